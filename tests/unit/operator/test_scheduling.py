"""The agents-unschedulable check: DaemonSet status, rendered tolerations, GPU nodes' taints."""

from __future__ import annotations

from typing import Any

import pytest
from rlenergy_dev.devcluster.nodes import GPU_TAINT, gpu_node_manifest
from rlenergy_operator import builders, scheduling, settings

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _ds(desired: int, observed: int | None = 1, generation: int = 1) -> dict[str, Any]:
    status: dict[str, Any] = {"desiredNumberScheduled": desired, "numberReady": 0}
    if observed is not None:
        status["observedGeneration"] = observed
    return {"metadata": {"generation": generation}, "status": status}


def _nodes(n: int, taints: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    nodes = [gpu_node_manifest(f"gpu-{i}") for i in range(n)]
    if taints is not None:
        for node in nodes:
            node["spec"]["taints"] = taints
    return nodes


@pytest.mark.parametrize(
    ("toleration", "taint", "want"),
    [
        (GPU_TOLERATION, GPU_TAINT, True),
        ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}, GPU_TAINT, True),
        ({"key": "nvidia.com/gpu", "value": "absent", "effect": "NoSchedule"}, GPU_TAINT, False),
        ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, GPU_TAINT, False),
        ({"operator": "Exists"}, GPU_TAINT, True),  # tolerates everything
        ({"key": "other", "operator": "Exists"}, GPU_TAINT, False),
        ({"operator": "Equal", "value": "present"}, GPU_TAINT, False),  # Equal needs a key
    ],
)
def test_tolerates_follows_kubernetes(
    toleration: dict[str, Any], taint: dict[str, Any], want: bool
) -> None:
    assert scheduling.tolerates(toleration, taint) is want


def test_missing_gpu_toleration_names_the_taint_and_the_fix() -> None:
    found = scheduling.agents_unschedulable(_ds(0), [], _nodes(3))
    assert found is not None
    status, reason, message = found
    assert status is True and reason == "AgentsUnschedulable"
    assert "nvidia.com/gpu=present:NoSchedule" in message
    assert "3 GPU nodes (gpu-0, gpu-1, gpu-2)" in message
    assert "--set agent.tolerateGpuTaint=true" in message


def test_the_rendered_daemonset_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the operator's own template: the default tolerates the GPU taint, false does not."""
    tol = builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"]
    assert scheduling.untolerated(tol["tolerations"], [GPU_TAINT]) == []
    monkeypatch.setenv("RLENERGY_OPERATOR_AGENT_TOLERATE_GPU_TAINT", "false")
    off = builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"]
    assert scheduling.untolerated(off["tolerations"], [GPU_TAINT]) == [GPU_TAINT]
    assert scheduling.agents_unschedulable(_ds(0), off["tolerations"], _nodes(2)) is not None


@pytest.mark.parametrize(
    ("ds", "tolerations", "nodes"),
    [
        (None, [], _nodes(3)),  # no DaemonSet yet
        (_ds(0, observed=None), [], _nodes(3)),  # controller has not looked yet
        (_ds(0, observed=1, generation=2), [], _nodes(3)),  # stale status
        (_ds(3), [], _nodes(3)),  # scheduled
        (_ds(0), [], []),  # no GPU node at all
        (_ds(0), [GPU_TOLERATION], _nodes(3)),  # tolerated: another cause
        (_ds(0), [], _nodes(3, taints=[])),  # untainted GPU nodes
        (_ds(0), [], _nodes(2, taints=[{"key": "x", "effect": "PreferNoSchedule"}])),
    ],
)
def test_nothing_to_report(
    ds: dict[str, Any] | None, tolerations: list[dict[str, Any]], nodes: list[dict[str, Any]]
) -> None:
    assert scheduling.agents_unschedulable(ds, tolerations, nodes) is None


def test_one_schedulable_gpu_node_is_not_a_taint_problem() -> None:
    nodes = _nodes(3)
    nodes[1]["spec"]["taints"] = []
    assert scheduling.agents_unschedulable(_ds(0), [], nodes) is None


def test_other_taints_are_named_without_the_gpu_fix() -> None:
    taint = {"key": "maintenance", "value": "true", "effect": "NoExecute"}
    found = scheduling.agents_unschedulable(_ds(0), [GPU_TOLERATION], _nodes(7, [GPU_TAINT, taint]))
    assert found is not None
    message = found[2]
    assert "maintenance=true:NoExecute" in message and "nvidia.com/gpu=" not in message
    assert "7 GPU nodes (gpu-0, gpu-1, gpu-2, gpu-3, gpu-4 and 2 more)" in message
    assert "tolerateGpuTaint" not in message


def test_last_finding_survives_a_restart_until_the_first_check() -> None:
    found = scheduling.agents_unschedulable(_ds(0), [], _nodes(3))
    assert found is not None
    published = builders.condition(
        "Degraded", found[0], found[1], found[2], generation=1, now="2026-01-01T00:00:00Z"
    )
    ready = builders.condition("Ready", True, "AgentsDeployed", "ok", generation=1, now="t")
    assert scheduling.last_finding([ready, published]) == found
    cleared = builders.condition(
        "Degraded", False, "AsExpected", "no errors", generation=1, now="2026-01-01T00:00:00Z"
    )
    assert scheduling.last_finding([ready, cleared]) is None
    other = builders.condition(
        "Degraded", True, "NodeErrors", "x", generation=1, now="2026-01-01T00:00:00Z"
    )
    assert scheduling.last_finding([other]) is None
