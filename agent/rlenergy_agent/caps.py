"""Locked clocks treated as caps: what each GPU actually runs after a lock, and why.

A locked SM clock is a request, not a guarantee: the driver holds the clock below the lock
under a power or thermal limit (a clock-event reason says so), sometimes with no reason at all,
and a limit can arrive minutes after the lock was accepted. ``CapWatch`` keeps, per GPU, the
lock the agent made, re-reads the SM clock and the clock-event reasons ``settle_s`` after each
lock (the read right after the write can see the old clock) and then every ``interval_s`` while
the lock holds, and classifies the last reading:

* ``asRequested``: effective clock within ``tolerance_mhz`` of the lock;
* ``capped``: below it with a slowdown reason (``limit`` names them: ``SwPowerCap``,
  ``HwSlowdown``, ``SwThermalSlowdown``, ``HwThermalSlowdown``, ``HwPowerBrakeSlowdown``);
* ``unexplained``: below it with no reason (flagged: node report, metric, Degraded condition);
* ``idle``: the GPU is idle (it runs nothing: no shortfall to judge); ``settling`` until the
  first reading after the settle time; ``unlocked`` without a lock.

The tolerance defaults to one SM clock step of the A100/H100 clock tables (15 MHz, NVML's
``nvmlDeviceGetSupportedGraphicsClocks`` lists them 15 MHz apart). Pure bookkeeping: the caller
(``rlenergy_agent.actuator``) does the NVML reads. Not thread safe: the service serialises calls.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence

from rlenergy.api import node as api_node
from rlenergy.gpu import base

CapState = api_node.ClockState

SETTLE_S = 1.0
"""Seconds after a lock before its first judged reading (NVML applies a lock within
milliseconds; one sampling period of margin)."""
INTERVAL_S = 5.0
"""Seconds between re-reads while a lock holds (a cap that arrives later shows within this)."""
TOLERANCE_MHZ = 15
"""Effective clocks this close below the lock count as the lock (one clock-table step)."""

_REASON_NAMES = {
    base.ClockEventReason.SW_POWER_CAP: "SwPowerCap",
    base.ClockEventReason.HW_SLOWDOWN: "HwSlowdown",
    base.ClockEventReason.SW_THERMAL_SLOWDOWN: "SwThermalSlowdown",
    base.ClockEventReason.HW_THERMAL_SLOWDOWN: "HwThermalSlowdown",
    base.ClockEventReason.HW_POWER_BRAKE_SLOWDOWN: "HwPowerBrakeSlowdown",
}


def limit_names(reasons: Iterable[base.ClockEventReason]) -> str:
    """The slowdown reasons among ``reasons`` as ``A,B`` (NVML names, sorted); ``""`` if none."""
    return ",".join(sorted(_REASON_NAMES[r] for r in reasons if r in _REASON_NAMES))


def held_clock_mhz(reads: Mapping[str, Sequence[int]]) -> int | None:
    """The lowest SM clock any GPU held over two consecutive read-backs, MHz (``None``: none).

    Args:
        reads: per GPU UUID, its SM clock read-backs of one window or probe slice, in order.

    A power or thermal cap holds a clock for many read-backs; one low read between reads at
    the lock is a transient, not the clock the window ran: a GPU ramping as its work begins,
    or the two NVML calls of a read (clock-event reasons, then the clock) falling either side
    of the GPU going idle or busy. Crediting such a read as the window's clock judged a 1.6 s
    training window at 1935 MHz by a single 345 MHz read in the full-stack e2e (its default
    time predicted 5x too short, the phase's status throughput ratio 0.952 against a true
    0.972). So each GPU's low is the lowest of the larger of each two consecutive reads; a GPU
    read once counts that read.
    """
    lows = [
        seq[0] if len(seq) == 1 else min(max(a, b) for a, b in itertools.pairwise(seq))
        for seq in reads.values()
        if seq
    ]
    return min(lows) if lows else None


def held_flag(flags: Mapping[str, Sequence[bool]]) -> bool:
    """Whether any GPU showed a flag on two consecutive read-backs (as ``held_clock_mhz``).

    Args:
        flags: per GPU UUID, one flag per read-back in order (a slowdown reason seen).
    """
    return any(
        (len(seq) == 1 and seq[0]) or any(a and b for a, b in itertools.pairwise(seq))
        for seq in flags.values()
    )


def classify(
    lock_mhz: int | None,
    effective_mhz: int | None,
    reasons: frozenset[base.ClockEventReason],
    tolerance_mhz: int = TOLERANCE_MHZ,
) -> tuple[CapState, str]:
    """(state, limit) of one reading against the lock.

    Args:
        lock_mhz: the lock the agent made, MHz (``None``: no lock).
        effective_mhz: the SM clock read back, MHz (``None``: unreadable).
        reasons: the clock-event reasons read with it.
        tolerance_mhz: shortfall that still counts as the lock, MHz.

    Returns:
        The state (module docstring) and the limiting reasons (``""`` unless ``capped``).
    """
    if lock_mhz is None:
        return "unlocked", ""
    if effective_mhz is None:
        return "settling", ""
    if effective_mhz >= lock_mhz - tolerance_mhz:
        return "asRequested", ""
    if base.ClockEventReason.GPU_IDLE in reasons:
        return "idle", ""
    limit = limit_names(reasons)
    return ("capped", limit) if limit else ("unexplained", "")


@dataclasses.dataclass
class GpuCap:
    """One GPU's lock and its last judged reading.

    Attributes:
        lock_mhz: the lock the agent made (``None``: default governor).
        locked_at_s: when the lock was made (monotonic), s.
        effective_mhz: SM clock of the last judged reading, MHz.
        state: see the module docstring.
        limit: the limiting reasons of a ``capped`` reading.
        checked_at_s: when the last reading was taken (monotonic), s.
        shortfalls: readings judged ``unexplained`` (a counter).
    """

    lock_mhz: int | None = None
    locked_at_s: float = 0.0
    effective_mhz: int | None = None
    state: CapState = "unlocked"
    limit: str = ""
    checked_at_s: float | None = None
    shortfalls: int = 0


class CapWatch:
    """Per GPU lock bookkeeping (module docstring).

    Args:
        settle_s: wait after a lock before its first judged reading, s.
        interval_s: time between re-reads while locked, s.
        tolerance_mhz: shortfall that still counts as the lock, MHz.
    """

    def __init__(
        self,
        settle_s: float = SETTLE_S,
        interval_s: float = INTERVAL_S,
        tolerance_mhz: int = TOLERANCE_MHZ,
    ) -> None:
        self.settle_s = settle_s
        self.interval_s = interval_s
        self.tolerance_mhz = tolerance_mhz
        self.gpus: dict[str, GpuCap] = {}

    def locked(self, uuid: str, lock_mhz: int | None, now_s: float) -> None:
        """The agent now holds ``lock_mhz`` on ``uuid`` (``None``: released)."""
        cap = self.gpus.setdefault(uuid, GpuCap())
        if lock_mhz == cap.lock_mhz and lock_mhz is not None:
            return  # the same lock re-applied: keep watching it
        self.gpus[uuid] = GpuCap(
            lock_mhz=lock_mhz,
            locked_at_s=now_s,
            state="unlocked" if lock_mhz is None else "settling",
            shortfalls=cap.shortfalls,
        )

    def due(self, now_s: float) -> list[str]:
        """GPUs whose lock wants a reading now (settled, and none within ``interval_s``)."""
        out = []
        for uuid, cap in self.gpus.items():
            if cap.lock_mhz is None or now_s - cap.locked_at_s < self.settle_s:
                continue
            if cap.checked_at_s is None or now_s - cap.checked_at_s >= self.interval_s:
                out.append(uuid)
        return sorted(out)

    def record(
        self,
        uuid: str,
        effective_mhz: int | None,
        reasons: frozenset[base.ClockEventReason],
        now_s: float,
    ) -> GpuCap:
        """Judge one reading of ``uuid``'s clock; returns the GPU's updated record."""
        cap = self.gpus.setdefault(uuid, GpuCap())
        cap.checked_at_s = now_s
        if now_s - cap.locked_at_s < self.settle_s:
            return cap  # too early to judge: the write may not have landed
        cap.state, cap.limit = classify(cap.lock_mhz, effective_mhz, reasons, self.tolerance_mhz)
        cap.effective_mhz = effective_mhz
        if cap.state == "unexplained":
            cap.shortfalls += 1
        return cap

    def get(self, uuid: str) -> GpuCap:
        """The GPU's record (an unlocked one when the GPU was never locked)."""
        return self.gpus.get(uuid, GpuCap())
