"""The whole loop on one machine: operator, node agents, stand-in NVML and a replayed verl job.

``FullStack`` runs, against a real API server (the dev cluster):

* the operator as a local process (``python -m rlenergy_operator --standalone``);
* one node agent per fake GPU node as a local process (``python -m rlenergy_agent --backend
  nvml``) whose pynvml loads the stand-in ``libnvidia-ml.so.1`` (``LD_LIBRARY_PATH``), each with
  its own state file played by a ``StandinDriver`` (8 simulated GPUs per node);
* a simulated trainer, one rank per node, replaying a real verl trace through the trainer SDK
  (``rlenergy.sdk.verl.RLEnergyVerlCallback``) to the agents' Unix sockets. Each rank is a
  real pod object on its KWOK node (``trainer-<node>``) and signals with a token the API
  server bound to that pod (``rlenergy_dev.devcluster.trainers``); the agents check it by
  TokenReview, as on a real node.

The trainer closes the loop the way ``rlenergy.sim.job`` runs a phase: each rank's work
fraction advances, tick by tick, at ``1 / time_factor`` of the SM clock its GPUs actually run
(the lock the agent holds right now, read back from the stand-in), so a probed phase's progress
follows the agent's slice-by-slice locks; the rank reports its cumulative progress to the agent
every tick (``progress_total``) and signals the end of the phase when its work is done (ranks
end a probed phase at slightly different times, like rollout workers). Time is divided by
``compress`` so that minutes of RL become about a second per phase, long enough for in-phase
probes (EE-RL slices need phases of at least 8 x 25 ms); the simulated GPUs' energy counters
advance in real time at the simulator's power for the running clock. The trainer advances the
counters itself, on its own thread, so a phase boundary signalled to the agent and the truth's
phase label switch happen between the same two counter updates: the simulator's truth per
(node, step, phase) is exact and the agents' measured windows must match it.

Before each step the trainer waits until the operator published the plan for that step and
every agent holds it (``rlenergy_agent_plan_step`` on the agent's /metrics), so a run is
reproducible; a real trainer never waits (agents apply whatever plan they hold).

Callers: ``tests/e2e/test_full_stack.py`` and ``rlenergy_dev.demo`` (``make demo``).
Everything listens on and dials 127.0.0.1 only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from rlenergy_agent import kube

import rlenergy_dev
from rlenergy.api import node as api_node
from rlenergy.control.freq import aggregate, probe
from rlenergy.gpu import models
from rlenergy.sdk import trainer as sdk_trainer
from rlenergy.sdk import verl as sdk_verl
from rlenergy.sdk import verl_hook
from rlenergy.sim import job as sim_job
from rlenergy.sim import traces, workload
from rlenergy_dev import standin
from rlenergy_dev.devcluster import trainers
from rlenergy_dev.podtrainer import tail_label

DEFAULT_TRACE = "verl-gpg-qwen2-7b-fsdp-8gpu"
PHASES = ("generation", "training")
TICK_S = 0.01
"""Counter update period of the simulated GPUs between phases, s."""
PHASE_TICK_S = 0.004
"""Counter update and progress report period while a phase runs, s (probe slices are 25 ms
or longer; the clock is read back every tick)."""
LONGEST_PHASE_S = 1.5
"""Real seconds of the longer mean phase at the default governor (about 0.55 s of generation
and 1.5 s of training on the default trace: two and six probe blocks per trial step)."""


def compressed_replay(
    trace: str, sku: models.GpuSku, steps: int, num_gpus: int, longest_phase_s: float
) -> tuple[sim_job.Job, float]:
    """A replay of ``trace`` on ``num_gpus`` GPUs, time-compressed.

    Returns:
        (the job, the compression factor): the longer mean phase at the default governor
        lasts ``longest_phase_s`` seconds of real time.
    """
    replay = workload.from_trace(traces.load_trace(trace), sku, steps)
    full = sim_job.Job(replay, sku, "sync", num_gpus=num_gpus)
    means = [
        sum(full.phase_truth(s, ph, None)[0] for s in replay.steps) / len(replay.steps)
        for ph in PHASES
    ]
    factor = max(means) / longest_phase_s

    def squeeze(s: workload.StepWork) -> workload.StepWork:
        return dataclasses.replace(
            s,
            phases=tuple(
                dataclasses.replace(p, boost_time_s=p.boost_time_s / factor) for p in s.phases
            ),
            other_time_s=s.other_time_s / factor,
        )

    fast = dataclasses.replace(replay, steps=tuple(squeeze(s) for s in replay.steps))
    return sim_job.Job(fast, sku, "sync", num_gpus=num_gpus), factor


@dataclasses.dataclass
class NodeAgent:
    """One node: its simulated GPUs, its agent process and the trainer rank on it."""

    node: str
    uuids: list[str]
    driver: standin.StandinDriver
    socket: Path
    log: Path
    proc: subprocess.Popen[str] | None = None
    metrics_port: int = 0
    callback: sdk_verl.RLEnergyVerlCallback | None = None
    pod: trainers.TrainerPod | None = None
    """The trainer rank's pod object and token (made by ``start_agents``)."""

    def plan_step(self) -> int:
        """The step of the plan the agent holds (-1: none)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback only
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("rlenergy_agent_plan_step{"):
                return int(float(line.rsplit(" ", 1)[1]))
        return -1

    def locked_mhz(self) -> int | None:
        """The SM clock the agent locked on this node's GPUs (None: default governor)."""
        locks = {
            int(self.driver.gpu(u).lock_max_mhz) if self.driver.gpu(u).locked else None
            for u in self.uuids
        }
        if len(locks) != 1:
            raise AssertionError(f"{self.node}: GPUs locked differently: {locks}")
        return locks.pop()


@dataclasses.dataclass
class StepTruth:
    """What the simulator knows about one replayed step."""

    step: int
    clocks_mhz: dict[str, int | None]
    """Lock at the phase's start on the first node (a probe's first slice)."""
    seconds: dict[str, float]
    joules: dict[tuple[str, str], float]
    """(node, phase) -> true energy over the node's GPUs, J."""
    locks_seen: dict[str, set[int | None]] = dataclasses.field(default_factory=dict)
    """Every lock a phase ran under on any node (more than one: the phase was probed)."""
    work_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """When the slowest rank's work was done, from the phase's start, s (``seconds`` less the
    trainer's last tick past it)."""
    default_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """The phase's time under the default governor on the same step (same noise), s."""
    default_joules: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    """(node, phase) -> the node's GPUs' energy for the phase under the default governor, J
    (the work's, plus the same idle tail of the trainer's last tick: ``tail_label``)."""


class FullStack:
    """Operator + 3 agents + a replayed verl job on the dev cluster.

    Args:
        kubeconfig: the dev cluster's admin kubeconfig.
        namespace: namespace of the policy, its reports and the agent DaemonSet.
        policy: the ``RLEnergyPolicy`` name the agents report for.
        nodes: fake GPU node names (one agent each).
        workdir: folder for state files, sockets and logs.
        lib_dir: folder holding the stand-in ``libnvidia-ml.so.1``.
        gpus_per_node: simulated GPUs per node.
        sku: simulated GPU model.
        python: interpreter for the operator and agent processes.
        operator_env: extra ``RLENERGY_OPERATOR_*`` settings.
    """

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        policy: str,
        nodes: Sequence[str],
        workdir: Path,
        lib_dir: Path,
        *,
        gpus_per_node: int = 8,
        sku: str = "h100-sxm",
        python: str = sys.executable,
        operator_env: Mapping[str, str] | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.policy = policy
        self.workdir = workdir
        self.lib_dir = lib_dir
        self.sku = models.get_sku(sku)
        self.python = python
        self.operator_env = dict(operator_env or {})
        self.operator: subprocess.Popen[bytes] | None = None
        self.operator_log = workdir / "operator.log"
        workdir.mkdir(parents=True, exist_ok=True)
        self.agents: list[NodeAgent] = []
        for node in nodes:
            uuids = [f"GPU-{node}-{i:02d}" for i in range(gpus_per_node)]
            driver = standin.StandinDriver(
                workdir / f"nvml-{node}.state", [(u, self.sku) for u in uuids]
            )
            self.agents.append(
                NodeAgent(
                    node, uuids, driver, workdir / f"{node}.sock", workdir / f"agent-{node}.log"
                )
            )
        self._api: Any = None
        self._files: list[IO[Any]] = []
        self.phase_ticks_s: list[float] = []
        """Every trainer tick inside a phase, s (``PHASE_TICK_S`` on an idle machine; longer
        ticks book more time at the clock read at their end, which the agents' slices see)."""

    # ----- processes ------------------------------------------------------------------------
    def start_operator(self) -> None:
        """Start the operator (standalone, cluster-wide) as a local process."""
        env = {
            **rlenergy_dev.source_env(os.environ),
            "KUBECONFIG": str(self.kubeconfig),
            "RLENERGY_OPERATOR_NAMESPACE": self.namespace,
            "RLENERGY_OPERATOR_RECONCILE_INTERVAL_S": "0.5",
            "RLENERGY_OPERATOR_RESET_DEADLINE_S": "30",
            "RLENERGY_OPERATOR_RETRY_DELAY_S": "1",
            "RLENERGY_OPERATOR_WATCH_SERVER_TIMEOUT_S": "30",
            **self.operator_env,
        }
        out = self.operator_log.open("ab")
        self._files.append(out)
        self.operator = subprocess.Popen(
            [self.python, "-m", "rlenergy_operator", "--standalone"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def start_agents(self, *, timeout_s: float = 60.0) -> None:
        """Start one agent per node on the stand-in NVML; returns once each is listening."""
        kubectl = trainers.kubectl_for(self.kubeconfig)
        labels = self.selector_labels()
        for a in self.agents:
            if a.pod is None:  # a restarted agent keeps its trainer pod
                a.pod = trainers.create_trainer(
                    kubectl, self.namespace, f"trainer-{a.node}", a.node, self.workdir / "tokens",
                    labels=labels,
                )  # fmt: skip
            env = {
                **rlenergy_dev.source_env(os.environ),
                **a.driver.env(self.lib_dir),
                "KUBECONFIG": str(self.kubeconfig),
                "RLENERGY_AGENT_NAMESPACE": self.namespace,
                "RLENERGY_AGENT_STATIC_PODS": json.dumps({a.pod.static_key: a.uuids}),
                "RLENERGY_AGENT_SAMPLE_INTERVAL_S": "0.05",
                "RLENERGY_AGENT_PLAN_POLL_S": "0.1",
                "RLENERGY_AGENT_REPORT_INTERVAL_S": "0.1",
            }
            err = a.log.open("a")
            self._files.append(err)
            a.proc = subprocess.Popen(
                [
                    self.python,
                    "-m",
                    "rlenergy_agent",
                    "--node",
                    a.node,
                    "--backend",
                    "nvml",
                    "--policy",
                    self.policy,
                    "--socket",
                    str(a.socket),
                    "--state-dir",
                    str(self.workdir / "agent-state"),
                    "--metrics-port",
                    "0",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        deadline = time.monotonic() + timeout_s
        for a in self.agents:
            assert a.proc is not None and a.proc.stdout is not None
            line = a.proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError(f"agent on {a.node} did not start:\n{self.agent_output(a)}")
            a.metrics_port = int(json.loads(line)["metricsPort"])
            assert a.pod is not None
            client = sdk_trainer.RLEnergyClient(
                str(a.socket), strict=True, timeout_s=10.0, token_file=str(a.pod.token_file)
            )
            a.callback = sdk_verl.RLEnergyVerlCallback(client)

    def agent_output(self, a: NodeAgent) -> str:
        """The agent's log so far."""
        return a.log.read_text(errors="replace") if a.log.exists() else ""

    def stop_agents(self) -> None:
        """SIGTERM every agent (each resets its locks on the way out)."""
        for a in self.agents:
            if a.callback is not None:
                a.callback.client.close()
            if a.proc is not None and a.proc.poll() is None:
                a.proc.send_signal(signal.SIGTERM)
        for a in self.agents:
            if a.proc is not None:
                try:
                    a.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    a.proc.kill()
                    a.proc.wait(timeout=5)
                if a.proc.stdout is not None:
                    a.proc.stdout.close()

    def stop_operator(self) -> None:
        """SIGTERM the operator."""
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(timeout=5)

    def close(self) -> None:
        """Stop everything this object started and unmap the state files."""
        self.stop_agents()
        self.stop_operator()
        for a in self.agents:
            a.driver.close()
        for f in self._files:
            f.close()

    def __enter__(self) -> FullStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- plan synchronisation -------------------------------------------------------------
    def selector_labels(self) -> dict[str, str]:
        """The policy's ``spec.selector.matchLabels`` ({} while it does not exist).

        The trainer pods carry them, as a job's pods do, so the operator reads their nodes'
        reports (it ignores the reports of nodes that host none of the policy's pods).
        """
        selector = (self._policy().get("spec") or {}).get("selector") or {}
        return {str(k): str(v) for k, v in (selector.get("matchLabels") or {}).items()}

    def policy_status(self) -> dict[str, Any]:
        """The policy's ``status`` (empty when the policy is missing)."""
        return dict(self._policy().get("status") or {})

    def _policy(self) -> dict[str, Any]:
        """The policy object as the API server holds it ({} when it is missing)."""
        if self._api is None:
            self._api = kube.load_api(str(self.kubeconfig))
        try:
            obj = self._api.get_namespaced_custom_object(
                kube.GROUP, kube.VERSION, self.namespace, kube.POLICY_PLURAL, self.policy
            )
        except kube.ApiException as exc:
            if exc.status == 404:
                return {}
            raise
        return dict(obj)

    def node_reports(self) -> list[dict[str, Any]]:
        """The policy's ``RLEnergyNodeReport`` objects as the API server holds them."""
        if self._api is None:
            self._api = kube.load_api(str(self.kubeconfig))
        listing = self._api.list_namespaced_custom_object(
            kube.GROUP, kube.VERSION, self.namespace, kube.REPORT_PLURAL
        )
        return [
            i
            for i in listing.get("items", [])
            if i.get("spec", {}).get("policyName") == self.policy
        ]

    def wait_plan(self, step: int, timeout_s: float = 60.0) -> None:
        """Wait until the operator planned ``step`` and every agent holds that plan."""
        deadline = time.monotonic() + timeout_s
        while (self.policy_status().get("plan") or {}).get("step", -1) < step:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no plan for step {step} after {timeout_s} s; status "
                    f"{json.dumps(self.policy_status())[:3000]}; reports (step, last, phases): "
                    + "; ".join(
                        f"{r['spec']['nodeName']}: last {r['spec'].get('lastStep')} "
                        + str([(x["step"], len(x["phases"])) for x in r["spec"].get("steps", [])])
                        for r in self.node_reports()
                    )
                )
            time.sleep(0.05)
        for a in self.agents:
            while a.plan_step() < step:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"agent on {a.node} never took the plan of step {step}")
                time.sleep(0.02)

    def _check_alive(self) -> None:
        if self.operator is not None and self.operator.poll() is not None:
            raise RuntimeError(f"the operator exited ({self.operator.returncode})")
        for a in self.agents:
            if a.proc is not None and a.proc.poll() is not None:
                raise RuntimeError(f"agent on {a.node} exited:\n{self.agent_output(a)[-3000:]}")

    # ----- the trainer ----------------------------------------------------------------------
    def _run_for(self, seconds: float) -> None:
        """Let ``seconds`` of real time pass with the GPUs' counters advancing."""
        start = last = time.monotonic()
        while True:
            now = time.monotonic()
            if now > last:
                for a in self.agents:
                    a.driver.advance(now - last)
                last = now
            left = start + seconds - now
            if left <= 0:
                return
            time.sleep(min(TICK_S, left))

    def apply_power_spread(self, job: sim_job.Job) -> dict[str, float]:
        """Give the nodes' GPUs, in order, the job's per-GPU power spread; returns it by UUID."""
        every = [u for a in self.agents for u in a.uuids]
        spread = dict(zip(every, job.power_spread, strict=False))
        for a in self.agents:
            for u in a.uuids:
                a.driver.set_power_spread(u, spread.get(u, 1.0))
        return spread

    def run_trainer(
        self,
        job: sim_job.Job,
        *,
        on_step: Callable[[StepTruth], None] | None = None,
        sync_plan: bool = True,
    ) -> list[StepTruth]:
        """Replay every step of ``job`` through the SDK, one rank per node.

        Args:
            job: the (time-compressed) job; its ``num_gpus`` should be nodes x GPUs per node.
            on_step: called after each step with its truth.
            sync_plan: wait for the operator's plan of each step before it starts.

        Returns:
            The simulator's truth per step.
        """
        spread = self.apply_power_spread(job)
        out: list[StepTruth] = []
        for step in job.replay.steps:
            s = step.index
            if sync_plan:
                self.wait_plan(s)
            truth = StepTruth(s, {}, {}, {})
            for phase in PHASES:
                label = f"{phase}-{s}"
                kind = step.phase(phase).kind
                started: dict[str, float] = {}
                for a in self.agents:
                    # Each rank's work starts at its own phase signal, as a verl worker's
                    # does: signalling every rank before any worked left the first ranks'
                    # GPUs idle for the later ranks' round trips inside their first probe
                    # slice (tests/unit/agent/test_status_truth.py, work-starts-late).
                    assert a.callback is not None
                    if phase == "generation":
                        a.callback.on_generation_start(s)
                    else:
                        a.callback.on_training_start(s)
                    started[a.node] = time.monotonic()
                    a.driver.set_work(a.uuids, kind, label)
                truth.clocks_mhz[phase] = _lock_of(self.agents[0])
                seconds, seen, work_s = self._run_phase(job, step, phase, label, started)
                truth.seconds[phase] = seconds
                truth.work_seconds[phase] = work_s
                truth.locks_seen[phase] = seen
                pw = step.phase(phase)
                default_s = truth.default_seconds[phase] = job.phase_truth(step, phase, None)[0]
                default_w = self.sku.power_w(pw.kind, self.sku.effective_clock_mhz(pw.kind, None))
                for a in self.agents:
                    tail_j = sum(a.driver.truth_j(u, tail_label(label)) for u in a.uuids)
                    truth.joules[(a.node, phase)] = (
                        sum(a.driver.truth_j(u, label) for u in a.uuids) + tail_j
                    )
                    truth.default_joules[(a.node, phase)] = (
                        default_w * default_s * sum(spread.get(u, 1.0) for u in a.uuids) + tail_j
                    )
                if phase == "generation":
                    self._run_for(step.other_time_s)  # reward, advantages: GPUs near idle
            out.append(truth)
            if on_step is not None:
                on_step(truth)
        return out

    def _run_phase(
        self,
        job: sim_job.Job,
        step: workload.StepWork,
        phase: str,
        label: str,
        started: Mapping[str, float],
    ) -> tuple[float, set[int | None], float]:
        """Run one phase on every rank until each finished its work (``sim.job._run_phase``).

        Per tick, a rank's work fraction advances by ``dt / T(f)``, ``T(f)`` the phase time at
        the lowest clock its GPUs run now (``dt`` from the rank's phase signal, ``started``
        by node, for its first tick); its cumulative progress (the phase's tokens along
        the phase's progress shape) goes to the agent. A rank that is done reports its final
        progress, signals the phase end and idles its GPUs.

        Returns:
            (the phase's time, the slowest rank, s; every lock seen on any node; when the
            slowest rank's work was done, s from its signal: its last tick less the overshoot).
        """
        pw = step.phase(phase)
        tokens = step.workload.phase_tokens(phase)
        times: dict[float, float] = {}

        def phase_time(clock: float) -> float:
            if clock not in times:
                times[clock] = job.phase_truth(step, phase, clock)[0]
            return times[clock]

        work = {a.node: 0.0 for a in self.agents}
        done_at: dict[str, float] = {}
        last_clock: dict[str, float] = {}
        seen: set[int | None] = set()
        start = last = time.monotonic()
        rank_last = dict(started)
        running = list(self.agents)
        while running:
            time.sleep(PHASE_TICK_S)
            now = time.monotonic()
            self.phase_ticks_s.append(now - last)
            last = now
            finished = []
            # Clocks in effect over the tick: every rank's read at once, right at the tick's
            # end and before any counter advances or report (reading each rank's clock after
            # the previous ranks' reports would book this tick at a lock the agent set after
            # it ended). A read racing the stand-in's lock write can see a half-written lock
            # (0 MHz): the tick then keeps the clock of the previous one.
            for a in running:
                clock = min(a.driver.clock_mhz(u) for u in a.uuids)
                if clock < self.sku.min_sm_clock_mhz:
                    clock = last_clock.get(a.node, float(self.sku.max_sm_clock_mhz))
                last_clock[a.node] = clock
                seen.add(_lock_of(a))
            for a in self.agents:
                dt = now - rank_last[a.node]
                rank_last[a.node] = now
                if a not in running:
                    a.driver.advance(dt)
                    continue
                clock = last_clock[a.node]
                left_s = (1.0 - work[a.node]) * phase_time(clock)
                if dt < left_s:
                    a.driver.advance(dt)
                    work[a.node] += dt / phase_time(clock)
                else:
                    # The work ends inside this tick: the GPUs idle for the rest of it (inside
                    # the agent's window until the signal; booked apart, ``tail_label``, as
                    # the default governor's run of the step would idle as long).
                    a.driver.advance(left_s)
                    a.driver.set_work(a.uuids, "idle", tail_label(label))
                    a.driver.advance(dt - left_s)
                    work[a.node] = 1.0
                assert a.callback is not None
                done = min(work[a.node], 1.0)
                # Stamped with the tick's end, when this total was counted: the later ranks'
                # reports leave after the earlier ranks' round trips (ms to tens of ms on a
                # loaded machine), and a stamp that late moves progress across slice
                # boundaries (tests/unit/agent/test_status_truth.py, "late stamps").
                a.callback.on_phase_progress(
                    tokens * workload.reported_progress(done, pw.progress_shape),
                    measured_at_s=now,
                )
                if work[a.node] >= 1.0:
                    finished.append(a)
                    done_at[a.node] = now - started[a.node] - (dt - left_s)
            for a in finished:
                assert a.callback is not None
                if phase == "generation":
                    a.callback.on_generation_end(step.index)
                else:
                    a.callback.on_step_end(step.index, trained_workload(step))
                a.driver.set_work(a.uuids, "idle", f"idle-{step.index}")
                running.remove(a)
        return last - start, seen, max(done_at.values(), default=last - start)


class PublishedRecords:
    """Every step record the agents published, by node and step: the reports read every 0.1 s.

    A node report holds only the records the operator has not folded yet (a record leaves at
    the agent's next write after the policy's ``totals.throughStep`` passed it,
    ``api_node.unfolded_steps``), so a test that checks records reads them while they are
    there. ``start`` (or a ``with`` block) starts the reads, ``stop`` ends them after one more.

    Args:
        node_reports: the policy's reports as the API server holds them
            (``FullStack.node_reports``).
        interval_s: time between reads, s.
    """

    def __init__(
        self, node_reports: Callable[[], list[dict[str, Any]]], interval_s: float = 0.1
    ) -> None:
        self.node_reports = node_reports
        self.interval_s = interval_s
        self._records: dict[str, dict[int, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="published-records", daemon=True)

    def start(self) -> PublishedRecords:
        """Start the reads; returns self."""
        self._thread.start()
        return self

    def __enter__(self) -> PublishedRecords:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def records(self) -> dict[str, dict[int, dict[str, Any]]]:
        """Node -> step -> the record as last read (a copy)."""
        with self._lock:
            return {node: dict(by_step) for node, by_step in self._records.items()}

    def read(self) -> None:
        """Read the reports once (an API error is left for the next read)."""
        try:
            reports = self.node_reports()
        except Exception:  # noqa: BLE001 - an API hiccup: the next read comes in interval_s
            return
        with self._lock:
            for r in reports:
                spec = r.get("spec") or {}
                by_step = self._records.setdefault(str(spec.get("nodeName")), {})
                for rec in spec.get("steps") or ():
                    by_step[int(rec["step"])] = rec

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.read()

    def stop(self) -> dict[str, dict[int, dict[str, Any]]]:
        """End the reads (one more first); the records by node and step."""
        if not self._stop.is_set():
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join(timeout=30)
            self.read()
        return self.records


def _lock_of(a: NodeAgent) -> int | None:
    """The lock on a node's first GPU (GPUs may differ for an instant while the agent switches)."""
    g = a.driver.gpu(a.uuids[0])
    return int(g.lock_max_mhz) if g.locked else None


def trained_workload(step: workload.StepWork) -> verl_hook.TrainedBatch:
    """The replayed step's token workload, as ``verl_hook.trained_batch`` counts a real batch.

    The trace gives the step's samples and tokens (verl's logged ``response_length/mean`` etc.
    times the batch, ``rlenergy.sim.traces``): no tensors to count here.
    """
    w = step.workload
    return verl_hook.TrainedBatch(
        samples=w.samples,
        aborted_samples=0,
        valid_tokens=w.valid_tokens,
        response_tokens=w.response_tokens,
        prompt_tokens=w.prompt_tokens,
    )


def probe_block_errors(
    job: sim_job.Job, step: workload.StepWork, windows: Sequence[api_node.PhaseWindowReport]
) -> list[tuple[str, int, int, float, float]]:
    """(phase, step, clock MHz, block ratio, true ratio) of each probe block in ``windows``.

    The blocks ``probe.blocks_from_slices`` makes of the slices as a node report gives them to
    the operator, each credited to the clock its candidate slices ran (a cap below the lock,
    ``effective_clock_mhz``); the truth is the default governor's time of ``step``'s phase over
    its time at that clock (``sim_job.Job.phase_truth``). Callers: tests/unit/agent/
    test_status_truth.py and tests/e2e/test_full_stack.py.
    """
    out = []
    for w in windows:
        slices = [aggregate.probe_slice(s) for s in w.slices]
        t_default = job.phase_truth(step, w.phase, None)[0]
        for clock, ratio, _ in probe.blocks_from_slices(slices)[0]:
            true = t_default / job.phase_truth(step, w.phase, clock)[0]
            out.append((w.phase, step.index, clock, round(ratio, 4), round(true, 4)))
    return out
