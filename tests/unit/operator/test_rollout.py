"""The operator's FlexFloor actuation: ``status.rollout`` from node reports, worker-set resizing.

We test these aspects:
* ``fold`` adds each complete step once (released GPU time, occupied generation GPU time,
  response tokens), stops at a pending step, and resumes from ``throughStep`` after a restart
  without double counting;
* tokens per occupied GPU-second = response tokens / (generation gpuSeconds - parked part);
* the floor comes from the spec (experts x bytes vs workerMemoryBytes, minActiveWorkers);
* ``reconcile`` resizes once per published step, refuses a target below the floor
  (``ShrinkRejected``, ``/scale`` untouched), retries a missing worker set; the Kubernetes
  calls are replaced by an in-memory worker set here (the e2e test runs the real API server).
"""

from __future__ import annotations

from typing import Any

import pytest
from rlenergy_operator import kube, rollout

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.api.v1alpha1 import status as api_status

GB = 10**9


def _spec(action: str = "scale", min_active: int = 1) -> api_policy.RLEnergyPolicySpec:
    return api_policy.parse_policy(
        {
            "selector": {"matchLabels": {"app": "rl"}},
            "rollout": {
                "workerSetRef": {"kind": "StatefulSet", "name": "pool"},
                # 16 experts of 1 GB, 10 GB per worker with 2 GB dense -> 8 per worker -> 2
                "experts": {"count": 16, "bytesPerExpert": GB},
                "workerMemoryBytes": 10 * GB,
                "denseBytes": 2 * GB,
                "minActiveWorkers": min_active,
                "releaseAction": action,
            },
        }
    )


def _record(step: int, gpu_s: float, parked_s: float, released_s: float, tokens: float):
    return api_node.StepRecord.model_validate(
        {
            "step": step,
            "workload": {
                "samples": 4,
                "responseTokens": tokens,
                "promptTokens": 10,
                "validTokens": tokens,
                "meanContextTokens": 0,
            },
            "phases": [
                {
                    "phase": "generation",
                    "durationSeconds": 1.0,
                    "gpuSeconds": gpu_s,
                    "releasedGpuSeconds": parked_s,
                },
                {"phase": "training", "durationSeconds": 2.0, "gpuSeconds": 99.0},
            ],
            "releasedGpuSeconds": released_s,
        }
    )


def _report(node: str, records: list[api_node.StepRecord], **kw: Any) -> api_node.NodeReport:
    return api_node.NodeReport.model_validate(
        {
            "policyName": "p",
            "nodeName": node,
            "gpus": [{"uuid": f"GPU-{node}", "parked": kw.pop("parked", False)}],
            "steps": [r.model_dump(by_alias=True) for r in records],
            "lastStep": max((r.step for r in records), default=-1),
            **kw,
        }
    )


def test_fold_adds_complete_steps_once_and_resumes_after_a_restart():
    a = _report("a", [_record(0, 8.0, 2.0, 3.0, 600), _record(1, 8.0, 0.0, 0.0, 500)])
    b = _report("b", [_record(0, 8.0, 4.0, 5.0, 600)], parked=True)  # step 1 pending on b
    s = rollout.fold(None, [a, b])
    assert s.through_step == 0
    assert s.released_gpu_seconds == pytest.approx(8.0)
    assert s.occupied_gpu_seconds == pytest.approx((8 - 2) + (8 - 4))
    assert s.response_tokens == 600  # job-level tokens, once per step
    assert s.tokens_per_occupied_gpu_second == pytest.approx(60.0)
    assert s.parked_gpus == 1
    # the same reports again: nothing is added (checkpoint)
    assert rollout.fold(s, [a, b]).released_gpu_seconds == pytest.approx(8.0)
    # a restart reads the status back and folds step 1 once b reports it
    restored = api_status.RolloutStatus.model_validate(s.model_dump(by_alias=True))
    b2 = _report("b", [_record(0, 8.0, 4.0, 5.0, 600), _record(1, 8.0, 1.0, 1.0, 500)])
    s2 = rollout.fold(restored, [a, b2])
    assert s2.through_step == 1
    assert s2.released_gpu_seconds == pytest.approx(9.0)
    assert s2.response_tokens == 1100
    assert s2.occupied_gpu_seconds == pytest.approx(10.0 + 8.0 + 7.0)
    assert s2.parked_gpus == 0


def test_floor_and_newest_dispatch():
    assert rollout.floor(_spec().rollout) == 2  # type: ignore[arg-type]
    assert rollout.floor(_spec(min_active=3).rollout) == 3  # type: ignore[arg-type]
    park = api_policy.parse_policy(
        {
            "selector": {"matchLabels": {"app": "rl"}},
            "rollout": {"experts": {"count": 16, "bytesPerExpert": GB}},
        }
    )
    assert rollout.floor(park.rollout) is None  # type: ignore[arg-type]
    reps = [
        _report("a", [], rollout={"step": 3, "activeWorkers": 4, "nextStepWorkers": 2}),
        _report("b", [], rollout={"step": 5, "activeWorkers": 4, "nextStepWorkers": 3}),
        _report("c", []),
    ]
    newest = rollout.newest_dispatch(reps)
    assert newest is not None and (newest.step, newest.next_step_workers) == (5, 3)


class _WorkerSet:
    """An in-memory worker set in place of the /scale calls."""

    def __init__(self, replicas: int | None) -> None:
        self.replicas = replicas
        self.patches: list[int] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(kube, "scale_replicas", lambda kind, ns, name: self.replicas)

        def patch(kind: str, ns: str, name: str, replicas: int) -> None:
            self.patches.append(replicas)
            self.replicas = replicas

        monkeypatch.setattr(kube, "set_scale_replicas", patch)


def _published(step: int, nxt: int) -> list[api_node.NodeReport]:
    return [_report("a", [], rollout={"step": step, "activeWorkers": 4, "nextStepWorkers": nxt})]


def test_reconcile_resizes_once_per_published_step_and_refuses_below_the_floor(
    monkeypatch: pytest.MonkeyPatch,
):
    ws = _WorkerSet(4)
    ws.install(monkeypatch)
    spec = _spec()
    r = rollout.reconcile(spec, None, _published(0, 2), "ns", "2026-01-01T00:00:00Z")
    assert ws.patches == [2]
    assert r.status is not None and r.status.scale is not None
    assert (r.status.scale.for_step, r.status.scale.reason) == (1, "ShrinkBetweenSteps")
    assert r.status.active == 2 and r.status.floor == 2
    assert r.event is not None and r.event[:2] == ("Normal", "ShrinkBetweenSteps")
    # the same publication again: decided already, no second patch, even if someone rescaled
    ws.replicas = 5
    r2 = rollout.reconcile(spec, r.status, _published(0, 2), "ns", "t")
    assert ws.patches == [2] and r2.event is None
    # below the floor: refused, untouched
    r3 = rollout.reconcile(spec, r2.status, _published(1, 1), "ns", "t")
    assert ws.patches == [2] and ws.replicas == 5
    assert r3.status is not None and r3.status.scale is not None
    assert r3.status.scale.reason == "ShrinkRejected"
    assert "minimum is 2" in r3.status.scale.message
    assert r3.event is not None and r3.event[:2] == ("Warning", "ShrinkRejected")
    # growth for the next step
    r4 = rollout.reconcile(spec, r3.status, _published(2, 4), "ns", "t")
    assert ws.patches == [2, 4]
    assert r4.status is not None and r4.status.active == 4


def test_reconcile_retries_a_missing_worker_set_and_leaves_park_policies_alone(
    monkeypatch: pytest.MonkeyPatch,
):
    ws = _WorkerSet(None)
    ws.install(monkeypatch)
    r = rollout.reconcile(_spec(), None, _published(0, 2), "ns", "t")
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "WorkerSetNotFound" and not ws.patches
    ws.replicas = 4
    r2 = rollout.reconcile(_spec(), r.status, _published(0, 2), "ns", "t")
    assert ws.patches == [2]
    park = rollout.reconcile(_spec("park"), None, _published(1, 1), "ns", "t")
    assert ws.patches == [2]
    assert park.status is not None and park.status.scale is None
    assert r2.status is not None
