"""The operator on the real control plane (etcd, kube-apiserver v1.36, KCM, scheduler, KWOK).

We test these aspects:
* admission: every invalid spec of tests/unit/api/invalid_specs.yaml is refused by the API
  server (OpenAPI schema + CEL) with a message naming the field;
* each sample in crds/samples gets Ready with observedGeneration, and the single node-agent
  DaemonSet lands on the GPU nodes (status fields read back intact);
* a test client drives the simulator for 3 fake nodes (a pod of the job on each) and writes
  RLEnergyNodeReports: the
  policy's status gets per-phase savings and totals, ``kubectl get rlep`` shows the saving, the
  plan changes after the trials; killing the operator mid-run and restarting it loses no
  report and double counts nothing (totals equal the sum of the reports);
* deletion: the finalizer waits for every GPU's reset acknowledgement or the deadline
  (Degraded + Warning event), the DaemonSet goes with the last policy, and deleting a
  namespace with a policy completes.

The operator runs as a subprocess (``python -m rlenergy_operator --standalone``) with the
admin kubeconfig; nothing dials anything but 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import get_json, wait_until
from rlenergy_dev.devcluster import DevCluster

from rlenergy.api import node as api_node

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
SAMPLES = sorted((CRDS / "samples").glob("*.yaml"))
sys.path.insert(0, str(ROOT / "tests" / "unit" / "operator"))
sys.path.insert(0, str(ROOT / "tests" / "unit" / "api"))

from api_invalid_specs import invalid_cases  # noqa: E402
from sim_nodes import NODES as SIM_NODES  # noqa: E402
from sim_nodes import SimNodes  # noqa: E402

from tests import factories  # noqa: E402

RESET_DEADLINE_S = 8


class Operator:
    """The operator as a subprocess; ``kill()`` is SIGKILL (no graceful shutdown)."""

    def __init__(self, cluster: DevCluster, namespace: str, log: Path) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "RLENERGY_OPERATOR_NAMESPACE": self.namespace,
            "RLENERGY_OPERATOR_RECONCILE_INTERVAL_S": "1",
            "RLENERGY_OPERATOR_RESET_DEADLINE_S": str(RESET_DEADLINE_S),
            "RLENERGY_OPERATOR_RETRY_DELAY_S": "1",
            "RLENERGY_OPERATOR_WATCH_SERVER_TIMEOUT_S": "30",
        }
        self.starts += 1
        with self.log.open("ab") as out:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlenergy_operator", "--standalone", "--all-namespaces"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
            )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def operator(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path
) -> Iterator[Operator]:
    op = Operator(dev_cluster, namespace, tmp_path / "operator.log")
    op.start()
    try:
        yield op
        # Let the operator lift its finalizers before it stops (no Terminating leftovers).
        dev_cluster.kubectl(
            "delete", "rlep", "--all", "-n", namespace, "--timeout=60s", check=False
        )
    finally:
        op.stop()
    assert "Traceback (most recent call last)" not in op.output(), op.output()[-4000:]


def _policy(name: str, **spec: Any) -> str:
    body = {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": name}}, **spec},
    }
    return json.dumps(body)


def _status(cluster: DevCluster, ns: str, name: str) -> dict[str, Any]:
    obj = get_json(cluster, "rlep", name, "-n", ns)
    return dict(obj.get("status") or {})


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


# ----- admission ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", invalid_cases(), ids=lambda c: c["id"])
def test_invalid_spec_is_refused_by_the_api_server(
    dev_cluster: DevCluster, crds: None, case: dict[str, Any]
):
    body = {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": "bad", "namespace": "default"},
        "spec": case["doc"],
    }
    res = dev_cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(body), check=False
    )
    assert res.returncode != 0, f"{case['id']} was accepted"
    assert case["field"] in res.stderr, res.stderr
    assert case.get("api", "") in res.stderr, res.stderr


def test_the_samples_pass_admission(dev_cluster: DevCluster, crds: None):
    for path in SAMPLES:
        dev_cluster.kubectl("create", "--dry-run=server", "-n", "default", "-f", str(path))


# ----- samples get Ready ---------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_each_sample_gets_ready_and_one_daemonset_serves_them(
    dev_cluster: DevCluster, operator: Operator, namespace: str
):
    names = []
    for path in SAMPLES:
        dev_cluster.kubectl("apply", "-n", namespace, "-f", str(path))
        names.append(get_json(dev_cluster, "-f", str(path), "-n", namespace)["metadata"]["name"])
    for name in names:
        status = wait_until(
            lambda n=name: (
                s
                if _condition(s := _status(dev_cluster, namespace, n), "Ready").get("status")
                == "True"
                else None
            ),
            timeout=120,
            what=f"{name} Ready",
        )
        obj = get_json(dev_cluster, "rlep", name, "-n", namespace)
        assert status["observedGeneration"] == obj["metadata"]["generation"]
        assert _condition(status, "Ready")["reason"] == "AgentsDeployed"
        assert _condition(status, "Degraded")["status"] == "False"
        assert status["plan"]["step"] == 0 and status["plan"]["phases"]
        # GitOps: the operator wrote one finalizer and no annotation or label.
        assert obj["metadata"]["finalizers"] == ["rlenergy.io/reset-clocks"]
        assert not any(k.startswith("kopf") for k in obj["metadata"].get("annotations", {}))
        assert "labels" not in obj["metadata"]
    observe = _status(dev_cluster, namespace, "observe-grpo-baseline")
    assert observe["plan"]["enforce"] is False
    dss = get_json(dev_cluster, "ds", "-n", namespace)["items"]
    assert len(dss) == 1
    pod = dss[0]["spec"]["template"]["spec"]
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.present"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    sec = pod["containers"][0]["securityContext"]
    assert (
        sec["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
        and sec["privileged"] is False
    )
    wait_until(
        lambda: (
            get_json(dev_cluster, "ds", dss[0]["metadata"]["name"], "-n", namespace)
            .get("status", {})
            .get("desiredNumberScheduled")
            == 3
        ),
        timeout=120,
        what="agent DaemonSet scheduled on the 3 GPU nodes",
    )
    table = dev_cluster.kubectl("get", "rlep", "-n", namespace).stdout
    assert "SAVING %" in table and "GEN MHZ" in table and "READY NODES" in table


# ----- the job loop ------------------------------------------------------------------------------
def _write_reports(cluster: DevCluster, ns: str, reports: list[api_node.NodeReport]) -> None:
    items = [
        {
            "apiVersion": "rlenergy.io/v1alpha1",
            "kind": "RLEnergyNodeReport",
            "metadata": {"name": f"{r.policy_name}.{r.node_name}", "namespace": ns},
            "spec": r.model_dump(by_alias=True, exclude_none=True),
        }
        for r in reports
    ]
    cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=sim-agent",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
    )


def _job_pods(cluster: DevCluster, ns: str, policy: str) -> None:
    """One pod of the job on each simulated node (KWOK runs it), labelled for the policy: the
    operator reads only the reports of nodes that host the policy's pods."""
    for node in SIM_NODES:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"trainer-{node}", "labels": {"app": policy}},
            "spec": {
                "nodeName": node,
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "t", "image": "registry.invalid/trainer:1"}],
            },
        }
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod))


def _report_energy(reports: list[api_node.NodeReport]) -> tuple[float, int, float]:
    """(joules, steps, valid tokens) summed over the reports' step records."""
    joules = 0.0
    steps: dict[int, float] = {}
    for rep in reports:
        for rec in rep.steps:
            joules += sum(p.energy_joules or 0.0 for p in rec.phases) + (
                rec.idle_energy_joules or 0.0
            )
            steps[rec.step] = rec.workload.valid_tokens
    return joules, len(steps), sum(steps.values())


@pytest.mark.timeout(420)
def test_simulated_job_gets_savings_and_survives_an_operator_kill(
    dev_cluster: DevCluster, operator: Operator, namespace: str
):
    name = "sim-grpo"
    dev_cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=_policy(name, controller={"warmupSteps": 2, "trialSteps": 4}),
    )
    _job_pods(dev_cluster, namespace, name)
    wait_until(
        lambda: _condition(_status(dev_cluster, namespace, name), "Ready").get("status") == "True",
        timeout=120,
        what="Ready",
    )
    steps = 24
    kill_after = 10
    lags: list[float] = []
    plans: list[dict[str, Any]] = []
    last_plan: dict[str, Any] = {}
    state = {"written": -1}

    def publish(reports: list[api_node.NodeReport]) -> None:
        _write_reports(dev_cluster, namespace, reports)
        state["written"] = max(rep.last_step for rep in reports)
        state["t"] = time.monotonic()
        state["reports"] = reports

    def plan_for(step: int) -> api_node.ClockPlan:
        nonlocal last_plan
        if step == kill_after + 1:
            operator.kill()  # mid-run: steps keep running on the last plan
        if step == kill_after + 4:
            operator.start()
        if operator.proc is not None and operator.proc.poll() is None:
            status = wait_until(
                lambda: (
                    s
                    if (s := _status(dev_cluster, namespace, name)).get("plan", {}).get("step", -1)
                    >= step
                    else None
                ),
                timeout=120,
                interval=0.1,
                what=f"plan for step {step}",
            )
            if step > 0 and step != kill_after + 4:
                lags.append(time.monotonic() - state["t"])
            last_plan = status["plan"]
            plans.append(last_plan)
        plan = api_node.ClockPlan.model_validate(last_plan)
        return plan.model_copy(update={"step": step})

    SimNodes(name, steps, publish, window=64).run(plan_for)
    final = wait_until(
        lambda: (
            s
            if (s := _status(dev_cluster, namespace, name)).get("totals", {}).get("throughStep")
            == steps - 1
            else None
        ),
        timeout=120,
        what="all steps accounted",
    )
    totals = final["totals"]
    joules, n_steps, tokens = _report_energy(state["reports"])
    # Restart lost nothing and double counted nothing: totals equal the sum of the reports
    # (each node's share summed back: equal up to float rounding of the split).
    assert totals["steps"] == n_steps == steps
    assert totals["measuredJoules"] == pytest.approx(joules, rel=1e-9)
    assert totals["validTokens"] == pytest.approx(tokens)
    assert totals["missedSteps"] == 0 and totals["unknownEnergySteps"] == 0
    assert (
        totals["savingPercent"] > 0
        and totals["predictedDefaultJoules"] > totals["comparedMeasuredJoules"]
    )
    for ph in final["phases"]:
        assert "percent" in ph["saving"], ph
        assert ph["energyPerValidTokenJoules"] > 0
        assert ph["predictedDefaultEnergyPerValidTokenJoules"] > 0
    assert final["nodes"] == {"ready": 3, "total": 3, "errors": []}
    # The plan changed after warm-up: trials with probe clocks or locked clocks appeared.
    states = {p["state"] for plan in plans for p in plan["phases"]}
    assert "warmup" in states and "trial" in states, states
    assert any(
        p.get("probeClocksMHz") or p.get("clockMHz") for plan in plans for p in plan["phases"]
    )
    events = dev_cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "reason=PlanChanged", "-o", "name"
    ).stdout.split()
    assert len(events) >= 2
    table = dev_cluster.kubectl("get", "rlep", name, "-n", namespace).stdout.splitlines()
    saving_col = table[0].index("SAVING %")
    assert table[1][saving_col:].split()[0] not in ("<none>", ""), table
    assert "job loop rebuilt" in operator.output()
    assert operator.starts == 2
    lags.sort()
    print(
        f"status lag after a report write: median {lags[len(lags) // 2]:.2f} s, max {lags[-1]:.2f} s"
    )
    assert lags[len(lags) // 2] < 5


# ----- deletion ---------------------------------------------------------------------------------
def _report(policy: str, node: str, ack: bool) -> api_node.NodeReport:
    gpu = api_node.GpuStatus(uuid=f"GPU-{node}-0", reset_acknowledged=ack)
    return factories.node_report(node, policy=policy, gpus=[gpu])


@pytest.mark.timeout(420)
def test_finalizer_waits_for_reset_acks_or_the_deadline(
    dev_cluster: DevCluster, operator: Operator, namespace: str
):
    for name in ("acked", "silent"):
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=_policy(name))
    for name in ("acked", "silent"):
        wait_until(
            lambda n=name: (
                _condition(_status(dev_cluster, namespace, n), "Ready").get("status") == "True"
            ),
            timeout=120,
            what=f"{name} Ready",
        )
    _write_reports(
        dev_cluster,
        namespace,
        [_report("acked", "kwok-gpu-0", False), _report("silent", "kwok-gpu-0", False)],
    )
    ds = get_json(dev_cluster, "ds", "-n", namespace)["items"]
    assert len(ds) == 1

    # 1. acknowledged reset: held until the agent acknowledges, then released.
    dev_cluster.kubectl("delete", "rlep", "acked", "-n", namespace, "--wait=false")
    status = wait_until(
        lambda: (
            s
            if _condition(s := _status(dev_cluster, namespace, "acked"), "Progressing").get(
                "reason"
            )
            == "ResettingClocks"
            else None
        ),
        timeout=30,
        what="ResettingClocks",
    )
    assert status["plan"]["enforce"] is False
    assert all(p.get("clockMHz") is None for p in status["plan"]["phases"])
    time.sleep(2)
    assert dev_cluster.kubectl("get", "rlep", "acked", "-n", namespace, check=False).returncode == 0
    t0 = time.monotonic()
    _write_reports(dev_cluster, namespace, [_report("acked", "kwok-gpu-0", True)])
    wait_until(
        lambda: (
            dev_cluster.kubectl("get", "rlep", "acked", "-n", namespace, check=False).returncode
            != 0
        ),
        timeout=30,
        what="acked policy gone",
    )
    print(f"finalizer lifted {time.monotonic() - t0:.1f} s after the reset acknowledgement")
    assert len(get_json(dev_cluster, "ds", "-n", namespace)["items"]) == 1, (
        "another policy needs it"
    )

    # 2. never acknowledged: released at the deadline with Degraded + a Warning event.
    t0 = time.monotonic()
    dev_cluster.kubectl("delete", "rlep", "silent", "-n", namespace, "--wait=false")
    wait_until(
        lambda: (
            dev_cluster.kubectl("get", "rlep", "silent", "-n", namespace, check=False).returncode
            != 0
        ),
        timeout=RESET_DEADLINE_S + 30,
        what="silent policy gone after the deadline",
    )
    assert time.monotonic() - t0 >= RESET_DEADLINE_S - 1
    events = dev_cluster.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        "reason=ResetDeadlineExceeded",
        "-o",
        "name",
    ).stdout.split()
    assert events
    wait_until(
        lambda: not get_json(dev_cluster, "ds", "-n", namespace)["items"],
        timeout=30,
        what="DaemonSet deleted with the last policy",
    )


@pytest.mark.timeout(360)
def test_deleting_a_namespace_with_a_policy_completes(
    dev_cluster: DevCluster, operator: Operator, namespace: str
):
    ns = f"{namespace[:50]}-x"
    dev_cluster.kubectl("create", "namespace", ns)
    wait_until(
        lambda: dev_cluster.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0,
        timeout=120,
        what="default SA",
    )
    dev_cluster.kubectl("apply", "-n", ns, "-f", "-", input=_policy("doomed"))
    wait_until(
        lambda: _condition(_status(dev_cluster, ns, "doomed"), "Ready").get("status") == "True",
        timeout=120,
        what="Ready",
    )
    _write_reports(dev_cluster, ns, [_report("doomed", "kwok-gpu-1", False)])
    t0 = time.monotonic()
    dev_cluster.kubectl("delete", "namespace", ns, "--wait=false")
    wait_until(
        lambda: dev_cluster.kubectl("get", "namespace", ns, check=False).returncode != 0,
        timeout=120,
        what=f"namespace {ns} gone",
    )
    print(f"namespace with a policy deleted in {time.monotonic() - t0:.1f} s")
