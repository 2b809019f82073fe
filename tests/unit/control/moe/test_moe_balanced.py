"""Balanced placement (longest first to the earliest predicted finisher) and its fluid model.

We test these aspects:
* the fluid finish model: steps are the longest response, the KV waves or the running cap,
  whichever binds; time adds the KV reads;
* ``place_balanced`` never predicts a later makespan than the even split, keeps a KV-heavy
  engine from taking more than its share, and is deterministic (property);
* bad input is refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_support import MODEL

from rlenergy import errors
from rlenergy.control.moe import placement


def test_fluid_model_binding_terms():
    one = MODEL.add(placement.EngineLoad(), 0, 1000)
    # One response: 1000 steps; KV byte-steps (0 + 500) x 1000 x 1000 = 5e8 B x steps.
    assert one.kv_byte_steps == pytest.approx(5e8)
    assert MODEL.finish_s(one) == pytest.approx(1000 * 0.01 + 5e8 * 1e-12)
    many = placement.EngineLoad()
    for _ in range(100):
        many = MODEL.add(many, 0, 1000)
    # KV waves: 5e10 / 1e9 = 50 steps < 1000; running cap: 1e5 / 64 = 1562.5 steps binds.
    assert MODEL.finish_s(many) == pytest.approx(1562.5 * 0.01 + 5e10 * 1e-12)
    assert MODEL.finish_s(placement.EngineLoad()) == 0.0


def test_balanced_spreads_long_responses():
    lengths = [4000.0, 4000.0, 100.0, 100.0, 100.0, 100.0]
    engine_of = placement.place_balanced(lengths, [0] * 6, 2, MODEL)
    assert engine_of[0] != engine_of[1]  # the two long ones on different engines
    even = placement.place_even(6, 2)  # contiguous: both long ones on engine 0
    assert placement.predicted_makespan_s(
        engine_of, lengths, [0] * 6, 2, MODEL
    ) < placement.predicted_makespan_s(even, lengths, [0] * 6, 2, MODEL)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.floats(1.0, 5000.0), min_size=1, max_size=60),
    engines=st.integers(1, 6),
)
def test_property_balanced_no_later_than_even(lengths, engines):
    prompts = [10] * len(lengths)
    engine_of = placement.place_balanced(lengths, prompts, engines, MODEL)
    assert engine_of == placement.place_balanced(lengths, prompts, engines, MODEL)
    assert all(0 <= e < engines for e in engine_of)
    balanced = placement.predicted_makespan_s(engine_of, lengths, prompts, engines, MODEL)
    even = placement.predicted_makespan_s(
        placement.place_even(len(lengths), engines), lengths, prompts, engines, MODEL
    )
    # LPT is within 4/3 of the optimum, which is at most the even split's makespan; the
    # longest response alone bounds both from below.
    longest = MODEL.finish_s(MODEL.add(placement.EngineLoad(), 10, max(lengths)))
    assert balanced >= longest - 1e-9
    assert balanced <= even * 4 / 3 + 1e-9


def test_refuses_bad_input():
    with pytest.raises(errors.InvalidInputError):
        placement.place_balanced([1.0], [0], 0, MODEL)
    with pytest.raises(errors.InvalidInputError):
        placement.place_balanced([1.0, 2.0], [0], 2, MODEL)
    with pytest.raises(errors.InvalidInputError):
        placement.predicted_makespan_s([3], [1.0], [0], 2, MODEL)
    with pytest.raises(errors.InvalidInputError):
        placement.FluidFinishModel(0.01, 0.0, 0.0, 1, 1)
