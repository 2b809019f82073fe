"""In-phase interleaved probes: paired comparison of candidate clocks with the default governor.

Why: comparing a trial step with the default-governor prediction for the same tokens leaves
the step's own variation in the comparison (2-11 % on the shipped verl traces, more than the
3-5 % throughput effect a 0.95 threshold must resolve). So a trial runs the phase as short
slices that alternate candidate and default governor in Thue-Morse blocks and compares progress
rate and power inside each block: the workload is the same on both sides and its trend cancels.
Energy per token follows as power ratio / throughput ratio. The agent switches clocks in
milliseconds; progress per slice comes from the trainer SDK (decode iterations for generation,
tokens for training) and power from instant-power samples (the energy counter updates only
every 20-100 ms, too coarse for slices).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rlenergy.control.freq import base

THUE_MORSE = (True, False, False, True, False, True, True, False)
"""One probe block: candidate (True) and default (False) slices in Thue-Morse order. The two
sides have equal first and second moments of position (0+3+5+6 = 1+2+4+7, 0+9+25+36 =
1+4+16+49), so a throughput trend that is linear or quadratic over the block cancels: decode
slows as sequences finish, and an ABBA block would bias the candidate upward."""
BLOCK = len(THUE_MORSE)


def block_schedule(clocks_mhz: Sequence[int]) -> tuple[int | None, ...]:
    """Slice schedule: one Thue-Morse block per clock (``None`` = default governor)."""
    out: list[int | None] = []
    for c in clocks_mhz:
        out.extend(c if is_candidate else None for is_candidate in THUE_MORSE)
    return tuple(out)


@dataclasses.dataclass
class RatioStats:
    """Running mean and variance (Welford) of per-block ratios for one clock."""

    n: int = 0
    throughput_mean: float = 0.0
    throughput_m2: float = 0.0
    power_sum: float = 0.0
    power_n: int = 0
    power_m2: float = 0.0

    def add(self, throughput_ratio: float, power_ratio: float | None) -> None:
        """Add one block's throughput ratio (candidate / default) and power ratio."""
        self.n += 1
        delta = throughput_ratio - self.throughput_mean
        self.throughput_mean += delta / self.n
        self.throughput_m2 += delta * (throughput_ratio - self.throughput_mean)
        if power_ratio is not None:
            before = self.power_sum / self.power_n if self.power_n else 0.0
            self.power_sum += power_ratio
            self.power_n += 1
            self.power_m2 += (power_ratio - before) * (power_ratio - self.power_sum / self.power_n)

    @property
    def stderr(self) -> float:
        """Standard error of the mean throughput ratio (inf below 2 blocks)."""
        if self.n < 2:
            return math.inf
        return math.sqrt(self.throughput_m2 / (self.n - 1) / self.n)

    @property
    def power_stderr(self) -> float:
        """Standard error of the mean power ratio (inf below 2 blocks with power)."""
        if self.power_n < 2:
            return math.inf
        return math.sqrt(self.power_m2 / (self.power_n - 1) / self.power_n)

    @property
    def power_ratio(self) -> float | None:
        """Mean power ratio candidate / default, or None if no energy was readable."""
        return self.power_sum / self.power_n if self.power_n else None

    @property
    def energy_per_token_ratio(self) -> float | None:
        """Energy per token, candidate / default (power ratio / throughput ratio)."""
        p = self.power_ratio
        if p is None or self.throughput_mean <= 0:
            return None
        return p / self.throughput_mean


def blocks_from_slices(
    slices: Sequence[base.ProbeSlice], min_fraction: float = 0.9
) -> tuple[list[tuple[int, float, float | None]], int]:
    """Group slices into Thue-Morse blocks; return per block (clock, throughput ratio, power ratio).

    Slices are scanned in order; a block is eight consecutive slices whose clocks follow
    ``THUE_MORSE`` for one candidate clock. Blocks with a slice shorter than ``min_fraction`` of
    the block's longest slice (the phase ended mid-slice), without work or tokens on either side,
    with a stalled slice (a hung engine: ``ProbeSlice.stalled``) or with a slice whose rate
    the progress reports did not resolve (``ProbeSlice.unresolved``: a report gap longer than
    the slice; its interpolated progress read 1560 MHz training blocks at up to 1.10 against a
    true 0.81, tests/unit/agent/test_status_truth.py) are dropped; a block whose
    slices were metered by different sources (``ProbeSlice.energy_source``) keeps its
    throughput ratio but gives no power ratio. Rates and powers are taken over each slice's
    work (``ProbeSlice.work_s``: a lead before the work began left out). A block is
    credited to the clock its candidate slices ran (``base.ran_slice_clock_mhz``, time-weighted)
    when a cap held them more than one clock step below the lock; else to the lock.

    Returns:
        The blocks and the number of slices consumed (the rest may start a block that later
        slices complete, when slices are whole phases of consecutive steps).
    """
    out: list[tuple[int, float, float | None]] = []
    i = 0
    while i + BLOCK <= len(slices):
        group = slices[i : i + BLOCK]
        clock = _block_clock(group)
        if clock is None:
            i += 1
            continue
        i += BLOCK
        if any(s.stalled or s.unresolved for s in group):
            continue
        durations = [s.duration_s for s in group]
        if min(durations) < min_fraction * max(durations):
            continue
        a = [s for s, cand in zip(group, THUE_MORSE, strict=True) if cand]
        b = [s for s, cand in zip(group, THUE_MORSE, strict=True) if not cand]
        # Rates and powers over the work only: a lead before the work began is neither.
        ta, tb = sum(s.work_s for s in a), sum(s.work_s for s in b)
        if ta <= 0 or tb <= 0:
            continue
        rate_b = sum(s.progress for s in b) / tb
        if rate_b <= 0:
            continue
        thr = (sum(s.progress for s in a) / ta) / rate_b
        # Credit the clock the candidate slices ran (a cap below the lock), time-weighted.
        ran = [base.ran_slice_clock_mhz(s) or clock for s in a]
        credited = round(sum(r * s.work_s for r, s in zip(ran, a, strict=True)) / ta)
        if credited >= clock - base.CLOCK_TOLERANCE_MHZ:
            credited = clock
        power: float | None = None
        ea = [s.work_energy_j for s in a]
        eb = [s.work_energy_j for s in b]
        # Like with like: a power ratio only between slices metered the same way (an instant-
        # power slice next to a counter-fallback one would carry the sensors' disagreement).
        if all(e is not None for e in ea + eb) and len({s.energy_source for s in group}) == 1:
            total_b = sum(e or 0.0 for e in eb)
            if total_b > 0:
                power = (sum(e or 0.0 for e in ea) / ta) / (total_b / tb)
        out.append((credited, thr, power))
    return out, i


def _block_clock(group: Sequence[base.ProbeSlice]) -> int | None:
    """The candidate clock of ``BLOCK`` slices in Thue-Morse order, else None."""
    clock = group[0].clock_mhz
    if clock is None or any(
        (s.clock_mhz == clock) != cand or (not cand and s.clock_mhz is not None)
        for s, cand in zip(group, THUE_MORSE, strict=True)
    ):
        return None
    return clock


def paired_default(
    slices: Sequence[base.ProbeSlice], fit: PhaseModelFit | CorrectedFit | None
) -> tuple[float, float] | None:
    """(time s, energy J) the default governor would have needed for the work of ``slices``.

    Measured, not modelled, where the window has it: each complete Thue-Morse block's default
    slices ran the default governor on the same work at the same point of the phase, so the
    block's work under the default governor takes their time plus the candidate slices' work
    at their rate, ``t_b (1 + P_a / P_b)``, and their power over that time,
    ``E_b (1 + P_a / P_b)`` (``P`` progress, ``t`` time, ``E`` energy of the candidate ``a``
    and default ``b`` slices, over their work: ``ProbeSlice.work_s``). Slices outside complete
    blocks (or in a block metered by two energy sources, or stalled): a default slice is its
    own answer; a candidate slice is scaled by the mean throughput and power ratios of this
    window's blocks at its clock, else by the fit's (at the clock it ran). A slice's lead
    (``ProbeSlice.lead_s``: the time before the phase's work began) is its own answer under
    any governor: counted in at the work's rate and power, a 12 ms lead read a generation
    saving 17.10 % against a true 15.53 %, left out 16.08 % against 16.13 %
    (tests/unit/agent/test_status_truth.py, case ``work-starts-late``).

    Returns:
        None when a slice's energy is unknown, or a candidate slice has neither blocks at its
        clock in this window nor a fit with power.
    """
    if any(s.energy_j is None for s in slices):
        return None
    time_s = energy_j = 0.0
    covered = [False] * len(slices)
    ratios: dict[int, list[tuple[float, float]]] = {}
    i = 0
    while i + BLOCK <= len(slices):
        group = slices[i : i + BLOCK]
        clock = _block_clock(group)
        if clock is None:
            i += 1
            continue
        a = [s for s, cand in zip(group, THUE_MORSE, strict=True) if cand]
        b = [s for s, cand in zip(group, THUE_MORSE, strict=True) if not cand]
        ta, tb = sum(s.work_s for s in a), sum(s.work_s for s in b)
        pa, pb = sum(s.progress for s in a), sum(s.progress for s in b)
        ea, eb = sum(s.work_energy_j or 0.0 for s in a), sum(s.work_energy_j or 0.0 for s in b)
        one_source = len({s.energy_source for s in group}) == 1  # like with like
        clean = not any(s.stalled or s.unresolved for s in group)
        if min(ta, tb, pb, ea, eb) > 0 and one_source and clean:
            time_s += tb * (1.0 + pa / pb) + sum(s.lead_s for s in group)
            energy_j += eb * (1.0 + pa / pb) + sum(s.lead_energy_j or 0.0 for s in group)
            ratios.setdefault(clock, []).append(((pa / ta) / (pb / tb), (ea / ta) / (eb / tb)))
            covered[i : i + BLOCK] = [True] * BLOCK
        i += BLOCK
    for s, done in zip(slices, covered, strict=True):
        if done:
            continue
        e = s.energy_j or 0.0
        if s.clock_mhz is None:
            time_s, energy_j = time_s + s.duration_s, energy_j + e
            continue
        seen = ratios.get(s.clock_mhz)
        if seen:
            thr = sum(r for r, _ in seen) / len(seen)
            power = sum(p for _, p in seen) / len(seen)
        else:
            ran = base.ran_slice_clock_mhz(s) or s.clock_mhz
            modelled = None if fit is None else fit.power_ratio(ran)
            if fit is None or modelled is None:
                return None
            thr, power = fit.throughput_ratio(ran), modelled
        if power <= 0:
            return None
        time_s += s.work_s * thr + s.lead_s
        energy_j += (s.work_energy_j or 0.0) * thr / power + (s.lead_energy_j or 0.0)
    return time_s, energy_j


@dataclasses.dataclass(frozen=True)
class PhaseModelFit:
    """Fit of the phase clock model to probe blocks.

    Throughput ratio vs the default governor at clock ``c`` (the default governor runs at
    ``f_default``, below ``f_max`` when the power limit binds), with ``u = 1 - m``:
    ``r(c) = (u (f_max/f_default - 1) + 1) / (u (f_max/c - 1) + 1)``; power ratio ``p(c) = 1 + beta
    ((c/f_max)**2 - (f_default/f_max)**2)`` (the phase model of ``rlenergy.gpu.models``,
    docs/simulator.md, a = 2). Each block gives one linear equation in ``u`` and one in ``beta``, so
    both are least-squares slopes with standard errors from the residuals.

    Attributes:
        u: share of phase time that scales with the SM clock (1 - m).
        u_stderr: standard error of ``u``.
        beta: power slope (``None`` when no power was measured).
        f_max_mhz: max clock.
        f_default_mhz: clock the default governor runs the phase at.
        blocks: number of blocks fitted.
    """

    u: float
    u_stderr: float
    beta: float | None
    f_max_mhz: float
    f_default_mhz: float
    blocks: int

    def throughput_ratio(self, clock_mhz: float, u: float | None = None) -> float:
        """Predicted throughput ratio vs default at ``clock_mhz``."""
        uu = self.u if u is None else u
        c = min(clock_mhz, self.f_default_mhz)
        return (uu * (self.f_max_mhz / self.f_default_mhz - 1.0) + 1.0) / (
            uu * (self.f_max_mhz / c - 1.0) + 1.0
        )

    def throughput_lower_bound(self, clock_mhz: float, z: float) -> float:
        """Lower confidence bound of the throughput ratio (``u`` at its upper bound).

        ``z`` is widened to Student's t for the fit's degrees of freedom.
        """
        k = student_t_factor(self.blocks - 1, z)
        return self.throughput_ratio(clock_mhz, min(self.u + k * self.u_stderr, 1.0))

    def throughput_stderr(self, clock_mhz: float) -> float:
        """Standard error of the predicted ratio (delta method)."""
        return abs(
            self.throughput_ratio(clock_mhz, self.u + self.u_stderr)
            - self.throughput_ratio(clock_mhz)
        )

    def power_ratio(self, clock_mhz: float) -> float | None:
        """Predicted power ratio vs default at ``clock_mhz``."""
        if self.beta is None:
            return None
        c = min(clock_mhz, self.f_default_mhz)
        return 1.0 + self.beta * (
            (c / self.f_max_mhz) ** 2 - (self.f_default_mhz / self.f_max_mhz) ** 2
        )

    def energy_ratio(self, clock_mhz: float) -> float | None:
        """Predicted energy per token vs default (power ratio / throughput ratio)."""
        p = self.power_ratio(clock_mhz)
        return None if p is None else p / self.throughput_ratio(clock_mhz)


_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def student_t_factor(dof: int, z: float) -> float:
    """``z`` scaled to Student's t at ``dof`` degrees of freedom (two-sided 95 % table / 1.96)."""
    if dof < 1:
        return math.inf
    if dof > 10:
        return z * (1.0 + 1.0 / (dof - 1))
    return z * _T975[dof] / 1.96


def fit_phase_model(
    blocks: Sequence[tuple[int, float, float | None]], f_max_mhz: float, f_default_mhz: float
) -> PhaseModelFit | None:
    """Fit ``PhaseModelFit`` to (clock, throughput ratio, power ratio) blocks.

    ``u`` is the least-squares slope of the model's linear form, ``u (g1 / r - x) = 1 - 1 / r``
    (``g1 = f_max / f_default - 1``, ``x = f_max / c - 1``), taken over each probed clock's
    mean ratio weighted by its blocks, not over single blocks: ``1 / r`` is convex, so over
    noisy blocks its mean exceeds ``1 / mean r`` (Jensen) and the per-block slope came out
    biased. Short phases give noisy blocks (TinyZero's 0.6 s phases on an H100: 8 % spread
    per block); there the per-block slope predicted generation 0.0031 below its true ratio at
    the lock (h100-sxm, sync, 1,000 steps: 0.9566 vs 0.9597 at 1515 MHz), holding the lock
    two clock steps high; the per-clock means predict 0.9597. ``u``'s standard error still
    comes from the blocks' own residuals.

    Returns:
        The fit, or None with fewer than two blocks below the default clock.
    """
    g1 = f_max_mhz / f_default_mhz - 1.0
    sd2 = (f_default_mhz / f_max_mhz) ** 2
    by_clock: dict[int, list[float]] = {}
    pa: list[float] = []
    pb: list[float] = []
    for clock, thr, power in blocks:
        if clock >= f_default_mhz or thr <= 0:
            continue
        by_clock.setdefault(clock, []).append(thr)
        if power is not None:
            pa.append((clock / f_max_mhz) ** 2 - sd2)
            pb.append(power - 1.0)
    xs = {clock: f_max_mhz / clock - 1.0 for clock in by_clock}
    n = sum(len(ratios) for ratios in by_clock.values())
    saa = sab = 0.0
    for clock, ratios in by_clock.items():
        r = sum(ratios) / len(ratios)
        a = g1 / r - xs[clock]
        saa += len(ratios) * a * a
        sab += len(ratios) * a * (1.0 - 1.0 / r)
    if n < 2 or saa <= 0:
        return None
    u = sab / saa
    ss = sum(
        ((1.0 - 1.0 / thr) - u * (g1 / thr - xs[clock])) ** 2
        for clock, ratios in by_clock.items()
        for thr in ratios
    )
    u_se = math.sqrt(ss / (n - 1)) / math.sqrt(saa)
    spp = sum(a * a for a in pa)
    beta = sum(a * b for a, b in zip(pa, pb, strict=True)) / spp if spp > 0 else None
    return PhaseModelFit(min(max(u, 0.0), 1.0), u_se, beta, f_max_mhz, f_default_mhz, n)


MISFIT_Z = 3.0
"""A measured clock whose mean throughput ratio is this many standard errors from the phase
model marks the model as misfitted for this phase (``CorrectedFit.misfit``) [heuristic]."""
MISFIT_MIN = 0.005
"""...and at least this far (a 0.5 % throughput error is below what the threshold resolves)
[heuristic]."""
MISFIT_MIN_BLOCKS = 3
"""A clock with fewer probe blocks than this (``ControllerSettings.min_blocks``' default)
must lie ``MISFIT_Z x sqrt(MISFIT_MIN_BLOCKS / n)`` standard errors off to flag a misfit (5.2
for one block) [heuristic]. Among the dozens of single blocks a short phase spreads over
clocks, one lies 3 standard errors out by chance: TinyZero on b200, seed 1, one block at
1305 MHz read 1.16 of default (3.9 standard errors), flagged a misfit, and the corrected fit
(which follows each probed clock's mean once flagged) interpolated a lock at 1155 MHz that ran
generation at 0.941 of default against 0.95. A real step shows far out on one block (TinyZero
on ``b200:step-decode``: 8.6 standard errors at 1455 MHz); requiring three blocks outright
cost that row 0.747 -> 0.662 of the oracle (``bench/energy.py``)."""


def _blend_variance(v_a: float, v_b: float, v_b_true: float) -> float:
    """Variance of ``CorrectedFit._blend``'s estimate where ``b``'s true variance is not its own.

    ``w**2 v_a + (1 - w)**2 v_b_true``, ``w = v_b / (v_a + v_b)`` the weight the blend gives
    ``a`` (from ``v_b``, what it assumes); the variance of the one it takes alone where it takes
    one alone.
    """
    if v_b <= 1e-18:
        return v_b_true
    if v_a <= 1e-18 or not math.isfinite(v_a):
        return v_a if math.isfinite(v_a) else v_b_true
    if not math.isfinite(v_b):
        return v_a
    w = v_b / (v_a + v_b)
    return w * w * v_a + (1.0 - w) ** 2 * v_b_true


@dataclasses.dataclass(frozen=True)
class MeasuredClock:
    """Direct evidence at one probed clock.

    Attributes:
        clock_mhz: the probed clock.
        n: probe blocks at it.
        throughput_mean: mean throughput ratio vs default.
        throughput_se: standard error of that mean (pooled within-clock spread; inf when unknown).
        power_mean: mean power ratio (None: no power measured).
        power_se: standard error of ``power_mean`` (pooled within-clock spread; inf when
            unknown).
    """

    clock_mhz: int
    n: int
    throughput_mean: float
    throughput_se: float
    power_mean: float | None
    power_se: float = math.inf

    def throughput_halfwidth(self, z: float) -> float:
        """Half-width of the throughput mean's confidence interval.

        ``z`` is widened to Student's t for ``n - 1`` degrees of freedom.
        """
        return student_t_factor(self.n - 1, z) * self.throughput_se


@dataclasses.dataclass(frozen=True)
class CorrectedFit:
    """The phase model corrected by what each probed clock measured directly.

    ``PhaseModelFit`` assumes ``t(f) = t0((1-m) f0/f + m)``. Real curves have knees, plateaus and
    steps (the published family, ``rlenergy.gpu.published``), where one ``u`` fitted to all blocks
    is biased at the clock that matters. So the prediction at clock ``c`` blends two estimates by
    inverse variance:

    * the model: ``r_model(c)``, variance ``se_model(c)**2 + tau2``, where ``tau2`` is the
      model's discrepancy variance (method of moments over the measured clocks: squared residuals
      in excess of their sampling variance; 0 when the model fits within noise);
    * the corrected model: ``r_model(c)`` plus the residuals (measured mean - model) of the
      probed clocks on either side of ``c``, linearly interpolated in clock (the default clock is
      an exact point with residual 0; below the lowest probed clock its residual holds), variance
      from the residuals' standard errors.

    Until a measured clock is ``MISFIT_Z`` standard errors off the model (``misfit``), the
    model alone predicts (its lever arm keeps the prediction precise between sparse, noisy
    blocks, and blending noisy monitor blocks in would be overconfident: they also fed the
    fit); once it is, each probed clock's own mean decides near it. Power ratios are blended
    with the same weights. Monotone by physics: a clock's throughput is at least that of any
    lower clock (used by ``PhaseController``'s bracketing search, not here).

    Attributes:
        model: the underlying one-parameter fit.
        measured: per probed clock below the default clock, ascending.
        tau2: discrepancy variance of the model (throughput-ratio units squared).
        misfit: a measured clock lies more than ``MISFIT_Z`` standard errors (and ``MISFIT_MIN``)
            from the model.
        power_misfit: a measured clock's mean power ratio lies more than ``MISFIT_Z`` standard
            errors (and ``MISFIT_MIN``) from the model's quadratic power: power floors and
            knees (``rlenergy.gpu.published``) bend it, so ``power_ratio`` corrects the model
            by the measured clocks' power residuals on its own (``_power_parts``), whether or
            not the throughput fits.
        power_tau2: discrepancy variance of the power model (power-ratio units squared; the
            method of moments, as ``tau2``).
    """

    model: PhaseModelFit
    measured: tuple[MeasuredClock, ...]
    tau2: float
    misfit: bool
    power_misfit: bool = False
    power_tau2: float = 0.0

    # Attributes of the model, so callers read either fit alike.
    @property
    def u(self) -> float:
        """The model's clock-scaling share."""
        return self.model.u

    @property
    def u_stderr(self) -> float:
        """Standard error of ``u``."""
        return self.model.u_stderr

    @property
    def beta(self) -> float | None:
        """The model's power slope (None: no power measured)."""
        return self.model.beta

    @property
    def f_max_mhz(self) -> float:
        """Max clock, MHz."""
        return self.model.f_max_mhz

    @property
    def f_default_mhz(self) -> float:
        """Clock the default governor runs the phase at, MHz."""
        return self.model.f_default_mhz

    @property
    def blocks(self) -> int:
        """Blocks fitted."""
        return self.model.blocks

    def measured_at(self, clock_mhz: int) -> MeasuredClock | None:
        """Direct evidence at ``clock_mhz``, if probed."""
        for m in self.measured:
            if m.clock_mhz == clock_mhz:
                return m
        return None

    def _neighbours(self, c: float) -> list[tuple[float, MeasuredClock | None]]:
        """(weight, measured clock or None = the default clock's exact point) around ``c``."""
        usable = [m for m in self.measured if math.isfinite(m.throughput_se)]
        below = [m for m in usable if m.clock_mhz <= c]
        above = [m for m in usable if m.clock_mhz > c]
        if not below:
            return [(1.0, above[0])] if above else []
        lo = below[-1]
        if lo.clock_mhz == c:
            return [(1.0, lo)]
        hi_c = above[0].clock_mhz if above else self.f_default_mhz
        w_hi = (c - lo.clock_mhz) / max(hi_c - lo.clock_mhz, 1e-9)
        return [(1.0 - w_hi, lo), (w_hi, above[0] if above else None)]

    def _parts(
        self, clock_mhz: float, u: float | None = None
    ) -> tuple[float, float, float, float, float | None, float | None]:
        """(model r, model var, corrected r, corrected var, model p, corrected p) at a clock."""
        c = min(clock_mhz, self.f_default_mhz)
        model = self.model
        r_m = model.throughput_ratio(c, u)
        se_m = model.throughput_stderr(c)
        p_m = model.power_ratio(c)
        nb = self._neighbours(c)
        if not self.misfit or c >= self.f_default_mhz or not nb:
            return r_m, se_m**2 + self.tau2, r_m, math.inf, p_m, p_m
        r_c = r_m
        var_c = 0.0
        p_c = p_m
        # The model's own error in the interpolated difference (its u uncertainty).
        u_hi = min(model.u + model.u_stderr, 1.0)
        diff_m = model.throughput_ratio(c, u_hi) - model.throughput_ratio(c)
        for w, m in nb:
            if m is None:
                continue
            r_c += w * (m.throughput_mean - model.throughput_ratio(m.clock_mhz, u))
            var_c += (w * m.throughput_se) ** 2
            diff_m -= w * (
                model.throughput_ratio(m.clock_mhz, u_hi) - model.throughput_ratio(m.clock_mhz)
            )
            pm_at = model.power_ratio(m.clock_mhz)
            if p_c is not None and m.power_mean is not None and pm_at is not None:
                p_c += w * (m.power_mean - pm_at)
        var_c += diff_m**2
        return r_m, se_m**2 + self.tau2, r_c, var_c, p_m, p_c

    @staticmethod
    def _blend(a: float, va: float, b: float, vb: float) -> tuple[float, float]:
        if vb <= 1e-18:
            return b, 0.0
        if va <= 1e-18:
            return a, 0.0
        wa, wb = 1.0 / va, 1.0 / vb
        return (a * wa + b * wb) / (wa + wb), 1.0 / (wa + wb)

    def throughput_ratio(self, clock_mhz: float, u: float | None = None) -> float:
        """Predicted throughput ratio vs default at ``clock_mhz``."""
        if not self.misfit:
            return self.model.throughput_ratio(clock_mhz, u)
        r_m, v_m, r_c, v_c, _, _ = self._parts(clock_mhz, u)
        # Monotone by physics: no clock at or below the default runs faster than the default
        # (a noisy block above 1 at one clock must not make the default look slower there).
        return min(self._blend(r_m, v_m, r_c, v_c)[0], 1.0)

    def throughput_stderr(self, clock_mhz: float) -> float:
        """Standard error of the predicted ratio."""
        if not self.misfit:
            return self.model.throughput_stderr(clock_mhz)
        r_m, v_m, r_c, v_c, _, _ = self._parts(clock_mhz)
        return math.sqrt(self._blend(r_m, v_m, r_c, v_c)[1])

    def throughput_lower_bound(self, clock_mhz: float, z: float) -> float:
        """Lower confidence bound (``z`` widened to Student's t for the blocks fitted)."""
        if not self.misfit:
            return self.model.throughput_lower_bound(clock_mhz, z)
        k = student_t_factor(self.blocks - 1, z)
        return self.throughput_ratio(clock_mhz) - k * self.throughput_stderr(clock_mhz)

    def _power_parts(self, clock_mhz: float) -> tuple[float, float, float, float] | None:
        """(model p, its variance, corrected p, its variance) at a clock (None: no power model).

        The corrected power is the model's plus the power residuals (measured mean - model) of
        the probed clocks with power on either side, linearly interpolated in clock (the
        default clock an exact point with residual 0; below the lowest, its residual holds).
        """
        c = min(clock_mhz, self.f_default_mhz)
        p_m = self.model.power_ratio(c)
        if p_m is None:
            return None
        usable = [
            m for m in self.measured if m.power_mean is not None and math.isfinite(m.power_se)
        ]
        below = [m for m in usable if m.clock_mhz <= c]
        above = [m for m in usable if m.clock_mhz > c]
        if c >= self.f_default_mhz or not usable:
            return p_m, self.power_tau2, p_m, math.inf
        if not below:
            nb: list[tuple[float, MeasuredClock | None]] = [(1.0, above[0])]
        elif below[-1].clock_mhz == c:
            nb = [(1.0, below[-1])]
        else:
            lo = below[-1]
            hi_c = above[0].clock_mhz if above else self.f_default_mhz
            w_hi = (c - lo.clock_mhz) / max(hi_c - lo.clock_mhz, 1e-9)
            nb = [(1.0 - w_hi, lo), (w_hi, above[0] if above else None)]
        p_c, var_c = p_m, 0.0
        for w, m in nb:
            if m is None or m.power_mean is None:
                continue
            p_c += w * (m.power_mean - (self.model.power_ratio(m.clock_mhz) or 0.0))
            var_c += (w * m.power_se) ** 2
        return p_m, self.power_tau2, p_c, var_c

    def power_ratio(self, clock_mhz: float) -> float | None:
        """Predicted power ratio vs default at ``clock_mhz``.

        With a power misfit, the model's and the power-corrected power blended by their own
        variances (``_power_parts``). Else, with a throughput misfit, the model's and the
        corrected power blended with the throughput's weights (``_blend``); else the model's.
        """
        if self.power_misfit:
            parts = self._power_parts(clock_mhz)
            if parts is None:
                return None
            return self._blend(*parts)[0]
        if not self.misfit:
            return self.model.power_ratio(clock_mhz)
        _, v_m, _, v_c, p_m, p_c = self._parts(clock_mhz)
        if p_m is None or p_c is None:
            return p_m
        return self._blend(p_m, v_m, p_c, v_c)[0]

    def _gap_share(self, clock_mhz: float, clocks_mhz: Sequence[int]) -> float:
        """Share of the model's discrepancy variance left at a clock, in [0, 1].

        0 at a measured clock (of ``clocks_mhz``) and at or above the default clock (exact
        points); ``4 w (1 - w)`` between two of them, ``w`` the clock's place in the gap (1
        mid-gap); 1 below the lowest measured clock (extrapolated) [heuristic: a discrepancy
        of variance ``tau2`` that is known at both ends of a gap is least known mid-gap].
        """
        c = min(clock_mhz, self.f_default_mhz)
        if c >= self.f_default_mhz or c in clocks_mhz:
            return 0.0
        below = [k for k in clocks_mhz if k < c]
        if not below:
            return 1.0
        above = [k for k in clocks_mhz if k > c]
        lo, hi = below[-1], above[0] if above else self.f_default_mhz
        w = (c - lo) / max(hi - lo, 1e-9)
        return 4.0 * w * (1.0 - w)

    def discrepancy_stderr(self, clock_mhz: float) -> tuple[float, float]:
        """Standard errors of ``throughput_ratio`` and ``power_ratio`` with the model's error.

        ``throughput_stderr`` carries the sampling error of the fit and its blend's weights
        assume the residuals' interpolation exact; where the one-parameter shape misses a
        curve (knees, plateaus, saturation: ``rlenergy.gpu.published``), the error at a clock
        also holds the model's discrepancy, whose variance the measured clocks estimate
        (``tau2``, ``power_tau2``: method of moments), at least ``MISFIT_MIN**2``: a model
        passes the misfit test with a residual up to ``MISFIT_MIN`` (and a few blocks' noise)
        at every measured clock, so its discrepancy is known no better. The model alone (no
        misfit) carries its sampling variance and all of the discrepancy, at measured clocks
        too, or the squared residual of the measured clocks around the clock where that is
        larger (``_local_residual2``); a blend of the model (variance ``v_m``, the full
        discrepancy included) and the residual-corrected model (``v_c``) with the point's
        weights ``a`` and ``1 - a`` carries ``a**2 v_m + (1 - a)**2 (v_c + share x
        discrepancy)`` (``_gap_share``: the residuals' interpolation between measured clocks
        is no exact point).

        Returns:
            (throughput ratio standard error, power ratio standard error) at ``clock_mhz``;
            0.0 at or above the default clock (both ratios are 1 there by definition); the
            power's is 0.0 without a power model.
        """
        if clock_mhz >= self.f_default_mhz:
            return 0.0, 0.0
        tau2, power_tau2 = max(self.tau2, MISFIT_MIN**2), max(self.power_tau2, MISFIT_MIN**2)
        thr_clocks = [m.clock_mhz for m in self.measured if math.isfinite(m.throughput_se)]
        thr_share = self._gap_share(clock_mhz, thr_clocks)
        _, v_m, _, v_c, _, _ = self._parts(clock_mhz)
        if self.misfit:
            thr_var = _blend_variance(v_m, v_c, v_c + tau2 * thr_share)
        else:
            se = self.model.throughput_stderr(clock_mhz)
            local = self._local_residual2(clock_mhz, power=False)
            thr_var = (se * se if math.isfinite(se) else 0.0) + max(tau2, local)
        parts = self._power_parts(clock_mhz)
        if parts is None:
            return math.sqrt(thr_var), 0.0
        p_clocks = [
            m.clock_mhz
            for m in self.measured
            if m.power_mean is not None and math.isfinite(m.power_se)
        ]
        p_share = self._gap_share(clock_mhz, p_clocks)
        if self.power_misfit:
            _, pv_m, _, pv_c = parts
            p_var = _blend_variance(pv_m, pv_c, pv_c + power_tau2 * p_share)
        else:
            p_var = max(power_tau2, self._local_residual2(clock_mhz, power=True))
        return math.sqrt(thr_var), math.sqrt(p_var)

    def _local_residual2(self, clock_mhz: float, *, power: bool) -> float:
        """Squared residual (measured mean - model) of the measured clocks around a clock.

        The clocks ``_neighbours`` interpolates between (the default clock's residual 0),
        their squared residuals weighted alike: a model that passed the misfit test can still
        miss the clocks near a lock by up to ``MISFIT_Z`` of their noise (TinyZero /
        ``b200:saturating-decode``, async, 1,000 steps: fit 0.893 against a true 0.915 at
        1,200 MHz, probed at 1,200-1,230 MHz), and the residual there says by how much. 0.0
        without neighbours (or power measured at them, for ``power``).
        """
        c = min(clock_mhz, self.f_default_mhz)
        total = 0.0
        for w, m in self._neighbours(c):
            if m is None:
                continue
            if power:
                modelled = self.model.power_ratio(m.clock_mhz)
                if m.power_mean is None or modelled is None:
                    continue
                resid = m.power_mean - modelled
            else:
                resid = m.throughput_mean - self.model.throughput_ratio(m.clock_mhz)
            total += w * resid * resid
        return total

    def monotone_bracket(
        self, clock_mhz: float, z: float
    ) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """What monotonicity in clock allows at a clock from the measured clocks around it.

        A clock's throughput and power ratios lie between those of the nearest measured clocks
        below and above it (the default clock, exactly 1, above the highest), each widened by
        ``z`` of its standard error: physics, no curve shape assumed, so it holds on knees and
        steps (``rlenergy.gpu.published``) where the model's discrepancy is large.

        Returns:
            ((throughput low, high), (power low, high)); None below the lowest measured clock
            (nothing bounds it from below) or at or above the default clock; the power's
            bracket (0, inf) without measured power on both sides.
        """
        c = min(clock_mhz, self.f_default_mhz)
        if c >= self.f_default_mhz:
            return None
        usable = [m for m in self.measured if math.isfinite(m.throughput_se)]
        below = [m for m in usable if m.clock_mhz <= c]
        if not below:
            return None
        above = [m for m in usable if m.clock_mhz >= c]
        lo = below[-1]
        thr_hi = above[0].throughput_mean + z * above[0].throughput_se if above else 1.0
        thr = (lo.throughput_mean - z * lo.throughput_se, thr_hi)
        p_below = [m for m in below if m.power_mean is not None and math.isfinite(m.power_se)]
        p_above = [m for m in above if m.power_mean is not None and math.isfinite(m.power_se)]
        if not p_below or (above and not p_above):
            return thr, (0.0, math.inf)
        p_lo = (p_below[-1].power_mean or 0.0) - z * p_below[-1].power_se
        p_hi = (p_above[0].power_mean or 0.0) + z * p_above[0].power_se if p_above else 1.0
        return thr, (p_lo, p_hi)

    def energy_ratio(self, clock_mhz: float) -> float | None:
        """Predicted energy per token vs default (power ratio / throughput ratio)."""
        p = self.power_ratio(clock_mhz)
        return None if p is None else p / self.throughput_ratio(clock_mhz)


def fit_corrected(
    blocks: Sequence[tuple[int, float, float | None]], f_max_mhz: float, f_default_mhz: float
) -> CorrectedFit | None:
    """``fit_phase_model`` corrected by each probed clock's own mean (``CorrectedFit``).

    Returns:
        The fit, or None when ``fit_phase_model`` has none.
    """
    model = fit_phase_model(blocks, f_max_mhz, f_default_mhz)
    if model is None:
        return None
    by_clock: dict[int, list[tuple[float, float | None]]] = {}
    for clock, thr, power in blocks:
        if clock < f_default_mhz and thr > 0:
            by_clock.setdefault(clock, []).append((thr, power))
    ss = ss_p = 0.0
    dof = dof_p = 0
    for values in by_clock.values():
        mean = sum(v[0] for v in values) / len(values)
        ss += sum((v[0] - mean) ** 2 for v in values)
        dof += len(values) - 1
        ps = [v[1] for v in values if v[1] is not None]
        if ps:
            p_mean = sum(ps) / len(ps)
            ss_p += sum((p - p_mean) ** 2 for p in ps)
            dof_p += len(ps) - 1
    pooled = math.sqrt(ss / dof) if dof >= 2 else math.inf
    pooled_p = math.sqrt(ss_p / dof_p) if dof_p >= 2 else math.inf
    measured: list[MeasuredClock] = []
    for clock in sorted(by_clock):
        values = by_clock[clock]
        powers = [v[1] for v in values if v[1] is not None]
        measured.append(
            MeasuredClock(
                clock,
                len(values),
                sum(v[0] for v in values) / len(values),
                pooled / math.sqrt(len(values)),
                sum(powers) / len(powers) if powers else None,
                pooled_p / math.sqrt(len(powers)) if powers else math.inf,
            )
        )
    excess: list[float] = []
    misfit = False
    for m in measured:
        if not math.isfinite(m.throughput_se):
            continue
        resid = m.throughput_mean - model.throughput_ratio(m.clock_mhz)
        var = m.throughput_se**2 + model.throughput_stderr(m.clock_mhz) ** 2
        excess.append(resid * resid - var)
        z = MISFIT_Z * math.sqrt(max(MISFIT_MIN_BLOCKS / m.n, 1.0))
        if abs(resid) > max(z * math.sqrt(var), MISFIT_MIN):
            misfit = True
    tau2 = max(sum(excess) / len(excess), 0.0) if excess else 0.0
    p_excess: list[float] = []
    power_misfit = False
    for m in measured:
        modelled = model.power_ratio(m.clock_mhz)
        if m.power_mean is None or modelled is None or not math.isfinite(m.power_se):
            continue
        resid = m.power_mean - modelled
        p_excess.append(resid * resid - m.power_se**2)
        if abs(resid) > max(MISFIT_Z * m.power_se, MISFIT_MIN):
            power_misfit = True
    power_tau2 = max(sum(p_excess) / len(p_excess), 0.0) if p_excess else 0.0
    return CorrectedFit(model, tuple(measured), tau2, misfit, power_misfit, power_tau2)
