"""Contract of a frequency policy: what it decides and what it observes.

A ``FrequencyPolicy`` has the zeus scheduler shape: the caller asks ``decide(step)`` for the
plan of the next RL step, runs the step, then reports what an agent measured with
``observe(...)``. Policies are pure and deterministic: no I/O, no clocks; the step index is the
only time they know.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Mapping
from typing import Protocol

from rlenergy.api import workload as api_workload


class PhaseState(enum.Enum):
    """Where a phase's clock selection stands."""

    WARMUP = "warmup"
    """Default governor; fitting the default-governor model."""
    TRIAL = "trial"
    """Probing candidate clocks against the default governor."""
    LOCKED = "locked"
    """Running the selected clock; monitoring."""
    FALLBACK = "fallback"
    """An error or lost signal: default governor until measurements are clean again."""
    OBSERVE = "observe"
    """Observe-only policy: never touches clocks."""


@dataclasses.dataclass(frozen=True)
class ProbeSlice:
    """One slice of an interleaved probe inside a phase.

    Attributes:
        clock_mhz: the locked SM clock of the slice, or ``None`` for the default governor.
        duration_s: slice length, s.
        progress: work the phase completed during the slice, in the unit the trainer SDK
            reports for the phase (decode iterations for generation, tokens for training); only
            ratios between slices of the same phase are used.
        energy_j: GPU energy of the slice summed over the phase's GPUs, J (``None``: unknown).
        stalled: the slice overlaps a stalled rollout (progress frozen with requests in flight
            at low power): its block is no evidence (``probe.blocks_from_slices`` drops it).
        effective_clock_mhz: the lowest SM clock read back during a locked slice, MHz
            (``None``: default governor or not read); see ``ran_slice_clock_mhz``.
        energy_source: where ``energy_j`` came from (``instant_power`` samples, or the
            counter fallback's source); a block's power ratio needs one source on both sides.
        rate_reports: progress reports the slice's rate was measured from (``None``: not
            counted, e.g. the simulator's exact slices); fewer than 2 (``unresolved``): its
            progress was interpolated across a report gap that mixes clocks, and its block
            is no evidence (``probe.blocks_from_slices`` drops it).
        lead_s: time from the slice's start until the phase's work began, s (a window's
            first slice when the trainer signals before its kernels start; 0 otherwise). The
            default governor would wait as long, so the lead is no part of the slice's rate or
            power (``work_s``) and counts as its own answer in a paired default.
        lead_energy_j: energy of the lead over the phase's GPUs, J (part of ``energy_j``;
            ``None``: no lead or the energy is unknown).
    """

    clock_mhz: int | None
    duration_s: float
    progress: float
    energy_j: float | None
    stalled: bool = False
    effective_clock_mhz: int | None = None
    energy_source: str | None = None
    rate_reports: int | None = None
    lead_s: float = 0.0
    lead_energy_j: float | None = None

    @property
    def work_s(self) -> float:
        """Time the slice ran the phase's work, s (``duration_s`` less the lead)."""
        return max(self.duration_s - self.lead_s, 0.0)

    @property
    def work_energy_j(self) -> float | None:
        """Energy of the slice's work, J (``energy_j`` less the lead's; ``None``: unknown)."""
        if self.energy_j is None:
            return None
        return max(self.energy_j - (self.lead_energy_j or 0.0), 0.0)

    @property
    def unresolved(self) -> bool:
        """The slice's progress is not its own rate (fewer than 2 reports at its clock)."""
        return self.rate_reports is not None and self.rate_reports < 2


@dataclasses.dataclass(frozen=True)
class PhaseObservation:
    """What an agent measured for one phase window of one step.

    Attributes:
        phase: phase name.
        duration_s: phase wall time, s.
        energy_j: energy over the phase's GPUs from counter deltas, J (``None``: unknown).
        requested_clock_mhz: the clock the plan asked for (``None``: default governor).
        applied_clock_mhz: the SM clock read back during the phase (lowest over GPUs).
        slowdown: a clock-event reason (power cap, thermal) held the clock below the request.
        slices: interleaved probe slices, when the plan asked for a probe.
        error: a GPU or signal error during the phase (the clocks may not be what was asked).
        stalled_s: stalled time excluded from ``duration_s`` (slowest node's), s.
        stalled_energy_j: energy of that stalled time, excluded from ``energy_j``, J (``None``:
            unknown).
        progress_gap_s: mean time between the trainer's in-phase progress reports that advanced
            the total, s (window length / (such reports + 1); the largest over the nodes);
            ``math.inf``: none arrived. ``0.0``: progress known exactly (the simulator).
            Slices shorter than ``eerl.SLICE_PER_PROGRESS_GAP`` gaps cannot be told apart.
        energy_source: where ``energy_j`` came from (``counter``, ``power_integration``,
            ``averaged_power``; ``mixed`` over nodes or GPUs metered differently).
    """

    phase: str
    duration_s: float
    energy_j: float | None
    requested_clock_mhz: int | None
    applied_clock_mhz: int | None = None
    slowdown: bool = False
    slices: tuple[ProbeSlice, ...] = ()
    error: str | None = None
    stalled_s: float = 0.0
    stalled_energy_j: float | None = 0.0
    progress_gap_s: float = 0.0
    energy_source: str | None = None


CLOCK_TOLERANCE_MHZ = 15
"""A read-back clock this close below the lock counts as the lock (one clock-table step of the
A100/H100 tables; the agent's ``caps`` module uses the same)."""


def ran_clock_mhz(obs: PhaseObservation) -> int | None:
    """The SM clock a locked window actually ran, MHz (``None``: default governor).

    The read-back when a cap held it below the lock by more than ``CLOCK_TOLERANCE_MHZ``, else
    the lock. Savings and pool times of locked windows are judged at this clock, so a power or
    thermal cap that arrives after the trials is not credited as the requested clock (#16).
    """
    req, ran = obs.requested_clock_mhz, obs.applied_clock_mhz
    if req is None or ran is None or ran >= req - CLOCK_TOLERANCE_MHZ:
        return req
    return ran


def ran_slice_clock_mhz(s: ProbeSlice) -> int | None:
    """The SM clock a locked probe slice actually ran, MHz (``None``: default governor).

    The read-back when a power or thermal cap held it more than ``CLOCK_TOLERANCE_MHZ`` below
    the lock, else the lock: a trial credits the clock the GPU ran, not the one asked (#16).
    """
    ran = s.effective_clock_mhz
    if s.clock_mhz is None or ran is None or ran >= s.clock_mhz - CLOCK_TOLERANCE_MHZ:
        return s.clock_mhz
    return ran


@dataclasses.dataclass(frozen=True)
class PoolIdle:
    """One pool's GPUs outside phase windows in one step.

    In async mode: waiting for the slower pool, plus the step's gaps.

    Attributes:
        energy_j: their energy, J (``None``: unknown).
        gpu_seconds: their idle time summed over GPUs, GPU-s (``None``: not reported).
        gpus: GPUs in the pool.
    """

    energy_j: float | None
    gpu_seconds: float | None
    gpus: int


@dataclasses.dataclass(frozen=True)
class StepObservation:
    """One RL step: its token workload, one observation per phase, each pool's idle.

    ``pool_idle``: in async mode, each pool's idle time by the phase it runs (empty in sync
    mode or when unknown).
    """

    step: int
    workload: api_workload.TokenWorkload
    phases: Mapping[str, PhaseObservation]
    pool_idle: Mapping[str, PoolIdle] = dataclasses.field(default_factory=dict)


def async_default_idle_j(
    idle_j: float,
    pool_idle: Mapping[str, PoolIdle],
    times_s: Mapping[str, tuple[float, float]],
) -> float:
    """The idle energy of an async step under the default governor, J.

    The pools run at once and each waits for the slower (``StepObservation.pool_idle``): a
    pool's idle time is the step's busy time, its slowest pool's phase, less its own phase.
    Under the default governor both phases run faster by their own ratios, so a pool waits
    ``(T_d - t_d) - (T - t)`` longer (``T``, ``T_d``: the slowest phase measured and under the
    default; ``t``, ``t_d``: the pool's), at the idle power per GPU its GPUs measured (else
    that of every pool that idled). The step's gaps outside both cancel. Counting the idle
    the same under either read the job's saving 11.90 % against a true 12.96 % on
    verl-grpo-deepseek7b / b200 async (``make bench-energy``, 2026-12-04; after: 13.03 %,
    docs/simulator.md).

    Args:
        idle_j: the step's measured idle energy, J.
        pool_idle: per phase, its pool's idle time and energy.
        times_s: per phase, (measured time s, default-governor time s).

    Returns:
        ``idle_j`` plus each pool's extra idle energy (at least 0); ``idle_j`` when a pool's
        idle or times are unknown (the idle counted the same under either).
    """
    if not pool_idle or set(pool_idle) != set(times_s):
        return idle_j
    known = [p for p in pool_idle.values() if p.energy_j is not None and p.gpu_seconds]
    if not known:
        return idle_j
    pooled_w = sum(p.energy_j or 0.0 for p in known) / sum(p.gpu_seconds or 0.0 for p in known)
    busy = max(t for t, _ in times_s.values())
    busy_default = max(t for _, t in times_s.values())
    extra_j = 0.0
    for name, pool in pool_idle.items():
        t, t_d = times_s[name]
        own = pool.energy_j is not None and pool.gpu_seconds
        per_gpu_w = (pool.energy_j or 0.0) / (pool.gpu_seconds or 1.0) if own else pooled_w
        extra_j += per_gpu_w * pool.gpus * ((busy_default - t_d) - (busy - t))
    return max(idle_j + extra_j, 0.0)


def async_default_idle_range_j(
    idle_j: float,
    pool_idle: Mapping[str, PoolIdle],
    times_s: Mapping[str, tuple[float, float]],
    bounds_s: Mapping[str, tuple[float, float]],
) -> tuple[float, float]:
    """Bounds of ``async_default_idle_j`` over the phases' default-time bounds, J.

    The default idle is no monotone function of one phase's default time: a slower default
    on the bottleneck pool lengthens the other pool's wait, a slower default on the other
    pool shortens its own. So the bounds are the least and the most of
    ``async_default_idle_j`` over every corner of the phases' (low, point, high) default
    times (3**phases evaluations; async runs two pools). Taking the point's idle for both
    bounds left the truth outside the job total's saving bounds while both phases' bounds
    held theirs (TinyZero / ``b200:step-decode`` async, seed 1, 200 steps: truth 10.09 %,
    bounds 7.19-9.36 %; ``make bench-energy``, 2026-12-07).

    Args:
        idle_j: the step's measured idle energy, J.
        pool_idle: per phase, its pool's idle time and energy.
        times_s: per phase, (measured time s, default-governor time s).
        bounds_s: per phase of ``times_s``, (low, high) default-governor time s.

    Returns:
        (low, high) idle energy under the default governor, J; both
        ``async_default_idle_j(idle_j, pool_idle, times_s)`` where it counts the idle the
        same under either.

    Raises:
        KeyError: a phase of ``times_s`` without ``bounds_s``.
    """
    names = list(times_s)
    values = [async_default_idle_j(idle_j, pool_idle, times_s)]
    for corner in itertools.product(range(3), repeat=len(names)):
        times = {
            n: (times_s[n][0], (bounds_s[n][0], times_s[n][1], bounds_s[n][1])[k])
            for n, k in zip(names, corner, strict=True)
        }
        values.append(async_default_idle_j(idle_j, pool_idle, times))
    return min(values), max(values)


@dataclasses.dataclass(frozen=True)
class PhaseDecision:
    """The plan for one phase of the next step.

    Attributes:
        clock_mhz: SM clock to lock for the phase, or ``None`` for the default governor.
        state: the selection state that produced it.
        probe_clocks_mhz: when non-empty, run the phase as interleaved slices cycling through
            these clocks (``None`` = default governor) instead of ``clock_mhz``.
        probe_slice_s: slice length for the probe, s.
        reason: one line for humans (status, logs).
        step_probe: this whole step is one slice of a probe block spanning steps (phases too
            short to slice); ``clock_mhz`` is the slice's clock.
    """

    clock_mhz: int | None
    state: PhaseState
    probe_clocks_mhz: tuple[int | None, ...] = ()
    probe_slice_s: float = 0.0
    reason: str = ""
    step_probe: bool = False

    @property
    def probing(self) -> bool:
        """The step runs a probe for this phase (in-phase slices or a whole-step slice)."""
        return bool(self.probe_clocks_mhz) or self.step_probe


@dataclasses.dataclass(frozen=True)
class Plan:
    """Clock decisions for every phase of one step."""

    step: int
    phases: Mapping[str, PhaseDecision]


class FrequencyPolicy(Protocol):
    """A per-phase clock policy (EE-RL, a fixed clock, the default governor)."""

    def decide(self, step: int) -> Plan:
        """Plan for ``step``."""
        ...

    def observe(self, observation: StepObservation) -> None:
        """Feed back what step ``observation.step`` measured."""
        ...


class DefaultGovernor:
    """The baseline: never locks a clock."""

    def __init__(self, phases: tuple[str, ...]) -> None:
        self._phases = phases

    def decide(self, step: int) -> Plan:
        """Default governor for every phase."""
        return Plan(
            step,
            {p: PhaseDecision(None, PhaseState.OBSERVE, reason="default") for p in self._phases},
        )

    def observe(self, observation: StepObservation) -> None:
        """Nothing to learn."""


class FixedClocks:
    """Fixed clocks per phase (sweeps, oracle replays)."""

    def __init__(self, clocks_mhz: Mapping[str, int | None]) -> None:
        self._clocks = dict(clocks_mhz)

    def decide(self, step: int) -> Plan:
        """The same clocks every step."""
        return Plan(
            step,
            {
                p: PhaseDecision(c, PhaseState.LOCKED, reason="fixed")
                for p, c in self._clocks.items()
            },
        )

    def observe(self, observation: StepObservation) -> None:
        """Nothing to learn."""
