"""Between-steps resizing in detail: the whole decision, message included.

We test these aspects:
* ``decide_scale``: every field of a grow, a shrink, a no-op and a refusal (the operator
  writes ``reason`` and ``message`` into the policy's status);
* ``decide_group_scale``: the exact refusal of an autoscaled group, of several hosts per
  replica, of a target outside ``[minReplicas, maxReplicas]`` (the bounds themselves are
  allowed), of a shrink with too few released pods (one pod: singular); a shrink's whole
  decision with the pods it deletes, needed and known.
"""

from __future__ import annotations

from rlenergy.control.moe import scale

RESIZE, NONE, REFUSED = scale.ScaleAction.RESIZE, scale.ScaleAction.NONE, scale.ScaleAction.REFUSED


def test_decisions_in_full():
    assert scale.decide_scale(2, 4, 2) == scale.ScaleDecision(
        RESIZE, 2, 4, 2, "GrowBetweenSteps", "grow from 2 to 4 workers (floor 2)"
    )
    assert scale.decide_scale(4, 2, 2) == scale.ScaleDecision(
        RESIZE, 4, 2, 2, "ShrinkBetweenSteps", "shrink from 4 to 2 workers (floor 2)"
    )
    assert scale.decide_scale(3, 3, 2) == scale.ScaleDecision(
        NONE, 3, 3, 2, "AtTarget", "3 workers"
    )
    assert scale.decide_scale(2, 1, 2) == scale.ScaleDecision(
        REFUSED,
        2,
        2,
        2,
        "ShrinkRejected",
        "cannot scale from 2 to 1 workers: minimum is 2; the worker set stays at 2",
    )


def group(replicas: int = 3, **kw: object) -> scale.WorkerGroup:
    return scale.WorkerGroup(cluster="rc", namespace="ns", group="rollout", replicas=replicas, **kw)  # type: ignore[arg-type]


def pod(suffix: str) -> str:
    return f"rc-rollout-worker-{suffix}"


PARKED = [(f"ns/{pod('aaaaa')}", True), (f"ns/{pod('bbbbb')}", True)]


def refusal(current: int, desired: int, floor: int, reason: str, why: str) -> scale.ScaleDecision:
    return scale.ScaleDecision(
        REFUSED,
        current,
        current,
        floor,
        reason,
        f"cannot scale from {current} to {desired} workers: {why}; "
        f"the worker group stays at {current}",
    )


def test_group_refusals_in_full():
    auto = scale.decide_group_scale(group(3, autoscaling=True), 2, 1, PARKED)
    assert auto == scale.GroupScaleDecision(
        refusal(
            3,
            2,
            1,
            "UnsupportedWorkerSet",
            "the RayCluster's in-tree autoscaler owns replicas and workersToDelete "
            "(enableInTreeAutoscaling)",
        ),
        (),
    )
    hosts = scale.decide_group_scale(group(3, hosts_per_replica=2), 2, 1, PARKED)
    assert hosts.decision == refusal(
        3,
        2,
        1,
        "UnsupportedWorkerSet",
        "numOfHosts is 2 (a replica of several pods is not resized)",
    )
    high = scale.decide_group_scale(group(3, max_replicas=4), 5, 1, PARKED)
    assert high.decision == refusal(
        3,
        5,
        1,
        "OutsideWorkerGroupBounds",
        "the worker group's minReplicas..maxReplicas is [0, 4] (KubeRay would clamp)",
    )
    unknown = scale.decide_group_scale(group(2), 1, 1, [(f"ns/{pod('aaaaa')}", False)])
    assert unknown == scale.GroupScaleDecision(
        refusal(
            2,
            1,
            1,
            "WorkersUnknown",
            "1 released worker pod needed, 0 known (pods of worker group rollout with every "
            "GPU parked in the node reports); not guessing which to delete",
        ),
        (),
        needed=1,
        known=0,
    )


def test_the_bounds_themselves_are_allowed():
    up = scale.decide_group_scale(group(3, max_replicas=4), 4, 1, PARKED)
    assert (up.decision.action, up.decision.target) == (RESIZE, 4)
    down = scale.decide_group_scale(group(3, min_replicas=2), 2, 1, PARKED)
    assert (down.decision.action, down.decision.target) == (RESIZE, 2)


def test_a_shrink_in_full():
    out = scale.decide_group_scale(group(3), 2, 2, PARKED)
    assert out == scale.GroupScaleDecision(
        scale.ScaleDecision(
            RESIZE,
            3,
            2,
            2,
            "ShrinkBetweenSteps",
            f"shrink from 3 to 2 workers (floor 2); deleting {pod('aaaaa')}",
        ),
        (pod("aaaaa"),),
        (pod("aaaaa"),),
        needed=1,
        known=2,
    )


def test_a_pod_is_released_only_if_every_gpu_is_parked_in_any_order():
    gpus = [(f"ns/{pod('aaaaa')}", False), (f"ns/{pod('aaaaa')}", True)]
    assert scale.group_pods(group(), gpus) == {pod("aaaaa"): False}


def test_refusals_keep_the_pending_deletions():
    pending = (pod("zzzzz"),)
    for g, desired in (
        (group(3, hosts_per_replica=2, workers_to_delete=pending), 2),
        (group(3, max_replicas=3, workers_to_delete=pending), 4),
    ):
        out = scale.decide_group_scale(g, desired, 1, PARKED)
        assert out.decision.action is REFUSED
        assert (out.workers_to_delete, out.chosen) == (pending, ())


def test_a_shrink_by_two_names_both_pods():
    out = scale.decide_group_scale(group(4), 2, 2, PARKED)
    assert out.chosen == (pod("aaaaa"), pod("bbbbb"))
    assert out.decision.message == (
        f"shrink from 4 to 2 workers (floor 2); deleting {pod('aaaaa')}, {pod('bbbbb')}"
    )
