"""Length predictor and residual model in detail (exact values from the documented rules).

We test these aspects:
* a prompt's prediction is the latest step's mean log length plus the mean of its last
  ``history_epochs`` (default 3) log offsets; a GRPO group is averaged in log space; a
  prediction is at least one token; an unseen prompt before any step gets 512 tokens;
* the fallback interpolates between the latest step's order statistics;
* the residual model: ``predicted - generated`` while below the prediction (at least 1), else
  the mean residual life of the latest step's lengths past ``generated`` (at least 1).
"""

from __future__ import annotations

import math

import pytest

from rlenergy.control.moe import predictor


def test_history_window_defaults_to_the_last_three_appearances():
    p = predictor.LengthPredictor()
    assert p.predict(["new"]) == (predictor.LengthPrediction(512.0, False),)
    # Step means are all ln 200; "a" sits at offsets -ln 2, +ln 2, 0, 0.
    for a, b in ((100, 400), (400, 100), (200, 200), (200, 200)):
        p.observe_step(["a", "b"], [a, b])
    (a,) = p.predict(["a"])
    # The first appearance is forgotten: mean offset (ln 2 + 0 + 0) / 3.
    assert a == predictor.LengthPrediction(pytest.approx(200 * 2 ** (1 / 3)), True)


def test_history_offsets_are_averaged():
    p = predictor.LengthPredictor(history_epochs=2)
    p.observe_step(["a", "b"], [100, 400])  # offset of "a": -ln 2
    p.observe_step(["a", "b"], [200, 200])  # 0
    assert p.predict(["a"])[0].length_tokens == pytest.approx(200 / math.sqrt(2))


def test_a_grpo_group_is_averaged_in_log_space():
    p = predictor.LengthPredictor(history_epochs=1)
    p.observe_step(["a", "a", "b", "b"], [100, 400, 50, 50])
    # Offset of "a" + step mean = mean log of its own responses: sqrt(100 x 400).
    assert p.predict(["a"])[0].length_tokens == pytest.approx(200.0)


def test_a_prediction_is_at_least_one_token():
    p = predictor.LengthPredictor(history_epochs=2)
    p.observe_step(["a", "b"], [1, 100])  # "a" at a tenth of the step's geometric mean
    p.observe_step(["c", "d"], [2, 2])  # the step mean falls to 2: "a" would be 0.2
    assert p.predict(["a"])[0] == predictor.LengthPrediction(1.0, True)


def test_fallback_interpolates_between_order_statistics():
    for q, expected in ((0.25, 15.0), (0.75, 25.0), (0.5, 20.0)):
        p = predictor.LengthPredictor(fallback_quantile=q)
        p.observe_step(["a", "b", "c"], [30, 10, 20])
        assert p.fallback_length_tokens() == pytest.approx(expected)


def test_residual_below_and_past_the_prediction():
    r = predictor.ResidualLength([30, 10, 20])
    assert r.remaining(10.0, 4.0) == 6.0  # below the prediction: what is left of it
    assert r.remaining(10.0, 9.5) == 1.0  # half a step left counts as one
    # At the prediction: the mean of the lengths past 10 (20, 30) minus 10.
    assert r.remaining(10.0, 10.0) == pytest.approx(15.0)
    # Past the prediction but below every length: the mean of all three minus 5.
    assert r.remaining(5.0, 5.0) == pytest.approx(15.0)
    assert r.remaining(5.0, 40.0) == 1.0  # past every length
    close = predictor.ResidualLength([10, 11])
    assert close.remaining(5.0, 10.5) == 1.0  # 11 - 10.5, at least one step
