"""Candidate clocks picked by hand (``rlenergy.control.freq.candidates``): the thinned grid's
targets ``max - (max - floor) (i + 1) / count`` snapped to the nearest supported clock, ranges
on their step grid, explicit lists checked, and the refusals in full."""

from __future__ import annotations

import pytest

from rlenergy import errors
from rlenergy.control.freq import candidates

GRID = list(range(1000, 2001, 100))  # 1000-2000 MHz every 100


def test_thinning_snaps_each_target_to_the_nearest_clock() -> None:
    # Targets 1666.7, 1333.3, 1000 MHz -> 1700, 1300, 1000.
    assert candidates.thin_candidates(GRID, count=3) == (1700, 1300, 1000)
    # The default: seven targets 1928.6 ... 1000 MHz.
    assert candidates.thin_candidates(GRID) == (1900, 1700, 1600, 1400, 1300, 1100, 1000)


def test_a_target_nearest_a_clock_already_picked_adds_nothing() -> None:
    # Targets 1666.7 -> 1997, 1333.3 -> 1000, 1000 -> 1000 again.
    clocks = [2000, 1999, 1998, 1997, 1000]
    assert candidates.thin_candidates(clocks, count=3) == (1997, 1000)


def test_few_clocks_are_all_candidates_and_the_floor_bounds_them() -> None:
    assert candidates.thin_candidates([1800, 2000, 1900]) == (1900, 1800)
    assert candidates.thin_candidates(GRID, lowest_fraction=0.8) == (1900, 1800, 1700, 1600)
    # Nothing above the floor: the next clock below max stands in; one clock: none.
    assert candidates.thin_candidates([2000, 500, 400]) == (500,)
    assert candidates.thin_candidates([2000]) == ()


def test_thinning_refusals_in_full() -> None:
    with pytest.raises(errors.InvalidInputError) as info:
        candidates.thin_candidates([])
    assert (info.value.field, info.value.reason) == (
        "supportedClocksMHz",
        "the GPU reports no supported clocks",
    )
    with pytest.raises(errors.InvalidInputError) as info:
        candidates.thin_candidates(GRID, count=0)
    assert (info.value.field, info.value.reason) == ("candidates", "need at least one candidate")
    assert candidates.thin_candidates(GRID, count=1) == (1000,)


def test_a_range_takes_its_step_grid_from_its_top_or_thins_without_one() -> None:
    assert candidates.from_range(GRID, 1200, 1800, 200) == (1800, 1600, 1400, 1200)
    assert candidates.from_range(GRID, 1150, 1750, 300) == (1700, 1400)
    assert candidates.from_range(GRID, 1200, 1800) == (1800, 1700, 1600, 1500, 1400, 1300, 1200)
    assert candidates.from_range(GRID, 1000, 2000) == (1900, 1700, 1600, 1400, 1300, 1100, 1000)
    with pytest.raises(errors.InvalidInputError) as info:
        candidates.from_range(GRID, 2100, 2200, 100)
    assert (info.value.field, info.value.reason) == (
        "clockRangeMHz",
        "no supported clock in 2100-2200 MHz; supported: 1000-2000 MHz",
    )


def test_explicit_candidates_are_deduplicated_descending_or_refused() -> None:
    assert candidates.validate_explicit(GRID, [1200, 1500, 1200]) == (1500, 1200)
    with pytest.raises(errors.InvalidInputError) as info:
        candidates.validate_explicit(GRID, [1250, 1500, 1330])
    assert (info.value.field, info.value.reason) == (
        "clockCandidatesMHz",
        "[1250, 1330] not supported by the GPU; allowed: 1000-2000 MHz in 100 MHz steps",
    )
    with pytest.raises(errors.InvalidInputError) as info:
        candidates.validate_explicit([1500], [1400])
    assert (
        info.value.reason
        == "[1400] not supported by the GPU; allowed: 1500-1500 MHz in 0 MHz steps"
    )
