"""FlexFloor cost-aware guard: release and placement only when occupied GPU-seconds fall.

We test these aspects:
* a release the rule allows is refused with ``OccupancyWouldRise`` when the step-time model
  says survivors slow down more than the released GPU saves, and granted when it pays;
* property: the guarded plan never predicts more occupied GPU-seconds than keeping the group,
  releases a subset of the unguarded plan, and keeps every expert hosted;
* the residual-length model (mean residual life past a prediction) and the placement forecast;
* the placement forecast lets part of the idle workers leave when the survivors' memory holds
  only some of their experts (as the release rule does), and averaged over the predictor's
  error it charges a worker for the longest of its noisy lengths (so concentrating responses
  predicted alike stops paying when predictions are poor);
* the predictor scores its own log error per kind (history / fallback).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_support import LinearCost

from rlenergy.control.moe import base, placement, predictor, release

GB = 10**9


def layout(experts: int = 8) -> base.MoeLayout:
    return base.MoeLayout(
        num_experts=experts,
        expert_bytes=GB,
        dense_bytes=2 * GB,
        kv_bytes_per_token=1000,
        worker_memory_bytes=40 * GB,
    )


def group(unfinished: Sequence[int], remaining: Sequence[float]) -> list[base.WorkerState]:
    shards = [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    return [
        base.WorkerState(
            w,
            frozenset(shards[w]),
            unfinished[w],
            0,
            running=unfinished[w],
            remaining_steps=remaining[w],
        )
        for w in range(4)
    ]


def test_release_refused_when_survivors_slow_down_more_than_it_saves():
    # Step time dominated by experts per worker: releasing 1 of 4 moves 2 experts onto one
    # survivor (2 -> 4 experts): 3 x (0 + 4) > 4 x (0 + 2) per step.
    workers = group([5, 5, 5, 0], [100, 100, 100, 0])
    plan = release.FlexFloorPlanner(layout(), LinearCost(0.0, 1e-3)).plan(workers, 0)
    assert plan.release == ()
    assert plan.refused[0].reason is base.RefusalReason.OCCUPANCY_WOULD_RISE
    assert "occupied GPU-seconds" in plan.refused[0].message
    assert plan.predicted_gpu_s == plan.predicted_keep_gpu_s


def test_release_granted_when_it_pays():
    # Fixed cost per step dominates: 3 x 10 ms < 4 x 10 ms.
    workers = group([5, 5, 5, 0], [100, 100, 100, 0])
    planner = release.FlexFloorPlanner(layout(), LinearCost(1e-2, 1e-5))
    plan = planner.plan(workers, 0)
    assert plan.release == (3,)
    assert plan.predicted_gpu_s is not None and plan.predicted_keep_gpu_s is not None
    assert plan.predicted_gpu_s < plan.predicted_keep_gpu_s


def test_copy_stall_can_outweigh_a_short_horizon():
    workers = group([5, 5, 5, 0], [2, 2, 2, 0])
    plan = release.FlexFloorPlanner(layout(), LinearCost(1e-2, 0.0, copy_s=1.0)).plan(workers, 0)
    assert plan.release == ()


def test_forecast_segments_shrink_the_batch():
    # One worker predicted to run 10 more steps, another 1000: the forecast after step 10
    # sees only the long one running.
    workers = [
        base.WorkerState(0, frozenset({0}), 1, 0, running=1, remaining_profile=(10.0,)),
        base.WorkerState(1, frozenset({1}), 1, 0, running=1, remaining_profile=(1000.0,)),
    ]
    cost = LinearCost(1.0, 0.0)
    planner = release.FlexFloorPlanner(layout(experts=2), cost)
    assert planner.predicted_occupied_gpu_s(workers) == pytest.approx(2 * 1000.0)


def test_guard_requires_a_cost_model():
    with pytest.raises(Exception, match="step-time model"):
        release.FlexFloorPlanner(layout()).predicted_occupied_gpu_s(group([0] * 4, [0] * 4))


@settings(max_examples=60, deadline=None)
@given(
    unfinished=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    remaining=st.lists(st.floats(0.0, 5000.0), min_size=4, max_size=4),
    fixed=st.floats(0.0, 0.05),
    per_expert=st.floats(0.0, 0.01),
    copy=st.floats(0.0, 2.0),
)
def test_property_guard_never_predicts_more_occupancy(
    unfinished, remaining, fixed, per_expert, copy
):
    remaining = [r if u else 0.0 for u, r in zip(unfinished, remaining, strict=True)]
    workers = group(unfinished, remaining)
    lay = layout()
    guarded = release.FlexFloorPlanner(lay, LinearCost(fixed, per_expert, copy)).plan(workers, 0)
    free = release.FlexFloorPlanner(lay).plan(workers, 0)
    assert set(guarded.release) <= set(free.release)
    assert guarded.predicted_gpu_s is not None and guarded.predicted_keep_gpu_s is not None
    assert guarded.predicted_gpu_s <= guarded.predicted_keep_gpu_s
    hosted = {e for w in workers if w.worker in guarded.active_after for e in w.experts}
    hosted |= {m.expert for m in guarded.moves}
    assert hosted == set(range(lay.num_experts))
    assert all(m.target in guarded.active_after for m in guarded.moves)


def test_residual_length_mean_residual_life():
    model = predictor.ResidualLength([100, 200, 300, 1000])
    assert model.remaining(500, 100) == 400  # still below its prediction
    assert model.remaining(100, 250) == pytest.approx((300 + 1000) / 2 - 250)
    assert model.remaining(100, 5000) == 1.0  # past every observed length
    p = predictor.LengthPredictor()
    assert p.residual() is None
    p.observe_step(["a", "b"], [10, 20])
    assert p.residual() is not None


def test_placement_forecast_prefers_concentration_when_release_pays():
    lay = layout(experts=4)
    shards = [frozenset({0, 1}), frozenset({2, 3})]
    preds = [1000.0, 1000.0, 10.0, 10.0]
    prompts = [10] * 4
    cost = LinearCost(1e-2, 0.0)
    concentrated = placement.forecast_occupied_gpu_s(
        [0, 0, 1, 1], preds, prompts, shards, lay, cost, elastic=True
    )
    spread = placement.forecast_occupied_gpu_s(
        [0, 1, 0, 1], preds, prompts, shards, lay, cost, elastic=True
    )
    fixed = placement.forecast_occupied_gpu_s(
        [0, 0, 1, 1], preds, prompts, shards, lay, cost, elastic=False
    )
    assert concentrated < spread == pytest.approx(fixed)
    assert placement.forecast_occupied_gpu_s([], [], [], shards, lay, cost, elastic=True) == 0.0


def test_placement_forecast_partial_release_when_memory_holds_only_some_experts():
    # 4 workers x 2 experts of 10 GB, 60 GB each (40 GB of KV room): the busy worker with
    # 15 GB of predicted KV has room for 2 more experts, so releasing all three idle workers
    # (6 experts) is refused, but two of them may leave when one idle worker stays (their 4
    # experts fit the two survivors).
    lay = base.MoeLayout(
        num_experts=8,
        expert_bytes=10 * GB,
        dense_bytes=0,
        kv_bytes_per_token=GB // 1000,
        worker_memory_bytes=60 * GB,
    )
    shards = [frozenset({2 * w, 2 * w + 1}) for w in range(4)]
    cost = LinearCost(1e-2, 0.0)
    preds = [15000.0, 10.0, 10.0, 10.0]  # 15 GB of predicted KV on worker 0
    prompts = [0] * 4
    elastic = placement.forecast_occupied_gpu_s(
        [0, 1, 2, 3], preds, prompts, shards, lay, cost, elastic=True
    )
    fixed = placement.forecast_occupied_gpu_s(
        [0, 1, 2, 3], preds, prompts, shards, lay, cost, elastic=False
    )
    # Two workers stay after the short responses: about half of the fixed group's cost.
    assert 0.4 * fixed < elastic < 0.6 * fixed


def test_expected_forecast_sees_the_longest_of_noisy_lengths():
    lay = layout(experts=4)
    shards = [frozenset({0, 1}), frozenset({2, 3})]
    prompts = [10] * 8
    cost = LinearCost(1e-2, 0.0)
    preds = [100.0] * 8
    point = placement.expected_occupied_gpu_s(
        [0] * 8, preds, [0.0] * 8, prompts, shards, lay, cost, elastic=True
    )
    assert point == pytest.approx(
        placement.forecast_occupied_gpu_s([0] * 8, preds, prompts, shards, lay, cost, elastic=True)
    )
    noisy = placement.expected_occupied_gpu_s(
        [0] * 8, preds, [1.0] * 8, prompts, shards, lay, cost, elastic=True, draws=16
    )
    assert noisy > 1.5 * point  # the max of 8 noisy lengths is well above their median
    capped = placement.expected_occupied_gpu_s(
        [0] * 8, preds, [1.0] * 8, prompts, shards, lay, cost, elastic=True, max_tokens=100.0
    )
    assert capped == pytest.approx(point)
    with pytest.raises(placement.errors.InvalidInputError):
        placement.expected_occupied_gpu_s([0], [1.0], [], [1], shards, lay, cost, elastic=True)


def test_predictor_scores_its_log_error_per_kind():
    import math

    p = predictor.LengthPredictor(history_epochs=2, default_length_tokens=100.0)
    assert p.log_error_sigma(True) is None and p.log_error_sigma(False) is None
    p.observe_step(["a", "b"], [100, 400])  # scored against the default 100 (fallback)
    fallback = math.sqrt((0.0 + math.log(4) ** 2) / 2)
    assert p.log_error_sigma(False) == pytest.approx(fallback)
    assert p.log_error_sigma(True) == pytest.approx(fallback)  # stands in before history
    p.observe_step(["a", "b"], [100, 400])  # same lengths: history predicts them exactly
    assert p.log_error_sigma(True) == pytest.approx(0.0, abs=1e-9)


def test_release_that_slows_the_rest_beyond_the_allowance_is_refused():
    # Fixed 10 ms + 1 ms per expert on the busiest worker: releasing worker 3 spreads its
    # experts one per survivor, 12 -> 13 ms per step (+8.3 %), 3 x 13 < 4 x 12 GPU-ms: it pays in
    # occupancy, but not within a 2 % slowdown allowance; a 20 % allowance lets it go.
    workers = group([5, 5, 5, 0], [100, 100, 100, 0])
    cost = LinearCost(1e-2, 1e-3)
    assert release.FlexFloorPlanner(layout(), cost).plan(workers, 0).release == (3,)
    strict = release.FlexFloorPlanner(layout(), cost, max_slowdown=0.02).plan(workers, 0)
    assert strict.release == ()
    assert strict.refused[0].reason is base.RefusalReason.OCCUPANCY_WOULD_RISE
    loose = release.FlexFloorPlanner(layout(), cost, max_slowdown=0.2).plan(workers, 0)
    assert loose.release == (3,)
    with pytest.raises(release.errors.InvalidInputError):
        release.FlexFloorPlanner(layout(), cost, max_slowdown=-0.1)
