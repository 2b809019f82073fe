"""The node agent's core: phase signals in, clocks and energy windows out.

``Agent`` holds the current ``ClockPlan`` and applies it locally the moment a phase starts
(clock switches never wait for the operator, DESIGN.md section 2). A phase signal names the
calling pod (authenticated by the server), so only that pod's GPUs, as the kubelet allocated
them, are clocked and metered (case #22). Each phase window is closed by the next signal; a
step's windows become one ``StepRecord`` for the node report. Energy of GPUs no pod holds is
booked to an explicit ``unattributed`` bucket. Utilisation never changes the declared phase
(case #27).

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
from rlenergy_agent import energy

log = logging.getLogger(__name__)

IDLE_PHASES = frozenset({"idle", "none", ""})
IDLE = "idle"
"""The window name of the time between phases (energy reported as ``idleEnergyJoules``)."""
MAX_STEPS_KEPT = 32
"""Step records kept in the report (bounded, oldest dropped)."""


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
        self.phase_seconds: dict[tuple[str, str], float] = {}
        self.latencies_s: list[float] = []
        self.dirty_steps: set[int] = set()
        self.idle_j: dict[int, float | None] = {}
        self.refused = 0

    # ----- plan -----------------------------------------------------------------------------
    def set_plan(self, plan: api_node.ClockPlan | None) -> None:
        """Adopt a new plan; ``None`` (policy removed) returns every GPU to the default."""
        with self._lock:
            self.plan = plan
            if plan is None or not plan.enforce:
                self.actuator.release(list(self.actuator.gpus), "policy removed or observe")

    def _clock_for(self, phase: str) -> int | None:
        if self.plan is None or not self.plan.enforce:
            return None
        entry = self.plan.for_phase(phase)
        return entry.clock_mhz if entry is not None else None

    # ----- signals --------------------------------------------------------------------------
    def gpus_of(self, pod: PodRef) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(physical GPU UUIDs, raw device IDs) the kubelet allocated to ``pod``."""
        devices = self.podmap.devices_of(pod)
        physical: list[str] = []
        for d in devices:
            u = self.mig_parent.get(d, d)
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
        foreign = [g for g in gpu_uuids if self.mig_parent.get(g, g) not in gpus]
        if foreign:
            self.refused += 1
            raise SignalRefused(f"pod {pod} does not hold GPU(s) {', '.join(foreign)}", 403)
        if step < 0:
            raise SignalRefused("step must be >= 0", 400)
        with self._lock:
            clock_mhz = None if phase in IDLE_PHASES else self._clock_for(phase)
            results = {u: self.actuator.apply(u, clock_mhz, owner_uuids=devices) for u in gpus}
            latency = self._clock() - t0
            self.latencies_s.append(latency)
            if len(self.latencies_s) > 10_000:
                del self.latencies_s[:5_000]
            # No read-back of the closing window here: the new clocks are already applied
            # (latency first); the sampling loop reads clocks during windows (``observe``).
            mark = self.meter.mark(gpus)
            closed = self._close(pod, mark)
            for u in gpus:
                self.phase_of[u] = "idle" if phase in IDLE_PHASES else phase
                self.pod_of[u] = pod
            # An idle signal opens an idle window too: its energy is the step's idle energy
            # (GPUs waiting for reward or data), booked outside the phases.
            self._open[pod] = _Open(
                IDLE if phase in IDLE_PHASES else phase,
                step,
                mark,
                self._clock(),
                clock_mhz,
                [],
                any(r.slowdown for r in results.values()),
                [f"{u}: {r.error}" for u, r in results.items() if r.error],
            )
            return PhaseResult(gpus, results, latency, closed)

    def _observe_clocks(self, pod: PodRef, gpus: Sequence[str]) -> None:
        """Read back the SM clock of a pod's busy GPUs into its open window (lowest wins)."""
        w = self._open.get(pod)
        if w is None:
            return
        for u in gpus:
            ctl = self.actuator.controls.get(u)
            if ctl is None or ctl.condition == "lost":
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
        """Read back clocks of every open window (the sampling loop calls this)."""
        with self._lock:
            for pod in list(self._open):
                self._observe_clocks(pod, self.gpus_of(pod)[0])

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

    def end_step(self, pod: PodRef, step: int, workload: api_node.TokenWorkloadReport) -> None:
        """``pod`` finished RL step ``step``: close its window and file the step's workload.

        Raises:
            SignalRefused: a negative step (it would make every later node report invalid).
        """
        if step < 0:
            raise SignalRefused("step must be >= 0", 400)
        gpus, _ = self.gpus_of(pod)
        with self._lock:
            if gpus:
                self._observe_clocks(pod, gpus)
                self._close(pod, self.meter.mark(gpus))
            self.workloads[step] = workload
            self.dirty_steps.add(step)

    def pod_gone(self, pod: PodRef) -> None:
        """The pod ended: close its window and reset its GPUs' clocks."""
        with self._lock:
            w = self._open.get(pod)
            gpus = [u for u, p in self.pod_of.items() if p == pod]
            if w is not None and gpus:
                self._close(pod, self.meter.mark(gpus))
            self.actuator.release(gpus, f"pod {pod} ended")
            for u in gpus:
                self.phase_of[u] = "idle"
                self.pod_of[u] = None

    def _close(self, pod: PodRef, end: energy.Mark) -> api_node.PhaseWindowReport | None:
        w = self._open.pop(pod, None)
        if w is None:
            return None
        win = self.meter.window(w.mark, end)
        if w.phase == IDLE:
            self.steps.setdefault(w.step, {})
            prev = self.idle_j.get(w.step, 0.0)
            self.idle_j[w.step] = (
                None if prev is None or win.energy_j is None else prev + win.energy_j
            )
            self.dirty_steps.add(w.step)
            self._trim()
            return None
        sources = set(win.sources.values())
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
        )
        self.steps.setdefault(w.step, {}).setdefault(w.phase, []).append(report)
        self.dirty_steps.add(w.step)
        for u, j in win.per_gpu_j.items():
            key = (u, w.phase)
            if j is not None:
                self.phase_energy_j[key] = self.phase_energy_j.get(key, 0.0) + j
            self.phase_seconds[key] = self.phase_seconds.get(key, 0.0) + win.duration_s
        self._trim()
        return report

    def _trim(self) -> None:
        while len(self.steps) > MAX_STEPS_KEPT:
            oldest = min(self.steps)
            del self.steps[oldest]
            self.workloads.pop(oldest, None)
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
            )

    def report(self) -> api_node.NodeReport:
        """The spec of this node's ``RLEnergyNodeReport``."""
        with self._lock:
            gpus = []
            total = 0.0
            unattributed = 0.0
            attributed = {u for u, p in self.pod_of.items() if p is not None}
            for pod_devices in self.podmap.pods().values():
                attributed.update(self.mig_parent.get(d, d) for d in pod_devices)
            for u, ctl in self.actuator.controls.items():
                j = self.meter.total_j(u)
                st = self.meter.state[u]
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
            )
