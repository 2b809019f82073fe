"""The NVML backend through the real pynvml on the stand-in library."""

from __future__ import annotations

import pytest
from agent_support import DriverFactory
from rlenergy_agent.nvml import backend, lib
from rlenergy_dev import standin

from rlenergy.gpu import base, errors, models


def test_nvml_gpu_satisfies_the_gpu_protocol(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    found = backend.discover()
    assert list(found.gpus) == list(drv.uuids)
    gpu = found.gpus[drv.uuids[0]]
    assert isinstance(gpu, base.Gpu)
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert found.driver_version == "550.54.15"
    clocks = gpu.supported_sm_clocks_mhz()
    assert clocks[0] == 1980 and clocks[-1] == 345 and list(clocks) == sorted(clocks, reverse=True)
    assert gpu.max_sm_clock_mhz() == 1980
    assert gpu.power_limit_mw() == 700_000
    assert gpu.total_energy_mj() == 123_456_789
    assert gpu.clock_event_reasons() == {base.ClockEventReason.GPU_IDLE}


def test_lock_reads_back_and_energy_follows_the_simulated_physics(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    gpu = backend.discover().gpus[drv.uuids[0]]
    drv.set_work(drv.uuids, "training")
    gpu.set_locked_sm_clocks(1500, 1500)
    drv.advance(2.0)
    assert drv.gpu(drv.uuids[0]).locked == 1
    assert gpu.sm_clock_mhz() == 1500
    sku = models.get_sku("h100-sxm")
    expected_w = sku.power_w("training", 1500)
    assert gpu.instant_power_mw() == int(expected_w * 1000)
    assert gpu.total_energy_mj() - 123_456_789 == int(expected_w * 2.0 * 1000)
    gpu.reset_locked_sm_clocks()
    assert drv.gpu(drv.uuids[0]).locked == 0


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (standin.NO_PERMISSION, errors.GpuNoPermissionError),
        (standin.NOT_SUPPORTED, errors.GpuNotSupportedError),
        (standin.GPU_IS_LOST, errors.GpuLostError),
        (standin.NOT_READY, errors.GpuTransientError),
        (standin.UNKNOWN, errors.GpuTransientError),
    ],
)
def test_nvml_codes_map_to_the_typed_error_tree(
    make_driver: DriverFactory, code: int, error: type[errors.GpuError]
) -> None:
    drv = make_driver(1)
    gpu = backend.discover().gpus[drv.uuids[0]]
    drv.gpu(drv.uuids[0]).fail_clock_set = code
    with pytest.raises(error) as info:
        gpu.set_locked_sm_clocks(1500, 1500)
    assert info.value.uuid == drv.uuids[0]
    assert drv.gpu(drv.uuids[0]).locked == 0


def test_case3_capabilities_are_probed_per_gpu_on_a_mixed_node(
    make_driver: DriverFactory,
) -> None:
    # Clock APIs differ per GPU generation: GPU0 = V100 (Volta), GPU1 = A100 (Ampere); the memory lock is NOT_SUPPORTED on
    # GPU0 only; SM locked clocks (the primary API) work on both; nothing exits.
    drv = make_driver(2)
    v100, a100 = drv.uuids
    drv.gpu(v100).architecture = standin.ARCH_VOLTA
    drv.gpu(a100).architecture = standin.ARCH_AMPERE
    drv.set_work(drv.uuids, "generation")
    found = backend.discover()
    with pytest.raises(errors.GpuNotSupportedError):
        found.gpus[v100].set_locked_memory_clocks(877, 877)
    found.gpus[a100].set_locked_memory_clocks(1215, 1215)
    for u in (v100, a100):
        found.gpus[u].set_locked_sm_clocks(1200, 1200)
        assert found.gpus[u].sm_clock_mhz() == 1200
    caps = {u: found.gpus[u].probe() for u in (v100, a100)}
    assert caps[v100].architecture == standin.ARCH_VOLTA
    assert not caps[v100].instant_power and caps[v100].energy_counter  # Volta: counter, no field
    assert caps[a100].architecture == standin.ARCH_AMPERE


def test_case8_probe_is_cached_and_the_failing_api_is_not_called_again(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    drv.gpu(drv.uuids[0]).architecture = standin.ARCH_PASCAL
    gpu = backend.discover().gpus[drv.uuids[0]]
    caps = gpu.probe()
    assert not caps.energy_counter and not caps.instant_power and caps.power_usage
    calls = lib.CALL_STATS["nvmlDeviceGetTotalEnergyConsumption"].calls
    assert gpu.probe() is caps
    assert lib.CALL_STATS["nvmlDeviceGetTotalEnergyConsumption"].calls == calls


def test_case9_all_telemetry_unsupported_is_telemetry_unavailable(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    g = drv.gpu(drv.uuids[0])
    g.fail_energy = g.fail_power = g.fail_clocks = standin.NOT_SUPPORTED
    gpu = backend.discover().gpus[drv.uuids[0]]
    caps = gpu.probe()
    assert caps.telemetry is False
    assert not caps.clock_list and not caps.clock_readback


def test_case7_mig_gpu_counts_once_and_lists_its_instances(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    g = drv.gpu(drv.uuids[0])
    g.mig_mode, g.mig_count = 1, 7
    found = backend.discover()
    assert len(found.gpus) == 2  # one physical device, not 7
    gpu = found.gpus[drv.uuids[0]]
    assert gpu.probe().mig
    assert len(gpu.mig_uuids) == 7 and all(u.startswith("MIG-") for u in gpu.mig_uuids)
    assert found.gpus[drv.uuids[1]].mig_uuids == ()


def test_case10_a_lost_gpu_at_enumeration_leaves_the_others(make_driver: DriverFactory) -> None:
    drv = make_driver(3)
    drv.gpu(drv.uuids[1]).fail_all = standin.GPU_IS_LOST
    found = backend.discover()
    assert set(found.gpus) == {drv.uuids[0], drv.uuids[2]}
    assert list(found.lost) == [1]


def test_case11b_version_mismatch_is_a_clear_error(make_driver: DriverFactory) -> None:
    drv = make_driver(1)
    drv.state.init_error = standin.LIB_RM_VERSION_MISMATCH
    with pytest.raises(lib.NvmlUnavailableError) as info:
        backend.discover()
    assert info.value.code == standin.LIB_RM_VERSION_MISMATCH
    assert "version mismatch" in str(info.value) and "restart the agent" in str(info.value)


def test_missing_library_says_the_container_toolkit_injects_it(
    make_driver: DriverFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_driver(1)
    monkeypatch.delenv(standin.STATE_ENV)  # the stand-in then answers DRIVER_NOT_LOADED
    with pytest.raises(lib.NvmlUnavailableError) as info:
        backend.discover()
    assert "NVIDIA container toolkit" in str(info.value)
    assert "libnvidia-ml" in str(info.value)


def test_case15_uuids_not_indices(make_driver: DriverFactory) -> None:
    drv = make_driver(4)
    found = backend.discover()
    target = drv.uuids[2]
    found.gpus[target].set_locked_sm_clocks(1200, 1200)
    locked = [u for u in drv.uuids if drv.gpu(u).locked]
    assert locked == [target]
