"""The agent's shared state: the fields every concern reads and writes under ``Agent._lock``.

``AgentState`` declares the fields (``service.Agent.__init__`` sets them); the concern modules
(``probes``: in-phase probe slices, ``parks``: parked rollout workers, ``records``: step
records and the node report) are mixins over it, so each holds one concern's methods while
``service.Agent`` keeps the lock, the shared state and the phase windows. The window and
probe records (``_Open``, ``_Probe``, ``_Slice``, ``_Park``) and the limits live here too.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from rlenergy.api import node as api_node
from rlenergy.api import phases as api_phases
from rlenergy.gpu import errors as gpu_errors
from rlenergy_agent import actuator as act
from rlenergy_agent import crosscheck, energy, histogram, pods, shares, stalls
from rlenergy_agent.pods import PodMap, PodRef

log = logging.getLogger("rlenergy_agent.service")

IDLE_PHASES = frozenset({"idle", "none", ""})
IDLE = "idle"
"""The window name of the time between phases (energy reported as ``idleEnergyJoules``)."""
MAX_STEPS_KEPT = 32
"""Step records the agent keeps (bounded, oldest dropped); the report holds those the
operator has not folded yet (``AgentState.folded_through_step``)."""
STEP_WINDOW = 8
"""A signal's step may lie at most this many steps past the newest step the agent accepted
(``AgentState.check_step``): a trainer advances one step at a time, an asynchronous rollout
dispatcher publishes the next step or two ahead, and a park names the current step. A step
further ahead (2^62, or ``MAX_STEP`` to end every park and stale every publication for good) is
refused with 409. The first signal after the agent starts or switches policy sets the newest
step (a trainer resuming from a checkpoint at step 5000 is accepted)."""
MISS_WAIT_S = 3.0
"""How long a pod's first signal that no discovery has selected waits for the node loop's next
discoveries (woken at once; each a listing of the node's pods and policies, tens of ms) before
it is answered 503: a pod that just started is then served on its first signal. Once per pod
(``selection_misses``); later misses are answered at once."""
MISSES_KEPT = 1024
"""Pods whose selection miss is remembered (``check_selected``): a bound on what callers that
no policy selects can make the agent keep; the oldest is forgotten first (it then gets one more
round of 503 before its 403)."""
DEFAULT_PHASES = frozenset(
    {api_phases.GENERATION, api_phases.TRAINING} | {s.name for s in api_phases.TRAINING_SUBPHASES}
)
"""Phase names accepted besides the plan's (and the idle names): the default policy's two
phases and verl's training sub-phases, which a trainer signals before it knows the plan."""
MAX_PHASE_SERIES = 64
"""Distinct phase names the per-GPU phase counters of /metrics keep; windows of further names
(plans of earlier policies, renamed phases) count under ``other`` [MODEL: a plan names a handful
of phases; the bound keeps a scrape small whatever a tenant signals]."""
OTHER_PHASE = "other"
"""The phase label of windows past ``MAX_PHASE_SERIES`` names."""
POWER_SAMPLES_PER_SLICE = 4
"""Instant-power reads per probe slice, spread evenly over it (the energy counter updates only
every 20-100 ms, too coarse for slices of a few tens of ms)."""
PROBER_IDLE_WAIT_S = 1.0
"""The prober thread's wait when no probe runs (a phase signal wakes it at once)."""
MAX_REPORT_AGE_S = 0.5
"""A progress report's own timestamp is trusted when at most this old on arrival, s."""
MAX_PROGRESS_LOG = 100_000
"""Progress reports kept per probed window (a runaway caller cannot grow it without bound)."""


@dataclasses.dataclass
class _Slice:
    """One finished probe slice (progress is filled in when the window closes)."""

    clock_mhz: int | None
    start_s: float
    end_s: float
    energy_j: float | None
    stalled: bool = False
    """The slice overlaps a stall (``stalls``) or was held through one."""
    effective_mhz: int | None = None
    """Lowest SM clock read with the slice's power samples (locked slices), MHz."""
    energy_source: str | None = None
    """``instant_power`` (mean of the samples) or the meter's source of the counter fallback."""
    samples: tuple[tuple[float, float], ...] = ()
    """The slice's instant-power samples: (time s, power summed over the window's GPUs W)."""
    switch_s: float | None = None
    """When the switch to the next slice's clock began (``end_s``: when it had reached every
    GPU), s; ``None``: the slice ended without a switch. Between the two the GPUs run mixed
    clocks, so progress reported then is no slice's rate (``probes.slice_progress``)."""


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
        samples: (time s, W) of each sample in ``power_w``.
        power_failed: an instant-power read failed in this slice (use counter deltas).
        clock_reads: per GPU, the SM clocks read back with the power samples of a locked
            slice, MHz (``caps.held_clock_mhz`` makes the slice's effective clock).
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
    samples: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    power_failed: bool = False
    clock_reads: dict[str, list[int]] = dataclasses.field(default_factory=dict)
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
        self.samples = []
        self.power_failed = False
        self.clock_reads = {}
        self.next_sample_s = t_s + 0.5 * self.slice_s / POWER_SAMPLES_PER_SLICE


@dataclasses.dataclass
class _Open:
    """An open phase window of one pod."""

    phase: str
    step: int
    mark: energy.Mark
    started_s: float
    requested_mhz: int | None
    applied: dict[str, list[int]]
    """Per GPU, the SM clocks read back while it was busy, MHz (``caps.held_clock_mhz``)."""
    slowdown: bool
    """A slowdown reason at a switch's read-back (the apply results of the phase and its slices)."""
    errors: list[str]
    progress: float = 0.0
    gpus: tuple[str, ...] = ()
    slow_reads: dict[str, list[bool]] = dataclasses.field(default_factory=dict)
    """Per GPU, whether each busy read-back showed a slowdown reason (``caps.held_flag``)."""
    devices: tuple[str, ...] = ()
    probe: _Probe | None = None
    progress_log: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """(time s, cumulative progress) reports, kept while the window is probed."""
    released_gpu_s: float = 0.0
    """GPU time of parks that ended inside this window, GPU-s."""
    stall: stalls.StallWatch | None = None
    """Stall detection, from the caller's first in-flight report (``stalls``)."""
    last_report_s: float | None = None
    """When the trainer's latest progress report was measured (this agent's clock), s."""
    report_gap_s: float = 0.0
    """Largest time from the window's start between the trainer's progress reports, s."""
    reports: int = 0
    """Progress reports that advanced the window's total."""
    reported: float = 0.0
    """The total of the newest advancing report."""
    last_signal_s: float = 0.0
    """When the caller's newest progress report arrived (this agent's clock), s; with
    ``started_s`` it renews the window's lease (``rlenergy_agent.leases``)."""


@dataclasses.dataclass(frozen=True)
class _Park:
    """A parked GPU: a released rollout worker's, at its lowest SM clock until its step ends.

    Attributes:
        pod: the pod that parked it.
        step: RL step of the release.
        since_s: when it was parked (this agent's clock), s.
        clock_mhz: the lock made (``None``: nothing written: observe plan or no clock control).
        dropped_s: when the GPU's power was first read below its power band after the park
            (``Parks.observe_parks``), s; ``None``: not yet. Released GPU time counts from here
            only: a parked GPU whose engine still decodes on it draws working power and
            releases nothing.
    """

    pod: PodRef
    step: int
    since_s: float
    clock_mhz: int | None
    dropped_s: float | None = None

    def released_s(self, now_s: float, start_s: float = 0.0) -> float:
        """Released time from ``max(dropped_s, start_s)`` to ``now_s``, s (0 before the drop)."""
        if self.dropped_s is None:
            return 0.0
        return max(now_s - max(self.dropped_s, start_s), 0.0)


class SignalRefused(Exception):
    """A phase signal the agent will not act on.

    Args:
        message: why.
        status: HTTP status to answer with (403 not your GPU, 404 no GPUs, 400 bad input).
    """

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


class AgentState:
    """The fields of ``service.Agent`` that its concern mixins share (set in its ``__init__``)."""

    node_name: str
    policy_name: str
    actuator: act.Actuator
    meter: energy.EnergyMeter
    podmap: PodMap
    mig_parent: dict[str, str]
    _clock: Callable[[], float]
    _lock: threading.RLock
    plan: api_node.ClockPlan | None
    _open: dict[PodRef, _Open]
    steps: dict[int, dict[str, list[api_node.PhaseWindowReport]]]
    workloads: dict[int, api_node.TokenWorkloadReport]
    phase_of: dict[str, str]
    pod_of: dict[str, PodRef | None]
    phase_energy_j: dict[tuple[str, str], float]
    phase_names: set[str]
    pod_energy: dict[tuple[PodRef, int], dict[str, float | None]]
    phase_seconds: dict[tuple[str, str], float]
    valid_tokens_total: float
    saving_ratio: dict[str, float]
    crosscheck: crosscheck.CrossCheck
    stall_after_s: float
    stalled_s_total: float
    _bands: dict[str, float | None]
    latency_hist: histogram.Histogram
    dirty_steps: set[int]
    record_cache: dict[int, tuple[tuple[object, ...], api_node.StepRecord]]
    idle_j: dict[int, float | None]
    idle_gpu_s: dict[int, float]
    refused: int
    probe_switches: int
    parked: dict[str, _Park]
    released_gpu_s: dict[str, float]
    step_released_gpu_s: dict[int, float]
    dispatch: api_node.RolloutDispatch | None
    ended_pods: collections.deque[api_node.EndedPod]
    expired_leases: collections.deque[api_node.ExpiredLease]
    phase_longest_s: dict[str, float]
    leases_expired_total: int
    sleep_checks: collections.deque[api_node.SleepCheck]
    sleep_results: dict[str, int]
    lost_workers: list[str]
    report_due: bool
    discovery: tuple[str, str] | None
    newest_step: int
    selected: frozenset[tuple[str, str]] | None
    discovery_due: bool
    discoveries: int
    selection_misses: dict[tuple[str, str, str], int]
    discovery_done: threading.Condition
    loop_wake: threading.Event
    folded_through_step: int = -1
    """The policy's ``status.totals.throughStep`` as the plan watch last delivered it (-1:
    unknown): the report leaves out the records at or before it (``api_node.unfolded_steps``),
    which the operator folded into the policy's status for good."""
    stopping: bool = False
    """SIGTERM arrived: the agent resets its clocks and exits; every signal gets 503 (retry:
    the next agent on the node serves the same socket), never a 403 a trainer takes as final."""
    discovery_pending: bool = False
    """The agent discovers its policy (no policy in the settings) and no discovery has
    succeeded yet: every signal gets 503 until one has (``nodeloop.rediscover``)."""
    _wake: threading.Event
    _stop: threading.Event
    _prober: threading.Thread | None

    def gpus_of(self, pod: PodRef) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(physical GPUs, devices) of ``pod`` (``service.Agent.gpus_of``)."""
        raise NotImplementedError

    def governed_pods(self) -> set[PodRef]:
        """Pods this agent acts for (``podends.PodEnds.governed_pods``)."""
        raise NotImplementedError

    def signal_gpus(
        self, pod: PodRef, gpu_uuids: Sequence[str], step: int, *, writes_all: bool = False
    ) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
        """The GPUs a signal of ``pod`` for ``step`` acts on, checked.

        ``writes_all``: the signal writes the clock of every GPU of the pod next (a phase
        signal), so parks of the pod that a newer step ends need no reset first.

        Returns:
            ``(physical GPUs, devices, targets)``: ``targets`` are the physical GPUs named in
            ``gpu_uuids`` (MIG or replica names mapped to their GPU, each once), or all of the
            pod's GPUs when none is named.

        Raises:
            SignalRefused: 404 the pod holds no GPU here, 403 it names a GPU it does not hold,
                400 a negative step.
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
        self.check_step(step, pod if writes_all else None)
        return gpus, devices, targets

    def check_step(self, step: int, writer: PodRef | None = None) -> None:
        """Refuse a step below 0 or more than ``STEP_WINDOW`` past the newest one; keep it.

        A newer step ends the parks of earlier steps (``_end_parks_before``).

        Args:
            step: the signal's RL step.
            writer: the signalling pod when its signal writes the clocks of all its GPUs next
                (a phase signal): its ended parks are not reset first.

        Raises:
            SignalRefused: 400 a negative step, 409 a step too far ahead (the message names
                the newest step and the window).
        """
        if step < 0:
            raise SignalRefused("step must be >= 0", 400)
        with self._lock:
            newest = self.newest_step
            if newest >= 0 and step > newest + STEP_WINDOW:
                self.refused += 1
                raise SignalRefused(
                    f"step {step} is more than {STEP_WINDOW} steps past the newest step "
                    f"{newest} of this node's policy; steps advance one at a time",
                    409,
                )
            if step > newest:
                self.newest_step = step
                self._end_parks_before(step, writer)

    def check_phase(self, phase: str) -> None:
        """Refuse a phase name that neither the plan nor ``DEFAULT_PHASES`` names.

        Bounds the phase names a step, the node report and /metrics can hold to the plan's
        phases, the defaults and the idle names, whatever a trainer sends.

        Raises:
            SignalRefused: 400, naming the phases accepted.
        """
        if phase in IDLE_PHASES or phase in DEFAULT_PHASES:
            return
        plan = self.plan
        if plan is not None and plan.for_phase(phase) is not None:
            return
        self.refused += 1
        listed = sorted({p.phase for p in plan.phases} if plan is not None else set())
        known = ", ".join([*listed, *sorted(DEFAULT_PHASES - set(listed)), "idle"])
        raise SignalRefused(
            f"phase {phase[:64]!r} is not a phase of the policy's plan; signal one of: {known}",
            400,
        )

    def check_serving(self) -> None:
        """Refuse every signal, retryably, while the agent cannot judge one.

        Raises:
            SignalRefused: 503 while the agent stops (``stopping``) or before its first policy
                discovery (``discovery_pending``).
        """
        if self.stopping:
            raise SignalRefused(
                "the node agent is stopping (a restart or a DaemonSet roll) and resets its "
                "clocks: retry; the next agent on this node serves the same socket",
                503,
            )
        if self.discovery_pending:
            raise SignalRefused(
                "the node agent has not yet discovered the policy governing this node: retry",
                503,
            )

    def check_selected(self, pod: PodRef) -> None:
        """Refuse a pod the policy this agent serves does not select.

        ``selected`` is set by policy discovery (``nodeloop``): the GPU pods of this node whose
        labels the serving policy's ``spec.selector`` matches, in its namespace. ``None`` (a
        policy named in the settings, or a plan file: local runs) checks nothing here. A miss
        asks the node loop to discover again at its next pass: a pod that just started (or was
        re-created under its name) signals before the discovery that selects it, so its
        refusal is final (403) only once a discovery that began after its first miss has not
        selected it either; until then it gets 503 (retry). The caller passed identity
        (``identity.authorize``: its token, its node, its GPUs) before this check.

        Raises:
            SignalRefused: 503 as ``check_serving``, for a pod the agent governs (its
                windows, locks or parks are held: discovery dropped it for a moment, e.g. an
                empty kubelet listing, and a lasting change resets it first,
                ``nodeloop.leave_policy``), or for a pod whose first miss no discovery has
                answered yet; 403 for any other pod, naming it and the policy.
        """
        self.check_serving()
        selected = self.selected
        if selected is None or (pod.namespace, pod.name) in selected:
            self.selection_misses.pop((pod.namespace, pod.name, pod.uid), None)
            return
        self.discovery_due = True
        if any(pods.same_pod(p, pod) for p in self.governed_pods()):
            raise SignalRefused(
                f"pod {pod} is governed here, but the newest policy discovery does not select "
                "it: retry",
                503,
            )
        key = (pod.namespace, pod.name, pod.uid)
        first = self.selection_misses.get(key)
        if first is None:
            while len(self.selection_misses) >= MISSES_KEPT:
                self.selection_misses.pop(next(iter(self.selection_misses)))
            self.selection_misses[key] = first = self.discoveries
            if self._await_selection(pod, first + 2):
                self.selection_misses.pop(key, None)
                return  # a pod that had just started: the fresh discovery selects it
        if self.discoveries <= first + 1:  # the discovery running at the miss may predate it
            raise SignalRefused(
                f"pod {pod} is not selected by the policy this node serves "
                f"({self.policy_name or 'none'}) as of the last discovery; discovering again "
                "(a pod that just started): retry",
                503,
            )
        self.refused += 1
        serving = self.policy_name or "none"
        raise SignalRefused(
            f"pod {pod} is not selected by the policy this node serves ({serving}): only the "
            "pods a policy's spec.selector matches may signal its node agents",
            403,
        )

    def _init_selection(self) -> None:
        """Set up selection misses (``check_selected``) and the discoveries they wait for."""
        self.discovery_due = False
        """A pod that no policy selects signalled: the node loop discovers again at once."""
        self.discoveries = 0
        """Discoveries that set ``selected``, counting up (``nodeloop.rediscover``)."""
        self.discovery_done = threading.Condition()
        """Notified at each discovery (``discovered``): a signal that missed waits on it."""
        self.loop_wake = threading.Event()
        """Set by a selection miss: the node loop passes at once instead of at its interval."""
        self.selection_misses: dict[tuple[str, str, str], int] = {}
        """``(namespace, name, uid)`` of pods refused by selection -> ``discoveries`` at their
        first refusal (at most ``MISSES_KEPT``, oldest dropped first)."""

    def discovered(self) -> None:
        """A policy discovery set ``selected``: count it and wake the signals waiting on one."""
        with self.discovery_done:
            self.discoveries += 1
            self.discovery_done.notify_all()

    def _await_selection(self, pod: PodRef, count: int) -> bool:
        """Wait up to ``MISS_WAIT_S`` for a discovery that selects ``pod``.

        Each wait wakes the node loop with a discovery due (``loop_wake``, ``discovery_due``).

        Returns:
            True once ``selected`` names ``pod``; False when ``discoveries`` reached ``count``
            without it, or the time ran out.
        """
        deadline = time.monotonic() + MISS_WAIT_S
        with self.discovery_done:
            while True:
                selected = self.selected
                if selected is not None and (pod.namespace, pod.name) in selected:
                    return True
                left = deadline - time.monotonic()
                if self.discoveries >= count or left <= 0:
                    return False
                self.discovery_due = True
                self.loop_wake.set()
                self.discovery_done.wait(left)

    def _entry_for(self, phase: str) -> api_node.PhasePlan | None:
        raise NotImplementedError

    def _power_band_w(self, uuid: str) -> float | None:
        """``uuid``'s power band, W (``stalls.band_w``; read once per GPU, then cached).

        Below it a GPU is not decoding: the stall watch and the park's released time use it.
        """
        if uuid not in self._bands:
            gpu = self.actuator.gpus[uuid]
            try:
                limit_w: float | None = gpu.power_limit_mw() / 1000.0
            except gpu_errors.GpuError:
                limit_w = None
            self._bands[uuid] = stalls.band_w(getattr(gpu, "name", ""), limit_w)
        return self._bands[uuid]

    def _end_parks_before(self, step: int, writer: PodRef | None = None) -> None:
        """End every park of a step before ``step`` (``parks.Parks._end_parks_before``)."""
        raise NotImplementedError

    def stalled_since_s(self, uuid: str) -> float | None:
        """How long the window on ``uuid`` is stalled, s (``service.Agent.stalled_since_s``)."""
        raise NotImplementedError

    def released_gpu_seconds(self, uuid: str) -> float:
        """GPU time of the parks of ``uuid``, GPU-s (``parks.Parks``)."""
        raise NotImplementedError

    def _end_parks(self, uuids: Iterable[str], now_s: float) -> float:
        """End the parks of ``uuids`` (``parks.Parks._end_parks``)."""
        raise NotImplementedError

    def _close(self, pod: PodRef, end: energy.Mark) -> api_node.PhaseWindowReport | None:
        """Close ``pod``'s window at ``end`` (``service.Agent._close``)."""
        raise NotImplementedError

    def expire_leases(self, now_s: float) -> list[api_node.ExpiredLease]:
        """End the windows silent past their lease (``leases.Leases.expire_leases``)."""
        raise NotImplementedError
