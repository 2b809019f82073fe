"""In-phase probe slices (EE-RL trials): the prober thread, slice boundaries, power samples.

The first slice's clock is applied by the phase signal (``service.Agent.phase``); the prober
(``probe_tick``, on its own thread) switches the lock at each later slice boundary through the
idempotent actuator, samples instant power a few times per slice and keeps the trainer's
cumulative progress log, interpolated at the boundaries when the window closes.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Sequence

from rlenergy.api import node as api_node
from rlenergy.gpu import base as gpu_base
from rlenergy.gpu import errors
from rlenergy_agent import caps, energy, stalls
from rlenergy_agent.pods import PodRef
from rlenergy_agent.state import (
    IDLE,
    MAX_PROGRESS_LOG,
    MAX_REPORT_AGE_S,
    POWER_SAMPLES_PER_SLICE,
    PROBER_IDLE_WAIT_S,
    AgentState,
    SignalRefused,
    _Open,
    _Probe,
    _Slice,
)

log = logging.getLogger("rlenergy_agent.service")


class ProbeSlices(AgentState):
    """ProbeSlices of ``service.Agent`` (a mixin over ``state.AgentState``)."""

    def progress(self, pod: PodRef, amount: float, in_flight: int | None = None) -> None:
        """Add phase progress (tokens or iterations) to ``pod``'s open window.

        ``in_flight``: requests the caller has in flight now (``None``: not said); see
        ``progress_total``.

        Raises:
            SignalRefused: a negative or non-finite amount (it would poison the window).
        """
        if not math.isfinite(amount) or amount < 0:
            raise SignalRefused(f"progress amount must be a finite number >= 0, got {amount}", 400)
        with self._lock:
            w = self._open.get(pod)
            if w is not None:
                w.last_signal_s = self._clock()
                w.progress += amount
                self._log_progress(w)
                self._in_flight(w, in_flight)

    def progress_total(
        self, pod: PodRef, total: float, at_s: float | None = None, in_flight: int | None = None
    ) -> None:
        """Set the cumulative progress of ``pod``'s current phase (tokens or iterations so far).

        Cumulative reports lose nothing when one is dropped, and a probed window interpolates
        them at its slice boundaries.

        Args:
            pod: the authenticated caller.
            total: progress of the phase so far.
            at_s: when the trainer measured it (``CLOCK_MONOTONIC``, shared by the processes
                of a node); taken only when it lies within ``MAX_REPORT_AGE_S`` before now and
                after the previous report, else the arrival time is used. It keeps the
                request's transit and queueing out of the slice boundaries.
            in_flight: requests the caller has in flight now (rollout engines; ``None``: not
                said). From the first count on, the window is watched for stalls
                (``rlenergy_agent.stalls``: progress frozen with requests in flight at low
                power).

        Raises:
            SignalRefused: a negative or non-finite total.
        """
        if not math.isfinite(total) or total < 0:
            raise SignalRefused(f"progress total must be a finite number >= 0, got {total}", 400)
        with self._lock:
            w = self._open.get(pod)
            if w is not None:
                w.last_signal_s = self._clock()
                w.progress = total
                self._log_progress(w, at_s)
                self._in_flight(w, in_flight)

    def _in_flight(self, w: _Open, in_flight: int | None) -> None:
        if in_flight is None or w.phase == IDLE:
            return
        if w.stall is None:
            band = self._stall_band(w.gpus)
            if band is None:
                return
            w.stall = stalls.StallWatch(self.stall_after_s, band)
        w.stall.in_flight = in_flight

    def _stall_band(self, gpus: Sequence[str]) -> float | None:
        """The lowest stall power band of ``gpus``, W (``stalls.band_w``; read once per GPU)."""
        bands = [b for u in gpus if (b := self._power_band_w(u)) is not None]
        return min(bands) if bands else None

    @staticmethod
    def _progress_cadence(w: _Open, duration_s: float, end_s: float) -> dict[str, float | None]:
        """The window's mean and largest progress-report gaps, s (``None``: no report)."""
        if w.last_report_s is None:
            return {"progress_mean_gap_seconds": None, "progress_max_gap_seconds": None}
        return {
            "progress_mean_gap_seconds": duration_s / (w.reports + 1),
            "progress_max_gap_seconds": max(w.report_gap_s, end_s - w.last_report_s),
        }

    def _log_progress(self, w: _Open, at_s: float | None = None) -> None:
        now = self._clock()
        t = now
        last = w.started_s if w.last_report_s is None else w.last_report_s
        if w.probe is not None and w.progress_log:
            last = max(last, w.progress_log[-1][0])
        if at_s is not None and math.isfinite(at_s) and now - MAX_REPORT_AGE_S <= at_s <= now:
            t = max(at_s, last)
        # The cadence of every window (probed or not) tells EE-RL whether in-phase slices can
        # be resolved (``PhaseWindowReport.progress_mean_gap_seconds``). Only reports that
        # advance the total count: a counter re-read between its steps (a micro-batch, an
        # engine step) resolves nothing finer than its steps.
        if w.progress != w.reported:
            w.report_gap_s = max(w.report_gap_s, t - last)
            w.last_report_s = t
            w.reports += 1
            w.reported = w.progress
        if w.probe is None or len(w.progress_log) >= MAX_PROGRESS_LOG:
            return
        w.progress_log.append((t, w.progress))

    def probe_tick(self) -> float | None:
        """Switch probe slices that are due and take due power samples.

        Returns:
            When the next slice boundary or power sample is due (this clock), or ``None`` when
            no window is probed.
        """
        with self._lock:
            now = self._clock()
            due: float | None = None
            for w in self._open.values():
                p = w.probe
                if p is None:
                    continue
                if now >= p.boundary_s and w.stall is not None and w.stall.stalled:
                    self._hold_slice(w, p, now)  # no clock change while stalled
                elif now >= p.boundary_s:
                    self._next_slice(w, p)
                elif now >= p.next_sample_s:
                    self._sample_power(w, p, now)
                    p.next_sample_s += p.slice_s / POWER_SAMPLES_PER_SLICE
                    if p.power_n >= POWER_SAMPLES_PER_SLICE:
                        p.next_sample_s = math.inf
                nxt = min(p.boundary_s, p.next_sample_s)
                due = nxt if due is None else min(due, nxt)
            return due

    def _sample_power(self, w: _Open, p: _Probe, now: float) -> None:
        total = 0.0
        for u in w.gpus:
            gpu = self.actuator.gpus[u]
            if p.clock_mhz is not None and u not in self.parked:
                try:  # the clock the slice runs: a cap below the lock is credited, not the lock
                    mhz = gpu.sm_clock_mhz()
                    # An idle GPU reads its idle clock under any lock (the work has not begun:
                    # the trainer signals a phase before its first kernels, or has ended):
                    # no cap, and crediting it read a 1485 MHz block at 1198 MHz in the
                    # full-stack e2e (tests/e2e/test_full_stack.py). Reasons are read only
                    # for a read below the lock.
                    if mhz >= p.clock_mhz or not _idle(gpu.clock_event_reasons()):
                        p.clock_reads.setdefault(u, []).append(mhz)
                except errors.GpuError as exc:
                    log.debug("slice clock read on %s failed: %s", u, exc)
            try:
                total += gpu.instant_power_mw() / 1000.0
            except errors.GpuError:
                p.power_failed = True
                return
        p.power_w += total
        p.power_n += 1
        p.samples.append((now, total))

    def _finish_slice(
        self,
        w: _Open,
        p: _Probe,
        end_s: float,
        mark: energy.Mark,
        switch_s: float | None = None,
    ) -> None:
        duration = max(end_s - p.start_s, 0.0)
        energy_j: float | None
        source: str | None
        if p.power_n and not p.power_failed:
            energy_j = p.power_w / p.power_n * duration
            source = "instant_power"
        else:
            win = self.meter.window(p.start_mark, mark)
            energy_j = win.energy_j
            kinds = set(win.sources.values())
            source = kinds.pop() if len(kinds) == 1 else "mixed"
        ran = caps.held_clock_mhz(p.clock_reads) if p.clock_mhz is not None else None
        p.done.append(
            _Slice(
                p.clock_mhz,
                p.start_s,
                end_s,
                energy_j,
                effective_mhz=ran,
                energy_source=source,
                samples=tuple(p.samples) if source == "instant_power" else (),
                switch_s=switch_s,
            )
        )

    def _next_slice(self, w: _Open, p: _Probe) -> None:
        nxt = p.schedule[(p.index + 1) % len(p.schedule)]
        # The GPUs take the new clock one after the other: from the first write on, a job
        # gated by its slowest GPU may run at the new clock (the switch took 2-20 ms over 8
        # stand-in GPUs in the full-stack e2e), so the ending slice's rate stops here.
        began = self._clock()
        results = [
            self.actuator.apply(u, nxt, owner_uuids=w.devices)
            for u in w.gpus
            if u not in self.parked
        ]
        now = self._clock()  # the new clock is in effect from here
        mark = self.meter.mark(w.gpus)
        self._finish_slice(w, p, now, mark, switch_s=min(began, now))
        p.index += 1
        p.begin(now, mark)
        self.probe_switches += 1
        w.slowdown = w.slowdown or any(r.slowdown for r in results)
        for r in results:
            if r.error and len(w.errors) < 8:
                w.errors.append(f"{r.uuid}: {r.error}")

    def _hold_slice(self, w: _Open, p: _Probe, now: float) -> None:
        """Stalled at a slice boundary: end the slice (stalled) and run it again, same clock.

        The grid restarts from ``now`` at the same slice index, so the schedule resumes where
        it stood once progress does; the held slices are flagged and their blocks dropped.
        """
        mark = self.meter.mark(w.gpus)
        self._finish_slice(w, p, now, mark)
        p.done[-1].stalled = True
        p.origin_s = now - p.index * p.slice_s
        p.begin(now, mark)

    def _slice_reports(self, w: _Open, p: _Probe) -> list[api_node.SliceReport]:
        log_t = [t for t, _ in w.progress_log]
        log_p = [v for _, v in w.progress_log]
        # The window's end (its last entry, appended at the close) and the trainer's last
        # report hold the phase's end: the work finished inside the last report's interval
        # (a trainer counts it done at its next report), then the GPUs waited for the end
        # signal. So neither interval is any slice's rate, also in a slice the prober switched
        # away from, as the switch can come after the last report. Counted in, the window's end
        # read a rollout's last default slice 20 % slow and its block 0.985 against a true
        # 0.924 (tests/unit/agent/test_status_truth.py); the last report, after a switch, read
        # one 10 % slow and its block 0.958 against a true 0.917 (tests/e2e/test_full_stack.py).
        last = _before(log_t, _before(log_t, log_t[-1])) if log_t else -math.inf
        spans = [(sl.start_s, sl.end_s) for sl in p.done]
        rate_ends = [min(sl.end_s if sl.switch_s is None else sl.switch_s, last) for sl in p.done]
        began = work_start(log_t, log_p)
        progress = slice_progress(log_t, log_p, spans, rate_ends, began)
        counts = [
            _rate_reports(log_t, span, end) for span, end in zip(spans, rate_ends, strict=True)
        ]
        reports = []
        for sl, amount, n in zip(p.done, progress, counts, strict=True):
            lead_s = min(max(began - sl.start_s, 0.0), sl.end_s - sl.start_s)
            energy_j, lead_j = _lead_split(sl, began, lead_s)
            reports.append(
                api_node.SliceReport(
                    clock_mhz=sl.clock_mhz,
                    duration_seconds=sl.end_s - sl.start_s,
                    progress=amount,
                    energy_joules=energy_j,
                    stalled=sl.stalled
                    or (w.stall is not None and w.stall.overlaps(sl.start_s, sl.end_s)),
                    effective_clock_mhz=sl.effective_mhz,
                    energy_source=sl.energy_source,
                    rate_reports=n,
                    lead_seconds=lead_s,
                    lead_energy_joules=lead_j,
                )
            )
        return reports

    def start_prober(self) -> None:
        """Run ``probe_tick`` on a thread, waking at each due boundary or sample."""
        if self._prober is not None:
            return
        self._stop.clear()

        def run() -> None:
            while not self._stop.is_set():
                self._wake.clear()
                try:
                    due = self.probe_tick()
                except Exception:  # noqa: BLE001 - the prober must outlive one bad tick
                    log.exception("probe tick failed")
                    due = None
                wait = PROBER_IDLE_WAIT_S if due is None else max(due - self._clock(), 0.0)
                if wait > 0:
                    self._wake.wait(wait)

        self._prober = threading.Thread(target=run, name="prober", daemon=True)
        self._prober.start()

    def stop_prober(self) -> None:
        """Stop the prober thread."""
        if self._prober is not None:
            self._stop.set()
            self._wake.set()
            self._prober.join(timeout=5)
            self._prober = None


def _before(ts: Sequence[float], t: float) -> float:
    """The latest time in ``ts`` (ascending) before ``t`` (-inf: none)."""
    i = bisect.bisect_left(ts, t) - 1
    return ts[i] if i >= 0 else -math.inf


def _idle(reasons: frozenset[gpu_base.ClockEventReason]) -> bool:
    """The GPU idles (NVML's GPU_IDLE reason) and nothing else holds its clock down."""
    return gpu_base.ClockEventReason.GPU_IDLE in reasons and not (
        reasons & gpu_base.SLOWDOWN_REASONS
    )


def work_start(ts: Sequence[float], values: Sequence[float]) -> float:
    """When the phase's work began, from the window's cumulative progress log, s.

    A trainer signals a phase before its first kernels (the full-stack harness signals three
    ranks one after the other; a verl worker a few ms ahead), so the window's first slice can
    open on idle GPUs. The work began inside the interval before the first report that
    advanced the total; it is placed by running the next advancing report interval's rate
    back from that report (clamped to the interval). Prefill or a first micro-batch that no
    report resolves is placed the same way, at the rate that follows it.

    Args:
        ts: report times, ascending, the window's opening first (value 0), s.
        values: cumulative progress at each.

    Returns:
        The start, s (``ts[0]`` when the first report's interval holds no measurable lead;
        ``-inf`` for an empty log or a window whose progress never advanced).
    """
    if not ts:
        return -math.inf
    first = next((k for k, v in enumerate(values) if v > values[0]), None)
    if first is None:
        return -math.inf
    if first == 0:
        return ts[0]
    prev = ts[first - 1]
    nxt = next((j for j in range(first + 1, len(ts)) if values[j] > values[first]), None)
    if nxt is None or ts[nxt] <= ts[first]:
        return prev
    rate = (values[nxt] - values[first]) / (ts[nxt] - ts[first])
    return min(max(ts[first] - (values[first] - values[first - 1]) / rate, prev), ts[first])


def _lead_split(sl: _Slice, began: float, lead_s: float) -> tuple[float | None, float | None]:
    """A slice's (energy J, its lead's energy J) (``None``: unknown / no lead).

    With power samples, the lead's power is the mean of those taken before the work began and
    the work's the mean of the rest, each over its own time (a sample in a 12 ms lead of a
    40 ms slice is idle power, not a quarter of the work's); a lead no sample fell in is
    charged the work's power (what the slice's mean charged it before leads were split). A
    counter-metered slice splits by time.
    """
    if sl.energy_j is None:
        return None, None
    energy_j = max(sl.energy_j, 0.0)
    if lead_s <= 0:
        return energy_j, None
    duration = sl.end_s - sl.start_s
    if not sl.samples or duration <= 0:
        return energy_j, energy_j * lead_s / duration if duration > 0 else None
    lead = [w for t, w in sl.samples if t < began]
    work = [w for t, w in sl.samples if t >= began] or lead
    work_w = sum(work) / len(work)
    lead_w = sum(lead) / len(lead) if lead else work_w
    return lead_w * lead_s + work_w * (duration - lead_s), lead_w * lead_s


def slice_progress(
    ts: Sequence[float],
    values: Sequence[float],
    spans: Sequence[tuple[float, float]],
    rate_ends: Sequence[float] | None = None,
    began: float = -math.inf,
) -> list[float]:
    """Each slice's progress from the trainer's cumulative progress log.

    A report interval that straddles a slice boundary mixes two clocks: the progress made in
    it before the switch ran at the old clock, after it at the new one, and where the switch
    fell inside the interval is unknown (the trainer reports every few ms to tens of ms, the
    same order as a slice). Interpolating the log at the boundaries splits such an interval
    by time, which blurs each slice's rate toward its neighbours' and biases every paired
    throughput ratio toward 1 (measured on the e2e's replay: a generation lock whose true
    ratio is 0.946 against a 0.95 threshold, tests/unit/agent/test_status_truth.py). So a
    slice's rate comes from the reports inside it only (its first to its last, all at its
    own clock); a slice with fewer than two reports inside falls back to the interpolated
    rate. A slice's clock holds only until the switch to the next one begins (``rate_ends``):
    the GPUs take a new lock one after the other, and a job gated by its slowest GPU runs the
    new clock from the first write on, so reports made while the switch runs are left out of
    both slices' rates (counted in, they read a default slice before a low clock as slow and
    inflate the block's throughput ratio: tests/unit/agent/test_status_truth.py, case
    "e2e-cadence", where a 5 ms switch read 1200 MHz training blocks at 0.70 against a true 0.64).
    The rates times the slices' durations are then scaled by one factor so that the slices
    add up to the interpolated progress of their whole span (the ratios between slices, which
    is what the probe blocks use, are unchanged by it).

    Args:
        ts: report times, ascending (the agent's clock), s.
        values: cumulative progress at each report.
        spans: (start, end) of each slice, in order, s.
        rate_ends: per slice, the last time a report counts in its rate (when the switch
            away from its clock began; ``None``: each slice's end, a report at the end
            included), s.
        began: when the phase's work began (``work_start``), s: a slice's rate runs from
            then on, not over a lead before it.

    Returns:
        Progress per slice (>= 0), in the order of ``spans``.
    """
    if not spans:
        return []

    def at(t: float) -> float:
        return _interpolate(ts, values, t)

    raw: list[float] = []
    ends = [end for _, end in spans] if rate_ends is None else rate_ends
    for (start, end), rate_end in zip(spans, ends, strict=True):
        lo, hi = _rate_span(ts, (start, end), rate_end)
        if hi > lo and ts[hi] > ts[lo]:
            rate = (values[hi] - values[lo]) / (ts[hi] - ts[lo])
            raw.append(max(rate, 0.0) * max(end - max(start, began), 0.0))
        else:
            raw.append(max(at(end) - at(start), 0.0))
    whole = max(at(spans[-1][1]) - at(spans[0][0]), 0.0)
    total = sum(raw)
    scale = whole / total if total > 0 else 0.0
    return [r * scale for r in raw]


def _rate_span(ts: Sequence[float], span: tuple[float, float], rate_end: float) -> tuple[int, int]:
    """First and last index of the reports a slice's rate uses (``slice_progress``)."""
    return bisect.bisect_right(ts, span[0]), bisect.bisect_right(ts, min(rate_end, span[1])) - 1


def _rate_reports(ts: Sequence[float], span: tuple[float, float], rate_end: float) -> int:
    """Reports a slice's rate was measured from.

    Fewer than 2: ``slice_progress`` fell back to the log interpolated at its boundaries.
    """
    lo, hi = _rate_span(ts, span, rate_end)
    if hi > lo and ts[hi] > ts[lo]:
        return hi - lo + 1
    return min(max(hi - lo + 1, 0), 1)


def _interpolate(ts: Sequence[float], values: Sequence[float], t: float) -> float:
    """Piecewise-linear value of a cumulative log at ``t`` (clamped to its ends)."""
    if not ts:
        return 0.0
    if t <= ts[0]:
        return values[0]
    if t >= ts[-1]:
        return values[-1]
    lo, hi = 0, len(ts) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ts[mid] <= t:
            lo = mid
        else:
            hi = mid
    span = ts[hi] - ts[lo]
    if span <= 0:
        return values[hi]
    return values[lo] + (values[hi] - values[lo]) * (t - ts[lo]) / span
