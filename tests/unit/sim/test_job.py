"""The job runner: measurement vs truth, baselines, oracle, sync and async accounting."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlenergy.control.freq import base
from rlenergy.gpu import models
from rlenergy.sim import job as sim_job
from rlenergy.sim import traces, workload


def _job(
    mode: sim_job.Mode = "sync", steps: int = 20, trace: str = "verl-gpg-qwen2-7b-fsdp-8gpu"
) -> sim_job.Job:
    sku = models.get_sku("h100-sxm")
    return sim_job.Job(workload.from_trace(traces.load_trace(trace), sku, steps), sku, mode, seed=5)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_default_governor_run_matches_the_analytic_default(mode: sim_job.Mode) -> None:
    job = _job(mode)
    results, gpus = sim_job.run_job(job, base.DefaultGovernor(workload.PHASES))
    online = sim_job.totals(job, results)
    default = sim_job.default_run(job)
    assert online.energy_j == pytest.approx(default.energy_j, rel=1e-9)
    assert online.time_s == pytest.approx(default.time_s, rel=1e-9)
    assert all(g.locked_sm_clocks_mhz is None for g in gpus)


def test_measured_phase_energy_is_within_one_percent_of_truth() -> None:
    job = _job(steps=10)
    results, _ = sim_job.run_job(job, base.FixedClocks({"generation": 1410, "training": 1875}))
    for r in results:
        assert r.measured_energy_j == pytest.approx(r.energy_j, rel=0.01)


def test_fixed_clock_run_equals_its_analytic_replay_and_clocks_are_reset_after() -> None:
    job = _job(steps=8)
    clocks = {"generation": 1200, "training": 1800}
    results, gpus = sim_job.run_job(job, base.FixedClocks(clocks))
    assert sim_job.totals(job, results).energy_j == pytest.approx(
        sim_job.fixed_run(job, clocks).energy_j, rel=1e-9
    )
    assert all(g.locked_sm_clocks_mhz is None for g in gpus)


def test_oracle_meets_each_threshold_and_beats_the_default() -> None:
    job = _job(steps=30)
    default = sim_job.default_run(job)
    orc = sim_job.oracle(job, {"generation": 0.95, "training": 0.95})
    for phase in workload.PHASES:
        assert default.phase_time_s[phase] / orc.totals.phase_time_s[phase] >= 0.95 - 1e-9
    assert orc.totals.energy_j < default.energy_j


def test_async_step_waits_for_the_slower_pool() -> None:
    job = _job("async", steps=3)
    step = job.replay.steps[0]
    t, _, times, _ = job.step_truth(step, {})
    assert t == pytest.approx(max(times.values()) + step.other_time_s)


@settings(max_examples=40, deadline=None)
@given(
    gen=st.one_of(
        st.none(), st.sampled_from(models.get_sku("h100-sxm").supported_sm_clocks_mhz()[:80])
    ),
    train=st.one_of(
        st.none(), st.sampled_from(models.get_sku("h100-sxm").supported_sm_clocks_mhz()[:80])
    ),
    mode=st.sampled_from(["sync", "async"]),
)
def test_energy_accounting_is_non_negative_and_sums_across_phases(gen, train, mode) -> None:
    job = _job(mode, steps=4)
    for step in job.replay.steps:
        t, e, times, energies = job.step_truth(step, {"generation": gen, "training": train})
        assert all(v >= 0 for v in energies.values()) and all(v > 0 for v in times.values())
        assert e >= sum(energies.values())  # the rest is idle energy, never negative
        # Idle energy: every GPU idles through the step's gaps (sync), or each pool idles for
        # the step time minus its own phase (async), at the SKU's idle power x its spread.
        idle_w = job.sku.idle_power_w
        spread = {p: sum(job.power_spread[g] for g in gpus) for p, gpus in job.pools().items()}
        if mode == "sync":
            want_idle = idle_w * sum(job.power_spread) * step.other_time_s
        else:
            want_idle = sum(idle_w * spread[p] * (t - times[p]) for p in times)
        assert e - sum(energies.values()) == pytest.approx(want_idle, rel=1e-9)
        assert want_idle >= idle_w * 0.5 * job.num_gpus * step.other_time_s > 0
    tot = sim_job.fixed_run(job, {"generation": gen, "training": train})
    assert tot.energy_j >= sum(tot.phase_energy_j.values()) > 0
