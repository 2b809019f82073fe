"""Agent benchmark on the stand-in NVML: phase signal -> clocks applied latency with the real
caller check, agent RSS, and measured vs true phase energy.

Runs ``rlenergy-agent --backend nvml`` as a separate process whose pynvml loads the stand-in
``libnvidia-ml.so.1`` through LD_LIBRARY_PATH (the real pynvml code path), drives it with the
trainer SDK over its Unix socket, and plays the simulated GPUs in real time. The trainer is a
pod object on a KWOK node of a dev cluster started here (real kube-apiserver, ``make bins``);
it signals with a token the API server bound to it, and the agent checks every caller by a
TokenReview against that API server, cached by token (``rlenergy_agent.identity``). Reported:
the signal-to-clock latency inside the agent (token check included) and the SDK's round trip,
p50/p99 over ``--signals`` signals; the first signal of a token (uncached: one TokenReview),
for the agent's first token and for ``--fresh-tokens`` new ones. Footprint: the resident set
(VmRSS) and CPU seconds per second (``/proc/<pid>/stat``) of an agent set up as in its pod,
idle, with its share of the Kubernetes and PodResources clients (each measured by leaving it
out), and of the benchmark's agent while it governs the GPUs through the timed phases, printed
beside their targets (60 MB; the chart's CPU request).

``--baseline-src DIR`` runs a second agent from another source tree (e.g. ``git worktree add
/tmp/base <commit>``) beside this one, on its own stand-in GPUs, and sends each cached-token
signal to both in turn, so both latency columns come from the same minutes of the same machine.
The start-up work census (a full garbage collection with the agent's start-up objects, and
frozen) is counted in a fresh interpreter, CPU as thread time. ``--trace`` runs the agents under
``bench/agent_trace.py`` and takes each cached-token signal's time in the agent apart: CPU,
run-queue wait (the machine's other processes), the agent lock's wait, the rest (GIL, I/O).
``--tls`` also serves the agent's TLS signal port (a certificate for 127.0.0.1 from a CA made
here) and sends every cached-token signal twice, over the socket and over TLS in turn (each
first half the time), on one persistent connection each: the same agent, the same minutes.

    python bench/agent.py [--signals 400] [--steps 3] [--fresh-tokens 5] [--baseline-src DIR]
                          [--trace | --tls] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlenergy_agent import identity, kube, kubeapi
from rlenergy_dev import standin
from rlenergy_dev.devcluster import DevCluster, trainers

from rlenergy.api import signals
from rlenergy.gpu import models
from rlenergy.sdk import trainer

ROOT = Path(__file__).resolve().parents[1]
PLAN = {
    "step": 0,
    "phases": [
        {"phase": "generation", "clockMHz": 1395, "state": "locked"},
        {"phase": "training", "clockMHz": 1755, "state": "locked"},
    ],
}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def identity_check_ms(cluster: DevCluster, token: str, n: int) -> tuple[float, list[float]]:
    """The agent's caller check alone, in this process: (first call = one real TokenReview,
    ms; ``n`` cached calls, ms each). Side by side with the signal latency, it shows what the
    check costs apart from the machine's scheduling noise."""
    api = kubeapi.ApiClient(kubeapi.from_kubeconfig(cluster.kubeconfig))
    auth = identity.TokenAuthenticator(kube.TokenReviewer(api).review, signals.TOKEN_AUDIENCE)
    header = f"Bearer {token}"
    t0 = time.perf_counter()
    auth.authenticate(header)
    first = (time.perf_counter() - t0) * 1e3
    cached = []
    for _ in range(n):
        t0 = time.perf_counter()
        auth.authenticate(header)
        cached.append((time.perf_counter() - t0) * 1e3)
    assert auth.reviews == 1
    return first, cached


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--signals", type=int, default=400)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--phase-seconds", type=float, default=3.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--fresh-tokens", type=int, default=5)
    ap.add_argument("--baseline-src", type=Path, help="a source tree to run beside this one")
    ap.add_argument("--trace", action="store_true", help="take each signal's time apart")
    ap.add_argument("--tls", action="store_true", help="also time each signal over TLS")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.tls and args.trace:
        ap.error("--tls and --trace: the trace counts the socket's signals only; pick one")
    with DevCluster(startup_timeout=180) as cluster:
        cluster.start(nodes=1, gpus_per_node=args.gpus)
        return run(args, cluster)


class AgentUnderTest:
    """One agent process on its own stand-in GPUs, serving the bench's trainer pod.

    Args:
        work: its folder.
        pod: the trainer pod (its static allocation names this agent's GPUs).
        node: the node name.
        gpus: stand-in GPUs.
        tag: distinguishes the GPU UUIDs of agents run side by side.
        kubeconfig: the dev cluster's kubeconfig (TokenReview, pod-end checks).
        src: a source tree to run the agent from (``None``: this one).
        trace: run it under ``bench/agent_trace.py`` (records in ``trace_path``).
    """

    def __init__(
        self,
        work: Path,
        pod: trainers.TrainerPod,
        node: str,
        gpus: int,
        tag: str,
        kubeconfig: Path,
        src: Path | None = None,
        trace: bool = False,
        tls_port: int = 0,
    ) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
        sku = models.get_sku("h100-sxm")
        self.uuids = [f"GPU-{tag}-{i:04x}-{(i * 7919) % 65536:04x}" for i in range(gpus)]
        self.drv = standin.StandinDriver(work / "state", [(u, sku) for u in self.uuids])
        self.drv.start(tick_s=0.02)
        (work / "plan.json").write_text(json.dumps(PLAN))
        env = dict(os.environ)
        env.update(self.drv.env(lib_dir))
        env.update(
            {
                "RLENERGY_AGENT_STATIC_PODS": json.dumps({pod.static_key: self.uuids}),
                "RLENERGY_AGENT_SAMPLE_INTERVAL_S": "0.5",
                "RLENERGY_AGENT_KUBE": "true",
                "KUBECONFIG": str(kubeconfig),
            }
        )
        ca_file = work / "tls" / "ca.crt"
        if tls_port:
            env.update(_tls_files(work / "tls", tls_port))
        if src is not None:  # its packages first on the path (this tree is installed editable)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(src / "agent"), str(src), env.get("PYTHONPATH", "")]
            )
        self.sock = work / "agent.sock"
        self.report = work / "report.json"
        self.trace_path = work / "trace.json" if trace else None
        cmd = standin.agent_argv(
            node, self.sock, work / "state-dir", "--plan", str(work / "plan.json"),
            "--report-file", str(self.report), "--log-level", "WARNING",
        )  # fmt: skip
        if self.trace_path is not None:
            env["RLENERGY_AGENT_TRACE"] = str(self.trace_path)
            cmd[1:3] = [str(ROOT / "bench" / "agent_trace.py")]  # instead of -m rlenergy_agent
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=work)
        assert self.proc.stdout is not None
        ready = json.loads(self.proc.stdout.readline())
        assert ready["ready"], ready
        self.client = trainer.RLEnergyClient(
            str(self.sock), strict=True, token_file=str(pod.token_file)
        )
        self.lat: list[float] = []
        self.rtt: list[float] = []
        self.tls_client: trainer.RLEnergyClient | None = None
        self.tls_lat: list[float] = []
        self.tls_rtt: list[float] = []
        if tls_port:
            assert ready.get("tlsPort") == tls_port, ready
            self.tls_client = trainer.RLEnergyClient(
                str(self.sock), strict=True, token_file=str(pod.token_file)
            )
            self.tls_client.endpoint = trainer.Endpoint(None, "127.0.0.1", tls_port, str(ca_file))

    def signal(self, phase: str, step: int, *, tls: bool = False) -> None:
        """One phase signal, timed (agent side and round trip), clocks checked."""
        client = self.tls_client if tls else self.client
        assert client is not None
        t0 = time.perf_counter()
        client.phase(phase, step=step)
        (self.tls_rtt if tls else self.rtt).append(time.perf_counter() - t0)
        (self.tls_lat if tls else self.lat).append(float(client.last_response["latencySeconds"]))
        want = 1395 if phase == "generation" else 1755
        assert all(self.drv.gpu(u).lock_max_mhz == want for u in self.uuids)

    def stop(self) -> bool:
        """Stop the agent; True when no stand-in GPU stays locked (reset on SIGTERM)."""
        self.client.close()
        if self.tls_client is not None:
            self.tls_client.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.drv.close()
        return not any(drv_state_locked(self.work / "state", len(self.uuids)))


def _tls_files(folder: Path, port: int) -> dict[str, str]:
    """A CA and a serving certificate for 127.0.0.1 in ``folder``; the agent's TLS env."""
    import datetime

    from rlenergy.api import tls

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca = tls.make_ca("bench CA", now)
    key = tls.new_key()
    cert = tls.issue_for_key(ca, key, tls.Request("bench", ("127.0.0.1",), ()), now)
    (folder / "ca.crt").write_bytes(ca.cert_pem)
    (folder / "tls.crt").write_bytes(cert)
    (folder / "tls.key").write_bytes(key)
    return {
        "RLENERGY_AGENT_TLS_PORT": str(port),
        "RLENERGY_AGENT_TLS_HOST": "127.0.0.1",
        "RLENERGY_AGENT_TLS_CERT_FILE": str(folder / "tls.crt"),
        "RLENERGY_AGENT_TLS_KEY_FILE": str(folder / "tls.key"),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STARTUP_CENSUS = r"""
import gc, json, sys, time
import rlenergy_agent.__main__, rlenergy_agent.kube, rlenergy_agent.nodeloop

def full_gc_ms():
    t0 = time.thread_time()
    gc.collect()
    return (time.thread_time() - t0) * 1e3

out = {}
gc.collect()
out["tracked_objects"] = len(gc.get_objects())
out["full_gc_ms"] = min(full_gc_ms() for _ in range(5))
gc.freeze()
out["full_gc_frozen_ms"] = min(full_gc_ms() for _ in range(5))
json.dump(out, sys.stdout)
"""


def startup_census() -> dict[str, float]:
    """What the agent's start-up objects cost, in a fresh interpreter (see the module doc)."""
    res = subprocess.run(
        [sys.executable, "-c", STARTUP_CENSUS], capture_output=True, text=True, check=True
    )
    return {k: float(v) for k, v in json.loads(res.stdout).items()}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, its ended threads included
    (``/proc/<pid>/stat`` fields 14-15, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_request(values: Path = ROOT / "helm" / "rl-energy" / "values.yaml") -> float:
    """The chart's CPU request of an agent pod, in CPUs (``agent.resources.requests.cpu``)."""
    import yaml

    text = str(yaml.safe_load(values.read_text())["agent"]["resources"]["requests"]["cpu"])
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def pod_like(
    work: Path,
    kubeconfig: Path,
    gpus: int,
    seconds: float = 10.0,
    *,
    kube: bool = True,
    podresources: bool = True,
) -> dict[str, Any]:
    """An agent set up as in its pod, not governing: VmRSS (MB = MiB, once a second) and CPU.

    As ``tests/integration/agent/test_agent_memory.py``: ``gpus`` stand-in H100s, the
    Kubernetes client on the dev cluster's kubeconfig and the PodResources client made (on a
    socket path nothing answers), so gRPC is loaded as on a node, with the pod's settings
    (sampling every second); the benchmark's own agent maps pods statically and loads no gRPC.
    ``kube=False`` leaves the Kubernetes client out and ``podresources=False`` the
    PodResources client (static, empty pod map): their share of the resident set is the
    difference.

    Returns:
        ``rss_mb``: the samples; ``cpu_per_s``: CPU seconds per second over the samples'
        ``seconds`` (``cpu_s``), after start-up; ``threads``: the process's threads at the end.
    """
    work.mkdir(parents=True, exist_ok=True)
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    sku = models.get_sku("h100-sxm")
    drv = standin.StandinDriver(work / "state", [(f"GPU-pod-{i}", sku) for i in range(gpus)])
    (work / "kubelet.sock").write_text("")
    (work / "plan.json").write_text(json.dumps(PLAN))
    env = {
        **os.environ,
        **drv.env(lib_dir),
        "RLENERGY_AGENT_KUBE": "true" if kube else "false",
        "KUBECONFIG": str(kubeconfig),
        "RLENERGY_AGENT_PODRESOURCES_SOCKET": str(work / "kubelet.sock"),
    }
    if not podresources:
        env["RLENERGY_AGENT_STATIC_PODS"] = "{}"
    cmd = standin.agent_argv(
        "pod-rss", work / "a.sock", work / "host", "--plan", str(work / "plan.json"),
        "--log-level", "CRITICAL",
    )  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)  # noqa: S603
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["ready"]
        samples = []
        t0, c0 = time.monotonic(), cpu_s(proc.pid)
        for _ in range(int(seconds)):
            time.sleep(1.0)
            samples.append(rss_mb(proc.pid))
        cpu = (cpu_s(proc.pid) - c0) / (time.monotonic() - t0)
        threads = len(list(Path(f"/proc/{proc.pid}/task").iterdir()))
        return {"rss_mb": samples, "cpu_per_s": cpu, "threads": threads}
    finally:
        proc.terminate()
        proc.wait(30)
        drv.close()


def breakdown(records: list[dict[str, Any]]) -> dict[str, float]:
    """p50/p99 of each part of the signals' time in the agent, ms (``bench/agent_trace.py``)."""
    parts = {
        "handler": [r["wall_s"] for r in records],
        "cpu": [r["cpu_s"] for r in records],
        "runqueue_wait": [r["runqueue_s"] for r in records],
        "agent_lock_wait": [r["lock_wait_s"] for r in records],
        "other_sleep": [r["wall_s"] - r["cpu_s"] - r["runqueue_s"] for r in records],
        "handler_minus_runqueue": [r["wall_s"] - r["runqueue_s"] for r in records],
    }
    out = {f"{k}_p{q}_ms": pct(v, q) * 1e3 for k, v in parts.items() for q in (50, 99)}
    out["signals_with_gc"] = float(sum(1 for r in records if r["gcs"]))
    return out


def traced(a: AgentUnderTest, skip: int, n: int) -> dict[str, float] | None:
    """The breakdown of ``a``'s cached-token signals (its phase requests ``skip .. skip+n``)."""
    if a.trace_path is None:
        return None
    phases = [r for r in json.loads(a.trace_path.read_text()) if r["path"] == "/v1/phase"]
    return breakdown(phases[skip : skip + n])


def run(args: argparse.Namespace, cluster: DevCluster) -> int:
    """The benchmark against ``cluster``."""
    work = Path(tempfile.mkdtemp(prefix="rlenergy-bench-", dir="/tmp"))
    cluster.kubectl("create", "namespace", "bench")
    node = cluster.nodes[0]
    pod = trainers.create_trainer(cluster.kubectl, "bench", "trainer-0", node, work / "tokens")
    census = startup_census()
    agent = AgentUnderTest(
        work / "agent", pod, node, args.gpus, "bench", cluster.kubeconfig, trace=args.trace,
        tls_port=_free_port() if args.tls else 0,
    )  # fmt: skip
    agents = [agent]
    if args.baseline_src is not None:
        agents.append(
            AgentUnderTest(
                work / "baseline", pod, node, args.gpus, "base", cluster.kubeconfig,
                src=args.baseline_src.resolve(), trace=args.trace,
            )
        )  # fmt: skip
    uuids, drv, client, report = agent.uuids, agent.drv, agent.client, agent.report
    reset_ok = False
    try:
        # the first signal of a token: one TokenReview against the API server
        first_lat: list[float] = []
        first_rtt: list[float] = []
        for k in range(1 + args.fresh_tokens):
            if k:  # a new token for the same pod (what a kubelet rotation brings)
                fresh = trainers.bound_token(cluster.kubectl, "bench", pod.name, pod.uid)
                trainers.write_token(pod.token_file, fresh)
            t0 = time.perf_counter()
            client.phase("generation", step=0)
            first_rtt.append(time.perf_counter() - t0)
            first_lat.append(float(client.last_response["latencySeconds"]))
        for a in agents:
            a.client.phase("idle", step=0)
        if agent.tls_client is not None:
            agent.tls_client.phase("idle", step=0)  # its connection and handshake, not timed
        for i in range(args.signals):
            for a in agents if i % 2 == 0 else agents[::-1]:  # each goes first half the time
                a.signal("generation" if i % 2 == 0 else "training", i // 2)
            if agent.tls_client is not None:  # the same signal again over TLS
                agent.signal("generation" if i % 2 == 0 else "training", i // 2, tls=True)
        agent_lat, rtt = agent.lat, agent.rtt
        last_step = (args.signals - 1) // 2  # the loop's newest step (the agent takes at most
        client.phase("idle", step=last_step)  # STEP_WINDOW steps ahead of it)
        rss = rss_mb(agent.proc.pid)
        in_pod = pod_like(work / "pod-rss", cluster.kubeconfig, args.gpus)
        pod_no_kube = pod_like(work / "pod-no-kube", cluster.kubeconfig, args.gpus, kube=False)
        pod_no_grpc = pod_like(
            work / "pod-no-grpc", cluster.kubeconfig, args.gpus, podresources=False
        )
        baseline_rss = rss_mb(agents[-1].proc.pid) if len(agents) > 1 else None
        for a in agents[1:]:
            a.stop()
        # energy: measured phase windows vs the simulator's truth, real time
        errors: list[float] = []
        base_step = last_step + 1
        t_gov, cpu_gov = time.monotonic(), cpu_s(agent.proc.pid)
        for s in range(args.steps):
            step = base_step + s
            for phase in ("generation", "training"):
                client.phase(phase, step=step)
                drv.set_work(uuids, phase, f"{phase}-{step}")
                time.sleep(args.phase_seconds)
            client.phase("idle", step=step)
            drv.set_work(uuids, "idle", "idle")
            client.end_step(step, samples=1, response_tokens=1, prompt_tokens=1, valid_tokens=1)
        governing_cpu = (cpu_s(agent.proc.pid) - cpu_gov) / (time.monotonic() - t_gov)
        governing_rss = rss_mb(agent.proc.pid)
        time.sleep(1.2)
        data = json.loads(report.read_text())
        windows = {
            (rec["step"], p["phase"]): p["energyJoules"]
            for rec in data["steps"]
            for p in rec["phases"]
        }
        rows = []
        for s in range(args.steps):
            step = base_step + s
            for phase in ("generation", "training"):
                truth = sum(drv.truth_j(u, f"{phase}-{step}") for u in uuids)
                measured = windows[(step, phase)]
                err = (measured - truth) / truth
                errors.append(abs(err))
                rows.append((step, phase, measured, truth, err))
        fresh = trainers.bound_token(cluster.kubectl, "bench", pod.name, pod.uid)
        check_first_ms, check_cached_ms = identity_check_ms(cluster, fresh, 10_000)
    finally:
        reset_ok = agent.stop()
        for a in agents[1:]:
            if a.proc.poll() is None:
                a.stop()
    out: dict[str, Any] = {
        "signals": args.signals,
        "gpus": args.gpus,
        "caller_check": "TokenReview against kube-apiserver "
        + cluster.server_version()
        + ", cached by token",
        "first_signal_agent_ms": first_lat[0] * 1e3,
        "first_signal_roundtrip_ms": first_rtt[0] * 1e3,
        "fresh_token_agent_ms": [x * 1e3 for x in first_lat[1:]],
        "fresh_token_roundtrip_ms": [x * 1e3 for x in first_rtt[1:]],
        "agent_latency_p50_ms": pct(agent_lat, 50) * 1e3,
        "agent_latency_p99_ms": pct(agent_lat, 99) * 1e3,
        "roundtrip_p50_ms": pct(rtt, 50) * 1e3,
        "roundtrip_p99_ms": pct(rtt, 99) * 1e3,
        "agent_rss_mb": rss,
        "agent_rss_governing_mb": governing_rss,
        "agent_cpu_governing_per_s": governing_cpu,
        "agent_pod_rss_mb": max(in_pod["rss_mb"]),
        "agent_pod_cpu_idle_per_s": in_pod["cpu_per_s"],
        "agent_pod_threads": in_pod["threads"],
        "agent_pod_rss_without_kube_mb": max(pod_no_kube["rss_mb"]),
        "agent_pod_rss_without_podresources_mb": max(pod_no_grpc["rss_mb"]),
        "agent_cpu_request": cpu_request(),
        "phase_energy_max_abs_error_pct": max(errors) * 100,
        "phase_energy_mean_abs_error_pct": statistics.mean(errors) * 100,
        "clocks_reset_on_sigterm": reset_ok,
        "identity_check_first_ms": check_first_ms,
        "identity_check_cached_p50_ms": pct(check_cached_ms, 50),
        "identity_check_cached_p99_ms": pct(check_cached_ms, 99),
        "startup_census": census,
        "trace": traced(agent, 2 + args.fresh_tokens, args.signals),
        "load_average_1m": os.getloadavg()[0],
    }
    if agent.tls_lat:
        out["tls"] = {
            "agent_latency_p50_ms": pct(agent.tls_lat, 50) * 1e3,
            "agent_latency_p99_ms": pct(agent.tls_lat, 99) * 1e3,
            "roundtrip_p50_ms": pct(agent.tls_rtt, 50) * 1e3,
            "roundtrip_p99_ms": pct(agent.tls_rtt, 99) * 1e3,
        }
    if len(agents) > 1:
        base = agents[1]
        out["baseline"] = {
            "src": str(args.baseline_src),
            "agent_latency_p50_ms": pct(base.lat, 50) * 1e3,
            "agent_latency_p99_ms": pct(base.lat, 99) * 1e3,
            "roundtrip_p50_ms": pct(base.rtt, 50) * 1e3,
            "roundtrip_p99_ms": pct(base.rtt, 99) * 1e3,
            "agent_rss_mb": baseline_rss,
            "trace": traced(base, 1, args.signals),
        }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"phase signal -> clocks applied on {args.gpus} GPUs, {args.signals} signals (stand-in NVML),"
            f" caller check: {out['caller_check']}"
        )
        print(
            f"  first signal of the agent's first token (uncached TokenReview): agent side "
            f"{out['first_signal_agent_ms']:.3f} ms, round trip {out['first_signal_roundtrip_ms']:.3f} ms"
        )
        if first_lat[1:]:
            print(
                f"  first signal of {len(first_lat) - 1} fresh tokens: agent side "
                + ", ".join(f"{x * 1e3:.2f}" for x in first_lat[1:])
                + " ms; round trip "
                + ", ".join(f"{x * 1e3:.2f}" for x in first_rtt[1:])
                + " ms"
            )
        print("  cached token:")
        print(
            f"  agent side  p50 {out['agent_latency_p50_ms']:.3f} ms   p99 {out['agent_latency_p99_ms']:.3f} ms   (target p99 <= 5 ms)"
        )
        print(
            f"  round trip  p50 {out['roundtrip_p50_ms']:.3f} ms   p99 {out['roundtrip_p99_ms']:.3f} ms"
        )
        if "tls" in out:
            t = out["tls"]
            print("  the same signals over TLS (127.0.0.1, one kept-alive connection):")
            print(
                f"  agent side  p50 {t['agent_latency_p50_ms']:.3f} ms   p99 {t['agent_latency_p99_ms']:.3f} ms"
            )
            print(
                f"  round trip  p50 {t['roundtrip_p50_ms']:.3f} ms   p99 {t['roundtrip_p99_ms']:.3f} ms"
            )
        print(
            f"agent RSS {rss:.1f} MB after the signals, {governing_rss:.1f} MB after "
            f"{args.steps} governed steps (target <= 60 MB)"
        )
        print(
            f"agent RSS as in its pod (Kubernetes and PodResources clients, {args.gpus} GPUs): "
            f"{out['agent_pod_rss_mb']:.1f} MB (target <= 60 MB)  "
            f"{'OK' if out['agent_pod_rss_mb'] <= 60.0 else 'MISSED'}; without the Kubernetes "
            f"client {out['agent_pod_rss_without_kube_mb']:.1f} MB, without the PodResources "
            f"client (gRPC, protobuf) {out['agent_pod_rss_without_podresources_mb']:.1f} MB"
        )
        request = out["agent_cpu_request"]
        print(
            f"agent CPU, s per s: idle as in its pod {out['agent_pod_cpu_idle_per_s']:.4f} "
            f"(sampling every 1 s, {out['agent_pod_threads']} threads); governing "
            f"{args.gpus} GPUs {governing_cpu:.4f} ({args.steps} steps of 2 phases, "
            f"{args.phase_seconds:g} s each, sampling every 0.5 s) (target <= the chart's "
            f"request {request:.3f})  "
            f"{'OK' if max(governing_cpu, out['agent_pod_cpu_idle_per_s']) <= request else 'MISSED'}"
        )
        print("measured vs true phase energy (counter deltas, real time):")
        for step, phase, m, t, e in rows:
            print(
                f"  step {step} {phase:<10} measured {m:9.1f} J  truth {t:9.1f} J  error {e * 100:+.3f} %"
            )
        print(f"  max |error| {out['phase_energy_max_abs_error_pct']:.3f} % (target <= 1 %)")
        print(f"clocks reset on SIGTERM: {reset_ok}")
        if len(agents) > 1:
            b = out["baseline"]
            assert isinstance(b, dict)
            print(
                f"side by side, signals interleaved ({args.signals} each; load average "
                f"{out['load_average_1m']:.1f}):  this tree | {args.baseline_src}"
            )
            for key, label in (
                ("agent_latency_p50_ms", "agent side p50, ms"),
                ("agent_latency_p99_ms", "agent side p99, ms"),
                ("roundtrip_p50_ms", "round trip p50, ms"),
                ("roundtrip_p99_ms", "round trip p99, ms"),
                ("agent_rss_mb", "agent RSS, MB"),
            ):
                print(f"  {label:<22} {out[key]:9.3f} | {b[key]:9.3f}")
        if out["trace"] is not None:
            print("signal time in the agent, taken apart (bench/agent_trace.py), p50 / p99, ms:")
            traces: list[tuple[str, dict[str, float]]] = [("this tree", out["trace"])]
            if len(agents) > 1:
                traces.append((str(args.baseline_src), out["baseline"]["trace"]))
            for name, tr in traces:
                print(
                    f"  {name}: handler {tr['handler_p50_ms']:.3f} / {tr['handler_p99_ms']:.3f}; "
                    f"CPU {tr['cpu_p50_ms']:.3f} / {tr['cpu_p99_ms']:.3f}; run-queue wait "
                    f"{tr['runqueue_wait_p50_ms']:.3f} / {tr['runqueue_wait_p99_ms']:.3f}; agent "
                    f"lock wait {tr['agent_lock_wait_p50_ms']:.3f} / "
                    f"{tr['agent_lock_wait_p99_ms']:.3f}; other sleep (GIL, I/O) "
                    f"{tr['other_sleep_p50_ms']:.3f} / {tr['other_sleep_p99_ms']:.3f}; handler "
                    f"less run-queue wait {tr['handler_minus_runqueue_p50_ms']:.3f} / "
                    f"{tr['handler_minus_runqueue_p99_ms']:.3f}; "
                    f"{tr['signals_with_gc']:.0f} signals saw a GC"
                )
        print(
            "start-up work (fresh interpreter): a full garbage collection over "
            f"{census['tracked_objects']:,.0f} start-up objects {census['full_gc_ms']:.1f} ms "
            f"CPU, {census['full_gc_frozen_ms']:.2f} ms with them frozen"
        )
        print(
            f"caller check alone (in process, side by side): first call (TokenReview) "
            f"{check_first_ms:.2f} ms; cached p50 {out['identity_check_cached_p50_ms'] * 1e3:.1f} us"
            f"   p99 {out['identity_check_cached_p99_ms'] * 1e3:.1f} us (10,000 calls)"
        )
    return 0


def drv_state_locked(path: Path, n: int) -> list[bool]:
    import ctypes
    import mmap

    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), ctypes.sizeof(standin.State))
        st = standin.State.from_buffer_copy(m)
        m.close()
    return [bool(st.gpus[i].locked) for i in range(n)]


if __name__ == "__main__":
    sys.exit(main())
