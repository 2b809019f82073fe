"""Power limits in the simulator, the static-clock user, and the hindsight bounds of bench/peers."""

import pytest

from rlenergy.gpu import errors, models
from rlenergy.gpu import simulated as sim_gpu
from rlenergy.sim import job as sim_job
from rlenergy.sim import peers, traces, workload

H100 = models.get_sku("h100-sxm")
B200 = models.get_sku("b200")


def _job(sku: models.GpuSku, mode: sim_job.Mode = "sync", steps: int = 40) -> sim_job.Job:
    trace = traces.load_trace("verl-gpg-qwen2-7b-fsdp-8gpu")
    return sim_job.Job(workload.from_trace(trace, sku, steps), sku, mode, seed=3)


def test_a_power_limit_caps_the_default_governor_and_locks() -> None:
    gpu = sim_gpu.SimulatedGpu(H100, "GPU-pl")
    assert gpu.effective_clock_mhz("training") == H100.max_sm_clock_mhz
    gpu.set_power_limit_mw(450_000)
    capped = gpu.effective_clock_mhz("training")
    assert capped < H100.max_sm_clock_mhz
    assert H100.power_w("training", capped) == pytest.approx(450.0)
    gpu.set_locked_sm_clocks(1980, 1980)
    assert gpu.effective_clock_mhz("training") == pytest.approx(capped)
    assert gpu.power_limit_mw() == 450_000
    gpu.execute("training", 1.0)
    assert gpu.clock_event_reasons() == {sim_gpu.base.ClockEventReason.SW_POWER_CAP}


def test_power_limit_constraints_and_refusals() -> None:
    gpu = sim_gpu.SimulatedGpu(H100, "GPU-pl")
    assert gpu.power_limit_constraints_mw() == (200_000, 700_000)
    assert gpu.default_power_limit_mw() == 700_000
    with pytest.raises(errors.GpuTransientError, match="outside 200000-700000"):
        gpu.set_power_limit_mw(150_000)
    gpu.inject(sim_gpu.Fault.NO_PERMISSION)
    with pytest.raises(errors.GpuNoPermissionError):
        gpu.set_power_limit_mw(500_000)


def test_job_truth_at_a_power_limit_matches_a_run_under_it() -> None:
    job = _job(B200, steps=6)

    class Limit:
        def __init__(self) -> None:
            self.plan = sim_job.base.DefaultGovernor(workload.PHASES)

        def decide(self, step: int) -> sim_job.base.Plan:
            return self.plan.decide(step)

        def observe(self, observation: sim_job.base.StepObservation) -> None:
            pass

    def bind(gpus: object) -> None:
        for g in gpus:  # type: ignore[attr-defined]
            g.set_power_limit_mw(800_000)

    results, _ = sim_job.run_job(job, Limit(), on_start=bind)
    online = sim_job.totals(job, results)
    truth = sim_job.fixed_run(job, {}, 800.0)
    assert online.energy_j == pytest.approx(truth.energy_j, rel=1e-9)
    assert online.time_s == pytest.approx(truth.time_s, rel=1e-9)
    assert truth.time_s > sim_job.default_run(job).time_s


@pytest.mark.parametrize("sku", [H100, B200], ids=lambda s: s.key)
def test_hindsight_bounds_keep_the_threshold_and_never_lose_energy(sku: models.GpuSku) -> None:
    job = _job(sku)
    default = sim_job.default_run(job)
    for bound in (peers.best_static_clock(job, 0.95), peers.best_static_power_limit(job, 0.95)):
        assert peers.throughput(bound.totals, default) >= 0.95 - 1e-12
        assert peers.saving(bound.totals, default) >= 0.0
    clock = peers.best_static_clock(job, 0.95)
    assert clock.setting is not None
    # No single supported clock does better in hindsight.
    for c in (int(clock.setting) + 15, int(clock.setting) - 15):
        other = sim_job.fixed_run(job, dict.fromkeys(workload.PHASES, float(c)))
        if default.time_s / other.time_s >= 0.95:
            assert other.energy_per_valid_token_j >= clock.totals.energy_per_valid_token_j


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_static_sweep_user_pays_for_its_sweep_then_locks_one_clock(mode: sim_job.Mode) -> None:
    job = _job(H100, mode, steps=60)
    sweep = [1830, 1680, 1530, 1380]
    user = peers.StaticSweepUser(workload.PHASES, sweep, 0.95, async_mode=mode == "async")
    results, gpus = sim_job.run_job(job, user)
    assert user.done and user.sweep_steps == 15
    swept = [r.clocks_mhz["generation"] for r in results[: user.sweep_steps]]
    assert swept == [None] * 3 + [c for c in sweep for _ in range(3)]
    after = {r.clocks_mhz["training"] for r in results[user.sweep_steps :]}
    assert after == {user.locked}
    assert all(g.locked_sm_clocks_mhz is None for g in gpus)
    # The lock is one that kept the threshold on the steps it measured.
    if user.locked is not None:
        fixed = sim_job.fixed_run(job, dict.fromkeys(workload.PHASES, float(user.locked)))
        assert sim_job.default_run(job).time_s / fixed.time_s >= 0.93


def test_static_sweep_user_refuses_a_one_step_setting() -> None:
    with pytest.raises(ValueError, match="steps_per_setting"):
        peers.StaticSweepUser(workload.PHASES, [1500], 0.95, steps_per_setting=1)


def test_capture_share_is_the_part_of_the_oracles_lead_over_the_peer_ee_rl_takes() -> None:
    # The oracle saves 10 %, the best online peer 4 %: EE-RL at 8.8 % takes 0.8 of the lead.
    assert peers.capture_share(0.088, 0.04, 0.10) == pytest.approx(0.8)
    assert peers.capture_share(0.10, 0.04, 0.10) == pytest.approx(1.0)
    assert peers.capture_share(0.03, 0.04, 0.10) == pytest.approx(-1 / 6)  # behind the peer
    assert peers.capture_share(0.06, 0.0, 0.10) == pytest.approx(0.6)  # no peer keeps it
    # No lead to take: even with the peer is all there is; behind it, nothing.
    assert peers.capture_share(0.05, 0.05, 0.05) == 1.0
    assert peers.capture_share(0.04, 0.05, 0.05) == 0.0
