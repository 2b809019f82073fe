"""The chaos harness: the real operator and real node agents (on the stand-in NVML) against the
dev cluster, a trainer driving them through the SDK, and the faults.

``Stack`` owns one namespace, one policy, ``len(nodes)`` agent processes (2 stand-in GPUs
each) and one or two operator processes. ``run_steps`` plays RL steps (generation, training,
end of step) on every node and snapshots the node reports after each step, so the energy of
every step record an agent ever published is known even when a restarted agent's report no
longer carries it. ``check_invariants`` is what every chaos test ends with:

* totals: ``status.totals`` equal the sum of the published step records (nothing lost, nothing
  double counted) and every step up to ``throughStep`` is either counted or a missed step;
* deletion: the policy's finalizer is lifted after the agents acknowledge the reset, every GPU
  is back at default clocks, the namespace goes away.

Nothing dials anything but 127.0.0.1; no ``kubectl logs/exec/port-forward``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rlenergy_dev import standin
from rlenergy_dev.devcluster import DevCluster, trainers
from rlenergy_dev.devcluster import process as dc_process

from rlenergy.gpu import models
from rlenergy.sdk import trainer

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
GPUS_PER_AGENT = 2
PHASE_S = 0.35
RESET_DEADLINE_S = 25
# One polling helper for the e2e and chaos suites (tests/ is a namespace package on pythonpath).
from tests.e2e.e2e_support import wait_until  # noqa: E402


# ----- control-plane faults --------------------------------------------------------------------
class Restarts:
    """Kills and restarts control-plane components with the same command line (same ports, same
    etcd data dir); keeps the replacement processes so they are stopped at the end."""

    def __init__(self, cluster: DevCluster) -> None:
        self.cluster = cluster
        self.current: dict[str, dc_process.ProcessRecord] = {}
        self.popens: dict[int, subprocess.Popen[bytes]] = {}

    def record(self, name: str) -> dc_process.ProcessRecord:
        if name in self.current:
            return self.current[name]
        return next(r for r in self.cluster.processes if r.name == name)

    def restart(
        self, name: str, *, sig: signal.Signals = signal.SIGKILL, down_s: float = 2.0
    ) -> float:
        """Kill ``name`` with ``sig``, keep it down ``down_s`` seconds, start it again.

        Returns:
            Seconds until the API server answers /readyz again.
        """
        rec = self.record(name)
        os.killpg(rec.pid, sig)
        deadline = time.monotonic() + 30
        while dc_process.is_alive(rec) and not _zombie(rec.pid):
            assert time.monotonic() < deadline, f"{name} did not exit on {sig.name}"
            time.sleep(0.05)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(rec.pid, os.WNOHANG)
        time.sleep(down_s)
        env = dict(os.environ)
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        t0 = time.monotonic()
        proc, new = dc_process.spawn(name, rec.argv, Path(rec.log), env=env)
        self.current[name] = new
        self.popens[new.pid] = proc
        wait_until(
            lambda: self.cluster.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
            timeout=120,
            interval=0.5,
            what=f"API server ready after restarting {name}",
        )
        return time.monotonic() - t0

    def stop(self) -> None:
        dc_process.terminate(list(self.current.values()), self.popens, grace=10)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# ----- processes ---------------------------------------------------------------------------------
class Proc:
    """A child process with its log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv, self.env, self.log = argv, env, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT)
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Agent:
    """One node agent process on its own stand-in NVML (2 GPUs) with one trainer rank."""

    def __init__(self, stack: Stack, node: str, lib_dir: Path) -> None:
        self.node = node
        self.work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rlchaos-"))  # short socket path
        self.uuids = [f"GPU-{node}-{i}" for i in range(GPUS_PER_AGENT)]
        self.driver = standin.StandinDriver(
            self.work / "state", [(u, models.get_sku("h100-sxm")) for u in self.uuids]
        )
        # the trainer rank: a real pod object on the node, labelled for the policy (the
        # operator reads only the reports of nodes hosting its pods), and a token bound to it
        self.pod = trainers.create_trainer(
            stack.cluster.kubectl, stack.namespace, f"trainer-{node}", node, self.work,
            labels={"app": stack.policy},
        )  # fmt: skip
        env = dict(os.environ)
        env.update(self.driver.env(lib_dir))
        env.update(
            {
                "KUBECONFIG": str(stack.cluster.kubeconfig),
                "RLENERGY_AGENT_KUBE": "true",
                "RLENERGY_AGENT_NAMESPACE": stack.namespace,
                "RLENERGY_AGENT_POLICY_NAME": stack.policy,
                "RLENERGY_AGENT_STATIC_PODS": json.dumps({self.pod.static_key: self.uuids}),
                "RLENERGY_AGENT_PLAN_POLL_S": "0.5",
                "RLENERGY_AGENT_SAMPLE_INTERVAL_S": "0.2",
                "RLENERGY_AGENT_REPORT_INTERVAL_S": "0.5",
            }
        )
        argv = standin.agent_argv(node, self.work / "a.sock", self.work / "host")
        self.proc = Proc(argv, env, stack.tmp / f"agent-{node}.log")
        self.client = trainer.RLEnergyClient(
            str(self.work / "a.sock"), timeout_s=5.0, token_file=str(self.pod.token_file)
        )

    def start(self) -> None:
        (self.work / "a.sock").unlink(missing_ok=True)
        self.proc.start()
        wait_until(lambda: (self.work / "a.sock").exists(), timeout=60, what=f"agent {self.node}")

    def locked(self) -> list[str]:
        return [u for u in self.uuids if self.driver.gpu(u).locked]

    def close(self) -> None:
        self.proc.stop()
        self.client.close()
        self.driver.stop()
        self.left_locked = self.locked()
        self.driver.close()


class Stack:
    """Operator(s) + agents + trainer for one policy in one namespace."""

    def __init__(
        self,
        cluster: DevCluster,
        namespace: str,
        tmp: Path,
        lib_dir: Path,
        *,
        nodes: tuple[str, ...] = ("kwok-gpu-0", "kwok-gpu-1"),
        policy: str = "chaos",
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.tmp = tmp
        self.policy = policy
        self.operators: list[Proc] = []
        self.agents = [Agent(self, n, lib_dir) for n in nodes]
        self.records: dict[tuple[str, int], float] = {}
        self.tokens: dict[int, float] = {}
        self.step = 0

    # ----- parts ---------------------------------------------------------------------------
    def operator(self, *, priority: int | None = None) -> Proc:
        """A new operator process (standalone, or peering with ``priority``)."""
        env = {
            **os.environ,
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "RLENERGY_OPERATOR_NAMESPACE": self.namespace,
            "RLENERGY_OPERATOR_RECONCILE_INTERVAL_S": "1",
            "RLENERGY_OPERATOR_RESET_DEADLINE_S": str(RESET_DEADLINE_S),
            "RLENERGY_OPERATOR_RETRY_DELAY_S": "1",
            "RLENERGY_OPERATOR_WATCH_SERVER_TIMEOUT_S": "30",
            "RLENERGY_OPERATOR_REQUEST_TIMEOUT_S": "10",
        }
        argv = [sys.executable, "-m", "rlenergy_operator", "--all-namespaces"]
        if priority is None:
            argv.append("--standalone")
        else:
            env["RLENERGY_OPERATOR_PRIORITY"] = str(priority)
        op = Proc(argv, env, self.tmp / f"operator-{len(self.operators)}.log")
        self.operators.append(op)
        op.start()
        return op

    def apply_policy(self, **spec: Any) -> None:
        body = {
            "apiVersion": "rlenergy.io/v1alpha1",
            "kind": "RLEnergyPolicy",
            "metadata": {"name": self.policy, "namespace": self.namespace},
            "spec": {
                "selector": {"matchLabels": {"app": self.policy}},
                "controller": {"warmupSteps": 1, "trialSteps": 2},
                **spec,
            },
        }
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(body))

    def start(self, *, operator: bool = True) -> None:
        if operator:
            self.operator()
        self.apply_policy()
        wait_until(
            lambda: self.status().get("plan", {}).get("step") == 0,
            timeout=90,
            what="initial plan",
        )
        for a in self.agents:
            a.start()
        # As with a DaemonSet, every agent has published its (step-less) report before the
        # trainer starts: the operator only knows the nodes that reported (see
        # docs/scale-and-chaos.md, "expected nodes").
        wait_until(
            lambda: (
                {r["spec"]["nodeName"] for r in self.reports() or []}
                >= {a.node for a in self.agents}
            ),
            timeout=90,
            what="every agent's first report",
        )

    # ----- reading -------------------------------------------------------------------------
    def _get(self, *args: str) -> Any:
        res = self.cluster.kubectl("get", *args, "-o", "json", check=False, timeout=30)
        return json.loads(res.stdout) if res.returncode == 0 else None

    def status(self) -> dict[str, Any]:
        obj = self._get("rlep", self.policy, "-n", self.namespace)
        return dict((obj or {}).get("status") or {})

    def reports(self) -> list[dict[str, Any]] | None:
        obj = self._get("rlenergynodereports", "-n", self.namespace)
        if obj is None:
            return None
        return [i for i in obj["items"] if i["spec"].get("policyName") == self.policy]

    def snapshot(self) -> list[dict[str, Any]]:
        """Read the reports (retrying while the API is down) and remember every step record."""
        reps = wait_until(
            lambda: (r if (r := self.reports()) is not None else None) or None,
            timeout=120,
            what="node reports readable",
        )
        for rep in reps:
            node = rep["spec"]["nodeName"]
            for rec in rep["spec"].get("steps", []):
                joules = sum(p.get("energyJoules") or 0.0 for p in rec.get("phases", [])) + (
                    rec.get("idleEnergyJoules") or 0.0
                )
                prev = self.records.setdefault((node, rec["step"]), joules)
                assert prev == pytest.approx(joules, rel=1e-12), (
                    f"{node} step {rec['step']} changed after it was published: {prev} -> {joules}"
                )
                self.tokens[rec["step"]] = rec["workload"]["validTokens"]
        return reps

    # ----- the trainer -----------------------------------------------------------------------
    def _run_for(self, seconds: float) -> None:
        end = last = time.monotonic()
        end += seconds
        while True:
            now = time.monotonic()
            for a in self.agents:
                if now > last:
                    a.driver.advance(now - last)
            last = now
            if now >= end:
                return
            time.sleep(min(0.02, end - now))

    def play_step(self, *, mid_phase: Callable[[], None] | None = None) -> int:
        """One RL step on every node: generation, training, end of step."""
        s = self.step
        for phase in ("generation", "training"):
            for a in self.agents:
                a.client.phase(phase, step=s)
                a.driver.set_work(a.uuids, phase, f"{phase}-{s}")  # type: ignore[arg-type]
            self._run_for(PHASE_S)
            if phase == "generation" and mid_phase is not None:
                mid_phase()
        for a in self.agents:
            a.driver.set_work(a.uuids, "idle")
            a.client.end_step(
                s,
                samples=64,
                response_tokens=64_000.0,
                prompt_tokens=8_000.0,
                valid_tokens=60_000.0 + s,
            )
        self.step += 1
        return s

    def run_steps(self, n: int, *, mid_phase: dict[int, Callable[[], None]] | None = None) -> None:
        """Play ``n`` steps; after each, wait until every live agent published it (snapshot)."""
        for _ in range(n):
            s = self.play_step(mid_phase=(mid_phase or {}).get(self.step))
            live = {a.node for a in self.agents if a.proc.alive()}

            def published(s: int = s, live: set[str] = live) -> bool:
                reps = self.snapshot()
                return all(
                    any(
                        r["spec"]["nodeName"] == n and r["spec"].get("lastStep", -1) >= s
                        for r in reps
                    )
                    for n in live
                )

            wait_until(published, timeout=90, interval=0.3, what=f"step {s} in every node report")

    # ----- the promises ---------------------------------------------------------------------
    def check_totals(self) -> dict[str, Any]:
        """Totals equal the sum of the published step records; every step accounted once."""
        last = self.step - 1
        st = wait_until(
            lambda: (
                s if (s := self.status()).get("totals", {}).get("throughStep", -1) >= last else None
            ),
            timeout=120,
            interval=0.5,
            what=f"totals through step {last}",
        )
        self.snapshot()
        totals = st["totals"]
        counted = sorted({s for (_, s) in self.records if s <= totals["throughStep"]})
        joules = sum(j for (_, s), j in self.records.items() if s <= totals["throughStep"])
        assert totals["steps"] == len(counted), (totals, counted)
        assert totals["steps"] + totals["missedSteps"] == totals["throughStep"] + 1, totals
        assert totals["measuredJoules"] == pytest.approx(joules, rel=1e-9), (totals, self.records)
        assert totals["validTokens"] == pytest.approx(sum(self.tokens[s] for s in counted))
        return st

    def delete_and_check_reset(self) -> float:
        """Delete the policy: finalizer lifted after reset acks, every GPU at default clocks."""
        t0 = time.monotonic()
        self.cluster.kubectl("delete", "rlep", self.policy, "-n", self.namespace, "--wait=false")
        wait_until(
            lambda: (
                self._get("rlep", self.policy, "-n", self.namespace) is None
                and self.cluster.kubectl(
                    "get", "rlep", self.policy, "-n", self.namespace, check=False
                ).returncode
                != 0
            ),
            timeout=RESET_DEADLINE_S + 60,
            interval=0.5,
            what="policy gone (finalizer lifted)",
        )
        took = time.monotonic() - t0
        assert took < RESET_DEADLINE_S, (
            f"finalizer needed the deadline ({took:.0f} s): no reset ack"
        )
        for a in self.agents:
            assert a.locked() == [], f"{a.node} still locked after the policy went: {a.locked()}"
        return took

    def close(self) -> None:
        if any(op.alive() for op in self.operators):
            # A test that failed before deleting its policy: let the live operator lift the
            # finalizer (the agents still acknowledge), so the namespace can go.
            self.cluster.kubectl(
                "delete",
                "rlep",
                "--all",
                "-n",
                self.namespace,
                "--timeout=60s",
                check=False,
                timeout=90,
            )
        for a in self.agents:
            a.close()
        for op in self.operators:
            op.stop()
        self.cluster.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)

    def no_tracebacks(self) -> None:
        for p in [*self.operators, *(a.proc for a in self.agents)]:
            out = p.output()
            assert "Traceback (most recent call last)" not in out, out[-4000:]


@contextlib.contextmanager
def stack(
    cluster: DevCluster, namespace: str, tmp: Path, lib_dir: Path, **kw: Any
) -> Iterator[Stack]:
    s = Stack(cluster, namespace, tmp, lib_dir, **kw)
    try:
        yield s
    finally:
        s.close()
