"""The thin seam over pynvml: the only module of the project that imports it (kepler nvml_lib).

Every function takes and returns plain Python values (a device handle is opaque), times the
call into ``CALL_STATS`` (NVML latency is a symptom of persistence mode off) and turns
``pynvml.NVMLError`` into ``NvmlCallError`` carrying the NVML return code, so nothing above this
module knows pynvml. Callers: ``rlenergy_agent.nvml.backend`` only. Tests may replace this seam
with a mock (mocks replace the seam, not the logic) or, better, run it unchanged on the
stand-in ``libnvidia-ml.so.1`` (dev/nvml_standin/standin.c).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, NewType, TypeVar

import pynvml  # type: ignore[import-untyped]

from rlenergy import errors

Handle = NewType("Handle", object)
"""An NVML device handle (``nvmlDevice_t``); opaque outside this module."""

SUCCESS = pynvml.NVML_SUCCESS
ERROR_UNINITIALIZED = pynvml.NVML_ERROR_UNINITIALIZED
ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
ERROR_NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION
ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
ERROR_DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
ERROR_LIB_RM_VERSION_MISMATCH = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
ERROR_GPU_NOT_FOUND = 28
"""NVML_ERROR_GPU_NOT_FOUND (NVML API reference; absent from older pynvml constants)."""
ERROR_UNKNOWN = pynvml.NVML_ERROR_UNKNOWN

FI_DEV_POWER_INSTANT = pynvml.NVML_FI_DEV_POWER_INSTANT
CLOCK_SM = pynvml.NVML_CLOCK_SM
CLOCK_MEM = pynvml.NVML_CLOCK_MEM

MISSING_LIBRARY_HINT = (
    "libnvidia-ml.so.1 is not loadable in the agent's container: run the agent under the "
    "RuntimeClass that injects the host driver (chart value agent.runtimeClassName, default "
    "nvidia: the RuntimeClass of NVIDIA's GPU Operator and the NVIDIA container toolkit; empty "
    "where nvidia is the node's default runtime); see docs/install.md"
)


class NvmlCallError(Exception):
    """An NVML call returned an error code.

    Args:
        code: the NVML return code (``ERROR_*``).
        function: the NVML entry point.
        message: NVML's text for the code.
    """

    def __init__(self, code: int, function: str, message: str) -> None:
        super().__init__(f"{function}: {message} (NVML error {code})")
        self.code = code
        self.function = function
        self.reason = message


class NvmlUnavailableError(errors.RLEnergyError):
    """NVML cannot be used on this node at all (library missing, driver mismatch).

    Args:
        message: what failed and what to do.
        code: the NVML return code of ``nvmlInit``.
    """

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class CallStat:
    """Latency of one NVML entry point since start.

    Attributes:
        calls: number of calls.
        errors: calls that returned an error.
        total_s: summed wall time, s.
        max_s: slowest call, s.
    """

    calls: int = 0
    errors: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


CALL_STATS: dict[str, CallStat] = {}
"""Per entry point latency, read by ``rlenergy_agent.metrics`` at scrape time."""
_stats_lock = threading.Lock()
_T = TypeVar("_T")


def _call(function: str, fn: Callable[..., _T], *args: Any) -> _T:
    start = time.perf_counter()
    failed = False
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        failed = True
        code = int(exc.value)
        raise NvmlCallError(code, function, _error_text(exc)) from None
    finally:
        elapsed = time.perf_counter() - start
        with _stats_lock:
            stat = CALL_STATS.setdefault(function, CallStat())
            stat.calls += 1
            stat.errors += int(failed)
            stat.total_s += elapsed
            stat.max_s = max(stat.max_s, elapsed)


def _error_text(exc: pynvml.NVMLError) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - nvmlErrorString itself can fail after GPU loss
        return f"NVML error {exc.value}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def init() -> None:
    """Initialise NVML (``nvmlInitWithFlags(0)``).

    Raises:
        NvmlUnavailableError: the library is missing, the driver is not loaded, or the
            library and kernel driver versions differ; the message says what to do.
        NvmlCallError: any other failure.
    """
    try:
        _call("nvmlInit", pynvml.nvmlInit)
    except NvmlCallError as exc:
        if exc.code in (ERROR_LIBRARY_NOT_FOUND, ERROR_DRIVER_NOT_LOADED):
            raise NvmlUnavailableError(f"{exc.reason}: {MISSING_LIBRARY_HINT}", exc.code) from None
        if exc.code == ERROR_LIB_RM_VERSION_MISMATCH:
            raise NvmlUnavailableError(
                f"{exc.reason}: the user-space NVML library and the kernel driver differ "
                "(driver upgraded under a running node); restart the agent pod after the node "
                "reboots or the driver is reloaded",
                exc.code,
            ) from None
        raise


def shutdown() -> None:
    """Release NVML (``nvmlShutdown``)."""
    _call("nvmlShutdown", pynvml.nvmlShutdown)


def driver_version() -> str:
    """Kernel driver version string."""
    return _text(_call("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion))


def device_count() -> int:
    """Number of physical GPUs (MIG instances are not counted by NVML here)."""
    return int(_call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount))


def handle_by_index(index: int) -> Handle:
    """Device handle of NVML index ``index`` (only for enumeration: key by UUID after)."""
    return Handle(_call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index))


def handle_by_uuid(uuid: str) -> Handle:
    """Device handle of the GPU with ``uuid``."""
    return Handle(
        _call("nvmlDeviceGetHandleByUUID", pynvml.nvmlDeviceGetHandleByUUID, uuid.encode())
    )


def uuid(handle: Handle) -> str:
    """The device UUID (``GPU-...``)."""
    return _text(_call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle))


def name(handle: Handle) -> str:
    """The product name."""
    return _text(_call("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle))


def architecture(handle: Handle) -> int:
    """``nvmlDeviceArchitecture_t`` (7 Volta, 8 Ampere, 9 Hopper, 10 Blackwell)."""
    return int(_call("nvmlDeviceGetArchitecture", pynvml.nvmlDeviceGetArchitecture, handle))


def mig_enabled(handle: Handle) -> bool:
    """Whether MIG mode is on now (NOT_SUPPORTED on GPUs without MIG is reported as off)."""
    try:
        current, _pending = _call("nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, handle)
    except NvmlCallError as exc:
        if exc.code == ERROR_NOT_SUPPORTED:
            return False
        raise
    return bool(current)


def mig_devices(handle: Handle) -> dict[str, int | None]:
    """MIG instance UUID (``MIG-...``) -> GPU-instance slices of its profile (MIG-enabled GPU).

    The slices come from ``nvmlDeviceGetAttributes`` on the instance's handle
    (``gpuInstanceSliceCount``: 1 for a 1g profile, 3 for 3g, 7 for 7g on an A100/H100);
    ``None`` where the driver does not answer it.
    """
    count = int(
        _call("nvmlDeviceGetMaxMigDeviceCount", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
    )
    out: dict[str, int | None] = {}
    for i in range(count):
        try:
            mig = _call(
                "nvmlDeviceGetMigDeviceHandleByIndex",
                pynvml.nvmlDeviceGetMigDeviceHandleByIndex,
                handle,
                i,
            )
        except NvmlCallError as exc:
            if exc.code == ERROR_NOT_FOUND:
                continue
            raise
        uuid = _text(_call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, mig))
        try:
            attrs = _call("nvmlDeviceGetAttributes", pynvml.nvmlDeviceGetAttributes_v2, mig)
            out[uuid] = int(attrs.gpuInstanceSliceCount) or None
        except NvmlCallError:
            out[uuid] = None
    return out


def persistence_enabled(handle: Handle) -> bool:
    """Whether persistence mode is on."""
    mode = _call("nvmlDeviceGetPersistenceMode", pynvml.nvmlDeviceGetPersistenceMode, handle)
    return bool(int(mode) == int(pynvml.NVML_FEATURE_ENABLED))


def supported_memory_clocks_mhz(handle: Handle) -> list[int]:
    """Supported memory clocks, MHz, as NVML lists them."""
    return [
        int(c)
        for c in _call(
            "nvmlDeviceGetSupportedMemoryClocks", pynvml.nvmlDeviceGetSupportedMemoryClocks, handle
        )
    ]


def supported_graphics_clocks_mhz(handle: Handle, memory_clock_mhz: int) -> list[int]:
    """Supported SM clocks at ``memory_clock_mhz``, MHz, as NVML lists them."""
    return [
        int(c)
        for c in _call(
            "nvmlDeviceGetSupportedGraphicsClocks",
            pynvml.nvmlDeviceGetSupportedGraphicsClocks,
            handle,
            memory_clock_mhz,
        )
    ]


def max_clock_mhz(handle: Handle, clock_type: int) -> int:
    """Maximum clock of ``clock_type`` (``CLOCK_SM``, ``CLOCK_MEM``), MHz."""
    return int(
        _call("nvmlDeviceGetMaxClockInfo", pynvml.nvmlDeviceGetMaxClockInfo, handle, clock_type)
    )


def clock_mhz(handle: Handle, clock_type: int) -> int:
    """Current clock of ``clock_type``, MHz."""
    return int(_call("nvmlDeviceGetClockInfo", pynvml.nvmlDeviceGetClockInfo, handle, clock_type))


def set_gpu_locked_clocks(handle: Handle, min_mhz: int, max_mhz: int) -> None:
    """``nvmlDeviceSetGpuLockedClocks`` (needs CAP_SYS_ADMIN)."""
    _call(
        "nvmlDeviceSetGpuLockedClocks",
        pynvml.nvmlDeviceSetGpuLockedClocks,
        handle,
        min_mhz,
        max_mhz,
    )


def reset_gpu_locked_clocks(handle: Handle) -> None:
    """``nvmlDeviceResetGpuLockedClocks`` (needs CAP_SYS_ADMIN)."""
    _call("nvmlDeviceResetGpuLockedClocks", pynvml.nvmlDeviceResetGpuLockedClocks, handle)


def set_memory_locked_clocks(handle: Handle, min_mhz: int, max_mhz: int) -> None:
    """``nvmlDeviceSetMemoryLockedClocks`` (Ampere+, CAP_SYS_ADMIN; off by default)."""
    _call(
        "nvmlDeviceSetMemoryLockedClocks",
        pynvml.nvmlDeviceSetMemoryLockedClocks,
        handle,
        min_mhz,
        max_mhz,
    )


def reset_memory_locked_clocks(handle: Handle) -> None:
    """``nvmlDeviceResetMemoryLockedClocks``."""
    _call("nvmlDeviceResetMemoryLockedClocks", pynvml.nvmlDeviceResetMemoryLockedClocks, handle)


def total_energy_mj(handle: Handle) -> int:
    """Energy since driver load, mJ (Volta+)."""
    return int(
        _call(
            "nvmlDeviceGetTotalEnergyConsumption",
            pynvml.nvmlDeviceGetTotalEnergyConsumption,
            handle,
        )
    )


def power_usage_mw(handle: Handle) -> int:
    """Power draw, mW (a 1 s trailing average on Ampere and newer)."""
    return int(_call("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, handle))


def memory_used_bytes(handle: Handle) -> int:
    """Framebuffer memory in use, bytes (``nvmlDeviceGetMemoryInfo``'s ``used``)."""
    return int(_call("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, handle).used)


def instant_power_mw(handle: Handle) -> int:
    """Instantaneous power from the field ``NVML_FI_DEV_POWER_INSTANT``, mW.

    Raises:
        NvmlCallError: the call or the field failed (the field carries its own return code).
    """
    values = _call(
        "nvmlDeviceGetFieldValues", pynvml.nvmlDeviceGetFieldValues, handle, [FI_DEV_POWER_INSTANT]
    )
    value = values[0]
    if int(value.nvmlReturn) != SUCCESS:
        code = int(value.nvmlReturn)
        raise NvmlCallError(code, "nvmlDeviceGetFieldValues(POWER_INSTANT)", f"field error {code}")
    return int(value.value.uiVal)


def enforced_power_limit_mw(handle: Handle) -> int:
    """Enforced power limit, mW."""
    return int(
        _call("nvmlDeviceGetEnforcedPowerLimit", pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    )


def clock_event_reasons(handle: Handle) -> int:
    """Current clock-event reason bit mask (``nvmlClocksEventReason*``)."""
    return int(
        _call(
            "nvmlDeviceGetCurrentClocksEventReasons",
            pynvml.nvmlDeviceGetCurrentClocksEventReasons,
            handle,
        )
    )


def utilization_percent(handle: Handle) -> tuple[int, int]:
    """(SM, memory) utilisation over the last sample period, %."""
    u = _call("nvmlDeviceGetUtilizationRates", pynvml.nvmlDeviceGetUtilizationRates, handle)
    return int(u.gpu), int(u.memory)
