"""Probe blocks and the paired default at their edges (rlenergy.control.freq.probe).

Written against the surviving mutants of ``make mutation`` (control-freq-probe, docs/mutation.md):
the scan past slices that start no block, the duration and zero-rate guards, the credited clock
of capped slices and its tolerance, the like-with-like power ratio with zero and small energies,
and ``paired_default``'s guards, uncovered slices and fit fallback. Each block here is exact:
25 ms slices, the default side at 100 tokens/s and 300 W, the candidate at ``RATE`` and ``POWER``
of that.
"""

from __future__ import annotations

import dataclasses

import pytest

from rlenergy.control.freq import base, probe

CLOCK = 1680
RATE, POWER = 0.96, 0.8
D = 0.025


def block(
    clock: int = CLOCK, *, rate: float = RATE, power: float = POWER, **kw: object
) -> list[base.ProbeSlice]:
    out = []
    for c in probe.block_schedule([clock]):
        r, p = (rate, power) if c is not None else (1.0, 1.0)
        out.append(base.ProbeSlice(c, D, 100 * D * r, 300 * D * p, **kw))  # type: ignore[arg-type]
    return out


def junk() -> base.ProbeSlice:
    return base.ProbeSlice(None, D, 2.5, 7.5)


def test_an_exact_block_gives_its_clock_and_ratios() -> None:
    blocks, used = probe.blocks_from_slices(block())
    assert used == 8
    assert blocks == [(CLOCK, pytest.approx(RATE), pytest.approx(POWER))]


@pytest.mark.parametrize("lead", [1, 2, 3])
def test_the_scan_slides_past_slices_that_start_no_block(lead: int) -> None:
    blocks, used = probe.blocks_from_slices([junk()] * lead + block())
    assert [b[0] for b in blocks] == [CLOCK] and used == lead + 8
    t, e = probe.paired_default([junk()] * lead + block(), None) or (0.0, 0.0)
    # the leading default slices are their own answer; the block's default side ran 0.1 s
    assert t == pytest.approx(lead * D + 0.1 * (1 + RATE))
    assert e == pytest.approx(lead * 7.5 + 30.0 * (1 + RATE))


def test_a_block_at_exactly_the_duration_fraction_is_kept() -> None:
    slices = block()
    slices = [dataclasses.replace(s, duration_s=1.0) for s in slices]
    slices[3] = dataclasses.replace(slices[3], duration_s=0.9)  # 0.9 = 0.9 x the longest
    assert len(probe.blocks_from_slices(slices)[0]) == 1
    slices[3] = dataclasses.replace(slices[3], duration_s=0.89)
    assert probe.blocks_from_slices(slices)[0] == []


def test_a_short_or_empty_block_is_skipped_not_the_rest() -> None:
    short = block()
    short[0] = dataclasses.replace(short[0], duration_s=D / 2)
    blocks, used = probe.blocks_from_slices(short + block(1530))
    assert [b[0] for b in blocks] == [1530] and used == 16
    empty = [dataclasses.replace(s, progress=0.0) if s.clock_mhz is None else s for s in block()]
    blocks, _ = probe.blocks_from_slices(empty + block(1530))
    assert [b[0] for b in blocks] == [1530]  # no tokens on the default side: no rate to compare


def test_slow_default_rates_still_make_a_block() -> None:
    slow = [dataclasses.replace(s, progress=s.progress / 1000) for s in block()]  # 0.1 tokens/s
    blocks, _ = probe.blocks_from_slices(slow)
    assert blocks == [(CLOCK, pytest.approx(RATE), pytest.approx(POWER))]


def test_a_capped_block_is_credited_to_the_clock_it_ran() -> None:
    capped = [
        dataclasses.replace(s, effective_clock_mhz=1500) if s.clock_mhz else s for s in block()
    ]
    assert probe.blocks_from_slices(capped)[0][0][0] == 1500
    # Half the candidate slices capped 30 MHz below: a mean of exactly one tolerance below
    half = list(block())
    cands = [i for i, s in enumerate(half) if s.clock_mhz]
    for i in cands[:2]:
        half[i] = dataclasses.replace(
            half[i], effective_clock_mhz=CLOCK - 2 * base.CLOCK_TOLERANCE_MHZ
        )
    assert probe.blocks_from_slices(half)[0][0][0] == CLOCK  # within the tolerance: the lock
    for i in cands:
        half[i] = dataclasses.replace(half[i], effective_clock_mhz=CLOCK - base.CLOCK_TOLERANCE_MHZ)
    assert probe.blocks_from_slices(half)[0][0][0] == CLOCK


def test_power_ratio_only_like_with_like() -> None:
    mixed = list(block())
    mixed[0] = dataclasses.replace(mixed[0], energy_source="instant_power")
    ((clock, thr, power),) = probe.blocks_from_slices(mixed)[0]
    assert (clock, power) == (CLOCK, None) and thr == pytest.approx(RATE)


def test_power_ratio_with_zero_and_small_energies() -> None:
    zero_b = list(block())
    i = next(k for k, s in enumerate(zero_b) if s.clock_mhz is None)
    zero_b[i] = dataclasses.replace(zero_b[i], energy_j=0.0)
    ((_, _, power),) = probe.blocks_from_slices(zero_b)[0]
    assert power == pytest.approx((4 * 7.5 * POWER / 0.1) / (3 * 7.5 / 0.1))
    zero_a = list(block())
    j = next(k for k, s in enumerate(zero_a) if s.clock_mhz)
    zero_a[j] = dataclasses.replace(zero_a[j], energy_j=0.0)
    ((_, _, power),) = probe.blocks_from_slices(zero_a)[0]
    assert power == pytest.approx(3 * POWER / 4)
    no_b = [dataclasses.replace(s, energy_j=0.0) if s.clock_mhz is None else s for s in block()]
    assert probe.blocks_from_slices(no_b)[0][0][2] is None
    tiny = [dataclasses.replace(s, energy_j=(s.energy_j or 0.0) * 1e-3) for s in block()]
    assert probe.blocks_from_slices(tiny)[0][0][2] == pytest.approx(POWER)


def test_paired_default_from_a_block_at_the_start_without_a_fit() -> None:
    got = probe.paired_default(block(), None)
    assert got == (pytest.approx(0.1 * (1 + RATE)), pytest.approx(30.0 * (1 + RATE)))


def test_paired_default_uncovered_slices() -> None:
    extra_default = base.ProbeSlice(None, D, 2.5, 7.5)
    t, e = probe.paired_default([*block(), extra_default], None) or (0.0, 0.0)
    assert t == pytest.approx(0.1 * (1 + RATE) + D)
    assert e == pytest.approx(30.0 * (1 + RATE) + 7.5)
    zero_default = base.ProbeSlice(None, D, 2.5, 0.0)
    _, e = probe.paired_default([*block(), zero_default], None) or (0.0, 0.0)
    assert e == pytest.approx(30.0 * (1 + RATE))
    # A candidate slice outside a block: this window's blocks at its clock give its ratios.
    extra = base.ProbeSlice(CLOCK, D, 100 * D * RATE, 300 * D * POWER)
    t, e = probe.paired_default([*block(), extra], None) or (0.0, 0.0)
    assert t == pytest.approx(0.1 * (1 + RATE) + D * RATE)
    assert e == pytest.approx(30.0 * (1 + RATE) + 7.5 * POWER * RATE / POWER)


def test_paired_default_uncovered_capped_slices_use_the_fit_at_the_clock_they_ran() -> None:
    fit = probe.PhaseModelFit(0.2, 0.0, 0.6, 1980, 1980, 6)
    capped = base.ProbeSlice(1380, D, 1.0, 5.0, effective_clock_mhz=1230)
    t, e = probe.paired_default([capped], fit) or (0.0, 0.0)
    assert t == pytest.approx(D * fit.throughput_ratio(1230))
    power = fit.power_ratio(1230)
    assert power is not None
    assert e == pytest.approx(5.0 * fit.throughput_ratio(1230) / power)
    no_power = probe.PhaseModelFit(0.2, 0.0, None, 1980, 1980, 6)
    assert probe.paired_default([capped], no_power) is None  # no power ratio to scale by
    assert probe.paired_default([capped], None) is None


def test_paired_default_guards_of_a_block() -> None:
    fit_free = None
    for field, side in (
        ("duration_s", True),
        ("duration_s", False),
        ("progress", False),
        ("energy_j", True),
        ("energy_j", False),
    ):
        slices = [
            dataclasses.replace(s, **{field: 0.0}) if (s.clock_mhz is not None) is side else s
            for s in block()
        ]
        # The block is no evidence: its candidate slices need this window's ratios or a fit
        assert probe.paired_default(slices, fit_free) is None, (field, side)


def test_paired_default_refuses_a_slice_the_fit_gives_no_power() -> None:
    zero = probe.PhaseModelFit(0.2, 0.0, 4 / 3, 1980, 1980, 6)  # p(990) = 1 - 4/3 x 0.75 = 0
    assert zero.power_ratio(990) == 0.0
    assert probe.paired_default([base.ProbeSlice(990, D, 1.0, 5.0)], zero) is None


def test_fit_skips_blocks_at_the_default_clock_wherever_they_are() -> None:
    blocks = [(1980, 1.0, 1.0), (1080, 0.857, 0.6), (1380, 0.92, 0.7)]
    fit = probe.fit_phase_model(blocks, 1980, 1980)
    assert fit is not None and fit.blocks == 2
