"""``JobLoop.totals`` and the status percentages carry every running sum, at their precision.

Killed mutmut survivors (docs/mutation.md): a field left out of ``totals()`` falls back to its
schema default, and a percentage rounded to whole points still passes a 1-point truth test.
"""

from __future__ import annotations

import pytest
from rlenergy_operator import jobloop

from rlenergy.api.v1alpha1 import policy

SPEC = policy.parse_policy({"selector": {"matchLabels": {"a": "b"}}})


def test_totals_carry_every_running_sum() -> None:
    loop = jobloop.JobLoop(SPEC, 1)
    acc = loop.account
    acc.through_step, acc.steps = 41, 40
    acc.measured_joules, acc.compared_measured_joules = 900.5, 800.25
    acc.predicted_default_joules = 1000.75
    acc.measured_seconds, acc.predicted_default_seconds = 50.5, 48.25
    acc.valid_tokens, acc.compared_steps = 123456.0, 37
    acc.unknown_energy_steps, acc.missed_steps = 2, 1
    t = loop.totals()
    assert (t.steps, t.through_step, t.compared_steps) == (40, 41, 37)
    assert (t.unknown_energy_steps, t.missed_steps) == (2, 1)
    assert (t.measured_joules, t.compared_measured_joules) == (900.5, 800.25)
    assert t.predicted_default_joules == 1000.75
    assert t.saved_joules == pytest.approx(1000.75 - 800.25)
    assert (t.measured_seconds, t.predicted_default_seconds) == (50.5, 48.25)
    assert t.valid_tokens == 123456.0
    assert t.saving_percent == round(100.0 * 200.5 / 1000.75, 3)
    assert t.throughput_ratio == round(48.25 / 50.5, 4)


def test_percentages_and_ratios_keep_their_precision() -> None:
    assert jobloop._pct(1.0, 3.0) == 33.333
    assert jobloop._pct(-1.0, 3.0) == -33.333
    assert jobloop._pct(1.0, 0.0) is None
    assert jobloop._pct(0.25, 0.5) == 50.0  # a prediction below 1 J is still a prediction
    assert jobloop._ratio(2.0, 3.0) == 0.6667
    assert jobloop._ratio(1.0, 0.0) is None
    assert jobloop._ratio(0.25, 0.5) == 0.5
