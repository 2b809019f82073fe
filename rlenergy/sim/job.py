"""Replay an RL job on simulated GPUs under a frequency policy, with the baselines beside it.

``run_job`` plays every step of a ``Replay`` on ``SimulatedGpu``s: it asks the policy for a
plan, applies clocks the way the node agent does (lock at phase start, idempotent writes,
interleaved slices for probes), reads energy counters at phase and slice boundaries, reports
the measurements (never the truth) to the policy, and keeps the truth for scoring.
``default_run`` and ``oracle`` evaluate the same steps with the same noise draws analytically:
the default governor, and the best fixed clock per phase in hindsight that meets the threshold.

Modes: ``sync`` (phases alternate on all GPUs, then the step's other work with GPUs idle) and
``async`` (a generation pool and a training pool of half the GPUs each run at once; the step
takes as long as the slower pool, the faster one idles) [MODEL: pool time scales inversely with
pool size].

Phases: the policy's (``Job.phases``). A replay split by training sub-phase
(``workload.from_trace(split=True)``) runs each sub-phase with its own physics; a policy phase
covers the replay phases ``workload.phase_groups`` gives it (``training`` covers the sub-phases
the policy does not name), gets one decision and reports one observation, as the node agent
sees one window per signalled phase.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal

import numpy as np

from rlenergy.control.freq import base
from rlenergy.gpu import base as gpu_base
from rlenergy.gpu import energy as gpu_energy
from rlenergy.gpu import errors as gpu_errors
from rlenergy.gpu import models
from rlenergy.gpu import simulated as sim_gpu
from rlenergy.sim import workload

Mode = Literal["sync", "async"]
TOKEN_RATE_SIGMA_1S = 0.02
"""Jitter of token throughput over a 1 s slice; it grows as 1/sqrt(slice length) [MODEL]."""
INSTANT_POWER_SAMPLES = 3
"""Instant-power reads the agent averages per probe slice (it samples at about 20 Hz)."""


@dataclasses.dataclass(frozen=True)
class Noise:
    """Noise draws of one step, shared by every run of the same job (paired comparisons)."""

    time: Mapping[str, float]
    power: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Truth and measurement of one simulated step.

    Attributes:
        index: step index.
        time_s: step wall time, s.
        energy_j: true energy over all GPUs, J.
        measured_energy_j: energy from counter deltas over all GPUs, J (None: unknown).
        phase_time_s: per phase wall time, s.
        phase_energy_j: per phase true energy, J.
        clocks_mhz: per phase the locked clock (None: default governor or probe).
        states: per phase the controller state.
        probing: per phase whether the step ran an interleaved probe.
    """

    index: int
    time_s: float
    energy_j: float
    measured_energy_j: float | None
    phase_time_s: Mapping[str, float]
    phase_energy_j: Mapping[str, float]
    clocks_mhz: Mapping[str, int | None]
    states: Mapping[str, str]
    probing: Mapping[str, bool]


@dataclasses.dataclass(frozen=True)
class Totals:
    """Whole-run totals of one policy on one replay."""

    time_s: float
    energy_j: float
    valid_tokens: float
    phase_time_s: Mapping[str, float]
    phase_energy_j: Mapping[str, float]

    @property
    def energy_per_valid_token_j(self) -> float:
        """Energy per valid token, J."""
        return self.energy_j / self.valid_tokens if self.valid_tokens > 0 else math.inf


class Job:
    """A replay bound to a SKU, mode, GPU count and seed.

    Args:
        replay: the steps.
        sku: simulated GPU model.
        mode: ``sync`` or ``async``.
        seed: seed for all noise; the same seed gives the same run.
        num_gpus: GPUs of the job (default: the trace's; async uses at least 2).
        phases: the policy's phase names (default: ``workload.PHASES``); see the module
            docstring.

    Raises:
        ValueError: async mode with more than two phases (finer phases are simulated in sync
            mode only).
    """

    def __init__(
        self,
        replay: workload.Replay,
        sku: models.GpuSku,
        mode: Mode = "sync",
        *,
        seed: int = 0,
        num_gpus: int | None = None,
        phases: Collection[str] | None = None,
    ) -> None:
        self.groups = workload.phase_groups(
            replay.phase_names, workload.PHASES if phases is None else phases
        )
        self.phases: tuple[str, ...] = tuple(self.groups)
        """The phases the policy sees, in step order (keys of ``groups``)."""
        if mode == "async" and len(self.phases) > 2:
            raise ValueError(
                f"async mode runs generation and training pools; phases {list(self.phases)} "
                "(finer phases) are simulated in sync mode only"
            )
        self.replay = replay
        self.sku = sku
        self.mode = mode
        self.seed = seed
        self.trace_gpus = replay.num_gpus
        n = num_gpus or replay.num_gpus
        self.num_gpus = max(n, 2) if mode == "async" else n
        noise = models.catalog().noise
        rng = np.random.default_rng([seed, 7])
        self.power_spread = [
            float(x) for x in rng.normal(1.0, noise.per_gpu_power_spread_frac, self.num_gpus)
        ]
        self._noise = [self._draw(i) for i in range(len(replay.steps))]

    # ----- pools and noise ---------------------------------------------------------------
    def pools(self) -> dict[str, list[int]]:
        """GPU indices per phase."""
        every = list(range(self.num_gpus))
        if self.mode == "sync":
            return {p: every for p in self.phases}
        half = self.num_gpus // 2
        return {p: every[:half] if p == "generation" else every[half:] for p in self.phases}

    def pool_time_scale(self, phase: str) -> float:
        """Phase time multiplier for the pool's size relative to the trace's GPU count [MODEL]."""
        return self.trace_gpus / len(self.pools()[phase])

    def _draw(self, index: int) -> Noise:
        noise = models.catalog().noise
        rng = np.random.default_rng([self.seed, index, 1])
        names = self.replay.phase_names
        t = rng.lognormal(0.0, noise.phase_time_sigma_frac, len(names))
        p = rng.lognormal(0.0, noise.phase_power_sigma_frac, len(names))
        return Noise(
            {ph: float(x) for ph, x in zip(names, t, strict=True)},
            {ph: float(x) for ph, x in zip(names, p, strict=True)},
        )

    # ----- analytic truth ------------------------------------------------------------------
    def phase_truth(
        self,
        step: workload.StepWork,
        phase: str,
        clock_mhz: float | None,
        power_limit_w: float | None = None,
    ) -> tuple[float, float]:
        """(time s, energy J over the pool) of ``phase`` at a fixed lock (None: default).

        ``power_limit_w`` caps the clock as a set power limit does (None: the SKU's default).
        A phase that covers several replay phases (``groups``) sums them.
        """
        noise = self._noise[step.index]
        spread = sum(self.power_spread[g] for g in self.pools()[phase])
        time_s = energy_j = 0.0
        for name in self.groups[phase]:
            pw = step.phase(name)
            f = self.sku.effective_clock_mhz(pw.kind, clock_mhz, power_limit_w)
            t = (
                pw.boost_time_s
                * self.pool_time_scale(phase)
                * self.sku.time_factor(pw.kind, f, step.workload.mean_context_tokens)
                * noise.time[name]
            )
            time_s += t
            energy_j += self.sku.power_w(pw.kind, f) * spread * noise.power[name] * t
        return time_s, energy_j

    def step_truth(
        self,
        step: workload.StepWork,
        clocks_mhz: Mapping[str, float | None],
        power_limit_w: float | None = None,
        *,
        idle_locked: bool = True,
    ) -> tuple[float, float, dict[str, float], dict[str, float]]:
        """(time s, energy J, phase times, phase energies) of a step at fixed clocks.

        ``idle_locked``: the pools idle holding their phase's lock (a static lock such as
        ``nvidia-smi -lgc``); False: unlocked (the node agent resets at the trainer's idle
        signal, ``run_job``'s ``idle_unlocked``).
        """
        times: dict[str, float] = {}
        energies: dict[str, float] = {}
        for phase in self.phases:
            times[phase], energies[phase] = self.phase_truth(
                step, phase, clocks_mhz.get(phase), power_limit_w
            )
        return self._combine(step, times, energies, clocks_mhz if idle_locked else {})

    def _combine(
        self,
        step: workload.StepWork,
        times: dict[str, float],
        energies: dict[str, float],
        locks: Mapping[str, float | None] | None = None,
    ) -> tuple[float, float, dict[str, float], dict[str, float]]:
        """Step time and energy; idle GPUs draw ``idle_power_for`` the lock they hold.

        ``locks``: per phase the clock its pool holds when it idles (sync: all GPUs idle after
        the last phase, holding its lock; None: unlocked).
        """
        locks = locks or {}
        pools = self.pools()
        if self.mode == "sync":
            busy = sum(times.values())
            step_time = busy + step.other_time_s
            idle_w = self.sku.idle_power_for(locks.get(self.phases[-1]))
            idle_j = idle_w * sum(self.power_spread) * step.other_time_s
        else:
            busy = max(times.values())
            step_time = busy + step.other_time_s
            idle_j = sum(
                self.sku.idle_power_for(locks.get(p))
                * sum(self.power_spread[g] for g in pools[p])
                * (step_time - times[p])
                for p in self.phases
            )
        return step_time, sum(energies.values()) + idle_j, times, energies


def _progress(x: float, k: float) -> float:
    """SDK-reported progress at work fraction ``x`` (``workload.reported_progress``)."""
    return workload.reported_progress(x, k)


class _Agent:
    """The node agent's part, simulated: applies clocks idempotently and meters energy."""

    def __init__(self, gpus: Sequence[sim_gpu.SimulatedGpu]) -> None:
        self.gpus = gpus
        self.applied: dict[str, int | None] = {g.uuid: None for g in gpus}

    def apply(self, gpu: sim_gpu.SimulatedGpu, clock_mhz: int | None) -> None:
        if self.applied[gpu.uuid] == clock_mhz:
            return
        if clock_mhz is None:
            gpu.reset_locked_sm_clocks()
        else:
            gpu.set_locked_sm_clocks(clock_mhz, clock_mhz)
        self.applied[gpu.uuid] = clock_mhz

    def reset_all(self) -> None:
        for g in self.gpus:
            try:
                self.apply(g, None)
            except gpu_errors.GpuError:
                self.applied[g.uuid] = None

    @staticmethod
    def read(gpu: sim_gpu.SimulatedGpu) -> int | None:
        try:
            return gpu.total_energy_mj()
        except gpu_errors.GpuError:
            return None


def _window(
    start: Sequence[int | None], end: Sequence[int | None], duration_s: float
) -> float | None:
    total = 0
    for s, e in zip(start, end, strict=True):
        if s is None or e is None:
            return None
        delta = gpu_energy.counter_delta(s, e, duration_s)
        if delta.energy_mj is None:
            return None
        total += delta.energy_mj
    return total / 1000.0


def _slice_energy(pool: Sequence[sim_gpu.SimulatedGpu], dt: float) -> float | None:
    """Energy of a probe slice from instant-power samples (counters are too coarse for slices)."""
    total = 0.0
    for g in pool:
        try:
            samples = [g.instant_power_mw() for _ in range(INSTANT_POWER_SAMPLES)]
        except gpu_errors.GpuError:
            return None
        total += sum(samples) / len(samples) / 1000.0 * dt
    return total


def run_job(
    job: Job,
    policy: base.FrequencyPolicy,
    *,
    on_step: object = None,
    faults: Mapping[int, Sequence[sim_gpu.Fault]] | None = None,
    on_start: Callable[[Sequence[sim_gpu.SimulatedGpu]], None] | None = None,
    idle_unlocked: bool = True,
    idle_lock_mhz: int | None = None,
) -> tuple[list[StepResult], list[sim_gpu.SimulatedGpu]]:
    """Play every step of ``job`` under ``policy``.

    Args:
        job: the job.
        policy: any ``FrequencyPolicy``.
        on_step: optional callable ``(StepResult) -> None`` (progress bars).
        faults: optional faults to inject into every GPU at a step index (an empty list clears).
        on_start: optional callable given the simulated GPUs before the first step (peers
            that drive the GPUs themselves, e.g. a power-limit optimizer, bind to them here).
        idle_unlocked: each pool's GPUs return to the default governor when its work of the
            step ends, as the node agent does at the trainer's idle signal
            (``rlenergy_agent.service.Agent.phase``: an idle phase has no plan entry); False:
            they idle holding the lock (a static lock, ``nvidia-smi -lgc``).
        idle_lock_mhz: with ``idle_unlocked``, lock every GPU at this clock for the step's
            idle gap instead of returning it to the default governor (the gap's GPUs run no
            work here, so no lock delays the next phase's start; the idle power a lock draws
            is the SKU's ``idle_power_for``).

    Returns:
        Per-step results and the simulated GPUs (their clocks are reset at the end).
    """
    sku = job.sku
    gpus = [
        sim_gpu.SimulatedGpu(
            sku,
            f"GPU-sim-{job.seed:04d}-{i:04d}",
            seed=job.seed * 1000 + i,
            power_spread=job.power_spread[i],
        )
        for i in range(job.num_gpus)
    ]
    agent = _Agent(gpus)
    pools = job.pools()
    results: list[StepResult] = []
    if on_start is not None:
        on_start(gpus)
    for step in job.replay.steps:
        if faults and step.index in faults:
            _inject(gpus, faults[step.index])
        plan = policy.decide(step.index)
        t0 = max(g.now_s for g in gpus)
        for g in gpus:
            g.idle(t0)
        noise = job._noise[step.index]
        phase_obs: dict[str, base.PhaseObservation] = {}
        times: dict[str, float] = {}
        energies: dict[str, float] = {}
        measured: list[float | None] = []
        held: dict[str, float | None] = {}
        for phase in job.phases:
            pool = [gpus[i] for i in pools[phase]]
            if job.mode == "sync":
                start = max(g.now_s for g in gpus)
                for g in pool:
                    g.idle(start)
            decision = plan.phases.get(phase) or base.PhaseDecision(None, base.PhaseState.OBSERVE)
            obs, t, e = _run_phase(job, step, phase, pool, agent, decision, noise)
            held[phase] = agent.applied[pool[0].uuid]
            phase_obs[phase] = obs
            times[phase], energies[phase] = t, e
            measured.append(obs.energy_j)
        # The rest of the step: GPUs idle (both pools wait for the slower one in async mode).
        if idle_unlocked:  # the trainer's idle signal: the agent resets each pool's clocks
            for g in gpus:
                try:
                    agent.apply(g, idle_lock_mhz)
                except gpu_errors.GpuError:
                    agent.applied[g.uuid] = None
            held = dict.fromkeys(held, idle_lock_mhz)
        end = max(g.now_s for g in gpus) + step.other_time_s
        idle_start = [_Agent.read(g) for g in gpus]
        idle_t = [end - g.now_s for g in gpus]
        for g in gpus:
            g.idle(end)
        idle_end = [_Agent.read(g) for g in gpus]
        idle_measured = _window(idle_start, idle_end, max(idle_t, default=0.0))
        measured.append(idle_measured)
        step_time, energy, _, _ = job._combine(step, times, energies, held)
        pool_idle: dict[str, base.PoolIdle] = {}
        if job.mode == "async":  # each pool's wait, metered like the agents' idle windows
            pool_idle = _pool_idle(pools, idle_start, idle_end, idle_t)
        policy.observe(base.StepObservation(step.index, step.workload, phase_obs, pool_idle))
        known = [m for m in measured if m is not None]
        result = StepResult(
            index=step.index,
            time_s=step_time,
            energy_j=energy,
            measured_energy_j=sum(known) if len(known) == len(measured) else None,
            phase_time_s=times,
            phase_energy_j=energies,
            clocks_mhz={p: d.clock_mhz for p, d in plan.phases.items()},
            states={p: d.state.value for p, d in plan.phases.items()},
            probing={p: d.probing for p, d in plan.phases.items()},
        )
        results.append(result)
        if callable(on_step):
            on_step(result)
    agent.reset_all()
    return results, gpus


def _inject(gpus: Sequence[sim_gpu.SimulatedGpu], faults: Sequence[sim_gpu.Fault]) -> None:
    """Replace every GPU's faults by ``faults`` (an empty list clears them)."""
    for g in gpus:
        g.clear_faults()
        g.inject(*faults)


def _pool_idle(
    pools: Mapping[str, Sequence[int]],
    idle_start: Sequence[int | None],
    idle_end: Sequence[int | None],
    idle_t: Sequence[float],
) -> dict[str, base.PoolIdle]:
    """Each pool's idle window of a step (its GPUs' meters, idle GPU-s, GPUs)."""
    return {
        phase: base.PoolIdle(
            _window(
                [idle_start[i] for i in members],
                [idle_end[i] for i in members],
                max((idle_t[i] for i in members), default=0.0),
            ),
            sum(idle_t[i] for i in members),
            len(members),
        )
        for phase, members in pools.items()
    }


@dataclasses.dataclass
class _SliceMeter:
    """A window's probe slices as the agent cuts them: time, tokens and energy accumulate.

    Attributes:
        rng: the window's noise (the trainer's token-rate noise per slice).
        slices: the slices emitted so far.
        dt: time of the open slice, s.
        tokens: tokens of the open slice.
        energy_j: energy of the open slice, J (None: a reading failed).
    """

    rng: np.random.Generator
    slices: list[base.ProbeSlice] = dataclasses.field(default_factory=list)
    dt: float = 0.0
    tokens: float = 0.0
    energy_j: float | None = 0.0

    def add(self, dt: float, tokens: float, energy_j: float | None) -> None:
        """Extend the open slice by ``dt`` s, ``tokens`` and ``energy_j`` J."""
        self.tokens += tokens
        self.energy_j = (
            None if energy_j is None or self.energy_j is None else self.energy_j + energy_j
        )
        self.dt += dt

    def emit(self, clock: int | None) -> None:
        """Close the open slice at ``clock`` (tokens with the rate noise of its length)."""
        sigma = min(TOKEN_RATE_SIGMA_1S / math.sqrt(max(self.dt, 1e-3)), 0.2)
        tok = self.tokens * float(self.rng.lognormal(0.0, sigma))
        self.slices.append(base.ProbeSlice(clock, self.dt, tok, self.energy_j))
        self.dt = self.tokens = 0.0
        self.energy_j = 0.0


def _apply_all(
    agent: _Agent, pool: Sequence[sim_gpu.SimulatedGpu], clock: int | None, error: str | None
) -> str | None:
    """Apply ``clock`` to every GPU of ``pool``; the first error (``error`` if already set)."""
    for g in pool:
        try:
            agent.apply(g, clock)
        except gpu_errors.GpuError as exc:
            error = error or f"{type(exc).__name__}: {exc}"
    return error


def _run_phase(
    job: Job,
    step: workload.StepWork,
    phase: str,
    pool: Sequence[sim_gpu.SimulatedGpu],
    agent: _Agent,
    decision: base.PhaseDecision,
    noise: Noise,
) -> tuple[base.PhaseObservation, float, float]:
    """Run one policy phase (its replay phases in order) as the agent runs its window.

    Probe slices are time slices of the window: a slice that a replay phase ends in goes on
    into the next one. The phase's tokens are shared equally among its replay phases (each is
    a pass over the step's tokens, as a forward-token counter reports them).
    """
    sku = job.sku
    error: str | None = None
    schedule: tuple[int | None, ...] = decision.probe_clocks_mhz or (decision.clock_mhz,)
    probing = bool(decision.probe_clocks_mhz)
    slice_s = decision.probe_slice_s if probing else math.inf
    fine = job.groups[phase]
    tokens_share = step.workload.phase_tokens(phase) / len(fine)
    rng = np.random.default_rng([job.seed, step.index, 2, job.phases.index(phase)])
    start_counters = [_Agent.read(g) for g in pool]
    t_start = pool[0].now_s
    k = 0
    true_j = 0.0
    acc = _SliceMeter(rng)
    applied: list[int] = []
    slowdown = False
    left = slice_s
    clock = schedule[0]
    for name in fine:
        pw = step.phase(name)
        boost = pw.boost_time_s * job.pool_time_scale(phase) * noise.time[name]
        x = 0.0
        while boost > 0 and x < 1.0 - 1e-12:
            clock = schedule[k % len(schedule)]
            error = _apply_all(agent, pool, clock, error)
            f_eff = pool[0].effective_clock_mhz(pw.kind)
            duration_full = boost * sku.time_factor(
                pw.kind, f_eff, step.workload.mean_context_tokens
            )
            dt = min(left, (1.0 - x) * duration_full)
            dx = dt / duration_full
            for g in pool:
                true_j += g.execute(pw.kind, dt, noise.power[name])
            if probing:
                acc.add(
                    dt,
                    tokens_share
                    * (_progress(x + dx, pw.progress_shape) - _progress(x, pw.progress_shape)),
                    _slice_energy(pool, dt),
                )
            try:
                applied.append(min(g.sm_clock_mhz() for g in pool))
                slowdown = slowdown or any(
                    g.clock_event_reasons() & gpu_base.SLOWDOWN_REASONS for g in pool
                )
            except gpu_errors.GpuError as exc:
                error = error or f"{type(exc).__name__}: {exc}"
            x += dx
            left -= dt
            if left <= 0.0:
                if probing:
                    acc.emit(clock)
                k += 1
                left = slice_s
    if probing and acc.dt > 0.0:
        acc.emit(clock)
    duration = pool[0].now_s - t_start
    end_counters = [_Agent.read(g) for g in pool]
    energy = _window(start_counters, end_counters, duration)
    obs = base.PhaseObservation(
        phase=phase,
        duration_s=duration,
        energy_j=energy,
        requested_clock_mhz=decision.clock_mhz,
        applied_clock_mhz=min(applied) if applied else None,
        slowdown=slowdown,
        slices=tuple(acc.slices),
        error=error,
    )
    return obs, duration, true_j


def totals(job: Job, results: Sequence[StepResult]) -> Totals:
    """Sum a run's truth."""
    valid = sum(s.workload.valid_tokens for s in job.replay.steps)
    return Totals(
        time_s=sum(r.time_s for r in results),
        energy_j=sum(r.energy_j for r in results),
        valid_tokens=valid,
        phase_time_s={p: sum(r.phase_time_s[p] for r in results) for p in job.phases},
        phase_energy_j={p: sum(r.phase_energy_j[p] for r in results) for p in job.phases},
    )


def fixed_run(
    job: Job,
    clocks_mhz: Mapping[str, float | None],
    power_limit_w: float | None = None,
    *,
    idle_locked: bool = True,
) -> Totals:
    """Totals of the whole job at fixed clocks per phase (None: default governor), analytically.

    ``power_limit_w``: a power limit held over the whole run (None: the SKU's default limit).
    ``idle_locked``: the locks are held while the GPUs idle (a static lock); False: the agent's
    per-phase locks, released at the trainer's idle signal (``Job.step_truth``).
    """
    t_sum = e_sum = 0.0
    pt = {p: 0.0 for p in job.phases}
    pe = {p: 0.0 for p in job.phases}
    for step in job.replay.steps:
        t, e, times, energies = job.step_truth(
            step, clocks_mhz, power_limit_w, idle_locked=idle_locked
        )
        t_sum += t
        e_sum += e
        for p in job.phases:
            pt[p] += times[p]
            pe[p] += energies[p]
    valid = sum(s.workload.valid_tokens for s in job.replay.steps)
    return Totals(t_sum, e_sum, valid, pt, pe)


def default_run(job: Job) -> Totals:
    """The default governor on every phase."""
    return fixed_run(job, {})


@dataclasses.dataclass(frozen=True)
class Oracle:
    """Best fixed clock per phase in hindsight meeting the threshold."""

    clocks_mhz: Mapping[str, int | None]
    totals: Totals


def oracle(
    job: Job,
    thresholds: Mapping[str, float],
    candidates_mhz: Mapping[str, Sequence[int]] | None = None,
    *,
    idle_locked: bool = False,
) -> Oracle:
    """Search fixed clocks per phase on the truth of this job.

    Sync: each phase independently, the lowest-energy clock whose whole-run phase throughput
    ratio vs default is >= its threshold. Async: every pair of clocks, the lowest-energy pair
    whose end-to-end throughput ratio is >= the lowest threshold. Clocks: every supported clock
    from max down to half of max (or ``candidates_mhz``), plus the default governor.
    ``idle_locked``: the clocks are held while the GPUs idle (static locks); default: released
    at the trainer's idle signal, as the node agent applies per-phase clocks (``run_job``).
    """
    return oracles(job, (thresholds,), candidates_mhz, idle_locked=idle_locked)[0]


def oracles(
    job: Job,
    threshold_sets: Sequence[Mapping[str, float]],
    candidates_mhz: Mapping[str, Sequence[int]] | None = None,
    *,
    idle_locked: bool = False,
) -> list[Oracle]:
    """``oracle`` for each of ``threshold_sets``, in order, on one table of the job's truth.

    The truth of every phase at every clock and step is what the search costs; it is computed
    once and each threshold set only picks from it.
    """
    steps = job.replay.steps
    sku = job.sku
    top = sku.max_sm_clock_mhz
    grid = {
        p: [None, *[c for c in sku.supported_sm_clocks_mhz() if c >= top / 2]] for p in job.phases
    }
    if candidates_mhz:
        for p, cands in candidates_mhz.items():
            grid[p] = [None, *cands]
    # per phase: matrix [clock, step] of time and energy
    tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for p in job.phases:
        t = np.empty((len(grid[p]), len(steps)))
        e = np.empty_like(t)
        for i, c in enumerate(grid[p]):
            for j, s in enumerate(steps):
                t[i, j], e[i, j] = job.phase_truth(s, p, c)
        tables[p] = (t, e)
    other = np.array([s.other_time_s for s in steps])
    if job.mode == "sync":
        # Per phase: whole-run ratio and energy at every clock.
        ratios: dict[str, np.ndarray] = {}
        energies: dict[str, np.ndarray] = {}
        for p in job.phases:
            t, e = tables[p]
            ratios[p] = t[0].sum() / t.sum(axis=1)
            energies[p] = e.sum(axis=1)
            if p == job.phases[-1] and idle_locked:
                # The last phase's lock is held while the GPUs idle (idle_power_for).
                idle = np.array([sku.idle_power_for(c) for c in grid[p]])
                energies[p] = energies[p] + idle * sum(job.power_spread) * other.sum()
    else:
        (tg, eg), (tt, et) = tables["generation"], tables["training"]
        pools = job.pools()
        sg = sum(job.power_spread[g] for g in pools["generation"])
        st = sum(job.power_spread[g] for g in pools["training"])
        busy = np.maximum(tg[:, None, :], tt[None, :, :])
        step_t = busy + other
        held = {p: grid[p] if idle_locked else [None] * len(grid[p]) for p in job.phases}
        iw_g = np.array([sku.idle_power_for(c) for c in held["generation"]])[:, None, None]
        iw_t = np.array([sku.idle_power_for(c) for c in held["training"]])[None, :, None]
        idle = iw_g * sg * (step_t - tg[:, None, :]) + iw_t * st * (step_t - tt[None, :, :])
        pair_energy = (eg[:, None, :] + et[None, :, :] + idle).sum(axis=2)
        total_t = step_t.sum(axis=2)
        pair_ratio = total_t[0, 0] / total_t
    out: list[Oracle] = []
    for thresholds in threshold_sets:
        chosen: dict[str, int | None] = {}
        if job.mode == "sync":
            for p in job.phases:
                ok = ratios[p] >= thresholds.get(p, 0.95) - 1e-12
                chosen[p] = grid[p][int(np.argmin(np.where(ok, energies[p], np.inf)))]
        else:
            ok = pair_ratio >= min(thresholds.values(), default=0.95) - 1e-12
            flat = int(np.argmin(np.where(ok, pair_energy, np.inf)))
            i, j = divmod(flat, pair_energy.shape[1])
            chosen = {"generation": grid["generation"][i], "training": grid["training"][j]}
        out.append(Oracle(chosen, fixed_run(job, chosen, idle_locked=idle_locked)))
    return out
