"""Thue-Morse probe blocks and the phase-model fit."""

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlenergy.control.freq import base, probe


def _slices(
    ratio: float, power_ratio: float, trend, clock: int = 1400, n_blocks: int = 1, dt: float = 1.0
):
    """Slices whose default progress rate follows ``trend(t)``; candidate slices run ``ratio`` slower."""
    out = []
    t = 0.0
    for c in probe.block_schedule([clock] * n_blocks):
        rate = trend(t + dt / 2) * (ratio if c is not None else 1.0)
        power = 300.0 * (power_ratio if c is not None else 1.0)
        out.append(base.ProbeSlice(c, dt, rate * dt, power * dt))
        t += dt
    return out


@given(
    a=st.floats(min_value=-0.02, max_value=0.02),
    b=st.floats(min_value=-0.0005, max_value=0.0005),
    ratio=st.floats(min_value=0.5, max_value=1.0),
)
def test_thue_morse_block_cancels_linear_and_quadratic_trends(
    a: float, b: float, ratio: float
) -> None:
    trend = lambda t: 100.0 * (1.0 + a * t + b * t * t)  # noqa: E731
    blocks, used = probe.blocks_from_slices(_slices(ratio, 0.8, trend))
    assert used == probe.BLOCK and len(blocks) == 1
    clock, thr, power = blocks[0]
    # Progress of a midpoint-sampled quadratic is exact per slice, so the ratio is exact.
    assert thr == pytest.approx(ratio, rel=1e-9)
    assert power == pytest.approx(0.8, rel=1e-9)


def test_an_abba_block_would_be_biased_by_a_convex_trend() -> None:
    """Why Thue-Morse: with a decaying rate, candidate-at-the-ends ABBA reads high."""
    trend = lambda t: 100.0 * math.exp(-0.3 * t)  # noqa: E731
    slices = []
    for i, c in enumerate((1400, None, None, 1400)):
        rate = trend(i + 0.5) * (0.9 if c else 1.0)
        slices.append(base.ProbeSlice(c, 1.0, rate, 1.0))
    abba = (slices[0].progress + slices[3].progress) / (slices[1].progress + slices[2].progress)
    tm_blocks, _ = probe.blocks_from_slices(_slices(0.9, 1.0, trend))
    assert abs(abba - 0.9) > abs(tm_blocks[0][1] - 0.9)


def test_partial_last_block_is_dropped() -> None:
    slices = _slices(0.9, 0.8, lambda t: 100.0, n_blocks=2)
    slices[-1] = base.ProbeSlice(slices[-1].clock_mhz, 0.3, 30.0, 90.0)
    blocks, _ = probe.blocks_from_slices(slices)
    assert len(blocks) == 1


def test_phase_model_fit_recovers_m_and_power_slope() -> None:
    f0, m = 1980.0, 0.9
    u = 1 - m
    blocks = []
    for c in (990, 1200, 1400, 1600):
        r = 1.0 / (u * f0 / c + m)
        p = 1.0 + 0.5 * ((c / f0) ** 2 - 1.0)
        blocks.append((c, r, p))
        blocks.append((c, r * 1.001, p))
    fit = probe.fit_phase_model(blocks, f0, f0)
    assert fit is not None
    assert fit.u == pytest.approx(u, rel=0.02)
    assert fit.beta == pytest.approx(0.5, rel=0.01)
    assert fit.throughput_ratio(1297) == pytest.approx(1.0 / (u * f0 / 1297 + m), rel=0.002)
    assert fit.throughput_lower_bound(1297, 2.0) <= fit.throughput_ratio(1297)


def test_power_capped_default_is_the_reference() -> None:
    """Clocks at or above the default governor's capped clock carry no information and ratio 1."""
    fit = probe.fit_phase_model([(1500, 0.8, 0.7), (1200, 0.7, 0.6), (1846, 1.0, 1.0)], 1965, 1846)
    assert fit is not None and fit.blocks == 2
    assert fit.throughput_ratio(1900) == pytest.approx(1.0)


def test_paired_default_is_measured_by_the_window_s_own_default_slices() -> None:
    """Complete blocks: the default slices' rate and power on the candidate slices' work."""
    rate = {None: 100.0, 1400: 80.0}  # progress per s
    power = {None: 700.0, 1400: 500.0}  # W
    slices = [
        base.ProbeSlice(c, 0.05, rate[c] * 0.05, power[c] * 0.05)
        for c in probe.block_schedule([1400, 1400])
    ]
    # a partial block at the end: one candidate slice, scaled by this window's block ratios
    slices.append(base.ProbeSlice(1400, 0.02, rate[1400] * 0.02, power[1400] * 0.02))
    got = probe.paired_default(slices, None)
    assert got is not None
    work = sum(s.progress for s in slices)
    assert got[0] == pytest.approx(work / rate[None], rel=1e-12)
    assert got[1] == pytest.approx(power[None] * work / rate[None], rel=1e-12)
    # Without blocks at its clock a candidate slice needs the fit; without one, no answer.
    assert probe.paired_default(slices[-1:], None) is None
    fit = probe.PhaseModelFit(0.5, 0.01, 1.0, 1980.0, 1980.0, 4)
    lone = probe.paired_default(slices[-1:], fit)
    power_ratio = fit.power_ratio(1400)
    assert lone is not None and power_ratio is not None
    assert lone[0] == pytest.approx(0.02 * fit.throughput_ratio(1400))
    assert lone[1] == pytest.approx(slices[-1].energy_j * fit.throughput_ratio(1400) / power_ratio)
    # Unknown slice energy: no measured answer.
    unknown = [*slices[:-1], base.ProbeSlice(None, 0.02, 2.0, None)]
    assert probe.paired_default(unknown, fit) is None


def test_a_block_with_a_slice_the_reports_did_not_resolve_is_no_evidence() -> None:
    """A slice with fewer than 2 reports at its clock got interpolated progress (mixed clocks):
    its block is dropped from the ratios and from the paired default; counted or unknown
    report counts keep it."""
    slices = _slices(0.9, 0.8, lambda t: 100.0, n_blocks=2)
    marked = [dataclasses.replace(s, rate_reports=5) for s in slices]
    marked[3] = dataclasses.replace(marked[3], rate_reports=1, progress=99.0)  # blurred
    blocks, _ = probe.blocks_from_slices(marked)
    assert [round(b[1], 9) for b in blocks] == [0.9]
    assert len(probe.blocks_from_slices(slices)[0]) == 2  # the simulator's: not counted
    # The blurred block's candidate slices are scaled by the clean block's ratios instead.
    t_paired, _ = probe.paired_default(marked, None) or (0.0, 0.0)
    t_clean, _ = probe.paired_default(slices, None) or (0.0, 0.0)
    assert t_paired == pytest.approx(t_clean, rel=1e-9)
