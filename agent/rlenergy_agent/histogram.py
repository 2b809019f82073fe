"""A cumulative histogram of observations (Prometheus histogram semantics), pure Python.

The agent records each phase signal's latency here at the moment it applies the clocks;
``rlenergy_agent.metrics`` exports it at scrape time as the histogram
``rlenergy_agent_phase_signal_latency_seconds`` (``_bucket{le=...}``, ``_sum``, ``_count``), so
quantiles are computed where they aggregate correctly: in Prometheus, with
``histogram_quantile(0.99, sum by (le) (rate(..._bucket[5m])))``. Counts only grow (a counter
per bucket), never trimmed.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

SIGNAL_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds of the signal-latency buckets, s. The agent applies clocks in about a
millisecond on the stand-in NVML (bench/agent.py) and in seconds with persistence mode off
(the driver re-initialises an idle GPU): the buckets span 0.5 ms to 10 s."""


class Histogram:
    """Cumulative bucket counts, sum and count of observations.

    Args:
        bounds_s: finite upper bounds, strictly increasing; ``+Inf`` is implied.

    Raises:
        ValueError: bounds empty, not increasing, or not finite.
    """

    def __init__(self, bounds_s: Sequence[float] = SIGNAL_LATENCY_BUCKETS_S) -> None:
        bounds = tuple(float(b) for b in bounds_s)
        if not bounds or any(not math.isfinite(b) for b in bounds):
            raise ValueError(f"histogram bounds must be finite and non-empty, got {bounds_s!r}")
        if any(b >= c for b, c in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"histogram bounds must increase strictly, got {bounds_s!r}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation ``value`` (same unit as the bounds)."""
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` per bucket, ``+Inf`` last (equal to ``count``)."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self._counts, strict=True):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(bound), running))
        return out
