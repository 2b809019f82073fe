"""The operator's FlexFloor actuation: ``status.rollout`` from node reports, worker-set resizing.

We test these aspects:
* ``fold`` adds each complete step once (released GPU time, occupied generation GPU time,
  response tokens), stops at a pending step, and resumes from ``throughStep`` after a restart
  without double counting;
* tokens per occupied GPU-second = response tokens / (generation gpuSeconds - parked part);
* the floor comes from the spec (experts x bytes vs workerMemoryBytes, minActiveWorkers);
* ``reconcile`` resizes once per published step, refuses a target below the floor
  (``ShrinkRejected``, ``/scale`` untouched), retries a missing worker set; the Kubernetes
  calls are replaced by an in-memory worker set here (the e2e test runs the real API server);
* a RayCluster worker group: the shrink patches ``replicas`` and names the released pod (every
  GPU parked in the reports) in ``scaleStrategy.workersToDelete``; before any park is reported
  it is refused (``WorkersUnknown``, one Warning event, retried at the next pass, no status
  churn); below the floor refused; growth clears the deleted pod's entry; a missing cluster or
  group is retried, a failed (guarded) patch is ``ScaleFailed`` and retried, an autoscaled
  cluster is ``UnsupportedWorkerSet``;
* no confused deputy (``optin``): a StatefulSet or RayCluster whose ``rlenergy.io/allow-scale-by``
  does not name the policy (absent, another policy, a prefix of the name) is never resized:
  ``ScaleNotAllowed``, a Degraded finding naming the ``kubectl annotate`` command, re-checked
  every pass without status churn; once it opts in, the same publication resizes it.
"""

from __future__ import annotations

from typing import Any

import pytest
from rlenergy_operator import kube, optin, rollout

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

    def __init__(self, replicas: int | None, allow: str = "p") -> None:
        self.replicas = replicas
        self.patches: list[int] = []
        self.annotations = {optin.ANNOTATION: allow}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(kube, "scale_replicas", lambda kind, ns, name: self.replicas)
        monkeypatch.setattr(
            kube,
            "worker_set_annotations",
            lambda kind, ns, name: None if self.replicas is None else dict(self.annotations),
        )

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
    r = rollout.reconcile(spec, None, _published(0, 2), "ns", "2026-01-01T00:00:00Z", policy="p")
    assert ws.patches == [2]
    assert r.status is not None and r.status.scale is not None
    assert (r.status.scale.for_step, r.status.scale.reason) == (1, "ShrinkBetweenSteps")
    assert r.status.active == 2 and r.status.floor == 2
    assert r.event is not None and r.event[:2] == ("Normal", "ShrinkBetweenSteps")
    assert (r.event.type, r.event.reason) == ("Normal", "ShrinkBetweenSteps")  # named fields
    # the same publication again: decided already, no second patch, even if someone rescaled
    ws.replicas = 5
    r2 = rollout.reconcile(spec, r.status, _published(0, 2), "ns", "t", policy="p")
    assert ws.patches == [2] and r2.event is None
    # below the floor: refused, untouched
    r3 = rollout.reconcile(spec, r2.status, _published(1, 1), "ns", "t", policy="p")
    assert ws.patches == [2] and ws.replicas == 5
    assert r3.status is not None and r3.status.scale is not None
    assert r3.status.scale.reason == "ShrinkRejected"
    assert "minimum is 2" in r3.status.scale.message
    assert r3.event is not None and r3.event[:2] == ("Warning", "ShrinkRejected")
    # growth for the next step
    r4 = rollout.reconcile(spec, r3.status, _published(2, 4), "ns", "t", policy="p")
    assert ws.patches == [2, 4]
    assert r4.status is not None and r4.status.active == 4


def test_reconcile_retries_a_missing_worker_set_and_leaves_park_policies_alone(
    monkeypatch: pytest.MonkeyPatch,
):
    ws = _WorkerSet(None)
    ws.install(monkeypatch)
    r = rollout.reconcile(_spec(), None, _published(0, 2), "ns", "t", policy="p")
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "WorkerSetNotFound" and not ws.patches
    ws.replicas = 4
    r2 = rollout.reconcile(_spec(), r.status, _published(0, 2), "ns", "t", policy="p")
    assert ws.patches == [2]
    park = rollout.reconcile(_spec("park"), None, _published(1, 1), "ns", "t", policy="p")
    assert ws.patches == [2]
    assert park.status is not None and park.status.scale is None
    assert r2.status is not None


# ----- RayCluster worker group: replicas + scaleStrategy.workersToDelete -------------------------
RAY_POD = "rc-rollout-worker-"


def _ray_spec() -> api_policy.RLEnergyPolicySpec:
    spec = _spec()
    ro = spec.rollout
    assert ro is not None
    ref = api_policy.WorkerSetRef.model_validate(
        {"kind": "RayCluster", "name": "rc", "workerGroupName": "rollout"}
    )
    return spec.model_copy(update={"rollout": ro.model_copy(update={"worker_set_ref": ref})})


class _RayCluster:
    """An in-memory RayCluster in place of the get / JSON-patch calls (tests the patch's guards)."""

    def __init__(self, replicas: int, **group: Any) -> None:
        self.obj: dict[str, Any] | None = {
            "metadata": {
                "name": "rc",
                "resourceVersion": "1",
                "annotations": {optin.ANNOTATION: "other, p"},
            },
            "spec": {
                "workerGroupSpecs": [
                    {"groupName": "other", "replicas": 1},
                    {"groupName": "rollout", "replicas": replicas, **group},
                ]
            },
        }
        self.patches: list[tuple[int, list[str]]] = []
        self.fail: kube.ApiError | None = None

    @property
    def group(self) -> dict[str, Any]:
        assert self.obj is not None
        return dict(self.obj["spec"]["workerGroupSpecs"][1])

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import copy

        monkeypatch.setattr(kube, "ray_cluster", lambda ns, name: copy.deepcopy(self.obj))

        def patch(
            ns: str, name: str, rv: str, index: int, group: str, replicas: int, strategy: Any
        ) -> None:
            assert self.obj is not None
            if self.fail is not None:
                raise self.fail
            assert rv == self.obj["metadata"]["resourceVersion"]
            g = self.obj["spec"]["workerGroupSpecs"][index]
            assert g["groupName"] == group
            g["replicas"], g["scaleStrategy"] = replicas, strategy
            self.obj["metadata"]["resourceVersion"] = str(int(rv) + 1)
            self.patches.append((replicas, list(strategy["workersToDelete"])))

        monkeypatch.setattr(kube, "patch_ray_worker_group", patch)


def _ray_reports(step: int, nxt: int, pods: dict[str, bool]) -> list[api_node.NodeReport]:
    """One node report: 2 GPUs per pod (suffix -> parked), and the dispatcher's publication."""
    return [
        api_node.NodeReport.model_validate(
            {
                "policyName": "p",
                "nodeName": "a",
                "gpus": [
                    {"uuid": f"GPU-{s}-{i}", "pod": f"ns/{RAY_POD}{s}", "parked": parked}
                    for s, parked in pods.items()
                    for i in range(2)
                ]
                + [{"uuid": "GPU-head", "pod": "ns/rc-head-hhhhh", "parked": True}],
                "rollout": {"step": step, "activeWorkers": 3, "nextStepWorkers": nxt},
            }
        )
    ]


def test_raycluster_shrink_names_the_released_pod_and_refuses_rather_than_guess(
    monkeypatch: pytest.MonkeyPatch,
):
    rc = _RayCluster(3)
    rc.install(monkeypatch)
    spec = _ray_spec()
    working = {"aaaaa": False, "bbbbb": False, "ccccc": False}
    # the publication arrives before the park shows in a report: refused, not guessed
    r = rollout.reconcile(spec, None, _ray_reports(0, 2, working), "ns", "t0", policy="p")
    assert rc.patches == []
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "WorkersUnknown"
    assert "1 released worker pod needed, 0 known" in r.status.scale.message
    assert r.status.active == 3
    assert r.event is not None and r.event[:2] == ("Warning", "WorkersUnknown")
    # the next pass, nothing new: no second event, the same status (no write)
    r2 = rollout.reconcile(spec, r.status, _ray_reports(0, 2, working), "ns", "t1", policy="p")
    assert r2.event is None and r2.status == r.status and rc.patches == []
    # the park reaches the report: the released pod is deleted by name
    parked = {**working, "bbbbb": True}
    r3 = rollout.reconcile(spec, r2.status, _ray_reports(0, 2, parked), "ns", "t2", policy="p")
    assert rc.patches == [(2, [RAY_POD + "bbbbb"])]
    assert rc.group["replicas"] == 2
    assert r3.status is not None and r3.status.scale is not None
    assert (r3.status.scale.reason, r3.status.scale.target) == ("ShrinkBetweenSteps", 2)
    assert r3.status.scale.workers_to_delete == [RAY_POD + "bbbbb"]
    assert r3.status.active == 2
    assert r3.event is not None and r3.event[:2] == ("Normal", "ShrinkBetweenSteps")
    assert RAY_POD + "bbbbb" in r3.event[2]
    # decided: the same publication does nothing more
    r4 = rollout.reconcile(spec, r3.status, _ray_reports(0, 2, parked), "ns", "t3", policy="p")
    assert len(rc.patches) == 1 and r4.event is None
    # below the floor (2): refused, untouched
    gone = {"aaaaa": True, "ccccc": False}
    r5 = rollout.reconcile(spec, r4.status, _ray_reports(1, 1, gone), "ns", "t4", policy="p")
    assert r5.status is not None and r5.status.scale is not None
    assert r5.status.scale.reason == "ShrinkRejected" and len(rc.patches) == 1
    # growth: replicas up, the deleted pod's entry cleared
    r6 = rollout.reconcile(spec, r5.status, _ray_reports(2, 3, gone), "ns", "t5", policy="p")
    assert rc.patches[-1] == (3, [])
    assert r6.status is not None and r6.status.active == 3
    assert r6.event is not None and r6.event[:2] == ("Normal", "GrowBetweenSteps")


def test_raycluster_missing_group_patch_conflict_and_autoscaler(monkeypatch: pytest.MonkeyPatch):
    rc = _RayCluster(3)
    rc.install(monkeypatch)
    spec = _ray_spec()
    reps = _ray_reports(0, 2, {"aaaaa": True, "bbbbb": False})
    obj, rc.obj = rc.obj, None
    r = rollout.reconcile(spec, None, reps, "ns", "t", policy="p")
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "WorkerSetNotFound"
    assert "worker group rollout" in r.status.scale.message
    assert obj is not None
    obj["spec"]["workerGroupSpecs"][1]["groupName"] = "renamed"
    rc.obj = obj
    r = rollout.reconcile(spec, r.status, reps, "ns", "t", policy="p")
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "WorkerSetNotFound" and rc.patches == []
    obj["spec"]["workerGroupSpecs"][1]["groupName"] = "rollout"
    rc.fail = kube.ApiError(status=422, reason="test operation failed")
    r = rollout.reconcile(spec, r.status, reps, "ns", "t", policy="p")
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "ScaleFailed" and "422" in r.status.scale.message
    rc.fail = None  # retried at the next pass
    r = rollout.reconcile(spec, r.status, reps, "ns", "t", policy="p")
    assert rc.patches == [(2, [RAY_POD + "aaaaa"])]
    auto = _RayCluster(3)
    auto.install(monkeypatch)
    assert auto.obj is not None
    auto.obj["spec"]["enableInTreeAutoscaling"] = True
    r = rollout.reconcile(spec, None, reps, "ns", "t", policy="p")
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "UnsupportedWorkerSet" and auto.patches == []
    assert r.event is not None and r.event[0] == "Warning"


def test_worker_group_reads_the_kuberay_fields():
    obj = {
        "metadata": {"name": "rc"},
        "spec": {
            "enableInTreeAutoscaling": False,
            "workerGroupSpecs": [
                {
                    "groupName": "rollout",
                    "replicas": 4,
                    "minReplicas": 1,
                    "maxReplicas": 8,
                    "numOfHosts": 1,
                    "scaleStrategy": {"workersToDelete": ["rc-rollout-worker-aaaaa"]},
                }
            ],
        },
    }
    found = rollout.worker_group(obj, "rollout", "ns")
    assert found is not None
    i, g = found
    assert i == 0 and (g.replicas, g.min_replicas, g.max_replicas) == (4, 1, 8)
    assert g.workers_to_delete == ("rc-rollout-worker-aaaaa",) and not g.autoscaling
    assert rollout.worker_group(obj, "nope", "ns") is None


@pytest.mark.parametrize("allow", ["", "other", "p2", "p-x, q"])
def test_a_worker_set_that_does_not_opt_in_is_never_resized(
    monkeypatch: pytest.MonkeyPatch, allow: str
):
    ws = _WorkerSet(4, allow=allow)
    ws.install(monkeypatch)
    r = rollout.reconcile(_spec(), None, _published(0, 2), "ns", "t0", policy="p")
    assert ws.patches == [] and ws.replicas == 4
    assert r.status is not None and r.status.scale is not None
    assert r.status.scale.reason == "ScaleNotAllowed"
    assert r.degraded is not None and r.degraded[0] == "ScaleNotAllowed"
    assert "kubectl annotate statefulset pool -n ns rlenergy.io/allow-scale-by=p" in r.degraded[1]
    assert r.status.scale.message == r.degraded[1] and r.event is None
    assert r.status.active == 4  # the dispatcher's count, not a target that was never applied
    # the next pass: the same refusal, the same stored decision (no status write)
    r2 = rollout.reconcile(_spec(), r.status, _published(0, 2), "ns", "t1", policy="p")
    assert r2.status == r.status and ws.patches == []
    # the workload's owner opts in: the same publication is now applied
    ws.annotations = {optin.ANNOTATION: f"{allow},p" if allow else "p"}
    r3 = rollout.reconcile(_spec(), r2.status, _published(0, 2), "ns", "t2", policy="p")
    assert ws.patches == [2] and r3.degraded is None
    assert r3.status is not None and r3.status.scale is not None
    assert r3.status.scale.reason == "ShrinkBetweenSteps"


def test_a_raycluster_that_does_not_opt_in_is_never_patched(monkeypatch: pytest.MonkeyPatch):
    rc = _RayCluster(3)
    assert rc.obj is not None
    rc.obj["metadata"]["annotations"] = {}
    rc.install(monkeypatch)
    reps = _ray_reports(0, 2, {"aaaaa": True, "bbbbb": False})
    r = rollout.reconcile(_ray_spec(), None, reps, "ns", "t", policy="p")
    assert rc.patches == [] and r.degraded is not None
    assert "kubectl annotate raycluster rc -n ns rlenergy.io/allow-scale-by=p" in r.degraded[1]
    rc.obj["metadata"]["annotations"] = {optin.ANNOTATION: "p"}
    r = rollout.reconcile(_ray_spec(), r.status, reps, "ns", "t", policy="p")
    assert rc.patches == [(2, [RAY_POD + "aaaaa"])] and r.degraded is None


def test_optin_names_policies_exactly():
    assert optin.allows({optin.ANNOTATION: " a , b "}, "b")
    assert not optin.allows({optin.ANNOTATION: "*"}, "b")
    assert not optin.allows({optin.ANNOTATION: "ab"}, "a")
    assert not optin.allows(None, "a") and not optin.allows({}, "a")
