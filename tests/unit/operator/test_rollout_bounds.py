"""A worker set never grows past ``spec.rollout.maxWorkers`` or the workload's own bound.

A dispatcher's ``nextStepWorkers`` is a trainer pod's word; the operator resizes with its own
credentials. The in-memory worker sets of ``test_rollout`` stand in for the ``/scale`` calls.
"""

from __future__ import annotations

import pydantic
import pytest
from rlenergy_operator import optin, rollout
from test_rollout import _published, _ray_reports, _ray_spec, _RayCluster, _spec, _WorkerSet

from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.moe import scale


def _bounded(max_workers: int) -> api_policy.RLEnergyPolicySpec:
    spec = _spec()
    assert spec.rollout is not None
    return spec.model_copy(
        update={"rollout": spec.rollout.model_copy(update={"max_workers": max_workers})}
    )


def test_a_published_count_above_max_workers_is_refused_and_the_set_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = _WorkerSet(4)
    ws.install(monkeypatch)
    r = rollout.reconcile(_bounded(8), None, _published(0, 4000), "ns", "t", policy="p")
    assert ws.patches == [] and ws.replicas == 4
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "AboveMaxWorkers"
    assert "maximum is 8" in r.status.scale.message
    assert r.status.active == 4
    assert r.event is not None and r.event[:2] == ("Warning", "AboveMaxWorkers")
    # within the bound: grown as published
    r2 = rollout.reconcile(_bounded(8), r.status, _published(1, 8), "ns", "t", policy="p")
    assert ws.patches == [8]
    assert r2.status is not None and r2.status.active == 8


def test_the_default_bound_holds_without_max_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = _WorkerSet(4)
    ws.install(monkeypatch)
    rollout.reconcile(_spec(), None, _published(0, 4000), "ns", "t", policy="p")
    assert ws.patches == []
    assert _spec().rollout is not None
    assert _spec().rollout.max_workers == api_policy.DEFAULT_MAX_WORKERS  # type: ignore[union-attr]


def test_the_workloads_own_bound_lowers_the_policys(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = _WorkerSet(4)
    ws.annotations[optin.MAX_WORKERS_ANNOTATION] = "6"
    ws.install(monkeypatch)
    r = rollout.reconcile(_bounded(32), None, _published(0, 7), "ns", "t", policy="p")
    assert ws.patches == []
    assert r.status is not None and r.status.scale is not None
    assert "maximum is 6" in r.status.scale.message
    rollout.reconcile(_bounded(32), r.status, _published(1, 6), "ns", "t", policy="p")
    assert ws.patches == [6]


def test_a_raycluster_group_is_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    rc = _RayCluster(3)
    rc.install(monkeypatch)
    spec = _ray_spec()
    assert spec.rollout is not None
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"max_workers": 4})})
    working = {"aaaaa": False, "bbbbb": False, "ccccc": False}
    r = rollout.reconcile(spec, None, _ray_reports(0, 5, working), "ns", "t", policy="p")
    assert rc.patches == []
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "AboveMaxWorkers"


@pytest.mark.parametrize(
    ("raw", "bound"), [(None, 9), ("4", 4), ("12", 9), (" 3 ", 3), ("0", 1), ("x", 1), ("-2", 1)]
)
def test_ceiling_reads_the_annotation(raw: str | None, bound: int) -> None:
    ann = {} if raw is None else {optin.MAX_WORKERS_ANNOTATION: raw}
    assert optin.ceiling(ann, 9) == bound


def test_decide_scale_refuses_past_the_ceiling_whole() -> None:
    d = scale.decide_scale(4, 9, 2, 8)
    assert (d.action, d.target, d.reason) == (scale.ScaleAction.REFUSED, 4, "AboveMaxWorkers")
    assert scale.decide_scale(4, 8, 2, 8).target == 8
    assert scale.decide_scale(9, 9, 2, 8).action is scale.ScaleAction.NONE  # already there


def test_max_workers_below_min_active_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="maxWorkers must be at least"):
        api_policy.RolloutSpec.model_validate(
            {"experts": {"count": 4, "bytesPerExpert": 1}, "minActiveWorkers": 5, "maxWorkers": 4}
        )
