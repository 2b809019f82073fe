"""The chart on real GPU clusters, rendered by the real helm, no cluster:

* tolerations, nodeSelector, affinity, runtimeClassName, imagePullSecrets (names, objects and
  ``global.imagePullSecrets``), image digests and the GPU node label go from the values through
  the operator's ConfigMap into the agent DaemonSet the operator renders from it;
  ``priorityClassName`` defaults to ``system-node-critical``;
* as a subchart of an umbrella chart (``helm dependency build`` + ``helm template``/``lint``, and
  ``helm install --wait`` on the real API server): the schema accepts ``global`` and the
  umbrella's values reach the subchart;
* bad values fail with their path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import chart_support
import pytest
import rlenergy_dev
import yaml
from rlenergy_dev.devcluster import DevCluster

pytestmark = pytest.mark.field

DIGEST = "sha256:" + "ab" * 32


def _agent_pod(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The agent pod spec the operator renders from the chart's ConfigMap."""
    from rlenergy_operator import builders, settings

    (cm,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")
    ]
    for key, value in cm["data"].items():
        monkeypatch.setenv(key, value)
    return dict(builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"])


def test_placement_settings_reach_the_agent_daemonset(monkeypatch: pytest.MonkeyPatch):
    dedicated = {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [zone]}]
            }
        }
    }
    docs = chart_support.template(
        "--set-json", f"agent.tolerations={json.dumps([dedicated])}",
        "--set-json", 'agent.nodeSelector={"pool":"h100"}',
        "--set-json", f"agent.affinity={json.dumps(affinity)}",
        "--set", "agent.runtimeClassName=nvidia",
        "--set", "agent.gpuNodeLabel=feature.node.kubernetes.io/pci-10de.present=true",
        "--set-json", 'imagePullSecrets=["regcred",{"name":"mirror"}]',
        "--set-json", 'global={"imagePullSecrets":[{"name":"org-wide"}]}',
        "--set", f"agent.image.digest={DIGEST}",
        "--set", f"operator.image.digest={DIGEST}",
    )  # fmt: skip
    pod = _agent_pod(docs, monkeypatch)
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        dedicated,
    ]
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "system-node-critical"  # the chart's default
    names = ["org-wide", "regcred", "mirror"]
    assert pod["imagePullSecrets"] == [{"name": n} for n in names]
    gpu = {
        "key": "feature.node.kubernetes.io/pci-10de.present",
        "operator": "In",
        "values": ["true"],
    }
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [zone, gpu]}]
    assert pod["containers"][0]["image"] == f"ghcr.io/rl-energy/rl-energy-agent@{DIGEST}"
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = deploy["spec"]["template"]["spec"]
    assert spec["containers"][0]["image"] == f"ghcr.io/rl-energy/rl-energy-operator@{DIGEST}"
    assert spec["imagePullSecrets"] == [{"name": n} for n in names]


def test_defaults_render_no_empty_placement_fields(monkeypatch: pytest.MonkeyPatch):
    docs = chart_support.template()
    pod = _agent_pod(docs, monkeypatch)
    for key in ("nodeSelector", "imagePullSecrets"):
        assert key not in pod, key
    # A GPU Operator node (v25.10+, CDI): the agent gets NVML only under the RuntimeClass nvidia.
    assert pod["runtimeClassName"] == "nvidia"
    unset = _agent_pod(chart_support.template("--set", "agent.runtimeClassName="), monkeypatch)
    assert "runtimeClassName" not in unset
    version = rlenergy_dev.project_version()
    assert pod["containers"][0]["image"] == f"ghcr.io/rl-energy/rl-energy-agent:{version}"
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert "imagePullSecrets" not in deploy["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    off = _agent_pod(chart_support.template("--set", "agent.priorityClassName="), monkeypatch)
    assert "priorityClassName" not in off


def _umbrella(tmp_path: Path) -> Path:
    umbrella = tmp_path / "platform"
    (umbrella / "charts").mkdir(parents=True)
    shutil.copytree(chart_support.CHART, umbrella / "charts" / "rl-energy")
    (umbrella / "Chart.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v2",
                "name": "platform",
                "version": "1.0.0",
                "dependencies": [
                    {
                        "name": "rl-energy",
                        "version": rlenergy_dev.project_version(),
                        "repository": "file://charts/rl-energy",
                    }
                ],
            }
        )
    )
    (umbrella / "values.yaml").write_text(
        yaml.safe_dump(
            {
                "global": {"imagePullSecrets": ["org-wide"], "clusterDomain": "gpu.example"},
                "rl-energy": {"agent": {"runtimeClassName": "nvidia"}},
            }
        )
    )
    chart_support.helm("dependency", "build", str(umbrella))
    return umbrella


def test_umbrella_chart_with_global_values_renders_and_lints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    umbrella = _umbrella(tmp_path)
    assert "1 chart(s) linted, 0 chart(s) failed" in chart_support.helm("lint", str(umbrella))
    docs = chart_support.template(chart=umbrella)
    pod = _agent_pod(docs, monkeypatch)
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "org-wide"}]


def test_bad_placement_values_fail_with_their_path():
    for args, path in [
        (["--set", "agent.image.digest=latest"], "/agent/image/digest"),
        (["--set", "agent.gpuNodeLabel=gpu present"], "/agent/gpuNodeLabel"),
        (["--set-json", 'agent.tolerations={"key":"a"}'], "/agent/tolerations"),
        (["--set-json", "imagePullSecrets=[{}]"], "/imagePullSecrets/0"),
    ]:
        res = chart_support.run("helm", "template", "rl", str(chart_support.CHART), *args)
        assert res.returncode != 0 and path in res.stderr, (args, res.stderr)


def test_umbrella_chart_installs_on_the_real_api_server(
    dev_cluster: DevCluster, namespace: str, tmp_path: Path
):
    umbrella = _umbrella(tmp_path)
    dev_cluster.kubectl("apply", "--server-side", "-f", str(chart_support.CHART / "crds"))
    dev_cluster.helm(
        "install", "platform", str(umbrella), "-n", namespace,
        "--set", "rl-energy.operator.replicas=0", "--wait", "--timeout", "90s",
    )  # fmt: skip
    try:
        cm = json.loads(
            dev_cluster.kubectl(
                "get", "configmap", "platform-rl-energy-config", "-n", namespace, "-o", "json"
            ).stdout
        )
        assert cm["data"]["RLENERGY_OPERATOR_AGENT_RUNTIME_CLASS"] == "nvidia"
        assert json.loads(cm["data"]["RLENERGY_OPERATOR_AGENT_IMAGE_PULL_SECRETS"]) == ["org-wide"]
    finally:
        dev_cluster.helm("uninstall", "platform", "-n", namespace, "--wait", check=False)
