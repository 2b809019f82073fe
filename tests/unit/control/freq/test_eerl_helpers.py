"""EE-RL's phase controller, piece by piece (rlenergy.control.freq.eerl).

Written against the surviving mutants of ``make mutation`` (control-freq-eerl, docs/mutation.md):
each helper of ``PhaseController`` and ``EERLController`` is driven to a value worked out by
hand. The phase model here is exact (blocks drawn from ``u = 0.2``, ``beta = 0.6`` with no
noise, so every confidence bound is the point estimate):

    r(c) = 1 / (0.2 (1980 / c - 1) + 1),  p(c) = 1 + 0.6 ((c / 1980)^2 - 1)

    clock MHz   1830    1680    1530    1380    1230    1080
    r(c)        0.9839  0.9655  0.9444  0.9200  0.8913  0.8571
    e = p / r   0.9275  0.8617  ...

so at a 0.95 threshold (lock target 0.952) the most efficient clock that keeps it is 1680 MHz.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from rlenergy.api import workload as api_workload
from rlenergy.control.freq import base, eerl, probe

F_MAX = 1980
SUPPORTED = (1980, 1830, 1680, 1530, 1380, 1230, 1080, 990)
CANDIDATES = (1830, 1680, 1530, 1380, 1230, 1080)
U, BETA = 0.2, 0.6
WL = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)


def _r(c: float) -> float:
    return 1.0 / (U * (F_MAX / c - 1.0) + 1.0)


def _p(c: float) -> float:
    return 1.0 + BETA * ((c / F_MAX) ** 2 - 1.0)


def _settings(name: str = "generation", ratio: float = 0.95) -> eerl.PhaseSettings:
    return eerl.PhaseSettings(name, ratio, CANDIDATES, SUPPORTED, F_MAX)


def _pc(ctl: eerl.ControllerSettings | None = None, **kw: object) -> eerl.PhaseController:
    return eerl.PhaseController(_settings(**kw), ctl or eerl.ControllerSettings())  # type: ignore[arg-type]


def _exact_blocks(*clocks: int, n: int = 3) -> list[tuple[int, float, float | None]]:
    return [(c, _r(c), _p(c)) for c in clocks for _ in range(n)]


def _fitted(ctl: eerl.ControllerSettings | None = None) -> eerl.PhaseController:
    pc = _pc(ctl)
    pc.stage = eerl.Trial()
    pc.blocks = _exact_blocks(1080, 1380)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    assert pc.fit is not None and not pc.fit.misfit
    return pc


def _block(clock: int, *, rate: float | None = None) -> tuple[base.ProbeSlice, ...]:
    """One Thue-Morse block at ``clock``: 25 ms slices, 100 tokens/s and 300 W at default, the
    candidate at ``rate`` (default: the exact model's ``r(clock)``) and ``p(clock)`` of that."""
    r = _r(clock) if rate is None else rate
    out = []
    for c in probe.block_schedule([clock]):
        thr, power = (r, _p(clock)) if c is not None else (1.0, 1.0)
        out.append(base.ProbeSlice(c, 0.025, 2.5 * thr, 7.5 * power))
    return tuple(out)


def _owe(pc: eerl.PhaseController, *, repay: float) -> None:
    """Book a run ledger whose deficit the lock must repay at a throughput ratio of ``repay``
    (10 s of default-governor time over 400 windows: the horizon is the run so far)."""
    pc.ledger_default_s, pc.ledger_windows = 10.0, 400
    pc.ledger_actual_s = 21.0526 - 10.0 / repay


def _async(training_ratio: float) -> eerl.EERLController:
    """An async job: generation at 0.95, training at ``training_ratio``."""
    return eerl.EERLController(
        [_settings(), _settings("training", training_ratio)],
        eerl.ControllerSettings(async_mode=True),
    )


def _default_obs(duration_s: float = 1.2, energy_j: float = 360.0) -> base.PhaseObservation:
    return base.PhaseObservation("generation", duration_s, energy_j, None, 1980)


# ----- settings and features -------------------------------------------------------------------
def test_allowed_clocks_default_to_the_supported_ones_down_to_the_lowest_candidate() -> None:
    assert _settings().allowed_mhz == (1980, 1830, 1680, 1530, 1380, 1230, 1080)
    explicit = eerl.PhaseSettings("g", 0.95, CANDIDATES, SUPPORTED, F_MAX, (1680, 1530))
    assert explicit.allowed_mhz == (1680, 1530)
    none = eerl.PhaseSettings("g", 0.95, (), SUPPORTED, F_MAX)
    assert none.allowed_mhz == (1980,)


def test_drift_features() -> None:
    assert eerl._drift_feature("generation", WL) == 150.0  # mean context length
    assert eerl._drift_feature("training", WL) == WL.phase_tokens("training") / 10
    empty = api_workload.TokenWorkload(0, 0.0, 0.0, 0.0, 0.0)
    assert eerl._drift_feature("training", empty) == 0.0  # no samples: no division by zero


# ----- the run ledger and the lock target ------------------------------------------------------
def test_repay_ratio_by_hand() -> None:
    pc = _pc()
    assert pc.repay_ratio == 0.0  # nothing booked
    pc.ledger_default_s, pc.ledger_actual_s, pc.ledger_windows = 10.0, 11.0, 10
    # H = max(10, 40 x 10 / 10) = 40 s; r = 40 / ((10 + 40) / 0.95 - 11)
    assert pc.repay_ratio == pytest.approx(40 / (50 / 0.95 - 11))
    assert pc.lock_target == pytest.approx(40 / (50 / 0.95 - 11) + eerl.LOCK_MARGIN)
    pc.ledger_windows = 100  # many short windows: the horizon is the run so far
    assert pc.repay_ratio == pytest.approx(10 / (20 / 0.95 - 11))
    pc.ledger_actual_s = 100.0  # too far behind to repay in time: the default governor
    assert pc.repay_ratio == 1.0
    pc.ledger_actual_s = 0.0
    assert pc.repay_ratio == 0.0
    pc.ledger_actual_s, pc.ledger_default_s = 11.0, 0.0
    assert pc.repay_ratio == 0.0


def test_repay_ratio_is_capped_at_one_and_off_for_a_relaxed_pool() -> None:
    pc = _pc()
    pc.ledger_default_s, pc.ledger_actual_s, pc.ledger_windows = 10.0, 10.0, 400
    # Ahead of the threshold: H = 10, r = 10 / (20 / 0.95 - 10) = 0.905 < threshold
    assert pc.repay_ratio == pytest.approx(10 / (20 / 0.95 - 10))
    assert pc.lock_target == pytest.approx(0.95 + eerl.LOCK_MARGIN)
    pc.ledger_actual_s = 20.9  # room = 21.05 - 20.9 = 0.15: r = 10 / 0.15 capped at 1
    assert pc.repay_ratio == 1.0
    pc.threshold = 0.9  # async slack relaxed this pool: it repays nothing
    assert pc.repay_ratio == 0.0
    assert pc.lock_target == pytest.approx(0.9 + eerl.LOCK_MARGIN)


def test_ledger_books_clean_windows_with_a_default_time_only() -> None:
    pc = _pc()
    pc._ledger_add(_default_obs())
    assert pc.ledger_windows == 0  # no default-equivalent time known yet
    pc._last_default_time_s = 1.0
    pc._ledger_add(base.PhaseObservation("generation", 1.1, 300.0, 1680))
    pc._ledger_add(base.PhaseObservation("generation", 0.0, 300.0, 1680))
    pc._ledger_add(base.PhaseObservation("generation", 1.1, 300.0, 1680, error="x"))
    assert (pc.ledger_default_s, pc.ledger_actual_s, pc.ledger_windows) == (1.0, 1.1, 1)


def test_allowed_lies_strictly_between_floor_and_default_clock() -> None:
    pc = _pc()
    assert pc._allowed() == [1830, 1680, 1530, 1380, 1230, 1080]
    pc.floor_mhz = 1380
    pc.default_clock_mhz = 1830
    assert pc._allowed() == [1680, 1530]
    assert pc.f_default_mhz == 1830
    pc.default_clock_mhz = None
    assert pc.f_default_mhz == F_MAX


# ----- phase length, slices, evidence ------------------------------------------------------------
def test_slices_in_phase_by_length_and_progress_cadence() -> None:
    pc = _pc()
    pc._last_time_s = 1.25
    assert pc._min_slice_s() == eerl.MIN_SLICE_S
    assert pc._slices_in_phase() == 48  # 1.25 s / 25 ms = 50, at most slices_per_phase
    pc._last_time_s = 0.5
    assert pc._slices_in_phase() == 16  # 20, cut to whole blocks of 8
    pc._last_time_s, pc.progress_gap_s = 1.2, 0.01
    assert pc._min_slice_s() == pytest.approx(0.04)  # four report gaps
    assert pc._slices_in_phase() == 24  # 30 -> 24
    pc.progress_gap_s = math.inf
    assert pc._slices_in_phase() == 0
    pc.progress_gap_s = 0.0
    pc._last_time_s = 0.19
    assert pc._slices_in_phase() == 0  # 7 slices: not one block
    pc._last_time_s = 0.2
    assert pc._slices_in_phase() == 8
    no_probes = _pc(eerl.ControllerSettings(in_phase_probes=False))
    no_probes._last_time_s = 10.0
    assert no_probes._slices_in_phase() == 0


def test_evidence_scale_and_trial_step_limit() -> None:
    pc = _pc()
    pc._last_time_s = pc._last_default_time_s = 2.0
    assert pc.evidence_scale == 1.0  # long phase: 1.2 s of slices fit
    assert pc.trial_step_limit == 8.0
    pc._last_time_s = pc._last_default_time_s = 0.6
    assert pc.evidence_scale == pytest.approx(2.0)  # 1.2 s of evidence over 0.6 s phases
    assert pc.trial_step_limit == pytest.approx(16.0)
    pc._last_time_s = pc._last_default_time_s = 0.3
    assert pc.evidence_scale == eerl.MAX_EVIDENCE_SCALE
    pc._last_default_time_s = 0.0
    assert pc.evidence_scale == 1.0
    pc._last_time_s, pc._last_default_time_s = 0.1, 0.1  # too short to slice: whole steps
    assert pc.evidence_scale == 1.0


def test_probe_evidence_says_which_and_why() -> None:
    pc = _pc()
    pc._last_time_s = 1.25
    assert pc.probe_evidence == "in-phase slices (progress exact)"
    pc.progress_gap_s = 0.02
    assert pc.probe_evidence == "in-phase slices (progress every 20 ms)"
    pc._last_time_s = 0.5
    pc.progress_gap_s = 0.2
    assert pc.probe_evidence == (
        "whole-phase: progress every 200 ms or more resolves fewer than 8 slices of a 0.500 s phase"
    )
    pc.progress_gap_s = math.inf
    assert pc.probe_evidence == (
        "whole-phase: no in-phase progress reports in the newest window, so trials alternate "
        "whole steps"
    )
    annotated = _pc(eerl.ControllerSettings(in_phase_probes=False))
    assert annotated.probe_evidence == (
        "whole-phase: phases arrive as pod annotations (phaseSource annotation), so trials "
        "alternate whole steps"
    )


# ----- the choice ---------------------------------------------------------------------------
def test_choose_the_most_efficient_clock_that_meets_the_target() -> None:
    pc = _fitted()
    assert _r(1680) > 0.952 > _r(1530)
    assert pc._choose() == (1680, pytest.approx(0.0, abs=1e-12))
    assert pc._choose(0.97)[0] == 1830
    assert pc._choose(0.99)[0] is None
    assert pc._choose(0.90)[0] == 1380  # e(1380) < e(1530) < e(1680)
    pc.floor_mhz = 1680
    assert pc._choose(0.90)[0] == 1830
    assert _pc()._choose() == (None, math.inf)  # no fit


def test_choose_without_power_prefers_the_lowest_clock_meeting_the_target() -> None:
    pc = _fitted()
    pc.blocks = [(c, thr, None) for c, thr, _ in pc.blocks]
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    assert pc.fit is not None and pc.fit.beta is None
    assert pc._choose()[0] == 1680  # clock / f_max as the score
    assert pc._choose(0.93)[0] == 1530


def test_lock_records_the_selection() -> None:
    pc = _fitted()
    pc._monitor.add(0.9, 0.9)
    pc.stage.steps, pc.stage.slowdowns = 5, 1
    pc._lock(1680, 150.0, slowdown=True)
    assert pc.state is base.PhaseState.LOCKED
    assert (pc.locked_clock_mhz, pc._previous_lock_mhz, pc.selections) == (1680, 1680, 1)
    assert pc.stage.feature == 150.0 and pc.stage.slowdown is True
    assert pc.stage.threshold == 0.95 and pc.stage.target == pytest.approx(0.952)
    assert pc._monitor.n == 0 and pc.stage.steps == 0 and pc.stage.slowdowns == 0


def test_estimate_by_state_monitor_and_fit() -> None:
    pc = _fitted()
    assert pc.estimate() == (None, None)  # not locked
    pc._lock(None, 150.0, slowdown=False)
    assert pc.estimate() == (1.0, 1.0)  # the default governor
    pc._lock(1680, 150.0, slowdown=False)
    thr, energy = pc.estimate()
    assert thr == pytest.approx(_r(1680)) and energy == pytest.approx(_p(1680) / _r(1680))
    for _ in range(2):
        pc._monitor.add(0.97, 0.8)
    assert pc.estimate()[0] == pytest.approx(_r(1680))  # 2 monitor blocks: not yet
    pc._monitor.add(0.97, 0.8)
    assert pc.estimate() == (pytest.approx(0.97), pytest.approx(0.8 / 0.97))
    pc.fit = None
    pc._monitor = probe.RatioStats()
    assert pc.estimate() == (None, None)


# ----- decisions outside trials ----------------------------------------------------------------
@pytest.mark.parametrize(
    "stage", [eerl.Observe(), eerl.Warmup(), eerl.Fallback()], ids=lambda s: s.state.value
)
def test_warmup_observe_and_fallback_run_the_default_governor(stage: eerl.Stage) -> None:
    pc = _fitted()
    pc.stage = stage
    state = stage.state
    assert pc.decide(True) == base.PhaseDecision(None, state, reason=state.value)


def test_a_locked_phase_without_a_clock_says_why() -> None:
    pc = _fitted()
    pc._lock(None, 150.0, slowdown=False)
    d = pc.decide(True)
    assert d == base.PhaseDecision(
        None, base.PhaseState.LOCKED, reason="no clock met the threshold"
    )
    pc._lock(1680, 150.0, slowdown=False)
    assert pc.decide(True).reason == "locked"


def test_monitor_checks_come_every_interval_at_the_lock() -> None:
    pc = _fitted(eerl.ControllerSettings(monitor_interval_steps=4))
    pc._last_time_s = 1.25
    pc._lock(1680, 150.0, slowdown=False)
    assert not pc._uncertain()
    seen = []
    for since in range(0, 9):
        pc.stage.steps = since
        d = pc.decide(True)
        seen.append(bool(d.probe_clocks_mhz))
        if d.probe_clocks_mhz:
            assert d.clock_mhz == 1680 and d.reason == "monitor 1680 MHz"
            assert d.probe_clocks_mhz == probe.block_schedule([1680]) + (1680,) * probe.BLOCK
            assert d.probe_slice_s == pytest.approx(1.25 / 48)
    assert seen == [False, False, False, False, True, False, False, False, True]
    pc.stage.steps = 4
    assert not pc.decide(False).probe_clocks_mhz  # no trial budget: no check


def test_lever_arm_checks_wait_while_the_run_owes_throughput() -> None:
    """An unsure lock checks twice as often, half of it at the lever-arm clock; a run that owes
    its threshold throughput (``repay_ratio`` above it) gets the plain check at the interval:
    on TinyZero / b200:batched-decode those checks (probed windows 22 % slower) left
    generation's whole run at 0.942 against 0.95 (``make bench-energy``, 2026-12-04)."""
    pc = _fitted(eerl.ControllerSettings(monitor_interval_steps=4))
    pc._last_time_s = 1.25
    pc.settings = _settings(ratio=0.90)
    pc.threshold = 0.90
    pc._lock(1830, 150.0, slowdown=False)
    assert pc._uncertain()
    pc.stage.steps = 2
    unsure = pc.decide(True)
    lever = pc._lever_clock()
    assert lever is not None and lever < 1830
    assert (
        unsure.probe_clocks_mhz
        == probe.block_schedule([lever, lever, 1830]) + (1830,) * probe.BLOCK
    )
    # A run 10 s of default time behind at 0.90 repays at 0.93 over the next 10 s.
    pc.ledger_default_s, pc.ledger_windows = 10.0, 400
    pc.ledger_actual_s = 20.0 / 0.90 - 10.0 / 0.93
    assert pc.repay_ratio == pytest.approx(0.93) and pc.repay_ratio > pc.threshold
    assert pc._uncertain()  # still unsure, but the run cannot pay for lever-arm slices
    assert not pc.decide(True).probe_clocks_mhz  # not due at 2 of 4
    pc.stage.steps = 4
    owed = pc.decide(True)
    assert owed.probe_clocks_mhz == probe.block_schedule([1830]) + (1830,) * probe.BLOCK


def test_an_idle_credit_moves_a_waiting_pool_to_the_clock_that_fills_its_wait() -> None:
    """A pool that does not set the async step time idles until the other ends: a lower clock
    fills that wait. With power ratio ``1 - 0.2 (1 - (c/f)**2)`` its own energy per token is
    lowest at 1530 MHz; an idle power of 0.3 of its default power moves the choice down to
    1230 MHz, whose ``e(c) - 0.3 / r(c)`` is the lowest of the clocks allowed."""
    pc = _fitted()
    pc.threshold = 0.80
    pc.fit = probe.CorrectedFit(_model(beta=0.2), (), 0.0, misfit=False)
    fit = pc.fit
    assert pc._choose()[0] == 1530
    assert min(CANDIDATES, key=lambda c: fit.energy_ratio(c) or 0.0) == 1530
    pc.idle_credit = 0.3
    assert pc._choose()[0] == 1230
    scores = {c: (fit.energy_ratio(c) or 0.0) - 0.3 / fit.throughput_ratio(c) for c in CANDIDATES}
    assert min(scores, key=lambda c: scores[c]) == 1230
    # A flat power saves nothing at any clock, but a wait to fill makes 1680 MHz worth it.
    pc.fit = probe.CorrectedFit(_model(beta=0.1), (), 0.0, misfit=False)
    pc.idle_credit = 0.0
    assert pc._choose()[0] is None
    pc.idle_credit = 0.3
    assert pc._choose()[0] == 1680


def test_the_async_controller_credits_only_the_pool_that_waits() -> None:
    """Idle power from the pools' idle (``StepObservation.pool_idle``) over the phase's default
    power: generation (1 s, 1000 J on 4 GPUs) waits 1 s a step for training (2 s) at 50 W a
    GPU, so its credit is 200 W / 1000 W; training sets the step time and gets none."""
    ctl = _async(0.95)
    for step in range(eerl.ASYNC_MIN_HISTORY):
        ctl.observe(
            base.StepObservation(
                step,
                WL,
                {
                    "generation": base.PhaseObservation("generation", 1.0, 1000.0, None, 1980),
                    "training": base.PhaseObservation("training", 2.0, 3000.0, None, 1980),
                },
                {
                    "generation": base.PoolIdle(200.0, 4.0, 4),
                    "training": base.PoolIdle(0.0, 0.0, 4),
                },
            )
        )
    ctl.decide(eerl.ASYNC_MIN_HISTORY)
    gen, train = ctl.phases["generation"], ctl.phases["training"]
    assert gen.idle_credit == pytest.approx(0.2)
    assert train.idle_credit == 0.0
    assert gen.threshold < 0.95  # the relaxed pool


# ----- the job-level controller ------------------------------------------------------------------
def test_trial_budget_is_a_fraction_of_at_least_forty_steps() -> None:
    ctl = eerl.EERLController([_settings()])
    ctl.trial_steps = 9
    assert ctl._trial_budget_left(0)  # 10 <= 0.25 x 40
    ctl.trial_steps = 10
    assert not ctl._trial_budget_left(0)
    assert not ctl._trial_budget_left(42)  # horizon 43: 10.75
    assert ctl._trial_budget_left(43)  # horizon 44: 11


def test_a_lost_phase_observation_and_an_agent_error_fall_back() -> None:
    ctl = eerl.EERLController([_settings(), _settings("training", 0.97)])
    for pc in ctl.phases.values():
        pc.stage = eerl.Locked(threshold=pc.threshold, target=pc.lock_target)
    obs = base.StepObservation(0, WL, {"generation": _default_obs()})
    ctl.observe(obs)
    assert ctl.steps_seen == 1
    assert ctl.phases["training"].state is base.PhaseState.FALLBACK
    assert ctl.phases["training"].retrial_reasons == ["error: no measurement (lost signal)"]
    assert ctl.phases["generation"].state is base.PhaseState.LOCKED
    ctl.report_error("generation", "nvml: GPU lost")
    assert ctl.phases["generation"].state is base.PhaseState.FALLBACK
    assert ctl.phases["generation"].retrial_reasons[-1] == "error: nvml: GPU lost"
    # Before any step: the error is booked against an empty workload.
    fresh = eerl.EERLController([_settings()])
    fresh.report_error("generation", "x")
    assert fresh.phases["generation"].state is base.PhaseState.FALLBACK


def test_observe_mode_keeps_observing_through_errors() -> None:
    pc = _pc(eerl.ControllerSettings(enforce=False))
    assert pc.state is base.PhaseState.OBSERVE
    pc.observe(base.PhaseObservation("generation", 0.0, None, None, error="x"), WL)
    assert pc.state is base.PhaseState.OBSERVE and pc.retrial_reasons == []


def test_summary_per_phase() -> None:
    ctl = eerl.EERLController([_settings()])
    pc = ctl.phases["generation"]
    pc.retrial_reasons.append("warm-up done")
    s = ctl.summary()["generation"]
    assert s == {
        "state": "warmup",
        "clock_mhz": None,
        "threshold": 0.95,
        "estimated_throughput_ratio": None,
        "estimated_energy_ratio": None,
        "selections": 0,
        "retrials": ["warm-up done"],
        "probe_evidence": pc.probe_evidence,
    }
    assert s["retrials"] is not pc.retrial_reasons  # a copy


def test_expected_ratio_of_a_pool() -> None:
    ctl = eerl.EERLController([_settings(), _settings("training", 0.97)])
    pc = ctl.phases["generation"]
    assert ctl._expected_ratio("generation") == 0.95  # not locked: its threshold
    fitted = _fitted()
    pc.fit, pc.blocks = fitted.fit, fitted.blocks
    pc._lock(None, 150.0, slowdown=False)
    assert ctl._expected_ratio("generation") == 1.0  # held at the default governor
    pc._lock(1680, 150.0, slowdown=False)
    assert ctl._expected_ratio("generation") == pytest.approx(_r(1680))
    pc._lock(1530, 150.0, slowdown=False)
    assert ctl._expected_ratio("generation") == 0.95  # never below the threshold
    pc.fit = None
    assert ctl._expected_ratio("generation") == 0.95


def test_pool_times_keep_plain_steps_only() -> None:
    ctl = _async(0.97)
    fitted = _fitted()
    ctl.phases["generation"].fit = fitted.fit
    gen_locked = base.PhaseObservation("generation", 2.0, 300.0, 1680, 1680)
    train = base.PhaseObservation("training", 1.5, 300.0, None, 1980)
    ctl._record_pool_times(
        base.StepObservation(0, WL, {"generation": gen_locked, "training": train})
    )
    assert ctl._pool_times == [{"generation": pytest.approx(2.0 * _r(1680)), "training": 1.5}]
    probe_step = base.PhaseObservation(
        "generation", 2.0, 300.0, None, slices=(base.ProbeSlice(None, 0.1, 1.0, 1.0),)
    )
    for skipped in (
        {"generation": probe_step, "training": train},
        {"generation": gen_locked},
        {
            "generation": gen_locked,
            "training": base.PhaseObservation("training", 1.5, None, None, error="x"),
        },
    ):
        ctl._record_pool_times(base.StepObservation(1, WL, skipped))
    assert len(ctl._pool_times) == 1
    ctl.phases["generation"].fit = None  # a locked clock without a fit: no default time known
    ctl._record_pool_times(
        base.StepObservation(2, WL, {"generation": gen_locked, "training": train})
    )
    assert len(ctl._pool_times) == 1
    ctl.phases["generation"].fit = fitted.fit
    for s in range(70):
        ctl._record_pool_times(
            base.StepObservation(s, WL, {"generation": train, "training": train})
        )
    assert len(ctl._pool_times) == 64  # the newest 64


# ----- direct evidence: verdicts, bracket, uncertainty -----------------------------------------
def _model(
    u_stderr: float = 0.0, beta: float | None = BETA, blocks: int = 6
) -> probe.PhaseModelFit:
    return probe.PhaseModelFit(U, u_stderr, beta, F_MAX, F_MAX, blocks)


def _with_measured(pc: eerl.PhaseController, *measured: probe.MeasuredClock) -> None:
    pc.fit = probe.CorrectedFit(_model(), tuple(measured), 0.0, misfit=False)


def test_verdict_of_a_clock_on_its_own_blocks() -> None:
    pc = _pc()
    assert pc._verdict(1680) is None  # no fit
    t2 = probe.student_t_factor(2, 1.5)  # 3 blocks
    cases = [
        (probe.MeasuredClock(1680, 3, 0.96, 0.001, None), True),  # 0.96 - 0.0033 >= 0.952
        (probe.MeasuredClock(1680, 3, 0.94, 0.001, None), False),  # 0.94 + 0.0033 < 0.952
        (probe.MeasuredClock(1680, 3, 0.953, 0.001, None), True),  # straddles, k <= 0.004: mean
        (probe.MeasuredClock(1680, 3, 0.951, 0.001, None), False),
        (probe.MeasuredClock(1680, 3, 0.953, 0.002, None), None),  # k = 0.0066: not yet
        (probe.MeasuredClock(1680, 2, 0.99, 0.0001, None), None),  # under min_blocks
        (probe.MeasuredClock(1680, 3, 0.99, math.inf, None), None),
        (probe.MeasuredClock(1680, 11, 0.953, 0.003, None), None),  # k = 0.0051, 11 blocks
        (probe.MeasuredClock(1680, 12, 0.953, 0.003, None), True),  # 4 x min_blocks: by mean
        (probe.MeasuredClock(1680, 12, 0.951, 0.003, None), False),
    ]
    assert t2 * 0.001 <= eerl.INDIFFERENCE < t2 * 0.002
    for m, want in cases:
        _with_measured(pc, m)
        assert pc._verdict(1680) is want, m
    assert pc._verdict(1530) is None  # not probed


def test_verdict_edges_are_inclusive() -> None:
    pc = _pc()
    k = probe.student_t_factor(2, 1.5) * 0.001
    target = 0.95 + eerl.LOCK_MARGIN
    _with_measured(pc, probe.MeasuredClock(1680, 3, target + k + 1e-12, 0.001, None))
    assert pc._verdict(1680) is True
    _with_measured(pc, probe.MeasuredClock(1680, 3, target, 0.001, None))
    assert pc._verdict(1680) is True  # straddling, k <= INDIFFERENCE: mean >= target


def test_bracket_from_the_decided_clocks() -> None:
    pc = _pc()
    assert pc.bracket() == (0, F_MAX)
    pc.floor_mhz = 1080
    _with_measured(
        pc,
        probe.MeasuredClock(1230, 3, 0.90, 0.001, None),  # miss
        probe.MeasuredClock(1380, 3, 0.93, 0.001, None),  # miss
        probe.MeasuredClock(1530, 3, 0.953, 0.002, None),  # undecided
        probe.MeasuredClock(1680, 3, 0.97, 0.001, None),  # meet
        probe.MeasuredClock(1830, 3, 0.99, 0.001, None),  # meet
    )
    assert pc.bracket() == (1380, 1680)


def test_uncertainty_cost_of_the_conservative_choice() -> None:
    pc = _pc()
    assert pc._uncertainty_cost() == 0.0  # no fit
    pc.fit = probe.CorrectedFit(_model(u_stderr=0.02), (), 0.0, misfit=False)
    pc.threshold = 0.96
    # point estimate: 1680 (r 0.9655); lower bound at 1680 0.959 < 0.962: the choice is 1830
    assert pc._choose()[0] == 1830
    want = _p(1830) / _r(1830) - _p(1680) / _r(1680)
    assert pc._uncertainty_cost() == pytest.approx(want)
    pc.threshold = 0.98  # only 1830's point meets it, and its lower bound does not
    assert pc._choose()[0] is None
    assert pc._uncertainty_cost() == pytest.approx(1.0 - _p(1830) / _r(1830))
    pc.threshold = 0.99  # no clock's point estimate meets it
    assert pc._uncertainty_cost() == 0.0
    pc.threshold = 0.96
    pc.fit = probe.CorrectedFit(_model(u_stderr=0.02, beta=None), (), 0.0, misfit=False)
    assert pc._uncertainty_cost() == 0.0  # no power measured


def test_uncertain_while_the_point_estimate_allows_lower_clocks() -> None:
    pc = _fitted()
    pc.threshold = 0.90
    pc.locked_clock_mhz = 1830
    assert pc._uncertain()  # 1680, 1530, 1380 all >= 0.904
    pc.locked_clock_mhz = 1530
    assert pc._uncertain()  # 1380 only, and it saves 5 % more
    pc.locked_clock_mhz = 1380
    assert not pc._uncertain()  # 1230's 0.891 < 0.904
    pc.locked_clock_mhz = None
    assert not pc._uncertain()
    pc.fit = probe.CorrectedFit(_model(beta=None), (), 0.0, misfit=False)
    pc.locked_clock_mhz = 1830
    assert pc._uncertain()  # three lower clocks, with or without power
    pc.threshold = 0.93
    assert not pc._uncertain()  # two lower clocks, and no energy ratio to weigh them
    pc.fit = None
    assert not pc._uncertain()


def test_uncertain_weighs_the_energy_gain_of_one_or_two_lower_clocks() -> None:
    pc = _fitted()
    pc.threshold = 0.91
    pc.locked_clock_mhz = 1680  # lower: 1530, 1380 (two)
    assert _p(1680) / _r(1680) - _p(1380) / _r(1380) >= eerl.MONITOR_GAIN
    assert pc._uncertain()
    # A nearly flat energy curve: the gain is below MONITOR_GAIN.
    pc.fit = probe.CorrectedFit(_model(beta=0.05), (), 0.0, misfit=False)
    assert not pc._uncertain()


# ----- the job-level plan ----------------------------------------------------------------------
def test_controller_starts_empty() -> None:
    ctl = eerl.EERLController([_settings()])
    assert ctl.settings == eerl.ControllerSettings()
    assert (ctl.trial_steps, ctl.steps_seen, ctl._pool_times) == (0, 0, [])
    assert ctl._last_workload is None
    ctl.observe(base.StepObservation(0, WL, {"generation": _default_obs()}))
    assert ctl._last_workload is WL
    assert ctl._pool_times == []  # sync mode keeps no pool times


def test_a_probing_plan_spends_one_trial_step() -> None:
    ctl = eerl.EERLController([_settings(), _settings("training", 0.97)])
    gen = ctl.phases["generation"]
    fitted = _fitted()
    gen.stage, gen.blocks, gen.fit = eerl.Trial(), fitted.blocks, fitted.fit
    gen._last_time_s = gen._last_default_time_s = 1.25
    plan = ctl.decide(0)
    assert plan.step == 0
    assert plan.phases["generation"].probing and not plan.phases["training"].probing
    assert plan.phases["training"].state is base.PhaseState.WARMUP
    assert ctl.trial_steps == 1
    ctl.trial_steps = 10  # the budget of the first 40 steps is spent
    plan = ctl.decide(1)
    assert not plan.phases["generation"].probing
    assert plan.phases["generation"].reason == "trial budget spent: interim clock"
    assert ctl.trial_steps == 10
    gen.stage = eerl.Warmup()
    ctl.trial_steps = 0
    ctl.decide(2)
    assert ctl.trial_steps == 0  # nothing probed


def test_async_thresholds_relax_the_faster_pool() -> None:
    ctl = _async(0.95)
    gen, train = ctl.phases["generation"], ctl.phases["training"]
    gen.floor_mhz = 1530
    ctl._pool_times = [{"generation": 1.0, "training": 2.0}] * 7
    ctl._update_async_thresholds()
    assert (gen.threshold, train.threshold) == (0.95, 0.95)  # 7 steps: too little history
    ctl._pool_times.append({"generation": 1.0, "training": 2.0})
    ctl.decide(8)  # async mode updates the thresholds before it plans
    assert train.threshold == pytest.approx(0.95 + eerl.ASYNC_SLACK / 10)
    # 8 x 2.0 / sum(max(1.0 / r, 2.0 / 0.955)) >= 0.95 + 0.002 from r = 0.48 on
    assert gen.threshold == pytest.approx(0.48)
    assert gen.floor_mhz == 0  # floors were measured against the stricter threshold


def test_async_thresholds_of_balanced_pools_stay() -> None:
    ctl = _async(0.95)
    gen, train = ctl.phases["generation"], ctl.phases["training"]
    train.floor_mhz = 1380
    ctl._pool_times = [{"generation": 2.0, "training": 2.0}] * 8
    ctl._update_async_thresholds()
    assert gen.threshold == pytest.approx(0.955)  # the first of equal pools is the bottleneck
    assert train.threshold == 0.95  # r = 0.96 is the first to pass: the threshold stays
    assert train.floor_mhz == 1380


# ----- trial decisions -------------------------------------------------------------------------
def _trial(last_time_s: float = 1.25) -> eerl.PhaseController:
    pc = _fitted()
    pc._last_time_s = pc._last_default_time_s = last_time_s
    return pc


def test_a_trial_first_checks_the_guess_of_carried_blocks_then_the_lever() -> None:
    pc = _trial()
    d = pc.decide(True)
    assert d == base.PhaseDecision(
        None,
        base.PhaseState.TRIAL,
        probe_clocks_mhz=probe.block_schedule([1680]),
        probe_slice_s=pytest.approx(1.25 / 48),
        reason="trial 1680 MHz vs default",
    )
    pc.stage.round_steps = 1.0
    assert pc._lever_clock() == 1080  # r(1080) = 0.857 >= PROBE_MIN_RATIO
    assert pc.decide(True).probe_clocks_mhz == probe.block_schedule([1080])
    assert pc.decide(True).reason == "trial 1080 MHz vs default"


def test_a_trial_without_budget_runs_the_interim_clock() -> None:
    pc = _trial()
    d = pc.decide(False)
    assert d == base.PhaseDecision(
        1680, base.PhaseState.TRIAL, reason="trial budget spent: interim clock"
    )
    pc.fit = None
    pc._previous_lock_mhz = 1530
    assert pc.decide(False).clock_mhz == 1530  # no fit yet: the previous lock
    pc.floor_mhz = 1980  # nothing left to probe: also the interim clock
    pc.fit = _fitted().fit
    assert pc.decide(True).reason == "trial budget spent: interim clock"


def test_an_extended_trial_without_budget_locks_the_safest_choice() -> None:
    pc = _trial()
    pc.stage.round_steps = pc.trial_step_limit
    assert pc.decide(True, allow_extra=True).probe_clocks_mhz  # may extend: probes on
    d = pc.decide(True, allow_extra=False)
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz == 1680
    assert d.clock_mhz == 1680 and d.state is base.PhaseState.LOCKED and d.reason == "locked"
    assert pc.selections == 1


def test_a_phase_too_short_to_slice_trials_whole_steps() -> None:
    pc = _trial(last_time_s=0.1)
    assert pc._slices_in_phase() == 0
    d = pc.decide(True)
    schedule = probe.block_schedule([1680])
    assert d == base.PhaseDecision(
        schedule[0], base.PhaseState.TRIAL, reason="step trial 1680 MHz", step_probe=True
    )
    assert pc.stage.step_probe == list(schedule) and pc.stage.step_probe_clock == 1680
    pc.stage.step_probe.pop(0)
    d = pc.decide(True)
    assert d == base.PhaseDecision(
        schedule[1], base.PhaseState.TRIAL, reason="step trial 1680 MHz", step_probe=True
    )


def test_a_monitor_check_while_unsure_probes_the_lever_twice() -> None:
    pc = _trial()
    pc.threshold = 0.90
    pc._lock(1830, 150.0, slowdown=False)
    assert pc._uncertain()
    pc.stage.steps = 5  # half of monitor_interval_steps while unsure
    d = pc.decide(True)
    lever = pc._lever_clock()
    assert lever == 1080
    assert d.probe_clocks_mhz == probe.block_schedule([1080, 1080, 1830]) + (1830,) * 8
    assert d.clock_mhz == 1830 and d.reason == "monitor 1830 MHz"
    pc.stage.steps = 4
    assert not pc.decide(True).probe_clocks_mhz
    pc._last_time_s = 0.1  # no slices fit: no in-phase check
    pc.stage.steps = 5
    assert not pc.decide(True).probe_clocks_mhz


def test_lever_clock_is_the_lowest_candidate_the_fit_keeps_above_the_probe_minimum() -> None:
    pc = _pc()
    assert pc._lever_clock() == 1080  # no fit: the lowest allowed clock
    pc.fit = probe.CorrectedFit(
        probe.PhaseModelFit(0.5, 0.0, BETA, F_MAX, F_MAX, 6), (), 0.0, misfit=False
    )
    # u = 0.5: r(1530) = 1 / (0.5 x 0.294 + 1) = 0.872, r(1380) = 0.821
    assert pc._lever_clock() == 1080  # never above the lowest allowed clock
    pc.floor_mhz = 1680  # allowed: 1830 only
    assert pc._lever_clock() == 1530  # below the floor: probing still sharpens the fit
    pc.floor_mhz = 1830  # nothing allowed
    assert pc._lever_clock() == 1530
    pc.fit = probe.CorrectedFit(
        probe.PhaseModelFit(1.0, 0.0, BETA, F_MAX, F_MAX, 6), (), 0.0, misfit=False
    )
    pc.floor_mhz = 0
    pc.default_clock_mhz = 1680  # only candidates below the default clock count
    assert pc._lever_clock() == 1080  # none reaches 0.85 (u = 1: r(1530) = 0.77)
    pc.floor_mhz = 1530  # allowed: none between 1530 and 1680
    assert pc._lever_clock() is None


# ----- observations ----------------------------------------------------------------------------
def test_warm_up_fits_the_default_model_and_reads_the_default_clock() -> None:
    pc = _pc()
    pc.observe(base.PhaseObservation("generation", 1.2, 360.0, None, 1755), WL)
    assert pc.state is base.PhaseState.WARMUP and pc.default_clock_mhz == 1755
    pc.observe(base.PhaseObservation("generation", 1.3, 380.0, None, 1740), WL)
    assert pc.state is base.PhaseState.TRIAL
    assert pc.retrial_reasons == ["warm-up done"]
    assert pc.default_clock_mhz == 1755  # the highest read back
    assert pc._last_time_s == 1.3 and pc._last_default_time_s == 1.3
    assert pc._last_feature == 150.0


def test_an_error_falls_back_and_clean_steps_recover() -> None:
    pc = _trial()
    pc.observe(base.PhaseObservation("generation", 1.0, None, 1680, error="nvml: timeout"), WL)
    assert pc.state is base.PhaseState.FALLBACK
    assert pc.retrial_reasons == ["error: nvml: timeout"]
    assert pc._last_time_s == 1.25  # the window with the error is not used
    pc.observe(_default_obs(), WL)
    assert pc.state is base.PhaseState.FALLBACK  # one clean step of recovery_steps = 2
    pc.observe(base.PhaseObservation("generation", 1.0, None, None, error="again"), WL)
    pc.observe(_default_obs(), WL)
    assert pc.state is base.PhaseState.FALLBACK  # the count restarted
    pc.observe(_default_obs(), WL)
    assert pc.state is base.PhaseState.TRIAL
    assert pc.retrial_reasons[-1] == "recovered from error"
    assert pc.floor_mhz == 0 and pc.blocks == []


def test_default_windows_feed_the_default_model_only() -> None:
    pc = _pc()
    pc.observe(base.PhaseObservation("generation", 1.2, 360.0, 1680, 1680), WL)
    assert pc.default_clock_mhz is None  # a locked window is no default-governor evidence
    sliced = base.PhaseObservation(
        "generation", 1.2, 360.0, None, 1980, slices=(base.ProbeSlice(None, 0.1, 1.0, 1.0),)
    )
    pc.observe(sliced, WL)
    assert pc.default_clock_mhz is None
    assert not pc.default_model.ready


def test_locked_monitor_blocks_feed_the_monitor_at_the_lock_only() -> None:
    pc = _trial()
    pc._lock(1680, 150.0, slowdown=False)
    n = len(pc.blocks)
    slices = (*_block(1680), *_block(1080))
    pc.observe(base.PhaseObservation("generation", 1.25, 300.0, 1680, slices=slices), WL)
    assert pc.stage.steps == 1
    assert len(pc.blocks) == n + 2
    assert pc._monitor.n == 1 and pc._monitor.throughput_mean == pytest.approx(_r(1680))


def test_slices_the_reports_cannot_resolve_give_no_blocks() -> None:
    pc = _trial()
    slices = tuple(base.ProbeSlice(c, 0.025, 2.5, 7.5) for c in probe.block_schedule([1680]))
    ok = base.PhaseObservation("generation", 0.2, 60.0, None, slices=slices, progress_gap_s=0.006)
    assert len(pc._blocks(ok, 100.0)) == 1  # 4 x 6 ms <= 25 ms
    late = base.PhaseObservation("generation", 0.2, 60.0, None, slices=slices, progress_gap_s=0.007)
    assert pc._blocks(late, 100.0) == []  # 4 x 7 ms > 25 ms


def test_whole_step_probes_make_a_block_over_eight_steps() -> None:
    pc = _pc()
    pc.stage = eerl.Trial()
    pc._last_time_s = pc._last_default_time_s = 0.1
    assert pc.decide(True).reason == "step trial 1830 MHz"  # no fit: the highest candidate
    schedule = list(pc.stage.step_probe)
    assert len(schedule) == probe.BLOCK
    for i, clock in enumerate(schedule):
        rate = _r(1830) if clock else 1.0
        power = _p(1830) if clock else 1.0
        obs = base.PhaseObservation("generation", 0.1 / rate, 30.0 * power / rate, clock)
        pc.observe(obs, WL)
        assert pc.stage.round_steps == pytest.approx((i + 1) / probe.BLOCK)
    assert pc.stage.step_probe == [] and pc.stage.pending == []
    assert pc.stats[1830].n == 1
    assert pc.stats[1830].throughput_mean == pytest.approx(_r(1830))
    assert pc.blocks == [(1830, pytest.approx(_r(1830)), pytest.approx(_p(1830)))]
    assert pc.state is base.PhaseState.TRIAL and pc.fit is None  # one block: no fit yet


# ----- the default governor's equivalent of a window --------------------------------------------
def test_default_equivalent_of_default_and_failed_windows() -> None:
    pc = _fitted()
    assert pc.default_equivalent(_default_obs(1.2, 360.0), WL) == (360.0, 1.2)
    assert pc.default_equivalent(_default_obs(1.2, 360.0), WL).time_s == 1.2  # named fields
    assert pc.default_equivalent(_default_obs(1.2, None), WL) == (None, 1.2)  # type: ignore[arg-type]
    failed = base.PhaseObservation("generation", 1.2, 360.0, None, error="x")
    assert pc.default_equivalent(failed, WL) == (None, None)
    assert pc._default_time_s(_default_obs(1.2, 360.0), WL) == 1.2


def test_default_equivalent_of_a_locked_window_from_the_fit_at_the_clock_it_ran() -> None:
    pc = _fitted()
    locked = base.PhaseObservation("generation", 2.0, 400.0, 1680, 1680)
    e, t = pc.default_equivalent(locked, WL)
    assert e == pytest.approx(400.0 * _r(1680) / _p(1680))
    assert t == pytest.approx(2.0 * _r(1680))
    assert pc._default_time_s(locked, WL) == pytest.approx(2.0 * _r(1680))
    capped = base.PhaseObservation("generation", 2.0, 400.0, 1680, 1500)  # a cap held it
    e, t = pc.default_equivalent(capped, WL)
    assert t == pytest.approx(2.0 * _r(1500)) and e == pytest.approx(400.0 * _r(1500) / _p(1500))


def test_default_equivalent_falls_back_to_the_token_model() -> None:
    pc = _pc()
    locked = base.PhaseObservation("generation", 2.0, 400.0, 1680, 1680)
    assert pc.default_equivalent(locked, WL) == (None, None)  # nothing known yet
    assert pc._default_time_s(locked, WL) == 2.0  # then the window's own time
    pc.default_model.add(WL.phase_tokens("generation"), 1.5, 450.0)
    assert pc.default_equivalent(locked, WL) == (pytest.approx(450.0), pytest.approx(1.5))
    fitted = _fitted()
    pc.fit = fitted.fit
    no_energy = base.PhaseObservation("generation", 2.0, None, 1680, 1680)
    assert pc.default_equivalent(no_energy, WL) == (pytest.approx(450.0), pytest.approx(1.5))
    pc.fit = probe.CorrectedFit(_model(beta=None), (), 0.0, misfit=False)  # no power: no ratio
    assert pc.default_equivalent(locked, WL) == (pytest.approx(450.0), pytest.approx(1.5))


def test_default_equivalent_of_a_probe_window_from_its_paired_default_slices() -> None:
    pc = _fitted()
    obs = base.PhaseObservation("generation", 0.4, 120.0, None, slices=_block(1680))
    e, t = pc.default_equivalent(obs, WL)
    # default slices: 0.1 s for 10 tokens; candidate slices did 10 r tokens more
    assert t == pytest.approx(0.4 * 0.1 * (1 + _r(1680)) / 0.2)
    assert e == pytest.approx(120.0 * 30.0 * (1 + _r(1680)) / (30.0 * (1 + _p(1680))))
    assert pc._default_time_s(obs, WL) == pytest.approx(t)


def test_default_equivalent_of_a_probe_window_without_slice_energy_uses_the_fit() -> None:
    pc = _fitted()
    slices = list(_block(1680))
    slices[0] = dataclasses.replace(slices[0], energy_j=None)
    obs = base.PhaseObservation("generation", 0.4, 120.0, None, slices=tuple(slices))
    e, t = pc.default_equivalent(obs, WL)
    e_ratio = _p(1680) / _r(1680)
    assert t == pytest.approx(0.1 * (1 + _r(1680)) * 0.4 / 0.2)
    assert e == pytest.approx(120.0 / ((0.1 * e_ratio + 0.1) / 0.2))
    # The same window credited at the clock a cap held the candidate slices to.
    capped = [
        dataclasses.replace(s, effective_clock_mhz=1500) if s.clock_mhz else s for s in slices
    ]
    obs = base.PhaseObservation("generation", 0.4, 120.0, None, slices=tuple(capped))
    _, t = pc.default_equivalent(obs, WL)
    assert t == pytest.approx(0.1 * (1 + _r(1500)) * 0.4 / 0.2)


def test_default_equivalent_of_a_probe_window_without_energy_is_the_token_model() -> None:
    pc = _fitted()
    obs = base.PhaseObservation("generation", 0.4, None, None, slices=_block(1680))
    assert pc.default_equivalent(obs, WL) == (None, None)  # no default model yet
    pc.default_model.add(WL.phase_tokens("generation"), 0.3, 90.0)
    assert pc.default_equivalent(obs, WL) == (pytest.approx(90.0), pytest.approx(0.3))


# ----- model check and bracketing search -------------------------------------------------------
def _misfit(pc: eerl.PhaseController, *measured: probe.MeasuredClock) -> None:
    """A misfitted corrected fit whose corrected curve is exact (no model error, no spread):
    the model plus the measured residuals, interpolated in clock (0 at the default clock)."""
    pc.fit = probe.CorrectedFit(_model(), tuple(measured), 1.0, misfit=True)


def test_search_probes_the_middle_of_the_bracket() -> None:
    pc = _pc()
    assert pc._search_clock() is None  # no fit
    _with_measured(pc, probe.MeasuredClock(1230, 3, 0.80, 0.0, None))
    assert pc._search_clock() is None  # the model fits: no search
    _misfit(
        pc,
        probe.MeasuredClock(1230, 3, 0.80, 0.0, None),  # miss
        probe.MeasuredClock(1830, 3, 0.99, 0.0, None),  # meet
    )
    assert pc.bracket() == (1230, 1830)
    # corrected r(1680) = r(1680) + 0.25 (0.80 - r(1230)) + 0.75 (0.99 - r(1830)) = 0.947:
    # no inside clock meets 0.952, so bisect: 1530
    assert pc.fit.throughput_ratio(1680) == pytest.approx(0.9473, abs=1e-4)
    assert pc._search_clock() == 1530


def test_search_takes_the_predicted_clock_inside_the_middle_half() -> None:
    pc = _pc()
    _misfit(
        pc,
        probe.MeasuredClock(1230, 3, 0.80, 0.0, None),
        probe.MeasuredClock(1830, 3, 1.00, 0.0, None),
    )
    # corrected r(1680) = 0.9548 >= 0.952, and 1680 = 1830 - (1830 - 1230) / 4: inside
    assert pc.fit.throughput_ratio(1680) == pytest.approx(0.9548, abs=1e-4)
    assert pc._search_clock() == 1680
    pc.floor_mhz = 1380  # bracket (1380, 1830): the middle half is 1492..1717
    assert pc._search_clock() == 1680
    pc.floor_mhz = 1530  # bracket (1530, 1830): 1605..1755 -> still 1680
    assert pc._search_clock() == 1680


def test_search_keeps_probing_an_undecided_clock_and_stops_on_a_closed_bracket() -> None:
    pc = _pc()
    _misfit(
        pc,
        probe.MeasuredClock(1230, 3, 0.80, 0.0, None),
        probe.MeasuredClock(1380, 4, 0.953, 0.003, None),  # undecided
        probe.MeasuredClock(1530, 3, 0.953, 0.003, None),  # undecided, fewer blocks
        probe.MeasuredClock(1830, 3, 0.99, 0.0, None),
    )
    assert pc._search_clock() == 1380
    _misfit(
        pc,
        probe.MeasuredClock(1680, 3, 0.90, 0.0, None),
        probe.MeasuredClock(1830, 3, 0.99, 0.0, None),
    )
    assert pc.bracket() == (1680, 1830)
    assert pc._search_clock() is None  # no clock between the two
    pc.floor_mhz = 1830
    assert pc.bracket() == (1830, 1830)
    assert pc._search_clock() is None


def test_model_check_tests_the_curve_halfway_to_the_choice() -> None:
    pc = _pc()
    assert pc._model_check_clock() is None  # no fit
    pc.blocks = _exact_blocks(1080)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    assert pc._choose()[0] == 1680
    assert pc._model_check_clock() == 1380  # halfway between 1080 and 1680
    pc.blocks = _exact_blocks(1080) + _exact_blocks(1230, n=2)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    assert pc._model_check_clock() == 1380  # 1230 has too few blocks to count
    pc.blocks = _exact_blocks(1080, 1230)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    assert pc._model_check_clock() is None  # two clocks a quarter of the span apart: tested
    pc.blocks = _exact_blocks(1080)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    pc.threshold = 0.99  # no choice: up to the default clock, 1530 halfway
    assert pc._model_check_clock() == 1530
    pc.fit = dataclasses.replace(pc.fit, misfit=True)
    assert pc._model_check_clock() is None  # misfitted: the search's job


def test_model_check_needs_a_clock_between() -> None:
    pc = _pc()
    pc.blocks = _exact_blocks(1080)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    pc.floor_mhz = 1530  # allowed: 1830, 1680; the choice 1680; nothing inside (1080, 1680)
    assert [c for c in pc._allowed() if 1080 < c < 1680] == []
    assert pc._model_check_clock() is None
    pc.fit = probe.fit_corrected([(1080, _r(1080), _p(1080))] * 2, F_MAX, F_MAX)
    pc.floor_mhz = 0
    assert pc._model_check_clock() is None  # 2 blocks: no clock decided yet


# ----- a locked phase's checks -----------------------------------------------------------------
def _locked_at(clock: int | None) -> eerl.PhaseController:
    pc = _trial()
    pc._lock(clock, 150.0, slowdown=False)
    return pc


def _plain(clock: int | None = 1680, **kw: object) -> base.PhaseObservation:
    return base.PhaseObservation("generation", 1.25, 300.0, clock, clock, **kw)  # type: ignore[arg-type]


def test_a_lock_its_monitor_blocks_prove_with_no_step_below_is_settled() -> None:
    """``_settled``: 12 monitor blocks at 1680 MHz (0.9655 +- 0.002) clear the 0.952 target,
    and 1530 MHz (0.9444) is below it: checks may be spaced out. Fewer blocks, blocks whose
    bound misses the target, or a lock with a clock below it that the fit puts at the target
    (1830 MHz over 1680 MHz) are not."""
    pc = _locked_at(1680)
    for i in range(eerl.SETTLED_MIN_BLOCKS - 1):
        pc._monitor.add(_r(1680) + (0.002 if i % 2 else -0.002), _p(1680))
    assert not pc._settled()  # 11 blocks
    pc._monitor.add(_r(1680), _p(1680))
    assert pc._settled()
    high = _locked_at(1830)
    for i in range(eerl.SETTLED_MIN_BLOCKS):
        high._monitor.add(_r(1830) + (0.002 if i % 2 else -0.002), _p(1830))
    assert not high._settled()  # 1680 MHz may still be proven
    near = _locked_at(1680)
    for i in range(eerl.SETTLED_MIN_BLOCKS):
        near._monitor.add(0.953 + (0.01 if i % 2 else -0.01), _p(1680))
    assert not near._settled()  # the bound is under 0.952


def test_a_phase_held_at_default_locks_once_a_clock_meets_the_target() -> None:
    pc = _locked_at(None)
    pc._check_locked(_plain(None), WL)
    assert pc.locked_clock_mhz == 1680 and pc.selections == 2
    assert pc.retrial_reasons[-1] == "target 0.952: default governor -> 1680 MHz"
    assert pc.stage.target == pytest.approx(0.952)
    held = _locked_at(None)
    held.threshold = held.stage.threshold = 0.99  # no clock meets it: stays at default
    held._check_locked(_plain(None), WL)
    assert held.locked_clock_mhz is None and held.selections == 1


def test_a_risen_threshold_steps_the_lock_up() -> None:
    pc = _locked_at(1680)
    pc.threshold = 0.97  # the async slack shrank
    pc._check_locked(_plain(), WL)
    assert pc.locked_clock_mhz == 1830 and pc.selections == 2
    assert pc.retrial_reasons[-1] == "target 0.972 (threshold 0.970): 1680 -> 1830 MHz"
    assert pc.stage.threshold == 0.97 and pc.stage.target == pytest.approx(0.972)


def test_a_grown_deficit_steps_up_only_to_a_clock_that_repays_it() -> None:
    pc = _locked_at(1680)
    _owe(pc, repay=0.97)  # repay ratio 0.97
    assert pc.lock_target == pytest.approx(0.972, abs=1e-4)
    pc._check_locked(_plain(), WL)
    assert pc.locked_clock_mhz == 1830
    assert pc.retrial_reasons[-1].endswith("(threshold 0.950): 1680 -> 1830 MHz")
    short = _locked_at(1680)
    _owe(short, repay=0.99)  # 0.99: no clock repays it
    target = short.lock_target
    short._check_locked(_plain(), WL)
    assert short.locked_clock_mhz == 1680 and short.selections == 1  # the lock stays
    assert short.stage.target == pytest.approx(target)


def test_a_lock_target_that_falls_is_remembered() -> None:
    pc = _locked_at(1680)
    pc.stage.target = 0.99
    pc._check_locked(_plain(), WL)
    assert pc.stage.target == pytest.approx(0.952)
    assert pc.locked_clock_mhz == 1680


def test_a_relaxed_pool_refines_its_lock_down() -> None:
    pc = _locked_at(1680)
    pc.threshold = 0.90
    pc._check_locked(_plain(), WL)
    assert pc.locked_clock_mhz == 1380  # r(1380) = 0.920 >= 0.902, r(1230) = 0.891 is not
    assert pc.retrial_reasons[-1] == "refined 1680 -> 1380 MHz"


def test_refine_starts_a_search_below_the_lock_when_the_model_misfits() -> None:
    pc = _locked_at(1830)
    # 1530 runs 2 % below the model the 1080 blocks fit: a knee; the search's next clock
    # is 1680, below the lock
    pc.blocks = [(1080, _r(1080), _p(1080))] * 20 + [(1530, 0.93, _p(1530))] * 3
    pc.floor_mhz = 1080
    pc._refine_locked()
    assert pc.fit is not None and pc.fit.misfit
    assert pc.state is base.PhaseState.TRIAL
    assert pc.retrial_reasons[-1] == "model misfit: search below 1830 MHz"
    assert pc.floor_mhz == 1080 and len(pc.blocks) == 23  # floor and every block kept
    assert pc._search_clock() == 1680


def test_a_workload_drift_retrials_with_the_newest_blocks() -> None:
    pc = _locked_at(1680)
    pc.blocks = _exact_blocks(1080, 1380, n=10)
    drifted = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 200.0)
    pc._check_locked(_plain(), drifted)
    assert pc.state is base.PhaseState.TRIAL
    assert pc.retrial_reasons[-1] == "workload drift +33%"
    assert pc.blocks == _exact_blocks(1080, 1380, n=10)[-eerl.CARRY_BLOCKS :]
    assert pc.fit is not None
    within = _locked_at(1680)
    within._check_locked(_plain(), api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 187.0))
    assert within.state is base.PhaseState.LOCKED  # +24.7 %: under drift_threshold


def test_drift_is_measured_against_the_features_the_trials_spanned() -> None:
    """A workload the trial round already spanned is no drift (a trace replayed in cycles
    swings its context length past the threshold at every wrap); past that range it is."""
    mean_context = 150.0  # WL's; the lock's step

    def check(context: float) -> eerl.PhaseController:
        pc = _locked_at(1680)
        pc._trial_features = (120.0, 190.0)  # the trial steps' mean context lengths
        pc._check_locked(_plain(), api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, context))
        return pc

    assert _locked_at(1680).stage.feature == mean_context
    assert check(230.0).state is base.PhaseState.LOCKED  # +53 % on the lock, +21 % on 190
    assert check(95.0).state is base.PhaseState.LOCKED  # -37 % on the lock, -21 % on 120
    up = check(240.0)  # +26 % on 190
    assert up.state is base.PhaseState.TRIAL and up.retrial_reasons[-1] == "workload drift +26%"
    down = check(89.0)  # -26 % on 120
    assert down.retrial_reasons[-1] == "workload drift -26%"
    # The range is that of the round: a re-trial without carried blocks forgets it, a drift
    # re-trial (its blocks carried) keeps it, and trial steps widen it.
    assert up._trial_features == (120.0, 190.0)
    up._retrial("test")
    assert up._trial_features is None
    pc = _warm()
    for context in (140.0, 110.0):
        pc.observe(
            base.PhaseObservation("generation", 1.25, 300.0, None, slices=()),
            api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, context),
        )
    assert pc._trial_features == (110.0, 140.0)


# ----- a trial round's end --------------------------------------------------------------------
def _slices_obs(*clocks: int, ratio: dict[int, float] | None = None) -> base.PhaseObservation:
    out = [s for clock in clocks for s in _block(clock, rate=(ratio or {}).get(clock))]
    return base.PhaseObservation("generation", 1.25, 300.0, None, slices=tuple(out))


def _warm() -> eerl.PhaseController:
    pc = _pc()
    for _ in range(2):
        pc.observe(base.PhaseObservation("generation", 1.25, 375.0, None, 1980), WL)
    assert pc.state is base.PhaseState.TRIAL
    return pc


def test_a_trial_locks_once_the_choice_is_precise_and_the_model_tested() -> None:
    pc = _warm()
    pc.observe(_slices_obs(1080, 1080, 1080), WL)
    assert pc.round_steps == 1.0 and pc.state is base.PhaseState.TRIAL
    assert pc._model_check_clock() == 1380  # exact, but the shape between is untested
    pc.observe(_slices_obs(1380, 1380, 1380), WL)
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz == 1680
    assert pc.round_steps == 2.0


def test_clearly_missing_clocks_raise_the_floor() -> None:
    pc = _warm()
    pc.observe(_slices_obs(1080, 1080, 1080, ratio={1080: 0.80}), WL)
    assert pc.floor_mhz == 1080
    assert pc.stats[1080].n == 3


def test_no_clock_left_locks_the_default_governor() -> None:
    pc = _warm()
    pc.floor_mhz = 1680
    low = {c: 0.5 for c in (1830,)}
    pc.observe(_slices_obs(1830, 1830, 1830, ratio=low), WL)
    assert pc.floor_mhz == 1830
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz is None


def test_a_round_without_a_fit_ends_at_the_default_governor_after_its_steps() -> None:
    pc = _warm()
    pc.stage.round_steps = 3 * pc.trial_step_limit
    one = _slices_obs(1080)
    pc.observe(dataclasses.replace(one, slices=one.slices[:8]), WL)
    assert pc.fit is None  # one block: no fit
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz is None


# ----- written against the first control-freq-eerl survivors ----------------------------------
def test_search_prefers_an_undecided_clock_inside_the_bracket_to_bisection() -> None:
    pc = _pc()
    _misfit(
        pc,
        probe.MeasuredClock(1080, 5, 0.953, 0.003, None),  # undecided, below the bracket
        probe.MeasuredClock(1230, 3, 0.80, 0.0, None),
        probe.MeasuredClock(1680, 3, 0.953, 0.003, None),  # undecided, inside
        probe.MeasuredClock(1830, 3, 0.99, 0.0, None),
    )
    assert pc.bracket() == (1230, 1830)
    assert pc._search_clock() == 1680  # not the bisection's 1530, nor 1080 outside


def test_search_meets_the_lock_target_not_less() -> None:
    pc = _pc()
    _misfit(
        pc,
        probe.MeasuredClock(1230, 3, 0.80, 0.0, None),
        probe.MeasuredClock(1830, 3, 0.9936, 0.0, None),
    )
    # corrected r(1680) = 0.950: above the threshold, below threshold + LOCK_MARGIN
    assert 0.95 - eerl.LOCK_MARGIN < pc.fit.throughput_ratio(1680) < 0.95 + eerl.LOCK_MARGIN
    assert pc._search_clock() == 1530


def test_search_bisects_when_the_predicted_clock_lies_in_the_top_quarter() -> None:
    pc = _pc()
    _misfit(pc, probe.MeasuredClock(1230, 3, 0.80, 0.0, None))
    # bracket (1230, 1980): r(1830) = 0.966 meets, r(1680) = 0.929 does not; 1830 lies above
    # 1980 - 750 / 4: bisect at 1605 -> 1680 (the first of the two nearest)
    assert pc.bracket() == (1230, F_MAX)
    assert pc.fit.throughput_ratio(1830) >= 0.952 > pc.fit.throughput_ratio(1680)
    assert pc._search_clock() == 1680


def test_verdict_uses_the_degrees_of_freedom_of_its_blocks() -> None:
    pc = _pc()
    # 3 blocks: t(2) x 0.0015 = 0.0049 > INDIFFERENCE (undecided); t(3) would give 0.0037
    _with_measured(pc, probe.MeasuredClock(1680, 3, 0.9555, 0.0015, None))
    assert pc._verdict(1680) is None


def test_uncertainty_cost_without_power_is_nothing_even_without_a_choice() -> None:
    pc = _pc()
    pc.fit = probe.CorrectedFit(_model(u_stderr=0.02, beta=None), (), 0.0, misfit=False)
    pc.threshold = 0.98
    assert pc._choose()[0] is None
    assert pc._uncertainty_cost() == 0.0


def test_lever_clock_skips_a_candidate_at_the_default_clock() -> None:
    pc = _pc()
    pc.fit = probe.CorrectedFit(
        probe.PhaseModelFit(0.9, 0.0, BETA, F_MAX, F_MAX, 6), (), 0.0, misfit=False
    )
    pc.default_clock_mhz, pc.floor_mhz = 1680, 1530  # nothing allowed in between
    assert pc.fit.throughput_ratio(1680) >= eerl.PROBE_MIN_RATIO > pc.fit.throughput_ratio(1530)
    assert pc._lever_clock() is None


def test_refine_uses_the_lock_target_with_the_deficit() -> None:
    pc = _locked_at(1830)
    _owe(pc, repay=0.97)  # lock target 0.972: 1830 still needed
    pc._refine_locked()
    assert pc.locked_clock_mhz == 1830 and pc.selections == 1
    free = _locked_at(1830)
    free._refine_locked()
    assert free.locked_clock_mhz == 1680 and free.selections == 2
    assert free.retrial_reasons[-1] == "refined 1830 -> 1680 MHz"


def test_held_at_default_locks_at_the_target_with_the_deficit() -> None:
    pc = _locked_at(None)
    pc._monitor.add(0.9, 0.9)
    _owe(pc, repay=0.97)
    pc._check_locked(_plain(None), WL)
    assert pc.locked_clock_mhz == 1830  # 1680 meets the threshold, not the repayment
    assert pc._monitor.n == 0


def test_a_threshold_no_clock_meets_returns_the_lock_to_the_default_governor() -> None:
    pc = _locked_at(1680)
    pc.threshold = 0.99
    pc._check_locked(_plain(), WL)
    assert pc.locked_clock_mhz is None
    assert pc.retrial_reasons[-1] == "target 0.992 (threshold 0.990): 1680 -> None MHz"


def test_a_sync_lock_is_refined_only_on_new_blocks() -> None:
    pc = _locked_at(1830)  # above the choice (1680), threshold at the policy's
    pc._check_locked(_plain(1830), WL)
    assert pc.locked_clock_mhz == 1830


def test_a_relaxed_pool_still_checks_for_drift_after_refining() -> None:
    pc = _locked_at(1680)
    pc.threshold = 0.90
    drifted = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 200.0)
    pc._check_locked(_plain(), drifted)
    assert pc.retrial_reasons[-2:] == ["refined 1680 -> 1380 MHz", "workload drift +33%"]
    assert pc.state is base.PhaseState.TRIAL


def test_a_monitor_miss_says_what_it_saw() -> None:
    pc = _locked_at(1680)
    for thr in (0.90, 0.91, 0.92):
        pc._monitor.add(thr, 0.8)
    pc._check_locked(_plain(), WL)
    assert pc.floor_mhz == 1680 and pc.locked_clock_mhz == 1830
    assert pc.retrial_reasons[-1] == (
        "throughput ratio 0.910 below 0.950 at 1680 MHz: stepped up to 1830 MHz"
    )
    assert pc.selections == 2 and pc._monitor.n == 0
    top = _locked_at(1830)
    for thr in (0.90, 0.91, 0.92):
        top._monitor.add(thr, 0.8)
    top._check_locked(_plain(1830), WL)  # no clock above 1830 left to step up to: re-trial
    assert top.state is base.PhaseState.TRIAL and top.floor_mhz == 1830
    assert top.retrial_reasons[-1] == "throughput ratio 0.910 below 0.950 at 1830 MHz"


def test_the_job_plan_lets_a_trial_extend_only_within_budget() -> None:
    ctl = eerl.EERLController([_settings()])
    pc = ctl.phases["generation"]
    fitted = _trial()
    pc.stage, pc.blocks, pc.fit = eerl.Trial(), fitted.blocks, fitted.fit
    pc._last_time_s = pc._last_default_time_s = 1.25
    pc.stage.round_steps = pc.trial_step_limit
    ctl.trial_steps = 5
    plan = ctl.decide(0)  # budget left: the trial may extend
    assert plan.phases["generation"].probing and pc.state is base.PhaseState.TRIAL
    assert ctl.trial_steps == 6
    ctl.trial_steps = 10
    plan = ctl.decide(1)  # no budget: lock the safest choice
    assert pc.state is base.PhaseState.LOCKED and plan.phases["generation"].clock_mhz == 1680
    ctl.observe(base.StepObservation(1, WL, {"generation": _plain()}))
    ctl.observe(base.StepObservation(2, WL, {"generation": _plain()}))
    assert ctl.steps_seen == 2


def test_pool_times_of_a_capped_lock_are_judged_at_the_clock_it_ran() -> None:
    ctl = _async(0.97)
    ctl.phases["generation"].fit = _fitted().fit
    capped = base.PhaseObservation("generation", 2.0, 300.0, 1680, 1500)
    train = base.PhaseObservation("training", 1.5, 300.0, None, 1980)
    ctl.observe(base.StepObservation(0, WL, {"generation": capped, "training": train}))
    assert ctl._pool_times == [{"generation": pytest.approx(2.0 * _r(1500)), "training": 1.5}]


def test_async_bottleneck_threshold_is_at_most_one() -> None:
    ctl = _async(0.999)
    ctl._pool_times = [{"generation": 1.0, "training": 2.0}] * 8
    ctl._update_async_thresholds()
    assert ctl.phases["training"].threshold == 1.0


def test_async_slack_down_to_the_lowest_ratio_searched() -> None:
    ctl = _async(0.95)
    ctl._pool_times = [{"generation": 0.1, "training": 2.0}] * 8
    ctl._update_async_thresholds()
    assert ctl.phases["generation"].threshold == pytest.approx(0.30)


def test_async_slack_keeps_the_step_ratio_margin_exactly() -> None:
    ctl = _async(0.95)
    # generation 1.05046 s against training 2.0 s: r = 0.50 gives a job ratio of
    # 2.0 / (1.05046 / 0.50) = 0.95197, just under 0.95 + ASYNC_SLACK / 25 = 0.952: 0.51 is first
    ctl._pool_times = [{"generation": 1.05046, "training": 2.0}] * 8
    ctl._update_async_thresholds()
    assert 2.0 / (1.05046 / 0.50) < 0.95 + eerl.ASYNC_SLACK / 25 <= 2.0 / (1.05046 / 0.51)
    assert ctl.phases["generation"].threshold == pytest.approx(0.51)


def test_a_monitor_miss_steps_up_to_what_also_repays_the_deficit() -> None:
    pc = _locked_at(1530)
    _owe(pc, repay=0.97)  # lock target 0.972
    pc.stage.target = pc.lock_target
    for thr in (0.90, 0.91, 0.92):
        pc._monitor.add(thr, 0.8)
    pc._check_locked(_plain(1530), WL)
    assert pc.floor_mhz == 1530 and pc.locked_clock_mhz == 1830  # 1680 misses 0.972


def test_drift_of_a_small_feature_is_drift() -> None:
    pc = _trial()
    pc._lock(1680, 0.5, slowdown=False)  # e.g. tokens per sample of a tiny phase
    tiny = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 1.0)
    pc._check_locked(_plain(), tiny)
    assert pc.retrial_reasons[-1] == "workload drift +100%"


def test_default_equivalent_counts_a_zero_energy_slice_as_zero() -> None:
    pc = _fitted()
    slices = list(_block(1680))
    first_default = next(i for i, s in enumerate(slices) if s.clock_mhz is None)
    slices[first_default] = dataclasses.replace(slices[first_default], energy_j=0.0)
    obs = base.PhaseObservation("generation", 0.2, 100.0, None, slices=tuple(slices))
    slice_j = sum(s.energy_j or 0.0 for s in slices)
    paired = probe.paired_default(slices, pc.fit)
    assert paired is not None
    e, _ = pc.default_equivalent(obs, WL)
    assert e == pytest.approx(100.0 * paired[1] / slice_j)


def test_default_equivalent_of_slices_without_any_energy_uses_the_fit() -> None:
    pc = _fitted()
    slices = tuple(dataclasses.replace(s, energy_j=0.0) for s in _block(1680))
    obs = base.PhaseObservation("generation", 0.2, 100.0, None, slices=slices)
    e, t = pc.default_equivalent(obs, WL)
    assert t == pytest.approx(0.1 * (1 + _r(1680)))
    assert e == pytest.approx(100.0 / ((1 + _p(1680) / _r(1680)) / 2))


def test_default_equivalent_of_small_energies_is_still_the_paired_one() -> None:
    pc = _fitted()
    # millijoule slices, the candidate's power 10 % off the model: the paired default slices
    # decide, not the model
    slices = tuple(
        dataclasses.replace(s, energy_j=(s.energy_j or 0.0) * 1e-3 * (1.1 if s.clock_mhz else 1.0))
        for s in _block(1680)
    )
    slice_j = sum(s.energy_j or 0.0 for s in slices)
    assert slice_j < 1.0
    obs = base.PhaseObservation("generation", 0.2, slice_j, None, slices=slices)
    e, _ = pc.default_equivalent(obs, WL)
    assert e == pytest.approx(0.030 * (1 + _r(1680)))  # the default slices' 300 W x 0.1 (1 + r)


def test_paired_default_slices_outside_blocks_use_the_fit() -> None:
    pc = _fitted()
    extra = base.ProbeSlice(1380, 0.025, 2.5 * _r(1380), 7.5 * _p(1380) * 1.1)
    slices = (*_block(1680), extra)
    slice_j = sum(s.energy_j or 0.0 for s in slices)
    obs = base.PhaseObservation("generation", 0.225, slice_j, None, slices=slices)
    paired = probe.paired_default(slices, pc.fit)
    assert paired is not None
    e, t = pc.default_equivalent(obs, WL)
    assert (e, t) == (pytest.approx(paired[1]), pytest.approx(paired[0]))


# ----- written against the second control-freq-eerl survivors ---------------------------------
def test_a_retrial_forgets_the_floor_unless_told_to_keep_it() -> None:
    pc = _trial()
    pc.floor_mhz = 1380
    pc._retrial("recovered from error")
    assert pc.floor_mhz == 0
    pc.floor_mhz = 1380
    pc._retrial("monitor miss", keep_floor=True)
    assert pc.floor_mhz == 1380


def test_decide_extends_a_trial_by_default() -> None:
    pc = _trial()
    pc.stage.round_steps = pc.trial_step_limit
    assert pc.decide(True).probing  # allow_extra defaults to True
    assert pc.state is base.PhaseState.TRIAL


def test_the_step_probe_in_progress_comes_first() -> None:
    pc = _trial(last_time_s=0.1)
    pc.decide(True)
    del pc.stage.step_probe[:3]  # three steps of the block done: the fourth is the candidate's
    assert pc.decide(True).clock_mhz == 1680


def test_choose_needs_an_energy_saving() -> None:
    pc = _fitted()
    pc.fit = probe.CorrectedFit(_model(beta=0.0), (), 0.0, misfit=False)  # flat power
    assert pc._choose(0.90) == (None, pytest.approx(0.0))  # every clock costs energy


def test_choose_takes_the_interior_energy_minimum() -> None:
    pc = _fitted()
    pc.fit = probe.CorrectedFit(_model(beta=0.2), (), 0.0, misfit=False)
    e = {c: pc.fit.energy_ratio(c) for c in (1680, 1530, 1380)}
    assert e[1530] < e[1380] < e[1680]  # a shallow power slope: the minimum is inside
    assert pc._choose(0.90)[0] == 1530


def test_choose_without_a_clock_reports_the_stderr_at_the_highest_allowed() -> None:
    pc = _pc()
    pc.fit = probe.CorrectedFit(_model(u_stderr=0.02), (), 0.0, misfit=False)
    clock, stderr = pc._choose(0.99)
    assert clock is None
    assert stderr == pytest.approx(pc.fit.throughput_stderr(1830)) and stderr > 0
    pc.floor_mhz = 1980
    assert pc._choose(0.99) == (None, math.inf)


def test_upper_bound_of_a_clock_s_blocks() -> None:
    pc = _pc()
    stats = probe.RatioStats()
    for thr in (0.90, 0.92, 0.94):
        stats.add(thr, None)
    assert pc._upper(stats) == pytest.approx(0.92 + probe.student_t_factor(2, 1.5) * stats.stderr)


def test_selections_and_ledger_windows_count_up() -> None:
    pc = _fitted()
    pc._lock(1680, 150.0, slowdown=False)
    pc._lock(1830, 150.0, slowdown=False)
    assert pc.selections == 2
    pc._last_default_time_s = 1.0
    pc._ledger_add(_plain())
    pc._ledger_add(_plain())
    assert pc.ledger_windows == 2


def test_drift_feature_of_a_one_sample_step() -> None:
    one = api_workload.TokenWorkload(1, 100.0, 20.0, 100.0, 70.0)
    assert eerl._drift_feature("training", one) == one.phase_tokens("training")


def test_an_extension_lock_carries_the_feature_and_the_deficit() -> None:
    pc = _trial()
    pc.stage.round_steps = pc.trial_step_limit
    pc._last_feature = 150.0
    _owe(pc, repay=0.97)
    pc.decide(True, allow_extra=False)
    assert pc.locked_clock_mhz == 1830  # the lock target repays the deficit
    assert pc.stage.feature == 150.0
    pc._check_locked(_plain(1830), api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 200.0))
    assert pc.retrial_reasons[-1] == "workload drift +33%"


def test_a_search_probes_its_clock_in_up_to_four_blocks() -> None:
    pc = _trial()
    _misfit(
        pc,
        probe.MeasuredClock(1230, 3, 0.80, 0.0, None),
        probe.MeasuredClock(1830, 3, 0.99, 0.0, None),
    )
    d = pc.decide(True)  # 48 slices: 6 blocks asked, at most 4 at the searched clock
    assert d.probe_clocks_mhz == probe.block_schedule([1530] * 4)
    assert d.reason == "trial 1530, 1530, 1530, 1530 MHz vs default"
    pc._last_time_s = 0.3  # 12 slices: one block
    assert pc.decide(True).probe_clocks_mhz == probe.block_schedule([1530])


def test_a_one_block_phase_probes_the_lever_not_the_guess() -> None:
    pc = _trial(last_time_s=0.3)
    pc.stage.round_steps = 1.0
    assert pc._slices_in_phase() == 8
    assert pc.decide(True).probe_clocks_mhz == probe.block_schedule([1080])


def test_the_model_check_is_probed_before_the_lever() -> None:
    pc = _trial()
    pc.blocks = _exact_blocks(1080)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    pc.stage.round_steps = 1.0
    assert pc.decide(True).probe_clocks_mhz == probe.block_schedule([1380])


def test_odd_and_short_monitor_intervals() -> None:
    for interval, due in ((5, 2), (2, 1)):  # while unsure: every max(interval // 2, 1) steps
        pc = _trial()
        pc.ctl = eerl.ControllerSettings(monitor_interval_steps=interval)
        pc.threshold = 0.90
        pc._lock(1830, 150.0, slowdown=False)
        assert pc._uncertain()
        pc.stage.steps = due
        assert pc.decide(True).probe_clocks_mhz, interval


def _with_grid(
    supported: tuple[int, ...], candidates: tuple[int, ...], allowed: tuple[int, ...] = ()
) -> eerl.PhaseController:
    settings = eerl.PhaseSettings("generation", 0.95, candidates, supported, F_MAX, allowed)
    pc = eerl.PhaseController(settings, eerl.ControllerSettings())
    pc.stage = eerl.Trial()
    return pc


def test_probes_start_from_the_candidates_not_every_allowed_clock() -> None:
    pc = _with_grid((1980, 1905, 1830, 1680, 1530, 1380, 1230, 1080), CANDIDATES)
    assert pc._allowed()[0] == 1905
    pc._last_time_s = pc._last_default_time_s = 0.1
    assert pc.decide(True).reason == "step trial 1830 MHz"  # the highest candidate


def test_the_lever_may_lie_below_the_lowest_candidate() -> None:
    pc = _with_grid(SUPPORTED, (1830, 1680, 1530, 1380), (1830, 1680, 1530, 1380, 1230, 1080))
    pc.blocks = _exact_blocks(1080, 1380)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    pc.stage.round_steps = 1.0
    assert pc._probe_clocks(6) == [1080]


def test_model_check_span_on_a_fine_grid() -> None:
    grid = (1980, 1830, 1680, 1530, 1380, 1230, 1200, 1080)
    pc = _with_grid(grid, (1830, 1680, 1530, 1380, 1230, 1080))
    pc.blocks = _exact_blocks(1080, 1200)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    assert pc._choose()[0] == 1680
    assert pc._model_check_clock() == 1380  # 120 MHz apart: under a quarter of 600


def test_model_check_never_probes_its_own_low_end() -> None:
    pc = _with_grid(SUPPORTED, (1830, 1680, 1080), (1830, 1680, 1080))
    pc.blocks = _exact_blocks(1080)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    assert pc._choose()[0] == 1680
    assert pc._model_check_clock() is None  # nothing strictly between 1080 and 1680


def test_the_default_model_is_fitted_on_the_phase_s_own_tokens() -> None:
    pc = _pc()
    for _ in range(2):
        pc.observe(base.PhaseObservation("generation", 1.2, 360.0, None, 1980), WL)
    locked = base.PhaseObservation("generation", 2.0, 400.0, 1680, 1680)
    pc.fit = None
    assert pc.default_equivalent(locked, WL) == (pytest.approx(360.0), pytest.approx(1.2))


def test_monitor_blocks_keep_their_power() -> None:
    pc = _trial()
    pc._lock(1680, 150.0, slowdown=False)
    pc.observe(base.PhaseObservation("generation", 1.25, 300.0, 1680, slices=_block(1680)), WL)
    assert pc._monitor.power_ratio == pytest.approx(_p(1680))


def test_slices_at_exactly_four_report_gaps_are_resolved() -> None:
    pc = _trial()
    obs = base.PhaseObservation(
        "generation", 0.2, 60.0, None, slices=_block(1680), progress_gap_s=0.00625
    )
    assert eerl.SLICE_PER_PROGRESS_GAP * 0.00625 == 0.025
    assert len(pc._blocks(obs, 100.0)) == 1


def test_a_whole_step_probe_without_energy_still_counts_its_rate() -> None:
    pc = _pc()
    pc.stage = eerl.Trial()
    pc._last_time_s = pc._last_default_time_s = 0.1
    pc.decide(True)
    for clock in list(pc.stage.step_probe):
        rate = _r(1830) if clock else 1.0
        pc.observe(base.PhaseObservation("generation", 0.1 / rate, None, clock), WL)
    assert pc.stats[1830].n == 1 and pc.stats[1830].power_ratio is None


# ----- how a trial round ends (``_observe_trial``) --------------------------------------------
def _noisy(threshold: float, noise: float = 0.02) -> eerl.PhaseController:
    """A trial whose fit is not precise (3 blocks at 1080 and 1530, +-noise): z x stderr 0.0048."""
    pc = _trial()
    pc.threshold = threshold
    pc.blocks = [(c, _r(c) + d, _p(c)) for c in (1080, 1530) for d in (-noise, 0.0, noise)]
    return pc


def _round_end(pc: eerl.PhaseController, round_steps_before: float) -> None:
    pc.stage.round_steps = round_steps_before
    obs = base.PhaseObservation("generation", 1.25, 300.0, None, slices=_block(1680))
    pc._observe_trial(pc.stage, obs, [], whole_step=False)  # one more probed step, no new block


def test_an_imprecise_round_locks_at_its_step_limit_when_the_margin_is_cheap() -> None:
    pc = _noisy(0.95)
    limit = pc.trial_step_limit
    _round_end(pc, limit - 2)
    assert pc.state is base.PhaseState.TRIAL  # imprecise and not at the limit
    assert pc._uncertainty_cost() < eerl.INFO_GAIN
    _round_end(pc, limit - 1)
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz == 1680


def test_an_imprecise_round_whose_margin_costs_goes_on_to_three_limits() -> None:
    pc = _noisy(0.94)
    limit = pc.trial_step_limit
    _round_end(pc, limit - 1)
    assert pc._uncertainty_cost() >= eerl.INFO_GAIN  # 1680 held, 1530 predicted fine
    assert pc.state is base.PhaseState.TRIAL
    _round_end(pc, 3 * limit - 2)
    assert pc.state is base.PhaseState.TRIAL
    _round_end(pc, 3 * limit - 1)
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz == 1680


def test_three_exact_blocks_are_precise_enough() -> None:
    pc = _trial()
    pc.blocks = _exact_blocks(1080, n=2) + _exact_blocks(1530, n=1)
    _round_end(pc, 0.0)
    assert pc.fit is not None and pc.fit.blocks == 3
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz == 1680


def test_a_precise_round_locks_at_the_target_with_the_deficit() -> None:
    pc = _trial()
    _owe(pc, repay=0.97)
    _round_end(pc, 0.0)
    assert pc.locked_clock_mhz == 1830


def test_a_misfitted_round_locks_only_once_the_bracket_closes() -> None:
    pc = _trial()
    pc.floor_mhz = 1080
    knee = [(1080, _r(1080), _p(1080))] * 20 + [(1530, 0.93, _p(1530))] * 3
    pc.blocks = list(knee)
    _round_end(pc, 0.0)
    assert pc.fit is not None and pc.fit.misfit and pc._search_clock() == 1680
    assert pc.state is base.PhaseState.TRIAL  # 1680 not decided yet
    pc = _trial()
    pc.floor_mhz = 1080
    pc.blocks = knee + _exact_blocks(1680)
    _round_end(pc, 0.0)
    assert pc.fit is not None and pc.fit.misfit and pc.bracket() == (1530, 1680)
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz == 1680


def test_a_round_that_runs_out_of_clocks_or_fit_keeps_its_feature() -> None:
    pc = _warm()
    pc.floor_mhz = 1680
    pc.observe(_slices_obs(1830, 1830, 1830, ratio={1830: 0.5}), WL)
    assert pc.locked_clock_mhz is None and pc.stage.feature == 150.0
    pc = _warm()
    pc.stage.round_steps = pc.trial_step_limit - 1
    pc._last_default_time_s = 2.0  # long phase: the limit stays at trial_steps
    one = _slices_obs(1080)
    pc._observe_trial(pc.stage, one, [], whole_step=False)
    assert pc.fit is None
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz is None
    assert pc.stage.feature == 150.0


# ----- written against the third control-freq-eerl survivors ----------------------------------
def test_search_keeps_probing_an_undecided_clock_below_the_target() -> None:
    pc = _pc()
    _misfit(
        pc,
        probe.MeasuredClock(1230, 3, 0.80, 0.0, None),
        probe.MeasuredClock(1380, 3, 0.950, 0.003, None),  # undecided: 0.950 +- 0.0099
        probe.MeasuredClock(1830, 3, 0.99, 0.0, None),
    )
    assert pc._verdict(1380) is None and pc.bracket() == (1230, 1830)
    assert pc._search_clock() == 1380  # not the bisection's 1530


@pytest.mark.parametrize(("noise", "precise"), [(0.0165, True), (0.0175, False)])
def test_precision_is_judged_with_the_fit_s_degrees_of_freedom(noise: float, precise: bool) -> None:
    pc = _noisy(0.95, noise)
    pc.fit = probe.fit_corrected(pc.blocks, F_MAX, F_MAX)
    choice, stderr = pc._choose()
    z_eff = probe.student_t_factor(pc.fit.blocks - 1, 1.5)  # 6 blocks: 5 degrees of freedom
    assert (z_eff * stderr <= eerl.INDIFFERENCE) is precise
    _round_end(pc, 0.0)
    assert (pc.state is base.PhaseState.LOCKED) is precise


def test_a_fresh_phase_says_it_has_no_phase_length_yet() -> None:
    pc = _pc()
    assert pc.probe_evidence == (
        "whole-phase: progress every 0 ms or more resolves fewer than 8 slices of a 0.000 s phase"
    )


def test_a_trial_without_budget_or_fit_before_any_lock_runs_the_default_governor() -> None:
    pc = _warm()
    assert pc.fit is None
    assert pc.decide(False).clock_mhz is None


def test_a_lock_made_under_a_slowdown_does_not_retrial_on_it() -> None:
    pc = _warm()
    pc.observe(_slices_obs(1080, 1080, 1080), WL)
    slowed = dataclasses.replace(_slices_obs(1380, 1380, 1380), slowdown=True)
    pc.observe(slowed, WL)  # the round locks in this window, under a power cap
    assert pc.state is base.PhaseState.LOCKED and pc.stage.slowdown is True
    for _ in range(3):
        pc._check_locked(_plain(slowdown=True), WL)
    assert pc.state is base.PhaseState.LOCKED  # the cap was there when it locked


def test_an_extension_lock_remembers_the_slowdown_it_saw() -> None:
    pc = _trial()
    pc.stage.round_steps = 3 * pc.trial_step_limit
    pc._last_slowdown = True  # the newest window ran under a power or thermal cap
    pc.decide(True, allow_extra=False)
    assert pc.state is base.PhaseState.LOCKED and pc.stage.slowdown is True


def test_the_newest_window_s_slowdown_goes_into_an_extension_lock() -> None:
    pc = _noisy(0.94)  # imprecise, and the margin costs: the round goes on past its limit
    pc.stage.round_steps = pc.trial_step_limit
    slowed = dataclasses.replace(_slices_obs(1680), slowdown=True)
    pc.observe(slowed, WL)
    assert pc.state is base.PhaseState.TRIAL and pc._last_slowdown is True
    pc.decide(True, allow_extra=False)
    assert pc.state is base.PhaseState.LOCKED and pc.stage.slowdown is True


def test_a_default_governor_lock_keeps_the_slowdown_of_its_window() -> None:
    pc = _warm()
    pc.floor_mhz = 1680
    slowed = dataclasses.replace(_slices_obs(1830, 1830, 1830, ratio={1830: 0.5}), slowdown=True)
    pc.observe(slowed, WL)
    assert pc.locked_clock_mhz is None and pc.stage.slowdown is True
    pc = _warm()
    pc.stage.round_steps = pc.trial_step_limit - 1
    pc._last_default_time_s = 2.0
    pc._observe_trial(
        pc.stage, dataclasses.replace(_slices_obs(1080), slowdown=True), [], whole_step=False
    )
    assert pc.fit is None and pc.locked_clock_mhz is None and pc.stage.slowdown is True


def test_a_probed_clock_bounds_every_higher_clock_from_below() -> None:
    """Throughput does not fall when the clock rises: a lower probed clock's own bound (at
    least ``min_blocks``) lifts the fit's bound at every clock above it, not below it."""
    pc = _pc()
    pc.fit = probe.CorrectedFit(_model(u_stderr=0.05), (), 0.0, misfit=False)
    z = pc.ctl.confidence_z
    loose = pc.fit.throughput_lower_bound(1680, z)
    assert loose < 0.952  # the loose fit alone keeps 1680 from a lock at 0.952
    proven = 0.97 - probe.student_t_factor(2, z) * 0.001
    pc.fit = probe.CorrectedFit(
        _model(u_stderr=0.05),
        (
            probe.MeasuredClock(1530, 3, 0.97, 0.001, None),
            probe.MeasuredClock(1380, 2, 0.99, 0.0001, None),  # under min_blocks: no bound
        ),
        0.0,
        misfit=False,
    )
    assert pc._lower_bound(1680, z) == pytest.approx(max(proven, loose))
    assert pc._lower_bound(1530, z) == pytest.approx(
        max(proven, pc.fit.throughput_lower_bound(1530, z))
    )
    assert pc._lower_bound(1380, z) == pc.fit.throughput_lower_bound(1380, z)
    assert pc._choose(0.952)[0] == 1530  # proven, and the most efficient clock above it


def test_a_misfit_lock_takes_the_lowest_clock_the_search_showed_to_meet() -> None:
    """Where the model misfits, the bracketing search's lowest clock shown to meet
    ``threshold + LOCK_MARGIN`` (``_verdict``) and every clock above it meet it, even where one
    noisy block at a clock in between drags the corrected fit's bound down (the case of
    verl-grpo-deepseek7b on h100-sxm:saturating-decode, docs/simulator.md: locked at 1500 MHz
    above a search that closed at 1350 / 1365 MHz)."""
    pc = _pc()
    pc.fit = probe.CorrectedFit(
        _model(u_stderr=0.05),
        (
            probe.MeasuredClock(1230, 12, 0.930, 0.003, None),  # miss
            probe.MeasuredClock(1380, 12, 0.955, 0.003, None),  # meets by its mean (12 blocks)
            probe.MeasuredClock(1530, 1, 0.90, 0.02, None),  # one noisy block: undecided
        ),
        0.0,
        misfit=True,
    )
    z = pc.ctl.confidence_z
    assert pc.bracket() == (1230, 1380)
    assert pc._proven_clock_mhz(0.95 + eerl.LOCK_MARGIN) == 1380
    assert all(pc._lower_bound(c, z) < 0.952 for c in (1380, 1530, 1680))
    assert pc._choose()[0] == 1380
    # A lock that must repay a deficit needs the bound: the search did not decide its target.
    assert pc._proven_clock_mhz(0.96) == math.inf
    assert pc._choose(0.96)[0] != 1380
    # Not while the model fits, and not where only the default clock is shown to meet.
    pc.fit = dataclasses.replace(pc.fit, misfit=False)
    assert pc._proven_clock_mhz(0.952) == math.inf
    pc.fit = probe.CorrectedFit(
        _model(u_stderr=0.05), (probe.MeasuredClock(1230, 12, 0.93, 0.003, None),), 0.0, True
    )
    assert pc._proven_clock_mhz(0.952) == math.inf


def test_a_held_lock_is_checked_by_the_evidence_it_was_chosen_by() -> None:
    """When the target moves, a lock at the search's proven clock is kept where the proof
    still covers the new target (``_meets``, as ``_choose``), not re-selected on the
    corrected fit's looser bound."""
    pc = _locked_at(1380)
    pc.fit = probe.CorrectedFit(
        _model(u_stderr=0.05),
        (
            probe.MeasuredClock(1230, 12, 0.930, 0.003, None),
            probe.MeasuredClock(1380, 12, 0.955, 0.003, None),
        ),
        0.0,
        misfit=True,
    )
    assert pc._lower_bound(1380, pc.ctl.confidence_z) < 0.952 and pc._meets(1380, 0.952)
    pc.stage.threshold = 0.951  # the async slack moved the threshold back to 0.95
    selections, reasons = pc.selections, list(pc.retrial_reasons)
    pc._check_locked(_plain(1380), WL)
    assert pc.locked_clock_mhz == 1380
    assert (pc.selections, pc.retrial_reasons) == (selections, reasons)
