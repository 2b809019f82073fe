"""Failed FlexFloor shrink steps in the operator (``rolloutfaults``, ``rollout.reconcile``).

We test these aspects, one per way a shrink step can fail:
* a rollout worker pod lost mid-rollout (its node agent listed it in ``endedPods``): the
  policy is Degraded ``RolloutWorkerLost`` naming the pod, its node and its reset GPUs, one
  Warning Event, ``status.rollout.failure.lostWorkers``; not again at the next pass (no
  churn: same ``since``); cleared once the dispatcher publishes a later step;
* not lost: a parked (released) pod that ended, a pod the dispatcher does not name, a pod
  that ended before the published step;
* the dispatcher's failures (``ReleaseAborted``, ``ResizeInFlight``, ``RankLost``) from its
  publication: Degraded with that reason and an Event per new failure;
* ``reloadedExperts`` and ``placementUnbalanced`` appear in ``status.rollout``;
* (the agent's list of the pods it reset is tested in ``tests/unit/agent/test_pod_end.py``);
  the planner's ``rank_lost`` names the experts to reload and the imbalance;
  ``failure_of`` maps each outcome to what the dispatcher publishes.
"""

from __future__ import annotations

from typing import Any

from rlenergy_operator import rollout, rolloutfaults

from rlenergy.api import node as api_node
from rlenergy.api import rollout as api_rollout
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.moe import base, placement
from rlenergy.sdk import planner
from rlenergy.sdk import rollout as sdk_rollout

GB = 10**9
NOW = "2026-12-01T23:00:00.000Z"
LATER = "2026-12-01T23:00:05.000Z"


def _spec() -> api_policy.RLEnergyPolicySpec:
    return api_policy.parse_policy(
        {
            "selector": {"matchLabels": {"app": "rl"}},
            "rollout": {
                "experts": {"count": 16, "bytesPerExpert": GB},
                "workerMemoryBytes": 10 * GB,
                "denseBytes": 2 * GB,
                "releaseAction": "park",
            },
        }
    )


def _dispatch(step: int, **kw: Any) -> dict[str, Any]:
    return {
        "step": step,
        "activeWorkers": 2,
        "workerPods": ["rl/worker-0", "rl/worker-1"],
        **kw,
    }


def _reports(dispatch: dict[str, Any], ended: list[dict[str, Any]] = ()) -> list[Any]:
    return [
        api_node.NodeReport.model_validate(
            {"policyName": "p", "nodeName": "n0", "rollout": dispatch}
        ),
        api_node.NodeReport.model_validate(
            {"policyName": "p", "nodeName": "n1", "endedPods": list(ended)}
        ),
    ]


def _ended(pod: str = "rl/worker-1", step: int = 4, parked: bool = False) -> dict[str, Any]:
    return {"pod": pod, "how": "EndedInApi", "gpus": ["GPU-a", "GPU-b"], "parked": parked,
            "step": step}  # fmt: skip


def _pass(previous, reports, now=NOW):
    return rollout.reconcile(_spec(), previous, reports, "rl", now, policy="p")


def test_worker_lost_mid_rollout_degrades_once_and_clears_at_a_later_step():
    reports = _reports(_dispatch(3), [_ended(step=4)])
    first = _pass(None, reports)
    f = first.status.failure
    assert f is not None and f.reason == "RolloutWorkerLost" and f.lost_workers == ["rl/worker-1"]
    assert first.degraded is not None and first.degraded[0] == "RolloutWorkerLost"
    for text in ("rl/worker-1 on node n1", "GPU-a, GPU-b reset", "rank_lost", "after step 3"):
        assert text in f.message, f.message
    assert first.fault_event is not None and first.fault_event[:2] == (
        "Warning",
        "RolloutWorkerLost",
    )
    again = _pass(first.status, reports, LATER)
    assert again.fault_event is None and again.status.failure == f  # same since: no churn
    assert again.degraded == first.degraded
    # The dispatcher recovered: a later step without the pod (or a replacement of it).
    healed = _pass(again.status, _reports(_dispatch(5), [_ended(step=4)]), LATER)
    assert healed.status.failure is None and healed.degraded is None
    assert healed.fault_event is None


def test_not_lost_released_unknown_or_before_the_step():
    for ended in (
        _ended(parked=True),  # a released worker (every GPU parked) whose pod was removed
        _ended(pod="rl/other"),  # not a rank of the group
        _ended(step=2),  # ended before the published step (an earlier group)
    ):
        res = _pass(None, _reports(_dispatch(3), [ended]))
        assert res.status.failure is None and res.degraded is None and res.fault_event is None


def test_dispatcher_failures_degrade_with_their_reason():
    previous = None
    for step, reason in ((3, "ReleaseAborted"), (4, "ResizeInFlight"), (5, "RankLost")):
        failure = {"reason": reason, "message": f"what happened at {step}", "ranks": [1]}
        res = _pass(previous, _reports(_dispatch(step, failure=failure)))
        f = res.status.failure
        assert f is not None and f.reason == reason and f.step == step
        assert f.message == f"step {step} (ranks [1]): what happened at {step}"
        assert res.degraded == (reason, f.message)
        assert res.fault_event == ("Warning", reason, f.message)  # a new failure each step
        previous = res.status
    assert _pass(previous, _reports(_dispatch(6))).degraded is None


def test_reloaded_experts_and_unbalanced_placement_in_status():
    res = _pass(
        None,
        _reports(_dispatch(3, reloadedExperts=[6, 7], placementUnbalanced=True)),
    )
    assert res.status.reloaded_experts == [6, 7] and res.status.placement_unbalanced
    dumped = res.status.model_dump(by_alias=True, exclude_none=True)
    assert dumped["reloadedExperts"] == [6, 7] and dumped["placementUnbalanced"] is True
    plain = _pass(res.status, _reports(_dispatch(4)))
    assert plain.status.reloaded_experts is None and not plain.status.placement_unbalanced


def test_lost_before_any_publication_is_no_finding():
    reports = [
        api_node.NodeReport.model_validate(
            {"policyName": "p", "nodeName": "n1", "endedPods": [_ended()]}
        )
    ]
    assert rolloutfaults.assess(None, None, reports, NOW).failure is None


def _planner() -> planner.RolloutPlanner:
    layout = base.MoeLayout(
        num_experts=6, expert_bytes=1, dense_bytes=0, kv_bytes_per_token=1,
        worker_memory_bytes=10**6,
    )  # fmt: skip
    fluid = placement.FluidFinishModel(0.01, 0.0, 1e6, 1, 256)
    return planner.RolloutPlanner(layout, fluid, clock=lambda: 0.0)


def _progress(worker: int, experts: list[int]) -> api_rollout.ProgressReport:
    return api_rollout.ProgressReport.model_validate(
        {"rolloutId": "r", "worker": worker, "decodeStep": 5, "unfinished": 1,
         "experts": experts, "kvBytes": 0}
    )  # fmt: skip


def _placed_planner() -> planner.RolloutPlanner:
    """A planner with one prompt of 3 responses placed over ranks 0, 1, 2."""
    p = _planner()
    p.place(
        api_rollout.PlacementRequest.model_validate(
            {"rolloutId": "r", "workers": [0, 1, 2],
             "prompts": [{"promptId": "a", "promptTokens": 1, "responses": 3}]}
        )
    )  # fmt: skip
    return p


def test_rank_lost_names_the_experts_to_reload_and_the_imbalance():
    p = _placed_planner()
    p.progress([_progress(0, [0, 1]), _progress(1, [2, 3]), _progress(2, [4, 5, 1])])
    loss = p.rank_lost(2, "pod rl/worker-2 deleted")
    # Expert 1 survives on rank 0; 4 and 5 only lived on rank 2: one each onto the survivors.
    assert loss.reload == {4: 0, 5: 1} and not loss.unbalanced
    f = sdk_rollout.failure_of(loss)
    assert f is not None and f.reason == "RankLost" and f.ranks == [2]
    assert "experts [4, 5] reloaded onto ranks [0, 1]" in f.message
    assert "abort-style" in f.message
    odd = _placed_planner()
    odd.progress([_progress(0, [0, 1]), _progress(1, [2, 3]), _progress(2, [4])])
    assert odd.rank_lost(2, "preempted").unbalanced  # 3 experts on rank 0, 2 on rank 1


def test_failure_of_each_outcome():
    def outcome(status: str, reason: str | None) -> api_rollout.ReleaseOutcome:
        return api_rollout.ReleaseOutcome.model_validate(
            {"rolloutId": "r", "decisionId": 3, "status": status, "activeWorkers": [0, 1],
             "reason": reason}
        )  # fmt: skip

    assert sdk_rollout.failure_of(outcome("Committed", None)) is None
    aborted = sdk_rollout.failure_of(outcome("Aborted", "rank 1 missed the ack deadline"))
    assert aborted is not None and aborted.reason == "ReleaseAborted"
    assert aborted.message == "release 3: rank 1 missed the ack deadline"
    inflight = sdk_rollout.failure_of(outcome("InFlight", "resize still running"))
    assert inflight is not None and inflight.reason == "ResizeInFlight"


def test_status_model_round_trip():
    f = api_status.RolloutFailureStatus(reason="RankLost", step=2, since=NOW)
    assert api_status.RolloutStatus(failure=f).model_dump(by_alias=True)["failure"]["step"] == 2


def test_feed_lost_ranks_calls_rank_lost_for_the_active_ranks_on_lost_pods():
    p = _placed_planner()
    pods = ["rl/w-0", "rl/w-1", "rl/w-1"]  # ranks 1 and 2 share a pod
    losses = sdk_rollout.feed_lost_ranks(p, ["rl/w-1", "rl/unknown"], pods)
    assert [x.rank for x in losses] == [1, 2] and p.active_workers == (0,)
    assert all(x.teardown for x in losses)
    assert sdk_rollout.feed_lost_ranks(p, ["rl/w-1"], pods) == []  # already gone
