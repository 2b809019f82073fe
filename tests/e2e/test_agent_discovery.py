"""Policy discovery on the real control plane: an agent started WITHOUT a policy finds the one
that governs its node's GPU pods, follows a relabelled pod to another policy, and governs
nothing on a conflict.

What runs: the CRDs on the dev cluster; a trainer pod bound to a KWOK GPU node (KWOK makes it
Running); a fake kubelet PodResources server (``rlenergy_agent.podmap.serve_fake_kubelet``)
that allocates two stand-in GPUs to that pod; one agent process for that node on the stand-in
``libnvidia-ml.so.1``, with no ``--policy`` and no ``RLENERGY_AGENT_POLICY_NAME``. No operator:
the test writes ``status.plan`` itself.

We check:
* the agent's node report appears for the policy whose selector matches the pod's labels (not
  for the other policy of the namespace), and the plan of that policy locks the pod's GPUs on a
  phase signal;
* relabelling the pod moves the agent to the other policy: the old policy's clocks are reset
  (the stand-in GPUs unlocked) and its report acknowledges the reset; the new policy's report
  appears;
* a third policy selecting the same pod is a conflict: the agent governs nothing, says so in
  its log and in ``rlenergy_agent_policy_discovery``;
* the pure matcher (``rlenergy.api.selector.matches``) agrees with the API server's own
  label-selector evaluation on a table of pods and selectors.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import get_json, get_json_if_found, wait_until
from rlenergy_agent import podmap
from rlenergy_dev import standin
from rlenergy_dev.devcluster import DevCluster, trainers

from rlenergy.api import naming, selector
from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.gpu import models
from rlenergy.sdk import trainer
from tests import factories

ROOT = Path(__file__).resolve().parents[2]
POD = "trainer-0"
LOCK_MHZ = 1395


def _policy(name: str, sel: dict[str, Any]) -> str:
    return json.dumps(factories.sample_policy(name=name, selector=sel))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short folder for Unix sockets (108-byte path limit)."""
    with tempfile.TemporaryDirectory(prefix="rle-", dir="/tmp") as d:
        yield Path(d)


def _report(cluster: DevCluster, ns: str, policy: str, node: str) -> dict[str, Any] | None:
    return get_json_if_found(
        cluster, "rlenergynodereports", naming.report_name(policy, node), "-n", ns
    )


def _discovery_metric(port: int) -> dict[str, str] | None:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # noqa: S310
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "rlenergy_agent_policy_discovery":
            labels = dict(fam.samples[0].labels)
            assert labels.pop("node")  # every agent family carries its node
            return labels
    return None


@pytest.mark.timeout(300)
def test_agent_discovers_follows_and_refuses_to_guess_its_policy(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path, short_dir: Path
):
    node = dev_cluster.nodes[0]
    ns = namespace
    k = dev_cluster.kubectl
    k("apply", "-n", ns, "-f", "-", input=_policy("grpo", {"matchLabels": {"job": "grpo"}}))
    k(
        "apply", "-n", ns, "-f", "-",
        input=_policy("dpo", {"matchExpressions": [
            {"key": "job", "operator": "In", "values": ["dpo", "dpo-v2"]}
        ]}),
    )  # fmt: skip
    # the trainer: a pod object on the node and a token the API server bound to it
    pod = trainers.create_trainer(k, ns, POD, node, tmp_path, labels={"job": "grpo"}, gpus=2)
    wait_until(
        lambda: get_json(dev_cluster, "pod", POD, "-n", ns)["status"].get("phase") == "Running",
        timeout=90,
        what="trainer pod Running on the KWOK node",
    )

    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    uuids = [f"GPU-{node}-disc-{i}" for i in range(2)]
    sku = models.get_sku("h100-sxm")
    kubelet_sock = str(short_dir / "kubelet.sock")
    agent_sock = short_dir / "agent.sock"
    kubelet = podmap.serve_fake_kubelet(
        kubelet_sock, lambda: {(ns, POD): {"nvidia.com/gpu": uuids}}
    )
    log_path = tmp_path / "agent.log"
    env = {
        key: v
        for key, v in os.environ.items()
        if key not in ("RLENERGY_AGENT_POLICY_NAME", "RLENERGY_AGENT_NAMESPACE")
    }
    with standin.StandinDriver(tmp_path / "nvml.state", [(u, sku) for u in uuids]) as drv:
        env.update(drv.env(lib_dir))
        env.update(
            {
                "KUBECONFIG": str(dev_cluster.kubeconfig),
                "RLENERGY_AGENT_PODRESOURCES_SOCKET": kubelet_sock,
                "RLENERGY_AGENT_SAMPLE_INTERVAL_S": "0.1",
                "RLENERGY_AGENT_PLAN_POLL_S": "0.2",
                "RLENERGY_AGENT_REPORT_INTERVAL_S": "0.2",
            }
        )
        with log_path.open("w") as err:
            proc = subprocess.Popen(
                standin.agent_argv(node, agent_sock, tmp_path / "state"),
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        client = trainer.RLEnergyClient(
            str(agent_sock), strict=True, timeout_s=10.0, token_file=str(pod.token_file)
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, log_path.read_text()
            port = int(json.loads(line)["metricsPort"])

            # 1. the report appears for the matching policy, not for the other one
            rep = wait_until(
                lambda: _report(dev_cluster, ns, "grpo", node),
                timeout=60,
                what=f"node report of grpo on {node}\n{log_path.read_text()}",
            )
            assert rep["spec"]["policyName"] == "grpo" and rep["spec"]["nodeName"] == node
            assert {g["uuid"] for g in rep["spec"]["gpus"]} == set(uuids)
            assert _report(dev_cluster, ns, "dpo", node) is None
            assert _discovery_metric(port) == {"reason": "Matched", "policy": f"{ns}/grpo"}

            # the matched policy's plan drives the pod's GPUs
            plan = api_node.ClockPlan(
                step=0,
                phases=[api_node.PhasePlan(phase="generation", clockMHz=LOCK_MHZ, state="locked")],
            ).model_dump(by_alias=True, mode="json", exclude_none=True)
            k(
                "patch", "rlenergypolicies", "grpo", "-n", ns, "--subresource=status",
                "--type=merge", "-p", json.dumps({"status": {"plan": plan}}),
            )  # fmt: skip

            def locked() -> bool:
                try:
                    client.phase("generation", step=0)
                except trainer.AgentRefusedError:
                    return False
                return all(drv.gpu(u).locked for u in uuids)

            wait_until(locked, timeout=30, what="generation locks the pod's GPUs under grpo's plan")

            # 2. the pod moves to the other policy: old clocks reset first, reports follow
            k("label", "pod", POD, "-n", ns, "job=dpo-v2", "--overwrite")
            new = wait_until(
                lambda: _report(dev_cluster, ns, "dpo", node),
                timeout=60,
                what=f"node report of dpo on {node}\n{log_path.read_text()}",
            )
            assert new["spec"]["policyName"] == "dpo"
            assert not any(drv.gpu(u).locked for u in uuids)
            old = _report(dev_cluster, ns, "grpo", node)
            assert old is not None
            assert all(g["resetAcknowledged"] for g in old["spec"]["gpus"]), old["spec"]["gpus"]
            assert "left policy" in log_path.read_text()

            # 3. a second policy selecting the same pod: a conflict, nothing governs
            k(
                "apply", "-n", ns, "-f", "-",
                input=_policy("all-jobs", {"matchExpressions": [
                    {"key": "job", "operator": "Exists"}
                ]}),
            )  # fmt: skip
            wait_until(
                lambda: _discovery_metric(port) == {"reason": "Conflict", "policy": ""},
                timeout=30,
                what="discovery reports the conflict",
            )
            text = log_path.read_text()
            assert "Conflict" in text and f"{ns}/all-jobs" in text and f"{ns}/dpo" in text
            assert _report(dev_cluster, ns, "all-jobs", node) is None
            # no policy governs: no pod is selected, the signal is refused, nothing is locked
            with pytest.raises(trainer.AgentRefusedError) as refused:
                client.phase("generation", step=1)
            assert refused.value.status == 403 and "is not selected" in str(refused.value)
            assert not any(drv.gpu(u).locked for u in uuids)
        except BaseException:
            print(log_path.read_text())
            raise
        finally:
            client.close()
            proc.terminate()
            proc.wait(timeout=20)
            if proc.stdout is not None:
                proc.stdout.close()
            kubelet.stop(None)
    assert proc.returncode == 0


SELECTORS: list[dict[str, Any]] = [
    {"matchLabels": {"job": "grpo"}},
    {"matchLabels": {"job": "grpo", "role": "trainer"}},
    {"matchExpressions": [{"key": "job", "operator": "In", "values": ["grpo", "dpo"]}]},
    {"matchExpressions": [{"key": "job", "operator": "NotIn", "values": ["grpo"]}]},
    {"matchExpressions": [{"key": "role", "operator": "Exists"}]},
    {"matchExpressions": [{"key": "role", "operator": "DoesNotExist"}]},
    {
        "matchLabels": {"team": "a"},
        "matchExpressions": [
            {"key": "job", "operator": "NotIn", "values": ["dpo"]},
            {"key": "example.com/tier", "operator": "Exists"},
        ],
    },
]
POD_LABELS: list[dict[str, str]] = [
    {"job": "grpo"},
    {"job": "grpo", "role": "trainer"},
    {"job": "dpo", "role": "rollout", "team": "a"},
    {"team": "a", "example.com/tier": "gold"},
    {"team": "a", "job": "grpo", "example.com/tier": ""},
    {"other": "x"},
]


def test_the_matcher_agrees_with_the_api_servers_label_selectors(
    dev_cluster: DevCluster, namespace: str
):
    for i, labels in enumerate(POD_LABELS):
        dev_cluster.kubectl(
            "create", "-n", namespace, "-f", "-",
            input=json.dumps(trainers.pod_manifest(f"p{i}", None, labels=labels)),
        )  # fmt: skip
    for sel in SELECTORS:
        query = api_policy.LabelSelector.model_validate(sel).to_query()
        listed = get_json(dev_cluster, "pods", "-n", namespace, "-l", query)["items"]
        server = {p["metadata"]["name"] for p in listed}
        ours = {f"p{i}" for i, labels in enumerate(POD_LABELS) if selector.matches(sel, labels)}
        assert ours == server, (sel, query)
