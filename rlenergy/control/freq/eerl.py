"""EE-RL: online per-phase SM clock selection for RL post-training (arXiv 2611.05748).

DESIGN section 4 defines the algorithm; this module implements it with one change that the
measurements asked for (see ``probe``):

1. Candidates: about 7 supported clocks between max and half of max, or from the policy.
2. Warm-up: ``warmup_steps`` under the default governor fit the default-governor model of time
   and energy over the step's tokens (``predictor.DefaultModel``); it predicts the default cost
   of any later step for status and for the async slack below.
3. Trials: a trial step runs the phase as interleaved slices of up to three candidates
   against the default governor on the same tokens, in Thue-Morse blocks (``probe``); a
   phase too short to slice (under ``8 x MIN_SLICE_S``) alternates whole steps instead; per-clock throughput and energy-per-token
   ratios accumulate over blocks. A candidate is accepted when the lower confidence bound of
   its throughput ratio clears ``minThroughputRatio``, rejected when the upper bound misses it;
   a rejected clock rejects every lower candidate (throughput falls with the clock). Probing
   bisects the unresolved candidates, then refines between the lowest accepted and the highest
   rejected clock by interpolating ``1/ratio`` linearly in ``1/f`` (exact for the phase model
   ``t = t0((1-m) f0/f + m)``), and locks the accepted clock with the lowest energy per token.
4. Monitor: a locked phase runs a short in-phase check every ``monitor_interval_steps``; it
   re-trials when the check's upper bound misses the threshold, when the workload drifts past
   ``drift_threshold`` (relative change of mean context length for generation, of tokens per
   sample for training), or when new clock-event reasons (power, thermal) appear.
5. Safety: an error in a phase's observation returns it to the default governor (FALLBACK);
   after ``recovery_steps`` clean steps it trials again.

Async mode (pools run at once; a step takes as long as the slower pool): a phase's threshold
is relaxed to ``min(t, t * T_phase / T_step + slack)`` from the default model's predicted pool
times, so the faster pool slows into the slack instead of idling.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from rlenergy.api import workload as api_workload
from rlenergy.control.freq import base, predictor, probe

INDIFFERENCE = 0.004
"""Half-width of a confidence interval below which a straddling candidate is decided by its
mean (a 0.4 % throughput difference is below what a user can see) [heuristic]."""
MIN_SLICE_S = 0.1
"""Shortest in-phase probe slice, s: a few decode iterations, so token counts mean something."""
ASYNC_SLACK = 0.05
"""Extra throughput margin kept on the non-bottleneck pool in async mode [heuristic]:
per-step noise makes max(pool times) exceed both means."""


@dataclasses.dataclass(frozen=True)
class PhaseSettings:
    """One phase's selection settings.

    Attributes:
        name: phase name (``generation``, ``training`` or custom).
        min_throughput_ratio: accepted candidates keep at least this share of the default
            governor's throughput, in (0, 1].
        candidates_mhz: candidate clocks, descending, each supported.
        supported_mhz: all supported clocks (refinement picks among them).
        max_clock_mhz: the GPU's max clock (the default governor's reference).
    """

    name: str
    min_throughput_ratio: float
    candidates_mhz: tuple[int, ...]
    supported_mhz: tuple[int, ...]
    max_clock_mhz: int


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
    """Job-level controller settings (CRD ``spec.controller``).

    Attributes:
        enforce: False = observe mode: never touch clocks, only measure.
        warmup_steps: default-governor steps before the first trial.
        trial_steps: most trial steps per phase per selection round.
        drift_threshold: relative workload change that forces a re-trial.
        max_trial_fraction: share of steps that may run trials (over at least 40 steps).
        confidence_z: z-score of the confidence bounds on throughput ratios.
        monitor_interval_steps: steps between monitor checks of a locked clock.
        slices_per_phase: target slices per probed phase.
        min_blocks: probe blocks before a candidate can be decided.
        async_mode: pools run concurrently (see module docstring).
        recovery_steps: clean steps after an error before trialling again.
    """

    enforce: bool = True
    warmup_steps: int = 2
    trial_steps: int = 8
    drift_threshold: float = 0.25
    max_trial_fraction: float = 0.25
    confidence_z: float = 2.0
    monitor_interval_steps: int = 10
    slices_per_phase: int = 48
    min_blocks: int = 3
    async_mode: bool = False
    recovery_steps: int = 2


def _drift_feature(phase: str, workload: api_workload.TokenWorkload) -> float:
    if phase == "generation":
        return workload.mean_context_tokens
    return workload.phase_tokens(phase) / max(workload.samples, 1)


class PhaseController:
    """Clock selection for one phase (see module docstring)."""

    def __init__(self, settings: PhaseSettings, ctl: ControllerSettings) -> None:
        self.settings = settings
        self.ctl = ctl
        self.state = base.PhaseState.WARMUP if ctl.enforce else base.PhaseState.OBSERVE
        self.default_model = predictor.DefaultModel()
        self.locked_clock_mhz: int | None = None
        self.threshold = settings.min_throughput_ratio
        self.selections = 0
        self.retrial_reasons: list[str] = []
        self._warm = 0
        self._last_time_s = 0.0
        self._new_round()
        self._lock_feature = 0.0
        self._lock_slowdown = False
        self._slowdowns = 0
        self._monitor = probe.RatioStats()
        self._since_lock = 0
        self._clean = 0

    # ----- state helpers ---------------------------------------------------------------------
    def _new_round(self) -> None:
        self.stats: dict[int, probe.RatioStats] = {}
        self.accepted: set[int] = set()
        self.rejected: set[int] = set()
        self.candidates: list[int] = list(self.settings.candidates_mhz)
        self._round_steps = 0.0
        self._refinements = 0
        self._step_probe: list[int | None] = []
        self._step_probe_clock: int | None = None
        self._pending: list[base.ProbeSlice] = []

    def _retrial(self, reason: str) -> None:
        self.retrial_reasons.append(reason)
        self.state = base.PhaseState.TRIAL
        self._new_round()

    def _unresolved(self) -> list[int]:
        floor = max(self.rejected, default=0)
        return [c for c in self.candidates if c > floor and c not in self.accepted and c not in self.rejected]

    def _bounds(self, stats: probe.RatioStats) -> tuple[float, float]:
        half = self.ctl.confidence_z * stats.stderr
        return stats.throughput_mean - half, stats.throughput_mean + half

    # ----- decide ------------------------------------------------------------------------
    def _slices_in_phase(self) -> int:
        """Probe slices that fit in the phase (a multiple of the block length; 0: too short)."""
        fit = int(self._last_time_s / MIN_SLICE_S)
        n = min(self.ctl.slices_per_phase, fit)
        return n - n % probe.BLOCK

    def decide(self, allow_probe: bool) -> base.PhaseDecision:
        """Decision for the next step; ``allow_probe`` is False when the trial budget is spent."""
        state = self.state
        if state in (base.PhaseState.OBSERVE, base.PhaseState.WARMUP, base.PhaseState.FALLBACK):
            return base.PhaseDecision(None, state, reason=state.value)
        n_slices = self._slices_in_phase()
        slice_s = self._last_time_s / n_slices if n_slices else 0.0
        if state is base.PhaseState.TRIAL:
            if self._step_probe:
                # Whole-step slices: finish the current block before anything else.
                clock = self._step_probe[0]
                return base.PhaseDecision(clock, state, reason=f"step trial {self._step_probe_clock} MHz")
            active = self._pick_active(max(n_slices // probe.BLOCK, 1))
            if not allow_probe or not active:
                return base.PhaseDecision(None, state, reason="trial budget spent: default governor")
            if n_slices == 0:
                self._step_probe_clock = active[0]
                self._step_probe = list(probe.block_schedule(active[:1]))
                return base.PhaseDecision(self._step_probe[0], state, reason=f"step trial {active[0]} MHz")
            return base.PhaseDecision(
                None,
                state,
                probe_clocks_mhz=probe.block_schedule(active),
                probe_slice_s=slice_s,
                reason=f"trial {', '.join(map(str, active))} MHz vs default",
            )
        clock = self.locked_clock_mhz
        due = self._since_lock > 0 and self._since_lock % self.ctl.monitor_interval_steps == 0
        if clock is not None and allow_probe and due and n_slices:
            return base.PhaseDecision(
                clock,
                state,
                probe_clocks_mhz=probe.block_schedule([clock]) + (clock,) * probe.BLOCK,
                probe_slice_s=slice_s,
                reason=f"monitor {clock} MHz",
            )
        return base.PhaseDecision(clock, state, reason="locked" if clock else "no clock met the threshold")

    def _pick_active(self, most: int) -> list[int]:
        unresolved = self._unresolved()
        most = min(most, 3)
        if len(unresolved) <= most:
            return unresolved
        # Parallel bisection: spread the probes over the unresolved interval.
        if most == 1:
            return [unresolved[len(unresolved) // 2]]
        idx = sorted({round(i * (len(unresolved) - 1) / (most - 1)) for i in range(most)})
        return [unresolved[i] for i in idx]

    # ----- observe -----------------------------------------------------------------------
    def observe(self, obs: base.PhaseObservation, workload: api_workload.TokenWorkload) -> None:
        """Feed one phase window of one step."""
        if obs.error is not None:
            if self.state is not base.PhaseState.OBSERVE:
                self.state = base.PhaseState.FALLBACK
                self.retrial_reasons.append(f"error: {obs.error}")
            self._clean = 0
            return
        self._last_time_s = obs.duration_s
        tokens = workload.phase_tokens(self.settings.name)
        if obs.requested_clock_mhz is None and not obs.slices:
            self.default_model.add(tokens, obs.duration_s, obs.energy_j)
        if obs.slices:
            blocks, _ = probe.blocks_from_slices(obs.slices)
        elif self.state is base.PhaseState.TRIAL and self._step_probe:
            # Whole-step probe: this phase is one slice of a block spanning steps.
            self._step_probe.pop(0)
            self._pending.append(base.ProbeSlice(obs.requested_clock_mhz, 1.0, tokens / obs.duration_s if obs.duration_s > 0 else 0.0, None if obs.energy_j is None else obs.energy_j / max(obs.duration_s, 1e-9)))
            blocks, used = probe.blocks_from_slices(self._pending)
            del self._pending[:used]
        else:
            blocks = []
        if self.state is base.PhaseState.FALLBACK:
            self._clean += 1
            if self._clean >= self.ctl.recovery_steps:
                self._retrial("recovered from error")
            return
        if self.state is base.PhaseState.WARMUP:
            self._warm += 1
            if self._warm >= self.ctl.warmup_steps and self.default_model.ready:
                self._retrial("warm-up done")
            return
        if self.state is base.PhaseState.TRIAL:
            for clock, thr, power in blocks:
                self.stats.setdefault(clock, probe.RatioStats()).add(thr, power)
            if obs.slices:
                self._round_steps += 1
            elif obs.requested_clock_mhz is not None or self._pending:
                self._round_steps += 1 / probe.BLOCK
            self._resolve()
            if not self._unresolved() and not self._refine() or self._round_steps >= self.ctl.trial_steps:
                self._lock(workload, obs)
            return
        if self.state is base.PhaseState.LOCKED:
            self._since_lock += 1
            for clock, thr, power in blocks:
                if clock == self.locked_clock_mhz:
                    self._monitor.add(thr, power)
            self._check_locked(obs, workload)

    def _resolve(self) -> None:
        for clock in self._unresolved():
            stats = self.stats.get(clock)
            if stats is None or stats.n < self.ctl.min_blocks:
                continue
            lcb, ucb = self._bounds(stats)
            if lcb >= self.threshold:
                self.accepted.add(clock)
            elif ucb < self.threshold:
                self.rejected.add(clock)
            elif ucb - lcb <= 2 * INDIFFERENCE:
                # Precise enough and still straddling: decide by the mean, keeping a margin.
                if stats.throughput_mean >= self.threshold + INDIFFERENCE / 2:
                    self.accepted.add(clock)
                else:
                    self.rejected.add(clock)

    def _refine(self) -> bool:
        """Add one clock between the lowest accepted and highest rejected; False if none."""
        if self._refinements >= 2 or not self.rejected:
            return False
        hi_rej = max(self.rejected)
        above = [c for c in self.accepted if c > hi_rej]
        top = self.settings.max_clock_mhz
        f_a, r_a = (min(above), self.stats[min(above)].throughput_mean) if above else (top, 1.0)
        r_b = self.stats[hi_rej].throughput_mean if hi_rej in self.stats else None
        if r_b is None or r_b >= r_a:
            return False
        # 1/r is linear in 1/f under t = t0 ((1 - m) f0 / f + m).
        x_a, x_b = 1.0 / f_a, 1.0 / hi_rej
        y_a, y_b = 1.0 / r_a, 1.0 / r_b
        target = 1.0 / (self.threshold + self.ctl.confidence_z * 0.004)
        if not y_a < target < y_b:
            return False
        x = x_a + (target - y_a) * (x_b - x_a) / (y_b - y_a)
        f_star = 1.0 / x
        between = sorted(c for c in self.settings.supported_mhz if hi_rej < c < f_a and c >= f_star)
        if not between or between[0] in self.candidates:
            return False
        self.candidates.append(between[0])
        self.candidates.sort(reverse=True)
        self._refinements += 1
        return True

    def _lock(self, workload: api_workload.TokenWorkload, obs: base.PhaseObservation) -> None:
        best: int | None = None
        best_e = math.inf
        for clock in sorted(self.accepted):
            e = self.stats[clock].energy_per_token_ratio
            score = e if e is not None else clock / 1e6  # unknown energy: prefer lower clocks
            if score < best_e:
                best, best_e = clock, score
        self.locked_clock_mhz = best
        self.state = base.PhaseState.LOCKED
        self.selections += 1
        self._lock_feature = _drift_feature(self.settings.name, workload)
        self._lock_slowdown = obs.slowdown
        self._slowdowns = 0
        self._monitor = probe.RatioStats()
        self._since_lock = 0

    def _check_locked(self, obs: base.PhaseObservation, workload: api_workload.TokenWorkload) -> None:
        mon = self._monitor
        if mon.n >= self.ctl.min_blocks and self._bounds(mon)[1] < self.threshold:
            self._retrial(f"throughput ratio {mon.throughput_mean:.3f} below {self.threshold:.3f}")
            return
        feature = _drift_feature(self.settings.name, workload)
        if self._lock_feature > 0 and abs(feature / self._lock_feature - 1.0) > self.ctl.drift_threshold:
            self._retrial(f"workload drift {feature / self._lock_feature - 1.0:+.0%}")
            return
        if obs.slowdown and not self._lock_slowdown and self.locked_clock_mhz is not None:
            self._slowdowns += 1
            if self._slowdowns >= 2:
                self._retrial("clock-event reasons (power or thermal slowdown)")
        else:
            self._slowdowns = 0

    # ----- reporting ---------------------------------------------------------------------
    def estimate(self) -> tuple[float | None, float | None]:
        """(throughput ratio, energy-per-token ratio) of the locked clock vs default, if known."""
        clock = self.locked_clock_mhz
        if clock is None:
            return (1.0, 1.0) if self.state is base.PhaseState.LOCKED else (None, None)
        stats = self._monitor if self._monitor.n >= self.ctl.min_blocks else self.stats.get(clock)
        if stats is None or stats.n == 0:
            return None, None
        return stats.throughput_mean, stats.energy_per_token_ratio


class EERLController:
    """Job-level EE-RL controller over all phases; satisfies ``base.FrequencyPolicy``."""

    def __init__(self, phases: Sequence[PhaseSettings], settings: ControllerSettings | None = None) -> None:
        self.settings = settings or ControllerSettings()
        self.phases: dict[str, PhaseController] = {
            p.name: PhaseController(p, self.settings) for p in phases
        }
        self.trial_steps = 0
        self.steps_seen = 0
        self._last_workload: api_workload.TokenWorkload | None = None

    def _trial_budget_left(self, step: int) -> bool:
        horizon = max(step + 1, 40)
        return self.trial_steps + 1 <= self.settings.max_trial_fraction * horizon

    def decide(self, step: int) -> base.Plan:
        """Plan for ``step`` (see ``base.FrequencyPolicy``)."""
        if self.settings.async_mode:
            self._update_async_thresholds()
        allow = self._trial_budget_left(step)
        decisions = {name: pc.decide(allow) for name, pc in self.phases.items()}
        if any(
            d.probe_clocks_mhz or (d.state is base.PhaseState.TRIAL and d.clock_mhz is not None)
            for d in decisions.values()
        ):
            self.trial_steps += 1
        return base.Plan(step, decisions)

    def observe(self, observation: base.StepObservation) -> None:
        """Feed a step's measurements to every phase."""
        self.steps_seen += 1
        for name, pc in self.phases.items():
            obs = observation.phases.get(name)
            if obs is None:
                pc.observe(
                    base.PhaseObservation(name, 0.0, None, None, error="no measurement (lost signal)"),
                    observation.workload,
                )
            else:
                pc.observe(obs, observation.workload)
        self._last_workload = observation.workload

    def report_error(self, phase: str, message: str) -> None:
        """An agent-side error outside a step's observation: that phase falls back to default."""
        pc = self.phases[phase]
        pc.observe(base.PhaseObservation(phase, 0.0, None, None, error=message), self._last_workload or _EMPTY)

    def _update_async_thresholds(self) -> None:
        wl = self._last_workload
        if wl is None or not all(pc.default_model.ready for pc in self.phases.values()):
            return
        times = {
            name: pc.default_model.time_fit()(wl.phase_tokens(name)) for name, pc in self.phases.items()
        }
        step_time = max(times.values())
        if step_time <= 0:
            return
        for name, pc in self.phases.items():
            if pc.state is base.PhaseState.TRIAL and pc._round_steps == 0:
                base_t = pc.settings.min_throughput_ratio
                pc.threshold = min(base_t, base_t * times[name] / step_time + ASYNC_SLACK)

    def summary(self) -> Mapping[str, Mapping[str, object]]:
        """Per phase: state, clock, threshold, estimated ratios, selections, re-trial reasons."""
        out: dict[str, Mapping[str, object]] = {}
        for name, pc in self.phases.items():
            thr, energy = pc.estimate()
            out[name] = {
                "state": pc.state.value,
                "clock_mhz": pc.locked_clock_mhz,
                "threshold": pc.threshold,
                "estimated_throughput_ratio": thr,
                "estimated_energy_ratio": energy,
                "selections": pc.selections,
                "retrials": list(pc.retrial_reasons),
            }
        return out


_EMPTY = api_workload.TokenWorkload(0, 0.0, 0.0, 0.0, 0.0)
