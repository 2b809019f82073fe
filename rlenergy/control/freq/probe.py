"""In-phase interleaved probes: paired comparison of a candidate clock with the default governor.

Why: the EE-RL trial compares a candidate with the default-governor prediction for the same
tokens, but on real verl traces a step's phase time varies 2-11 % (generation) around any
token-based prediction, more than the 3-5 % throughput effect a threshold of 0.95 must resolve.
So a trial step runs the phase as short slices alternating candidate and default governor in
Thue-Morse order (candidate, default, default, candidate, default, candidate, candidate, default), and compares token rate and power within
each block: the workload is the same on both sides, its slow change cancels to first order, and
the energy-per-token ratio follows as power ratio / throughput ratio. The agent switches clocks
in milliseconds, so slices of about a second cost nothing; tokens per slice come from the
trainer SDK's progress reports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rlenergy.control.freq import base


THUE_MORSE = (True, False, False, True, False, True, True, False)
"""One probe block: candidate (True) and default (False) slices in Thue-Morse order. The two
sides have equal first and second moments of position (0+3+5+6 = 1+2+4+7, 0+9+25+36 =
1+4+16+49), so a throughput trend that is linear or quadratic over the block cancels: decode
slows as sequences finish, and an ABBA block would bias the candidate upward."""
BLOCK = len(THUE_MORSE)


def block_schedule(clocks_mhz: Sequence[int]) -> tuple[int | None, ...]:
    """Slice schedule: one Thue-Morse block per clock (``None`` = default governor)."""
    out: list[int | None] = []
    for c in clocks_mhz:
        out.extend(c if is_candidate else None for is_candidate in THUE_MORSE)
    return tuple(out)


@dataclasses.dataclass
class RatioStats:
    """Running mean and variance (Welford) of per-block ratios for one clock."""

    n: int = 0
    throughput_mean: float = 0.0
    throughput_m2: float = 0.0
    power_sum: float = 0.0
    power_n: int = 0

    def add(self, throughput_ratio: float, power_ratio: float | None) -> None:
        """Add one block's throughput ratio (candidate / default) and power ratio."""
        self.n += 1
        delta = throughput_ratio - self.throughput_mean
        self.throughput_mean += delta / self.n
        self.throughput_m2 += delta * (throughput_ratio - self.throughput_mean)
        if power_ratio is not None:
            self.power_sum += power_ratio
            self.power_n += 1

    @property
    def stderr(self) -> float:
        """Standard error of the mean throughput ratio (inf below 2 blocks)."""
        if self.n < 2:
            return math.inf
        return math.sqrt(self.throughput_m2 / (self.n - 1) / self.n)

    @property
    def power_ratio(self) -> float | None:
        """Mean power ratio candidate / default, or None if no energy was readable."""
        return self.power_sum / self.power_n if self.power_n else None

    @property
    def energy_per_token_ratio(self) -> float | None:
        """Energy per token, candidate / default (power ratio / throughput ratio)."""
        p = self.power_ratio
        if p is None or self.throughput_mean <= 0:
            return None
        return p / self.throughput_mean


def blocks_from_slices(
    slices: Sequence[base.ProbeSlice], min_fraction: float = 0.9
) -> tuple[list[tuple[int, float, float | None]], int]:
    """Group slices into Thue-Morse blocks; return per block (clock, throughput ratio, power ratio).

    Slices are scanned in order; a block is eight consecutive slices whose clocks follow
    ``THUE_MORSE`` for one candidate clock. Blocks with a slice shorter than ``min_fraction`` of
    the block's longest slice (the phase ended mid-slice) or without tokens on the default side
    are dropped.

    Returns:
        The blocks and the number of slices consumed (the rest may start a block that later
        slices complete, when slices are whole phases of consecutive steps).
    """
    out: list[tuple[int, float, float | None]] = []
    i = 0
    while i + BLOCK <= len(slices):
        group = slices[i : i + BLOCK]
        clock = group[0].clock_mhz
        if clock is None or any(
            (s.clock_mhz == clock) != cand or (not cand and s.clock_mhz is not None)
            for s, cand in zip(group, THUE_MORSE, strict=True)
        ):
            i += 1
            continue
        i += BLOCK
        durations = [s.duration_s for s in group]
        if min(durations) < min_fraction * max(durations):
            continue
        a = [s for s, cand in zip(group, THUE_MORSE, strict=True) if cand]
        b = [s for s, cand in zip(group, THUE_MORSE, strict=True) if not cand]
        ta, tb = sum(s.duration_s for s in a), sum(s.duration_s for s in b)
        rate_b = sum(s.tokens for s in b) / tb
        if rate_b <= 0:
            continue
        thr = (sum(s.tokens for s in a) / ta) / rate_b
        power: float | None = None
        ea = [s.energy_j for s in a]
        eb = [s.energy_j for s in b]
        if all(e is not None for e in ea + eb):
            total_b = sum(e or 0.0 for e in eb)
            if total_b > 0:
                power = (sum(e or 0.0 for e in ea) / ta) / (total_b / tb)
        out.append((clock, thr, power))
    return out, i
