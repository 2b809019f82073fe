"""Energy windows from a GPU's cumulative energy counter, safe across wrap and reset.

Used by the simulator's job runner and by the agent's energy meter: a phase window is the
counter delta between its boundaries, not an integral of averaged power (NVML's power reading
is a 1 s trailing average, so it smears phase boundaries).
"""

from __future__ import annotations

import dataclasses

COUNTER_WRAP_MJ = 2**64
"""NVML's energy counter is an unsigned long long in mJ (NVML API reference)."""

MAX_PLAUSIBLE_POWER_W = 3000.0
"""Upper bound on a single GPU's power used to reject absurd counter jumps [MODEL]:
the largest part we support draws 1,200 W (GB200)."""


@dataclasses.dataclass(frozen=True)
class CounterDelta:
    """Result of reading a counter window.

    Attributes:
        energy_mj: energy in the window, mJ; ``None`` when it cannot be known.
        reset_detected: the counter went backwards (driver reload, GPU reset); the energy
            counted is the part after the reset, a lower bound.
        rejected: the delta was implausible (more than ``MAX_PLAUSIBLE_POWER_W`` for the window).
    """

    energy_mj: int | None
    reset_detected: bool = False
    rejected: bool = False


def counter_delta(start_mj: int, end_mj: int, duration_s: float) -> CounterDelta:
    """Energy between two counter reads.

    Args:
        start_mj: counter at the window start, mJ.
        end_mj: counter at the window end, mJ.
        duration_s: wall time between the two reads, s (must be >= 0).

    Returns:
        The delta. A counter that went backwards is treated as a reset: the energy after the
        reset (``end_mj``) is a lower bound, flagged. A wrap of the 64-bit counter is
        indistinguishable from a reset only above 2**63 mJ; near the top it is unwrapped. A
        delta above ``MAX_PLAUSIBLE_POWER_W`` x duration is rejected (``energy_mj=None``).

    Raises:
        ValueError: negative counter values or duration.
    """
    if start_mj < 0 or end_mj < 0:
        raise ValueError("counter values must be >= 0 mJ")
    if duration_s < 0:
        raise ValueError("duration_s must be >= 0")
    limit_mj = MAX_PLAUSIBLE_POWER_W * max(duration_s, 0.1) * 1000.0
    if end_mj >= start_mj:
        delta = end_mj - start_mj
        if delta > limit_mj:
            return CounterDelta(None, rejected=True)
        return CounterDelta(delta)
    wrapped = COUNTER_WRAP_MJ - start_mj + end_mj
    if start_mj > 2**63 and wrapped <= limit_mj:
        return CounterDelta(wrapped)
    if end_mj > limit_mj:
        return CounterDelta(None, reset_detected=True, rejected=True)
    return CounterDelta(end_mj, reset_detected=True)
