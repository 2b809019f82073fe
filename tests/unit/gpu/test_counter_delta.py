"""``rlenergy.gpu.energy.counter_delta`` at its edges: refusals, the plausibility limit (just
under and just over), the 0.1 s floor of that limit, a wrap near 2**64, a reset."""

from __future__ import annotations

import pytest

from rlenergy.gpu import energy

LIMIT_MJ_PER_S = energy.MAX_PLAUSIBLE_POWER_W * 1000.0


@pytest.mark.parametrize(("start", "end"), [(-1, 0), (0, -1), (-5, -5)])
def test_negative_counters_are_refused(start: int, end: int) -> None:
    with pytest.raises(ValueError, match=r"^counter values must be >= 0 mJ$"):
        energy.counter_delta(start, end, 1.0)


def test_a_negative_duration_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^duration_s must be >= 0$"):
        energy.counter_delta(0, 10, -0.001)


def test_zero_counters_and_zero_duration_are_valid() -> None:
    assert energy.counter_delta(0, 0, 0.0) == energy.CounterDelta(0)
    assert energy.counter_delta(0, 5, 0.0) == energy.CounterDelta(5)


def test_the_plausibility_limit_is_power_times_duration() -> None:
    limit = int(LIMIT_MJ_PER_S * 2.0)
    assert energy.counter_delta(1_000, 1_000 + limit, 2.0) == energy.CounterDelta(limit)
    over = energy.counter_delta(1_000, 1_000 + limit + 1, 2.0)
    assert over == energy.CounterDelta(None, rejected=True)


def test_short_windows_are_judged_over_at_least_a_tenth_of_a_second() -> None:
    floor = int(LIMIT_MJ_PER_S * 0.1)
    assert energy.counter_delta(0, floor, 0.01).energy_mj == floor
    assert energy.counter_delta(0, floor + 1, 0.01).rejected
    assert energy.counter_delta(0, floor + 1, 0.2).energy_mj == floor + 1


def test_a_wrap_near_the_top_is_unwrapped() -> None:
    start = energy.COUNTER_WRAP_MJ - 100
    assert energy.counter_delta(start, 50, 1.0) == energy.CounterDelta(150)
    # Just above 2**63 still counts as a wrap; at 2**63 a backwards step is a reset.
    assert energy.counter_delta(2**63 + 1, 0, 1e13).energy_mj == 2**63 - 1
    reset = energy.counter_delta(2**63, 10, 1.0)
    assert reset == energy.CounterDelta(10, reset_detected=True)


def test_a_reset_counts_the_energy_after_it_as_a_lower_bound() -> None:
    assert energy.counter_delta(9_000, 400, 1.0) == energy.CounterDelta(400, reset_detected=True)
    limit = int(LIMIT_MJ_PER_S * 1.0)
    assert energy.counter_delta(9_000_000_000, limit, 1.0).energy_mj == limit
    too_much = energy.counter_delta(9_000_000_000, limit + 1, 1.0)
    assert too_much == energy.CounterDelta(None, reset_detected=True, rejected=True)
    # A wrap that would be implausible is a reset, not a wrap.
    top = energy.COUNTER_WRAP_MJ - 1
    assert energy.counter_delta(top, limit + 1, 1.0).reset_detected


def test_a_wrap_exactly_at_the_limit_is_still_plausible() -> None:
    limit = int(LIMIT_MJ_PER_S * 1.0)
    start = energy.COUNTER_WRAP_MJ - limit // 3
    end = limit - limit // 3
    assert energy.counter_delta(start, end, 1.0) == energy.CounterDelta(limit)


def test_only_a_start_above_2_63_can_wrap_even_over_a_long_window() -> None:
    """Over 1e13 s the plausibility limit (3e19 mJ) admits any wrap, so only ``start > 2**63``
    tells a wrap from a reset: at 2**63 exactly, and far below it, a backwards step is a reset."""
    assert energy.counter_delta(2**63, 10, 1e13) == energy.CounterDelta(10, reset_detected=True)
    assert energy.counter_delta(1_000, 10, 1e13) == energy.CounterDelta(10, reset_detected=True)
