"""Length-aware placement and the length predictor.

We test these aspects:
* placement never exceeds a worker's KV budget (property); every response is placed once;
* long responses concentrate on the first workers, short ones finish elsewhere;
* the verl baseline is equal contiguous chunks;
* the predictor uses a prompt's history, corrects drift, falls back to a quantile.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlenergy import errors
from rlenergy.control.moe import placement, predictor


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.floats(1, 5000), min_size=1, max_size=60),
    budgets=st.lists(st.integers(6000, 200000), min_size=1, max_size=6),
    balance=st.sampled_from(["tokens", "count"]),
)
def test_property_placement_never_exceeds_memory(lengths, budgets, balance):
    prompts = [50] * len(lengths)
    p = placement.place_by_length(lengths, prompts, budgets, 1, balance=balance)
    assert len(p.worker_of) == len(lengths)
    for w, budget in enumerate(budgets):
        demand = sum(
            placement.response_kv_bytes(prompts[i], lengths[i], 1)
            for i in p.responses_of(w)
            if not p.queued[i]
        )
        assert demand == p.predicted_kv_bytes[w] <= budget


def test_long_responses_concentrate_and_short_workers_get_more():
    lengths = [100.0] * 8 + [10.0] * 60
    p = placement.place_by_length(lengths, [0] * 68, [10**9] * 4, 1, balance="tokens")
    assert set(p.worker_of[:8]) <= {0, 1}
    assert set(p.worker_of[8:]) >= {2, 3}
    assert len(p.responses_of(0)) < len(p.responses_of(3))


def test_response_too_large_for_any_worker_is_an_error():
    with pytest.raises(errors.InvalidInputError, match="more than any worker"):
        placement.place_by_length([100.0], [0], [50], 1)


def test_even_placement_is_contiguous_chunks():
    assert placement.place_even(8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert placement.place_even(5, 2) == (0, 0, 0, 1, 1)


def test_predictor_history_drift_and_fallback():
    pred = predictor.LengthPredictor(default_length_tokens=300)
    assert pred.predict(["a"])[0] == predictor.LengthPrediction(300.0, False)
    pred.observe_step(["a", "b", "c"], [100, 200, 400])
    a, new = pred.predict(["a", "z"])
    assert a.from_history and not new.from_history
    assert new.length_tokens == 200  # median of the latest step
    # Every length doubles next step: "a" keeps its offset from the step mean.
    pred.observe_step(["b", "c"], [400, 800])
    (a2,) = pred.predict(["a"])
    step_geomean = math.sqrt(400 * 800)
    assert a2.length_tokens == pytest.approx(step_geomean / 2, rel=1e-6)  # a was half the mean
    with pytest.raises(errors.InvalidInputError):
        pred.observe_step(["a"], [0])


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.floats(1, 5000), min_size=1, max_size=60),
    budgets=st.lists(st.integers(0, 200000), min_size=1, max_size=6),
)
def test_property_lockstep_within_never_exceeds_memory(lengths, budgets):
    prompts = [50] * len(lengths)
    p = placement.place_lockstep_within(lengths, prompts, budgets, 1)
    assert len(p.worker_of) == len(lengths)
    for w, budget in enumerate(budgets):
        demand = sum(
            placement.response_kv_bytes(prompts[i], lengths[i], 1)
            for i in p.responses_of(w)
            if not p.queued[i]
        )
        assert demand == p.predicted_kv_bytes[w] <= budget


def test_fit_keeps_what_fits_moves_to_most_room_and_queues_the_rest():
    # Fits everywhere: the dealt placement comes back unchanged.
    dealt = placement.place_lockstep([100.0, 90.0, 80.0, 70.0], 2)
    same = placement.fit_kv_budget(dealt, [100.0, 90.0, 80.0, 70.0], [0] * 4, [10**6] * 2, 1)
    assert same.worker_of == dealt and not any(same.queued)
    # Rank 0 holds 100 of its 120: the 90 goes to the rank with the most room (rank 2).
    moved = placement.fit_kv_budget([0, 0, 1], [100.0, 90.0, 10.0], [0] * 3, [120, 95, 200], 1)
    assert moved.worker_of == (0, 2, 1) and moved.predicted_kv_bytes == (100, 10, 90)
    # No rank has room for the second 100: it stays on its rank, queued, counted nowhere.
    full = placement.fit_kv_budget([0, 1], [100.0, 100.0], [0, 0], [100, 50], 1)
    assert full.worker_of == (0, 1) and full.queued == (False, True)
    assert full.predicted_kv_bytes == (100, 0)
