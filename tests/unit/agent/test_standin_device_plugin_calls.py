"""The NVML calls NVIDIA's k8s-device-plugin makes, answered by the stand-in as NVML does.

The plugin (tests/integration/agent/test_nvidia_device_plugin.py runs the binary) enumerates
GPUs by minor number, PCI identity and compute capability, ranks allocations by PCIe topology
and NVLink, and checks health by NVML events. Each call is made here through the real pynvml
on the stand-in library, which pynvml loads as ``libnvidia-ml.so.1``.

We test these aspects:
* the device node's minor number is the GPU's place in the state file, in a container that
  sees fewer GPUs too, while the NVML index counts the visible GPUs;
* PCI info: NVIDIA's vendor ID, the board's device ID, a bus ID per GPU in both formats;
* compute capability and brand of the architecture;
* PCIe topology: one switch per pair, one CPU per four, and no NVLink;
* events: the supported types, registration, a wait that times out, Xid 79 once for a GPU the
  driver marks lost, again after it recovers and is lost again, and NOT_SUPPORTED for a type
  the GPU lacks.
"""

from __future__ import annotations

import time

import pynvml
import pytest
from agent_support import DriverFactory
from rlenergy_dev import standin


def _handles() -> list[object]:
    return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]


def test_minor_number_is_the_state_index_and_index_counts_visible_gpus(
    make_driver: DriverFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    drv = make_driver(4)
    u = list(drv.uuids)
    monkeypatch.setenv(f"{standin.VISIBLE_ENV_PREFIX}0", u[2])  # a container with GPU 2 only
    pynvml.nvmlInit()
    (h,) = _handles()
    assert pynvml.nvmlDeviceGetUUID(h) == u[2]
    assert pynvml.nvmlDeviceGetMinorNumber(h) == 2  # /dev/nvidia2 in any container
    assert pynvml.nvmlDeviceGetIndex(h) == 0


def test_minor_numbers_of_all_gpus(make_driver: DriverFactory) -> None:
    make_driver(3)
    pynvml.nvmlInit()  # the make_driver fixture shuts NVML down
    assert [pynvml.nvmlDeviceGetMinorNumber(h) for h in _handles()] == [0, 1, 2]
    assert [pynvml.nvmlDeviceGetIndex(h) for h in _handles()] == [0, 1, 2]


def test_pci_info(make_driver: DriverFactory) -> None:
    make_driver(2)
    pynvml.nvmlInit()  # the make_driver fixture shuts NVML down
    infos = [pynvml.nvmlDeviceGetPciInfo(h) for h in _handles()]
    assert [i.bus for i in infos] == [0x18, 0x28]
    assert {i.domain for i in infos} == {0} and {i.device for i in infos} == {0}
    # H100 SXM5 80GB: vendor 0x10DE, device 0x2330 (the PCI ID repository).
    assert {i.pciDeviceId for i in infos} == {0x233010DE}
    assert [i.busId for i in infos] == ["00000000:18:00.0", "00000000:28:00.0"]
    assert [i.busIdLegacy for i in infos] == ["0000:18:00.0", "0000:28:00.0"]


def test_compute_capability_and_brand(make_driver: DriverFactory) -> None:
    make_driver(1)
    pynvml.nvmlInit()  # the make_driver fixture shuts NVML down
    (h,) = _handles()
    assert pynvml.nvmlDeviceGetArchitecture(h) == 9  # Hopper
    assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    assert pynvml.nvmlDeviceGetBrand(h) == pynvml.NVML_BRAND_NVIDIA


def test_topology_and_no_nvlink(make_driver: DriverFactory) -> None:
    make_driver(8)
    pynvml.nvmlInit()  # the make_driver fixture shuts NVML down
    h = _handles()
    level = pynvml.nvmlDeviceGetTopologyCommonAncestor
    assert level(h[0], h[0]) == pynvml.NVML_TOPOLOGY_INTERNAL
    assert level(h[0], h[1]) == pynvml.NVML_TOPOLOGY_SINGLE
    assert level(h[0], h[3]) == pynvml.NVML_TOPOLOGY_NODE
    assert level(h[1], h[6]) == level(h[6], h[1]) == pynvml.NVML_TOPOLOGY_SYSTEM
    for call in (pynvml.nvmlDeviceGetNvLinkState, pynvml.nvmlDeviceGetNvLinkRemotePciInfo):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(h[0], 0)


XID_CRITICAL = pynvml.nvmlEventTypeXidCriticalError
ECC = pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypeSingleBitEccError
HEALTH_MASK = XID_CRITICAL | ECC
"""The events the device plugin's health check registers (internal/rm/health.go)."""


def test_event_wait_times_out_without_events(make_driver: DriverFactory) -> None:
    make_driver(2)
    pynvml.nvmlInit()  # the make_driver fixture shuts NVML down
    events = pynvml.nvmlEventSetCreate()
    try:
        for h in _handles():
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(h)
            assert supported & HEALTH_MASK == HEALTH_MASK
            pynvml.nvmlDeviceRegisterEvents(h, HEALTH_MASK & supported, events)
        t0 = time.monotonic()
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait(events, 200)
        assert 0.19 <= time.monotonic() - t0 < 2.0
    finally:
        pynvml.nvmlEventSetFree(events)


def test_a_lost_gpu_sends_xid_79_once(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    pynvml.nvmlInit()  # the make_driver fixture shuts NVML down
    u = list(drv.uuids)
    h = _handles()
    events = pynvml.nvmlEventSetCreate()
    try:
        for handle in h:
            pynvml.nvmlDeviceRegisterEvents(handle, HEALTH_MASK, events)
        drv.lose(u[1])
        e = pynvml.nvmlEventSetWait(events, 1000)
        assert e.eventType == XID_CRITICAL and e.eventData == 79
        assert (e.gpuInstanceId, e.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
        assert pynvml.nvmlDeviceGetMinorNumber(h[0]) == 0  # the other GPU answers
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetUUID(e.device)  # the event's device is the lost one
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait(events, 100)  # reported once
        drv.recover(u[1])
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait(events, 100)
        drv.lose(u[1])
        assert pynvml.nvmlEventSetWait(events, 1000).eventData == 79  # lost again
    finally:
        pynvml.nvmlEventSetFree(events)


def test_a_set_without_xid_hears_nothing_and_unknown_types_are_refused(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    pynvml.nvmlInit()  # the make_driver fixture shuts NVML down
    (h,) = _handles()
    events = pynvml.nvmlEventSetCreate()
    try:
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeSingleBitEccError, events)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypePowerSourceChange, events)
        drv.lose(drv.uuids[0])
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait(events, 100)
    finally:
        pynvml.nvmlEventSetFree(events)
