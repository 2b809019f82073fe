"""``probe.CorrectedFit`` and ``probe.fit_corrected`` on small hand-made fits.

The model below has ``u = 0.5`` and the default governor at the max clock (2000 MHz), so its
throughput ratio is ``r(c) = 1 / (0.5 (2000/c - 1) + 1)``: 0.75 at 1200 MHz, 0.8235294 at
1400 MHz, 0.8888889 at 1600 MHz. Expected values are written out from the docstring's
formulas (inverse-variance blend of the model and the residual-corrected model, residuals
interpolated linearly in clock, the default clock an exact point with residual 0).
"""

from __future__ import annotations

import math

import pytest

from rlenergy.control.freq import probe

F_MAX = 2000.0


def _r(c: float, u: float = 0.5, f_default: float = F_MAX) -> float:
    return (u * (F_MAX / f_default - 1.0) + 1.0) / (u * (F_MAX / c - 1.0) + 1.0)


def _model(u_se: float = 0.0, beta: float | None = None) -> probe.PhaseModelFit:
    return probe.PhaseModelFit(0.5, u_se, beta, F_MAX, F_MAX, 6)


M1200 = probe.MeasuredClock(1200, 3, 0.70, 0.01, 0.60)
M1600 = probe.MeasuredClock(1600, 3, 0.90, 0.02, 0.80)
UNKNOWN = probe.MeasuredClock(1000, 1, 0.50, math.inf, None)


def _fit(
    measured: tuple[probe.MeasuredClock, ...] = (M1200, M1600),
    *,
    u_se: float = 0.0,
    beta: float | None = None,
    tau2: float = 0.0004,
    misfit: bool = True,
) -> probe.CorrectedFit:
    return probe.CorrectedFit(_model(u_se, beta), measured, tau2, misfit)


def test_the_model_values_used_here() -> None:
    assert _r(1200) == pytest.approx(0.75)
    assert _r(1400) == pytest.approx(1 / 1.2142857142857142)
    assert _r(1600) == pytest.approx(1 / 1.125)


@pytest.mark.parametrize(
    ("clock", "want"),
    [
        (1000.0, [(1.0, M1200)]),  # below the lowest probed clock: its residual holds
        (1200.0, [(1.0, M1200)]),  # at a probed clock: that clock alone
        (1300.0, [(0.75, M1200), (0.25, M1600)]),
        (1600.0, [(1.0, M1600)]),
        (1800.0, [(0.5, M1600), (0.5, None)]),  # toward the default clock's exact point
    ],
)
def test_neighbours_interpolate_linearly_in_clock(clock: float, want: list) -> None:
    got = _fit()._neighbours(clock)
    assert [m for _, m in got] == [m for _, m in want]
    assert [w for w, _ in got] == pytest.approx([w for w, _ in want])


def test_a_clock_without_a_standard_error_is_not_a_neighbour() -> None:
    fit = _fit((UNKNOWN, M1600))
    assert fit._neighbours(900.0) == [(1.0, M1600)]
    assert [m for _, m in fit._neighbours(1800.0)] == [M1600, None]
    assert _fit((UNKNOWN,))._neighbours(1500.0) == []


def test_blend_weights_by_inverse_variance() -> None:
    assert probe.CorrectedFit._blend(1.0, 1.0, 3.0, 1.0) == pytest.approx((2.0, 0.5))
    assert probe.CorrectedFit._blend(1.0, 3.0, 2.0, 1.0) == pytest.approx((1.75, 0.75))
    assert probe.CorrectedFit._blend(1.0, 1.0, 2.0, 0.0) == (2.0, 0.0)  # exact b wins
    assert probe.CorrectedFit._blend(1.0, 0.0, 2.0, 1.0) == (1.0, 0.0)  # exact a wins
    assert probe.CorrectedFit._blend(1.0, 0.0, 2.0, 0.0) == (2.0, 0.0)  # both: b first


def test_between_two_probed_clocks_the_residuals_correct_the_model() -> None:
    fit = _fit()
    r_m = _r(1400)
    r_c = r_m + 0.5 * (0.70 - _r(1200)) + 0.5 * (0.90 - _r(1600))
    v_m, v_c = 0.0004, (0.5 * 0.01) ** 2 + (0.5 * 0.02) ** 2
    parts = fit._parts(1400.0)
    assert parts[:4] == pytest.approx((r_m, v_m, r_c, v_c))
    assert parts[4:] == (None, None)  # no power slope
    want = (r_m / v_m + r_c / v_c) / (1 / v_m + 1 / v_c)
    assert fit.throughput_ratio(1400.0) == pytest.approx(want)
    assert fit.throughput_stderr(1400.0) == pytest.approx(math.sqrt(1 / (1 / v_m + 1 / v_c)))
    k = probe.student_t_factor(6 - 1, 1.645)
    assert fit.throughput_lower_bound(1400.0, 1.645) == pytest.approx(
        want - k * math.sqrt(1 / (1 / v_m + 1 / v_c))
    )


def test_the_model_s_own_u_error_widens_the_corrected_variance() -> None:
    """With ``u_stderr`` the interpolated difference carries the model's error at ``c`` less
    the weighted errors at the neighbours (``u`` at its upper bound vs at its fit)."""
    u_se = 0.1
    fit = _fit(u_se=u_se)

    def d(c: float) -> float:
        return _r(c, 0.5 + u_se) - _r(c)

    diff = d(1400) - 0.5 * d(1200) - 0.5 * d(1600)
    v_c = (0.5 * 0.01) ** 2 + (0.5 * 0.02) ** 2 + diff**2
    se_m = abs(_r(1400, 0.6) - _r(1400))
    r_m, v_m, _, var_c, _, _ = fit._parts(1400.0)
    assert (r_m, v_m, var_c) == pytest.approx((_r(1400), se_m**2 + 0.0004, v_c))
    # u's upper bound is clamped at 1.
    high = probe.CorrectedFit(
        probe.PhaseModelFit(0.95, 0.2, None, F_MAX, F_MAX, 6), (M1200,), 0.0, True
    )

    def d1(c: float) -> float:
        return _r(c, 1.0, F_MAX) - _r(c, 0.95, F_MAX)

    assert high._parts(1000.0)[3] == pytest.approx((0.01**2) + (d1(1000) - d1(1200)) ** 2)


def test_a_passed_u_moves_the_model_and_the_residuals_alike() -> None:
    fit = _fit()
    u = 0.6
    r_m, _, r_c, _, _, _ = fit._parts(1400.0, u)
    assert r_m == pytest.approx(_r(1400, u))
    assert r_c == pytest.approx(
        _r(1400, u) + 0.5 * (0.70 - _r(1200, u)) + 0.5 * (0.90 - _r(1600, u))
    )


def test_power_is_corrected_with_the_same_weights() -> None:
    beta = 0.8
    fit = _fit(beta=beta)

    def p(c: float) -> float:
        return 1.0 + beta * ((c / F_MAX) ** 2 - 1.0)

    p_c = p(1400) + 0.5 * (0.60 - p(1200)) + 0.5 * (0.80 - p(1600))
    *_, p_m, got_c = fit._parts(1400.0)
    assert (p_m, got_c) == pytest.approx((p(1400), p_c))
    v_m, v_c = 0.0004, (0.5 * 0.01) ** 2 + (0.5 * 0.02) ** 2
    want_p = (p(1400) / v_m + p_c / v_c) / (1 / v_m + 1 / v_c)
    assert fit.power_ratio(1400.0) == pytest.approx(want_p)
    assert fit.energy_ratio(1400.0) == pytest.approx(want_p / fit.throughput_ratio(1400.0))
    # A neighbour without a power mean adds no correction.
    nopower = _fit((M1200, probe.MeasuredClock(1600, 3, 0.90, 0.02, None)), beta=beta)
    assert nopower._parts(1400.0)[5] == pytest.approx(p(1400) + 0.5 * (0.60 - p(1200)))


def test_at_a_probed_clock_its_mean_decides_with_its_own_error() -> None:
    # Model variance 0 (u_stderr 0, tau2 0): the model counts as exact and wins the blend.
    fit = _fit(tau2=0.0)
    assert fit.throughput_ratio(1200.0) == pytest.approx(_r(1200))
    fit = _fit(tau2=1.0)
    v_c = 0.01**2
    want = (_r(1200) / 1.0 + 0.70 / v_c) / (1 / 1.0 + 1 / v_c)
    assert fit.throughput_ratio(1200.0) == pytest.approx(want)


def test_without_a_misfit_or_at_the_default_the_model_alone_predicts() -> None:
    fit = _fit(misfit=False, beta=0.8)
    model = _model(beta=0.8)
    for c in (1000.0, 1400.0, 1900.0):
        assert fit.throughput_ratio(c) == model.throughput_ratio(c)
        assert fit.throughput_stderr(c) == model.throughput_stderr(c)
        assert fit.power_ratio(c) == model.power_ratio(c)
        assert fit.throughput_lower_bound(c, 1.645) == model.throughput_lower_bound(c, 1.645)
    misfit = _fit(beta=0.8)
    r_m, v_m, r_c, v_c, p_m, p_c = misfit._parts(2000.0)
    assert (r_m, r_c, v_c) == (1.0, 1.0, math.inf) and v_m == pytest.approx(0.0004)
    assert p_m == p_c == pytest.approx(1.0)
    assert misfit.throughput_ratio(2500.0) == 1.0  # above the default: the default's


def test_a_noisy_block_above_one_never_makes_a_clock_faster_than_the_default() -> None:
    fast = probe.MeasuredClock(1600, 3, 1.10, 0.001, None)
    fit = _fit((fast,), tau2=1.0)
    assert fit.throughput_ratio(1600.0) == 1.0


def test_measured_at_finds_only_probed_clocks() -> None:
    fit = _fit()
    assert fit.measured_at(1200) is M1200 and fit.measured_at(1600) is M1600
    assert fit.measured_at(1400) is None


def test_fit_corrected_pools_the_spread_within_clocks_and_flags_a_misfit() -> None:
    """Blocks on a curve with a knee: the model, fitted to all, misses 1200 MHz by far more than
    its pooled standard error, so the fit is flagged and 1200 MHz's own mean decides near it."""
    blocks = [
        (1200, 0.70, 0.60),
        (1200, 0.72, 0.62),
        (1600, 0.90, 0.80),
        (1600, 0.92, None),
        (2000, 1.00, 1.00),  # at the default: no evidence below it
    ]
    fit = probe.fit_corrected(blocks, F_MAX, F_MAX)
    assert fit is not None
    pooled = math.sqrt((0.01**2 * 2 + 0.01**2 * 2) / 2)  # two clocks, one dof each
    assert [m.clock_mhz for m in fit.measured] == [1200, 1600]
    assert [m.n for m in fit.measured] == [2, 2]
    assert [m.throughput_mean for m in fit.measured] == pytest.approx([0.71, 0.91])
    assert [m.throughput_se for m in fit.measured] == pytest.approx([pooled / math.sqrt(2)] * 2)
    assert [m.power_mean for m in fit.measured] == pytest.approx([0.61, 0.80])
    model = probe.fit_phase_model(blocks, F_MAX, F_MAX)
    assert model is not None and fit.model == model
    excess = []
    for m in fit.measured:
        resid = m.throughput_mean - model.throughput_ratio(m.clock_mhz)
        var = m.throughput_se**2 + model.throughput_stderr(m.clock_mhz) ** 2
        excess.append(resid**2 - var)
    assert fit.tau2 == pytest.approx(max(sum(excess) / 2, 0.0))
    want_misfit = any(
        abs(m.throughput_mean - model.throughput_ratio(m.clock_mhz))
        > max(
            probe.MISFIT_Z
            * math.sqrt(m.throughput_se**2 + model.throughput_stderr(m.clock_mhz) ** 2),
            probe.MISFIT_MIN,
        )
        for m in fit.measured
    )
    assert fit.misfit is want_misfit


def test_fit_corrected_without_replicates_has_no_standard_errors() -> None:
    """One block per clock: no within-clock spread (fewer than 2 dof), so no clock has a
    standard error, nothing is a neighbour and nothing can be a misfit."""
    fit = probe.fit_corrected([(1200, 0.70, None), (1600, 0.95, None)], F_MAX, F_MAX)
    assert fit is not None
    assert all(math.isinf(m.throughput_se) for m in fit.measured)
    assert fit.misfit is False and fit.tau2 == 0.0
    assert probe.fit_corrected([(1200, 0.70, None)], F_MAX, F_MAX) is None


def test_a_passed_u_reaches_the_prediction_in_either_mode() -> None:
    u = 0.6
    assert _fit(misfit=False).throughput_ratio(1400.0, u) == pytest.approx(_r(1400, u))
    fit = _fit()
    r_m, v_m, r_c, v_c, _, _ = fit._parts(1400.0, u)
    want = (r_m / v_m + r_c / v_c) / (1 / v_m + 1 / v_c)
    assert fit.throughput_ratio(1400.0, u) == pytest.approx(want)
    assert fit.throughput_ratio(1400.0, u) != pytest.approx(fit.throughput_ratio(1400.0))


def test_without_neighbours_the_model_s_variance_is_its_error_and_discrepancy() -> None:
    fit = _fit((UNKNOWN,), u_se=0.1, tau2=0.0004)
    se_m = abs(_r(1400, 0.6) - _r(1400))
    r_m, v_m, r_c, v_c, _, _ = fit._parts(1400.0)
    assert (r_m, r_c, v_c) == (pytest.approx(_r(1400)), pytest.approx(_r(1400)), math.inf)
    assert v_m == pytest.approx(se_m**2 + 0.0004)


def test_an_exact_side_wins_the_blend_outright() -> None:
    assert probe.CorrectedFit._blend(1.0, 1.0, 2.0, 1e-18) == (2.0, 0.0)
    assert probe.CorrectedFit._blend(1.0, 1e-18, 2.0, 1.0) == (1.0, 0.0)


def test_power_takes_the_throughput_s_weights_an_exact_model_included() -> None:
    """With the model exact (no u error, no discrepancy) throughput and power both take the
    model's value; power once gave an exact model zero weight and took the corrected value."""
    beta = 0.8
    fit = _fit(tau2=0.0, beta=beta)
    p_model = 1.0 + beta * ((1400.0 / F_MAX) ** 2 - 1.0)
    assert fit.throughput_ratio(1400.0) == pytest.approx(_r(1400))
    assert fit.power_ratio(1400.0) == pytest.approx(p_model)
    assert fit._parts(1400.0)[5] != pytest.approx(p_model)  # the corrected value differs
    # Without a neighbour the corrected side has no weight: the model's power.
    assert _fit((UNKNOWN,), beta=beta).power_ratio(1400.0) == pytest.approx(p_model)
    assert _fit(beta=None).power_ratio(1400.0) is None
    assert _fit(beta=None).energy_ratio(1400.0) is None


def test_fit_corrected_leaves_out_blocks_at_or_above_the_default_and_at_zero() -> None:
    blocks = [(1200, 0.70, None), (1200, 0.72, None), (1200, 0.0, None), (1600, 0.90, None)]
    blocks += [(1600, 0.92, None), (2000, 1.0, None)]
    fit = probe.fit_corrected(blocks, F_MAX, F_MAX)
    assert fit is not None
    assert [(m.clock_mhz, m.n) for m in fit.measured] == [(1200, 2), (1600, 2)]


def test_fit_corrected_flags_a_misfit_only_beyond_both_limits() -> None:
    # The model fits these exactly (u = 0.5), with a small spread at each clock: no misfit.
    exact = [(c, _r(c) + d, None) for c in (1200, 1600) for d in (-0.001, 0.001)]
    fit = probe.fit_corrected(exact, F_MAX, F_MAX)
    assert fit is not None and fit.misfit is False and fit.tau2 == 0.0
    # A knee: 1200 MHz runs far slower than the one-parameter model fitted to both allows.
    knee = [(1200, 0.60 + d, None) for d in (-0.001, 0.0, 0.001)]
    knee += [(1600, 0.95 + d, None) for d in (-0.001, 0.0, 0.001)]
    fit = probe.fit_corrected(knee, F_MAX, F_MAX)
    assert fit is not None and fit.misfit is True and fit.tau2 > 0.0
    # A clock with fewer blocks than MISFIT_MIN_BLOCKS must lie MISFIT_Z x sqrt(3 / n) standard
    # errors off (5.2 for one block): on the model at 1000 and 1600 MHz (three blocks each), one
    # block at 1300 MHz read 0.02, 0.03 and 0.04 above it lies 3.3, 4.5 and 5.5 standard
    # errors off.
    assert probe.MISFIT_MIN_BLOCKS == 3
    for above, flagged in ((0.02, False), (0.03, False), (0.04, True)):
        blocks = [(c, _r(c) + d, None) for c in (1000, 1600) for d in (-0.005, 0.0, 0.005)]
        fit = probe.fit_corrected([*blocks, (1300, _r(1300) + above, None)], F_MAX, F_MAX)
        assert fit is not None and fit.misfit is flagged, above


def _floor_blocks(noise: float = 0.005) -> list[tuple[int, float, float | None]]:
    """Throughput exactly on the model (u = 0.5); power the quadratic
    ``1 + 0.6 ((c/f_max)**2 - 1)`` (0.55 at 1000 MHz, 0.616 at 1200) held up by a floor of 0.65
    below 1400 MHz, two blocks per clock +-noise."""
    out: list[tuple[int, float, float | None]] = []
    for c in (1000, 1200, 1400, 1600, 1800):
        p = max(1.0 + 0.6 * ((c / F_MAX) ** 2 - 1.0), 0.65 if c < 1400 else 0.0)
        out += [(c, _r(c), p - noise), (c, _r(c), p + noise)]
    return out


def test_a_power_floor_is_a_power_misfit_and_the_measured_power_decides() -> None:
    """Throughput fits, power does not: a floor the quadratic cannot bend to (the published
    family's power floors, ``rlenergy.gpu.published``). The power is corrected on its own."""
    fit = probe.fit_corrected(_floor_blocks(), F_MAX, F_MAX)
    assert fit is not None and fit.misfit is False and fit.power_misfit is True
    assert [m.power_se for m in fit.measured] == pytest.approx([0.005] * 5)
    model = fit.model
    resid = {
        m.clock_mhz: (m.power_mean or 0.0) - (model.power_ratio(m.clock_mhz) or 0.0)
        for m in fit.measured
    }
    assert fit.power_tau2 == pytest.approx(
        max(sum(r * r - 0.005**2 for r in resid.values()) / 5, 0.0)
    )
    assert fit.power_tau2 > 20 * 0.005**2  # the model's discrepancy dwarfs the noise

    def blend(p_model: float, p_corrected: float, var_corrected: float) -> float:
        w_m, w_c = 1.0 / fit.power_tau2, 1.0 / var_corrected
        return (p_model * w_m + p_corrected * w_c) / (w_m + w_c)

    for c in (1000, 1200, 1800):
        m = fit.measured_at(c)
        assert m is not None and m.power_mean is not None
        p_m = model.power_ratio(c) or 0.0
        assert fit.power_ratio(c) == pytest.approx(blend(p_m, m.power_mean, 0.005**2))
        assert fit.power_ratio(c) == pytest.approx(m.power_mean, abs=3e-3)
    assert abs((fit.power_ratio(1000) or 0.0) - (model.power_ratio(1000) or 0.0)) > 0.04
    # Between probed clocks the residuals interpolate linearly; the throughput is the model's.
    p_m = model.power_ratio(1300) or 0.0
    mid = p_m + 0.5 * (resid[1200] + resid[1400])
    assert fit.power_ratio(1300) == pytest.approx(blend(p_m, mid, 2 * (0.5 * 0.005) ** 2))
    assert fit.throughput_ratio(1300) == pytest.approx(_r(1300))
    assert fit.energy_ratio(1000) == pytest.approx(0.65 / _r(1000), abs=3e-3)
    assert fit.power_ratio(F_MAX) == pytest.approx(1.0)


def test_a_quadratic_power_is_no_power_misfit() -> None:
    blocks = [
        (c, _r(c), 1.0 + 0.6 * ((c / F_MAX) ** 2 - 1.0) + d)
        for c in (1000, 1400, 1800)
        for d in (-0.005, 0.005)
    ]
    fit = probe.fit_corrected(blocks, F_MAX, F_MAX)
    assert fit is not None and fit.power_misfit is False
    assert fit.power_ratio(1200) == fit.model.power_ratio(1200)
    # One block per clock: no power standard error, so no power misfit either.
    single = probe.fit_corrected(_floor_blocks()[::2], F_MAX, F_MAX)
    assert single is not None and single.power_misfit is False
    assert all(math.isinf(m.power_se) for m in single.measured)


@pytest.mark.parametrize(
    ("clock", "want"),
    [
        (1200.0, 0.0),  # a measured clock
        (1000.0, 1.0),  # below the lowest: extrapolated
        (1400.0, 1.0),  # mid-gap between 1200 and 1600
        (1300.0, 0.75),  # w = 0.25: 4 w (1 - w)
        (1700.0, 0.75),  # toward the default clock's exact point: w = 0.25
        (2000.0, 0.0),  # the default clock
    ],
)
def test_the_discrepancy_share_is_least_known_mid_gap(clock: float, want: float) -> None:
    assert _fit()._gap_share(clock, [1200, 1600]) == pytest.approx(want)


def test_the_discrepancy_stderr_carries_the_model_s_error_between_measured_clocks() -> None:
    """The blend's own standard error treats the residuals' interpolation as exact; the
    bounds' adds ``tau2`` (at least ``MISFIT_MIN**2``) times the gap share to the corrected
    side, weighted as the point weights it (``_blend_variance``)."""
    fit = _fit()
    v_m, v_c = 0.0004, (0.5 * 0.01) ** 2 + (0.5 * 0.02) ** 2
    w = v_c / (v_m + v_c)
    want = math.sqrt(w * w * v_m + (1 - w) ** 2 * (v_c + 0.0004 * 1.0))
    thr_se, power_se = fit.discrepancy_stderr(1400.0)
    assert thr_se == pytest.approx(want)
    assert thr_se > fit.throughput_stderr(1400.0)
    assert power_se == 0.0  # no power model
    # At a measured clock only the blend's sampling error stays.
    _, v_m2, _, v_c2, _, _ = fit._parts(1200.0)
    w2 = v_c2 / (v_m2 + v_c2)
    assert fit.discrepancy_stderr(1200.0)[0] == pytest.approx(
        math.sqrt(w2 * w2 * v_m2 + (1 - w2) ** 2 * v_c2)
    )
    # A model that fits (no misfit, tau2 0) and probed clocks on it: its own error and
    # MISFIT_MIN**2, at a measured clock too (it passed the misfit test only to within
    # MISFIT_MIN there).
    on = tuple(
        probe.MeasuredClock(c, 3, _r(c), 0.01, 1.0 + 0.8 * ((c / F_MAX) ** 2 - 1.0), 0.01)
        for c in (1200, 1600)
    )
    fits = probe.CorrectedFit(_model(0.05, 0.8), on, 0.0, False)
    se = fits.model.throughput_stderr(1400.0)
    thr_se, power_se = fits.discrepancy_stderr(1400.0)
    assert thr_se == pytest.approx(math.sqrt(se**2 + probe.MISFIT_MIN**2))
    assert power_se == pytest.approx(probe.MISFIT_MIN)
    at_probed = fits.model.throughput_stderr(1200.0)
    assert fits.discrepancy_stderr(1200.0)[0] == pytest.approx(
        math.sqrt(at_probed**2 + probe.MISFIT_MIN**2)
    )
    # Probed clocks off the model by less than the misfit test sees (0.70 and 0.90 against
    # 0.75 and 0.889): their squared residuals, interpolated, where larger than the floor.
    off = probe.CorrectedFit(_model(0.05, 0.8), (M1200, M1600), 0.0, False)
    local = 0.5 * (0.70 - _r(1200)) ** 2 + 0.5 * (0.90 - _r(1600)) ** 2
    assert off.discrepancy_stderr(1400.0)[0] == pytest.approx(math.sqrt(se**2 + local))
    assert off.discrepancy_stderr(1200.0)[0] == pytest.approx(
        math.sqrt(at_probed**2 + (0.70 - _r(1200)) ** 2)
    )
    assert fits.discrepancy_stderr(2000.0) == (0.0, 0.0)


def test_the_monotone_bracket_is_the_measured_clocks_around_a_clock() -> None:
    fit = _fit()
    (thr_lo, thr_hi), (p_lo, p_hi) = fit.monotone_bracket(1400.0, 2.0) or ((0, 0), (0, 0))
    assert (thr_lo, thr_hi) == pytest.approx((0.70 - 2 * 0.01, 0.90 + 2 * 0.02))
    assert (p_lo, p_hi) == (0.0, math.inf)  # M1200/M1600 carry no power standard error
    # Above the highest measured clock the default's exact 1 closes it.
    assert (fit.monotone_bracket(1800.0, 2.0) or ((0, 0),))[0] == pytest.approx((0.90 - 0.04, 1.0))
    powered = _fit(
        (
            probe.MeasuredClock(1200, 3, 0.70, 0.01, 0.60, 0.01),
            probe.MeasuredClock(1600, 3, 0.90, 0.02, 0.80, 0.02),
        )
    )
    assert (powered.monotone_bracket(1800.0, 2.0) or ((0, 0), (0, 0)))[1] == pytest.approx(
        (0.80 - 0.04, 1.0)
    )
    assert fit.monotone_bracket(1000.0, 2.0) is None  # nothing measured below
    assert fit.monotone_bracket(2000.0, 2.0) is None
