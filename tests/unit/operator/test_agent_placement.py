"""Where the node agents land: the settings a real GPU cluster needs
(extra tolerations, nodeSelector, affinity, runtimeClassName, imagePullSecrets, the GPU node
label) rendered by ``builders.agent_daemonset`` from ``OperatorConfig`` as the chart's
ConfigMap sets it (JSON in the environment)."""

from __future__ import annotations

import json

import pydantic
import pytest
from rlenergy_operator import builders, settings

pytestmark = pytest.mark.field

GPU = {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}


def _pod(**kw: object) -> dict:
    return builders.agent_daemonset(settings.OperatorConfig(**kw))["spec"]["template"]["spec"]


def _terms(pod: dict) -> list[dict]:
    node = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return list(node["nodeSelectorTerms"])


def test_defaults_keep_the_gpu_label_and_nothing_else():
    pod = _pod()
    assert _terms(pod) == [{"matchExpressions": [GPU]}]
    for key in ("nodeSelector", "runtimeClassName", "imagePullSecrets", "priorityClassName"):
        assert key not in pod, key


def test_every_setting_lands_on_the_pod_template(monkeypatch: pytest.MonkeyPatch):
    dedicated = {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
    anti = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    env = {
        "TOLERATIONS": json.dumps([dedicated]),
        "NODE_SELECTOR": json.dumps({"pool": "h100"}),
        "AFFINITY": json.dumps(anti),
        "RUNTIME_CLASS": "nvidia",
        "IMAGE_PULL_SECRETS": json.dumps(["regcred"]),
        "GPU_NODE_LABEL": "feature.node.kubernetes.io/pci-10de.present",
        "PRIORITY_CLASS": "system-node-critical",
    }
    for k, v in env.items():
        monkeypatch.setenv(f"RLENERGY_OPERATOR_AGENT_{k}", v)
    pod = _pod()
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        dedicated,
    ]
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["affinity"]["podAntiAffinity"] == anti["podAntiAffinity"]
    # a bare key: the label must be present, whatever its value
    assert _terms(pod) == [
        {
            "matchExpressions": [
                {"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "Exists"}
            ]
        }
    ]


def test_required_node_terms_are_each_anded_with_the_gpu_label():
    zone_a = {"key": "zone", "operator": "In", "values": ["a"]}
    big = {"key": "mem", "operator": "Gt", "values": ["1000"]}
    user = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [zone_a]}, {"matchFields": [big]}]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}],
        }
    }
    cfg = settings.OperatorConfig(agent_affinity=user)
    pod = builders.agent_daemonset(cfg)["spec"]["template"]["spec"]
    assert _terms(pod) == [
        {"matchExpressions": [zone_a, GPU]},
        {"matchFields": [big], "matchExpressions": [GPU]},
    ]
    preferred = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred == [{"weight": 1}]
    # the configuration itself is not mutated (the DaemonSet is rebuilt every check)
    assert cfg.agent_affinity == user
    assert builders.agent_daemonset(cfg)["spec"]["template"]["spec"] == pod


def test_a_bad_gpu_label_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RLENERGY_OPERATOR_AGENT_GPU_NODE_LABEL", "gpu present")
    with pytest.raises(pydantic.ValidationError, match="agent_gpu_node_label"):
        settings.OperatorConfig()
