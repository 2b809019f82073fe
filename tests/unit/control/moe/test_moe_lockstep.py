"""Placement inside one lock-stepped EP group (``place_lockstep``) and its makespan model.

We test these aspects:
* ``lockstep_makespan_s``: a step costs the fixed time plus the KV of the rank reading the
  most, until the longest response ends (a hand-computed case);
* the case that ``place_balanced`` gets wrong inside a group (a few long responses, many short
  ones: equal predicted finishes per rank pile the short ones on a few ranks, and those set
  every step): ``place_lockstep`` keeps the counts even and is predicted faster;
* properties: at every decode step, under the predictions, the ranks' running responses differ
  by at most one; the placement is deterministic; the dealt placement is never predicted
  slower than the even split by more than one response's KV per step;
* bad input is refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlenergy import errors
from rlenergy.control.moe import placement

MODEL = placement.FluidFinishModel(
    step_fixed_s=0.01,
    kv_s_per_byte=1e-9,
    kv_bytes_per_token=1000,
    kv_capacity_bytes=1e12,
    max_running=1024,
)


def test_makespan_hand_computed():
    # Rank 0: lengths 10 and 4 (prompts 0); rank 1: length 6. KV per rank at step t:
    # rank 0 = 2t (t < 4), t (4 <= t < 10); rank 1 = t (t < 6). Peak: 2t on [0, 4),
    # t on [4, 10). Integral of the peak = 16 + (100 - 16) / 2 = 58 token-steps x 1000 B.
    got = placement.lockstep_makespan_s([0, 0, 1], [10.0, 4.0, 6.0], [0, 0, 0], 2, MODEL)
    assert got == pytest.approx(10 * 0.01 + 58 * 1000 * 1e-9)


def test_few_long_many_short_stays_even_inside_a_group():
    lengths = [256.0] * 4 + [150.0] * 252
    prompts = [100] * len(lengths)
    balanced = placement.place_balanced(lengths, prompts, 8, MODEL)
    dealt = placement.place_lockstep(lengths, 8)
    counts = [dealt.count(r) for r in range(8)]
    assert max(counts) - min(counts) <= 1
    # Equal predicted finishes per rank, right for independent engines, leave some ranks
    # with one long response and pile the short ones elsewhere.
    assert max(balanced.count(r) for r in range(8)) > 1.5 * max(counts)
    assert placement.lockstep_makespan_s(
        dealt, lengths, prompts, 8, MODEL
    ) < placement.lockstep_makespan_s(balanced, lengths, prompts, 8, MODEL)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4000), min_size=1, max_size=80),
    ranks=st.integers(1, 8),
)
def test_property_running_responses_even_at_every_step(lengths, ranks):
    preds = [float(x) for x in lengths]
    dealt = placement.place_lockstep(preds, ranks)
    assert dealt == placement.place_lockstep(preds, ranks)
    assert all(0 <= r < ranks for r in dealt)
    for t in sorted(set(lengths)):
        running = [0] * ranks
        for i, r in enumerate(dealt):
            running[r] += lengths[i] >= t
        assert max(running) - min(running) <= 1
    prompts = [0] * len(lengths)
    even = placement.place_even(len(lengths), ranks)
    mine = placement.lockstep_makespan_s(dealt, preds, prompts, ranks, MODEL)
    theirs = placement.lockstep_makespan_s(even, preds, prompts, ranks, MODEL)
    # The dealt peak rank holds at most one running response more than the mean, and the mean
    # is at most the even split's peak: at most one response's KV per step more.
    one_more = sum(preds) * 1000 * 1e-9
    assert mine <= theirs + one_more + 1e-9


def test_refuses_bad_input():
    with pytest.raises(errors.InvalidInputError):
        placement.place_lockstep([1.0], 0)
    with pytest.raises(errors.InvalidInputError):
        placement.lockstep_makespan_s([0], [1.0, 2.0], [0], 1, MODEL)
    with pytest.raises(errors.InvalidInputError):
        placement.lockstep_makespan_s([2], [1.0], [0], 2, MODEL)
