"""Between-steps resizing of a rollout worker set (``releaseAction: scale``).

We test these aspects:
* the floor is the planner's (expert floor, minActiveWorkers), raised by expert replicas;
* vllm-project/vllm PR #52702's values: 128 experts, 64 slots per worker -> minimum 2; 1 is refused with
  ``minimum is 2`` and the set stays untouched;
* a target below the floor is refused whole (never clamped), growth is always allowed, the
  current size is a no-op; no decision ever leaves fewer workers than the floor unless the
  set already was below it and is left untouched.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlenergy import errors
from rlenergy.control.moe import base, scale

GB = 10**9


def layout(experts: int, expert_bytes: int, memory: int, dense: int = 0, min_active: int = 1):
    return base.MoeLayout(
        num_experts=experts,
        expert_bytes=expert_bytes,
        dense_bytes=dense,
        kv_bytes_per_token=0,
        worker_memory_bytes=memory,
        min_active_workers=min_active,
    )


def test_case29_floor_of_two_refuses_one_with_minimum_is_2():
    # 128 experts; with DP 2 and 128 physical experts each worker holds 64.
    lay = layout(128, GB, 64 * GB)
    assert scale.worker_set_floor(lay) == 2
    d = scale.decide_scale(2, 1, scale.worker_set_floor(lay))
    assert d.action is scale.ScaleAction.REFUSED
    assert d.reason == "ShrinkRejected"
    assert "minimum is 2" in d.message
    assert d.target == d.current == 2
    # 256 physical experts (128 per worker): minimum 1, the shrink is allowed
    lay256 = layout(128, GB, 128 * GB)
    assert scale.worker_set_floor(lay256) == 1
    assert scale.decide_scale(2, 1, 1).action is scale.ScaleAction.RESIZE


def test_floor_takes_min_active_workers_dense_weights_and_replicas():
    # 8 experts of 1 GB; 20 GB per worker with 2 GB dense -> 18 slots -> expert floor 1
    assert scale.worker_set_floor(layout(8, GB, 20 * GB, dense=2 * GB)) == 1
    assert scale.worker_set_floor(layout(8, GB, 20 * GB, dense=2 * GB, min_active=3)) == 3
    # dense weights leave 3 slots -> ceil(8 / 3) = 3
    assert scale.worker_set_floor(layout(8, GB, 5 * GB, dense=2 * GB)) == 3
    # two replicas of each expert: 16 expert copies / 3 slots -> 6; and >= 2 distinct hosts
    assert scale.worker_set_floor(layout(8, GB, 5 * GB, dense=2 * GB), expert_replicas=2) == 6
    assert scale.worker_set_floor(layout(1, GB, 100 * GB), expert_replicas=2) == 2
    with pytest.raises(errors.InvalidInputError, match="replicas"):
        scale.worker_set_floor(layout(8, GB, 20 * GB), expert_replicas=0)


def test_grow_at_target_and_invalid_inputs():
    grow = scale.decide_scale(2, 4, 2)
    assert (grow.action, grow.target, grow.reason) == (
        scale.ScaleAction.RESIZE,
        4,
        "GrowBetweenSteps",
    )
    shrink = scale.decide_scale(4, 2, 2)
    assert (shrink.action, shrink.target, shrink.reason) == (
        scale.ScaleAction.RESIZE,
        2,
        "ShrinkBetweenSteps",
    )
    same = scale.decide_scale(3, 3, 2)
    assert (same.action, same.target, same.reason) == (scale.ScaleAction.NONE, 3, "AtTarget")
    with pytest.raises(errors.InvalidInputError, match="nextStepWorkers"):
        scale.decide_scale(3, 0, 2)
    with pytest.raises(errors.InvalidInputError, match="current"):
        scale.decide_scale(-1, 2, 2)
    with pytest.raises(errors.InvalidInputError, match="floor"):
        scale.decide_scale(3, 2, 0)


@given(
    current=st.integers(0, 64),
    desired=st.integers(1, 64),
    floor=st.integers(1, 16),
)
def test_never_below_the_floor(current: int, desired: int, floor: int):
    d = scale.decide_scale(current, desired, floor)
    if d.action is scale.ScaleAction.RESIZE:
        assert d.target == desired >= floor
    else:
        assert d.target == current  # refused or no-op: untouched
    if desired < floor:
        assert d.action is scale.ScaleAction.REFUSED
        assert f"minimum is {floor}" in d.message
