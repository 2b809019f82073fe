"""Energy meter: running per-GPU totals and phase windows from counter deltas.

Each GPU keeps a running total (mJ) advanced by samples: with an energy counter, by the counter
delta between samples (``rlenergy.gpu.energy.counter_delta``: reset and wrap safe);
without one, by trapezoidal integration of instant power, or of the 1 s averaged power flagged
low confidence. A phase window is the difference of the running totals sampled
at its two boundaries, so windows and totals agree by construction and a window is the counter
delta between its boundaries, never an average of power. A GPU with nothing readable is
``unknown`` (energy ``None``), never 0. A lost GPU's windows close at its last good
sample and are flagged incomplete. Totals are saved with the raw counter they
correspond to, so a restarted agent adds the energy of its downtime once and only once.

Callers: ``rlenergy_agent.service`` (boundaries, periodic sampling), ``rlenergy_agent.metrics``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Literal

from rlenergy.gpu import base, errors
from rlenergy.gpu import energy as gpu_energy

log = logging.getLogger(__name__)

EnergySource = Literal["counter", "power_integration", "averaged_power", "unavailable"]
MAX_POWER_LIMIT_FACTOR = 1.5
"""A sample implying more than this times the board power limit is rejected."""
MIN_PLAUSIBILITY_WINDOW_S = 0.2
"""Counter updates come 20-100 ms apart (NVML docs), so a short interval can see a whole update:
plausibility is judged over at least this long, s."""
AVERAGE_WINDOW_S = 1.0
"""NVML's power reading averages over about 1 s on Ampere+."""


@dataclasses.dataclass
class GpuEnergy:
    """Running energy state of one GPU.

    Attributes:
        uuid: GPU UUID.
        source: how energy is measured.
        total_mj: energy counted since the totals file began, mJ.
        raw_mj: the last raw counter read (``None``: none yet or no counter).
        last_t: monotonic time of the last good sample, s.
        last_power_w: power at the last sample (integration modes), W.
        power_limit_w: board power limit, W (``None``: unknown).
        lost_at: wall time the GPU was lost (``None``: not lost).
        samples: good samples.
        missing: samples that failed (transient errors).
        rejected: samples rejected as implausible.
        resets: counter resets seen.
        errors_seen: failures since start, for incomplete-window detection.
        raw_since_t: monotonic time of the last sample before the current raw counter value was
            first read (the value was written after it), s.
    """

    uuid: str
    source: EnergySource
    total_mj: float = 0.0
    raw_mj: int | None = None
    last_t: float | None = None
    last_power_w: float | None = None
    power_limit_w: float | None = None
    lost_at: float | None = None
    samples: int = 0
    missing: int = 0
    rejected: int = 0
    resets: int = 0
    errors_seen: int = 0
    raw_since_t: float | None = None


@dataclasses.dataclass(frozen=True)
class Mark:
    """Running totals of some GPUs at one instant (a window boundary).

    Attributes:
        t_s: monotonic time, s.
        totals_mj: per UUID the running total, mJ (``None``: unknown).
        errors: per UUID ``errors_seen`` at the mark.
    """

    t_s: float
    totals_mj: Mapping[str, float | None]
    errors: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class Window:
    """Energy between two marks.

    Attributes:
        duration_s: wall time, s.
        energy_j: summed over the GPUs, J; ``None`` when any GPU is unknown.
        per_gpu_j: per UUID, J (``None``: unknown).
        incomplete: a GPU failed or was lost inside the window (energy is a lower bound).
        low_confidence: a GPU measured by averaged power in a window shorter than twice the
            averaging window.
        sources: per UUID the energy source.
    """

    duration_s: float
    energy_j: float | None
    per_gpu_j: Mapping[str, float | None]
    incomplete: bool
    low_confidence: bool
    sources: Mapping[str, EnergySource]


def source_for(energy_counter: bool, instant_power: bool, power_usage: bool) -> EnergySource:
    """The best energy source among what a GPU supports (probe results)."""
    if energy_counter:
        return "counter"
    if instant_power:
        return "power_integration"
    if power_usage:
        return "averaged_power"
    return "unavailable"


class EnergyMeter:
    """Per-GPU running totals and windows.

    Args:
        gpus: the GPUs keyed by UUID.
        sources: the energy source per UUID (from the capability probe).
        totals_path: JSON file the totals persist to (``None``: memory only).
        clock: monotonic time source, s.
        wall: wall-clock source, s (persisted totals use it across restarts).
    """

    def __init__(
        self,
        gpus: Mapping[str, base.Gpu],
        sources: Mapping[str, EnergySource],
        *,
        totals_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.gpus = dict(gpus)
        self._clock = clock
        self._wall = wall
        self.totals_path = totals_path
        self._lock = threading.RLock()
        self.state: dict[str, GpuEnergy] = {
            u: GpuEnergy(u, sources.get(u, "unavailable")) for u in self.gpus
        }
        for u, st in self.state.items():
            try:
                st.power_limit_w = self.gpus[u].power_limit_mw() / 1000.0
            except errors.GpuError:
                st.power_limit_w = None
        self._saved_wall: dict[str, float] = {}
        self.restored_downtime_j = 0.0
        if totals_path is not None:
            self._load(totals_path)

    # ----- persistence ----------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        if not path.exists():
            return
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.error("energy totals file %s unreadable (%s); starting from 0", path, exc)
            return
        for uuid, rec in data.get("gpus", {}).items():
            st = self.state.get(uuid)
            if st is None:
                continue
            st.total_mj = float(rec.get("total_mj", 0.0))
            raw = rec.get("raw_mj")
            st.raw_mj = int(raw) if raw is not None and st.source == "counter" else None
            self._saved_wall[uuid] = float(rec.get("wall_s", self._wall()))

    def save(self) -> None:
        """Persist totals with the raw counter each corresponds to (atomic replace, fsynced)."""
        if self.totals_path is None:
            return
        with self._lock:
            data = {
                "version": 1,
                "gpus": {
                    u: {"total_mj": st.total_mj, "raw_mj": st.raw_mj, "wall_s": self._wall()}
                    for u, st in self.state.items()
                },
            }
        self.totals_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.totals_path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.totals_path)

    # ----- sampling ---------------------------------------------------------------------------
    def sample(self, uuids: Iterable[str] | None = None) -> None:
        """Read every (or the given) GPU once and advance its running total."""
        with self._lock:
            for uuid in self.state if uuids is None else uuids:
                st = self.state.get(uuid)
                if st is not None:
                    self._sample_one(st)

    def _sample_one(self, st: GpuEnergy) -> None:
        if st.source == "unavailable" or st.lost_at is not None:
            return
        gpu = self.gpus[st.uuid]
        now = self._clock()
        try:
            if st.source == "counter":
                raw = gpu.total_energy_mj()
                self._advance_counter(st, raw, now)
            else:
                power_mw = (
                    gpu.instant_power_mw()
                    if st.source == "power_integration"
                    else gpu.power_usage_mw()
                )
                self._advance_power(st, power_mw / 1000.0, now)
        except errors.GpuLostError as exc:
            st.lost_at = self._wall()
            st.errors_seen += 1
            log.error("GPU %s lost; its energy stops at the last good sample: %s", st.uuid, exc)
            return
        except errors.GpuError as exc:
            st.missing += 1
            st.errors_seen += 1
            log.warning("energy sample of %s failed (counted missing): %s", st.uuid, exc)
            return
        st.samples += 1
        st.last_t = now

    def _advance_counter(self, st: GpuEnergy, raw: int, now: float) -> None:
        if st.raw_mj is None:
            self._saved_wall.pop(st.uuid, None)
            st.raw_mj = raw
            st.raw_since_t = now
            return
        if st.last_t is None:
            # First sample after a restart: the persisted raw counter is from the last save.
            saved = self._saved_wall.pop(st.uuid, None)
            duration = max(self._wall() - saved, 0.0) if saved is not None else 0.0
        else:
            duration = now - st.last_t
        # A counter that held one value over several samples and then moved covers the time
        # since that value was written (at most since the sample before it was first read), not
        # just since the last sample: a driver that updates the counter late (a stall, then a
        # catch-up) is not a glitch; overflow or sentinel jumps are orders of magnitude larger.
        covered = duration
        if st.last_t is not None and st.raw_since_t is not None:
            covered = max(duration, now - st.raw_since_t)
        delta = gpu_energy.counter_delta(st.raw_mj, raw, covered)
        if delta.reset_detected:
            st.resets += 1
            log.warning(
                "energy counter of %s went back (%d -> %d mJ): driver reload or GPU reset",
                st.uuid,
                st.raw_mj,
                raw,
            )
        energy = delta.energy_mj
        if energy is not None and st.power_limit_w is not None:
            limit_mj = (
                MAX_POWER_LIMIT_FACTOR
                * st.power_limit_w
                * max(covered, MIN_PLAUSIBILITY_WINDOW_S)
                * 1000.0
            )
            if energy > limit_mj:
                energy = None
        if energy is None:
            st.rejected += 1
            st.errors_seen += 1
            log.warning(
                "rejected implausible energy sample on %s (%d -> %d mJ in %.3f s)",
                st.uuid,
                st.raw_mj,
                raw,
                covered,
            )
        else:
            if st.last_t is None:
                self.restored_downtime_j += energy / 1000.0
            st.total_mj += energy
        if raw != st.raw_mj or st.raw_since_t is None:
            st.raw_since_t = st.last_t if st.last_t is not None else now
        st.raw_mj = raw

    def _advance_power(self, st: GpuEnergy, power_w: float, now: float) -> None:
        if st.last_t is not None and st.last_power_w is not None:
            dt = max(now - st.last_t, 0.0)
            st.total_mj += (st.last_power_w + power_w) / 2.0 * dt * 1000.0
        st.last_power_w = power_w

    def readmit(self, uuid: str) -> None:
        """A lost GPU answers again: sample it from a fresh counter baseline.

        The energy of the time it was lost is unknown: it is not counted, and the windows that
        span the loss are ``incomplete`` (the loss counted as an error).
        """
        with self._lock:
            st = self.state.get(uuid)
            if st is None or st.lost_at is None:
                return
            st.lost_at = None
            st.raw_mj = None
            st.raw_since_t = None
            st.last_power_w = None
            st.errors_seen += 1
            log.warning("GPU %s answers again: energy counted from now on", uuid)

    def lost(self) -> list[str]:
        """GPUs the meter found lost."""
        with self._lock:
            return [u for u, st in self.state.items() if st.lost_at is not None]

    # ----- windows ----------------------------------------------------------------------------
    def mark(self, uuids: Iterable[str]) -> Mark:
        """Sample ``uuids`` now and return their running totals (a window boundary)."""
        ids = list(uuids)
        with self._lock:
            self.sample(ids)
            totals: dict[str, float | None] = {}
            errs: dict[str, int] = {}
            for u in ids:
                st = self.state.get(u)
                if st is None or st.source == "unavailable" or st.samples == 0:
                    totals[u] = None
                    errs[u] = st.errors_seen if st else 0
                    continue
                totals[u] = st.total_mj
                errs[u] = st.errors_seen
            return Mark(self._clock(), totals, errs)

    def window(self, start: Mark, end: Mark) -> Window:
        """Energy between two marks of the same GPUs.

        Returns:
            The window; a GPU unknown at either mark makes the sum unknown.
        """
        per: dict[str, float | None] = {}
        incomplete = False
        low = False
        sources: dict[str, EnergySource] = {}
        duration = max(end.t_s - start.t_s, 0.0)
        for u, a in start.totals_mj.items():
            b = end.totals_mj.get(u)
            st = self.state.get(u)
            sources[u] = st.source if st else "unavailable"
            if a is None or b is None:
                per[u] = None
                continue
            per[u] = max(b - a, 0.0) / 1000.0
            if end.errors.get(u, 0) != start.errors.get(u, 0) or (st and st.lost_at is not None):
                incomplete = True
            if sources[u] == "averaged_power" and duration < 2 * AVERAGE_WINDOW_S:
                low = True
        values = list(per.values())
        total = None if any(v is None for v in values) else sum(v for v in values if v is not None)
        return Window(duration, total, per, incomplete, low, sources)

    def total_j(self, uuid: str) -> float | None:
        """Running total of one GPU, J (``None``: unknown, never 0 for unreadable)."""
        st = self.state.get(uuid)
        if st is None or st.source == "unavailable":
            return None
        return st.total_mj / 1000.0


def power_from_counter(delta_mj: int, duration_s: float) -> float:
    """Mean power of a counter window, W (952,494 mJ over 60 s is 15.87 W).

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be > 0")
    return delta_mj / 1000.0 / duration_s


def straggler_wait_worker_s(finish_times_s: Iterable[float], gpus_per_worker: int = 1) -> float:
    """GPU-seconds rollout workers wait for the slowest one in a phase.

    Args:
        finish_times_s: each worker's finish time within the phase, s.
        gpus_per_worker: GPUs per worker.

    Returns:
        ``sum(max - t) * gpus_per_worker``, GPU-seconds (0 for no workers).
    """
    times = list(finish_times_s)
    if not times:
        return 0.0
    last = max(times)
    return sum(last - t for t in times) * gpus_per_worker
