"""The default-governor model, candidate thinning and phase settings at their edges.

Written against the surviving mutants of ``make mutation`` (control-freq-rest, docs/mutation.md):
``predictor.fit_linear`` (the ridge's default weight, the three-point and small-value edges,
the residual spread of two points), ``candidates.from_range`` (a range in the top half of the
clocks), ``candidates.validate_explicit`` (the step a two-clock GPU reports) and
``config.phase_settings`` (an explicit candidate just below the max clock).
"""

from __future__ import annotations

import math

import pytest

from rlenergy import errors
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import candidates, config, predictor


def test_three_points_are_fitted_with_the_default_ridge() -> None:
    xs, ys = [1000.0, 1100.0, 1200.0], [2.0, 2.1, 2.2]  # y = 1 + x / 1000
    fit = predictor.fit_linear(xs, ys)
    # lam = 0.1 mx^2 / (sxx / n + 0.1 mx^2) with mx = 1100, sxx = 20000
    lam = 0.1 * 1100**2 / (20000 / 3 + 0.1 * 1100**2)
    slope = (1 - lam) * 0.001 + lam * 2.1 / 1100
    assert fit.slope == pytest.approx(slope)
    assert fit.intercept == pytest.approx(2.1 - slope * 1100)
    assert fit.intercept > 0.05  # not the per-token rate through 0


def test_small_workloads_and_costs_keep_their_rate_and_spread() -> None:
    fit = predictor.fit_linear([0.5, 0.5], [1.0, 1.0])
    assert (fit.intercept, fit.slope) == (0.0, 2.0)  # the per-unit rate of x below 1
    two = predictor.fit_linear([1.0, 2.0], [0.1, 0.3])  # two points: rate 0.2 / 1.5
    resid = [0.1 - 0.2 / 1.5, 0.3 - 0.4 / 1.5]
    want = math.sqrt(sum(r * r for r in resid) / 1) / 0.2
    assert two.relative_sigma == pytest.approx(want)  # residual sd over n - 1 = 1, / mean y


def test_refusal_says_what_is_needed() -> None:
    with pytest.raises(ValueError, match="^need matching, non-empty xs and ys$"):
        predictor.fit_linear([], [])


def test_a_range_in_the_top_half_is_thinned_down_to_its_own_lowest_clock() -> None:
    supported = list(range(1980, 500, -15))
    got = candidates.from_range(supported, 1500, 1980)
    assert len(got) == candidates.DEFAULT_CANDIDATES
    assert min(got) == 1500 and max(got) < 1980
    assert all(1500 <= c <= 1980 for c in got)


def test_a_two_clock_gpu_reports_its_step() -> None:
    with pytest.raises(errors.InvalidInputError, match="in 480 MHz steps"):
        candidates.validate_explicit([1980, 1500], [1400])


def test_an_explicit_candidate_just_below_the_max_clock_is_kept() -> None:
    spec = api_policy.RLEnergyPolicySpec.model_validate(
        {
            "selector": {"matchLabels": {"app": "rl"}},
            "phases": [
                {
                    "name": "generation",
                    "minThroughputRatio": 0.95,
                    "clockCandidatesMHz": [1965, 1500],
                }
            ],
        }
    )
    (gen,) = config.phase_settings(spec, [1980, 1965, 1500, 1200])
    assert gen.candidates_mhz == (1965, 1500)
