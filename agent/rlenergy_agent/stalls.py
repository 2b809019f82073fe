"""Stalled rollouts: progress frozen while requests are in flight and the GPUs draw little power.

A hung inference engine (a NCCL wait, a dead worker the scheduler still waits on) keeps its
requests in flight and its GPUs busy-waiting: utilisation stays high, power drops toward idle
and progress stops. Without a detector the agent keeps cycling trial clocks through it and the
low power reads as a saving. ``StallWatch`` judges one phase window at every sample of the
agent's sampling loop from three inputs, whatever feeds them (today the trainer SDK's
``/v1/progress`` reports: cumulative ``total`` and ``inFlight``; the engine-metrics progress
stream can feed the same call):

* progress: the window's cumulative progress did not grow since the previous sample;
* in flight: the caller's last report said at least one request is in flight (unknown counts
  as none: a training phase or an SDK that does not say is never judged stalled);
* power: the window's mean power per GPU over the sample interval is below ``band_w``.

A sample with progress not grown and requests in flight is *quiet*; a quiet sample whose
power is also in the band is *frozen*. A stall is a judgement over a window, not over one
sample: once a run of quiet samples has lasted ``after_s``, the run is stalled when at least
``IN_BAND_FRACTION`` of its samples of the last ``after_s`` seconds are frozen, from the
first frozen sample of that window on. So a power spike of one or two samples (a clock switch
wakes the busy-wait for a moment) neither resets the run nor ends a stall; progress that grows,
an empty in-flight count, or power above the band for more than ``1 - IN_BAND_FRACTION`` of the
window does. The stall ends at its last quiet sample (observed on both ends, so the stalled
time is a lower bound: never more than the agent saw). While stalled the agent changes no clock
(the prober holds the current slice's clock), the window reports the stalled seconds and their
energy (``stalledSeconds``, ``stalledEnergyJoules``, excluded from savings and trial evidence
by the operator), slices that overlap a stall are flagged ``stalled`` (the probe drops their
blocks), the GPUs say ``stalled`` in the node report (the operator's ``RolloutStalled``
condition) and ``rlenergy_agent_rollout_stalled`` is 1.

The power band per SKU (``band_w``): half way between the SKU's idle power and the least power
a working decode draws, the generation phase model at the lowest supported clock
(``rlenergy.gpu.models``, ``data/gpus.yaml``; H100 SXM: 80 W idle, 206 W decode at 345 MHz ->
143 W) [MODEL]. A GPU the catalog does not know gets ``UNKNOWN_SKU_LIMIT_FRACTION`` of its
enforced power limit (0.2 x 700 W = 140 W on an H100, the same band) [MODEL].

Pure bookkeeping (times, numbers and opaque energy marks in, transitions out); the service
reads NVML and the meter. Not thread safe: the service serialises calls.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from rlenergy.gpu import models

STALL_AFTER_S = 60.0
"""Default frozen time before a stall is declared, s (``RLENERGY_AGENT_STALL_AFTER_S``): long
enough that a slow prefill or a long tool call with progress reported per step does not trip
it, short against the minutes a hung engine wastes."""
BAND_FRACTION = 0.5
"""Where the band sits between idle power (0) and a working decode at the lowest clock (1)."""
IN_BAND_FRACTION = 0.7
"""Share of a quiet window's samples that must sit in the power band for a stall [MODEL: a
clock switch lifts a busy-waiting GPU's power for about one 1 s sample, so a hung engine whose
clock changes every 4 s or more keeps at least 70 % of a window's samples in the band (one in
four above it, plus one at the window's edge); a working engine whose progress report lags
sits above the band for most of its samples]."""
UNKNOWN_SKU_LIMIT_FRACTION = 0.2
"""Band of a GPU the SKU catalog does not know: this share of its enforced power limit."""


def band_w(gpu_name: str, power_limit_w: float | None) -> float | None:
    """The stall power band per GPU, W (module docstring); ``None``: no basis for one.

    Args:
        gpu_name: NVML product name (``nvmlDeviceGetName``).
        power_limit_w: enforced power limit, W (``None``: unreadable).
    """
    sku = models.sku_for_nvml_name(gpu_name)
    if sku is not None:
        working = sku.power_w("generation", sku.min_sm_clock_mhz)
        return sku.idle_power_w + BAND_FRACTION * (working - sku.idle_power_w)
    if power_limit_w is not None and power_limit_w > 0:
        return UNKNOWN_SKU_LIMIT_FRACTION * power_limit_w
    return None


@dataclasses.dataclass
class Stall:
    """One stall (closed when ``end_s`` is set).

    Attributes:
        start_s: first frozen sample, s (the service's clock).
        start_mark: the energy mark taken at ``start_s`` (opaque here).
        end_s: last frozen sample, s (``None`` while it lasts).
        end_mark: the mark taken at ``end_s``.
    """

    start_s: float
    start_mark: Any
    end_s: float | None = None
    end_mark: Any = None


@dataclasses.dataclass
class StallWatch:
    """The stall state of one phase window (module docstring).

    Attributes:
        after_s: quiet time that makes a stall, s (also the judged window's length).
        band_w: power per GPU below which a quiet sample is frozen, W.
        stalls: the window's stalls, the last one possibly open.
        in_flight: the caller's last in-flight count (``None``: never said).
        power_w: mean power per GPU of the last sample interval, W.
        in_band_fraction: share of the judged window's samples that must be frozen.
    """

    after_s: float
    band_w: float
    stalls: list[Stall] = dataclasses.field(default_factory=list)
    in_flight: int | None = None
    power_w: float | None = None
    in_band_fraction: float = IN_BAND_FRACTION
    _progress: float | None = None
    _run_s: float | None = None
    _window: collections.deque[tuple[float, bool, Any]] = dataclasses.field(
        default_factory=collections.deque
    )
    _last_s: float = 0.0
    _last_mark: Any = None

    @property
    def stalled(self) -> bool:
        """A stall is going on."""
        return bool(self.stalls) and self.stalls[-1].end_s is None

    def frozen_for_s(self, now_s: float) -> float:
        """How long the current run of quiet samples lasts, s (0 when none)."""
        return 0.0 if self._run_s is None else max(now_s - self._run_s, 0.0)

    def _share(self) -> float:
        """Frozen share of the judged window's samples."""
        return sum(frozen for _, frozen, _ in self._window) / max(len(self._window), 1)

    def sample(self, now_s: float, progress: float, power_w: float | None, mark: Any) -> str | None:
        """Judge one sample; returns ``"started"`` or ``"ended"`` on a transition, else None.

        Args:
            now_s: the sample's time, s.
            progress: the window's cumulative progress now.
            power_w: mean power per GPU since the previous sample, W (``None``: unknown,
                quiet but not frozen).
            mark: the energy mark of this sample (kept for the stall's energy).
        """
        self.power_w = power_w
        quiet = (
            self._progress is not None and progress <= self._progress and (self.in_flight or 0) > 0
        )
        frozen = quiet and power_w is not None and power_w < self.band_w
        self._progress = progress
        out: str | None = None
        if not quiet:
            if self.stalled:
                self._end(self._last_s, self._last_mark)
                out = "ended"
            self._run_s = None
            self._window.clear()
        else:
            if self._run_s is None:
                self._run_s = now_s
            self._window.append((now_s, frozen, mark))
            while self._window and self._window[0][0] < now_s - self.after_s:
                self._window.popleft()
            enough = self._share() >= self.in_band_fraction
            if not self.stalled and enough and now_s - self._run_s >= self.after_s:
                first = next((t, m) for t, f, m in self._window if f)
                self.stalls.append(Stall(first[0], first[1]))
                out = "started"
            elif self.stalled and not enough:
                self._end(self._last_s, self._last_mark)
                out = "ended"
                self._run_s = now_s  # a new run, judged afresh
                self._window.clear()
                self._window.append((now_s, frozen, mark))
        self._last_s, self._last_mark = now_s, mark
        return out

    def close(self) -> None:
        """The window closes: an open stall ends at its last frozen sample."""
        if self.stalled:
            self._end(self._last_s, self._last_mark)

    def _end(self, end_s: float, mark: Any) -> None:
        self.stalls[-1].end_s = end_s
        self.stalls[-1].end_mark = mark

    def stalled_s(self, now_s: float | None = None) -> float:
        """Stalled time of the window, s (an open stall up to ``now_s``, else its last sample)."""
        total = 0.0
        open_end = now_s if now_s is not None else self._last_s
        for st in self.stalls:
            end = st.end_s if st.end_s is not None else open_end
            total += max(end - st.start_s, 0.0)
        return total

    def overlaps(self, start_s: float, end_s: float) -> bool:
        """Whether ``[start_s, end_s]`` overlaps a stall (an open one lasts until now)."""
        for st in self.stalls:
            end = st.end_s if st.end_s is not None else float("inf")
            if start_s <= end and st.start_s <= end_s:
                return True
        return False
