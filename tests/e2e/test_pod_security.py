"""Pod Security levels the signal socket needs, on the real API server's PodSecurity admission.

The agent's signal socket reaches trainer pods as a hostPath volume (docs/agent.md, "The socket
stays a hostPath"), and Pod Security's ``baseline`` level forbids every hostPath volume. So the
docs tell users to label the trainer's namespace ``pod-security.kubernetes.io/enforce:
privileged`` (docs/verl.md) and the agent's own namespace too (docs/quickstart.md: hostPaths
and ``CAP_SYS_ADMIN``). We check those statements against kube-apiserver's built-in PodSecurity
admission, by server-side dry runs (nothing is scheduled):

* the trainer pod exactly as docs/verl.md shows it (its volumes and mounts, parsed from the
  page) is refused under ``baseline`` and ``restricted``, naming the hostPath volume, and
  admitted under ``privileged``;
* the same pod without the socket's hostPath (the projected token alone) is admitted under
  ``baseline``: the token is not what needs the label;
* the agent pod the operator deploys (``builders.agent_daemonset``) is refused under
  ``baseline`` for its hostPaths and ``SYS_ADMIN``, admitted under ``privileged``.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml
from rlenergy_dev.devcluster import DevCluster
from rlenergy_operator import builders, settings

DOCS = Path(__file__).resolve().parents[2] / "docs"
LEVEL_LABEL = "pod-security.kubernetes.io/enforce"


def documented_trainer_spec() -> dict[str, Any]:
    """The trainer pod spec fragment of docs/verl.md (the block that mounts the socket)."""
    text = (DOCS / "verl.md").read_text()
    for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
        doc = yaml.safe_load(block)
        volumes = (doc or {}).get("spec", {}).get("volumes", [])
        if any((v.get("hostPath") or {}).get("path") == "/var/run/rlenergy" for v in volumes):
            return dict(doc["spec"])
    raise AssertionError("docs/verl.md has no trainer pod block mounting /var/run/rlenergy")


def trainer_pod(spec: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    spec["containers"][0].setdefault("image", "rl-energy-agent:dev")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer"}, "spec": spec}


def dry_run(cluster: DevCluster, namespace: str, level: str, pod: dict[str, Any]) -> str:
    """Label ``namespace`` with ``level``, dry-run create ``pod``; '' when admitted, else why."""
    cluster.kubectl("label", "namespace", namespace, f"{LEVEL_LABEL}={level}", "--overwrite")
    res = cluster.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-",
        input=json.dumps(pod), check=False,
    )  # fmt: skip
    return "" if res.returncode == 0 else res.stderr


def test_the_documented_trainer_pod_needs_the_privileged_level(
    dev_cluster: DevCluster, namespace: str
) -> None:
    spec = documented_trainer_spec()
    pod = trainer_pod(spec)
    for level, message in (
        ("baseline", 'hostPath volumes (volume "rlenergy")'),
        ("restricted", 'volume "rlenergy" uses restricted volume type "hostPath"'),
    ):
        why = dry_run(dev_cluster, namespace, level, pod)
        assert f'violates PodSecurity "{level}:latest"' in why and message in why, why
    assert dry_run(dev_cluster, namespace, "privileged", pod) == ""
    # the projected token alone passes baseline: the socket's hostPath is what needs the label
    spec["volumes"] = [v for v in spec["volumes"] if "hostPath" not in v]
    spec["containers"][0]["volumeMounts"] = [
        m for m in spec["containers"][0]["volumeMounts"] if m["name"] != "rlenergy"
    ]
    assert dry_run(dev_cluster, namespace, "baseline", trainer_pod(spec)) == ""


def test_the_agent_pod_needs_the_privileged_level(dev_cluster: DevCluster, namespace: str) -> None:
    ds = builders.agent_daemonset(settings.OperatorConfig())
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "agent"},
        "spec": ds["spec"]["template"]["spec"],
    }
    pod["spec"].pop("serviceAccountName", None)  # no such account in the test namespace
    why = dry_run(dev_cluster, namespace, "baseline", pod)
    assert 'violates PodSecurity "baseline:latest"' in why, why
    assert "hostPath volumes" in why and "SYS_ADMIN" in why, why
    assert dry_run(dev_cluster, namespace, "privileged", pod) == ""
