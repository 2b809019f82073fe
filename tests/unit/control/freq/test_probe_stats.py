"""The probe statistics on hand-made inputs: Student's t factor, the per-clock
running stats, the one-parameter phase model's bounds and power, and which slices form a block.

Expected values are written from the docstrings' formulas (``rlenergy.control.freq.probe``).
"""

from __future__ import annotations

import math

import pytest

from rlenergy.control.freq import base, probe


@pytest.mark.parametrize(
    ("dof", "want"),
    [
        (0, math.inf),
        (-3, math.inf),
        (1, 1.645 * 12.71 / 1.96),
        (5, 1.645 * 2.57 / 1.96),
        (10, 1.645 * 2.23 / 1.96),
        (11, 1.645 * (1.0 + 1.0 / 10)),
        (21, 1.645 * (1.0 + 1.0 / 20)),
    ],
)
def test_student_t_factor_widens_z_for_few_blocks(dof: int, want: float) -> None:
    assert probe.student_t_factor(dof, 1.645) == pytest.approx(want)


def test_ratio_stats_keep_a_running_mean_variance_and_power() -> None:
    stats = probe.RatioStats()
    assert stats.stderr == math.inf and stats.power_ratio is None
    assert stats.energy_per_token_ratio is None
    stats.add(0.90, 0.80)
    assert (stats.n, stats.throughput_mean, stats.stderr) == (1, pytest.approx(0.90), math.inf)
    stats.add(0.94, None)  # a block without readable energy
    stats.add(0.92, 0.70)
    assert stats.n == 3
    assert stats.throughput_mean == pytest.approx(0.92)
    # sample variance of (0.90, 0.94, 0.92) = 0.0004; stderr = sqrt(0.0004 / 3)
    assert stats.throughput_m2 == pytest.approx(0.0008)
    assert stats.stderr == pytest.approx(math.sqrt(0.0004 / 3))
    assert (stats.power_sum, stats.power_n) == (pytest.approx(1.50), 2)
    assert stats.power_ratio == pytest.approx(0.75)
    assert stats.energy_per_token_ratio == pytest.approx(0.75 / 0.92)


def _model(u: float = 0.5, u_se: float = 0.05, beta: float | None = 0.8) -> probe.PhaseModelFit:
    return probe.PhaseModelFit(u, u_se, beta, 2000.0, 1800.0, 6)


def _r(c: float, u: float) -> float:
    return (u * (2000.0 / 1800.0 - 1.0) + 1.0) / (u * (2000.0 / c - 1.0) + 1.0)


def test_the_lower_bound_takes_u_at_its_t_widened_upper_bound() -> None:
    k = 1.645 * 2.57 / 1.96  # six blocks: five degrees of freedom
    assert _model().throughput_lower_bound(1400.0, 1.645) == pytest.approx(
        _r(1400.0, 0.5 + k * 0.05)
    )
    # u's upper bound is clamped at 1 (all of the phase's time scales with the clock).
    assert _model(u=0.9, u_se=0.2).throughput_lower_bound(1400.0, 1.645) == pytest.approx(
        _r(1400.0, 1.0)
    )


def test_power_and_energy_ratios_against_a_power_capped_default() -> None:
    m = _model()
    p = 1.0 + 0.8 * ((1400.0 / 2000.0) ** 2 - (1800.0 / 2000.0) ** 2)
    assert m.power_ratio(1400.0) == pytest.approx(p)
    assert m.power_ratio(1900.0) == pytest.approx(1.0)  # above the default: the default's
    assert m.energy_ratio(1400.0) == pytest.approx(p / _r(1400.0, 0.5))
    assert _model(beta=None).power_ratio(1400.0) is None
    assert _model(beta=None).energy_ratio(1400.0) is None


def _slices(clocks: list[int | None]) -> list[base.ProbeSlice]:
    return [base.ProbeSlice(c, 0.1, 10.0, 30.0) for c in clocks]


@pytest.mark.parametrize(
    ("clocks", "want"),
    [
        ([1400, None, None, 1400, None, 1400, 1400, None], 1400),
        ([None, 1400, 1400, None, 1400, None, None, 1400], None),  # default first: no block
        ([1400, None, None, 1200, None, 1400, 1400, None], None),  # another clock as candidate
        ([1400, None, 1200, 1400, None, 1400, 1400, None], None),  # another clock as default
        ([1400, 1400, None, 1400, None, 1400, 1400, None], None),  # a candidate out of order
    ],
)
def test_a_block_is_eight_slices_in_thue_morse_order(clocks: list[int | None], want) -> None:
    assert probe._block_clock(_slices(clocks)) == want


def test_the_phase_model_fit_is_least_squares_through_the_origin() -> None:
    """Blocks against a power-capped default (2000 MHz max, 1800 MHz default): each block is
    one equation ``b = u a`` with ``a = g1/r - x``, ``b = 1 - 1/r`` (``g1 = f_max/f_default
    - 1``, ``x = f_max/c - 1``); power ``p - 1 = beta ((c/f_max)^2 - (f_default/f_max)^2)``."""
    u_true, beta_true = 0.4, 0.8
    noise = {1200: 0.004, 1400: -0.006, 1600: 0.003}
    blocks = []
    for c, e in noise.items():
        p = 1.0 + beta_true * ((c / 2000.0) ** 2 - 0.81)
        blocks.append((c, _r(c, u_true) + e, p))
    blocks.append((1800, 1.0, 1.0))  # at the default: not an equation
    fit = probe.fit_phase_model(blocks, 2000.0, 1800.0)
    assert fit is not None
    g1 = 2000.0 / 1800.0 - 1.0
    a = [g1 / thr - (2000.0 / c - 1.0) for c, thr, _ in blocks[:3]]
    b = [1.0 - 1.0 / thr for _, thr, _ in blocks[:3]]
    saa = sum(x * x for x in a)
    u = sum(x * y for x, y in zip(a, b, strict=True)) / saa
    sd = math.sqrt(sum((y - u * x) ** 2 for x, y in zip(a, b, strict=True)) / 2)
    assert (fit.u, fit.u_stderr, fit.blocks) == (
        pytest.approx(u),
        pytest.approx(sd / math.sqrt(saa)),
        3,
    )
    assert fit.u == pytest.approx(u_true, abs=0.05)
    assert fit.beta == pytest.approx(beta_true)  # power without noise: exact
    assert (fit.f_max_mhz, fit.f_default_mhz) == (2000.0, 1800.0)


def test_the_phase_model_share_is_clamped_to_the_unit_interval() -> None:
    # Slower than clock scaling allows (u would be above 1): clamped at 1.
    blocks = [(1000, 0.45, None), (1500, 0.70, None)]
    fit = probe.fit_phase_model(blocks, 2000.0, 2000.0)
    assert fit is not None and fit.u == 1.0 and fit.beta is None
    # Faster at the lower clocks than at the default (u would be negative): clamped at 0.
    fit = probe.fit_phase_model([(1000, 1.02, None), (1500, 1.01, None)], 2000.0, 2000.0)
    assert fit is not None and fit.u == 0.0
    # Fewer than two blocks below the default, or a zero ratio: no fit.
    assert probe.fit_phase_model([(1000, 0.7, None), (2000, 1.0, None)], 2000.0, 2000.0) is None
    assert probe.fit_phase_model([(1000, 0.7, None), (1500, 0.0, None)], 2000.0, 2000.0) is None
