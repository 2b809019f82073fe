"""SimulatedGpu: the GPU protocol, NVML-like sensors and typed faults."""

import pytest

from rlenergy.gpu import base, errors, models
from rlenergy.gpu import simulated as sim_gpu


@pytest.fixture
def gpu() -> sim_gpu.SimulatedGpu:
    return sim_gpu.SimulatedGpu(models.get_sku("h100-sxm"), "GPU-test-0", seed=3)


def test_satisfies_the_gpu_protocol(gpu: sim_gpu.SimulatedGpu) -> None:
    assert isinstance(gpu, base.Gpu)


def test_energy_counter_is_monotone_and_updates_every_20_to_100_ms(
    gpu: sim_gpu.SimulatedGpu,
) -> None:
    readings = []
    for _ in range(400):
        gpu.execute("generation", 0.005)
        readings.append(gpu.total_energy_mj())
    assert all(b >= a for a, b in zip(readings, readings[1:], strict=False))
    changes = sum(1 for a, b in zip(readings, readings[1:], strict=False) if b != a)
    # 2 s of readings every 5 ms: between 2 s / 100 ms = 20 and 2 s / 20 ms = 100 updates.
    assert 20 <= changes <= 100


def test_counter_window_matches_truth_over_a_long_phase(gpu: sim_gpu.SimulatedGpu) -> None:
    start = gpu.total_energy_mj()
    truth = gpu.execute("training", 30.0)
    end = gpu.total_energy_mj()
    assert (end - start) / 1000.0 == pytest.approx(truth, rel=0.01)


def test_lock_above_power_cap_is_accepted_but_runs_lower() -> None:
    g = sim_gpu.SimulatedGpu(models.get_sku("b200"), "GPU-b200", seed=1)
    g.set_locked_sm_clocks(1965, 1965)
    g.execute("training", 1.0)
    assert g.sm_clock_mhz() < 1965
    assert base.ClockEventReason.SW_POWER_CAP in g.clock_event_reasons()


def test_faults_raise_typed_errors(gpu: sim_gpu.SimulatedGpu) -> None:
    gpu.inject(sim_gpu.Fault.NO_PERMISSION)
    with pytest.raises(errors.GpuNoPermissionError):
        gpu.set_locked_sm_clocks(1200, 1200)
    gpu.clear_faults()
    gpu.inject(sim_gpu.Fault.ENERGY_NOT_SUPPORTED)
    with pytest.raises(errors.GpuNotSupportedError):
        gpu.total_energy_mj()
    gpu.clear_faults()
    gpu.inject(sim_gpu.Fault.LOST)
    with pytest.raises(errors.GpuLostError):
        gpu.sm_clock_mhz()


def test_unsupported_clock_is_refused(gpu: sim_gpu.SimulatedGpu) -> None:
    with pytest.raises(errors.GpuTransientError, match="supported"):
        gpu.set_locked_sm_clocks(100, 100)


def test_counter_reset_goes_back_near_zero(gpu: sim_gpu.SimulatedGpu) -> None:
    gpu.execute("training", 5.0)
    before = gpu.total_energy_mj()
    gpu.reset_energy_counter()
    gpu.execute("training", 1.0)
    assert gpu.total_energy_mj() < before


def test_power_reading_is_a_trailing_average(gpu: sim_gpu.SimulatedGpu) -> None:
    gpu.execute("idle", 2.0)
    gpu.execute("training", 0.25)
    avg_w = gpu.power_usage_mw() / 1000
    instant_w = gpu.instant_power_mw() / 1000
    assert avg_w < 0.6 * instant_w  # the 1 s average still holds mostly idle power
