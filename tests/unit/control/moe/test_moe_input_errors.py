"""FlexFloor refuses bad input with the field to change and what is allowed.

We test these aspects:
* every ``InvalidInputError`` of the planner names its field (the policy path a person edits,
  ``rollout.experts``, ``minActiveWorkers``, ...) and says, in its exact words, what is wrong
  and what values are allowed (the GB figures a memory refusal quotes included);
* the boundary values the messages promise are accepted (``>= 1`` accepts 1, ``[0, 1]``
  accepts 0 and 1, a worker holding exactly the dense weights and one expert is valid).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from moe_support import MODEL

from rlenergy import errors
from rlenergy.control.moe import base, placement, predictor, protocol, release, scale

GB = 10**9


def refused(call: Callable[[], object], field: str, reason: str) -> None:
    """``call`` raises ``InvalidInputError`` for ``field`` with exactly ``reason``."""
    with pytest.raises(errors.InvalidInputError) as info:
        call()
    assert (info.value.field, info.value.reason) == (field, reason)
    assert str(info.value) == f"{field}: {reason}"


def layout(**kw: int) -> base.MoeLayout:
    args = {
        "num_experts": 8,
        "expert_bytes": GB,
        "dense_bytes": 2 * GB,
        "kv_bytes_per_token": 1000,
        "worker_memory_bytes": 20 * GB,
    }
    args.update(kw)
    return base.MoeLayout(**args)  # type: ignore[arg-type]


def test_layout_errors_name_the_field():
    refused(lambda: layout(num_experts=0), "experts", "need >= 1 expert, got 0")
    for name in ("expert_bytes", "dense_bytes", "kv_bytes_per_token", "worker_memory_bytes"):
        refused(lambda name=name: layout(**{name: -1}), name, "must be >= 0")
    refused(lambda: layout(min_active_workers=0), "minActiveWorkers", "must be >= 1, got 0")
    # 30.05 GB dense + 1.215 GB per expert do not fit 31.05 GB (the sizes are quoted rounded).
    refused(
        lambda: layout(
            dense_bytes=30_050_000_000,
            expert_bytes=1_215_000_000,
            worker_memory_bytes=31_050_000_000,
        ),
        "rollout.experts",
        "one worker cannot hold the dense weights (30.1 GB) and one expert (1.22 GB) in 31.1 GB",
    )
    # Exactly dense weights plus one expert: valid, one slot per worker.
    exact = layout(dense_bytes=2 * GB, expert_bytes=GB, worker_memory_bytes=3 * GB)
    assert exact.expert_slots_per_worker == 1
    assert exact.expert_floor() == 8


def test_expert_floor_and_parallelism_errors():
    refused(
        lambda: base.expert_floor(8, 0),
        "rollout.experts",
        "a worker cannot hold a single expert: no valid worker set",
    )
    assert base.expert_floor(8, 1) == 8
    for dp, ep in ((0, 1), (1, 0), (0, 0)):
        refused(
            lambda dp=dp, ep=ep: base.validate_parallelism(dp, ep),
            "rollout.parallelism",
            "data and expert parallel sizes must be >= 1",
        )
    base.validate_parallelism(1, 1)  # one rank: a valid (if inelastic) rollout
    refused(
        lambda: base.validate_parallelism(2, 1),
        "rollout.parallelism",
        "DP=2 with EP=1 is not an elastic EP rollout: run expert parallelism across all "
        "data-parallel ranks (EP = DP), or leave rollout release off for this job",
    )


def test_placement_errors_name_the_field():
    refused(
        lambda: placement.place_by_length([1.0], [0], [], 1),
        "workers",
        "need at least one rollout worker",
    )
    refused(
        lambda: placement.place_by_length([1.0, 2.0], [0], [10], 1),
        "prompt_tokens",
        "need one prompt length per response",
    )
    refused(
        lambda: placement.place_by_length([1.0], [0], [10], 1, max_responses_per_worker=0),
        "max_responses_per_worker",
        "must be >= 1",
    )
    refused(
        lambda: placement.place_by_length([1.0], [0], [10], 1, balance="token"),  # type: ignore[arg-type]
        "balance",
        'must be "count" or "tokens", not \'token\'',
    )
    # 2115 tokens x 1 MB = 2.115 GB against 1.215 GB: both quoted to 10 MB.
    refused(
        lambda: placement.place_by_length([2115.0], [0], [1_215_000_000], 10**6),
        "placement",
        "response 0 needs 2.12 GB of KV cache, more than any worker has (1.22 GB): shorten "
        "max_response_length or add memory",
    )
    refused(lambda: placement.place_even(3, 0), "workers", "need at least one rollout worker")
    refused(
        lambda: placement.place_lockstep([1.0], 0), "workers", "need at least one rollout worker"
    )


def test_forecast_errors_name_the_field():
    lay = layout()
    shards = [frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})]
    cost = _ConstantCost()
    for preds, prompts in (([1.0, 2.0], [0]), ([1.0], [0, 0])):
        refused(
            lambda preds=preds, prompts=prompts: placement.forecast_occupied_gpu_s(
                [0], preds, prompts, shards, lay, cost, elastic=False
            ),
            "placement",
            "need one prediction and prompt per response",
        )
    refused(
        lambda: placement.expected_occupied_gpu_s(
            [0], [1.0], [], [0], shards, lay, cost, elastic=False
        ),
        "log_sigma",
        "need one error sigma per prediction",
    )
    refused(
        lambda: placement.expected_occupied_gpu_s(
            [0], [1.0], [0.5], [0], shards, lay, cost, elastic=False, draws=0
        ),
        "draws",
        "must be >= 1",
    )
    # One draw of one response of 10 steps on a kept group of 2 at 1 s per step (sigma 0.5
    # but a single draw: whatever length is drawn, it is clipped to max_tokens = 1 step).
    one = placement.expected_occupied_gpu_s(
        [0], [10.0], [0.5], [0], shards, lay, cost, elastic=False, draws=1, max_tokens=1.0
    )
    assert one == pytest.approx(2.0)


def test_fluid_model_and_balanced_errors_name_the_field():
    why = "an engine needs KV memory and room for one running response"
    refused(lambda: placement.FluidFinishModel(0.01, 0.0, 0.0, 1, 1), "placement", why)
    refused(lambda: placement.FluidFinishModel(0.01, 0.0, 1e9, 1, 0), "placement", why)
    # The smallest engine the contract allows: 1 byte of KV, one running response.
    tiny = placement.FluidFinishModel(0.01, 0.0, 1.0, 1, 1)
    assert tiny.max_running == 1
    refused(
        lambda: placement.place_balanced([1.0], [0], 0, MODEL),
        "workers",
        "need at least one rollout engine",
    )
    refused(
        lambda: placement.place_balanced([1.0, 2.0], [0], 2, MODEL),
        "prompt_tokens",
        "need one prompt length per response",
    )
    for engine_of, preds, prompts in (([0], [1.0, 2.0], [0]), ([0], [1.0], [0, 0])):
        refused(
            lambda e=engine_of, p=preds, q=prompts: placement.predicted_makespan_s(
                e, p, q, 2, MODEL
            ),
            "placement",
            "need one engine, length and prompt each",
        )
    refused(
        lambda: placement.predicted_makespan_s([2], [1.0], [0], 2, MODEL),
        "placement",
        "engine 2 outside [0, 2)",
    )
    refused(
        lambda: placement.predicted_makespan_s([-1], [1.0], [0], 2, MODEL),
        "placement",
        "engine -1 outside [0, 2)",
    )
    for rank_of, preds, prompts in (([0], [1.0, 2.0], [0]), ([0], [1.0], [0, 0])):
        refused(
            lambda r=rank_of, p=preds, q=prompts: placement.lockstep_makespan_s(r, p, q, 2, MODEL),
            "placement",
            "need one rank, length and prompt each",
        )
    for bad in (2, -1):
        refused(
            lambda bad=bad: placement.lockstep_makespan_s([bad], [1.0], [0], 2, MODEL),
            "placement",
            "a rank outside [0, 2)",
        )


def test_predictor_errors_name_the_field():
    refused(lambda: predictor.ResidualLength([]), "lengths_tokens", "need at least one length")
    refused(lambda: predictor.LengthPredictor(history_epochs=0), "history_epochs", "must be >= 1")
    for q in (-0.1, 1.5):
        refused(
            lambda q=q: predictor.LengthPredictor(fallback_quantile=q),
            "fallback_quantile",
            "must be within [0, 1]",
        )
    refused(
        lambda: predictor.LengthPredictor(default_length_tokens=0.5),
        "default_length_tokens",
        "must be >= 1 token",
    )
    # The limits themselves are allowed.
    assert predictor.LengthPredictor(default_length_tokens=1).predict(["a"]) == (
        predictor.LengthPrediction(1.0, False),
    )
    for q, expected in ((0.0, 10.0), (1.0, 30.0)):
        p = predictor.LengthPredictor(history_epochs=1, fallback_quantile=q)
        p.observe_step(["a", "b", "c"], [30, 10, 20])
        assert p.fallback_length_tokens() == expected
    p = predictor.LengthPredictor()
    why = "need one length (>= 1 token) per prompt id, at least one"
    refused(lambda: p.observe_step(["a"], [10, 20]), "lengths_tokens", why)
    refused(lambda: p.observe_step(["a", "b"], [10]), "lengths_tokens", why)
    refused(lambda: p.observe_step([], []), "lengths_tokens", why)
    refused(lambda: p.observe_step(["a"], [0.5]), "lengths_tokens", "length 0.5 < 1 token")
    # One token and 1.5 tokens are valid lengths: the median of (1, 1.5, 2) is 1.5.
    p.observe_step(["a", "b", "c"], [1, 1.5, 2])
    assert p.fallback_length_tokens() == 1.5


def test_protocol_errors_name_the_field():
    why = "ack window and apply margin must be >= 1 decode step"
    for ack, margin in ((0, 1), (1, 0)):
        refused(lambda a=ack, m=margin: protocol.ProtocolTiming(a, m), "rollout.releaseTiming", why)
    quick = protocol.ProtocolTiming(1, 1)
    plan = base.ReleasePlan(release=(2,), moves=(), refused=(), active_after=(0, 1))
    d = protocol.make_decision(plan, decision_id=1, active_before=(0, 1, 2), step=5, timing=quick)
    assert (d.ack_deadline_step, d.apply_at_step) == (6, 7)
    empty = base.ReleasePlan(release=(), moves=(), refused=(), active_after=())
    refused(
        lambda: protocol.make_decision(
            empty, decision_id=1, active_before=(0, 1), step=0, timing=quick
        ),
        "release",
        "the plan releases no worker",
    )
    outside = base.ReleasePlan(release=(1, 5, 4), moves=(), refused=(), active_after=())
    refused(
        lambda: protocol.make_decision(
            outside, decision_id=1, active_before=(0, 1), step=0, timing=quick
        ),
        "release",
        "workers [4, 5] are not active",
    )


def test_release_and_scale_errors_name_the_field():
    lay = layout()
    refused(
        lambda: release.FlexFloorPlanner(lay, _ConstantCost(), max_slowdown=-0.1),
        "max_slowdown",
        "must be >= 0",
    )
    ws = [
        base.WorkerState(0, frozenset(range(4)), 0, 0, remaining_steps=0.0),
        base.WorkerState(1, frozenset(range(4, 8)), 1, 0, running=1, remaining_steps=10.0),
    ]
    # No slowdown allowed at all is a valid allowance (only releases that do not slow down).
    zero = release.FlexFloorPlanner(lay, _ConstantCost(), max_slowdown=0.0)
    assert zero.plan(ws, 0).release == (0,)
    refused(
        lambda: release.FlexFloorPlanner(lay).predicted_occupied_gpu_s(ws),
        "cost_model",
        "the planner has no step-time model",
    )
    refused(
        lambda: release.FlexFloorPlanner(lay, _ConstantCost()).predicted_occupied_gpu_s(
            ws, release=(0, 1)
        ),
        "release",
        "a release may not empty the EP group",
    )
    refused(
        lambda: release.FlexFloorPlanner(lay).plan([ws[0], ws[0]], 0),
        "workers",
        "a worker rank appears twice",
    )
    big = layout(num_experts=128, dense_bytes=0, worker_memory_bytes=64 * GB)
    refused(
        lambda: release.check_scale_target(2, 1, big),
        "rollout.replicas",
        "cannot scale from 2 to 1 workers: minimum is 2 (128 experts, 64 per worker, "
        "minActiveWorkers=1)",
    )
    for args in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        refused(
            lambda args=args: release.minimum_data_parallel_size(*args),
            "rollout.experts",
            "counts must be >= 1",
        )
    assert release.minimum_data_parallel_size(1, 1, 1) == 1
    refused(
        lambda: release.wait_after_finish_worker_s([]),
        "finish_s",
        "need at least one worker finish time",
    )
    refused(
        lambda: scale.worker_set_floor(lay, expert_replicas=0),
        "rollout.experts.replicas",
        "must be >= 1, got 0",
    )
    refused(lambda: scale.decide_scale(-1, 2, 2), "current", "must be >= 0, got -1")
    refused(lambda: scale.decide_scale(3, 0, 2), "nextStepWorkers", "must be >= 1, got 0")
    refused(lambda: scale.decide_scale(3, 2, 0), "floor", "must be >= 1, got 0")


class _ConstantCost:
    """One second per decode step whatever the group; copies are free."""

    def decode_step_s(self, workers: object) -> float:
        return 1.0

    def copy_s(self, moves: object) -> float:
        return 0.0
