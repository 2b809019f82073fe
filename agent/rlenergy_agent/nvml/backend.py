"""``NvmlGpu``: one physical GPU through NVML, satisfying ``rlenergy.gpu.base.Gpu``.

NVML return codes become the typed errors of ``rlenergy.gpu.errors`` in one place
(``_nvml_errors``, zeus's mapping): NOT_SUPPORTED -> ``GpuNotSupportedError``, NO_PERMISSION ->
``GpuNoPermissionError``, GPU_IS_LOST / GPU_NOT_FOUND -> ``GpuLostError``, anything else ->
``GpuTransientError``. Capabilities are probed once per GPU at discovery and cached (a GPU
without an energy counter must not be asked every sample). GPUs are keyed by UUID; a
MIG-enabled GPU is one device whose MIG instance UUIDs map back to it. Callers:
``rlenergy_agent.backends``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from rlenergy.gpu import base, errors
from rlenergy_agent.nvml import lib

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")

_LOST_CODES = frozenset({lib.ERROR_GPU_IS_LOST, lib.ERROR_GPU_NOT_FOUND})
_HANDLE_CODES = frozenset({lib.ERROR_INVALID_ARGUMENT, lib.ERROR_UNINITIALIZED})
"""On a call whose only argument is the device handle, these codes mean the handle is no
longer valid (NVML re-initialised underneath, a GPU reset): the GPU is treated as lost until
NVML is initialised again and the handle looked up anew (``NvmlSession.reinit``)."""


def map_error(exc: lib.NvmlCallError, uuid: str | None) -> errors.GpuError:
    """The typed GPU error for an NVML failure.

    Args:
        exc: the NVML failure.
        uuid: the GPU's UUID.

    Returns:
        ``GpuNotSupportedError``, ``GpuNoPermissionError``, ``GpuLostError`` or
        ``GpuTransientError``.
    """
    text = str(exc)
    if exc.code == lib.ERROR_NOT_SUPPORTED:
        return errors.GpuNotSupportedError(text, uuid)
    if exc.code == lib.ERROR_NO_PERMISSION:
        return errors.GpuNoPermissionError(
            f"{text}; the agent needs CAP_SYS_ADMIN to change clocks", uuid
        )
    if exc.code in _LOST_CODES:
        return errors.GpuLostError(text, uuid)
    return errors.GpuTransientError(text, uuid)


def _nvml_errors(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """Map ``lib.NvmlCallError`` raised by a method of ``NvmlGpu`` to ``rlenergy.gpu.errors``."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return fn(*args, **kwargs)
        except lib.NvmlCallError as exc:
            self = args[0]
            uuid = self.uuid if isinstance(self, NvmlGpu) else None
            raise map_error(exc, uuid) from exc

    return wrapper


def _nvml_reads(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """``_nvml_errors`` for a read that takes only the handle: an invalid handle is a lost GPU."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return fn(*args, **kwargs)
        except lib.NvmlCallError as exc:
            self = args[0]
            uuid = self.uuid if isinstance(self, NvmlGpu) else None
            if exc.code in _HANDLE_CODES:
                raise errors.GpuLostError(f"invalid device handle: {exc}", uuid) from exc
            raise map_error(exc, uuid) from exc

    return wrapper


def _unless_unsupported(read: Callable[[], _T]) -> _T | None:
    """``read()``, or None where the GPU cannot answer it (a lost GPU still raises)."""
    try:
        return read()
    except errors.GpuLostError:
        raise
    except errors.GpuError:
        return None


Support = bool | None
"""``True`` supported, ``False`` not supported, ``None`` unknown (not probed or failed)."""


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one GPU supports, probed once at discovery.

    Attributes:
        energy_counter: ``nvmlDeviceGetTotalEnergyConsumption`` works (Volta+).
        instant_power: the ``NVML_FI_DEV_POWER_INSTANT`` field works (Hopper+).
        power_usage: ``nvmlDeviceGetPowerUsage`` works.
        clock_list: the supported SM clock list has more than one entry.
        clock_readback: ``nvmlDeviceGetClockInfo(SM)`` works.
        clock_reasons: the clock-event reasons work.
        mig: MIG mode is on (clocks are shared by every instance).
        persistence: persistence mode is on; ``None`` unknown.
        architecture: ``nvmlDeviceArchitecture_t`` or ``None``.
        memory_clock_mhz: the memory clock the SM list was queried at, MHz.
    """

    energy_counter: bool
    instant_power: bool
    power_usage: bool
    clock_list: bool
    clock_readback: bool
    clock_reasons: bool
    mig: bool
    persistence: Support
    architecture: int | None
    memory_clock_mhz: int | None

    @property
    def telemetry(self) -> bool:
        """Any energy or power reading works (else telemetry is unavailable)."""
        return self.energy_counter or self.instant_power or self.power_usage


class NvmlGpu:
    """One physical GPU through NVML.

    Args:
        handle: the NVML handle.
        uuid: the GPU UUID.
        name: the product name.
    """

    def __init__(self, handle: lib.Handle, uuid: str, name: str) -> None:
        self._handle = handle
        self._uuid = uuid
        self._name = name
        self._clocks: tuple[int, ...] | None = None
        self._capabilities: Capabilities | None = None
        self.mig_uuids: tuple[str, ...] = ()
        self.mig_slices: dict[str, int] = {}
        """MIG instance UUID -> GPU-instance slices of its profile (where NVML answers)."""

    @property
    def uuid(self) -> str:
        """GPU UUID."""
        return self._uuid

    def rebind(self, handle: lib.Handle) -> None:
        """Use ``handle`` from now on (NVML was initialised again).

        What was probed is probed again at the next ``probe`` (a driver change can change
        clocks, MIG and support).
        """
        self._handle = handle
        self._clocks = None
        self._capabilities = None

    @property
    def name(self) -> str:
        """NVML product name."""
        return self._name

    # ----- capability probe ------------------------------------------------------------------
    def probe(self) -> Capabilities:
        """Probe what the GPU supports, once; later calls return the cached answer.

        Raises:
            GpuLostError: the GPU is gone.
        """
        if self._capabilities is not None:
            return self._capabilities

        def works(fn: Callable[[], object]) -> bool:
            try:
                fn()
            except errors.GpuLostError:
                raise
            except errors.GpuError as exc:
                log.debug("probe %s: %s", self._uuid, exc)
                return False
            return True

        persistence: Support = _unless_unsupported(self._persistence)
        arch = _unless_unsupported(self._architecture)
        mig = self._probe_mig()
        mem, clock_list = self._probe_clocks()
        caps = Capabilities(
            energy_counter=works(self.total_energy_mj),
            instant_power=works(self.instant_power_mw),
            power_usage=works(self.power_usage_mw),
            clock_list=clock_list,
            clock_readback=works(self.sm_clock_mhz),
            clock_reasons=works(self.clock_event_reasons),
            mig=mig,
            persistence=persistence,
            architecture=arch,
            memory_clock_mhz=mem,
        )
        if not caps.energy_counter:
            log.warning(
                "GPU %s (%s) has no energy counter; integrating %s power instead",
                self._uuid,
                self._name,
                "instant" if caps.instant_power else "averaged",
            )
        if not caps.telemetry:
            log.warning(
                "GPU %s (%s): no power or energy reading; energy unknown", self._uuid, self._name
            )
        self._capabilities = caps
        return caps

    def _probe_mig(self) -> bool:
        """Whether MIG is on; when it is, records the MIG devices and their slices."""
        try:
            mig = self._mig()
            if mig:
                found = self._mig_devices()
                self.mig_uuids = tuple(found)
                self.mig_slices = {m: n for m, n in found.items() if n is not None}
        except errors.GpuLostError:
            raise
        except errors.GpuError:
            return False
        return mig

    def _probe_clocks(self) -> tuple[int | None, bool]:
        """(memory clock MHz, more than one SM clock supported); (None, False) on error."""
        try:
            return self._memory_clock(), len(self.supported_sm_clocks_mhz()) > 1
        except errors.GpuLostError:
            raise
        except errors.GpuError:
            return None, False

    @property
    def capabilities(self) -> Capabilities | None:
        """The cached probe result (``None`` before ``probe``)."""
        return self._capabilities

    @_nvml_errors
    def _persistence(self) -> bool:
        return lib.persistence_enabled(self._handle)

    @_nvml_errors
    def _architecture(self) -> int:
        return lib.architecture(self._handle)

    @_nvml_errors
    def _mig(self) -> bool:
        return lib.mig_enabled(self._handle)

    @_nvml_errors
    def _mig_devices(self) -> dict[str, int | None]:
        return lib.mig_devices(self._handle)

    @_nvml_errors
    def _memory_clock(self) -> int:
        """The memory clock in use, MHz (the SM list depends on it)."""
        try:
            return lib.clock_mhz(self._handle, lib.CLOCK_MEM)
        except lib.NvmlCallError:
            return max(lib.supported_memory_clocks_mhz(self._handle))

    # ----- Gpu protocol ------------------------------------------------------------------------
    @_nvml_errors
    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """Supported SM clocks at the memory clock in use, descending, MHz (cached).

        Raises:
            GpuNotSupportedError: the GPU cannot list clocks.
            GpuLostError: the GPU is gone.
        """
        if self._clocks is None:
            try:
                mem = lib.clock_mhz(self._handle, lib.CLOCK_MEM)
            except lib.NvmlCallError:
                mem = max(lib.supported_memory_clocks_mhz(self._handle))
            clocks = lib.supported_graphics_clocks_mhz(self._handle, mem)
            self._clocks = tuple(sorted(set(clocks), reverse=True))
        return self._clocks

    @_nvml_errors
    def max_sm_clock_mhz(self) -> int:
        """Maximum (boost) SM clock, MHz."""
        return lib.max_clock_mhz(self._handle, lib.CLOCK_SM)

    @_nvml_errors
    def set_locked_sm_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock range; see ``rlenergy.gpu.base.Gpu``.

        Raises:
            GpuNoPermissionError: the agent lacks CAP_SYS_ADMIN.
            GpuNotSupportedError: the GPU does not support locked clocks.
            GpuLostError: the GPU is gone.
            GpuTransientError: any other failure (an invalid range among them).
        """
        lib.set_gpu_locked_clocks(self._handle, min_mhz, max_mhz)

    @_nvml_errors
    def reset_locked_sm_clocks(self) -> None:
        """Return the SM clock to the default governor.

        Raises:
            GpuNoPermissionError: the agent lacks CAP_SYS_ADMIN.
            GpuNotSupportedError: the GPU does not support locked clocks.
            GpuLostError: the GPU is gone.
        """
        lib.reset_gpu_locked_clocks(self._handle)

    @_nvml_errors
    def set_locked_memory_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the memory clock (Ampere+; off by default).

        Raises:
            GpuNotSupportedError: the GPU cannot lock its memory clock.
            GpuNoPermissionError: the agent lacks CAP_SYS_ADMIN.
        """
        lib.set_memory_locked_clocks(self._handle, min_mhz, max_mhz)

    @_nvml_errors
    def reset_locked_memory_clocks(self) -> None:
        """Return the memory clock to the default.

        Raises:
            GpuNotSupportedError: the GPU cannot lock its memory clock.
        """
        lib.reset_memory_locked_clocks(self._handle)

    @_nvml_reads
    def sm_clock_mhz(self) -> int:
        """SM clock now (read-back), MHz."""
        return lib.clock_mhz(self._handle, lib.CLOCK_SM)

    @_nvml_reads
    def total_energy_mj(self) -> int:
        """Energy since driver load, mJ.

        Raises:
            GpuNotSupportedError: pre-Volta GPUs have no energy counter.
        """
        return lib.total_energy_mj(self._handle)

    @_nvml_reads
    def power_usage_mw(self) -> int:
        """Power draw (1 s trailing average on Ampere+), mW."""
        return lib.power_usage_mw(self._handle)

    @_nvml_reads
    def instant_power_mw(self) -> int:
        """Instantaneous power, mW.

        Raises:
            GpuNotSupportedError: no instant power field on this GPU or driver.
        """
        return lib.instant_power_mw(self._handle)

    @_nvml_reads
    def memory_used_bytes(self) -> int:
        """Framebuffer memory in use, bytes (``base.MemoryReading``).

        Raises:
            GpuNotSupportedError: the driver does not report memory on this GPU.
        """
        return lib.memory_used_bytes(self._handle)

    @_nvml_reads
    def power_limit_mw(self) -> int:
        """Enforced power limit, mW."""
        return lib.enforced_power_limit_mw(self._handle)

    @_nvml_reads
    def clock_event_reasons(self) -> frozenset[base.ClockEventReason]:
        """Reasons the clock is held below the requested one right now."""
        return base.ClockEventReason.from_mask(lib.clock_event_reasons(self._handle))

    @_nvml_errors
    def utilization_percent(self) -> tuple[int, int]:
        """(SM, memory) utilisation, % (a hint only, never a phase signal: rollouts wait at 0 %)."""
        return lib.utilization_percent(self._handle)


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What NVML enumeration found.

    Attributes:
        gpus: usable GPUs keyed by UUID, in NVML order.
        lost: NVML indices whose handle or UUID could not be read, with the error.
        driver_version: the kernel driver version ("" when unreadable).
        indices: NVML index -> UUID of the usable GPUs (DRA devices named by index map
            through it: ``rlenergy_agent.dra``).
    """

    gpus: dict[str, NvmlGpu]
    lost: dict[int, str]
    driver_version: str
    indices: dict[int, str] = dataclasses.field(default_factory=dict)


def discover() -> Discovery:
    """Initialise NVML and enumerate the physical GPUs, probing each once.

    Returns:
        The GPUs keyed by UUID; a GPU that fails enumeration is listed in ``lost`` and the
        others are still returned.

    Raises:
        rlenergy_agent.nvml.lib.NvmlUnavailableError: NVML cannot be initialised.
        GpuTransientError: the device count cannot be read.
    """
    lib.init()
    try:
        count = lib.device_count()
    except lib.NvmlCallError as exc:
        raise map_error(exc, None) from exc
    try:
        version = lib.driver_version()
    except lib.NvmlCallError:
        version = ""
    gpus: dict[str, NvmlGpu] = {}
    lost: dict[int, str] = {}
    indices: dict[int, str] = {}
    for i in range(count):
        try:
            handle = lib.handle_by_index(i)
            gpu = NvmlGpu(handle, lib.uuid(handle), lib.name(handle))
            gpu.probe()
        except (lib.NvmlCallError, errors.GpuError) as exc:
            log.error("GPU at NVML index %d unusable: %s", i, exc)
            lost[i] = str(exc)
            continue
        gpus[gpu.uuid] = gpu
        indices[i] = gpu.uuid
    return Discovery(gpus, lost, version, indices)


class NvmlSession:
    """NVML's life on this node: initialised again after a lost GPU or a changed driver.

    NVML hands out device handles per initialisation; a GPU that fell off the bus and came
    back (a GPU reset, a driver reload) answers GPU_IS_LOST or an invalid handle on the old
    one, and a changed driver version means the clock tables, MIG layout and every lock may
    have changed. ``reinit`` shuts NVML down, initialises it again, looks every known GPU up
    by UUID, re-binds its ``NvmlGpu`` (everyone holding it sees the new handle) and probes it
    again. Satisfies ``rlenergy_agent.actuator.GpuLibrary``.

    Args:
        gpus: the node's GPUs by UUID (from ``discover``).
        version: the driver version they were discovered under.
        indices: their NVML index -> UUID at discovery (``Discovery.indices``).
    """

    def __init__(
        self, gpus: dict[str, NvmlGpu], version: str, indices: dict[int, str] | None = None
    ) -> None:
        self.gpus = gpus
        self.version = version
        self.indices = dict(indices or {})
        self.reinits = 0
        """Re-initialisations made."""

    def driver_version(self) -> str:
        """The kernel driver version now.

        Raises:
            GpuLostError: NVML does not answer (not initialised, driver gone).
        """
        try:
            return lib.driver_version()
        except lib.NvmlCallError as exc:
            raise errors.GpuLostError(f"driver version unreadable: {exc}") from exc

    def reinit(self) -> dict[str, bool]:
        """Initialise NVML again and re-bind every GPU; per UUID whether it answers.

        Returns:
            ``{uuid: True}`` for a GPU found and probed again, ``False`` for one still lost
            (or every GPU when NVML itself cannot start: a driver upgraded under the agent
            gives LIB_RM_VERSION_MISMATCH until the agent's container is restarted).
        """
        self.reinits += 1
        try:
            lib.shutdown()
        except lib.NvmlCallError as exc:
            log.info("nvmlShutdown before re-initialisation: %s", exc)
        try:
            lib.init()
            self.version = lib.driver_version()
        except (lib.NvmlUnavailableError, lib.NvmlCallError) as exc:
            log.error("NVML re-initialisation failed: %s", exc)
            return dict.fromkeys(self.gpus, False)
        out: dict[str, bool] = {}
        for uuid, gpu in self.gpus.items():
            try:
                gpu.rebind(lib.handle_by_uuid(uuid))
                gpu.probe()
                out[uuid] = True
            except (lib.NvmlCallError, errors.GpuError) as exc:
                log.warning("GPU %s not back after NVML re-initialisation: %s", uuid, exc)
                out[uuid] = False
        return out


def shutdown() -> None:
    """Release NVML; errors are logged, never raised (used on the way out)."""
    try:
        lib.shutdown()
    except lib.NvmlCallError as exc:
        log.warning("nvmlShutdown failed: %s", exc)
