"""A simulated GPU that satisfies ``rlenergy.gpu.base.Gpu`` and raises ``rlenergy.gpu.errors``.

Ground truth lives here and in ``rlenergy.sim.job``; a controller only sees what the protocol
returns, as a real agent would. Sensors behave as NVML documents them:

* the energy counter (mJ since "driver load") advances only at driver updates 20-100 ms apart,
  so a read returns the energy up to the last update, not up to now;
* ``power_usage_mw`` is a 1 s trailing average with read noise;
* a clock lock above the power-capped clock is accepted but the GPU runs lower, reporting
  ``SW_POWER_CAP`` ("lock accepted but effective clock lower").

Faults can be injected (``inject``): not supported, no permission, GPU lost, counter reset.
Time is virtual: the job runner advances each GPU with ``execute`` / ``idle``.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import random

from rlenergy.gpu import base, errors, models


class Fault(enum.Enum):
    """Faults the simulated GPU can be told to show."""

    NO_PERMISSION = "no_permission"
    """Clock and power-limit writes fail (container without CAP_SYS_ADMIN)."""
    CLOCKS_NOT_SUPPORTED = "clocks_not_supported"
    """Locked clocks unsupported (consumer or old GPUs)."""
    ENERGY_NOT_SUPPORTED = "energy_not_supported"
    """No energy counter (pre-Volta)."""
    LOST = "lost"
    """Every call fails with GPU_IS_LOST."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """A span of virtual time at constant power (truth, never shown to controllers)."""

    start_s: float
    end_s: float
    power_w: float
    clock_mhz: float


class SimulatedGpu:
    """One simulated GPU of a given SKU.

    Args:
        sku: the SKU model.
        uuid: the GPU UUID.
        seed: seed for sensor timing and noise; same seed, same readings.
        power_spread: fixed part-to-part power multiplier (1.0 = nominal).
        start_s: virtual time at creation, s.
    """

    def __init__(
        self,
        sku: models.GpuSku,
        uuid: str,
        *,
        seed: int = 0,
        power_spread: float = 1.0,
        start_s: float = 0.0,
    ) -> None:
        self.sku = sku
        self._uuid = uuid
        self._rng = random.Random(seed)
        self.power_spread = power_spread
        self._sensors = models.catalog().sensors
        self.now_s = start_s
        self._locked: tuple[int, int] | None = None
        self._power_limit_w = float(sku.power_limit_w)
        self._faults: set[Fault] = set()
        self._segments: list[Segment] = []
        self._starts: list[float] = []
        self._cum_j: list[float] = [0.0]
        self._counter_offset_mj = self._rng.randrange(10**6, 10**9)
        self._hash_seed = self._rng.randrange(2**32)
        self._current_kind: models.PhaseKind = "idle"
        self.writes = 0
        """Number of clock writes that reached the device (idempotence checks)."""

    # ----- Gpu protocol -------------------------------------------------------------------
    @property
    def uuid(self) -> str:
        """GPU UUID."""
        return self._uuid

    @property
    def name(self) -> str:
        """NVML product name."""
        return self.sku.nvml_name

    def _check(self) -> None:
        if Fault.LOST in self._faults:
            raise errors.GpuLostError("GPU is lost (NVML_ERROR_GPU_IS_LOST)", self._uuid)

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """Supported SM clocks, descending, MHz."""
        self._check()
        return self.sku.supported_sm_clocks_mhz()

    def max_sm_clock_mhz(self) -> int:
        """Boost clock, MHz."""
        self._check()
        return self.sku.max_sm_clock_mhz

    def set_locked_sm_clocks(self, min_mhz: int, max_mhz: int) -> None:
        """Lock SM clocks; see ``rlenergy.gpu.base.Gpu``."""
        self._check()
        if Fault.NO_PERMISSION in self._faults:
            raise errors.GpuNoPermissionError(
                "setting locked clocks needs CAP_SYS_ADMIN (NVML_ERROR_NO_PERMISSION)", self._uuid
            )
        if Fault.CLOCKS_NOT_SUPPORTED in self._faults:
            raise errors.GpuNotSupportedError("locked clocks not supported", self._uuid)
        supported = self.sku.supported_sm_clocks_mhz()
        if not (supported[-1] <= min_mhz <= max_mhz <= supported[0]):
            raise errors.GpuTransientError(
                f"invalid clock range {min_mhz}-{max_mhz} MHz (NVML_ERROR_INVALID_ARGUMENT); "
                f"supported {supported[-1]}-{supported[0]}",
                self._uuid,
            )
        self._locked = (min_mhz, max_mhz)
        self.writes += 1

    def reset_locked_sm_clocks(self) -> None:
        """Return to the default governor."""
        self._check()
        if Fault.NO_PERMISSION in self._faults:
            raise errors.GpuNoPermissionError(
                "resetting locked clocks needs CAP_SYS_ADMIN", self._uuid
            )
        self._locked = None
        self.writes += 1

    @property
    def locked_sm_clocks_mhz(self) -> tuple[int, int] | None:
        """The current lock (simulator-only view; NVML has no getter)."""
        return self._locked

    def effective_clock_mhz(self, kind: models.PhaseKind) -> float:
        """Clock the GPU runs ``kind`` at under the current lock (truth), MHz."""
        if kind == "idle":
            return float(self.sku.min_sm_clock_mhz)
        return self.sku.effective_clock_mhz(
            kind, None if self._locked is None else self._locked[1], self._power_limit_w
        )

    def sm_clock_mhz(self) -> int:
        """Read-back of the SM clock now, MHz (rounded down to a supported step)."""
        self._check()
        clock = self.effective_clock_mhz(self._current_kind)
        step = self.sku.clock_step_mhz
        top = self.sku.max_sm_clock_mhz
        return int(top - ((top - clock) // step + (1 if (top - clock) % step else 0)) * step)

    def total_energy_mj(self) -> int:
        """Energy counter, mJ, as of the driver's last update (a pure function of time)."""
        self._check()
        if Fault.ENERGY_NOT_SUPPORTED in self._faults:
            raise errors.GpuNotSupportedError("energy counter not supported", self._uuid)
        return self._counter_offset_mj + int(
            self._energy_until_j(self._last_update_before(self.now_s)) * 1000.0
        )

    def _last_update_before(self, t_s: float) -> float:
        """Time of the driver's last counter update at or before ``t_s``.

        Updates fall once per grid cell of ``(min + max) / 2`` seconds at a hashed offset, so
        successive updates are ``min``..``max`` apart (NVML docs: 20-100 ms) [MODEL].
        """
        lo = self._sensors.energy_counter_update_min_s
        hi = self._sensors.energy_counter_update_max_s
        cell = (lo + hi) / 2.0
        jitter = hi - cell
        n = int(t_s // cell)
        for k in (n, n - 1):
            tick = k * cell + jitter * self._hash01(k)
            if tick <= t_s:
                return max(tick, 0.0)
        return 0.0

    def _hash01(self, k: int) -> float:
        return ((k * 2654435761 + self._hash_seed) % 4294967296) / 4294967296.0

    def power_usage_mw(self) -> int:
        """1 s trailing-average power with read noise, mW."""
        self._check()
        window = self._sensors.power_average_window_s
        start = max(self.now_s - window, self._starts[0] if self._starts else self.now_s)
        span = self.now_s - start
        if span <= 0:
            avg = self.sku.idle_power_w
        else:
            avg = (self._energy_until_j(self.now_s) - self._energy_until_j(start)) / span
        noise = self._rng.gauss(1.0, self._sensors.power_read_noise_frac)
        return int(avg * noise * 1000.0)

    def instant_power_mw(self) -> int:
        """Instantaneous power of the running segment with read noise, mW."""
        self._check()
        if Fault.ENERGY_NOT_SUPPORTED in self._faults:
            raise errors.GpuNotSupportedError("instant power field not supported", self._uuid)
        power = self._segments[-1].power_w if self._segments else self.sku.idle_power_w
        return int(power * self._rng.gauss(1.0, self._sensors.power_read_noise_frac) * 1000.0)

    def power_limit_mw(self) -> int:
        """Power limit in force, mW (``nvmlDeviceGetEnforcedPowerLimit``)."""
        self._check()
        return int(self._power_limit_w * 1000)

    def power_limit_constraints_mw(self) -> tuple[int, int]:
        """(min, max) settable limit, mW (``nvmlDeviceGetPowerManagementLimitConstraints``)."""
        self._check()
        return int(self.sku.min_power_limit_w * 1000), int(self.sku.power_limit_w * 1000)

    def default_power_limit_mw(self) -> int:
        """Default power limit, mW (``nvmlDeviceGetPowerManagementDefaultLimit``)."""
        self._check()
        return int(self.sku.power_limit_w * 1000)

    def set_power_limit_mw(self, limit_mw: int) -> None:
        """Set the power limit (``nvmlDeviceSetPowerManagementLimit``); it caps every clock.

        Raises:
            GpuNoPermissionError: NO_PERMISSION fault injected.
            GpuTransientError: the limit is outside the constraints (NVML_ERROR_INVALID_ARGUMENT).
        """
        self._check()
        if Fault.NO_PERMISSION in self._faults:
            raise errors.GpuNoPermissionError(
                "setting the power limit needs CAP_SYS_ADMIN (NVML_ERROR_NO_PERMISSION)", self._uuid
            )
        lo, hi = self.power_limit_constraints_mw()
        if not lo <= limit_mw <= hi:
            raise errors.GpuTransientError(
                f"power limit {limit_mw} mW outside {lo}-{hi} mW (NVML_ERROR_INVALID_ARGUMENT)",
                self._uuid,
            )
        self._power_limit_w = limit_mw / 1000.0
        self.writes += 1

    def clock_event_reasons(self) -> frozenset[base.ClockEventReason]:
        """SW_POWER_CAP while the power limit holds the clock below the lock or boost."""
        self._check()
        kind = self._current_kind
        if kind == "idle":
            return frozenset({base.ClockEventReason.GPU_IDLE})
        target = self.sku.max_sm_clock_mhz if self._locked is None else self._locked[1]
        if self.sku.power_capped_clock_mhz(kind, self._power_limit_w) < target:
            return frozenset({base.ClockEventReason.SW_POWER_CAP})
        return frozenset()

    # ----- simulator controls ---------------------------------------------------------------
    def inject(self, *faults: Fault) -> None:
        """Start showing ``faults``."""
        self._faults.update(faults)

    def clear_faults(self) -> None:
        """Stop showing any fault."""
        self._faults.clear()

    def reset_energy_counter(self) -> None:
        """Simulate a driver reload: the counter restarts near 0."""
        self._counter_offset_mj = -int(
            self._energy_until_j(self._last_update_before(self.now_s)) * 1000.0
        )

    def execute(
        self, kind: models.PhaseKind, duration_s: float, power_factor: float = 1.0
    ) -> float:
        """Run ``kind`` for ``duration_s`` at the current effective clock; returns true joules.

        Args:
            kind: phase kind.
            duration_s: virtual seconds (>= 0).
            power_factor: multiplicative noise on the phase's mean power.
        """
        if duration_s < 0:
            raise ValueError("duration_s must be >= 0")
        self._current_kind = kind
        clock = self.effective_clock_mhz(kind)
        power = self.sku.power_w(kind, clock) * self.power_spread * power_factor
        return self._append(duration_s, power, clock)

    def idle(self, until_s: float) -> float:
        """Sit idle until virtual time ``until_s``; returns true joules."""
        self._current_kind = "idle"
        if until_s <= self.now_s:
            return 0.0
        idle_w = self.sku.idle_power_for(None if self._locked is None else self._locked[1])
        return self._append(until_s - self.now_s, idle_w * self.power_spread, 0.0)

    def true_energy_j(self) -> float:
        """Truth: joules since creation."""
        return self._cum_j[-1]

    def _append(self, duration_s: float, power_w: float, clock: float) -> float:
        if duration_s == 0:
            return 0.0
        seg = Segment(self.now_s, self.now_s + duration_s, power_w, clock)
        self._segments.append(seg)
        self._starts.append(seg.start_s)
        energy = power_w * duration_s
        self._cum_j.append(self._cum_j[-1] + energy)
        self.now_s = seg.end_s
        return energy

    def _energy_until_j(self, t_s: float) -> float:
        i = bisect.bisect_right(self._starts, t_s) - 1
        if i < 0:
            return 0.0
        seg = self._segments[i]
        return self._cum_j[i] + seg.power_w * (min(t_s, seg.end_s) - seg.start_s)
