"""The node agent's core: phase signals in, clocks and energy windows out.

``Agent`` holds the current ``ClockPlan`` and applies it locally the moment a phase starts
(clock switches never wait for the operator, docs/architecture.md). A phase signal names the
calling pod (authenticated by the server), so only that pod's GPUs, as the kubelet allocated
them, are clocked and metered (case #22). Each phase window is closed by the next signal; a
step's windows become one ``StepRecord`` for the node report. Energy of GPUs no pod holds is
booked to an explicit ``unattributed`` bucket. Utilisation never changes the declared phase
(case #27).

In-phase probes (EE-RL trials, ``rlenergy.control.freq.probe``): when the plan entry of a phase
has ``probeClocksMHz``, the phase runs as slices of ``probeSliceSeconds`` cycling through those
clocks (``None`` = default governor). The first slice's clock is applied by the phase signal
itself (same latency path); the prober (``probe_tick``, on its own thread in the agent process)
switches the lock at each later slice boundary through the idempotent actuator, samples instant
power a few times per slice (energy = mean power x slice time; counter deltas between the
boundaries when instant power fails), and the window keeps the trainer's cumulative progress
log, interpolated at the boundaries when the window closes. The closed window reports the
slices in order, the partial last one included.

Callers: ``rlenergy_agent.server`` (signals), ``rlenergy_agent.__main__`` (lifecycle),
``rlenergy_agent.metrics`` (``snapshot``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from rlenergy.api import node as api_node
from rlenergy.gpu import base, errors
from rlenergy_agent import actuator as act
from rlenergy_agent import crosscheck, energy, histogram, shares

log = logging.getLogger(__name__)

IDLE_PHASES = frozenset({"idle", "none", ""})
IDLE = "idle"
"""The window name of the time between phases (energy reported as ``idleEnergyJoules``)."""
MAX_STEPS_KEPT = 32
"""Step records kept in the report (bounded, oldest dropped)."""
POWER_SAMPLES_PER_SLICE = 4
"""Instant-power reads per probe slice, spread evenly over it (the energy counter updates only
every 20-100 ms, too coarse for slices of a few tens of ms)."""
PROBER_IDLE_WAIT_S = 1.0
"""The prober thread's wait when no probe runs (a phase signal wakes it at once)."""
MAX_REPORT_AGE_S = 0.5
"""A progress report's own timestamp is trusted when at most this old on arrival, s."""
MAX_PROGRESS_LOG = 100_000
"""Progress reports kept per probed window (a runaway caller cannot grow it without bound)."""


@dataclasses.dataclass(frozen=True)
class PodRef:
    """A pod, as the kubelet knows it."""

    namespace: str
    name: str
    uid: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class PodMap(Protocol):
    """Which device IDs (GPU or MIG UUIDs) the kubelet allocated to which pod."""

    def devices_of(self, pod: PodRef) -> tuple[str, ...]:
        """Device IDs allocated to ``pod`` (empty: none or unknown pod)."""
        ...

    def pods(self) -> Mapping[PodRef, tuple[str, ...]]:
        """Every pod with allocated GPUs."""
        ...


class StaticPodMap:
    """A fixed pod map (the ``sim`` backend and tests)."""

    def __init__(self, allocations: Mapping[PodRef, Sequence[str]]) -> None:
        self.allocations = {p: tuple(d) for p, d in allocations.items()}

    def devices_of(self, pod: PodRef) -> tuple[str, ...]:
        """Device IDs of ``pod``."""
        return self.allocations.get(pod, ())

    def pods(self) -> Mapping[PodRef, tuple[str, ...]]:
        """All allocations."""
        return dict(self.allocations)


class SignalRefused(Exception):
    """A phase signal the agent will not act on.

    Args:
        message: why.
        status: HTTP status to answer with (403 not your GPU, 404 no GPUs, 400 bad input).
    """

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class _Slice:
    """One finished probe slice (progress is filled in when the window closes)."""

    clock_mhz: int | None
    start_s: float
    end_s: float
    energy_j: float | None


@dataclasses.dataclass
class _Probe:
    """The slicing state of a probed window.

    Attributes:
        schedule: slice clocks, cycled (``None`` = default governor).
        slice_s: planned slice length, s.
        index: the current slice's position in the phase (0-based).
        start_s: when the current slice started (its clock applied), s.
        start_mark: counter totals at the current slice's start (fallback energy).
        power_w: sum over samples of the instant power summed over the window's GPUs, W.
        power_n: samples in ``power_w``.
        power_failed: an instant-power read failed in this slice (use counter deltas).
        next_sample_s: when the next power sample is due, s.
        done: finished slices.
    """

    schedule: tuple[int | None, ...]
    slice_s: float
    start_s: float
    start_mark: energy.Mark
    next_sample_s: float
    origin_s: float = 0.0
    index: int = 0
    power_w: float = 0.0
    power_n: int = 0
    power_failed: bool = False
    done: list[_Slice] = dataclasses.field(default_factory=list)

    @property
    def clock_mhz(self) -> int | None:
        """The current slice's clock."""
        return self.schedule[self.index % len(self.schedule)]

    @property
    def boundary_s(self) -> float:
        """When the current slice ends.

        Boundaries lie on a fixed grid from the phase start, so a late switch shortens the next
        slice instead of shifting every later one.
        """
        return self.origin_s + (self.index + 1) * self.slice_s

    def begin(self, t_s: float, mark: energy.Mark) -> None:
        """Start a slice at ``t_s``."""
        self.start_s = t_s
        self.start_mark = mark
        self.power_w = 0.0
        self.power_n = 0
        self.power_failed = False
        self.next_sample_s = t_s + 0.5 * self.slice_s / POWER_SAMPLES_PER_SLICE


@dataclasses.dataclass
class _Open:
    """An open phase window of one pod."""

    phase: str
    step: int
    mark: energy.Mark
    started_s: float
    requested_mhz: int | None
    applied: list[int]
    slowdown: bool
    errors: list[str]
    progress: float = 0.0
    gpus: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    probe: _Probe | None = None
    progress_log: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """(time s, cumulative progress) reports, kept while the window is probed."""
    released_gpu_s: float = 0.0
    """GPU time of parks that ended inside this window, GPU-s."""


@dataclasses.dataclass(frozen=True)
class _Park:
    """A parked GPU: a released rollout worker's, at its lowest SM clock until its step ends.

    Attributes:
        pod: the pod that parked it.
        step: RL step of the release.
        since_s: when it was parked (this agent's clock), s.
        clock_mhz: the lock made (``None``: nothing written: observe plan or no clock control).
    """

    pod: PodRef
    step: int
    since_s: float
    clock_mhz: int | None


@dataclasses.dataclass(frozen=True)
class ParkResult:
    """What one park signal did.

    Attributes:
        parked: GPUs parked by this signal, UUID -> lock made, MHz (``None``: none written).
        already: GPUs that were parked before (idempotent: untouched).
        applied: per UUID the actuator's result (read-back included) where a clock was set.
    """

    parked: Mapping[str, int | None]
    already: tuple[str, ...]
    applied: Mapping[str, act.ApplyResult]


@dataclasses.dataclass
class PhaseResult:
    """What one phase signal did.

    Attributes:
        gpus: the physical GPU UUIDs acted on.
        applied: per UUID the apply result.
        latency_s: signal received to clocks applied on every GPU, s.
        closed: the window the signal closed, if any.
    """

    gpus: tuple[str, ...]
    applied: Mapping[str, act.ApplyResult]
    latency_s: float
    closed: api_node.PhaseWindowReport | None


class Agent:
    """One node's agent for one policy.

    Args:
        node_name: the node.
        policy_name: the ``RLEnergyPolicy`` whose plan this agent applies.
        actuator: clock control.
        meter: energy meter.
        podmap: device allocation.
        mig_parent: MIG instance UUID -> physical GPU UUID.
        clock: monotonic time source, s.
    """

    def __init__(
        self,
        node_name: str,
        policy_name: str,
        actuator: act.Actuator,
        meter: energy.EnergyMeter,
        podmap: PodMap,
        *,
        mig_parent: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_name = node_name
        self.policy_name = policy_name
        self.actuator = actuator
        self.meter = meter
        self.podmap = podmap
        self.mig_parent = dict(mig_parent or {})
        self._clock = clock
        self._lock = threading.RLock()
        self.plan: api_node.ClockPlan | None = None
        self._open: dict[PodRef, _Open] = {}
        self.steps: dict[int, dict[str, list[api_node.PhaseWindowReport]]] = {}
        self.workloads: dict[int, api_node.TokenWorkloadReport] = {}
        self.phase_of: dict[str, str] = {u: "idle" for u in actuator.gpus}
        self.pod_of: dict[str, PodRef | None] = {u: None for u in actuator.gpus}
        self.phase_energy_j: dict[tuple[str, str], float] = {}
        """(GPU, phase) -> energy of every closed window, J; idle windows under ``idle``."""
        self.phase_seconds: dict[tuple[str, str], float] = {}
        self.valid_tokens_total = 0.0
        """Valid tokens of every step ended here (a counter: not trimmed with the records)."""
        self.saving_ratio: dict[str, float] = {}
        """The policy status' saving / 100 per phase (``""``: the job), for /metrics."""
        self.crosscheck = crosscheck.CrossCheck(meter, clock=clock)
        """Energy counter vs integrated instant power, at a low duty cycle (``observe``)."""
        self.latency_hist = histogram.Histogram()
        """Phase signal received to clocks applied, s (``/metrics``: a histogram)."""
        self.dirty_steps: set[int] = set()
        self.idle_j: dict[int, float | None] = {}
        self.refused = 0
        self.probe_switches = 0
        self.parked: dict[str, _Park] = {}
        """Parked GPUs (released rollout workers), by UUID."""
        self.released_gpu_s: dict[str, float] = {}
        """Per GPU the time of ended parks, GPU-s (a counter; ongoing parks come on top)."""
        self.step_released_gpu_s: dict[int, float] = {}
        """Per RL step the time of its ended parks, GPU-s."""
        self.dispatch: api_node.RolloutDispatch | None = None
        """The rollout dispatcher's newest publication on this node."""
        self.report_due = False
        """Park state or a dispatcher publication changed: the report writer should write."""
        self.discovery: tuple[str, str] | None = None
        """Policy discovery's last outcome (reason, ``ns/name`` or ``""``); ``None``: a policy
        was configured."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    # ----- plan -----------------------------------------------------------------------------
    def set_plan(self, plan: api_node.ClockPlan | None) -> None:
        """Adopt a new plan; ``None`` (policy removed) returns every GPU to the default."""
        with self._lock:
            self.plan = plan
            if plan is None or not plan.enforce:
                for w in self._open.values():
                    w.probe = None  # a running probe must not lock again
                self._end_parks(list(self.parked), self._clock())
                self.actuator.release(list(self.actuator.gpus), "policy removed or observe")

    def switch_policy(self, policy_name: str) -> None:
        """Serve another policy (discovery found a new one, or none: ``""``).

        Resets every clock of the old policy first (no GPU stays locked by a plan nobody
        governs any more), then drops the old policy's step records, so the new policy's report
        starts clean. Energy totals and metric counters carry on (they are the node's).
        """
        with self._lock:
            self.set_plan(None)
            for w in self._open.values():
                w.probe = None
            self._open.clear()
            self.steps.clear()
            self.workloads.clear()
            self.idle_j.clear()
            self.dirty_steps.clear()
            self.step_released_gpu_s.clear()
            self.dispatch = None
            self.saving_ratio = {}
            self.phase_of = {u: "idle" for u in self.actuator.gpus}
            self.pod_of = {u: None for u in self.actuator.gpus}
            self.policy_name = policy_name

    def _entry_for(self, phase: str) -> api_node.PhasePlan | None:
        if self.plan is None or not self.plan.enforce or phase in IDLE_PHASES:
            return None
        return self.plan.for_phase(phase)

    # ----- signals --------------------------------------------------------------------------
    def gpus_of(self, pod: PodRef) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(physical GPU UUIDs, raw device IDs) the kubelet allocated to ``pod``."""
        devices = self.podmap.devices_of(pod)
        physical: list[str] = []
        for d in devices:
            u = shares.physical(d, self.mig_parent)
            if u in self.actuator.gpus and u not in physical:
                physical.append(u)
        return tuple(physical), devices

    def phase(
        self,
        pod: PodRef,
        phase: str,
        step: int,
        *,
        gpu_uuids: Sequence[str] = (),
        received_s: float | None = None,
    ) -> PhaseResult:
        """``pod`` enters ``phase`` of RL step ``step`` on its GPUs now.

        Args:
            pod: the authenticated caller.
            phase: phase name (``idle`` ends the current window without opening one).
            step: RL step index.
            gpu_uuids: GPUs the caller names; each must be allocated to it.
            received_s: when the signal arrived (monotonic), for latency.

        Returns:
            What was applied.

        Raises:
            SignalRefused: the pod holds no GPU on this node, or names a GPU it does not hold.
        """
        t0 = received_s if received_s is not None else self._clock()
        gpus, devices = self.gpus_of(pod)
        if not gpus:
            self.refused += 1
            raise SignalRefused(f"pod {pod} holds no GPU on node {self.node_name}", 404)
        foreign = [g for g in gpu_uuids if shares.physical(g, self.mig_parent) not in gpus]
        if foreign:
            self.refused += 1
            raise SignalRefused(f"pod {pod} does not hold GPU(s) {', '.join(foreign)}", 403)
        if step < 0:
            raise SignalRefused("step must be >= 0", 400)
        with self._lock:
            entry = self._entry_for(phase)
            clock_mhz = entry.clock_mhz if entry is not None else None
            probing = (
                entry is not None and bool(entry.probe_clocks_mhz) and entry.probe_slice_seconds > 0
            )
            first = entry.probe_clocks_mhz[0] if entry is not None and probing else clock_mhz
            # A park lasts until the pod's next working phase or a later step; an idle signal
            # of the parked step keeps the GPU parked (it waits at the lowest clock).
            self._end_parks(
                [
                    u
                    for u in gpus
                    if (p := self.parked.get(u)) is not None
                    and (phase not in IDLE_PHASES or step > p.step)
                ],
                self._clock(),
            )
            results = {
                u: self.actuator.apply(u, first, owner_uuids=devices)
                for u in gpus
                if u not in self.parked
            }
            latency = self._clock() - t0
            self.latency_hist.observe(latency)
            # No read-back of the closing window here: the new clocks are already applied
            # (latency first); the sampling loop reads clocks during windows (``observe``).
            mark = self.meter.mark(gpus)
            closed = self._close(pod, mark)
            for u in gpus:
                self.phase_of[u] = "idle" if phase in IDLE_PHASES else phase
                self.pod_of[u] = pod
            # An idle signal opens an idle window too: its energy is the step's idle energy
            # (GPUs waiting for reward or data), booked outside the phases.
            now = self._clock()
            w = _Open(
                IDLE if phase in IDLE_PHASES else phase,
                step,
                mark,
                now,
                clock_mhz,
                [],
                any(r.slowdown for r in results.values()),
                [f"{u}: {r.error}" for u, r in results.items() if r.error],
                gpus=gpus,
                devices=tuple(devices),
            )
            if probing and entry is not None:
                w.probe = _Probe(
                    tuple(entry.probe_clocks_mhz), entry.probe_slice_seconds, now, mark, now, now
                )
                w.probe.begin(now, mark)
                w.progress_log.append((now, 0.0))
            self._open[pod] = w
        if probing:
            self._wake.set()
        return PhaseResult(gpus, results, latency, closed)

    def _observe_clocks(self, pod: PodRef, gpus: Sequence[str]) -> None:
        """Read back the SM clock of a pod's busy GPUs into its open window (lowest wins)."""
        w = self._open.get(pod)
        if w is None:
            return
        for u in gpus:
            ctl = self.actuator.controls.get(u)
            if ctl is None or ctl.condition == "lost" or u in self.parked:
                continue
            gpu = self.actuator.gpus[u]
            try:
                reasons = gpu.clock_event_reasons()
                if base.ClockEventReason.GPU_IDLE in reasons:
                    continue
                w.applied.append(gpu.sm_clock_mhz())
                w.slowdown = w.slowdown or bool(reasons & base.SLOWDOWN_REASONS)
            except errors.GpuError as exc:
                log.debug("clock read-back on %s failed: %s", u, exc)

    def observe(self) -> None:
        """Read back clocks of every open window and of due locks (the sampling loop)."""
        with self._lock:
            for pod in list(self._open):
                self._observe_clocks(pod, self.gpus_of(pod)[0])
            if self.actuator.watch_caps():
                self.report_due = True  # an unexplained shortfall: report it now
            if self.crosscheck.tick():
                self.report_due = True  # counter and power disagree: report both numbers

    def progress(self, pod: PodRef, amount: float) -> None:
        """Add phase progress (tokens or iterations) to ``pod``'s open window.

        Raises:
            SignalRefused: a negative or non-finite amount (it would poison the window).
        """
        if not math.isfinite(amount) or amount < 0:
            raise SignalRefused(f"progress amount must be a finite number >= 0, got {amount}", 400)
        with self._lock:
            w = self._open.get(pod)
            if w is not None:
                w.progress += amount
                self._log_progress(w)

    def progress_total(self, pod: PodRef, total: float, at_s: float | None = None) -> None:
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

        Raises:
            SignalRefused: a negative or non-finite total.
        """
        if not math.isfinite(total) or total < 0:
            raise SignalRefused(f"progress total must be a finite number >= 0, got {total}", 400)
        with self._lock:
            w = self._open.get(pod)
            if w is not None:
                w.progress = total
                self._log_progress(w, at_s)

    def _log_progress(self, w: _Open, at_s: float | None = None) -> None:
        if w.probe is None or len(w.progress_log) >= MAX_PROGRESS_LOG:
            return
        now = self._clock()
        t = now
        if at_s is not None and math.isfinite(at_s) and now - MAX_REPORT_AGE_S <= at_s <= now:
            t = max(at_s, w.progress_log[-1][0] if w.progress_log else w.started_s)
        w.progress_log.append((t, w.progress))

    # ----- in-phase probes ------------------------------------------------------------------
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
                if now >= p.boundary_s:
                    self._next_slice(w, p)
                elif now >= p.next_sample_s:
                    self._sample_power(w, p)
                    p.next_sample_s += p.slice_s / POWER_SAMPLES_PER_SLICE
                    if p.power_n >= POWER_SAMPLES_PER_SLICE:
                        p.next_sample_s = math.inf
                nxt = min(p.boundary_s, p.next_sample_s)
                due = nxt if due is None else min(due, nxt)
            return due

    def _sample_power(self, w: _Open, p: _Probe) -> None:
        total = 0.0
        for u in w.gpus:
            try:
                total += self.actuator.gpus[u].instant_power_mw() / 1000.0
            except errors.GpuError:
                p.power_failed = True
                return
        p.power_w += total
        p.power_n += 1

    def _finish_slice(self, w: _Open, p: _Probe, end_s: float, mark: energy.Mark) -> None:
        duration = max(end_s - p.start_s, 0.0)
        energy_j: float | None
        if p.power_n and not p.power_failed:
            energy_j = p.power_w / p.power_n * duration
        else:
            energy_j = self.meter.window(p.start_mark, mark).energy_j
        p.done.append(_Slice(p.clock_mhz, p.start_s, end_s, energy_j))

    def _next_slice(self, w: _Open, p: _Probe) -> None:
        nxt = p.schedule[(p.index + 1) % len(p.schedule)]
        results = [
            self.actuator.apply(u, nxt, owner_uuids=w.devices)
            for u in w.gpus
            if u not in self.parked
        ]
        now = self._clock()  # the new clock is in effect from here
        mark = self.meter.mark(w.gpus)
        self._finish_slice(w, p, now, mark)
        p.index += 1
        p.begin(now, mark)
        self.probe_switches += 1
        w.slowdown = w.slowdown or any(r.slowdown for r in results)
        for r in results:
            if r.error and len(w.errors) < 8:
                w.errors.append(f"{r.uuid}: {r.error}")

    def _slice_reports(self, w: _Open, p: _Probe) -> list[api_node.SliceReport]:
        log_t = [t for t, _ in w.progress_log]
        log_p = [v for _, v in w.progress_log]

        def at(t: float) -> float:
            return _interpolate(log_t, log_p, t)

        out = []
        for sl in p.done:
            progress = max(at(sl.end_s) - at(sl.start_s), 0.0)
            out.append(
                api_node.SliceReport(
                    clock_mhz=sl.clock_mhz,
                    duration_seconds=sl.end_s - sl.start_s,
                    progress=progress,
                    energy_joules=None if sl.energy_j is None else max(sl.energy_j, 0.0),
                )
            )
        return out

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

    def end_step(self, pod: PodRef, step: int, workload: api_node.TokenWorkloadReport) -> None:
        """``pod`` finished RL step ``step``: close its window and file the step's workload.

        Raises:
            SignalRefused: a negative step (it would make every later node report invalid).
        """
        if step < 0:
            raise SignalRefused("step must be >= 0", 400)
        gpus, devices = self.gpus_of(pod)
        with self._lock:
            # The step ends: its parks end too (un-parked to the default governor until the
            # next phase signal applies the plan).
            ended = [u for u, p in self.parked.items() if p.pod == pod and p.step <= step]
            self._end_parks(ended, self._clock())
            for u in ended:
                self.actuator.apply(u, None, owner_uuids=devices)
            if gpus:
                self._observe_clocks(pod, gpus)
                self._close(pod, self.meter.mark(gpus))
            old = self.workloads.get(step)
            self.valid_tokens_total += workload.valid_tokens - (old.valid_tokens if old else 0.0)
            self.workloads[step] = workload
            self.dirty_steps.add(step)

    def governed_pods(self) -> set[PodRef]:
        """Pods this agent acts for: an open window, a GPU they drove last, or a park."""
        with self._lock:
            pods = set(self._open) | {p for p in self.pod_of.values() if p is not None}
            return pods | {p.pod for p in self.parked.values()}

    def pod_gone(self, pod: PodRef) -> None:
        """The pod ended: close its window, end its parks, reset its GPUs to the default.

        Its GPUs are the ones it drove last, parked, or has an open window on.
        """
        with self._lock:
            w = self._open.get(pod)
            parked = [u for u, p in self.parked.items() if p.pod == pod]
            gpus = [u for u, p in self.pod_of.items() if p == pod]
            gpus += [u for u in (*parked, *(w.gpus if w else ())) if u not in gpus]
            self._end_parks(parked, self._clock())
            if w is not None and gpus:
                self._close(pod, self.meter.mark(gpus))
            self.actuator.release(gpus, f"pod {pod} ended")
            for u in gpus:
                self.phase_of[u] = "idle"
                self.pod_of[u] = None
            self.report_due = self.report_due or bool(gpus)

    def _shared(self, pod: PodRef, win: energy.Window) -> energy.Window:
        """``win`` with each shared GPU's energy scaled to ``pod``'s share (``shares``)."""
        split = shares.shares(
            {(p.namespace, p.name): d for p, d in self.podmap.pods().items()},
            self.mig_parent,
            {u: c.mig_uuids for u, c in self.actuator.controls.items() if c.mig_uuids},
        )
        key = (pod.namespace, pod.name)
        factor = {u: split.get((key, u), 1.0) for u in win.per_gpu_j}
        if all(f == 1.0 for f in factor.values()):
            return win
        per = {u: None if j is None else j * factor[u] for u, j in win.per_gpu_j.items()}
        values = list(per.values())
        total = None if any(v is None for v in values) else sum(v for v in values if v is not None)
        return dataclasses.replace(win, energy_j=total, per_gpu_j=per)

    def _close(self, pod: PodRef, end: energy.Mark) -> api_node.PhaseWindowReport | None:
        w = self._open.pop(pod, None)
        if w is None:
            return None
        win = self._shared(pod, self.meter.window(w.mark, end))
        now = self._clock()
        released = w.released_gpu_s + sum(
            max(now - max(p.since_s, w.started_s), 0.0)
            for u in w.gpus
            if (p := self.parked.get(u)) is not None
        )
        if w.phase == IDLE:
            self.steps.setdefault(w.step, {})
            prev = self.idle_j.get(w.step, 0.0)
            self.idle_j[w.step] = (
                None if prev is None or win.energy_j is None else prev + win.energy_j
            )
            self._count(win)
            self.dirty_steps.add(w.step)
            self._trim()
            return None
        sources = set(win.sources.values())
        slices: list[api_node.SliceReport] = []
        if w.probe is not None:
            self._finish_slice(w, w.probe, end.t_s, end)
            w.progress_log.append((end.t_s, w.progress))
            slices = self._slice_reports(w, w.probe)
        report = api_node.PhaseWindowReport(
            phase=w.phase,
            duration_seconds=win.duration_s,
            energy_joules=win.energy_j,
            requested_clock_mhz=w.requested_mhz,
            applied_clock_mhz=min(w.applied) if w.applied else None,
            slowdown=w.slowdown,
            error="; ".join(w.errors) or None,
            energy_source=sources.pop() if len(sources) == 1 else "mixed",
            incomplete=win.incomplete,
            low_confidence=win.low_confidence,
            gpu_energy_joules=dict(win.per_gpu_j),
            progress=w.progress,
            slices=slices,
            gpu_seconds=win.duration_s * len(w.gpus),
            released_gpu_seconds=min(released, win.duration_s * len(w.gpus)),
        )
        self.steps.setdefault(w.step, {}).setdefault(w.phase, []).append(report)
        self.dirty_steps.add(w.step)
        self._count(win, w.phase)
        self._trim()
        return report

    def _count(self, win: energy.Window, phase: str = IDLE) -> None:
        """Add a closed window to the per-GPU phase counters of /metrics."""
        for u, j in win.per_gpu_j.items():
            key = (u, phase)
            if j is not None:
                self.phase_energy_j[key] = self.phase_energy_j.get(key, 0.0) + j
            self.phase_seconds[key] = self.phase_seconds.get(key, 0.0) + win.duration_s

    def _trim(self) -> None:
        while len(self.steps) > MAX_STEPS_KEPT:
            oldest = min(self.steps)
            del self.steps[oldest]
            self.workloads.pop(oldest, None)
            self.step_released_gpu_s.pop(oldest, None)
            self.idle_j.pop(oldest, None)

    # ----- report ---------------------------------------------------------------------------
    def _finished(self, steps: Iterable[int]) -> set[int]:
        newest = max(self.steps, default=-1)
        return {s for s in steps if s in self.steps and (s in self.workloads or s < newest)}

    def finished_dirty_steps(self) -> set[int]:
        """Changed steps that are finished (a report written now carries them for good).

        A step's record changes until the trainer closes it, so the writer clears only these
        after a write; a step still running stays dirty for the write after it ends.
        """
        with self._lock:
            self.dirty_steps.intersection_update(self.steps)
            return self._finished(self.dirty_steps)

    def step_record(self, step: int) -> api_node.StepRecord:
        """The node's record of ``step``: one window per phase (summed over pods)."""
        with self._lock:
            phases: list[api_node.PhaseWindowReport] = []
            for _phase, windows in sorted(self.steps.get(step, {}).items()):
                energies = [w.energy_joules for w in windows]
                per_gpu: dict[str, float | None] = {}
                for w in windows:
                    per_gpu.update(w.gpu_energy_joules)
                applied = [w.applied_clock_mhz for w in windows if w.applied_clock_mhz]
                phases.append(
                    windows[0].model_copy(
                        update={
                            "duration_seconds": max(w.duration_seconds for w in windows),
                            "energy_joules": None
                            if any(e is None for e in energies)
                            else sum(e for e in energies if e is not None),
                            "applied_clock_mhz": min(applied) if applied else None,
                            "slowdown": any(w.slowdown for w in windows),
                            "incomplete": any(w.incomplete for w in windows),
                            "gpu_energy_joules": per_gpu,
                            "progress": sum(w.progress for w in windows),
                            "slices": [s for w in windows for s in w.slices],
                            "gpu_seconds": sum(w.gpu_seconds for w in windows),
                            "released_gpu_seconds": sum(w.released_gpu_seconds for w in windows),
                        }
                    )
                )
            workload = self.workloads.get(step) or api_node.TokenWorkloadReport(
                samples=0, response_tokens=0, prompt_tokens=0, valid_tokens=0, mean_context_tokens=0
            )
            return api_node.StepRecord(
                step=step,
                workload=workload,
                phases=phases,
                idle_energy_joules=self.idle_j.get(step, 0.0),
                released_gpu_seconds=self.step_released_gpu_s.get(step, 0.0),
            )

    def _cross_check(self, uuid: str) -> api_node.EnergyCrossCheck | None:
        chk = self.crosscheck.gpus.get(uuid)
        if chk is None or chk.last is None:
            return None
        last = chk.last
        return api_node.EnergyCrossCheck(
            counter_joules=last.counter_j,
            power_joules=last.power_j,
            window_seconds=last.window_s,
            mismatch=last.mismatch,
            mismatches=chk.mismatches,
        )

    def report(self) -> api_node.NodeReport:
        """The spec of this node's ``RLEnergyNodeReport``."""
        with self._lock:
            gpus = []
            total = 0.0
            unattributed = 0.0
            attributed = {u for u, p in self.pod_of.items() if p is not None}
            for pod_devices in self.podmap.pods().values():
                attributed.update(shares.physical(d, self.mig_parent) for d in pod_devices)
            for u, ctl in self.actuator.controls.items():
                j = self.meter.total_j(u)
                st = self.meter.state[u]
                cap = self.actuator.caps.get(u)
                condition = ctl.condition
                reason = ctl.reason
                if st.lost_at is not None:
                    condition, reason = "lost", reason or "GPULost"
                elif st.source == "unavailable" and condition == "ok":
                    condition, reason = "degraded", "TelemetryUnavailable"
                gpus.append(
                    api_node.GpuStatus(
                        uuid=u,
                        name=getattr(self.actuator.gpus[u], "name", ""),
                        condition=condition,
                        reason=reason,
                        locked_clock_mhz=ctl.applied_mhz,
                        # Acknowledged once nothing is locked under a plan that locks
                        # nothing: the operator's reset plan on deletion (enforce false) or
                        # no plan at all (the policy is gone).
                        reset_acknowledged=(self.plan is None or not self.plan.enforce)
                        and ctl.applied_mhz is None,
                        energy_joules_total=j or 0.0,
                        energy_source=st.source,
                        energy_known=j is not None,
                        phase=self.phase_of.get(u, "idle"),
                        pod=str(self.pod_of[u]) if self.pod_of.get(u) else None,
                        supported_clocks_mhz=list(ctl.supported_mhz),
                        parked=u in self.parked,
                        requested_clock_mhz=ctl.requested_mhz,
                        effective_clock_mhz=cap.effective_mhz if cap.lock_mhz else None,
                        clock_state=cap.state,
                        clock_limit=cap.limit,
                        energy_cross_check=self._cross_check(u),
                    )
                )
                if j is not None:
                    total += j
                    if u not in attributed:
                        unattributed += j
            # Only finished steps: the trainer closed them (end_step) or moved past them. The
            # operator folds a step as soon as every node reported it, so a step still running
            # (its generation window closed, training under way) must not appear yet.
            done = sorted(self._finished(self.steps))
            steps = [self.step_record(s) for s in done]
            return api_node.NodeReport(
                policy_name=self.policy_name,
                node_name=self.node_name,
                gpus=gpus,
                steps=steps,
                last_step=max(done, default=-1),
                measured_joules_total=total,
                unattributed_joules_total=unattributed,
                released_gpu_seconds_total=sum(
                    self.released_gpu_seconds(u) for u in self.actuator.controls
                ),
                rollout=self.dispatch,
            )

    # ----- released rollout workers (FlexFloor park) ----------------------------------------
    def park(self, pod: PodRef, step: int, *, gpu_uuids: Sequence[str] = ()) -> ParkResult:
        """Park ``pod``'s GPUs at their lowest supported SM clock: a released rollout worker.

        The park lasts until the pod's next working phase signal or a signal of a later step
        (the plan's clock is applied then), the end of ``step`` (``end_step``: default
        governor), ``unpark``, the pod's end, or the plan's removal (every lock reset). Parking
        a parked GPU does nothing (idempotent). Under an observe plan (or none) no clock is
        written, but the released time is still accounted.

        Args:
            pod: the authenticated caller.
            step: RL step of the release.
            gpu_uuids: GPUs to park, each the pod's own (empty: every GPU of the pod).

        Returns:
            What was parked, with the actuator's read-back.

        Raises:
            SignalRefused: the pod holds no GPU here (404), names a GPU it does not hold
                (403), or a negative step (400).
        """
        gpus, devices = self.gpus_of(pod)
        if not gpus:
            self.refused += 1
            raise SignalRefused(f"pod {pod} holds no GPU on node {self.node_name}", 404)
        named = (shares.physical(g, self.mig_parent) for g in gpu_uuids)
        targets = list(dict.fromkeys(named)) or list(gpus)
        foreign = [g for g in targets if g not in gpus]
        if foreign:
            self.refused += 1
            raise SignalRefused(f"pod {pod} does not hold GPU(s) {', '.join(foreign)}", 403)
        if step < 0:
            raise SignalRefused("step must be >= 0", 400)
        with self._lock:
            enforce = self.plan is not None and self.plan.enforce
            now = self._clock()
            parked: dict[str, int | None] = {}
            applied: dict[str, act.ApplyResult] = {}
            already = tuple(u for u in targets if u in self.parked)
            for u in targets:
                if u in self.parked:
                    continue
                ctl = self.actuator.controls[u]
                clock: int | None = None
                if enforce and ctl.supported_mhz:
                    r = applied[u] = self.actuator.apply(
                        u, min(ctl.supported_mhz), owner_uuids=devices
                    )
                    clock = r.target_mhz if r.error is None and r.skipped is None else None
                self.parked[u] = _Park(pod, step, now, clock)
                parked[u] = clock
            self.steps.setdefault(step, {})
            self.report_due = self.report_due or bool(parked)
            if parked:
                log.info("parked %s for pod %s at step %d", ", ".join(parked), pod, step)
            return ParkResult(parked, already, applied)

    def unpark(self, pod: PodRef, *, gpu_uuids: Sequence[str] = ()) -> float:
        """End ``pod``'s parks (all, or ``gpu_uuids``) and apply the plan's current clock.

        Returns:
            The GPU time of the parks ended, GPU-s.
        """
        with self._lock:
            wanted = {shares.physical(g, self.mig_parent) for g in gpu_uuids}
            ended = [
                u for u, p in self.parked.items() if p.pod == pod and (not wanted or u in wanted)
            ]
            released = self._end_parks(ended, self._clock())
            w = self._open.get(pod)
            entry = self._entry_for(w.phase) if w is not None else None
            clock = w.probe.clock_mhz if w is not None and w.probe is not None else None
            if w is not None and w.probe is None and entry is not None:
                clock = entry.clock_mhz
            _gpus, devices = self.gpus_of(pod)
            for u in ended:
                self.actuator.apply(u, clock, owner_uuids=devices)
            return released

    def _end_parks(self, uuids: Iterable[str], now_s: float) -> float:
        """Account and forget the parks of ``uuids`` (clocks are the caller's business)."""
        total = 0.0
        for u in list(uuids):
            p = self.parked.pop(u, None)
            if p is None:
                continue
            dt = max(now_s - p.since_s, 0.0)
            total += dt
            self.released_gpu_s[u] = self.released_gpu_s.get(u, 0.0) + dt
            self.step_released_gpu_s[p.step] = self.step_released_gpu_s.get(p.step, 0.0) + dt
            self.dirty_steps.add(p.step)
            w = self._open.get(p.pod)
            if w is not None and u in w.gpus:
                w.released_gpu_s += max(now_s - max(p.since_s, w.started_s), 0.0)
            self.report_due = True
        return total

    def released_gpu_seconds(self, uuid: str) -> float:
        """Parked time of ``uuid`` so far, ongoing park included, GPU-s (a counter)."""
        with self._lock:
            p = self.parked.get(uuid)
            ongoing = max(self._clock() - p.since_s, 0.0) if p is not None else 0.0
            return self.released_gpu_s.get(uuid, 0.0) + ongoing

    def publish_rollout(self, pod: PodRef, dispatch: api_node.RolloutDispatch) -> None:
        """Keep the rollout dispatcher's publication for the node report (newest step wins).

        Raises:
            SignalRefused: the pod holds no GPU on this node (404), or the step is older
                than the one already published (409).
        """
        gpus, _ = self.gpus_of(pod)
        if not gpus:
            self.refused += 1
            raise SignalRefused(f"pod {pod} holds no GPU on node {self.node_name}", 404)
        with self._lock:
            if self.dispatch is not None and dispatch.step < self.dispatch.step:
                raise SignalRefused(
                    f"step {dispatch.step} is older than the published step {self.dispatch.step}",
                    409,
                )
            if dispatch != self.dispatch:
                self.dispatch = dispatch
                self.report_due = True


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
