"""The project's Helm chart against the pinned helm v3 and the real API server."""

from __future__ import annotations

from pathlib import Path

import yaml
from e2e_support import get_json

from rlenergy.devcluster import K8S_VERSION, DevCluster

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
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "ServiceAccount"]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    config = yaml.safe_load(cm["data"]["operator.yaml"])
    assert config["kubernetes"]["serverVersion"] == K8S_VERSION
    assert config["watchNamespaces"] == ["rl"]
    bad = dev_cluster.helm("template", "demo", str(CHART), "--set", "operator.mode=x", check=False)
    assert bad.returncode != 0
    assert "operator.mode must be observe or enforce" in bad.stderr
    old = dev_cluster.helm("template", "demo", str(CHART), "--kube-version", "1.29.0", check=False)
    assert old.returncode != 0 and "kubeVersion" in old.stderr


def test_helm_install_into_the_cluster(dev_cluster: DevCluster, namespace: str):
    res = dev_cluster.helm(
        "install", "rl", str(CHART), "--namespace", namespace, "--wait", "--timeout", "60s",
        "--set", "operator.mode=enforce",
    )  # fmt: skip
    assert "STATUS: deployed" in res.stdout
    sa = get_json(dev_cluster, "serviceaccount", "rl-rl-energy", "-n", namespace)
    assert sa["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    cm = get_json(dev_cluster, "configmap", "rl-rl-energy-config", "-n", namespace)
    config = yaml.safe_load(cm["data"]["operator.yaml"])
    # .Capabilities.KubeVersion comes from the live server: the binaries are version-stamped.
    assert config["kubernetes"]["serverVersion"] == K8S_VERSION
    assert config["mode"] == "enforce"
    # The operator's ServiceAccount can get a token (TokenRequest) and is denied by RBAC so far.
    token = dev_cluster.kubectl("create", "token", "rl-rl-energy", "-n", namespace).stdout
    assert token.count(".") == 2
    can = dev_cluster.kubectl(
        "auth", "can-i", "list", "nodes", f"--as=system:serviceaccount:{namespace}:rl-rl-energy",
        check=False,
    )  # fmt: skip
    assert can.stdout.strip() == "no"
    dev_cluster.helm("uninstall", "rl", "--namespace", namespace, "--wait")
    gone = dev_cluster.kubectl(
        "get", "configmap", "rl-rl-energy-config", "-n", namespace, check=False
    )
    assert gone.returncode != 0 and "NotFound" in gone.stderr
