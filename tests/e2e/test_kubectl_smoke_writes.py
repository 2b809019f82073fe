"""``kubectl rlenergy smoke``'s reads and writes on the real API server, without an operator.

The session's control plane (KWOK nodes, the project's CRDs, no operator: nothing fills the
policy status, so the smoke test must time out and say what is missing). A node-agent
DaemonSet stands in for the operator's (its label, image, TLS port env and ``hostNetwork``).
We test these aspects:

* with ``--keep``: the command exits 1 within its timeout with ``report``, ``lock`` and
  ``saving`` missing (``-o json``), having applied the smoke policy (server-side apply) and
  created the smoke pod in the given namespace with the DaemonSet's image, TLS port and host
  network, and left both in place;
* run again without ``--keep``: it replaces the pod left over, then deletes the pod and the
  policy, and leaves the namespace it did not create;
* the pod of ``deploy/smoke/smoke.yaml`` is admitted in a namespace that enforces Pod Security
  ``restricted``, without a warning (server-side dry run).

The whole loop with an operator and an agent (report, lock, saving) is
``tests/e2e/test_runbook.py`` on the real node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from e2e_support import get_json, wait_until
from rlenergy_dev.devcluster import DevCluster

from rlenergy.api import signals

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(sys.executable).parent / "kubectl-rlenergy"
IMAGE = "registry.example.com/rl-energy-agent:smoke-test"


def _daemonset(namespace: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "rlenergy-node-agent"}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "rlenergy-node-agent", "namespace": namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "hostNetwork": True,
                    "nodeSelector": {"rlenergy.io/no-such-node": "true"},
                    "containers": [
                        {
                            "name": "agent",
                            "image": IMAGE,
                            "env": [
                                {"name": "RLENERGY_AGENT_TLS_PORT", "value": "9555"},
                                {"name": "RLENERGY_AGENT_TOKEN_AUDIENCE", "value": "aud-x"},
                            ],
                        }
                    ],
                },
            },
        },
    }


def _smoke(c: DevCluster, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return subprocess.run(
        [str(PLUGIN), "smoke", "-n", namespace, "--timeout", "8", "-o", "json",
         "--kubeconfig", str(c.kubeconfig), *args],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_smoke_applies_policy_and_pod_then_cleans_up(
    dev_cluster: DevCluster, namespace: str, crds: None
) -> None:
    dev_cluster.kubectl("apply", "-f", "-", input=json.dumps(_daemonset(namespace)))
    res = _smoke(dev_cluster, namespace, "--keep")
    assert res.returncode == 1 and res.stdout, (res.stdout, res.stderr)
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["missing"] == ["report", "lock", "saving"], doc
    images = {
        d["spec"]["template"]["spec"]["containers"][0]["image"]
        for d in get_json(
            dev_cluster, "ds", "-A", "-l", "app.kubernetes.io/name=rlenergy-node-agent"
        )["items"]
    }
    assert doc["image"] in images, (doc["image"], images)

    policy = get_json(dev_cluster, "rlep", "rlenergy-smoke", "-n", namespace)
    assert policy["spec"]["controller"]["mode"] == "enforce"
    pod = get_json(dev_cluster, "pod", "rlenergy-smoke", "-n", namespace)
    (container,) = pod["spec"]["containers"]
    assert container["image"] == doc["image"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    if doc["image"] == IMAGE:  # our DaemonSet was the one read
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[signals.PORT_ENV] == "9555"
        assert pod["spec"]["hostNetwork"] is True
        sources = pod["spec"]["volumes"][0]["projected"]["sources"]
        assert sources[0]["serviceAccountToken"]["audience"] == "aud-x"

    # The pod left over is deleted and created anew (a plain create would get 409).
    res = _smoke(dev_cluster, namespace)
    assert res.returncode == 1, res
    assert json.loads(res.stdout)["missing"] == ["report", "lock", "saving"]
    wait_until(
        lambda: not get_json(dev_cluster, "pods", "-n", namespace, "-l",
                             "app.kubernetes.io/name=rlenergy-smoke")["items"],
        timeout=60, what="the smoke pod deleted",
    )  # fmt: skip
    assert not get_json(dev_cluster, "rlep", "-n", namespace)["items"]
    ns = get_json(dev_cluster, "namespace", namespace)
    assert ns["status"]["phase"] == "Active"  # not the plugin's to delete


def test_shipped_smoke_pod_is_admitted_under_restricted(
    dev_cluster: DevCluster, namespace: str
) -> None:
    dev_cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/warn=restricted",
    )  # fmt: skip
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "smoke" / "smoke.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "Pod")
    pod["metadata"]["namespace"] = namespace
    res = dev_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(pod))
    assert "created (server dry run)" in res.stdout, res
    assert "Warning" not in res.stderr, res.stderr
