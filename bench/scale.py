"""Scale benchmark: the operator against 250 and 1,000 KWOK GPU nodes x 8 GPUs.

What runs:

* the dev cluster (etcd, kube-apiserver, KCM, scheduler, KWOK) on 127.0.0.1;
* the real operator as a subprocess (``python -m rlenergy_operator --standalone``);
* 20 ``RLEnergyPolicy`` objects, each governing a job spread over ``nodes / 20`` nodes;
* the node agents simulated in this process: every node has its own
  ``rlenergy_agent.kube.ReportWriter`` (the agent's real report writer: one report object per
  policy and node, created once, then patched once per RL step with a JSON Patch of what
  changed; the report holds the records the operator has not folded, ``totals.throughStep`` as
  the plan watch delivered it, or with ``--keep-folded`` the newest 32), and each policy's agents
  read ``status.plan`` through the agent's real ``PlanWatcher`` (``--pollers`` watchers per
  policy, each one watch on the policy object, read staggered over the agent's 2 s poll
  period; a real fleet has one per node, see the extrapolated load in the output). The step records come from the simulator
  (``rlenergy.sim``: one simulated 8-GPU node per job, every node reports that node's record).

What it prints per scale point: operator peak RSS, status lag (last node report of a step
written -> a watch on the policies shows ``status.totals.throughStep`` >= that step) p50/p99,
plan propagation (last report of a step written -> every simulated agent of the policy holds
the plan for the next step) p50/p99, API requests per second by verb and resource over the RL
steps (delta of ``apiserver_request_total`` from the API server's /metrics), 409 conflicts,
report writes per node per RL step. Targets (DESIGN.md section 7): operator RSS <= 300 MB,
status lag p99 <= 5 s, at most one write per node per RL step, zero unresolved conflicts.

Bounded: a few RL steps per point; every wait has a deadline. Usage:
``python bench/scale.py [--points 250,1000] [--steps 5] [--policies 20] [--shards 1,2]``;
2,500 nodes (``--points 2500``) need about 9 minutes to start and 4 GB for the API server.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rlenergy_agent import kube as agent_kube
from rlenergy_dev.devcluster import DevCluster
from rlenergy_operator import shards

from rlenergy.api import node as api_node
from rlenergy.control.freq import aggregate, base
from rlenergy.gpu import models
from rlenergy.sim import job as sim_job
from rlenergy.sim import workload

ROOT = Path(__file__).resolve().parents[1]
GPUS_PER_NODE = 8
GROUP, VERSION, POLICIES = "rlenergy.io", "v1alpha1", "rlenergypolicies"
PLAN_POLL_S = 2.0  # the agent's default RLENERGY_AGENT_PLAN_POLL_S
WATCH_TIMEOUT_S = agent_kube.PlanWatcher.WATCH_TIMEOUT_S  # one plan watch request's length
RECONCILE_S = 2.0  # the operator's default RLENERGY_OPERATOR_RECONCILE_INTERVAL_S
WINDOW = 32  # the agent's MAX_STEPS_KEPT
TARGET_RSS_MB, TARGET_LAG_P99_S = 300.0, 5.0
TARGET_WRITE_KB = 8.0  # a node report write (its PATCH body), p50, 8 GPUs
NODE_GRACE_S = 600  # the node lifecycle controller's grace period in the benchmark's cluster


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, KiB."""
    cur = peak = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            cur = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1])
    return cur, peak


_METRIC = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def apiserver_metrics(cluster: DevCluster) -> str:
    """The API server's ``/metrics`` text."""
    return cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout


def request_counts(text: str) -> collections.Counter[tuple[str, str, str]]:
    """``apiserver_request_total`` of a ``/metrics`` text as (verb, resource[/subresource],
    code) -> count."""
    out: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group("labels")))
        res = labels.get("resource", "")
        if labels.get("subresource"):
            res += "/" + labels["subresource"]
        out[(labels.get("verb", ""), res, labels.get("code", ""))] += int(float(m.group("value")))
    return out


def mean_seconds(before: str, after: str, metric: str, **labels: str) -> tuple[float, int]:
    """(mean, count) between two ``/metrics`` texts of the histogram ``metric`` over the series
    whose labels include ``labels`` (``<metric>_sum`` / ``<metric>_count`` deltas)."""

    def totals(text: str) -> tuple[float, float]:
        out = [0.0, 0.0]
        for line in text.splitlines():
            for i, suffix in enumerate(("_sum{", "_count{")):
                if line.startswith(metric + suffix):
                    have = dict(_LABEL.findall(line[line.index("{") : line.index("}")]))
                    if all(have.get(k) == v for k, v in labels.items()):
                        out[i] += float(line.rsplit(" ", 1)[1])
        return out[0], out[1]

    (s0, c0), (s1, c1) = totals(before), totals(after)
    n = int(c1 - c0)
    return ((s1 - s0) / n if n else float("nan")), n


plan_to_decisions = aggregate.plan_decisions


class Operator:
    """The operator subprocess."""

    def __init__(
        self,
        cluster: DevCluster,
        log: Path,
        namespace: str,
        *,
        verbose: bool = False,
        shard: tuple[int, int] = (1, 0),
    ) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(cluster.kubeconfig),
            "RLENERGY_OPERATOR_NAMESPACE": namespace,
            "RLENERGY_OPERATOR_RESET_DEADLINE_S": "30",
            "RLENERGY_OPERATOR_RETRY_DELAY_S": "1",
            "RLENERGY_OPERATOR_SHARDS": str(shard[0]),
            "RLENERGY_OPERATOR_SHARD_INDEX": str(shard[1]),
        }
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlenergy_operator", "--standalone", "--all-namespaces"]
                + (["--verbose"] if verbose else []),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
            )
        self.peak_kib = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.peak_kib = max(self.peak_kib, rss_kib(self.proc.pid)[1])
            except OSError:
                return

    def cpu_s(self) -> float:
        """User + system CPU time of the operator process so far, s (``/proc/<pid>/stat``)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> tuple[float, float]:
        cur, peak = rss_kib(self.proc.pid)
        self.peak_kib = max(self.peak_kib, peak)
        return cur / 1024, self.peak_kib / 1024

    def stop(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


WATCHER = r"""
import json, sys, time
import kubernetes
kubernetes.config.load_kube_config(config_file=sys.argv[1])
api = kubernetes.client.CustomObjectsApi()
while True:
    w = kubernetes.watch.Watch()
    try:
        for ev in w.stream(api.list_namespaced_custom_object, sys.argv[2], sys.argv[3],
                           sys.argv[4], sys.argv[5], timeout_seconds=20):
            now = time.time()
            obj = ev["object"]
            totals = (obj.get("status") or {}).get("totals") or {}
            print(json.dumps([obj["metadata"]["name"], int(totals.get("throughStep", -1)), now]),
                  flush=True)
    except Exception as exc:
        print(json.dumps(["", -1, repr(exc)]), flush=True)
        time.sleep(1)
"""


class _WatchProcess:
    """A watch script (``WATCHER``, ``REPORT_WATCHER``) run in its own process, one JSON line
    per event read by a thread of this one (``_event``): the child stamps each event with the
    wall clock as it arrives; in this process the watch shared the GIL with the simulated
    agents (serialising every node's report at each step), which delayed its timestamps by
    seconds at 250 nodes and more."""

    def __init__(self, script: str, kubeconfig: Path, namespace: str, plural: str) -> None:
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, str(kubeconfig), GROUP, VERSION, namespace, plural],
            stdout=subprocess.PIPE,
            text=True,
        )
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._event(json.loads(line))

    def _event(self, fields: list[Any]) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


class PolicyWatch(_WatchProcess):
    """A watch on the namespace's policies: when each (policy, throughStep) was first seen."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.seen: dict[tuple[str, int], float] = {}
        super().__init__(WATCHER, kubeconfig, namespace, POLICIES)

    def _event(self, fields: list[Any]) -> None:
        name, through, now = fields
        if not name:
            print(f"  (policy watch restarted: {now})", file=sys.stderr)
            return
        with self.lock:
            self.seen.setdefault((name, through), now)

    def first_seen(self, name: str, step: int) -> float | None:
        """Wall-clock time (``time.time()``) the status first showed ``throughStep >= step``."""
        with self.lock:
            times = [t for (n, s), t in self.seen.items() if n == name and s >= step]
        return min(times) if times else None


REPORT_WATCHER = r"""
import json, sys, time
import kubernetes
kubernetes.config.load_kube_config(config_file=sys.argv[1])
api = kubernetes.client.CustomObjectsApi()
version = ""
while True:
    w = kubernetes.watch.Watch()
    kw = {"timeout_seconds": 60, "allow_watch_bookmarks": True}
    if version:
        kw["resource_version"] = version
    try:
        for ev in w.stream(api.list_namespaced_custom_object, sys.argv[2], sys.argv[3],
                           sys.argv[4], sys.argv[5], **kw):
            now = time.time()
            if ev["type"] in ("ADDED", "MODIFIED"):
                spec = ev["object"].get("spec") or {}
                print(json.dumps([spec.get("policyName"), spec.get("nodeName"),
                                  int(spec.get("lastStep", -1)), now]), flush=True)
        version = w.resource_version or version
    except Exception as exc:
        version = ""
        print(json.dumps(["", "", -1, repr(exc)]), flush=True)
        time.sleep(1)
"""


class ReportWatch(_WatchProcess):
    """A watch on the namespace's node reports in its own process: when each node's report of
    each step first reached a watcher (the API server's watch delivery, which the operator's
    report index waits for too).

    It is one more watcher of every report event for the API server (each event is encoded
    once and written to each watcher) and parses every report in its own process.
    """

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.first: dict[tuple[str, str], list[tuple[int, float]]] = collections.defaultdict(list)
        self.restarts = 0
        super().__init__(REPORT_WATCHER, kubeconfig, namespace, "rlenergynodereports")

    def _event(self, fields: list[Any]) -> None:
        policy, node, last, now = fields
        if not policy:
            self.restarts += 1
            return
        with self.lock:
            seen = self.first[(policy, node)]
            if not seen or last > seen[-1][0]:
                seen.append((last, now))

    def delivered(self, policy: str, nodes: list[str], step: int) -> float | None:
        """When the watch had every one of ``nodes``' reports with ``lastStep >= step``."""
        out = 0.0
        with self.lock:
            for node in nodes:
                times = [t for last, t in self.first.get((policy, node), []) if last >= step]
                if not times:
                    return None
                out = max(out, min(times))
        return out


ACCOUNTED = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\].*\[([^/\]]+)/([^\]]+)\] "
    r"accounted steps \[([\d, ]+)\]"
)


def accounted_times(log: str, namespace: str) -> dict[tuple[str, int], float]:
    """(policy, step) -> wall-clock time the operator logged folding the step (before its PATCH)."""
    out: dict[tuple[str, int], float] = {}
    for line in log.splitlines():
        m = ACCOUNTED.match(line)
        if m is None or m.group(2) != namespace:
            continue
        t = time.mktime(time.strptime(m.group(1)[:19], "%Y-%m-%d %H:%M:%S"))
        t += int(m.group(1)[20:]) / 1000
        for step in m.group(4).split(","):
            out.setdefault((m.group(3), int(step)), t)
    return out


class FleetJob:
    """One policy's RL job over its nodes; the simulated agents of those nodes."""

    keep_folded = False
    """``--keep-folded``: reports keep the newest ``WINDOW`` records, folded or not (the agent
    before its reports left folded records out)."""

    def __init__(
        self,
        bench: Point,
        name: str,
        nodes: list[str],
        steps: int,
        seed: int,
        pollers: int,
    ) -> None:
        self.bench = bench
        self.name = name
        self.nodes = nodes
        self.sku = models.get_sku("h100-sxm")
        replay = workload.synthetic(steps, seed=seed, num_gpus=GPUS_PER_NODE)
        self.job = sim_job.Job(replay, self.sku, "sync", seed=seed)
        ns = bench.namespace
        self.writers = {n: agent_kube.ReportWriter(bench.api, ns, name, n) for n in nodes}
        self.watchers = [agent_kube.PlanWatcher(bench.api, ns, name) for _ in range(pollers)]
        self.records: list[api_node.StepRecord] = []
        self.last_write: dict[int, float] = {}
        self.plan: api_node.ClockPlan | None = None
        self.folded = -1  # totals.throughStep as the plan watches delivered it
        self.report_bytes: list[int] = []  # per RL step: one node's stored report, JSON bytes
        self.write_bytes: list[int] = []  # every write: its request body as sent, bytes
        self.propagation: list[float] = []
        self.error: BaseException | None = None
        clocks = list(self.sku.supported_sm_clocks_mhz())
        self._gpus = {
            n: [
                api_node.GpuStatus(
                    uuid=f"GPU-{n}-{i:02d}",
                    name="NVIDIA H100 80GB HBM3",
                    supported_clocks_mhz=clocks,
                )
                for i in range(GPUS_PER_NODE)
            ]
            for n in nodes
        }

    # ----- the agents' report side ---------------------------------------------------------
    def report(self, node: str, *, ack: bool = False) -> api_node.NodeReport:
        gpus = self._gpus[node]
        if ack:
            gpus = [g.model_copy(update={"reset_acknowledged": True}) for g in gpus]
        recs = self.records[-WINDOW:]
        last = recs[-1].step if recs else -1
        folded = -1
        if not self.keep_folded:  # the agent's rule: what the operator has not folded
            kept, folded = api_node.unfolded_steps([r.step for r in recs], self.folded)
            recs = recs[len(recs) - len(kept) :]
        return api_node.NodeReport(
            policy_name=self.name,
            node_name=node,
            gpus=gpus,
            steps=recs,
            last_step=last,
            folded_through_step=folded,
            measured_joules_total=sum(
                p.energy_joules or 0.0 for r in self.records for p in r.phases
            ),
        )

    def write_all(self, *, ack: bool = False) -> float:
        """Every node writes its report (thread pool); the wall-clock time the last write ended.

        Each write stamps its own end in its thread, so this process's GIL queue (the other
        jobs' writes) does not delay the stamp.
        """

        def write(node: str, report: api_node.NodeReport) -> float:
            self.writers[node].write(report)
            return time.time()

        futs = [self.bench.pool.submit(write, n, self.report(n, ack=ack)) for n in self.nodes]
        end = max(f.result() for f in futs)
        self.write_bytes.extend(self.writers[n].last_body_bytes for n in self.nodes)
        return end

    # ----- the agents' plan side -----------------------------------------------------------
    def wait_plan(self, step: int, *, deadline_s: float = 120.0) -> api_node.ClockPlan:
        """Poll like the agents (staggered over the poll period) until all hold ``step``'s plan."""
        start = time.monotonic()
        have: dict[int, api_node.ClockPlan] = {}
        k = len(self.watchers)
        next_poll = [start + i * PLAN_POLL_S / k for i in range(k)]
        while len(have) < k:
            now = time.monotonic()
            if now - start > deadline_s:
                raise TimeoutError(f"{self.name}: no plan for step {step} in {deadline_s:.0f} s")
            i = min(range(k), key=lambda j: next_poll[j] if j not in have else float("inf"))
            time.sleep(max(0.0, next_poll[i] - now))
            exists, plan = self.watchers[i].poll()
            next_poll[i] += PLAN_POLL_S
            if exists and plan is not None and plan.step >= step:
                have[i] = plan
        self.folded = max(w.folded_through_step for w in self.watchers)
        return have[k - 1]

    # ----- the job -------------------------------------------------------------------------
    def decide(self, step: int) -> base.Plan:
        plan = self.wait_plan(step)
        if step > 0:
            self.propagation.append(time.time() - self.last_write[step - 1])
        self.plan = plan
        return plan_to_decisions(plan.model_copy(update={"step": step}))

    def observe(self, obs: base.StepObservation) -> None:
        w = obs.workload
        rec = api_node.StepRecord(
            step=obs.step,
            workload=api_node.TokenWorkloadReport(
                samples=w.samples,
                response_tokens=w.response_tokens,
                prompt_tokens=w.prompt_tokens,
                valid_tokens=w.valid_tokens,
                mean_context_tokens=w.mean_context_tokens,
            ),
            phases=[
                api_node.PhaseWindowReport(
                    phase=ph.phase,
                    duration_seconds=ph.duration_s,
                    energy_joules=ph.energy_j,
                    requested_clock_mhz=ph.requested_clock_mhz,
                    applied_clock_mhz=ph.applied_clock_mhz,
                    slowdown=ph.slowdown,
                    slices=[
                        api_node.SliceReport(
                            clock_mhz=s.clock_mhz,
                            duration_seconds=s.duration_s,
                            progress=s.progress,
                            energy_joules=s.energy_j,
                        )
                        for s in ph.slices
                    ],
                    error=ph.error,
                    # The simulator knows each slice's progress exactly (no report gaps).
                    progress_mean_gap_seconds=ph.progress_gap_s,
                )
                for ph in obs.phases.values()
            ],
            idle_energy_joules=0.0,
        )
        self.records.append(rec)
        self.last_write[obs.step] = self.write_all()
        # The object as stored (the CRD's defaults filled in, managedFields included): what
        # etcd keeps and a watch event carries; one GET per policy and step.
        first = self.writers[self.nodes[0]]
        stored = self.bench.api.get_namespaced_custom_object(
            GROUP, VERSION, self.bench.namespace, "rlenergynodereports", first.name
        )
        self.report_bytes.append(len(json.dumps(stored, separators=(",", ":"))))

    def run(self) -> None:
        try:
            sim_job.run_job(self.job, self)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - reported by the point
            self.error = exc


class Point:
    """One scale point: policies over ``nodes`` nodes in a fresh namespace."""

    def __init__(
        self,
        cluster: DevCluster,
        api: Any,
        pool: concurrent.futures.ThreadPoolExecutor,
        *,
        namespace: str,
        nodes: list[str],
        policies: int,
        steps: int,
        pollers: int,
        operator_cpu_s: Any = None,
    ) -> None:
        self.cluster = cluster
        self.operator_cpu_s = operator_cpu_s or (lambda: [float("nan")])  # s, per shard
        self.api = api
        self.pool = pool
        self.namespace = namespace
        self.nodes = nodes
        self.steps = steps
        per = len(nodes) // policies
        self.jobs = [
            FleetJob(self, f"job-{i:02d}", nodes[i * per : (i + 1) * per], steps, 11 + i, pollers)
            for i in range(policies)
        ]

    def create(self) -> None:
        self.cluster.kubectl("create", "namespace", self.namespace)
        items = [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "RLEnergyPolicy",
                "metadata": {"name": j.name, "namespace": self.namespace},
                "spec": {
                    "selector": {"matchLabels": {"app": j.name}},
                    "controller": {"warmupSteps": 1, "trialSteps": 2},
                },
            }
            for j in self.jobs
        ]
        # The operator reads only the reports of nodes that host one of the policy's pods
        # (``rlenergy_operator.podnodes``): one trainer pod per node, bound to it (KWOK runs it).
        items += [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{j.name}-{n}", "labels": {"app": j.name}},
                "spec": {
                    "nodeName": n,
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [{"name": "trainer", "image": "registry.invalid/trainer:1"}],
                },
            }
            for j in self.jobs
            for n in j.nodes
        ]
        self.cluster.kubectl(
            "apply",
            "-n",
            self.namespace,
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )

    def settle(self, *, deadline_s: float = 900.0) -> float:
        """Wait until every trainer pod of the point is Running (KWOK writes each status), as
        a job's pods are before its first RL step: ``create`` makes one pod per node at once,
        and the measured steps should not share the API server with KWOK's status writes of
        those pods (they took 0.6-2.6 s at 1,000 and 2,500 nodes). Returns the seconds
        waited; raises TimeoutError after ``deadline_s``."""
        t0 = time.monotonic()
        want = sum(len(j.nodes) for j in self.jobs)
        while True:
            running = self.cluster.kubectl(
                "get", "pods", "-n", self.namespace, "--field-selector=status.phase=Running",
                "-o", "name", timeout=120,
            ).stdout.split()  # fmt: skip
            if len(running) >= want:
                return time.monotonic() - t0
            if time.monotonic() - t0 > deadline_s:
                raise TimeoutError(
                    f"{len(running)} of {want} trainer pods Running after {deadline_s:.0f} s"
                )
            time.sleep(2.0)

    def run(self) -> dict[str, Any]:
        watch = PolicyWatch(self.cluster.kubeconfig, self.namespace)
        reports = ReportWatch(self.cluster.kubeconfig, self.namespace)
        try:
            self.create()
            settle_s = self.settle()
            # Agents start: each writes its first report (GPUs and clock tables) at once.
            t0 = time.monotonic()
            for j in self.jobs:
                j.wait_plan(0)
            for j in self.jobs:
                j.write_all()
            initial_s = time.monotonic() - t0
            metrics_before = apiserver_metrics(self.cluster)
            before = request_counts(metrics_before)
            t_start, cpu_start = time.monotonic(), list(self.operator_cpu_s())
            threads = [threading.Thread(target=j.run, name=j.name) for j in self.jobs]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=900)
            # The last step's status.
            for j in self.jobs:
                deadline = time.monotonic() + 60
                while watch.first_seen(j.name, self.steps - 1) is None:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            elapsed = time.monotonic() - t_start
            shard_cpu_s = [b - a for a, b in zip(cpu_start, self.operator_cpu_s(), strict=True)]
            metrics_text = apiserver_metrics(self.cluster)
            after = request_counts(metrics_text)
            errors = [f"{j.name}: {j.error!r}" for j in self.jobs if j.error is not None]
            lags: list[float] = []
            missing = 0
            for j in self.jobs:
                for step, t_write in j.last_write.items():
                    seen = watch.first_seen(j.name, step)
                    if seen is None:
                        missing += 1
                    else:
                        lags.append(max(0.0, seen - t_write))
            prop = [p for j in self.jobs for p in j.propagation]
            writes = {(j.name, step): t for j in self.jobs for step, t in j.last_write.items()}
            seen_at = {key: watch.first_seen(key[0], key[1]) for key in writes}
            nodes_of = {j.name: j.nodes for j in self.jobs}
            delivered = {key: reports.delivered(key[0], nodes_of[key[0]], key[1]) for key in writes}
            return {
                "namespace": self.namespace,
                "writes": writes,
                "seen": seen_at,
                "delivered": delivered,
                "report_watch_restarts": reports.restarts,
                "metrics_before": metrics_before,
                "nodes": len(self.nodes),
                "gpus": len(self.nodes) * GPUS_PER_NODE,
                "policies": len(self.jobs),
                "steps": self.steps,
                "settle_s": settle_s,
                "initial_s": initial_s,
                "elapsed_s": elapsed,
                "operator_cpu_s": sum(shard_cpu_s),
                "shard_cpu_s": shard_cpu_s,
                "lags": lags,
                "lag_missing": missing,
                "propagation": prop,
                "requests": after - before,
                "metrics": metrics_text,
                "report_bytes": [b for j in self.jobs for b in j.report_bytes],
                "write_bytes": [b for j in self.jobs for b in j.write_bytes],
                "patched": sum(w.patched for j in self.jobs for w in j.writers.values()),
                "errors": errors,
            }
        finally:
            watch.stop()
            reports.stop()

    def teardown(self) -> float:
        """Delete the policies; the agents acknowledge the reset plan (the finalizer's wait)."""
        t0 = time.monotonic()
        self.cluster.kubectl("delete", "rlep", "--all", "-n", self.namespace, "--wait=false")
        for j in self.jobs:
            deadline = time.monotonic() + 60
            while True:
                exists, plan = j.watchers[0].poll()
                if not exists or (plan is not None and not plan.enforce):
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            if exists:
                j.write_all(ack=True)
        self.cluster.kubectl(
            "wait",
            "--for=delete",
            "rlep",
            "--all",
            "-n",
            self.namespace,
            "--timeout=90s",
            check=False,
            timeout=120,
        )
        self.cluster.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)
        return time.monotonic() - t0

    def stop_watchers(self) -> None:
        """End the simulated agents' plan watches (before the next point or the cluster stops:
        a watch cut by the API server's exit logs a reconnect warning)."""
        for j in self.jobs:
            for w in j.watchers:
                w.stop()


def summarize(res: dict[str, Any], ops: list[Operator]) -> list[str]:
    rss = [op.rss_mb() for op in ops]
    cur, peak = max(r[0] for r in rss), max(r[1] for r in rss)
    req: collections.Counter[tuple[str, str, str]] = res["requests"]
    dt = res["elapsed_s"]
    by: collections.Counter[tuple[str, str]] = collections.Counter()
    conflicts = 0
    conflict_by: collections.Counter[str] = collections.Counter()
    for (verb, resource, code), n in req.items():
        if n <= 0:
            continue
        by[(verb, resource)] += n
        if code == "409":
            conflicts += n
            conflict_by[f"{verb} {resource}"] += n
    writes = sum(
        n
        for (verb, resource, code), n in req.items()
        if resource == "rlenergynodereports"
        and verb in ("PATCH", "CREATE", "UPDATE", "APPLY")
        and code.startswith("2")
    )
    status_writes = sum(
        n
        for (verb, resource, code), n in req.items()
        if resource == "rlenergypolicies/status"
        and verb in ("PATCH", "UPDATE")
        and code.startswith("2")
    )
    per_node_step = writes / (res["nodes"] * res["steps"])
    lags, prop = res["lags"], res["propagation"]
    folded = res["accounted"]
    fold_lags = [max(0.0, folded[key] - t) for key, t in res["writes"].items() if key in folded]
    delivered = res["delivered"]
    delivery = [max(0.0, d - res["writes"][k]) for k, d in delivered.items() if d is not None]
    after_delivery = [
        max(0.0, folded[k] - d) for k, d in delivered.items() if d is not None and k in folded
    ]
    m0, m1 = res["metrics_before"], res["metrics"]
    patch_s, patches = mean_seconds(
        m0, m1, "apiserver_request_duration_seconds", resource="rlenergynodereports", verb="PATCH"
    )
    etcd_s, updates = mean_seconds(
        m0, m1, "etcd_request_duration_seconds", resource="rlenergynodereports", operation="update"
    )
    n = res["nodes"]
    lines = [
        f"== {n} nodes x {GPUS_PER_NODE} GPUs ({res['gpus']} GPUs), {res['policies']} policies, "
        f"{res['steps']} RL steps in {dt:.1f} s (trainer pods Running after "
        f"{res['settle_s']:.1f} s; agents' first reports: {res['initial_s']:.1f} s)",
        f"  operator RSS now {cur:.0f} MB, peak {peak:.0f} MB (target <= {TARGET_RSS_MB:.0f})"
        f"  {'OK' if peak <= TARGET_RSS_MB else 'MISSED'}; {peak / n * 1e3:.0f} kB per node"
        + (f" (the largest of {len(ops)} shards)" if len(ops) > 1 else ""),
        f"  operator CPU over the steps: {res['operator_cpu_s']:.1f} s ({res['operator_cpu_s'] / dt:.2f}"
        f" cores), {res['operator_cpu_s'] / (n * res['steps']) * 1e3:.2f} ms per node report "
        f"write (its watch event, index and fold)"
        + (f", all {len(ops)} shards together" if len(ops) > 1 else ""),
        *(
            f"    shard {k} of {len(ops)}: CPU {c:.1f} s ({c / (n * res['steps']) * 1e3:.2f} ms per "
            f"node report write of the cluster), RSS now {r[0]:.0f} MB, peak {r[1]:.0f} MB, "
            f"{len(res['shard_policies'][k])} policies"
            for k, (c, r) in enumerate(zip(res["shard_cpu_s"], rss, strict=True))
            if len(ops) > 1
        ),
        f"  status lag (last report of a step -> status shows it): p50 {pct(lags, 50):.2f} s, "
        f"p99 {pct(lags, 99):.2f} s, max {max(lags, default=float('nan')):.2f} s over {len(lags)} "
        f"steps, {res['lag_missing']} never seen (target p99 <= {TARGET_LAG_P99_S:.0f} s)"
        f"  {'OK' if lags and pct(lags, 99) <= TARGET_LAG_P99_S and not res['lag_missing'] else 'MISSED'}",
        f"    of which in the operator (last report -> the operator logs the step accounted, "
        f"before its status PATCH): p50 {pct(fold_lags, 50):.2f} s, p99 {pct(fold_lags, 99):.2f} s "
        f"over {len(fold_lags)} steps",
        f"    the API server's watch delivery (last report written -> an independent watch on "
        f"the reports has every node's report of the step): p50 {pct(delivery, 50):.2f} s, p99 "
        f"{pct(delivery, 99):.2f} s over {len(delivery)} steps ({res['report_watch_restarts']} "
        f"watch restarts); then the operator (-> accounted): p50 {pct(after_delivery, 50):.2f} s, "
        f"p99 {pct(after_delivery, 99):.2f} s",
        f"    API server per report PATCH (apiserver_request_duration_seconds): mean "
        f"{patch_s:.3f} s over {patches}; of which its etcd update "
        f"(etcd_request_duration_seconds): mean {etcd_s:.3f} s over {updates}",
        f"  plan propagation (last report of a step -> every agent holds the next plan, "
        f"{PLAN_POLL_S:.0f} s polls): p50 {pct(prop, 50):.2f} s, p99 {pct(prop, 99):.2f} s",
        f"  node report write (PATCH body as sent; JSON Patch of the changes once the stored "
        f"object is known, {res['patched']} of {len(res['write_bytes'])}): p50 "
        f"{pct(res['write_bytes'], 50) / 1e3:.2f} kB, max "
        f"{max(res['write_bytes'], default=0) / 1e3:.1f} kB (target p50 <= {TARGET_WRITE_KB:.0f} "
        f"kB)  {'OK' if pct(res['write_bytes'], 50) <= TARGET_WRITE_KB * 1e3 else 'MISSED'}",
        f"  node report object (one node's as stored after its write, JSON: what etcd keeps and a "
        f"watch event carries; "
        f"{'the newest 32 records' if FleetJob.keep_folded else 'the records not folded yet'}): "
        f"p50 {pct(res['report_bytes'], 50) / 1e3:.1f} kB, max "
        f"{max(res['report_bytes'], default=0) / 1e3:.1f} kB",
        f"  node report writes per node per RL step: {per_node_step:.2f} ({writes} writes; target "
        f"<= 1)  {'OK' if per_node_step <= 1.0 + 1e-9 else 'MISSED'}",
        f"  policy status writes: {status_writes} ({status_writes / (res['policies'] * res['steps']):.2f} "
        f"per policy per step)",
        f"  409 conflicts: {conflicts} (agents' writes retry 409; unresolved = failed writes: "
        f"{len(res['errors'])})  {'OK' if not res['errors'] else 'MISSED'}; by request: "
        + (", ".join(f"{k} {v}" for k, v in conflict_by.most_common(5)) or "none"),
        f"  a real fleet holds one plan watch per node (a LIST, then a WATCH renewed every "
        f"{WATCH_TIMEOUT_S:.0f} s): {n * 2 / WATCH_TIMEOUT_S:.1f} requests/s extrapolated "
        f"(polling status.plan every {PLAN_POLL_S:.0f} s was {n / PLAN_POLL_S:.0f} GET/s; "
        f"simulated here with fewer watchers)",
        "  API requests/s over the RL steps by verb and resource (top 14):",
    ]
    for (verb, resource), cnt in by.most_common(14):
        lines.append(f"    {verb:<7} {resource:<34} {cnt / dt:8.2f}/s  ({cnt})")
    for e in res["errors"]:
        lines.append(f"  ERROR {e}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="250,1000", help="node counts, ascending")
    ap.add_argument("--steps", type=int, default=5, help="RL steps per point")
    ap.add_argument("--policies", type=int, default=20)
    ap.add_argument("--pollers", type=int, default=4, help="plan watchers per policy")
    ap.add_argument("--workers", type=int, default=12, help="report-writer threads")
    ap.add_argument(
        "--keep-folded",
        action="store_true",
        help="reports keep the newest 32 records, folded or not (before the agents left the "
        "folded records out): the object size to compare with",
    )
    ap.add_argument(
        "--shards",
        default="1",
        help="operator shard counts to run side by side at each point, in this order; a count "
        "given again runs again (RLENERGY_OPERATOR_SHARDS; one operator process per shard)",
    )
    ap.add_argument(
        "--operator-verbose",
        action="store_true",
        help="run the operator with --verbose (logs each report it indexes; large at scale)",
    )
    args = ap.parse_args(argv)
    # SIGTERM (``kill``, a CI timeout) unwinds like Ctrl-C: the ``finally`` blocks stop the
    # operator processes and the cluster; the default action left the operators running.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    FleetJob.keep_folded = args.keep_folded
    points = [int(x) for x in args.points.split(",")]
    shard_counts = [int(x) for x in args.shards.split(",")]
    out_lines: list[str] = []
    step_rows: list[dict[str, Any]] = []
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlenergy-bench-scale-") as tmp:
        # KWOK renews all 1,000 leases from one process: on 2 shared cores it fell behind and
        # the node lifecycle controller tainted nodes and re-created DaemonSet pods during the
        # steps (thousands of node PATCHes); a real node's kubelet renews its own.
        cluster = DevCluster(startup_timeout=600, node_monitor_grace_s=NODE_GRACE_S)
        with cluster:
            t0 = time.monotonic()
            cluster.start(nodes=points[0], gpus_per_node=GPUS_PER_NODE)
            print(
                f"dev cluster with {points[0]} nodes up in {time.monotonic() - t0:.0f} s",
                flush=True,
            )
            cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
            cluster.wait_crds_established(
                "rlenergypolicies.rlenergy.io", "rlenergynodereports.rlenergy.io"
            )
            cluster.kubectl("create", "namespace", "rl-energy-system")
            # the agents' own client (rlenergy_agent.kubeapi), as their writers and watchers use
            api = agent_kube.load_api(str(cluster.kubeconfig), pool_maxsize=args.workers + 8)
            runs = [(n, count) for n in points for count in shard_counts]
            all_ops: list[Operator] = []
            pool = concurrent.futures.ThreadPoolExecutor(args.workers)
            try:
                for k, (n, count) in enumerate(runs):
                    have = len(cluster.nodes)
                    if n > have:
                        t0 = time.monotonic()
                        cluster.add_nodes(n - have, timeout=600)
                        print(
                            f"added {n - have} nodes in {time.monotonic() - t0:.0f} s", flush=True
                        )
                    # Fresh operator processes per run: each shard's CPU and RSS are its own.
                    ops = [
                        Operator(
                            cluster,
                            Path(tmp) / f"operator-{n}-{count}-{i}.log",
                            "rl-energy-system",
                            verbose=args.operator_verbose,
                            shard=(count, i),
                        )
                        for i in range(count)
                    ]
                    all_ops += ops
                    # one namespace per run: a count may be given more than once (runs in a row)
                    namespace = (
                        f"scale-{n}" if len(shard_counts) == 1 else f"scale-{n}-s{count}-{k}"
                    )
                    point = Point(
                        cluster,
                        api,
                        pool,
                        namespace=namespace,
                        nodes=cluster.nodes[:n],
                        policies=args.policies,
                        steps=args.steps,
                        pollers=args.pollers,
                        operator_cpu_s=lambda ops=ops: [op.cpu_s() for op in ops],
                    )
                    print(f"running {n} nodes, {count} operator shard(s) ...", flush=True)
                    res = point.run()
                    res["accounted"] = folded = accounted_times(
                        "".join(op.log.read_text(errors="replace") for op in ops), res["namespace"]
                    )
                    res["shard_policies"] = [
                        [
                            j.name
                            for j in point.jobs
                            if shards.shard_of(namespace, j.name, count) == i
                        ]
                        for i in range(count)
                    ]
                    lines = summarize(res, ops)
                    step_rows += [
                        {
                            "nodes": n,
                            "shards": count,
                            "policy": job,
                            "step": step,
                            "last_write": t,
                            "accounted": folded.get((job, step)),
                            "seen": res["seen"].get((job, step)),
                            "delivered": res["delivered"].get((job, step)),
                        }
                        for (job, step), t in sorted(res["writes"].items())
                    ]
                    print("\n".join(lines), flush=True)
                    out_lines += lines
                    (ROOT / "out").mkdir(exist_ok=True)
                    (ROOT / "out" / f"bench-scale-apiserver-metrics-{n}.txt").write_text(
                        res["metrics"]
                    )
                    if k < len(runs) - 1:
                        print(
                            f"  teardown (reset acks, finalizers) {point.teardown():.1f} s",
                            flush=True,
                        )
                    point.stop_watchers()
                    exited = any(op.proc.poll() is not None for op in ops)
                    for op in ops:
                        op.stop()
                    if exited:
                        print("operator exited!", file=sys.stderr)
                        break
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
                for op in all_ops:
                    op.stop()
                log = "".join(op.log.read_text(errors="replace") for op in all_ops)
                (ROOT / "out").mkdir(exist_ok=True)
                (ROOT / "out" / "bench-scale-operator.log").write_text(log)
                tb = log.count("Traceback (most recent call last)")
                out_lines.append(f"operator log: {len(log.splitlines())} lines, {tb} tracebacks")
                if tb:
                    print(log[-3000:], file=sys.stderr)
                mem = cluster.memory()
                out_lines.append(
                    "control plane peak RSS: "
                    + ", ".join(f"{k} {v[1] / 1024:.0f} MB" for k, v in mem.items())
                )
    out_lines.append(f"total {time.monotonic() - t_all:.0f} s")
    print("\n".join(out_lines[-3:]))
    summary = ROOT / "out" / "bench-scale.txt"
    summary.parent.mkdir(exist_ok=True)
    summary.write_text("\n".join(out_lines) + "\n")
    # Per policy and step, wall-clock times (time.time()): for reading where a lag comes from.
    (ROOT / "out" / "bench-scale-steps.json").write_text(json.dumps(step_rows, indent=1))
    print(f"summary written to {summary.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
