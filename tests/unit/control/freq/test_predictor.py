"""The default-governor model (``rlenergy.control.freq.predictor``): exact on exact data.

We test these aspects: a least-squares line through points on a line is that line, with zero
residual spread; the ridge pulls the intercept toward the per-token rate by the documented
weight; fewer than three points or no spread in tokens fall back to the per-token rate;
predictions are never negative; the spread is the residual sd over the mean; bad input is
refused; ``DefaultModel`` keeps the newest points, leaves unknown energy out of the energy fit
only, and is ready once it has a time and an energy.
"""

from __future__ import annotations

import math

import pytest

from rlenergy.control.freq import predictor


def test_points_on_a_line_give_that_line_without_ridge() -> None:
    xs = [100.0, 200.0, 400.0, 800.0]
    ys = [5.0 + 0.25 * x for x in xs]
    fit = predictor.fit_linear(xs, ys, ridge=0.0)
    assert fit.intercept == pytest.approx(5.0)
    assert fit.slope == pytest.approx(0.25)
    assert fit.relative_sigma == pytest.approx(0.0, abs=1e-12)
    assert fit(1000.0) == pytest.approx(255.0)


def test_the_ridge_shrinks_the_slope_toward_the_per_token_rate() -> None:
    xs = [100.0, 200.0, 400.0, 800.0]
    ys = [50.0 + 0.25 * x for x in xs]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    ridge = 0.1
    lam = ridge * mx * mx / (sxx / n + ridge * mx * mx)
    want_slope = (1 - lam) * 0.25 + lam * (my / mx)
    fit = predictor.fit_linear(xs, ys, ridge=ridge)
    assert 0 < lam < 1
    assert fit.slope == pytest.approx(want_slope, rel=1e-12)
    assert fit.intercept == pytest.approx(my - want_slope * mx, rel=1e-12)
    assert fit(mx) == pytest.approx(my)  # the line goes through the centroid
    assert 0.25 < fit.slope < my / mx and 0 < fit.intercept < 50.0
    resid = [y - (fit.intercept + fit.slope * x) for x, y in zip(xs, ys, strict=True)]
    sd = math.sqrt(sum(r * r for r in resid) / (n - 1))
    assert fit.relative_sigma == pytest.approx(sd / my, rel=1e-12)
    assert fit.relative_sigma > 0


def test_few_points_or_no_spread_use_the_per_token_rate() -> None:
    two = predictor.fit_linear([100.0, 300.0], [12.0, 28.0])
    assert (two.intercept, two.slope) == (0.0, pytest.approx(40.0 / 400.0))
    same = predictor.fit_linear([200.0, 200.0, 200.0], [10.0, 12.0, 14.0])
    assert same.intercept == 0.0 and same.slope == pytest.approx(12.0 / 200.0)
    assert same.relative_sigma == pytest.approx(math.sqrt(8.0 / 2) / 12.0)
    one = predictor.fit_linear([50.0], [5.0])
    assert one.slope == pytest.approx(0.1) and one.relative_sigma == 0.0
    zero = predictor.fit_linear([0.0, 0.0], [0.0, 0.0])
    assert (zero.slope, zero.relative_sigma) == (0.0, 0.0)


def test_predictions_are_never_negative() -> None:
    fit = predictor.LinearFit(intercept=-10.0, slope=0.01, relative_sigma=0.0)
    assert fit(100.0) == 0.0
    assert fit(2000.0) == pytest.approx(10.0)


@pytest.mark.parametrize(("xs", "ys"), [([], []), ([1.0], [1.0, 2.0])])
def test_bad_input_is_refused(xs: list[float], ys: list[float]) -> None:
    with pytest.raises(ValueError, match="matching, non-empty"):
        predictor.fit_linear(xs, ys)


def test_default_model_keeps_the_newest_points_and_unknown_energy_out() -> None:
    model = predictor.DefaultModel(max_points=3)
    assert not model.ready
    model.add(100.0, 1.0, None)
    assert not model.ready  # a time but no energy yet
    for i in range(2, 6):
        model.add(100.0 * i, float(i), 10.0 * i)
    assert model.ready
    assert model.tokens == [300.0, 400.0, 500.0] and model.times_s == [3.0, 4.0, 5.0]
    assert model.energy_tokens == [300.0, 400.0, 500.0]
    assert model.energies_j == [30.0, 40.0, 50.0]
    model.add(600.0, 6.0, None)
    assert model.tokens == [400.0, 500.0, 600.0]
    assert model.energy_tokens == [300.0, 400.0, 500.0]  # the energy fit keeps its points
    assert model.time_fit()(800.0) == pytest.approx(8.0)
    assert model.energy_fit()(800.0) == pytest.approx(80.0)
