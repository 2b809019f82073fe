"""``helm install`` into the dev cluster, the operator running, a policy applied.

The chart is installed with the in-cluster operator scaled to 0 and the operator runs as a local
process configured from the chart's ConfigMap (what the in-cluster Deployment gets through
``envFrom``), as in ``make demo``. KWOK's pod stages make the agent pods bound to the fake GPU
nodes Running and Ready. We check:

* the agent DaemonSet exists with one Running pod per fake GPU node and carries the chart's
  settings (image, port, hostPath, resources, ServiceAccount, priority class, GPU toleration,
  capabilities);
* with ``agent.tolerateGpuTaint=false`` no agent schedules on the tainted GPU nodes: the install
  NOTES warn, the policy goes Degraded (``AgentsUnschedulable``) with a message naming the
  missing ``nvidia.com/gpu`` toleration and the fix, a Warning Event is posted, and the
  documented fix (``helm upgrade --reuse-values --set agent.tolerateGpuTaint=true``) brings one
  agent per node and clears the condition;
* the documented uninstall order (delete the policies while the operator and the agents run,
  then ``helm uninstall``) leaves no GPU clock locked on the stand-in NVML and no policy or
  namespace held by a finalizer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import get_json, wait_until
from rlenergy_dev import fullstack, standin
from rlenergy_dev.devcluster import DevCluster

from tests import factories

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rl-energy"
AGENT_SELECTOR = "app.kubernetes.io/name=rlenergy-node-agent"
DAEMONSET = "rlenergy-node-agent"
FAST = {
    "RLENERGY_OPERATOR_RECONCILE_INTERVAL_S": "0.5",
    "RLENERGY_OPERATOR_RESET_DEADLINE_S": "30",
    "RLENERGY_OPERATOR_AGENT_CHECK_INTERVAL_S": "1",
}
"""Shorter operator periods than the chart's (same code paths, a shorter test)."""
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


class Release:
    """A chart release in the test's namespace with the operator as a local process."""

    def __init__(self, cluster: DevCluster, namespace: str, workdir: Path, name: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.workdir = workdir
        self.name = name
        self.installed = False
        self.notes = ""

    def install(self, *values: str) -> None:
        self.cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
        res = self.cluster.helm(
            "install", self.name, str(CHART), "-n", self.namespace,
            "--set", "operator.replicas=0", *values, "--wait", "--timeout", "120s",
        )  # fmt: skip
        self.installed = True
        self.notes = res.stdout

    def upgrade(self, *values: str) -> None:
        self.cluster.helm(
            "upgrade", self.name, str(CHART), "-n", self.namespace, "--reuse-values", *values,
            "--wait", "--timeout", "120s",
        )  # fmt: skip

    def operator_env(self) -> dict[str, str]:
        """The chart's operator settings (its ConfigMap), with the test's short periods."""
        cm = get_json(
            self.cluster, "configmap", f"{self.name}-rl-energy-config", "-n", self.namespace
        )
        return {**cm["data"], **FAST}

    def stack(self, policy: str, lib_dir: Path, tag: str) -> fullstack.FullStack:
        return fullstack.FullStack(
            self.cluster.kubeconfig, self.namespace, policy, self.cluster.nodes,
            self.workdir / tag, lib_dir, operator_env=self.operator_env(),
        )  # fmt: skip

    def uninstall(self) -> None:
        if self.installed:
            self.cluster.helm("uninstall", self.name, "-n", self.namespace, "--wait")
            self.installed = False


@pytest.fixture
def release(dev_cluster: DevCluster, namespace: str, tmp_path: Path) -> Iterator[Release]:
    rel = Release(dev_cluster, namespace, tmp_path, f"rl{namespace[-6:]}")
    try:
        yield rel
    finally:
        rel.uninstall()


@pytest.fixture(scope="module")
def lib_dir() -> Path:
    return standin.build_library(ROOT / "build" / "nvml-standin")


def _agent_pods(cluster: DevCluster, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(cluster, "pods", "-n", namespace, "-l", AGENT_SELECTOR)[
        "items"
    ]
    return items


def _one_running_agent_per_node(cluster: DevCluster, namespace: str) -> list[dict[str, Any]] | None:
    pods = _agent_pods(cluster, namespace)
    running = [p for p in pods if p["status"].get("phase") == "Running"]
    nodes = sorted(p["spec"].get("nodeName", "") for p in running)
    return running if len(pods) == len(cluster.nodes) and nodes == sorted(cluster.nodes) else None


def _delete_policy(cluster: DevCluster, namespace: str, name: str) -> float:
    """Delete the policy and wait until it is gone; returns the seconds it took."""
    t0 = time.monotonic()
    cluster.kubectl("delete", "rlep", name, "-n", namespace, "--timeout=90s")
    return time.monotonic() - t0


@pytest.fixture
def priority_class(dev_cluster: DevCluster, namespace: str) -> Iterator[str]:
    """A PriorityClass of value 100000 for the agents (cluster-scoped, removed afterwards)."""
    name = f"{namespace}-agents"
    body = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": 100000,
    }
    dev_cluster.kubectl("create", "-f", "-", input=json.dumps(body))
    yield name
    dev_cluster.kubectl("delete", "priorityclass", name, "--wait=false", check=False)


def test_agents_run_on_every_gpu_node_with_the_charts_settings(
    dev_cluster: DevCluster, namespace: str, release: Release, lib_dir: Path, priority_class: str
):
    release.install(
        "--set", "agent.image.repository=registry.example/rl-agent", "--set", "agent.image.tag=9.9",
        "--set", "agent.metricsPort=9500", "--set", "agent.stateDir=/srv/rlenergy",
        "--set", "agent.resources.limits.memory=160Mi", "--set", "agent.resources.requests.cpu=20m",
        "--set", f"agent.priorityClassName={priority_class}",
    )  # fmt: skip
    policy = factories.sample_policy()
    name = policy["metadata"]["name"]
    with release.stack(name, lib_dir, "stack") as stack:
        stack.start_operator()
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
        pods = wait_until(
            lambda: _one_running_agent_per_node(dev_cluster, namespace),
            timeout=120,
            what="one Running agent pod per GPU node",
        )
        ds = wait_until(
            lambda: (
                d
                if (d := get_json(dev_cluster, "daemonset", DAEMONSET, "-n", namespace))[
                    "status"
                ].get("numberReady")
                == len(dev_cluster.nodes)
                else None
            ),
            timeout=60,
            what="DaemonSet numberReady = GPU nodes",
        )
        assert ds["status"]["desiredNumberScheduled"] == len(dev_cluster.nodes)
        pod = ds["spec"]["template"]["spec"]
        agent = pod["containers"][0]
        assert agent["image"] == "registry.example/rl-agent:9.9"
        assert agent["ports"][0]["containerPort"] == 9500
        assert {"name": "RLENERGY_AGENT_METRICS_PORT", "value": "9500"} in agent["env"]
        assert agent["resources"]["limits"]["memory"] == "160Mi"
        assert agent["resources"]["requests"]["cpu"] == "20m"
        assert pod["serviceAccountName"] == f"{release.name}-rl-energy-agent"
        paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
        assert paths["state"] == "/srv/rlenergy"
        assert GPU_TOLERATION in pod["tolerations"]
        assert pod["priorityClassName"] == priority_class
        sec = agent["securityContext"]
        assert sec["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
        assert sec["privileged"] is False and sec["readOnlyRootFilesystem"] is True
        for p in pods:  # the pods themselves, as the API server admitted them
            assert p["spec"]["containers"][0]["image"] == "registry.example/rl-agent:9.9"
            assert p["spec"]["serviceAccountName"] == f"{release.name}-rl-energy-agent"
            assert p["spec"]["priority"] == 100000  # the Priority admission resolved the class
        wait_until(
            lambda: _condition(stack.policy_status(), "Ready").get("status") == "True",
            timeout=60,
            what="policy Ready",
        )
        degraded = _condition(stack.policy_status(), "Degraded")
        assert degraded.get("status") == "False", degraded
        deleted_s = _delete_policy(dev_cluster, namespace, name)
        assert deleted_s < 25, f"finalizer took {deleted_s:.1f} s"


def test_missing_gpu_toleration_degrades_the_policy_and_the_documented_fix_works(
    dev_cluster: DevCluster, namespace: str, release: Release, lib_dir: Path
):
    release.install("--set", "agent.tolerateGpuTaint=false")
    assert "WARNING: agent.tolerateGpuTaint=false" in release.notes
    policy = factories.sample_policy()
    name = policy["metadata"]["name"]
    with release.stack(name, lib_dir, "untolerated") as stack:
        stack.start_operator()
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
        degraded = wait_until(
            lambda: (
                c
                if (c := _condition(stack.policy_status(), "Degraded")).get("reason")
                == "AgentsUnschedulable"
                else None
            ),
            timeout=180,  # 27 s alone; a fresh-clone CI run beside two real-node runs took >90
            what="Degraded AgentsUnschedulable",
        )
        assert degraded["status"] == "True"
        message = degraded["message"]
        assert "nvidia.com/gpu=present:NoSchedule" in message, message
        assert "toleration is missing" in message, message
        assert "--set agent.tolerateGpuTaint=true" in message, message
        ds = get_json(dev_cluster, "daemonset", DAEMONSET, "-n", namespace)
        assert ds["spec"]["template"]["spec"].get("tolerations") in (None, [])
        assert ds["status"]["desiredNumberScheduled"] == 0
        assert _agent_pods(dev_cluster, namespace) == []
        events = wait_until(
            lambda: [
                e
                for e in get_json(dev_cluster, "events", "-n", namespace)["items"]
                if e.get("reason") == "AgentsUnschedulable"
                and e["involvedObject"].get("name") == name
            ],
            timeout=30,
            what="Warning event AgentsUnschedulable",
        )
        assert events[0]["type"] == "Warning"
        assert "--set agent.tolerateGpuTaint=true" in events[0]["message"]
        stack.stop_operator()

    # The fix from the message and docs/install.md: the new ConfigMap restarts the operator
    # (a local process here), which re-renders the DaemonSet with the toleration.
    release.upgrade("--set", "agent.tolerateGpuTaint=true")
    with release.stack(name, lib_dir, "fixed") as stack:
        assert stack.operator_env["RLENERGY_OPERATOR_AGENT_TOLERATE_GPU_TAINT"] == "true"
        stack.start_operator()
        wait_until(
            lambda: _one_running_agent_per_node(dev_cluster, namespace),
            timeout=120,
            what="one Running agent pod per GPU node after the fix",
        )
        wait_until(
            lambda: _condition(stack.policy_status(), "Degraded").get("status") == "False",
            timeout=60,
            what="Degraded cleared",
        )
        deleted_s = _delete_policy(dev_cluster, namespace, name)
        assert deleted_s < 25, f"finalizer took {deleted_s:.1f} s"


@pytest.mark.timeout(420)
def test_delete_policies_then_helm_uninstall_leaves_no_locked_clock_or_finalizer(
    dev_cluster: DevCluster, namespace: str, release: Release, lib_dir: Path
):
    release.install()
    warmup = 2
    policy = factories.sample_policy(warmupSteps=warmup, trialSteps=2)
    name = policy["metadata"]["name"]
    with release.stack(name, lib_dir, "stack") as stack:
        stack.start_operator()
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
        stack.start_agents()
        job, _ = fullstack.compressed_replay(
            fullstack.DEFAULT_TRACE, stack.sku, warmup, num_gpus=24,
            longest_phase_s=fullstack.LONGEST_PHASE_S,
        )  # fmt: skip
        stack.run_trainer(job)
        # The job is in the first trial's generation when the policy goes: the agents lock the
        # trial's probe clocks slice by slice, or the whole phase at the trial clock when the
        # trainer's progress reports in warm-up came too far apart for eight slices in the short
        # compressed phase (EE-RL then alternates whole steps and says so in probeEvidence; seen
        # in a fresh-clone CI run: clockMHz 1845, no probe clocks).
        stack.wait_plan(warmup)
        gen = next(p for p in stack.policy_status()["plan"]["phases"] if p["phase"] == "generation")
        probed = [c for c in gen["probeClocksMHz"] if c is not None]
        assert probed or gen["clockMHz"] is not None, gen
        for a in stack.agents:
            assert a.callback is not None
            a.callback.on_generation_start(warmup)
        every = {u for a in stack.agents for u in a.uuids}
        seen: set[str] = set()

        def locked_once() -> bool:  # slices may include the default governor (unlocked)
            seen.update(u for a in stack.agents for u in a.uuids if a.driver.gpu(u).locked)
            return seen == every

        wait_until(locked_once, timeout=10, interval=0.005, what="every GPU locked by a slice")
        # 1. Policies first, while the operator and the agents run: the finalizer waits for
        #    every GPU's reset acknowledgement.
        deleted_s = _delete_policy(dev_cluster, namespace, name)
        assert deleted_s < 25, f"finalizer took {deleted_s:.1f} s"
        still = [u for a in stack.agents for u in a.uuids if a.driver.gpu(u).locked]
        assert still == [], f"locked after the policy went: {still}"
        events = get_json(dev_cluster, "events", "-n", namespace)["items"]
        assert not [e for e in events if e.get("reason") == "ResetDeadlineExceeded"]
        # 2. Then the release.
        release.uninstall()
        stack.stop_agents()
        still = [u for a in stack.agents for u in a.uuids if a.driver.gpu(u).locked]
        assert still == [], f"locked after helm uninstall: {still}"
        stack.stop_operator()
    assert get_json(dev_cluster, "rlep", "-n", namespace)["items"] == []
    # No finalizer holds the namespace: it goes away (reports and all) within the timeout.
    t_ns = time.monotonic()
    dev_cluster.kubectl("delete", "namespace", namespace, "--timeout=120s")
    res = dev_cluster.kubectl("get", "namespace", namespace, check=False)
    assert res.returncode != 0 and "NotFound" in res.stderr, res.stdout
    print(
        f"\nuninstall: policy finalizer lifted in {deleted_s:.1f} s, namespace gone in "
        f"{time.monotonic() - t_ns:.1f} s"
    )


def test_helm_install_refuses_invalid_values_with_their_path(
    dev_cluster: DevCluster, namespace: str
):
    """values.schema.json on a real ``helm install`` (test_helm_chart.py covers ``template``)."""
    for args, path in [
        (["--set", "agent.tolerateGpuTaint=maybe"], "/agent/tolerateGpuTaint"),
        (["--set", "agent.metricsPort=70000"], "/agent/metricsPort"),
        (["--set", "operator.resetDeadlineS=-5"], "/operator/resetDeadlineS"),
    ]:
        res = dev_cluster.helm(
            "install", "bad", str(CHART), "-n", namespace, *args, check=False
        )  # fmt: skip
        assert res.returncode != 0 and path in res.stderr, (args, res.stderr)
    assert dev_cluster.helm("list", "-n", namespace, "-q").stdout.strip() == ""
