"""The project's Helm chart against the pinned helm v3 and the real API server."""

from __future__ import annotations

from pathlib import Path

import yaml
from rlenergy_dev.devcluster import K8S_VERSION, DevCluster

CHART = Path(__file__).resolve().parents[2] / "helm" / "rl-energy"


def test_helm_is_v3(dev_cluster: DevCluster):
    out = dev_cluster.helm("version", "--short").stdout
    assert out.startswith("v3."), out


def test_helm_lint(dev_cluster: DevCluster):
    res = dev_cluster.helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in res.stdout


def test_helm_template(dev_cluster: DevCluster):
    res = dev_cluster.helm(
        "template", "demo", str(CHART), "--namespace", "rl", "--kube-version",
        K8S_VERSION.lstrip("v"),
    )  # fmt: skip
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "ServiceAccount", "Deployment", "ClusterRole"} <= kinds
    cm = next(d for d in docs if d["metadata"]["name"] == "demo-rl-energy-config")
    assert cm["data"]["RLENERGY_OPERATOR_NAMESPACE"] == "rl"
    bad = dev_cluster.helm(
        "template", "demo", str(CHART), "--set", "agent.metricsPort=x", check=False
    )
    assert bad.returncode != 0
    assert "/agent/metricsPort" in bad.stderr
    old = dev_cluster.helm("template", "demo", str(CHART), "--kube-version", "1.29.0", check=False)
    assert old.returncode != 0 and "kubeVersion" in old.stderr
