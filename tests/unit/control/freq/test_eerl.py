"""EE-RL controller behaviour on synthetic heavy-tailed workloads (simulated H100s).

We test these aspects: drift forces a re-trial; a candidate below the threshold is never
locked; measurement noise of a few percent does not flip decisions; an error returns the
default governor; observe mode never writes a clock; the whole run keeps the threshold.
"""

import dataclasses

import pytest

from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import base, config, eerl
from rlenergy.gpu import models
from rlenergy.gpu import simulated as sim_gpu
from rlenergy.sim import job as sim_job
from rlenergy.sim import workload

SKU = models.get_sku("h100-sxm")


def _run(
    replay: workload.Replay,
    *,
    seed: int = 0,
    spec: api_policy.RLEnergyPolicySpec | None = None,
    faults=None,
):
    job = sim_job.Job(replay, SKU, "sync", seed=seed)
    ctl = config.build_controller(
        spec or api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz()
    )
    plans: list[base.Plan] = []
    orig = ctl.decide

    def recording_decide(step: int) -> base.Plan:
        plan = orig(step)
        plans.append(plan)
        return plan

    ctl.decide = recording_decide  # type: ignore[method-assign]
    results, gpus = sim_job.run_job(job, ctl, faults=faults)
    return job, ctl, results, gpus, plans


def _phase_ratio(job: sim_job.Job, phase: str, clock: int | None) -> float:
    default = sim_job.default_run(job)
    fixed = sim_job.fixed_run(job, {phase: clock})
    return default.phase_time_s[phase] / fixed.phase_time_s[phase]


def test_response_length_drift_forces_a_retrial() -> None:
    replay = workload.synthetic(160, seed=1, response_start=300, response_end=2400, drift_at=80)
    _, ctl, results, _, _ = _run(replay)
    reasons = ctl.phases["generation"].retrial_reasons
    assert any(r.startswith("workload drift") for r in reasons), reasons
    drift_steps = [r.index for r in results if r.index > 80 and r.probing["generation"]]
    assert drift_steps and drift_steps[0] <= 84


def test_a_candidate_below_the_threshold_is_never_locked() -> None:
    replay = workload.synthetic(120, seed=2, response_start=800, response_end=800)
    job, ctl, results, _, _ = _run(replay)
    locked = {r.clocks_mhz["generation"] for r in results if r.states["generation"] == "locked"}
    assert locked
    for clock in locked:
        assert _phase_ratio(job, "generation", clock) >= 0.95
    # the lowest candidate (~990 MHz, ratio ~0.89) was probed and not kept
    lowest = min(ctl.phases["generation"].settings.candidates_mhz)
    assert _phase_ratio(job, "generation", lowest) < 0.95
    assert lowest not in locked


@pytest.mark.parametrize("trace_seed", [3])
def test_noise_of_a_few_percent_does_not_flip_decisions(trace_seed: int) -> None:
    replay = workload.synthetic(120, seed=trace_seed, response_start=1000, response_end=1000)
    finals = []
    for seed in range(4):
        job, ctl, _, _, _ = _run(replay, seed=seed)
        finals.append(ctl.phases["generation"].locked_clock_mhz)
        assert _phase_ratio(job, "generation", finals[-1]) >= 0.95
    assert None not in finals
    assert max(finals) - min(finals) <= 90, finals  # within six 15 MHz steps across noise draws


def test_an_error_returns_the_default_governor_then_recovers() -> None:
    replay = workload.synthetic(60, seed=4, response_start=800, response_end=800)
    faults = {30: [sim_gpu.Fault.LOST], 31: []}
    _, ctl, results, gpus, plans = _run(replay, faults=faults)
    gen = [p.phases["generation"] for p in plans]
    assert gen[31].state is base.PhaseState.FALLBACK and gen[31].clock_mhz is None
    assert any(
        r.startswith("error: GpuLostError") for r in ctl.phases["generation"].retrial_reasons
    )
    assert any(d.state is not base.PhaseState.FALLBACK for d in gen[34:])
    assert all(g.locked_sm_clocks_mhz is None for g in gpus)


def test_observe_mode_never_writes_a_clock() -> None:
    spec = api_policy.RLEnergyPolicySpec.model_validate({"controller": {"mode": "observe"}})
    replay = workload.synthetic(20, seed=5)
    job, ctl, results, gpus, _ = _run(replay, spec=spec)
    assert all(g.writes == 0 for g in gpus)
    assert sim_job.totals(job, results).energy_j == pytest.approx(sim_job.default_run(job).energy_j)


def test_whole_run_keeps_the_threshold_with_trials_included() -> None:
    replay = workload.synthetic(200, seed=6)
    job, _, results, _, _ = _run(replay)
    online = sim_job.totals(job, results)
    default = sim_job.default_run(job)
    assert default.time_s / online.time_s >= 0.95
    assert online.energy_j < default.energy_j


def test_async_relaxes_the_faster_pool() -> None:
    replay = workload.synthetic(120, seed=7, response_start=1500, response_end=1500)
    job = sim_job.Job(replay, SKU, "async", seed=0)
    spec = api_policy.RLEnergyPolicySpec(mode="async")
    ctl = config.build_controller(spec, SKU.supported_sm_clocks_mhz())
    sim_job.run_job(job, ctl)
    thresholds = {n: pc.threshold for n, pc in ctl.phases.items()}
    assert min(thresholds.values()) < 0.95 <= max(thresholds.values())


def test_settings_come_from_the_policy() -> None:
    spec = api_policy.RLEnergyPolicySpec.model_validate(
        {
            "controller": {
                "warmupSteps": 5,
                "trialSteps": 3,
                "driftThreshold": 0.5,
                "maxTrialFraction": 0.1,
            }
        }
    )
    s = config.controller_settings(spec)
    assert (s.warmup_steps, s.trial_steps, s.drift_threshold, s.max_trial_fraction) == (
        5,
        3,
        0.5,
        0.1,
    )
    assert isinstance(
        config.build_controller(spec, SKU.supported_sm_clocks_mhz()), eerl.EERLController
    )


def test_default_equivalent_uses_the_paired_probe_fit() -> None:
    from rlenergy.api import workload as api_workload
    from rlenergy.control.freq import probe

    settings = config.phase_settings(
        api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz()
    )[0]
    pc = eerl.PhaseController(settings, eerl.ControllerSettings())
    pc.fit = probe.PhaseModelFit(
        u=0.1, u_stderr=0.001, beta=0.5, f_max_mhz=1980, f_default_mhz=1980, blocks=10
    )
    wl = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)
    locked = base.PhaseObservation("generation", 10.0, 3000.0, 1410)
    energy, time_s = pc.default_equivalent(locked, wl)
    assert time_s == pytest.approx(10.0 * pc.fit.throughput_ratio(1410))
    assert energy == pytest.approx(3000.0 / pc.fit.energy_ratio(1410))
    assert energy > 3000.0 and time_s < 10.0  # the default governor costs more energy, less time
    default = base.PhaseObservation("generation", 9.0, 4000.0, None)
    assert pc.default_equivalent(default, wl) == (4000.0, 9.0)
    failed = base.PhaseObservation("generation", 9.0, 4000.0, 1410, error="GpuLostError")
    assert pc.default_equivalent(failed, wl) == (None, None)


@pytest.mark.parametrize("async_mode", [False, True])
def test_locked_windows_trust_the_blocks_at_their_clock_over_a_fit_they_contradict(
    async_mode: bool,
) -> None:
    """A locked window's counterfactual is the paired blocks measured at its
    clock once they sit more than ``MEASURED_Z`` standard errors off the fit (sync mode);
    blocks that agree with the fit within their noise leave the fit's (more precise) ratio."""
    from rlenergy.api import workload as api_workload
    from rlenergy.control.freq import probe

    settings = config.phase_settings(
        api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz()
    )[0]
    pc = eerl.PhaseController(settings, eerl.ControllerSettings(async_mode=async_mode))
    pc.fit = probe.PhaseModelFit(
        u=0.1, u_stderr=0.001, beta=0.5, f_max_mhz=1980, f_default_mhz=1980, blocks=10
    )
    fit_thr, fit_e = pc.fit.throughput_ratio(1410), pc.fit.energy_ratio(1410)
    assert fit_e is not None
    wl = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)
    locked = base.PhaseObservation("generation", 10.0, 3000.0, 1410)
    off = probe.RatioStats()
    for d in (-0.002, 0.0, 0.002, 0.001):  # blocks 0.05 faster, 0.03 lower power than the fit
        off.add(fit_thr + 0.05 + d, fit_thr * fit_e - 0.03 + d)
    pc.stats[1410] = off
    energy, time_s = pc.default_equivalent(locked, wl)
    if async_mode:  # async keeps the fit (the blocks moved async rows off the truth)
        assert time_s == pytest.approx(10.0 * fit_thr)
        assert energy == pytest.approx(3000.0 / fit_e)
    else:
        assert time_s == pytest.approx(10.0 * off.throughput_mean)
        assert energy == pytest.approx(3000.0 / off.energy_per_token_ratio)
    near = probe.RatioStats()
    for d in (-0.02, 0.0, 0.02, 0.01):  # the fit's ratio within the blocks' noise
        near.add(fit_thr + d, fit_thr * fit_e + d)
    pc.stats[1410] = near
    energy, time_s = pc.default_equivalent(locked, wl)
    assert time_s == pytest.approx(10.0 * fit_thr)
    assert energy == pytest.approx(3000.0 / fit_e)


def _async_controller() -> eerl.PhaseController:
    """A phase controller of the default policy's first phase, in async mode."""
    settings = config.phase_settings(
        api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz()
    )[0]
    return eerl.PhaseController(settings, eerl.ControllerSettings(async_mode=True))


def test_locked_window_bounds_span_the_fit_and_the_blocks_at_its_clock() -> None:
    """``default_equivalent_range``: a locked window judged by the fit (async mode keeps it)
    has bounds from the fit's ratios, each +- ``STATUS_Z`` of its standard error with the
    model's discrepancy (``CorrectedFit.discrepancy_stderr``), joined with the blocks' own;
    a default-governor window and a failed one are their own bounds."""
    from rlenergy.api import workload as api_workload
    from rlenergy.control.freq import probe

    pc = _async_controller()
    model = probe.PhaseModelFit(
        u=0.1, u_stderr=0.001, beta=0.5, f_max_mhz=1980, f_default_mhz=1980, blocks=10
    )
    pc.fit = probe.CorrectedFit(model, (), 0.0, False)
    fit_thr, fit_e = pc.fit.throughput_ratio(1410), pc.fit.energy_ratio(1410)
    thr_sd, power_sd = pc.fit.discrepancy_stderr(1410)
    assert fit_e is not None and thr_sd > model.throughput_stderr(1410) > 0
    assert power_sd == pytest.approx(probe.MISFIT_MIN)  # nothing measured: the floor
    wl = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)
    locked = base.PhaseObservation("generation", 10.0, 3000.0, 1410)
    point = pc.default_equivalent(locked, wl)
    # Without blocks at the clock: the fit's ratios +- 2 of their standard errors.
    low, high = pc.default_equivalent_range(locked, wl)
    z = eerl.STATUS_Z
    assert (low.time_s, high.time_s) == pytest.approx(
        (10.0 * (fit_thr - z * thr_sd), 10.0 * (fit_thr + z * thr_sd))
    )
    power = fit_e * fit_thr
    assert (low.energy_j, high.energy_j) == pytest.approx(
        (
            3000.0 * (fit_thr - z * thr_sd) / (power + z * power_sd),
            3000.0 * (fit_thr + z * thr_sd) / (power - z * power_sd),
        )
    )
    # Blocks 0.05 faster than the fit: the upper bound reaches past their mean.
    off = probe.RatioStats()
    for d in (-0.002, 0.0, 0.002, 0.001):
        off.add(fit_thr + 0.05 + d, fit_thr * fit_e - 0.03 + d)
    pc.stats[1410] = off
    assert pc.default_equivalent(locked, wl) == point  # async: the point stays the fit's
    low, high = pc.default_equivalent_range(locked, wl)
    assert low.time_s == pytest.approx(10.0 * (fit_thr - z * thr_sd))
    assert high.time_s == pytest.approx(10.0 * (off.throughput_mean + z * off.stderr))
    assert low.energy_j <= 3000.0 / off.energy_per_token_ratio <= high.energy_j
    assert low.energy_j <= point.energy_j <= high.energy_j
    for window in (
        base.PhaseObservation("generation", 9.0, 4000.0, None),
        base.PhaseObservation("generation", 9.0, 4000.0, 1410, error="GpuLostError"),
    ):
        same = pc.default_equivalent(window, wl)
        assert pc.default_equivalent_range(window, wl) == (same, same)


def test_a_lock_above_the_probed_clocks_holds_the_truth_of_a_power_the_model_misses() -> None:
    """The case the bounds missed (TinyZero / ``b200:saturating-decode``, sync): a lock
    between the highest probed clock and the default, where the power model, corrected by
    the probed clocks' residuals, reads 0.02 above the true power ratio (0.732 vs 0.713
    there). The old bounds moved the energy ratio with the throughput alone and missed the
    true default energy; with the power's discrepancy (``power_tau2`` x the gap share) they
    hold it, and monotonicity keeps the throughput's at most 1."""
    from rlenergy.api import workload as api_workload
    from rlenergy.control.freq import probe

    pc = _async_controller()
    model = probe.PhaseModelFit(
        u=0.3, u_stderr=0.003, beta=0.7, f_max_mhz=1980, f_default_mhz=1980, blocks=30
    )
    p_model = model.power_ratio(1050) or 0.0
    probed = probe.MeasuredClock(
        1050, 12, model.throughput_ratio(1050), 0.004, p_model - 0.04, 0.004
    )
    pc.fit = probe.CorrectedFit(model, (probed,), 0.0, False, True, 0.00066)
    clock = 1560
    thr, e_ratio = pc.fit.throughput_ratio(clock), pc.fit.energy_ratio(clock)
    assert e_ratio is not None
    power = thr * e_ratio
    true_power = power - 0.02
    wl = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)
    locked = base.PhaseObservation("generation", 10.0, 3000.0, clock)
    true_default_j = 3000.0 * thr / true_power  # measured energy / true energy ratio
    # The old construction: throughput +- 2 of the model's standard error, power fixed.
    se = model.throughput_stderr(clock)
    old_high_j = 3000.0 * min(thr + eerl.STATUS_Z * se, 1.0) / power
    assert true_default_j > old_high_j
    low, high = pc.default_equivalent_range(locked, wl)
    assert low.energy_j is not None and high.energy_j is not None
    assert low.energy_j <= true_default_j <= high.energy_j
    assert high.time_s is not None and high.time_s <= 10.0  # throughput ratio at most 1
    # Not uselessly wide: the energy bounds within +-10 % of the point (2 x 0.026 power).
    point = pc.default_equivalent(locked, wl).energy_j or 0.0
    assert 0.90 * point < low.energy_j < point < high.energy_j < 1.10 * point


def _phase_controller() -> eerl.PhaseController:
    settings = config.phase_settings(
        api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz()
    )[0]
    return eerl.PhaseController(settings, eerl.ControllerSettings())


def _observe_default(pc: eerl.PhaseController, durations: list[float]) -> None:
    from rlenergy.api import workload as api_workload

    wl = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)
    for d in durations:
        pc.observe(base.PhaseObservation("generation", d, 300.0 * d, None, 1980), wl)


def test_a_short_phase_gets_more_trial_steps_for_the_same_evidence() -> None:
    short, long_ = _phase_controller(), _phase_controller()
    _observe_default(short, [0.6, 0.6])  # 24 slices of 25 ms: half of slices_per_phase
    _observe_default(long_, [60.0, 60.0])
    ctl = eerl.ControllerSettings()
    assert long_.evidence_scale == 1.0 and long_.trial_step_limit == ctl.trial_steps
    assert short.evidence_scale == pytest.approx(2.0)
    assert short.trial_step_limit == pytest.approx(2 * ctl.trial_steps)
    tiny = _phase_controller()
    _observe_default(tiny, [0.21, 0.21])  # one block: capped
    assert tiny.evidence_scale == eerl.MAX_EVIDENCE_SCALE


def test_the_lever_arm_clock_stays_low_when_a_floor_rises() -> None:
    from rlenergy.control.freq import probe

    pc = _phase_controller()
    _observe_default(pc, [60.0, 60.0])
    pc.fit = probe.PhaseModelFit(
        u=0.14, u_stderr=0.02, beta=0.5, f_max_mhz=1980, f_default_mhz=1980, blocks=10
    )
    lowest = min(pc.settings.candidates_mhz)
    pc.floor_mhz = 1275  # the lowest candidates missed the threshold on their own blocks
    assert pc._lever_clock() == lowest  # predicted ratio ~0.88 >= PROBE_MIN_RATIO
    assert all(c > 1275 for c in pc._allowed())  # but none of them can be locked
    pc.fit = dataclasses.replace(pc.fit, u=0.9)  # compute bound: 990 MHz would cost ~45 %
    assert pc._lever_clock() == min(pc._allowed())


@pytest.mark.field
def test_default_equivalent_judges_a_capped_lock_at_the_clock_it_ran() -> None:
    """A cap after the trials (read back 1200 MHz under a 1410 MHz lock) is judged
    at 1200 MHz, not credited as 1410 MHz; a read-back within one clock step is the lock."""
    from rlenergy.api import workload as api_workload
    from rlenergy.control.freq import probe

    settings = config.phase_settings(
        api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz()
    )[0]
    pc = eerl.PhaseController(settings, eerl.ControllerSettings())
    pc.fit = probe.PhaseModelFit(
        u=0.1, u_stderr=0.001, beta=0.5, f_max_mhz=1980, f_default_mhz=1980, blocks=10
    )
    wl = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)
    capped = base.PhaseObservation("generation", 10.0, 3000.0, 1410, applied_clock_mhz=1200)
    assert base.ran_clock_mhz(capped) == 1200
    energy, time_s = pc.default_equivalent(capped, wl)
    assert time_s == pytest.approx(10.0 * pc.fit.throughput_ratio(1200))
    assert energy == pytest.approx(3000.0 / pc.fit.energy_ratio(1200))
    at_lock = base.PhaseObservation("generation", 10.0, 3000.0, 1410, applied_clock_mhz=1395)
    assert base.ran_clock_mhz(at_lock) == 1410
    assert pc.default_equivalent(at_lock, wl)[1] == pytest.approx(
        10.0 * pc.fit.throughput_ratio(1410)
    )
    assert base.ran_clock_mhz(base.PhaseObservation("g", 1.0, 1.0, None, 900)) is None


@pytest.mark.field
def test_annotation_phase_source_trials_whole_steps_and_keeps_the_threshold() -> None:
    """phaseSource annotation: a phase signal takes an API round trip and a watch, and no
    in-phase progress comes with it, so EE-RL plans no probe slice at all: every trial and
    check alternates whole steps, and the run still keeps the threshold and saves energy."""
    spec = api_policy.RLEnergyPolicySpec.model_validate(
        {"selector": {"matchLabels": {"app": "x"}}, "phaseSource": "annotation"}
    )
    assert config.controller_settings(spec).in_phase_probes is False
    replay = workload.synthetic(200, seed=6)
    job, ctl, results, _, plans = _run(replay, spec=spec)
    decisions = [d for p in plans for d in p.phases.values()]
    assert not any(d.probe_clocks_mhz for d in decisions)  # no slice is ever planned
    assert any(d.step_probe for d in decisions)  # trials ran as whole steps
    for pc in ctl.phases.values():
        assert "phaseSource annotation" in pc.probe_evidence
    online = sim_job.totals(job, results)
    default = sim_job.default_run(job)
    assert default.time_s / online.time_s >= 0.95
    assert online.energy_j < default.energy_j
    socket = config.controller_settings(api_policy.RLEnergyPolicySpec())
    assert socket.in_phase_probes is True  # the default, phaseSource socket
