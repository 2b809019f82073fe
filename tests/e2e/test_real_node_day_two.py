"""Day two on the real node: a kubelet restart, a rolled agent DaemonSet, a re-created pod.

One real-node dev cluster for the module (``DevCluster.start(real_node=True)``, as
tests/e2e/test_real_node.py brings it up: the chart with the real images, eight stand-in GPUs
advertised by NVIDIA's device plugin (``cdi-cri``), the agent under the RuntimeClass ``nvidia``), one policy.
The trainer pods run ``SIGNALLER`` in the agent image: the SDK (``RLEnergyClient``, strict)
over the agent's socket with the pod's projected token, generation and training phases with
progress reports and a step end; every signal's outcome is appended, with its wall time, to a
JSON-lines file in the pod's hostPath work folder, which the test reads. A trainer also copies
its token there and stays in its phase, still reporting progress, while a ``hold`` file is in
that folder. The kubelet case needs a phase the controller has locked, so its trainer runs
1.5 s phases with a report every 20 ms: fine enough for in-phase probe slices, which decide a
trial within a few steps; 0.5 s phases with reports every 0.1 s resolve no slice, and their
whole-step trials, eight steps a probe block under the default trial budget, had not locked a
phase after 300 s on a busy machine. We test these aspects:

* the kubelet restarted (SIGTERM, 2 s down, same command line) while the controller's lock is
  held: every 10 ms sample of the trainer's GPUs shows that lock throughout (no reset by the
  restart itself), the agent pod is not restarted, the trainer's accepted signals never pause
  for more than 10 s, and afterwards, with the locked phase held again, the agent's
  ``/metrics`` name the lock its GPUs hold (the node report is written as steps end, and a
  held phase ends none);
* the agent DaemonSet rolled (``kubectl rollout restart``: a template annotation) while two
  trainer pods signal: neither pod's accepted signals pause for more than 10 s, no GPU outside
  the two pods is ever locked, and after both pods are deleted every GPU is back at the
  default governor within 10 s (no lock left without an owner);
* a trainer pod deleted and re-created under its name: the old pod's token (valid, in the
  agent's cache a moment before) is refused for the new pod's GPUs from its first use and for
  longer than the agent's review cache lives, while the new pod's own first signal is accepted.
* GPUs allocated through DRA: Kubernetes' DRA test driver runs as a kubelet plugin of the node
  (``RealNode.start_dra_driver``) and publishes its devices in a ResourceSlice; two trainer pods
  each get one device through a ResourceClaim of a DeviceClass selecting that driver, and no
  ``nvidia.com/gpu``. The kubelet's PodResources names each pod's device under
  ``dynamic_resources`` (read here with the agent's own client); the agent, with
  ``agent.draIndexDrivers`` naming the driver, maps each device to the stand-in GPU of its index,
  accepts the pods' signals and locks that GPU while they signal (its ``/metrics`` name the same
  lock), locks no other GPU, refuses the second pod's signal naming the first pod's GPU (403)
  while accepting its own, and resets both GPUs within 10 s of the pods' deletion.

Figures (signal gaps, restart and roll times) are printed and written to
``build/realnode-day-two.json``; a failed kubelet case leaves the agent's, the operator's and
the kubelet's logs, the pods, events, node reports and policy in ``build/realnode-day-two/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import (
    get_json,
    gpu_locks,
    pod_ready,
    pods_of,
    real_node_cluster,
    real_node_values,
    start_nvidia_device_plugin,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families
from rlenergy_agent import dra, podmap
from rlenergy_dev import podtrainer, standin
from rlenergy_dev.devcluster import DevCluster, draplugin
from rlenergy_dev.devcluster.nvidiaplugin import NvidiaDevicePlugin
from rlenergy_dev.devcluster.realnode import RealNode
from test_real_node import (
    CHART,
    GPUS,
    IMAGES,
    RELEASE,
    RESET_BOUND_S,
    ROOT,
    SAMPLE,
    SYSTEM_NS,
    _trainer_pod,
)

from rlenergy.gpu import models
from rlenergy.sdk import trainer

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(900)]

NS = "team-day-two"
AGENT_SELECTOR = "app.kubernetes.io/name=rlenergy-node-agent"
AGENT_DS = "rlenergy-node-agent"
OPERATOR_SELECTOR = "app.kubernetes.io/component=operator"
SIGNAL_GAP_BOUND_S = 10.0
"""Longest pause of a trainer's accepted signals a kubelet restart or an agent roll may cause, s."""
KUBELET_DOWN_S = 2.0
"""Time between the old kubelet's exit and the new one's start, s (a service manager's restart)."""
AFTER_S = 10.0
"""How long signals and locks are watched after the event settled, s."""
STEADY_S = 2.0
"""How long a held phase's lock must stay put before the kubelet is restarted, s."""
HOLD_TRIES = 6
LOCK_WAIT_S = 180.0
"""How long the controller may take to lock a phase of the kubelet case's trainer, s (19.1-19.5 s
from its first signal in six runs at load average 4-8: 2 warm-up steps and a trial round of
in-phase probes, on 3 s steps)."""
RESULTS = ROOT / "build" / "realnode-day-two.json"
DIAGNOSTICS = ROOT / "build" / "realnode-day-two"
"""Where a failed case leaves the agent's log, the kubelet's, the trainer pods and the events."""

SIGNALLER = r"""
import json, os, shutil, sys, time
from rlenergy.sdk import trainer

PHASE_S, REPORT_S = float(sys.argv[1]), float(sys.argv[2])
W = "/var/run/rlenergy-work"
shutil.copy("/var/run/secrets/rlenergy/token", W + "/token")
client = trainer.RLEnergyClient(strict=True)
out = open(W + "/signals.jsonl", "a", buffering=1)
work = open(W + "/work.jsonl", "ab", buffering=0)


def send(what, fn, *args, **kw):
    t0 = time.time()
    try:
        fn(*args, **kw)
        ok, status = True, 200
    except trainer.AgentRefusedError as exc:
        ok, status = False, exc.status
    except OSError as exc:
        ok, status = False, type(exc).__name__
    out.write(json.dumps({"t": t0, "s": time.time() - t0, "what": what, "ok": ok,
                          "status": status}) + "\n")


step = 0
while True:
    step += 1
    for phase in ("generation", "training"):
        send(phase, client.phase, phase, step=step)
        work.write((json.dumps({"kind": phase, "label": phase, "at": time.monotonic()})
                    + "\n").encode())
        t0 = time.monotonic()
        while time.monotonic() - t0 < PHASE_S or os.path.exists(W + "/hold"):
            time.sleep(REPORT_S)
            send("progress", client.progress_total, 1000.0 * (time.monotonic() - t0))
    send("step", client.end_step, step, samples=64, response_tokens=64000.0,
         prompt_tokens=16000.0, valid_tokens=64000.0)
"""
"""The trainer pods' program (the agent image's Python and SDK; no verl: these cases are about
signals and locks, not the workload). Arguments: the phase length and the time between progress
reports, s. Its progress runs at 1000 units/s whatever the SM clock (a phase bound elsewhere than
the SMs), so every clock keeps the throughput and EE-RL locks the allowed clock of least power."""
SIGNAL_PHASE_S, SIGNAL_REPORT_S = 0.5, 0.1
"""The rollout and re-created-pod trainers' phase length and report period, s."""
LOCK_PHASE_S, LOCK_REPORT_S = 1.5, 0.02
"""The kubelet case's trainer: phase length and report period, s. Probe slices must span
``eerl.SLICE_PER_PROGRESS_GAP`` report gaps and a probe block is ``probe.BLOCK`` slices, so a
phase needs at least 8 x 4 report gaps (0.64 s at 20 ms; 1.5 s leaves room for reports slowed
to 45 ms by a busy machine)."""


@dataclasses.dataclass
class Day:
    """The module's cluster and what the chart install left running."""

    cluster: DevCluster
    node: RealNode
    driver: standin.StandinDriver
    plugin: NvidiaDevicePlugin
    work: Path
    socket_dir: Path
    labels: dict[str, str]
    policy: str
    figures: dict[str, Any]
    metrics_port: int
    """The agent's ops port (``/metrics``) on the node's 127.0.0.1 (hostNetwork)."""


@contextlib.contextmanager
def _diagnostics(d: Day, case: str) -> Iterator[None]:
    """On a failure inside, write what explains it to ``DIAGNOSTICS / case``."""
    try:
        yield
    except BaseException:
        out = DIAGNOSTICS / case
        out.mkdir(parents=True, exist_ok=True)
        c = d.cluster
        for name, args in {
            "agent.log": ("logs", "-n", SYSTEM_NS, "-l", AGENT_SELECTOR, "--tail=-1"),
            "operator.log": ("logs", "-n", SYSTEM_NS, "-l", OPERATOR_SELECTOR, "--tail=-1"),
            "pods.yaml": ("get", "pods", "-A", "-o", "yaml"),
            "events.txt": ("get", "events", "-A", "--sort-by=.lastTimestamp"),
            "reports.yaml": ("get", "rlenergynodereports", "-A", "-o", "yaml"),
            "policy.yaml": ("get", "rlep", "-A", "-o", "yaml"),
        }.items():
            res = c.kubectl(*args, check=False, timeout=60)
            (out / name).write_text(res.stdout + res.stderr)
        if d.node.kubelet is not None:
            (out / "kubelet.log").write_text(Path(d.node.kubelet.log).read_text(errors="replace"))
        if d.plugin.log.exists():
            (out / "device-plugin.log").write_text(d.plugin.log.read_text(errors="replace"))
        raise


def _agent(c: DevCluster) -> dict[str, Any]:
    return wait_until(
        lambda: [p for p in pods_of(c, SYSTEM_NS, AGENT_SELECTOR) if pod_ready(p)],
        timeout=180,
        what="a Ready agent pod",
    )[0]


@pytest.fixture(scope="module")
def day(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Day]:
    """The real node, the chart installed with the real images, the policy, the agent Ready."""
    t_start = time.monotonic()
    c = real_node_cluster("the day-two real-node e2e test")
    figures: dict[str, Any] = {"cluster_start_s": c.timings}
    with c:
        assert c.real_node is not None
        node = c.real_node
        work = tmp_path_factory.mktemp("day-two")
        for name in ("rl-energy-operator", "rl-energy-agent"):
            archive = IMAGES / f"{name}.oci.tar"
            if not archive.is_file():
                pytest.fail(f"{archive} missing: build the images with `make images`")
            node.import_image(archive)
        lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
        state = work / "nvml" / "nvml.state"
        state.parent.mkdir()
        uuids = [f"GPU-daytwo-{i:02d}" for i in range(GPUS)]
        sku = models.get_sku("h100-sxm")
        driver = standin.StandinDriver(state, [(u, sku) for u in uuids])
        driver.start()  # the counters run in real time (a case's WorkFeed takes over meanwhile)
        node.write_cdi_spec(lib_dir / "libnvidia-ml.so.1", state, uuids)
        plugin = start_nvidia_device_plugin(node, driver, lib_dir)
        try:
            values = real_node_values(c, node, work)
            values["agent"]["draIndexDrivers"] = [draplugin.DRIVER]  # the DRA case's devices
            (work / "values.json").write_text(json.dumps(values))
            c.helm(
                "install", RELEASE, str(CHART), "-n", SYSTEM_NS, "--create-namespace",
                "-f", str(work / "values.json"), "--wait", "--timeout", "180s", timeout=240,
            )  # fmt: skip
            c.kubectl("create", "namespace", NS)
            # _trainer_pod mounts the replay ConfigMap of the verl trainer; these pods read none.
            c.kubectl("create", "configmap", "trainer-replay", "-n", NS)
            policy = yaml.safe_load(SAMPLE.read_text())
            policy["spec"]["controller"] = {"warmupSteps": 2, "trialSteps": 4}
            c.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(policy))
            _agent(c)
            figures["bring_up_s"] = round(time.monotonic() - t_start, 1)
            yield Day(
                c, node, driver, plugin, work, Path(values["agent"]["socketDir"]),
                dict(policy["spec"]["selector"]["matchLabels"]), policy["metadata"]["name"],
                figures, int(values["agent"]["metricsPort"]),
            )  # fmt: skip
            c.kubectl("delete", "rlep", policy["metadata"]["name"], "-n", NS, "--timeout=90s",
                      timeout=120)  # fmt: skip
            c.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "120s",
                   timeout=180)  # fmt: skip
            assert set(gpu_locks(driver, driver.uuids).values()) == {None}
        finally:
            plugin.stop()
            figures["module_wall_s"] = round(time.monotonic() - t_start, 1)
            RESULTS.parent.mkdir(exist_ok=True)
            RESULTS.write_text(json.dumps(figures, indent=2, default=str))
            print(json.dumps(figures, indent=2, default=str))
            driver.close()


@dataclasses.dataclass
class Trainer:
    """A signalling trainer pod: its name, host work folder and the GPUs it was allocated."""

    name: str
    work: Path
    gpus: tuple[str, ...]

    def signals(self) -> list[dict[str, Any]]:
        """Every signal the pod made so far (``SIGNALLER``'s records, complete lines only)."""
        path = self.work / "signals.jsonl"
        if not path.exists():
            return []
        text = path.read_text()
        return [json.loads(ln) for ln in text[: text.rfind("\n") + 1].splitlines() if ln]

    def accepted_since(self, t: float) -> int:
        return sum(1 for r in self.signals() if r["ok"] and r["t"] >= t)

    def hold(self, on: bool) -> None:
        """Keep the pod in its current phase (still reporting progress) while ``on``."""
        flag = self.work / "hold"
        if on:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)


def _signaller(phase_s: float = SIGNAL_PHASE_S, report_s: float = SIGNAL_REPORT_S) -> list[str]:
    """The command of a ``SIGNALLER`` pod with phases of ``phase_s`` and reports every ``report_s``."""
    return ["python3", "-c", SIGNALLER, str(phase_s), str(report_s)]


def _start_trainer(d: Day, name: str, folder: str, command: list[str] | None = None) -> Trainer:
    """Create a ``SIGNALLER`` pod with 2 GPUs; wait for its allocation and its first signal."""
    work = d.work / folder
    n = len(d.plugin.allocations)
    pod = _trainer_pod(name, NS, d.labels, d.socket_dir, work, command or _signaller(), 2)
    d.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    wait_until(lambda: len(d.plugin.allocations) > n, timeout=60, what=f"{name}'s allocation")
    gpus = d.plugin.allocations[n]
    t = Trainer(name, work, gpus)

    def signalled() -> bool:
        phase = get_json(d.cluster, "pod", name, "-n", NS)["status"].get("phase")
        assert phase in ("Pending", "Running"), (
            phase, d.cluster.kubectl("logs", "-n", NS, name, check=False).stdout[-3000:]
        )  # fmt: skip
        return t.accepted_since(0.0) > 0

    wait_until(signalled, timeout=180, interval=0.5, what=f"{name}'s first accepted signal")
    return t


def _delete(d: Day, *trainers: Trainer) -> float:
    """Delete the pods; their GPUs must be back at the default governor within 10 s.

    Returns:
        Seconds from the delete to the last of their GPUs reset.
    """
    t0 = time.monotonic()
    for t in trainers:
        t.hold(False)
        d.cluster.kubectl("delete", "pod", t.name, "-n", NS, "--wait=false")
    gpus = tuple(g for t in trainers for g in t.gpus)
    wait_until(
        lambda: set(gpu_locks(d.driver, gpus).values()) == {None},
        timeout=RESET_BOUND_S + 20, interval=0.05, what="the deleted trainers' GPUs reset",
    )  # fmt: skip
    took = time.monotonic() - t0
    assert took <= RESET_BOUND_S, (took, [t.name for t in trainers])
    names = [t.name for t in trainers]
    wait_until(
        lambda: not [p for p in get_json(d.cluster, "pods", "-n", NS)["items"]
                     if p["metadata"]["name"] in names],
        timeout=120, what=f"pods {names} gone",
    )  # fmt: skip
    return took


def max_accepted_gap_s(records: list[dict[str, Any]], t0: float, t1: float) -> float:
    """Longest time in ``[t0, t1]`` (wall clock, s) without an accepted signal.

    The gaps counted: ``t0`` to the first accepted signal, between accepted signals, and the
    last one to ``t1`` (no accepted signal at all: ``t1 - t0``).
    """
    times = [t0, *sorted(float(r["t"]) for r in records if r["ok"] and t0 <= r["t"] <= t1), t1]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


class LockSampler:
    """Samples the stand-in locks of ``uuids`` every 10 ms on a thread: ``(time, locks)``."""

    def __init__(self, driver: standin.StandinDriver, uuids: tuple[str, ...]) -> None:
        self.samples: list[tuple[float, dict[str, int | None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(driver, uuids), name="lock-sampler", daemon=True
        )

    def _run(self, driver: standin.StandinDriver, uuids: tuple[str, ...]) -> None:
        while not self._stop.wait(0.01):
            self.samples.append((time.time(), gpu_locks(driver, uuids)))

    def __enter__(self) -> LockSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _gone(d: Day, t: Trainer) -> None:
    """``t``'s pod deleted (if still there) and its GPUs unlocked, as far as 60 s allow."""
    d.cluster.kubectl(
        "delete", "pod", t.name, "-n", NS, "--ignore-not-found", "--timeout=60s", check=False
    )
    deadline = time.monotonic() + 60
    while set(gpu_locks(d.driver, t.gpus).values()) != {None} and time.monotonic() < deadline:
        time.sleep(0.5)


def _agent_locks(d: Day, gpus: tuple[str, ...]) -> dict[str, int | None]:
    """The SM clock lock the agent holds on each of ``gpus``, as its ``/metrics`` says, MHz.

    ``rlenergy_agent_gpu_clock_locked`` 1 and the plan's requested
    ``rlenergy_agent_gpu_sm_clock_hertz``; None where it holds no lock.
    """
    url = f"http://127.0.0.1:{d.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - the node's loopback
        text = resp.read().decode()
    held: dict[str, bool] = {}
    requested: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            uuid = sample.labels.get("gpu_uuid")
            if uuid not in gpus:
                continue
            if sample.name == "rlenergy_agent_gpu_clock_locked":
                held[uuid] = sample.value == 1.0
            elif sample.name == "rlenergy_agent_gpu_sm_clock_hertz" and (
                sample.labels.get("kind") == "requested"
            ):
                requested[uuid] = round(sample.value / 1e6)
    return {u: requested.get(u) if held.get(u) else None for u in gpus}


def _locked_phase(d: Day) -> tuple[str, int]:
    """A phase the controller has settled on a clock (``state: locked``): (name, clock MHz)."""

    seen: list[dict[str, Any]] = []

    def locked() -> tuple[str, int] | None:
        status = get_json(d.cluster, "rlep", d.policy, "-n", NS).get("status", {})
        seen[:] = [
            {k: ph.get(k) for k in ("name", "state", "clockMHz", "probeEvidence")}
            for ph in status.get("phases") or ()
        ] + [{"steps": status.get("totals", {}).get("steps")}]
        for ph in status.get("phases") or ():
            if ph.get("state") == "locked" and ph.get("clockMHz"):
                return str(ph["name"]), int(ph["clockMHz"])
        return None

    try:
        return wait_until(locked, timeout=LOCK_WAIT_S, interval=1, what="a locked phase")
    except pytest.fail.Exception:
        pytest.fail(
            f"no phase locked by the controller after {LOCK_WAIT_S} s: {seen}", pytrace=False
        )


def _hold_a_steady_lock(d: Day, t: Trainer, feed: podtrainer.WorkFeed, phase: str) -> int:
    """Hold ``t`` in ``phase`` until its GPUs show one lock, unchanged for ``STEADY_S``.

    A step the controller probes runs its phase as slices at several clocks: such a phase is
    let go and the next one of that name is held, up to ``HOLD_TRIES`` times.

    Returns:
        The lock, MHz (the trainer is left held).
    """
    seen: list[set[int | None]] = []
    for _ in range(HOLD_TRIES):
        t.hold(False)
        wait_until(lambda: feed.kind != phase, timeout=60, interval=0.02, what=f"{phase} ends")
        wait_until(lambda: feed.kind == phase, timeout=60, interval=0.02, what=f"{phase} runs")
        t.hold(True)
        time.sleep(0.5)  # the phase signal's lock applied
        with LockSampler(d.driver, t.gpus) as sampler:
            time.sleep(STEADY_S)
        held = {v for _, locks in sampler.samples for v in locks.values()}
        seen.append(held)
        clocks = {v for v in held if v is not None}
        if len(held) == 1 and len(clocks) == 1:
            return clocks.pop()
    pytest.fail(f"no steady lock in {phase} after {HOLD_TRIES} tries: {seen}", pytrace=False)


def test_kubelet_restart_keeps_the_lock_and_the_signals(day: Day) -> None:
    d, fig = day, dict[str, Any]()
    d.figures["kubelet_restart"] = fig
    holder: list[tuple[str, ...]] = []
    d.driver.stop()  # the feed advances the counters while it runs
    feed = podtrainer.WorkFeed(
        d.driver, d.work / "steady" / "work.jsonl", lambda: holder[0] if holder else ()
    ).start()
    with contextlib.ExitStack() as cleanup, _diagnostics(d, "kubelet_restart"):
        cleanup.callback(d.driver.start)
        cleanup.callback(feed.stop)
        t = _start_trainer(d, "steady", "steady", _signaller(LOCK_PHASE_S, LOCK_REPORT_S))
        cleanup.callback(_gone, d, t)  # a failure here must not leave a lock to the next case
        holder.append(t.gpus)
        t_signal = time.monotonic()
        phase, _ = _locked_phase(d)
        fig["first_signal_to_locked_phase_s"] = round(time.monotonic() - t_signal, 1)
        lock = _hold_a_steady_lock(d, t, feed, phase)
        fig["phase"], fig["lock_mhz"] = phase, lock
        agent_uid = _agent(d.cluster)["metadata"]["uid"]
        registrations = d.plugin.registrations
        with LockSampler(d.driver, t.gpus) as sampler:
            time.sleep(1.0)
            t_restart = time.time()
            fig["kubelet_stop_s"] = round(d.node.restart_kubelet(down_s=KUBELET_DOWN_S), 2)
            wait_until(
                lambda: d.plugin.registrations > registrations,
                timeout=120, interval=0.1, what="the device plugin registered with the new kubelet",
            )  # fmt: skip
            fig["restart_to_plugin_registered_s"] = round(time.time() - t_restart, 2)
            time.sleep(AFTER_S)
            t_end = time.time()
        t.hold(False)

        off = [
            (round(ts - t_restart, 2), v) for ts, v in sampler.samples if set(v.values()) != {lock}
        ]
        fig["lock_samples"] = len(sampler.samples)
        assert not off, f"the lock {lock} MHz moved during the kubelet restart: {off[:5]}"
        gap = max_accepted_gap_s(t.signals(), t_restart - 1.0, t_end)
        fig["max_signal_gap_s"] = round(gap, 2)
        refused = [r for r in t.signals() if not r["ok"] and r["t"] >= t_restart - 1.0]
        fig["signals_refused"] = [(r["what"], r["status"]) for r in refused][:10]
        assert gap <= SIGNAL_GAP_BOUND_S, (gap, refused[:10])
        assert t.accepted_since(t_restart + KUBELET_DOWN_S) > 0

        # The agent pod kept running, and its live view (/metrics) names the lock the GPUs
        # hold. Not the node report: it is written when a step ends, and a held phase ends none.
        agent = _agent(d.cluster)
        assert agent["metadata"]["uid"] == agent_uid
        assert all(s.get("restartCount", 0) == 0 for s in agent["status"]["containerStatuses"])

        # Read while the lock cannot move: the locked phase held again (a phase held at random
        # may be a probe's, whose slices switch clocks all along).
        fig["lock_after_restart_mhz"] = _hold_a_steady_lock(d, t, feed, phase)
        try:
            wait_until(
                lambda: _agent_locks(d, t.gpus) == gpu_locks(d.driver, t.gpus),
                timeout=30, interval=0.5, what="the agent's /metrics naming the GPUs' lock",
            )  # fmt: skip
        finally:
            t.hold(False)
        fig["trainer_delete_to_reset_s"] = round(_delete(d, t), 2)


def test_agent_rollout_while_two_trainers_signal(day: Day) -> None:
    d, fig = day, dict[str, Any]()
    d.figures["agent_rollout"] = fig
    a = _start_trainer(d, "pair-a", "pair-a")
    b = _start_trainer(d, "pair-b", "pair-b")
    assert not set(a.gpus) & set(b.gpus), (a.gpus, b.gpus)
    others = tuple(u for u in d.driver.uuids if u not in a.gpus + b.gpus)
    old = _agent(d.cluster)
    with LockSampler(d.driver, others) as strays:
        time.sleep(2.0)
        t_roll = time.time()
        d.cluster.kubectl("rollout", "restart", f"ds/{AGENT_DS}", "-n", SYSTEM_NS)
        new = wait_until(
            lambda: [
                p for p in pods_of(d.cluster, SYSTEM_NS, AGENT_SELECTOR)
                if pod_ready(p) and p["metadata"]["uid"] != old["metadata"]["uid"]
            ],
            timeout=180, what="the rolled agent pod Ready",
        )[0]  # fmt: skip
        fig["roll_to_new_agent_ready_s"] = round(time.time() - t_roll, 1)
        fig["new_agent_pod"] = new["metadata"]["name"]
        d.cluster.kubectl(
            "rollout", "status", f"ds/{AGENT_DS}", "-n", SYSTEM_NS, "--timeout=120s",
            timeout=150,
        )  # fmt: skip
        t_ready = time.time()
        wait_until(
            lambda: a.accepted_since(t_ready) > 0 and b.accepted_since(t_ready) > 0,
            timeout=60, interval=0.2, what="both trainers' signals accepted by the new agent",
        )  # fmt: skip
        time.sleep(AFTER_S)
        t_end = time.time()
    gaps = {t.name: max_accepted_gap_s(t.signals(), t_roll - 1.0, t_end) for t in (a, b)}
    fig["max_signal_gap_s"] = {k: round(v, 2) for k, v in gaps.items()}
    fig["signals_refused"] = {
        t.name: [(r["what"], r["status"]) for r in t.signals() if not r["ok"]][:10] for t in (a, b)
    }
    stray = [(round(ts - t_roll, 2), v) for ts, v in strays.samples if set(v.values()) != {None}]
    assert not stray, f"GPUs outside the two trainers locked: {stray[:5]}"
    assert all(g <= SIGNAL_GAP_BOUND_S for g in gaps.values()), fig
    # No lock outlives its owner: the new agent resets the GPUs of both pods at their end.
    fig["trainers_delete_to_reset_s"] = round(_delete(d, a, b), 2)
    assert set(gpu_locks(d.driver, d.driver.uuids).values()) == {None}


def test_recreated_pod_refuses_the_old_token(day: Day) -> None:
    d, fig = day, dict[str, Any]()
    d.figures["recreated_pod"] = fig
    with _diagnostics(d, "recreated_pod"):
        old = _start_trainer(d, "again", "again-1")
        token = d.work / "old-token"
        token.write_bytes((old.work / "token").read_bytes())
        d.cluster.kubectl("delete", "pod", "again", "-n", NS, "--wait=true", timeout=120)
        t0 = time.monotonic()
        n = len(d.plugin.allocations)
        pod = _trainer_pod(
            "again", NS, d.labels, d.socket_dir, d.work / "again-2", _signaller(), 2,
        )  # fmt: skip
        d.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
        wait_until(lambda: len(d.plugin.allocations) > n, timeout=60, what="the new allocation")
        gpus = d.plugin.allocations[n]
        # The old token, from the host's side of the agent socket, naming the new pod's GPUs:
        # refused from its first use and past the agent's review cache (10 s).
        client = trainer.RLEnergyClient(
            str(d.socket_dir / "agent.sock"), strict=True, gpus=gpus, token_file=str(token)
        )
        answers: list[tuple[float, int | str]] = []
        while time.monotonic() - t0 < 15.0:
            try:
                client.phase("generation", step=1)
                answers.append((round(time.monotonic() - t0, 2), "ACCEPTED"))
            except trainer.AgentRefusedError as exc:
                answers.append((round(time.monotonic() - t0, 2), exc.status))
            time.sleep(0.25)
        client.close()
        fig["old_token_answers"] = sorted({a for _, a in answers}, key=str)
        fig["old_token_tries"] = len(answers)
        # Never taken; the first answer a refusal (401: the API server no longer accepts the
        # token; 403: the agent refuses its pod), not a 503 to retry.
        assert answers and answers[0][1] in (401, 403), answers[:10]
        assert all(a != "ACCEPTED" for _, a in answers), answers
        new = Trainer("again", d.work / "again-2", gpus)
        wait_until(lambda: new.signals(), timeout=180, interval=0.5, what="the new pod's signal")
        first = new.signals()[0]
        fig["new_pod_first_signal"] = first
        assert first["ok"], new.signals()[:5]
        fig["trainer_delete_to_reset_s"] = round(_delete(d, new), 2)


DEVICE_CLASS = "rlenergy-test-driver"
DRA_LOCK_WAIT_S = 180.0
"""How long a DRA trainer's GPU may take to show a lock from its first accepted signal, s (the
controller's warm-up steps and first trials, as ``LOCK_WAIT_S``)."""


def _dra_objects(names: list[str]) -> list[dict[str, Any]]:
    """A DeviceClass of the test driver's devices and one ResourceClaim of one device per name."""
    cls = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{draplugin.DRIVER}"'}}]},
    }
    claims = [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": DEVICE_CLASS, "count": 1}}
                    ]
                }
            },
        }
        for name in names
    ]
    return [cls, *claims]


def _start_dra_trainer(d: Day, name: str) -> Trainer:
    """A ``SIGNALLER`` pod holding the ResourceClaim ``name`` and no ``nvidia.com/gpu``.

    Waits for the claim's allocation; the trainer's GPU is the stand-in GPU of the allocated
    device's index (``device-NN``).
    """
    work = d.work / name
    pod = _trainer_pod(name, NS, d.labels, d.socket_dir, work, _signaller(), 0)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": name}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    d.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))

    def allocated() -> list[dict[str, Any]]:
        claim = get_json(d.cluster, "resourceclaim", name, "-n", NS)
        return list(((claim.get("status") or {}).get("allocation") or {}).get("devices", {})
                    .get("results") or [])  # fmt: skip

    (result,) = wait_until(allocated, timeout=60, what=f"{name}'s claim allocated")
    assert (result["driver"], result["pool"]) == (draplugin.DRIVER, d.node.name), result
    index = dra.index_of(result["device"])
    assert index is not None, result
    return Trainer(name, work, (d.driver.uuids[index],))


def test_dra_allocated_pods_are_governed(day: Day) -> None:
    d, fig = day, dict[str, Any]()
    d.figures["dra"] = fig
    c = d.cluster
    with contextlib.ExitStack() as cleanup, _diagnostics(d, "dra"):
        t0 = time.monotonic()
        plugin = d.node.start_dra_driver(kubeconfig=c.kubeconfig, num_devices=len(d.driver.uuids))
        cleanup.callback(plugin.stop)

        def published() -> list[dict[str, Any]]:
            return [
                s for s in get_json(c, "resourceslices")["items"]
                if s["spec"]["driver"] == draplugin.DRIVER and s["spec"].get("devices")
            ]  # fmt: skip

        (slice_,) = wait_until(published, timeout=60, what="the DRA driver's ResourceSlice")
        fig["driver_start_to_slice_s"] = round(time.monotonic() - t0, 1)
        assert [dev["name"] for dev in slice_["spec"]["devices"]] == [
            draplugin.device_name(i) for i in range(len(d.driver.uuids))
        ]
        c.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "List", "items": _dra_objects(["dra-a", "dra-b"]),
        }))  # fmt: skip
        cleanup.callback(
            c.kubectl, "delete", "deviceclass", DEVICE_CLASS, "--ignore-not-found", check=False
        )
        t_pods = time.monotonic()
        a = _start_dra_trainer(d, "dra-a")
        b = _start_dra_trainer(d, "dra-b")
        for t in (b, a):
            cleanup.callback(_gone, d, t)
        assert a.gpus != b.gpus, (a.gpus, b.gpus)
        fig["gpus"] = {"dra-a": a.gpus[0], "dra-b": b.gpus[0]}

        # The real kubelet's listing, read with the agent's own client: each pod's device under
        # dynamic_resources, mapped to its GPU by the index rule the chart value enables.
        sock = d.node.pod_resources_dir / "kubelet.sock"
        resolver = dra.DraResolver(None, dict(enumerate(d.driver.uuids)), [draplugin.DRIVER])
        client = podmap.PodResourcesClient(str(sock), dra_resolver=resolver)
        try:

            def both() -> dict[str, tuple[str, ...]] | None:
                got = {
                    p.name: g for p, g in client.refresh().items() if p.name in ("dra-a", "dra-b")
                }
                return got if len(got) == 2 else None

            listed = wait_until(
                both, timeout=60, interval=0.5, what="both DRA pods in the kubelet's PodResources"
            )
        finally:
            client.close()
        assert listed == {"dra-a": a.gpus, "dra-b": b.gpus}, listed

        others = tuple(u for u in d.driver.uuids if u not in a.gpus + b.gpus)
        with LockSampler(d.driver, others) as strays:
            for t in (a, b):
                wait_until(lambda t=t: t.accepted_since(0.0) > 0, timeout=180, interval=0.5,
                           what=f"{t.name}'s first accepted signal")  # fmt: skip
            fig["pods_to_first_signals_s"] = round(time.monotonic() - t_pods, 1)
            t_signal = time.monotonic()
            locked = wait_until(
                lambda: (lk := gpu_locks(d.driver, a.gpus)[a.gpus[0]]) is not None and lk,
                timeout=DRA_LOCK_WAIT_S, interval=0.05, what="dra-a's GPU locked",
            )  # fmt: skip
            fig["first_signal_to_lock_s"] = round(time.monotonic() - t_signal, 1)
            fig["lock_mhz"] = locked
            with LockSampler(d.driver, a.gpus) as window:  # several 0.5 s phases
                time.sleep(4.0)
            fig["locks_seen_mhz"] = sorted(
                {v for _, lk in window.samples for v in lk.values()}, key=lambda v: v or 0
            )
            wait_until(
                lambda: _agent_locks(d, a.gpus)[a.gpus[0]] is not None,
                timeout=30, interval=0.2, what="the agent's /metrics naming dra-a's lock",
            )  # fmt: skip

            # dra-b's token, from the host's side of the socket: dra-a's GPU refused, its own
            # accepted.
            token = b.work / "token"
            answers: dict[str, int | str] = {}
            for who, gpus in (("other", a.gpus), ("own", b.gpus)):
                tc = trainer.RLEnergyClient(
                    str(d.socket_dir / "agent.sock"), strict=True, gpus=gpus,
                    token_file=str(token),
                )  # fmt: skip
                try:
                    tc.phase("generation", step=1)
                    answers[who] = "ACCEPTED"
                except trainer.AgentRefusedError as exc:
                    answers[who] = exc.status
                finally:
                    tc.close()
            fig["dra_b_token_answers"] = answers
            assert answers == {"other": 403, "own": "ACCEPTED"}, answers
        stray = [v for _, v in strays.samples if set(v.values()) != {None}]
        assert not stray, f"GPUs outside the DRA pods locked: {stray[:5]}"
        # The agent read the node's ResourceSlices (its RBAC: resourceslices list) and fell back
        # to the index rule only because the test driver publishes no uuid attribute.
        log = c.kubectl("logs", "-n", SYSTEM_NS, "-l", AGENT_SELECTOR, "--tail=-1").stdout
        assert "ResourceSlices failed" not in log, log[-3000:]
        assert "listed this node's ResourceSlices: 0 device(s) with a uuid" in log, log[-3000:]
        refused = [r for t in (a, b) for r in t.signals() if not r["ok"]]
        fig["signals_refused"] = [(r["what"], r["status"]) for r in refused][:10]
        fig["signals_accepted"] = {t.name: t.accepted_since(0.0) for t in (a, b)}
        fig["trainers_delete_to_reset_s"] = round(_delete(d, a, b), 2)
        # The claims released (the resourceclaim controller) and deleted with their finalizer.
        t_del = time.monotonic()
        c.kubectl("delete", "resourceclaim", "dra-a", "dra-b", "-n", NS, "--timeout=60s",
                  timeout=90)  # fmt: skip
        fig["claims_delete_s"] = round(time.monotonic() - t_del, 1)
