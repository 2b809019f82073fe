"""Scoring of simulated jobs on hand-made inputs: truth, baselines, oracle, what run_job reports.

Every expected value is worked out by hand from the toy SKU below (the GPU model's documented
formulas, ``rlenergy.gpu.models``) with the catalog's noise switched off:

* generation: ``P(f) = 50 + 150 (f/1000)**2`` W, time factor ``0.5 * 1000/f + 0.5``;
* training: ``P(f) = 100 + 200 (f/1000)**2`` W, time factor ``0.75 * 1000/f + 0.25``;
* idle: 50 W unlocked, 60 W while a clock is locked (as the published family does).

So at 500 MHz generation takes 1.5x as long at 87.5 W, at 800 MHz training 1.1875x at 228 W.
The energy counter updates every 1/16 s exactly, so counter deltas over phase windows that are
multiples of 1/16 s are exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pytest

from rlenergy import errors
from rlenergy.api import workload as api_workload
from rlenergy.control.freq import base
from rlenergy.gpu import models
from rlenergy.gpu import simulated as sim_gpu
from rlenergy.sim import job as sim_job
from rlenergy.sim import report, workload


class _ToySku(models.GpuSku):
    """The toy SKU; idle power depends on whether a clock is locked."""

    locked_idle_power_w: float = 60.0

    def idle_power_for(self, locked_mhz: float | None) -> float:
        return self.idle_power_w if locked_mhz is None else self.locked_idle_power_w


SKU = _ToySku(
    key="toy",
    nvml_name="Toy GPU",
    gpu_product_label="Toy-GPU",
    max_sm_clock_mhz=1000,
    min_sm_clock_mhz=400,
    clock_step_mhz=100,
    memory_clock_mhz=2000,
    power_limit_w=1000.0,
    min_power_limit_w=100.0,
    idle_power_w=50.0,
    memory_bandwidth_tbps=1.0,
    dense_bf16_tflops=100.0,
    generation=models.GenerationModel(
        m0=0.5,
        m_ctx_slope=0.0,
        ctx_ref_tokens=1000.0,
        m_min=0.1,
        m_max=0.9,
        pc_w=50.0,
        pd_w=150.0,
        a=2.0,
    ),
    training=models.TrainingModel(m=0.25, pc_w=100.0, pd_w=200.0, a=2.0),
)

RESPONSE_TOKENS = 4320.0
PROMPT_TOKENS = 1000.0
VALID_TOKENS = 1000.0


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """No run-to-run noise, no read noise, counter updates every 1/16 s."""
    cat = models.catalog().model_copy(
        update={
            "noise": models.NoiseModel(
                phase_time_sigma_frac=0.0, phase_power_sigma_frac=0.0, per_gpu_power_spread_frac=0.0
            ),
            "sensors": models.SensorModel(
                energy_counter_update_min_s=0.0625,
                energy_counter_update_max_s=0.0625,
                power_average_window_s=1.0,
                power_read_noise_frac=0.0,
            ),
        }
    )
    monkeypatch.setattr(models, "catalog", lambda: cat)


def _replay(
    *steps: tuple[float, float, float], num_gpus: int = 2, shape: float = 1.0
) -> workload.Replay:
    """Steps of (generation boost s, training boost s, other s)."""
    wl = api_workload.TokenWorkload(
        samples=8,
        response_tokens=RESPONSE_TOKENS,
        prompt_tokens=PROMPT_TOKENS,
        valid_tokens=VALID_TOKENS,
        mean_context_tokens=500.0,
    )
    return workload.Replay(
        "toy",
        tuple(
            workload.StepWork(
                index=i,
                source_step=i,
                cycle=0,
                phases=(
                    workload.PhaseWork("generation", "generation", g, shape),
                    workload.PhaseWork("training", "training", t, 1.0),
                ),
                other_time_s=o,
                workload=wl,
            )
            for i, (g, t, o) in enumerate(steps)
        ),
        num_gpus,
        (),
    )


class _Scripted:
    """A policy with the same plan every step that records what it is asked and told."""

    def __init__(self, phases: Mapping[str, base.PhaseDecision]) -> None:
        self.phases = dict(phases)
        self.decided: list[int] = []
        self.observed: list[base.StepObservation] = []

    def decide(self, step: int) -> base.Plan:
        self.decided.append(step)
        return base.Plan(step, self.phases)

    def observe(self, observation: base.StepObservation) -> None:
        self.observed.append(observation)


def _probe(clocks: tuple[int | None, ...], slice_s: float) -> base.PhaseDecision:
    return base.PhaseDecision(
        None, base.PhaseState.TRIAL, probe_clocks_mhz=clocks, probe_slice_s=slice_s
    )


# ----- the job -------------------------------------------------------------------------------
def test_default_job_is_sync_on_the_traces_gpus_and_async_needs_two() -> None:
    one = _replay((10, 20, 10), num_gpus=1)
    assert sim_job.Job(one, SKU).pools() == {"generation": [0], "training": [0]}
    assert sim_job.Job(one, SKU, "sync").num_gpus == 1
    assert sim_job.Job(one, SKU, "async").num_gpus == 2
    assert sim_job.Job(one, SKU, "async").pools() == {"generation": [0], "training": [1]}
    assert sim_job.Job(one, SKU, "sync", num_gpus=4).num_gpus == 4


def test_async_pools_split_the_gpus_in_halves_and_scale_phase_time() -> None:
    job = sim_job.Job(_replay((10, 20, 10), num_gpus=4), SKU, "async")
    assert job.pools() == {"generation": [0, 1], "training": [2, 3]}
    # Half the trace's GPUs per pool: each phase takes twice its trace time [MODEL].
    assert job.pool_time_scale("generation") == 2.0
    assert job.pool_time_scale("training") == 2.0
    wide = sim_job.Job(_replay((10, 20, 10), num_gpus=2), SKU, "async", num_gpus=4)
    assert wide.pool_time_scale("training") == 1.0


def test_same_seed_same_run_other_seed_other_run() -> None:
    """With the catalog's noise: a seed fixes every draw (paired comparisons rely on it)."""
    replay = _replay((10, 20, 10), (12, 18, 10), shape=2.0)

    def play(seed: int) -> tuple[list[sim_job.StepResult], list[base.StepObservation]]:
        policy = _Scripted({"generation": _probe((None, 500), 1.0)})
        results, _ = sim_job.run_job(sim_job.Job(replay, SKU, seed=seed), policy)
        return results, policy.observed

    first, again, other = play(3), play(3), play(4)
    assert first == again
    assert first[0][0].energy_j != other[0][0].energy_j
    assert first[0][1].measured_energy_j != other[0][1].measured_energy_j
    # the slices' token jitter too
    first_slice, other_slice = (o[1][0].phases["generation"].slices[0] for o in (first, other))
    assert first_slice.progress != other_slice.progress
    spread = sim_job.Job(replay, SKU, seed=3).power_spread
    assert spread == sim_job.Job(replay, SKU, seed=3).power_spread


# ----- analytic truth and baselines --------------------------------------------------------------
def test_default_run_totals_and_energy_per_valid_token(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10)), SKU)
    d = sim_job.default_run(job)
    # generation 10 s x 200 W x 2 GPUs, training 20 s x 300 W x 2, idle 10 s x 50 W x 2
    assert d.time_s == pytest.approx(40.0)
    assert d.energy_j == pytest.approx(4000.0 + 12000.0 + 1000.0)
    assert d.phase_time_s == pytest.approx({"generation": 10.0, "training": 20.0})
    assert d.phase_energy_j == pytest.approx({"generation": 4000.0, "training": 12000.0})
    assert d.valid_tokens == VALID_TOKENS
    assert d.energy_per_valid_token_j == pytest.approx(17.0)


def test_fixed_clocks_saving_against_the_default_and_the_held_lock_at_idle(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10)), SKU)
    both = sim_job.fixed_run(job, {"generation": 500, "training": 800})
    # generation 15 s x 87.5 W x 2, training 23.75 s x 228 W x 2, idle holds training's lock
    assert both.phase_time_s == pytest.approx({"generation": 15.0, "training": 23.75})
    assert both.phase_energy_j == pytest.approx({"generation": 2625.0, "training": 10830.0})
    assert both.time_s == pytest.approx(48.75)
    assert both.energy_j == pytest.approx(2625.0 + 10830.0 + 60.0 * 2 * 10)
    saving = 1 - both.energy_j / sim_job.default_run(job).energy_j
    assert saving == pytest.approx(1 - 14655.0 / 17000.0)
    # Only generation locked: the GPUs idle after training unlocked (50 W).
    gen_only = sim_job.fixed_run(job, {"generation": 500})
    assert gen_only.time_s == pytest.approx(45.0)
    assert gen_only.energy_j == pytest.approx(2625.0 + 12000.0 + 50.0 * 2 * 10)
    step = job.replay.steps[0]
    t, e, times, energies = job.step_truth(step, {"training": 800})
    assert (t, e) == pytest.approx((43.75, 4000.0 + 10830.0 + 1200.0))
    assert times == pytest.approx({"generation": 10.0, "training": 23.75})
    assert energies == pytest.approx({"generation": 4000.0, "training": 10830.0})


def test_fixed_run_sums_every_step(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10), (20, 10, 5)), SKU)
    tot = sim_job.fixed_run(job, {"generation": 500, "training": 800})
    # step 2: generation 30 s x 87.5 W x 2, training 11.875 s x 228 W x 2, idle 5 s x 60 W x 2
    assert tot.phase_time_s == pytest.approx({"generation": 45.0, "training": 35.625})
    assert tot.phase_energy_j == pytest.approx({"generation": 7875.0, "training": 16245.0})
    assert tot.time_s == pytest.approx(48.75 + 46.875)
    assert tot.energy_j == pytest.approx(14655.0 + 11265.0)
    assert tot.valid_tokens == 2 * VALID_TOKENS
    assert tot.energy_per_valid_token_j == pytest.approx(25920.0 / 2000.0)


def test_power_limit_caps_each_phase_by_its_own_power_curve(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10)), SKU)
    # 228 W: generation (200 W at boost) runs free; training settles at 800 MHz (228 W).
    capped = sim_job.fixed_run(job, {}, power_limit_w=228.0)
    assert capped.phase_time_s == pytest.approx({"generation": 10.0, "training": 23.75})
    assert capped.phase_energy_j == pytest.approx({"generation": 4000.0, "training": 10830.0})
    assert capped.energy_j == pytest.approx(4000.0 + 10830.0 + 1000.0)
    assert job.phase_truth(job.replay.steps[0], "generation", None, 228.0) == pytest.approx(
        (10.0, 4000.0)
    )


def test_async_step_idles_each_pool_at_its_own_lock(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10)), SKU, "async", num_gpus=4)
    tot = sim_job.fixed_run(job, {"generation": 500})
    # generation pool: 15 s then 15 s idle locked (60 W); training pool: 20 s then 10 s at 50 W
    assert tot.time_s == pytest.approx(30.0)
    assert tot.energy_j == pytest.approx(2625.0 + 12000.0 + 60.0 * 2 * 15 + 50.0 * 2 * 10)
    t, e, _, _ = job.step_truth(job.replay.steps[0], {"training": 800})
    # training 23.75 s is the slower pool: generation idles 23.75 s unlocked, training 10 s locked
    assert t == pytest.approx(33.75)
    assert e == pytest.approx(4000.0 + 10830.0 + 50.0 * 2 * 23.75 + 60.0 * 2 * 10)


# ----- oracle ----------------------------------------------------------------------------------
def _sync_long_idle() -> sim_job.Job:
    """Sync, 2 GPUs, 50 s of idle per step: locking training costs 10 W x 2 x 50 s = 1000 J."""
    return sim_job.Job(_replay((10, 20, 50)), SKU)


def test_sync_oracle_takes_the_lowest_energy_clock_down_to_half_of_max(quiet: None) -> None:
    thresholds = {"generation": 0.5, "training": 0.5}
    orc = sim_job.oracle(_sync_long_idle(), thresholds, idle_locked=True)
    # generation energy falls to 400 MHz (2590 J) but the grid stops at 500 MHz (2625 J);
    # training: 600 MHz (10320 J + 6000 J idle locked) beats 500 MHz (10500 J) and the default
    # (12000 J + 5000 J).
    assert orc.clocks_mhz == {"generation": 500, "training": 600}
    assert orc.totals.energy_j == pytest.approx(2625.0 + 10320.0 + 6000.0)
    assert orc.totals.time_s == pytest.approx(15.0 + 30.0 + 50.0)
    # The agent's per-phase clocks (the default): released at the idle signal, 50 W idle.
    agent = sim_job.oracle(_sync_long_idle(), thresholds)
    assert agent.clocks_mhz == {"generation": 500, "training": 600}
    assert agent.totals.energy_j == pytest.approx(2625.0 + 10320.0 + 5000.0)


def test_sync_oracle_threshold_is_inclusive_and_counts_the_locked_idle(quiet: None) -> None:
    exactly_800 = 10.0 / 11.25  # generation's throughput ratio at 800 MHz
    thresholds = {"generation": exactly_800, "training": 0.92}
    orc = sim_job.oracle(_sync_long_idle(), thresholds, idle_locked=True)
    # training at 900 MHz (ratio 0.923) saves 646.7 J but its lock costs 1000 J of idle
    assert orc.clocks_mhz == {"generation": 800, "training": None}
    # released at the idle signal, the lock costs no idle: 900 MHz saves its 646.7 J
    agent = sim_job.oracle(_sync_long_idle(), thresholds)
    assert agent.clocks_mhz == {"generation": 800, "training": 900}


def test_sync_oracle_candidates_and_default_threshold(quiet: None) -> None:
    orc = sim_job.oracle(
        _sync_long_idle(),
        {"training": 0.92},
        candidates_mhz={"generation": [950, 900]},
        idle_locked=True,
    )
    # generation's threshold defaults to 0.95: 950 MHz (ratio 0.974) qualifies, 900 (0.947) not
    assert orc.clocks_mhz == {"generation": 950, "training": None}


def _async(gen_s: float, train_s: float) -> sim_job.Job:
    """Async, 4 GPUs (2 per pool) of a 2-GPU trace: phase times as in the trace."""
    return sim_job.Job(_replay((gen_s, train_s, 10)), SKU, "async", num_gpus=4)


def test_async_oracle_slows_the_faster_pool_for_free(quiet: None) -> None:
    job = _async(10, 20)
    orc = sim_job.oracle(job, {"generation": 1.0, "training": 1.0}, idle_locked=True)
    # generation at 500 MHz takes 15 s < training's 20 s: step time unchanged, ratio exactly 1
    assert orc.clocks_mhz == {"generation": 500, "training": None}
    assert orc.totals.time_s == pytest.approx(30.0)
    assert orc.totals.energy_j == pytest.approx(2625.0 + 12000.0 + 1800.0 + 1000.0)
    agent = sim_job.oracle(job, {"generation": 1.0, "training": 1.0})  # 15 s idle at 50 W
    assert agent.totals.energy_j == pytest.approx(2625.0 + 12000.0 + 1500.0 + 1000.0)
    # 950 MHz saves 195 J of generation energy but idles locked: 6173 J vs 6000 J unlocked
    near = sim_job.oracle(
        job, {"generation": 1.0}, candidates_mhz={"generation": [950]}, idle_locked=True
    )
    assert near.clocks_mhz == {"generation": None, "training": None}
    assert sim_job.oracle(
        job, {"generation": 1.0}, candidates_mhz={"generation": [950]}
    ).clocks_mhz == {"generation": 950, "training": None}
    # training at 800/900 MHz would slow the step below 0.95 of the default's throughput
    slow = sim_job.oracle(job, {"generation": 0.95}, candidates_mhz={"training": [800, 900]})
    assert slow.clocks_mhz == {"generation": 500, "training": None}


def test_async_oracle_uses_the_lowest_threshold_end_to_end(quiet: None) -> None:
    job = _async(30, 10)
    # generation is the slower pool: 900 MHz (31.67 s, step ratio 0.96) passes the lowest
    # threshold 0.95; training at 500 MHz (17.5 s) still finishes first.
    want = {"generation": 900, "training": 500}
    assert sim_job.oracle(job, {"generation": 0.95, "training": 1.0}).clocks_mhz == want
    assert sim_job.oracle(job, {}).clocks_mhz == want  # no thresholds: 0.95
    cands = sim_job.oracle(job, {}, candidates_mhz={"generation": [800, 900]})
    assert cands.clocks_mhz == want  # 800 MHz: step ratio 0.914
    # training at 950 MHz saves 168 J but idles locked: 60 W x 2 x 31.27 s = 3753 J against
    # 50 W x 2 x 31.67 s = 3167 J unlocked
    idle = sim_job.oracle(job, {}, candidates_mhz={"training": [950]}, idle_locked=True)
    assert idle.clocks_mhz == {"generation": 900, "training": None}


# ----- run_job: what it measures and reports -----------------------------------------------------
def test_run_reports_truth_measurement_and_the_plan_per_step(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10), (20, 10, 5)), SKU)
    plan = {
        "generation": base.PhaseDecision(500, base.PhaseState.LOCKED),
        "training": base.PhaseDecision(800, base.PhaseState.TRIAL),
    }
    policy = _Scripted(plan)
    started: list[Sequence[sim_gpu.SimulatedGpu]] = []
    seen: list[sim_job.StepResult] = []
    results, gpus = sim_job.run_job(
        job, policy, on_start=started.append, on_step=seen.append, idle_unlocked=False
    )
    assert started == [gpus] and len(gpus) == 2
    assert seen == results
    assert policy.decided == [0, 1]
    r = results[0]
    assert r.index == 0 and results[1].index == 1
    assert r.time_s == pytest.approx(48.75)
    assert r.energy_j == pytest.approx(14655.0)
    assert r.measured_energy_j == pytest.approx(14655.0, abs=1e-6)
    assert results[1].measured_energy_j == pytest.approx(11265.0, abs=1e-6)
    assert r.phase_time_s == pytest.approx({"generation": 15.0, "training": 23.75})
    assert r.phase_energy_j == pytest.approx({"generation": 2625.0, "training": 10830.0})
    assert r.clocks_mhz == {"generation": 500, "training": 800}
    assert r.states == {"generation": "locked", "training": "trial"}
    assert r.probing == {"generation": False, "training": False}
    tot = sim_job.totals(job, results)
    assert tot.time_s == pytest.approx(95.625)
    assert tot.energy_j == pytest.approx(25920.0)
    assert tot.phase_time_s == pytest.approx({"generation": 45.0, "training": 35.625})
    assert tot.phase_energy_j == pytest.approx({"generation": 7875.0, "training": 16245.0})
    assert tot.valid_tokens == 2 * VALID_TOKENS
    assert tot.energy_per_valid_token_j == pytest.approx(12.96)
    # What the policy was told: the step, its workload and each phase's measurement.
    obs = policy.observed[0]
    assert obs.step == 0 and obs.workload == job.replay.steps[0].workload
    gen, train = obs.phases["generation"], obs.phases["training"]
    assert (gen.phase, gen.requested_clock_mhz, gen.applied_clock_mhz) == ("generation", 500, 500)
    assert (train.phase, train.requested_clock_mhz) == ("training", 800)
    assert train.applied_clock_mhz == 800
    assert gen.duration_s == pytest.approx(15.0) and train.duration_s == pytest.approx(23.75)
    assert gen.energy_j == pytest.approx(2625.0, abs=1e-6)
    assert train.energy_j == pytest.approx(10830.0, abs=1e-6)
    assert gen.slowdown is False and train.slowdown is False
    assert gen.error is None and train.error is None
    assert gen.slices == () and train.slices == ()
    assert [o.step for o in policy.observed] == [0, 1]
    assert all(g.locked_sm_clocks_mhz is None for g in gpus)


def test_async_run_measures_each_pool_and_its_idle(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10), num_gpus=1), SKU, "async")
    # Training is not in the plan: it runs at the default governor.
    results, _ = sim_job.run_job(job, base.FixedClocks({"generation": 500}), idle_unlocked=False)
    r = results[0]
    # generation GPU: 15 s x 87.5 W, then 15 s idle locked at 60 W; training GPU: 20 s x 300 W,
    # then 10 s at 50 W. The pools start together.
    want = 1312.5 + 900.0 + 6000.0 + 500.0
    assert r.time_s == pytest.approx(30.0)
    assert r.energy_j == pytest.approx(want)
    assert r.measured_energy_j == pytest.approx(want, abs=1e-6)
    assert r.clocks_mhz == {"generation": 500}
    # The agent (the default) resets the generation GPU at its idle signal: 15 s at 50 W. The
    # policy is told each pool's idle: its energy, GPU-seconds and GPUs.
    policy = _Scripted({"generation": base.PhaseDecision(500, base.PhaseState.LOCKED)})
    agent_run, _ = sim_job.run_job(job, policy)
    unlocked = 1312.5 + 750.0 + 6000.0 + 500.0
    assert agent_run[0].energy_j == pytest.approx(unlocked)
    assert agent_run[0].measured_energy_j == pytest.approx(unlocked, abs=1e-6)
    idle = policy.observed[0].pool_idle
    assert idle["generation"] == base.PoolIdle(pytest.approx(750.0, abs=1e-6), 15.0, 1)
    assert idle["training"] == base.PoolIdle(pytest.approx(500.0, abs=1e-6), 10.0, 1)


def test_probe_slices_cycle_the_clocks_and_carry_progress_and_energy(
    quiet: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sim_job, "TOKEN_RATE_SIGMA_1S", 0.0)
    # Generation: 4 s at boost, progress shape 2: F(x) = (2x + x**2) / 3.
    job = sim_job.Job(_replay((4, 2, 1), shape=2.0), SKU)
    policy = _Scripted({"generation": _probe((None, 500), 1.0)})
    results, _ = sim_job.run_job(job, policy)
    gen = policy.observed[0].phases["generation"]
    # 1 s slices: default covers 1/4 of the work per slice, 500 MHz 1/6; the last default slice
    # has 1/6 left (2/3 s). Work fractions 0, 1/4, 5/12, 2/3, 5/6, 1; F x 4320 tokens:
    # 0, 810, 1450, 2560, 3400, 4320.
    assert [s.clock_mhz for s in gen.slices] == [None, 500, None, 500, None]
    assert [s.duration_s for s in gen.slices] == pytest.approx([1, 1, 1, 1, 2 / 3])
    assert [s.progress for s in gen.slices] == pytest.approx([810, 640, 1110, 840, 920])
    # instant power x slice length over both GPUs: 200 W at default, 87.5 W at 500 MHz
    assert [s.energy_j for s in gen.slices] == pytest.approx([400, 175, 400, 175, 800 / 3])
    assert gen.duration_s == pytest.approx(14 / 3)
    assert gen.requested_clock_mhz is None and gen.applied_clock_mhz == 500
    r = results[0]
    assert r.phase_energy_j["generation"] == pytest.approx(400 + 175 + 400 + 175 + 800 / 3)
    assert r.probing == {"generation": True}
    assert r.states == {"generation": "trial"}
    assert r.clocks_mhz == {"generation": None}
    # Training (not in the plan) ran whole at the default governor.
    assert policy.observed[0].phases["training"].slices == ()
    assert r.phase_time_s["training"] == pytest.approx(2.0)


def test_probe_clocks_are_taken_in_order(quiet: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_job, "TOKEN_RATE_SIGMA_1S", 0.0)
    job = sim_job.Job(_replay((1, 2, 1)), SKU)
    policy = _Scripted({"training": _probe((800, 500, None), 0.25)})
    sim_job.run_job(job, policy)
    slices = policy.observed[0].phases["training"].slices
    assert [s.clock_mhz for s in slices[:4]] == [800, 500, None, 800]
    # training reports all its tokens (prompt + response), in proportion to work (shape 1)
    assert sum(s.progress for s in slices) == pytest.approx(PROMPT_TOKENS + RESPONSE_TOKENS)


@pytest.mark.parametrize(
    ("boost_s", "slice_s", "sigma"),
    [(100.0, 0.25, 0.02 / math.sqrt(0.25)), (1.0, 0.0025, 0.2)],
    ids=["grows-as-1/sqrt(slice)", "capped-at-0.2"],
)
def test_slice_progress_jitter(quiet: None, boost_s: float, slice_s: float, sigma: float) -> None:
    """Token throughput jitter per slice: 0.02 over 1 s, growing as 1/sqrt(slice), at most 0.2."""
    job = sim_job.Job(_replay((1, boost_s, 1)), SKU)
    policy = _Scripted({"training": _probe((None,), slice_s)})
    sim_job.run_job(job, policy)
    slices = [s for s in policy.observed[0].phases["training"].slices if s.duration_s > slice_s / 2]
    tokens = PROMPT_TOKENS + RESPONSE_TOKENS
    logs = [math.log(s.progress / (tokens * s.duration_s / boost_s)) for s in slices]
    mean = sum(logs) / len(logs)
    std = math.sqrt(sum((v - mean) ** 2 for v in logs) / (len(logs) - 1))
    assert len(logs) == 400
    assert abs(mean) < 3 * sigma / math.sqrt(len(logs))
    assert std == pytest.approx(sigma, rel=0.15)


def test_power_capped_phase_reports_slowdown_and_the_clock_it_ran(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10)), SKU)
    policy = _Scripted({})

    def cap(gpus: Sequence[sim_gpu.SimulatedGpu]) -> None:
        for g in gpus:
            g.set_power_limit_mw(160_000)

    sim_job.run_job(job, policy, on_start=cap)
    gen, train = (policy.observed[0].phases[p] for p in ("generation", "training"))
    # 160 W: generation settles at 856 MHz (read back as 800), training at 548 MHz (500)
    assert (gen.slowdown, gen.applied_clock_mhz) == (True, 800)
    assert (train.slowdown, train.applied_clock_mhz) == (True, 500)
    # each phase runs at its own capped clock: 1000 sqrt(110/150) and 1000 sqrt(60/200) MHz
    f_gen, f_train = 1000 * math.sqrt(110 / 150), 1000 * math.sqrt(60 / 200)
    assert gen.duration_s == pytest.approx(10 * (500 / f_gen + 0.5))
    assert train.duration_s == pytest.approx(20 * (750 / f_train + 0.25))


def test_energy_unknown_while_the_counter_is_unsupported_and_back_after(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10), (10, 20, 10), (10, 20, 10)), SKU)
    policy = _Scripted({"generation": base.PhaseDecision(500, base.PhaseState.LOCKED)})
    faults = {1: [sim_gpu.Fault.ENERGY_NOT_SUPPORTED], 2: []}
    results, _ = sim_job.run_job(job, policy, faults=faults)
    want = 2625.0 + 12000.0 + 1000.0
    assert [r.energy_j for r in results] == pytest.approx([want] * 3)
    assert results[0].measured_energy_j == pytest.approx(want, abs=1e-6)
    assert results[1].measured_energy_j is None
    assert policy.observed[1].phases["generation"].energy_j is None
    assert results[2].measured_energy_j == pytest.approx(want, abs=1e-6)


def test_refused_lock_is_reported_and_the_phase_runs_at_default(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10)), SKU)
    policy = _Scripted({"generation": base.PhaseDecision(500, base.PhaseState.LOCKED)})
    results, _ = sim_job.run_job(job, policy, faults={0: [sim_gpu.Fault.NO_PERMISSION]})
    gen, train = (policy.observed[0].phases[p] for p in ("generation", "training"))
    assert gen.error is not None and gen.error.startswith("GpuNoPermissionError: ")
    assert (gen.requested_clock_mhz, gen.applied_clock_mhz) == (500, 1000)
    assert train.error is None  # the default governor needs no write
    assert results[0].energy_j == pytest.approx(17000.0)
    assert results[0].clocks_mhz == {"generation": 500}  # what was planned


def test_lost_gpu_leaves_clock_and_energy_unknown(quiet: None) -> None:
    job = sim_job.Job(_replay((10, 20, 10)), SKU)
    policy = _Scripted({})
    results, _ = sim_job.run_job(job, policy, faults={0: [sim_gpu.Fault.LOST]})
    gen = policy.observed[0].phases["generation"]
    assert gen.error is not None and gen.error.startswith("GpuLostError: ")
    assert gen.applied_clock_mhz is None and gen.energy_j is None
    assert results[0].measured_energy_j is None
    assert results[0].energy_j == pytest.approx(17000.0)


def test_the_oracle_held_above_its_thresholds_saves_no_more_than_the_oracle() -> None:
    """``simulate(oracle_margins=...)``: the oracle searched again with every threshold raised
    by each margin; a wider margin can only cost saving, 0 is the oracle itself, a negative
    margin is refused before the run."""
    trace = "verl-gpg-qwen2-7b-fsdp-8gpu"
    rep = report.simulate(trace, "h100-sxm", steps=20, oracle_margins=(0.0, 0.002, 0.005, 0.02))
    held = rep.margin_oracle_saving
    assert held[0.0] == pytest.approx(rep.oracle_saving)
    assert held[0.0] >= held[0.002] >= held[0.005] >= held[0.02]
    assert held[0.02] < rep.oracle_saving  # 2 points above 0.95 costs a clock step or more
    assert report.simulate(trace, "h100-sxm", steps=2).margin_oracle_saving == {}
    with pytest.raises(errors.InvalidInputError, match="oracle_margins"):
        report.simulate(trace, "h100-sxm", steps=2, oracle_margins=(-0.01,))


def _result(
    index: int,
    energy_j: Mapping[str, float],
    idle_j: float,
    states: Mapping[str, str],
    clocks_mhz: Mapping[str, int | None] | None = None,
    probing: Mapping[str, bool] | None = None,
) -> sim_job.StepResult:
    return sim_job.StepResult(
        index=index,
        time_s=0.0,
        energy_j=sum(energy_j.values()) + idle_j,
        measured_energy_j=None,
        phase_time_s={},
        phase_energy_j=dict(energy_j),
        clocks_mhz=dict(clocks_mhz or {}),
        states=dict(states),
        probing=dict(probing or {}),
    )


def test_learning_cost_splits_each_window_above_the_held_run_by_what_it_ran(quiet: None) -> None:
    """Against the held clocks (generation 500 MHz, training 800 MHz; per step 2625 J, 10830 J
    and 50 W x 2 GPUs x 10 s = 1000 J of unlocked idle), each window's excess goes to what it
    ran; the parts are points of the default run's 4 x 17000 J."""
    job = sim_job.Job(_replay(*[(10, 20, 10)] * 4), SKU)
    gen, train = "generation", "training"
    results = [
        _result(0, {gen: 4000.0, train: 12000.0}, 1000.0, {gen: "warmup", train: "warmup"}),
        _result(
            1,
            {gen: 3000.0, train: 11000.0},
            1000.0,
            {gen: "trial", train: "trial"},
            {train: 900},
            {gen: True},
        ),
        _result(
            2,
            {gen: 2800.0, train: 10830.0},
            1200.0,
            {gen: "locked", train: "locked"},
            {gen: 600, train: 800},
        ),
        _result(
            3,
            {gen: 2625.0, train: 12000.0},
            1000.0,
            {gen: "locked", train: "fallback"},
            {gen: 500},
        ),
    ]
    cost = report.learning_cost(
        job, results, {gen: 500, train: 800}, {gen: 500, train: 800}, 4 * 17000.0
    )
    assert list(cost) == list(report.COST_PARTS)
    pp = 100.0 / 68000.0
    assert cost == pytest.approx(
        {
            "warm-up": (1375.0 + 1170.0) * pp,
            "probes": 375.0 * pp,
            "interim clocks": (170.0 + 175.0) * pp,  # a trial window and a lock at 600 MHz
            "lock offset": 0.0,  # generation at 500 MHz in step 3, training at 800 in step 2
            "fallback": 1170.0 * pp,
            "idle": 200.0 * pp,
        }
    )


def test_learning_cost_is_the_held_oracles_saving_less_the_online_saving() -> None:
    """On a whole simulated run (noise on), the parts sum to the gap of the savings, and the
    warm-up's default-governor steps cost energy against a clock-saving oracle."""
    for mode in ("sync", "async"):
        rep = report.simulate(
            "verl-gpg-qwen2-7b-fsdp-8gpu", "b200", mode, steps=30, oracle_margins=(0.002,)
        )
        cost = rep.learning_cost_pp[0.002]
        gap_pp = 100.0 * (rep.margin_oracle_saving[0.002] - rep.online_saving)
        assert sum(cost.values()) == pytest.approx(gap_pp, abs=1e-9)
        assert cost["warm-up"] > 0.0
        assert rep.online_to_held(0.002) == pytest.approx(
            rep.online_saving / rep.margin_oracle_saving[0.002]
        )
    with pytest.raises(KeyError):
        rep.online_to_held(0.005)
