"""The documented KubeRay RayJob (``docs/examples/verl-rayjob.yaml``) on the dev cluster.

KubeRay's own CRDs (``tests/e2e/testdata/kuberay-v1.5.0``, vendored from the v1.5.0 tag) are
installed; the operator and its trainer-pod webhook run as in ``test_pod_injection``, and the
policy is ``crds/samples/sync-job.yaml``. The KubeRay operator itself does not run here
(docs/verl.md says why), so the pods KubeRay would create from the RayJob's head and worker
templates are created as a server-side dry run through the real API server and our webhook.

We test these aspects:
* the RayJob is accepted by KubeRay's published schema (a typo in the example fails here) and
  names the hook once, at job level, as a module-path string in ``spec.runtimeEnvYAML``;
* no pod template sets Ray's reserved setup-hook variable (a second hook) and each carries
  the policy's label and the opt-in label;
* the head's and the worker group's pods, as admitted by the API server, are injected by the
  webhook (the agent's volume, mount and environment).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import get_json
from rlenergy_dev.devcluster import DevCluster
from rlenergy_operator import injection
from test_pod_injection import LEVEL, Operator
from test_pod_injection import setup as setup  # the fixture: operator, webhook, policy

from rlenergy.api import signals
from rlenergy.sdk import verl_hook

ROOT = Path(__file__).resolve().parents[2]
KUBERAY_CRDS = Path(__file__).resolve().parent / "testdata" / "kuberay-v1.5.0"
EXAMPLE = ROOT / "docs" / "examples" / "verl-rayjob.yaml"
POLICY = ROOT / "crds" / "samples" / "sync-job.yaml"


@pytest.fixture(scope="module")
def kuberay_crds(dev_cluster: DevCluster) -> None:
    """KubeRay's RayCluster and RayJob CRDs, server-side (too large for client-side apply)."""
    dev_cluster.kubectl("apply", "--server-side", "-f", str(KUBERAY_CRDS), timeout=180)
    dev_cluster.wait_crds_established("rayclusters.ray.io", "rayjobs.ray.io", timeout_s=120)


def _templates(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = job["spec"]["rayClusterSpec"]
    out = {"head": spec["headGroupSpec"]["template"]}
    for group in spec["workerGroupSpecs"]:
        out[group["groupName"]] = group["template"]
    return out


def _dry_run_pod(cluster: DevCluster, ns: str, name: str, template: dict[str, Any]) -> Any:
    """The pod KubeRay would create from ``template``, as the API server would admit it."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template.get("metadata", {}), "name": name},
        "spec": template["spec"],
    }
    out = cluster.kubectl(
        "create", "--dry-run=server", "-n", ns, "-o", "json", "-f", "-", input=json.dumps(pod)
    )
    return json.loads(out.stdout)


def test_the_documented_rayjob_is_accepted_and_its_pods_are_injected(
    dev_cluster: DevCluster,
    kuberay_crds: None,
    setup: tuple[Operator, str, str],  # noqa: F811 - the fixture imported above
) -> None:
    _, ns, _ = setup
    # The example's images are not restricted-ready; Pod Security is not what is tested here.
    dev_cluster.kubectl("label", "namespace", ns, f"{LEVEL}-")
    dev_cluster.kubectl("apply", "-n", ns, "-f", str(POLICY))
    dev_cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    job = get_json(dev_cluster, "rayjob", "grpo-qwen-7b", "-n", ns)
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert runtime_env == {"worker_process_setup_hook": verl_hook.HOOK_PATH}

    selector = yaml.safe_load(POLICY.read_text())["spec"]["selector"]["matchLabels"]
    templates = _templates(job)
    assert set(templates) == {"head", "gpu"}
    for group, template in templates.items():
        labels = template["metadata"]["labels"]
        assert labels[injection.LABEL] == "true" and selector.items() <= labels.items(), group
        for c in template["spec"]["containers"]:
            names = {e["name"] for e in c.get("env", [])}
            assert verl_hook.RESERVED_HOOK_VAR not in names, (group, c["name"])

        pod = _dry_run_pod(dev_cluster, ns, f"grpo-qwen-7b-{group}-0", template)
        assert injection.is_injected(pod), (group, pod["spec"])
        (c, *_) = pod["spec"]["containers"]
        assert {"name": injection.VOLUME, "mountPath": injection.MOUNT_PATH, "readOnly": True} in (
            c["volumeMounts"]
        )
        env = {e["name"]: e for e in c["env"]}
        assert env[signals.HOST_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
