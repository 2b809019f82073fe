"""The node agent's core: phase signals in, clocks and energy windows out.

``Agent`` holds the current ``ClockPlan`` and applies it locally the moment a phase starts
(clock switches never wait for the operator, docs/architecture.md). A phase signal names the
calling pod (authenticated by the server), so only that pod's GPUs, as the kubelet allocated
them, are clocked and metered. Each phase window is closed by the next signal; a
step's windows become one ``StepRecord`` for the node report. Energy of GPUs no pod holds is
booked to an explicit ``unattributed`` bucket. Utilisation never changes the declared phase
(a rollout can wait at 0 % utilisation for minutes).

In-phase probes (EE-RL trials, ``rlenergy.control.freq.probe``): when the plan entry of a phase
has ``probeClocksMHz``, the phase runs as slices of ``probeSliceSeconds`` cycling through those
clocks (``None`` = default governor). The first slice's clock is applied by the phase signal
itself (same latency path); the prober (``probe_tick``, on its own thread in the agent process)
switches the lock at each later slice boundary through the idempotent actuator, samples instant
power a few times per slice (energy = mean power x slice time; counter deltas between the
boundaries when instant power fails), and the window keeps the trainer's cumulative progress
log, interpolated at the boundaries when the window closes. The closed window reports the
slices in order, the partial last one included.

``Agent`` keeps the lock, the shared state (``state.AgentState``) and the phase windows, and
delegates one concern per module: ``probes`` (probe slices and the prober thread), ``parks``
(parked rollout workers), ``records`` (step records and the node report), ``observe`` (the
sampling loop's clock read-backs and stall samples of open windows); the pod map's types are in
``pods``.

Callers: ``rlenergy_agent.server`` (signals), ``rlenergy_agent.__main__`` (lifecycle),
``rlenergy_agent.metrics`` (``snapshot``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from rlenergy.api import node as api_node
from rlenergy_agent import actuator as act
from rlenergy_agent import caps, crosscheck, energy, histogram, shares, stalls
from rlenergy_agent.leases import Leases
from rlenergy_agent.observe import WindowObservations
from rlenergy_agent.parks import Parks
from rlenergy_agent.podends import ENDED_PODS_KEPT as ENDED_PODS_KEPT
from rlenergy_agent.podends import PodEnds
from rlenergy_agent.pods import PodMap as PodMap
from rlenergy_agent.pods import PodRef as PodRef
from rlenergy_agent.pods import StaticPodMap as StaticPodMap
from rlenergy_agent.probes import ProbeSlices
from rlenergy_agent.records import StepRecords
from rlenergy_agent.sleeps import SleepChecks
from rlenergy_agent.state import IDLE, IDLE_PHASES, _Open, _Park, _Probe
from rlenergy_agent.state import MAX_STEPS_KEPT as MAX_STEPS_KEPT
from rlenergy_agent.state import SignalRefused as SignalRefused

log = logging.getLogger(__name__)

"""Ended pods the node report lists, newest last [MODEL: a rollout loses few ranks a step]."""


@dataclasses.dataclass
class PhaseResult:
    """What one phase signal did.

    Attributes:
        gpus: the physical GPU UUIDs acted on.
        applied: per UUID the apply result.
        latency_s: signal received to clocks applied on every GPU, s.
        closed: the window the signal closed, if any.
        plan_phases: the phase names of the plan the agent follows now, in its order
            (observe-mode plans included; empty: no plan), so that the trainer knows which
            training sub-phases the policy names (``rlenergy.api.phases.signal_name``).
        boundary_s: when the GPUs' energy counters were read for the boundary this signal
            made (the agent's clock, s): energy before it is the closed window's, after it
            the new window's.
    """

    gpus: tuple[str, ...]
    applied: Mapping[str, act.ApplyResult]
    latency_s: float
    closed: api_node.PhaseWindowReport | None
    plan_phases: tuple[str, ...] = ()
    boundary_s: float | None = None


class Agent(ProbeSlices, Parks, StepRecords, WindowObservations, Leases, PodEnds, SleepChecks):
    """One node's agent for one policy.

    Args:
        node_name: the node.
        policy_name: the ``RLEnergyPolicy`` whose plan this agent applies.
        actuator: clock control.
        meter: energy meter.
        podmap: device allocation.
        mig_parent: MIG instance UUID -> physical GPU UUID.
        clock: monotonic time source, s.
        stall_after_s: frozen time that makes a stall, s (``rlenergy_agent.stalls``).
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
        stall_after_s: float = stalls.STALL_AFTER_S,
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
        self.pod_energy: dict[tuple[PodRef, int], dict[str, float | None]] = {}
        """Energy of each pod's phase windows per (pod, step) and phase, J, until its step ends."""
        self.phase_of: dict[str, str] = {u: "idle" for u in actuator.gpus}
        self.pod_of: dict[str, PodRef | None] = {u: None for u in actuator.gpus}
        self.phase_energy_j: dict[tuple[str, str], float] = {}
        """(GPU, phase) -> energy of every closed window, J; idle windows under ``idle``."""
        self.phase_names: set[str] = set()
        """Phase names with counters of their own (``state.MAX_PHASE_SERIES``)."""
        self.phase_seconds: dict[tuple[str, str], float] = {}
        self.valid_tokens_total = 0.0
        """Valid tokens of every step ended here (a counter: not trimmed with the records)."""
        self.saving_ratio: dict[str, float] = {}
        """The policy status' saving / 100 per phase (``""``: the job), for /metrics."""
        self.crosscheck = crosscheck.CrossCheck(meter, clock=clock)
        """Energy counter vs integrated instant power, at a low duty cycle (``observe``)."""
        self.stall_after_s = stall_after_s
        self.stalled_s_total = 0.0
        """Stalled time of every closed window, s (a counter for /metrics)."""
        self._bands: dict[str, float | None] = {}
        self.latency_hist = histogram.Histogram()
        """Phase signal received to clocks applied, s (``/metrics``: a histogram)."""
        self.dirty_steps: set[int] = set()
        self.record_cache: dict[int, tuple[tuple[object, ...], api_node.StepRecord]] = {}
        """Built step records by step, with what they were built from (``records``)."""
        self.idle_j: dict[int, float | None] = {}
        self.idle_gpu_s: dict[int, float] = {}
        """Per step, the idle windows' time summed over their GPUs, GPU-s."""
        self.refused = 0
        self.probe_switches = 0
        self._init_rollout()
        self._init_callers()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self._init_leases()
        self._init_sleeps()
        actuator.sharers = self.sharers_of

    def _init_rollout(self) -> None:
        """The FlexFloor state: parked GPUs, released time, dispatches, ended pods."""
        self.parked: dict[str, _Park] = {}
        """Parked GPUs (released rollout workers), by UUID."""
        self.released_gpu_s: dict[str, float] = {}
        """Per GPU the time of ended parks, GPU-s (a counter; ongoing parks come on top)."""
        self.step_released_gpu_s: dict[int, float] = {}
        """Per RL step the time of its ended parks, GPU-s."""
        self.dispatch: api_node.RolloutDispatch | None = None
        """The rollout dispatcher's newest publication on this node."""
        self.ended_pods: collections.deque[api_node.EndedPod] = collections.deque(
            maxlen=ENDED_PODS_KEPT
        )
        """Governed pods that ended (``pod_gone``), newest last, for the node report."""
        self.lost_workers: list[str] = []
        """Rollout worker pods the policy's status names lost (the plan watch sets it)."""

    def _init_callers(self) -> None:
        """Who may signal: the report flag, discovery's outcome and selection, the step window."""
        self.report_due = False
        """Park state or a dispatcher publication changed: the report writer should write."""
        self.discovery: tuple[str, str] | None = None
        """Policy discovery's last outcome (reason, ``ns/name`` or ``""``); ``None``: a policy
        was configured."""
        self.newest_step = -1
        """The newest RL step a signal carried (``state.STEP_WINDOW``); -1: none yet."""
        self.selected: frozenset[tuple[str, str]] | None = None
        """``(namespace, name)`` of the pods the serving policy selects (discovery); ``None``:
        not known, nothing checked (``state.AgentState.check_selected``)."""
        self._init_selection()

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
            self.record_cache.clear()
            self.workloads.clear()
            self.idle_j.clear()
            self.idle_gpu_s.clear()
            self.dirty_steps.clear()
            self.step_released_gpu_s.clear()
            self.dispatch = None
            self.newest_step = -1
            self.pod_energy.clear()
            self.saving_ratio, self.folded_through_step = {}, -1
            self.phase_of = {u: "idle" for u in self.actuator.gpus}
            self.pod_of = {u: None for u in self.actuator.gpus}
            self.policy_name = policy_name

    def plan_phases(self) -> tuple[str, ...]:
        """Phase names of the current plan, in its order (observe included; empty: no plan).

        The phase signal's answer carries them (``signals.PhaseAnswer.plan_phases``): a trainer
        signals a training sub-phase under its own name only when the plan lists it.
        """
        with self._lock:
            return tuple(p.phase for p in self.plan.phases) if self.plan is not None else ()

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

    def sharers_of(self, gpu: str) -> set[str]:
        """Every device ID of physical GPU ``gpu`` that any pod holds (``shares.sharers``)."""
        return shares.sharers(gpu, self.podmap.pods(), self.mig_parent)

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
            SignalRefused: the pod holds no GPU on this node, or names a GPU it does not hold
                (403/404); a phase name neither the plan nor the defaults name (400); a step
                too far past the newest (409).
        """
        t0 = received_s if received_s is not None else self._clock()
        self.check_phase(phase)
        gpus, devices, _ = self.signal_gpus(pod, gpu_uuids, step, writes_all=True)
        with self._lock:
            entry = self._entry_for(phase)
            plan_phases = self.plan_phases()
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
            # A lock found gone (a GPU reset): the closing window is no evidence.
            prior = self._open.get(pod)
            if prior is not None:
                prior.errors += [
                    f"{e.uuid}: {e.reason}" for e in self.actuator.pending if e.uuid in prior.gpus
                ]
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
                {},
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
        return PhaseResult(gpus, results, latency, closed, plan_phases, boundary_s=mark.t_s)

    # ----- in-phase probes ------------------------------------------------------------------

    def end_step(
        self, pod: PodRef, step: int, workload: api_node.TokenWorkloadReport
    ) -> dict[str, float | None]:
        """``pod`` finished RL step ``step``: close its window and file the step's workload.

        Returns:
            The energy of ``pod``'s phase windows of the step per phase, J (``None``: some
            window's energy is unknown), the trainer's ``rlenergy/energy/*`` metrics.

        Raises:
            SignalRefused: a negative step (it would make every later node report invalid), or
                one too far past the newest (``state.AgentState.check_step``).
        """
        self.check_step(step)
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
            return self._pod_step_energy(pod, step)

    def _pod_step_energy(self, pod: PodRef, step: int) -> dict[str, float | None]:
        """Energy of ``pod``'s windows of ``step`` per phase, J (caller holds the lock).

        Forgets the pod's older steps.
        """
        for key in [k for k in self.pod_energy if k[0] == pod and k[1] < step]:
            del self.pod_energy[key]
        return self.pod_energy.pop((pod, step), {})

    def _shared(self, pod: PodRef, win: energy.Window) -> energy.Window:
        """``win`` with each shared GPU's energy scaled to ``pod``'s share (``shares``)."""
        split = shares.shares(
            {(p.namespace, p.name): d for p, d in self.podmap.pods().items()},
            self.mig_parent,
            {u: c.mig_uuids for u, c in self.actuator.controls.items() if c.mig_uuids},
            {
                m: n
                for g in self.actuator.gpus.values()
                for m, n in getattr(g, "mig_slices", {}).items()
            },
            {u: (p.namespace, p.name) for u, p in self.pod_of.items() if p is not None},
        )
        key = (pod.namespace, pod.name)
        factor = {u: split.get((key, u), 1.0) for u in win.per_gpu_j}
        if all(f == 1.0 for f in factor.values()):
            return win
        per = {u: None if j is None else j * factor[u] for u, j in win.per_gpu_j.items()}
        values = list(per.values())
        total = None if any(v is None for v in values) else sum(v for v in values if v is not None)
        return dataclasses.replace(win, energy_j=total, per_gpu_j=per)

    def _stalled(self, pod: PodRef, w: _Open) -> tuple[float, float | None]:
        """(stalled s, their energy J: the pod's share, same source) of a closing window."""
        if w.stall is None:
            return 0.0, 0.0
        w.stall.close()
        seconds = 0.0
        joules: float | None = 0.0
        for st in w.stall.stalls:
            assert st.end_s is not None
            seconds += max(st.end_s - st.start_s, 0.0)
            e = self._shared(pod, self.meter.window(st.start_mark, st.end_mark)).energy_j
            joules = None if joules is None or e is None else joules + e
        self.stalled_s_total += seconds
        return seconds, joules

    def _close(self, pod: PodRef, end: energy.Mark) -> api_node.PhaseWindowReport | None:
        w = self._open.pop(pod, None)
        if w is None:
            return None
        win = self._shared(pod, self.meter.window(w.mark, end))
        self._window_closed(w.phase, win.duration_s)
        now = self._clock()
        released = w.released_gpu_s + sum(
            p.released_s(now, w.started_s) for u in w.gpus if (p := self.parked.get(u)) is not None
        )
        if w.phase == IDLE:
            self.steps.setdefault(w.step, {})
            prev = self.idle_j.get(w.step, 0.0)
            self.idle_j[w.step] = (
                None if prev is None or win.energy_j is None else prev + win.energy_j
            )
            self.idle_gpu_s[w.step] = self.idle_gpu_s.get(w.step, 0.0) + win.duration_s * len(
                w.gpus
            )
            self._count(win)
            self.dirty_steps.add(w.step)
            self._trim()
            return None
        stalled_s, stalled_j = self._stalled(pod, w)
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
            applied_clock_mhz=caps.held_clock_mhz(w.applied),
            slowdown=w.slowdown or caps.held_flag(w.slow_reads),
            error="; ".join(w.errors) or None,
            energy_source=sources.pop() if len(sources) == 1 else "mixed",
            incomplete=win.incomplete,
            low_confidence=win.low_confidence,
            gpu_energy_joules=dict(win.per_gpu_j),
            progress=w.progress,
            **self._progress_cadence(w, win.duration_s, end.t_s),
            slices=slices,
            gpu_seconds=win.duration_s * len(w.gpus),
            released_gpu_seconds=min(released, win.duration_s * len(w.gpus)),
            stalled_seconds=min(stalled_s, win.duration_s),
            stalled_energy_joules=None
            if stalled_j is None
            else min(stalled_j, win.energy_j if win.energy_j is not None else stalled_j),
        )
        self.steps.setdefault(w.step, {}).setdefault(w.phase, []).append(report)
        mine = self.pod_energy.setdefault((pod, w.step), {})
        prev = mine.get(w.phase, 0.0)
        mine[w.phase] = None if prev is None or win.energy_j is None else prev + win.energy_j
        self.dirty_steps.add(w.step)
        self._count(win, w.phase)
        self._trim()
        return report

    # ----- report ---------------------------------------------------------------------------

    # ----- released rollout workers (FlexFloor park) ----------------------------------------
