"""The GPU protocol: what the agent and the simulator need from one physical GPU.

Two implementations satisfy it: ``rlenergy.gpu.simulated.SimulatedGpu`` (the simulator, the
agent's ``--backend sim``) and the agent's NVML backend (``rlenergy_agent.nvml.backend``).
Every method documents its unit; every failure is one of ``rlenergy.gpu.errors``. GPUs are
keyed by UUID, never by index (CUDA, NVML and nvidia-smi indices differ).
"""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable


class ClockEventReason(enum.Enum):
    """Why the GPU runs below the requested clock (NVML ``nvmlClocksEventReason*`` bits)."""

    GPU_IDLE = 0x1
    APPLICATIONS_CLOCKS_SETTING = 0x2
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8
    SYNC_BOOST = 0x10
    SW_THERMAL_SLOWDOWN = 0x20
    HW_THERMAL_SLOWDOWN = 0x40
    HW_POWER_BRAKE_SLOWDOWN = 0x80
    DISPLAY_CLOCK_SETTING = 0x100

    @classmethod
    def from_mask(cls, mask: int) -> frozenset[ClockEventReason]:
        """Decode an NVML clock-event bit mask; unknown bits are ignored."""
        return frozenset(r for r in cls if mask & r.value)

    @staticmethod
    def to_mask(reasons: frozenset[ClockEventReason]) -> int:
        """Encode reasons as the NVML bit mask."""
        mask = 0
        for r in reasons:
            mask |= r.value
        return mask


SLOWDOWN_REASONS = frozenset(
    {
        ClockEventReason.SW_POWER_CAP,
        ClockEventReason.HW_SLOWDOWN,
        ClockEventReason.SW_THERMAL_SLOWDOWN,
        ClockEventReason.HW_THERMAL_SLOWDOWN,
        ClockEventReason.HW_POWER_BRAKE_SLOWDOWN,
    }
)
"""Reasons that mean a clock decision is not what the GPU runs (EE-RL re-trial triggers)."""


@runtime_checkable
class Gpu(Protocol):
    """One physical GPU (a MIG-enabled GPU counts once).

    Implementations must be safe to call from one thread at a time; the agent serialises calls.
    """

    @property
    def uuid(self) -> str:
        """The GPU UUID, e.g. ``GPU-5f3c...``; the key for everything."""
        ...

    @property
    def name(self) -> str:
        """Product name as NVML reports it (``NVIDIA H100 80GB HBM3``)."""
        ...

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """Supported SM clocks at the highest memory clock, descending, MHz.

        Raises:
            GpuNotSupportedError: the GPU cannot list clocks.
            GpuLostError: the GPU is gone.
        """
        ...

    def max_sm_clock_mhz(self) -> int:
        """Maximum (boost) SM clock, MHz."""
        ...

    def set_locked_sm_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock range (``nvmlDeviceSetGpuLockedClocks``).

        Raises:
            GpuNoPermissionError: the caller lacks CAP_SYS_ADMIN.
            GpuNotSupportedError: the GPU does not support locked clocks.
            GpuLostError: the GPU is gone.
        """
        ...

    def reset_locked_sm_clocks(self) -> None:
        """Return the SM clock to the default governor (``nvmlDeviceResetGpuLockedClocks``)."""
        ...

    def sm_clock_mhz(self) -> int:
        """The SM clock the GPU runs now (read-back), MHz."""
        ...

    def total_energy_mj(self) -> int:
        """Energy since driver load, mJ (``nvmlDeviceGetTotalEnergyConsumption``).

        Updated every 20-100 ms by the driver (NVML docs), so short windows are coarse.

        Raises:
            GpuNotSupportedError: pre-Volta GPUs have no energy counter.
        """
        ...

    def power_usage_mw(self) -> int:
        """Power draw averaged over the last second on Ampere and newer, mW (NVML docs)."""
        ...

    def instant_power_mw(self) -> int:
        """Instantaneous power, mW (NVML field ``NVML_FI_DEV_POWER_INSTANT``, Hopper and newer).

        Raises:
            GpuNotSupportedError: the GPU or driver has no instant power field.
        """
        ...

    def power_limit_mw(self) -> int:
        """Enforced power limit, mW."""
        ...

    def clock_event_reasons(self) -> frozenset[ClockEventReason]:
        """Reasons the clock is held below the requested one right now."""
        ...


@runtime_checkable
class MemoryReading(Protocol):
    """A GPU that reports its framebuffer memory in use (NVML ``nvmlDeviceGetMemoryInfo``).

    Optional next to :class:`Gpu`: a backend without it leaves a sleep unverified.
    """

    def memory_used_bytes(self) -> int:
        """Framebuffer memory in use, bytes.

        Raises:
            GpuError: the read failed (``GpuNotSupportedError`` where the driver has none).
        """
        ...
