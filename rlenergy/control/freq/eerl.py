"""EE-RL: online per-phase SM clock selection for RL post-training (arXiv 2611.05748).

The definitions are the project's own (the paper's full text was not at hand): candidates, a
default-governor model fitted on warm-up steps over the step's tokens, trials against the
default governor on the same tokens, a throughput threshold per phase, monitor and re-select,
default governor on error; trials measure inside a phase, because measurements asked for it:

1. Candidates: about 7 supported clocks between max and half of max, or from the policy.
2. Warm-up: ``warmup_steps`` under the default governor fit ``predictor.DefaultModel`` (time
   and energy over tokens) and read back the clock the default governor runs each phase at.
3. Trials compare a candidate with the default governor inside the same phase (``probe``):
   interleaved slices in Thue-Morse blocks give paired throughput and power ratios whose
   workload noise cancels. On the shipped verl traces a step's phase time varies 2-11 % around
   any token-based prediction, more than the 3-5 % effect a 0.95 threshold must resolve, so a
   step-level comparison cannot decide; the paired one can. A phase too short to slice (under
   ``8 x MIN_SLICE_S``) alternates whole steps instead.
4. Selection is model based: every block feeds a least-squares fit of the phase clock model
   (``probe.PhaseModelFit``), so blocks at low clocks (long lever arm) sharpen the prediction
   at every clock. Before a lock, blocks halfway between the lever and the choice test the
   model's shape (``_model_check_clock``); where a probed clock misses the model by
   ``probe.MISFIT_Z`` standard errors (a step, knee or plateau the model cannot follow), the fit
   is corrected by each probed clock's own mean (``probe.CorrectedFit``) and a bracketing
   search over the supported clocks takes over (``_search_clock``): each probe decides one
   clock against the threshold directly, and the round locks once the bracket has closed.
   The lock is the allowed clock with the lowest predicted energy per token whose lower
   confidence bound (Student's t) meets ``minThroughputRatio``. A clock whose own
   blocks clearly miss the threshold raises a floor; the floor bars it from the lock but not
   from probing: the lever-arm clock stays the lowest candidate predicted at or above
   ``PROBE_MIN_RATIO``. Trials stop when the choice is precise (``INDIFFERENCE``) or after
   ``trial_steps`` (up to 3x while the confidence margin still costs more than ``INFO_GAIN``
   of energy per token). Both step counts are scaled by ``PhaseController.evidence_scale``: a
   phase too short for ``slices_per_phase`` slices gets proportionally less probe time per
   step, so it needs more steps for the same evidence (the job's trial budget,
   ``max_trial_fraction`` of the steps, still bounds them).
5. Monitor: a locked phase runs a short in-phase check every ``monitor_interval_steps``
   (``SETTLED_MONITOR_FACTOR`` times as far apart once the lock's own monitor blocks prove it
   with room to spare, ``PhaseController._settled``); its
   blocks refine the fit (the lock may move down once proven), a check whose upper bound
   misses the threshold steps the lock up at once, a workload drift past ``drift_threshold``
   beyond the range the lock's trial steps spanned (mean context length for generation,
   tokens per sample for training; ``PhaseController._drift``) or new clock-event
   reasons (power, thermal) start a new trial. While the point estimate allows a clock that
   saves ``MONITOR_GAIN`` more than the lock, checks come twice as often and are mostly
   lever-arm blocks, so the lock keeps stepping down as the evidence accumulates; not while
   the run owes its threshold throughput (``repay_ratio``): lever-arm slices cost it.
6. Safety: an error in a phase's observation returns it to the default governor (FALLBACK);
   after ``recovery_steps`` clean steps it trials again.

Trial cost counts in every reported figure: probe slices run at the candidate clocks.

Each phase's selection is in one stage (``PhaseController.stage``, one class per
``base.PhaseState``: ``Observe``, ``Warmup``, ``Trial``, ``Locked``, ``Fallback``), and each stage
holds the fields only it uses. What outlives a stage stays on the ``PhaseController``: the
round's evidence (probe blocks and their fit, which a lock keeps refining), the newest lock's
clock and monitor blocks (reported, and pooled for windows at that clock), the run ledger, the
floor and the threshold.

Async mode (pools run at once; a step takes as long as the slower pool): the bottleneck pool
keeps its threshold plus a margin, and the other pools relax to the slack the joint history of
pool times shows (``EERLController._update_async_thresholds``). A relaxed pool's slowdown fills
time it would idle, so its clocks are scored with that idle's energy taken off
(``PhaseController.idle_credit``, from the pools' measured idle, ``StepObservation.pool_idle``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import ClassVar, NamedTuple

from rlenergy.api import workload as api_workload
from rlenergy.control.freq import base, predictor, probe

INDIFFERENCE = 0.004
"""Half-width of a confidence interval below which a straddling candidate is decided by its
mean (a 0.4 % throughput difference is below what a user can see) [heuristic]."""
MIN_SLICE_S = 0.025
"""Shortest in-phase probe slice, s: a few decode iterations of a small model; the agent
switches clocks in about 3 ms (bench/agent.py), well inside a slice."""
LOCK_MARGIN = 0.002
"""Throughput margin on a lock above the threshold: trial slices at low clocks cost some
throughput, and the threshold holds for the whole run, trials included [heuristic]."""
PROBE_MIN_RATIO = 0.85
"""Lowest predicted throughput ratio of a probe clock: the lever arm of the fit stays at the
lowest candidate that costs at most this much during its slices [heuristic]."""
CARRY_BLOCKS = 12
"""Probe blocks a drift re-trial keeps from the previous round [heuristic]."""
INFO_GAIN = 0.01
"""Keep trialling (up to 3 x trialSteps) while the confidence margin costs more than this share
of energy per token [heuristic]."""
MAX_EVIDENCE_SCALE = 3.0
"""Most a short phase's trial round, in steps, is scaled up [heuristic]."""
MONITOR_GAIN = 0.005
"""A locked phase keeps probing its lever-arm clock while the point estimate allows a clock
that would save at least this share of energy per token more than the lock [heuristic]."""
ASYNC_MIN_HISTORY = 8
"""Plain steps of pool-time history before a pool's threshold is relaxed: the max of two
pools depends on their joint spread, which two warm-up steps cannot show [heuristic]."""
SLICE_PER_PROGRESS_GAP = 4.0
"""Shortest probe slice in gaps between the trainer's progress reports: a slice's rate comes
from the reports inside it (``rlenergy_agent.probes.slice_progress``; a report interval that
straddles a switch mixes two clocks), so a slice must span enough report gaps (the mean report
interval of the phase's newest window; one late report does not disqualify a phase) for at
least two reports to fall inside it when the gaps vary: four [heuristic; at two, a full-stack
run with 16 ms median trainer ticks read training slices through the interpolated fallback
and locked a clock whose true ratio was 0.933 against 0.97]. Without reports
(``PhaseObservation.progress_gap_s`` infinite) no slice can be resolved and trials alternate
whole steps (whole-phase evidence)."""
REPAY_HORIZON = 1.0
"""Future phase time, as a multiple of the phase time so far (at least ``REPAY_MIN_WINDOWS``
mean windows), over which a lock repays the run's throughput deficit (trial and monitor slices
below the threshold): the lock target is the ratio that brings the phase's whole-run ratio back
to its threshold by then [heuristic; 1.0: by twice the time run so far, inside the bench's 200
steps where trials end by step 60-100]."""
TRIAL_BUDGET_MIN_STEPS = 40
"""Shortest horizon, in steps, over which ``max_trial_fraction`` budgets trial steps
(``EERLController._trial_budget_left``): early in a run the budget is a fraction of this, not of
the few steps seen [heuristic]."""
REPAY_MIN_WINDOWS = TRIAL_BUDGET_MIN_STEPS
"""Shortest repayment horizon, in mean phase windows: the trial budget's own horizon
(``TRIAL_BUDGET_MIN_STEPS``) [heuristic]."""
ASYNC_SLACK = 0.05
"""Extra throughput margin kept on the non-bottleneck pool in async mode [heuristic]:
per-step noise makes max(pool times) exceed both means."""
MEASURED_Z = 2.0
"""A locked window's default counterfactual takes the paired blocks measured at its clock over
the fit once their mean is this many standard errors off it [heuristic]."""
STATUS_Z = 2.0
"""Standard errors on either side of a locked window's ratios in the bounds of its default
counterfactual (``PhaseController.default_equivalent_range``) [heuristic: about 95 % where the
blocks are normal]."""
SETTLED_MIN_BLOCKS = 12
"""Monitor blocks at a lock before its checks may be spaced out (``_settled``): four times
``min_blocks`` [heuristic]."""
SETTLED_MONITOR_FACTOR = 4
"""How much wider monitor checks are spaced once a lock is settled (``_settled``): on
1,000-step runs the checks' default-governor slices were the largest part of the learning cost
(``report.learning_cost``, probes 0.16-1.30 points of the job's energy) [heuristic]."""


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
        allowed_mhz: clocks the selection may lock, descending (explicit candidates only, the
            supported clocks in the policy's range, or every supported clock down to the lowest
            candidate).
    """

    name: str
    min_throughput_ratio: float
    candidates_mhz: tuple[int, ...]
    supported_mhz: tuple[int, ...]
    max_clock_mhz: int
    allowed_mhz: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.allowed_mhz:
            lowest = min(self.candidates_mhz, default=self.max_clock_mhz)
            allowed = tuple(c for c in self.supported_mhz if c >= lowest)
            object.__setattr__(self, "allowed_mhz", allowed)


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
        in_phase_probes: False when phase signals arrive as pod annotations
            (``phaseSource: annotation``): a signal takes an API round trip and a watch
            (tens of ms, ``docs/agent.md``) and no in-phase progress comes with it, so no
            probe slice can be timed or resolved; every trial alternates whole steps
            (whole-phase evidence) and locked phases run no in-phase monitor checks.
    """

    enforce: bool = True
    warmup_steps: int = 2
    trial_steps: int = 8
    drift_threshold: float = 0.25
    max_trial_fraction: float = 0.25
    confidence_z: float = 1.5
    monitor_interval_steps: int = 10
    slices_per_phase: int = 48
    min_blocks: int = 3
    async_mode: bool = False
    recovery_steps: int = 2
    in_phase_probes: bool = True


@dataclasses.dataclass
class Observe:
    """Observe-only policy: the phase never touches clocks, only measures."""

    state: ClassVar[base.PhaseState] = base.PhaseState.OBSERVE


@dataclasses.dataclass
class Warmup:
    """Default governor while the default-governor model is fitted.

    Attributes:
        steps: clean windows observed in warm-up.
    """

    state: ClassVar[base.PhaseState] = base.PhaseState.WARMUP
    steps: int = 0


@dataclasses.dataclass
class Trial:
    """A selection round probing candidate clocks against the default governor.

    The round's evidence (``PhaseController.blocks``, ``stats``, ``fit``) outlives the trial:
    the lock it chooses keeps refining it.

    Attributes:
        round_steps: trial steps spent in this round (a whole-step probe counts
            ``1 / probe.BLOCK``).
        step_probe: the rest of a whole-step block's schedule (None: default governor), one
            entry per step; empty when no whole-step block is running.
        step_probe_clock: the clock of the whole-step block (None: none running).
        pending: whole-step slices observed that do not complete a block yet.
    """

    state: ClassVar[base.PhaseState] = base.PhaseState.TRIAL
    round_steps: float = 0.0
    step_probe: list[int | None] = dataclasses.field(default_factory=list)
    step_probe_clock: int | None = None
    pending: list[base.ProbeSlice] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Locked:
    """Running the selected clock (``PhaseController.locked_clock_mhz``) and monitoring it.

    Attributes:
        threshold: the phase's threshold when the lock's target was last set.
        target: the lock target the held clock was last shown to meet (``lock_target``).
        feature: drift feature of the step that locked (``_drift_feature``).
        slowdown: whether that step showed clock-event reasons (power or thermal).
        round_steps: trial steps the round spent before this lock.
        steps: windows observed since the lock.
        slowdowns: consecutive windows with new clock-event reasons.
    """

    state: ClassVar[base.PhaseState] = base.PhaseState.LOCKED
    threshold: float
    target: float
    feature: float = 0.0
    slowdown: bool = False
    round_steps: float = 0.0
    steps: int = 0
    slowdowns: int = 0


@dataclasses.dataclass
class Fallback:
    """Default governor after an error until ``recovery_steps`` clean windows.

    Attributes:
        clean_steps: clean windows since the last error.
    """

    state: ClassVar[base.PhaseState] = base.PhaseState.FALLBACK
    clean_steps: int = 0


Stage = Observe | Warmup | Trial | Locked | Fallback
"""Where a phase's selection stands, with the fields that stage needs (one class per
``base.PhaseState``)."""


class DefaultEquivalent(NamedTuple):
    """What the default governor would have needed for a phase window (None: unknown)."""

    energy_j: float | None
    time_s: float | None


def _drift_feature(phase: str, workload: api_workload.TokenWorkload) -> float:
    if phase == "generation":
        return workload.mean_context_tokens
    return workload.phase_tokens(phase) / max(workload.samples, 1)


class PhaseController:
    """Clock selection for one phase (see module docstring)."""

    def __init__(self, settings: PhaseSettings, ctl: ControllerSettings) -> None:
        self.settings = settings
        self.ctl = ctl
        self.stage: Stage = Warmup() if ctl.enforce else Observe()
        self.default_model = predictor.DefaultModel()
        self.default_clock_mhz: int | None = None
        self.locked_clock_mhz: int | None = None
        self.threshold = settings.min_throughput_ratio
        self.selections = 0
        self.retrial_reasons: list[str] = []
        self.fit: probe.CorrectedFit | None = None
        self.floor_mhz = 0
        self._last_time_s = 0.0
        self._last_default_time_s = 0.0
        self._last_feature = 0.0
        self._last_slowdown = False
        self._previous_lock_mhz: int | None = None
        """The clock the newest round locked (a trial's interim clock before its fit)."""
        self.ledger_default_s = 0.0
        self.ledger_actual_s = 0.0
        self.ledger_windows = 0
        self._trial_features: tuple[float, float] | None = None
        """(lowest, highest) drift feature of the steps whose trials chose the lock
        (``_drift_range``)."""
        self._monitor = probe.RatioStats()
        """Monitor blocks at ``locked_clock_mhz`` since it was set; kept after the lock ends
        (``_locked_ratios`` pools them for windows at that clock)."""
        self.progress_gap_s = 0.0
        self.idle_credit = 0.0
        """Async mode, a pool that does not set the step time: its idle power over its phase's
        default-governor power (``EERLController._update_async_thresholds``). Its slowdown
        fills time it would otherwise idle, so a clock is scored by ``e(c) - k / r(c)``
        (``_choose``); 0: no credit (sync mode, the bottleneck pool)."""
        self.default_j = 0.0
        self.default_s = 0.0
        """Energy (J) and time (s) of the phase's default-governor windows (their power)."""
        self._new_round()

    # ----- state helpers ---------------------------------------------------------------------
    def _new_round(self) -> None:
        self.blocks: list[tuple[int, float, float | None]] = []
        self.stats: dict[int, probe.RatioStats] = {}
        self.fit = None

    def _retrial(
        self, reason: str, *, keep_floor: bool = False, carry: bool = False, keep_all: bool = False
    ) -> None:
        self.retrial_reasons.append(reason)
        self.stage = Trial()
        if not keep_floor:
            self.floor_mhz = 0
        carried = list(self.blocks) if keep_all else self.blocks[-CARRY_BLOCKS:] if carry else []
        if not carried:
            self._trial_features = None
        self._new_round()
        if carried:
            # The previous workload's blocks seed the fit; new blocks at the best guess correct
            # it, so a drift re-trial need not pay for the low-clock lever arm again.
            self.blocks = list(carried)
            self.fit = probe.fit_corrected(
                self.blocks, self.settings.max_clock_mhz, self.f_default_mhz
            )

    @property
    def state(self) -> base.PhaseState:
        """Where the phase's selection stands (``stage``'s kind)."""
        return self.stage.state

    @property
    def round_steps(self) -> float:
        """Trial steps spent in the current selection round (whole-step probes count 1/8).

        While locked, the steps the round spent before the lock; 0 in other stages.
        """
        if isinstance(self.stage, Trial | Locked):
            return self.stage.round_steps
        return 0.0

    def _locked(self) -> Locked:
        """The ``Locked`` stage (raises RuntimeError in any other stage: a caller's bug)."""
        if not isinstance(self.stage, Locked):
            raise RuntimeError(f"{self.settings.name}: {self.state.value}, not locked")
        return self.stage

    @property
    def f_default_mhz(self) -> int:
        """Clock the default governor runs this phase at (read back in warm-up), MHz."""
        return self.default_clock_mhz or self.settings.max_clock_mhz

    @property
    def repay_ratio(self) -> float:
        """Throughput ratio that repays the run's deficit against the threshold (0: none).

        The phase's whole run so far took ``A`` s where the default governor would have taken
        ``D`` (``ledger_actual_s``, ``ledger_default_s``: every window's default-equivalent
        time, ``default_equivalent``; probe windows from their paired default slices). Over
        ``H = REPAY_HORIZON x D`` more seconds of default-governor work (at least
        ``REPAY_MIN_WINDOWS`` mean windows) the ratio ``r`` keeps the whole-run ratio at the
        threshold ``theta`` where ``(D + H) / (A + H / r) = theta``, so
        ``r = H / ((D + H) / theta - A)`` (1.0 when no clock below the default can repay it in
        time). A pool whose threshold the async slack relaxed (``threshold`` below the
        policy's) repays nothing: its slowdown does not set the step time.
        """
        d, a = self.ledger_default_s, self.ledger_actual_s
        theta = self.threshold
        if d <= 0 or a <= 0 or theta < self.settings.min_throughput_ratio - 1e-9:
            return 0.0
        h = REPAY_HORIZON * max(d, REPAY_MIN_WINDOWS * d / max(self.ledger_windows, 1))
        room = (d + h) / theta - a
        return min(h / room, 1.0) if room > 0 else 1.0

    @property
    def lock_target(self) -> float:
        """Throughput ratio a lock's lower bound must meet, in (0, 1 + LOCK_MARGIN].

        The threshold or the repayment ratio (``repay_ratio``), whichever is higher, plus
        ``LOCK_MARGIN``.
        """
        return max(self.threshold, self.repay_ratio) + LOCK_MARGIN

    def _ledger_add(self, obs: base.PhaseObservation) -> None:
        """Book a window in the phase's run ledger (its default-equivalent time, s)."""
        if obs.error is None and obs.duration_s > 0 and self._last_default_time_s > 0:
            self.ledger_default_s += self._last_default_time_s
            self.ledger_actual_s += obs.duration_s
            self.ledger_windows += 1

    def _allowed(self) -> list[int]:
        """Clocks the selection may lock, descending: below the default clock, above the floor."""
        return [c for c in self.settings.allowed_mhz if self.floor_mhz < c < self.f_default_mhz]

    @property
    def evidence_scale(self) -> float:
        """How many steps this phase needs for the probe evidence of one long-phase step.

        ``trial_steps`` is sized for a phase long enough for ``slices_per_phase`` slices of
        ``MIN_SLICE_S`` (six probe blocks). A shorter phase gives proportionally less probe time
        per step (the evidence of a block grows with its length), so its trial round, counted
        in steps, is scaled by that time deficit (at most ``MAX_EVIDENCE_SCALE``). A probed step
        costs the same share of the step's energy and time whatever the phase length, so the
        evidence, not the step count, is what a trial must buy. Whole-step probes already count
        ``1 / BLOCK`` per step.
        """
        if self._slices_in_phase() == 0 or self._last_default_time_s <= 0:
            return 1.0
        full_s = self.ctl.slices_per_phase * MIN_SLICE_S
        return min(max(full_s / self._last_default_time_s, 1.0), MAX_EVIDENCE_SCALE)

    @property
    def trial_step_limit(self) -> float:
        """Trial steps of one selection round before the extension rule (``INFO_GAIN``)."""
        return self.ctl.trial_steps * self.evidence_scale

    def _min_slice_s(self) -> float:
        """Shortest slice the phase's progress reports resolve, s (inf: no reports)."""
        return max(MIN_SLICE_S, SLICE_PER_PROGRESS_GAP * self.progress_gap_s)

    def _slices_in_phase(self) -> int:
        """Probe slices that fit in the phase (a multiple of the block length).

        0: the phase is too short, or no in-phase progress resolves its slices.
        """
        shortest = self._min_slice_s()
        if not self.ctl.in_phase_probes or not math.isfinite(shortest):
            return 0
        fit = int(self._last_time_s / shortest)
        n = min(self.ctl.slices_per_phase, fit)
        return n - n % probe.BLOCK

    @property
    def probe_evidence(self) -> str:
        """Which evidence trials of this phase use, and why (status ``probeEvidence``)."""
        gap = self.progress_gap_s
        if not self.ctl.in_phase_probes:
            return (
                "whole-phase: phases arrive as pod annotations (phaseSource annotation), "
                "so trials alternate whole steps"
            )
        if not math.isfinite(gap):
            return (
                "whole-phase: no in-phase progress reports in the newest window, "
                "so trials alternate whole steps"
            )
        if self._slices_in_phase() == 0:
            return (
                f"whole-phase: progress every {1000 * gap:.0f} ms or more resolves fewer than "
                f"{probe.BLOCK} slices of a {self._last_time_s:.3f} s phase"
            )
        cadence = "exact" if gap == 0 else f"every {1000 * gap:.0f} ms"
        return f"in-phase slices (progress {cadence})"

    # ----- decide ------------------------------------------------------------------------
    def decide(self, allow_probe: bool, allow_extra: bool = True) -> base.PhaseDecision:
        """Decision for the next step.

        Args:
            allow_probe: False when the job's trial budget is spent.
            allow_extra: False when trials past ``trial_steps`` would crowd out other phases.
        """
        stage = self.stage
        if isinstance(stage, Trial):
            return self._decide_trial(stage, allow_probe, allow_extra)
        if isinstance(stage, Locked):
            return self._decide_locked(stage, allow_probe)
        return base.PhaseDecision(None, stage.state, reason=stage.state.value)

    def _slice_plan(self) -> tuple[int, float]:
        """(probe slices that fit in the phase, each slice's length s; 0 and 0.0: none)."""
        n_slices = self._slices_in_phase()
        return n_slices, self._last_time_s / n_slices if n_slices else 0.0

    def _decide_trial(
        self, trial: Trial, allow_probe: bool, allow_extra: bool
    ) -> base.PhaseDecision:
        """A trial's decision: the running whole-step block, a new probe, or the interim clock."""
        state = trial.state
        if trial.step_probe:
            # Whole-step slices: finish the current block before anything else.
            return base.PhaseDecision(
                trial.step_probe[0],
                state,
                reason=f"step trial {trial.step_probe_clock} MHz",
                step_probe=True,
            )
        n_slices, slice_s = self._slice_plan()
        active = self._probe_clocks(max(n_slices // probe.BLOCK, 1))
        extending = trial.round_steps >= self.trial_step_limit
        if extending and not allow_extra and self.fit is not None:
            # No budget to extend the trial: lock the safest choice the data supports.
            self._lock(self._choose(self.lock_target)[0], self._last_feature, self._last_slowdown)
            return self.decide(allow_probe, allow_extra)
        if not allow_probe or not active:
            # Waiting for trial budget: run the safest choice so far, else the previous lock.
            interim = self._choose()[0] if self.fit is not None else self._previous_lock_mhz
            return base.PhaseDecision(interim, state, reason="trial budget spent: interim clock")
        if n_slices == 0:
            trial.step_probe_clock = active[0]
            trial.step_probe = list(probe.block_schedule(active[:1]))
            return base.PhaseDecision(
                trial.step_probe[0],
                state,
                reason=f"step trial {active[0]} MHz",
                step_probe=True,
            )
        schedule = probe.block_schedule(active)
        return base.PhaseDecision(
            None,
            state,
            probe_clocks_mhz=schedule,
            probe_slice_s=slice_s,
            reason=f"trial {', '.join(map(str, active))} MHz vs default",
        )

    def _decide_locked(self, lock: Locked, allow_probe: bool) -> base.PhaseDecision:
        """A lock's decision: its clock, with a monitor check when one is due."""
        state = lock.state
        n_slices, slice_s = self._slice_plan()
        clock = self.locked_clock_mhz
        # Lever-arm checks cost throughput (a quarter of their slices run the lever-arm clock,
        # and they come twice as often): not while the run owes its threshold some
        # (``repay_ratio``).
        unsure = self._uncertain() and self.repay_ratio <= self.threshold
        interval = self.ctl.monitor_interval_steps
        if unsure:
            interval = max(interval // 2, 1)
        elif self._settled():
            interval *= SETTLED_MONITOR_FACTOR
        due = lock.steps > 0 and lock.steps % interval == 0
        if clock is not None and allow_probe and due and n_slices:
            # While the lock is held up by uncertainty, the check also probes the lowest clock
            # (the largest lever arm on the model) so the lock can move down when proven.
            lever = self._lever_clock()
            order = (
                [lever, lever, clock] if unsure and lever is not None and lever < clock else [clock]
            )
            schedule = probe.block_schedule(order) + (clock,) * probe.BLOCK
            return base.PhaseDecision(
                clock,
                state,
                probe_clocks_mhz=schedule,
                probe_slice_s=slice_s,
                reason=f"monitor {clock} MHz",
            )
        return base.PhaseDecision(
            clock, state, reason="locked" if clock else "no clock met the threshold"
        )

    def _lever_clock(self) -> int | None:
        """Clock for the fit's lever arm (the lowest candidate at ``PROBE_MIN_RATIO`` or above).

        The lowest candidate the fit predicts at or above ``PROBE_MIN_RATIO``, else the lowest
        allowed clock (never above it). A floor only bars a clock from the lock; probing below
        it still sharpens the model at every clock (the information on ``u`` per block grows
        with ``f_max / c - 1``), and a probe slice at ``PROBE_MIN_RATIO`` costs a bounded share
        of the step's throughput.
        """
        allowed = self._allowed()
        low = allowed[-1] if allowed else None
        fit = self.fit
        if fit is None:
            return low
        for c in sorted(self.settings.candidates_mhz):
            if c < self.f_default_mhz and fit.throughput_ratio(c) >= PROBE_MIN_RATIO:
                return c if low is None else min(c, low)
        return low

    def _settled(self) -> bool:
        """True once the lock's own monitor blocks prove it with room to spare.

        At least ``SETTLED_MIN_BLOCKS`` monitor blocks at the lock whose lower confidence bound
        (Student's t) clears ``lock_target``, and the next lower allowed clock shown to miss
        it (the fit's upper bound under the target; the checks' blocks are what moves a lock
        down a step):
        checks then add little but their default-governor slices, so ``_decide_locked`` spaces
        them ``SETTLED_MONITOR_FACTOR`` times wider.
        """
        stats, fit, clock = self._monitor, self.fit, self.locked_clock_mhz
        if stats.n < SETTLED_MIN_BLOCKS or not math.isfinite(stats.stderr):
            return False
        lower = [c for c in self._allowed() if clock is not None and c < clock]
        if fit is None:
            return False
        if lower:
            below = max(lower)
            z = probe.student_t_factor(max(fit.blocks - 1, 1), self.ctl.confidence_z)
            if fit.throughput_ratio(below) + z * fit.throughput_stderr(below) >= self.lock_target:
                return False
        k = probe.student_t_factor(stats.n - 1, self.ctl.confidence_z)
        return stats.throughput_mean - k * stats.stderr >= self.lock_target

    def _uncertain(self) -> bool:
        """True while the model's point estimate allows a clock well below the lock."""
        fit, clock = self.fit, self.locked_clock_mhz
        if fit is None or clock is None:
            return False
        lower = [
            c
            for c in self._allowed()
            if c < clock and fit.throughput_ratio(c) >= self.threshold + INDIFFERENCE
        ]
        if len(lower) >= 3:
            return True
        if not lower:
            return False
        e_lock, e_point = fit.energy_ratio(clock), fit.energy_ratio(min(lower))
        return e_lock is not None and e_point is not None and e_lock - e_point >= MONITOR_GAIN

    def _probe_clocks(self, most: int) -> list[int]:
        """Clocks to probe next.

        In-phase: the lever-arm clock only (``_lever_clock``). A block's information on the
        model's ``u`` grows with ``(f_max / c - 1) ** 2``: at the lever (throughput about
        ``PROBE_MIN_RATIO``) that is about ten times what a block near the lock gives, so blocks
        spent at the best guess slowed the fit down. Measured over the shipped traces (h100-sxm,
        sync, ten seeds; docs/simulator.md): online/oracle on TinyZero 0.844 -> 0.864 mean,
        the other traces within -0.001..+0.005. The lock itself is still checked directly by
        the monitor blocks, which step it up when its own blocks miss the threshold. Whole-step
        probes run entire steps at the probed clock, so they try only the best guess, starting
        from the highest candidate; a drift re-trial with carried blocks checks its guess first.
        """
        allowed = self._allowed()
        if not allowed:
            return []
        cands = [c for c in self.settings.candidates_mhz if c in allowed] or allowed
        guess = self._choose()[0] if self.fit is not None else None
        if most <= 1 and self._slices_in_phase() == 0:
            return [guess if guess is not None else cands[0]]
        search = self._search_clock()
        if search is not None:
            return [search] * max(min(most, 4), 1)
        check = self._model_check_clock()
        if check is not None:
            return [check]
        if guess is not None and self.round_steps == 0 and self.blocks:
            return [guess]  # drift re-trial with carried blocks: check the guess first
        return [min(cands[-1], self._lever_clock() or cands[-1])]

    # ----- bracketing search (the model does not fit) -------------------------------------
    def _verdict(self, clock: int) -> bool | None:
        """Whether ``clock``'s own blocks meet the lock target (None: not decided yet).

        Decided when the Student-t interval clears ``threshold + LOCK_MARGIN`` either way, when
        it is narrower than ``INDIFFERENCE`` (by its mean), or after ``4 x min_blocks`` blocks.
        """
        fit = self.fit
        m = fit.measured_at(clock) if fit is not None else None
        if m is None or m.n < self.ctl.min_blocks or not math.isfinite(m.throughput_se):
            return None
        target = self.threshold + LOCK_MARGIN
        k = m.throughput_halfwidth(self.ctl.confidence_z)
        if m.throughput_mean - k >= target:
            return True
        if m.throughput_mean + k < target:
            return False
        if k <= INDIFFERENCE or m.n >= 4 * self.ctl.min_blocks:
            return m.throughput_mean >= target
        return None

    def bracket(self) -> tuple[int, int]:
        """(highest clock shown to miss, lowest clock shown to meet) the lock target, MHz.

        Throughput does not fall when the clock rises, so the lock lies in between; the floor
        counts as a miss and the default clock as a meet.
        """
        lo, hi = self.floor_mhz, self.f_default_mhz
        fit = self.fit
        for m in fit.measured if fit is not None else ():
            verdict = self._verdict(m.clock_mhz)
            if verdict is True:
                hi = min(hi, m.clock_mhz)
            elif verdict is False:
                lo = max(lo, m.clock_mhz)
        return lo, hi

    def _model_check_clock(self) -> int | None:
        """A clock that tests the model's shape before a lock, or None (tested, or nothing to test).

        The lever-arm blocks fix the model's one parameter; they cannot show that the curve has
        another shape (a step, a plateau) between the lever and the default clock. So before a
        round locks, ``min_blocks`` blocks run at the clock halfway between the lowest probed
        clock and the choice (or the default clock); if they miss the model by ``MISFIT_Z``
        standard errors, the bracketing search takes over (``_search_clock``). Tested once two
        probed clocks with ``min_blocks`` each lie a quarter of that span apart.
        """
        fit = self.fit
        if fit is None or fit.misfit:
            return None
        decided = [m.clock_mhz for m in fit.measured if m.n >= self.ctl.min_blocks]
        if not decided:
            return None
        low = min(decided)
        choice = self._choose()[0]
        high = choice if choice is not None else self.f_default_mhz
        span = high - low
        if max(decided) - low >= span / 4:
            return None
        inside = [c for c in self._allowed() if low < c < high]
        if not inside:
            return None
        return min(inside, key=lambda c: abs(c - (low + high) / 2))

    def _search_clock(self) -> int | None:
        """Next clock of the bracketing search, or None (model fits, or bracket closed).

        Runs only where the corrected fit flags the model as misfitted (a knee, plateau or step
        the one-parameter model cannot follow): the model's smooth shape then says little
        between probed clocks, so each probe tests one clock directly, and the bracket shrinks
        by at least a quarter per decided clock. A clock still undecided keeps being probed;
        else the next is the lowest clock the corrected fit predicts meets the target where
        that lies in the middle half of the bracket, else the bracket's midpoint (bisection).
        """
        fit = self.fit
        if fit is None or not fit.misfit:
            return None
        lo, hi = self.bracket()
        if lo >= hi:
            return None
        inside = [c for c in self._allowed() if lo < c < hi]
        if not inside:
            return None
        pending = [
            m for m in fit.measured if m.clock_mhz in inside and self._verdict(m.clock_mhz) is None
        ]
        if pending:
            return max(pending, key=lambda m: m.n).clock_mhz
        target = self.threshold + LOCK_MARGIN
        meets = [c for c in inside if fit.throughput_ratio(c) >= target]
        quarter = (hi - lo) / 4
        guess_f = (lo + hi) / 2
        if meets and lo + quarter <= min(meets) <= hi - quarter:
            guess_f = float(min(meets))
        return min(inside, key=lambda c: abs(c - guess_f))

    # ----- observe -----------------------------------------------------------------------
    def observe(self, obs: base.PhaseObservation, workload: api_workload.TokenWorkload) -> None:
        """Feed one phase window of one step."""
        if obs.error is not None:
            if not isinstance(self.stage, Observe):
                self.stage = Fallback()
                self.retrial_reasons.append(f"error: {obs.error}")
            return
        tokens = workload.phase_tokens(self.settings.name)
        self._observe_window(obs, workload, tokens)
        stage = self.stage
        if isinstance(stage, Fallback):
            stage.clean_steps += 1
            if stage.clean_steps >= self.ctl.recovery_steps:
                self._retrial("recovered from error")
        elif isinstance(stage, Warmup):
            stage.steps += 1
            if stage.steps >= self.ctl.warmup_steps and self.default_model.ready:
                self._retrial("warm-up done")
        elif isinstance(stage, Trial):
            whole_step = not obs.slices and bool(stage.step_probe)
            blocks = self._blocks(obs, tokens)
            f = self._last_feature
            lo, hi = self._trial_features or (f, f)
            self._trial_features = (min(lo, f), max(hi, f))
            self._observe_trial(stage, obs, blocks, whole_step=whole_step)
        elif isinstance(stage, Locked):
            self._observe_locked(stage, obs, workload, self._blocks(obs, tokens))

    def _observe_window(
        self, obs: base.PhaseObservation, workload: api_workload.TokenWorkload, tokens: float
    ) -> None:
        """Book a clean window in every stage: ledger, slicing inputs, default-governor model."""
        self._last_time_s = obs.duration_s
        self.progress_gap_s = obs.progress_gap_s
        self._last_default_time_s = self._default_time_s(obs, workload)
        self._ledger_add(obs)
        self._last_feature = _drift_feature(self.settings.name, workload)
        self._last_slowdown = obs.slowdown
        if obs.requested_clock_mhz is None and not obs.slices:
            self.default_model.add(tokens, obs.duration_s, obs.energy_j)
            if obs.energy_j is not None and obs.duration_s > 0:
                self.default_j += obs.energy_j
                self.default_s += obs.duration_s
            if obs.applied_clock_mhz is not None:
                self.default_clock_mhz = max(self.default_clock_mhz or 0, obs.applied_clock_mhz)

    def _observe_locked(
        self,
        lock: Locked,
        obs: base.PhaseObservation,
        workload: api_workload.TokenWorkload,
        blocks: list[tuple[int, float, float | None]],
    ) -> None:
        """A locked window: monitor blocks refine the fit, then the lock is checked."""
        lock.steps += 1
        for clock, thr, power in blocks:
            if clock == self.locked_clock_mhz:
                self._monitor.add(thr, power)
            self.blocks.append((clock, thr, power))
        if blocks:
            self._refine_locked()
        if self.stage is lock:
            self._check_locked(obs, workload)

    def _default_time_s(
        self, obs: base.PhaseObservation, workload: api_workload.TokenWorkload
    ) -> float:
        """The phase's time under the default governor, from the fit where one exists."""
        if obs.requested_clock_mhz is None and not obs.slices:
            return obs.duration_s
        _, time_s = self.default_equivalent(obs, workload)
        return obs.duration_s if time_s is None else time_s

    def _blocks(
        self, obs: base.PhaseObservation, tokens: float
    ) -> list[tuple[int, float, float | None]]:
        """Probe blocks a window completes: its in-phase slices, or a whole-step block's last."""
        if obs.slices:
            planned = max(s.duration_s for s in obs.slices)
            if SLICE_PER_PROGRESS_GAP * obs.progress_gap_s > planned:
                return []  # the reports cannot resolve these slices: no in-phase evidence
            return probe.blocks_from_slices(obs.slices)[0]
        trial = self.stage
        if isinstance(trial, Trial) and trial.step_probe:
            # Whole-step probe: this phase is one slice (rates) of a block spanning steps.
            trial.step_probe.pop(0)
            duration = max(obs.duration_s, 1e-9)
            power = None if obs.energy_j is None else obs.energy_j / duration
            trial.pending.append(
                base.ProbeSlice(obs.requested_clock_mhz, 1.0, tokens / duration, power)
            )
            blocks, used = probe.blocks_from_slices(trial.pending)
            del trial.pending[:used]
            return blocks
        return []

    def _observe_trial(
        self,
        trial: Trial,
        obs: base.PhaseObservation,
        blocks: list[tuple[int, float, float | None]],
        *,
        whole_step: bool,
    ) -> None:
        """A trial window: book its blocks, raise the floor, lock once the choice is decided.

        ``whole_step``: the window was one step of a whole-step block.
        """
        if obs.slices:
            trial.round_steps += 1
        elif whole_step:
            trial.round_steps += 1 / probe.BLOCK
        for clock, thr, power in blocks:
            self.blocks.append((clock, thr, power))
            self.stats.setdefault(clock, probe.RatioStats()).add(thr, power)
        # Direct evidence beats the model: a clock clearly below the threshold raises the floor.
        for clock, stats in self.stats.items():
            if stats.n >= self.ctl.min_blocks and self._upper(stats) < self.threshold:
                self.floor_mhz = max(self.floor_mhz, clock)
        if not self._allowed():
            self._lock(None, self._last_feature, obs.slowdown)
            return
        self.fit = probe.fit_corrected(self.blocks, self.settings.max_clock_mhz, self.f_default_mhz)
        if self.fit is None:
            if trial.round_steps >= self.trial_step_limit:
                self._lock(None, self._last_feature, obs.slowdown)
            return
        if self._trial_decided(trial, self.fit):
            self._lock(self._choose(self.lock_target)[0], self._last_feature, obs.slowdown)

    def _trial_decided(self, trial: Trial, fit: probe.CorrectedFit) -> bool:
        """Whether the round may lock: its choice is precise, or its steps are spent."""
        choice, stderr = self._choose()
        z_eff = probe.student_t_factor(fit.blocks - 1, self.ctl.confidence_z)
        precise = (
            choice is not None
            and fit.blocks >= self.ctl.min_blocks
            and z_eff * stderr <= INDIFFERENCE
        )
        limit = self.trial_step_limit
        if fit.misfit:
            # The model does not fit: lock once the bracketing search has closed.
            precise = choice is not None and self._search_clock() is None
        elif self._model_check_clock() is not None and trial.round_steps < 3 * limit:
            precise = False  # the model's shape is not tested yet
        done = trial.round_steps >= limit and (
            trial.round_steps >= 3 * limit or self._uncertainty_cost() < INFO_GAIN
        )
        return precise or done

    def _uncertainty_cost(self) -> float:
        """Energy-per-token ratio given up by the conservative choice vs the point estimate.

        Trials continue past ``trial_steps`` (up to three times) while this exceeds
        ``INFO_GAIN``: short phases give few probe blocks per step, so the confidence bound
        would otherwise hold the clock far above what the point estimate supports.
        """
        fit = self.fit
        if fit is None:
            return 0.0
        point = [c for c in self._allowed() if fit.throughput_ratio(c) >= self.threshold]
        conservative, _ = self._choose()
        if not point:
            return 0.0
        e_point = fit.energy_ratio(min(point))
        e_cons = fit.energy_ratio(conservative) if conservative is not None else 1.0
        if e_point is None or e_cons is None:
            return 0.0
        return e_cons - e_point

    def _upper(self, stats: probe.RatioStats) -> float:
        k = probe.student_t_factor(stats.n - 1, self.ctl.confidence_z)
        return stats.throughput_mean + k * stats.stderr

    def _choose(self, target: float | None = None) -> tuple[int | None, float]:
        """Most efficient allowed clock whose lower bound meets ``target``, and its stderr.

        ``target``: default ``threshold + LOCK_MARGIN`` (what trials decide against); locks
        pass ``lock_target`` (the run's deficit repaid as well).
        """
        fit = self.fit
        if fit is None:
            return None, math.inf
        best: int | None = None
        k = self.idle_credit
        best_e = 1.0 - k
        target = self.threshold + LOCK_MARGIN if target is None else target
        proven_mhz = self._proven_clock_mhz(target)
        for clock in self._allowed():
            if not self._meets(clock, target, proven_mhz):
                continue
            e = fit.energy_ratio(clock)
            if e is None:
                score = clock / self.settings.max_clock_mhz - k
            else:
                score = e - k / max(fit.throughput_ratio(clock), 1e-9)
            if score < best_e:
                best, best_e = clock, score
        if best is None:
            return None, fit.throughput_stderr(self._allowed()[0]) if self._allowed() else math.inf
        return best, fit.throughput_stderr(best)

    def _lower_bound(self, clock_mhz: int, z: float) -> float:
        """Lower confidence bound of the throughput ratio at ``clock_mhz``.

        The fit's bound (``CorrectedFit.throughput_lower_bound``), raised to the bound any
        probed clock at or below ``clock_mhz`` shows on its own blocks (at least
        ``min_blocks``): throughput does not fall when the clock rises, so a clock proven to
        meet a target proves every higher one. Without it a single noisy block at an
        unproven clock between a proven one and the default (the corrected fit follows each
        probed clock's mean near it) drags the fit's bound down over that whole span, and
        the lock lands far above the proven clock.
        """
        fit = self.fit
        assert fit is not None
        bound = fit.throughput_lower_bound(clock_mhz, z)
        for m in fit.measured:
            if m.clock_mhz <= clock_mhz and m.n >= self.ctl.min_blocks:
                bound = max(bound, m.throughput_mean - m.throughput_halfwidth(z))
        return bound

    def _meets(self, clock_mhz: int, target: float, proven_mhz: float | None = None) -> bool:
        """Whether ``clock_mhz`` is shown to meet ``target``.

        At or above ``proven_mhz`` (default ``_proven_clock_mhz(target)``; a caller testing many
        clocks passes it, taken once), or its lower bound (``_lower_bound``) meets it. What a
        lock is chosen by (``_choose``) and what a held lock is checked against when its target
        moves (``_check_locked``), so the two never disagree on the same evidence.
        """
        if proven_mhz is None:
            proven_mhz = self._proven_clock_mhz(target)
        if clock_mhz >= proven_mhz:
            return True
        return self._lower_bound(clock_mhz, self.ctl.confidence_z) >= target

    def _proven_clock_mhz(self, target: float) -> float:
        """Lowest clock the bracketing search showed meets ``target`` (inf: none).

        Only while the model is misfitted (the search decides clock by clock there,
        ``_verdict``) and only for the target the search decides against,
        ``threshold + LOCK_MARGIN``: a lock that must repay a deficit (a higher
        ``lock_target``) still needs the bound. Every clock at or above it meets the target
        (throughput does not fall when the clock rises).
        """
        fit = self.fit
        if fit is None or not fit.misfit or target > self.threshold + LOCK_MARGIN + 1e-12:
            return math.inf
        hi = self.bracket()[1]
        return hi if hi < self.f_default_mhz else math.inf

    def _drift(self, feature: float) -> float | None:
        """Relative drift of ``feature`` past ``drift_threshold``, or None (no drift).

        Measured against the range of features the lock was chosen over (``_drift_range``):
        a workload the trial round's blocks already spanned is no drift. A trace replayed in
        cycles swings its context length by more than the threshold at every wrap
        (verl-grpo-uitars15-7b's ten steps: 4199 -> 5292 tokens, +26 %); measured from the
        lock's single step, each wrap re-trialled a lock its own trials had covered (uitars on
        ``h100-sxm:step-decode``, async: nine re-trials in 200 steps).
        """
        lo, hi = self._drift_range()
        if lo <= 0:
            return None
        thr = self.ctl.drift_threshold
        if feature > hi * (1.0 + thr):
            return feature / hi - 1.0
        if feature < lo * (1.0 - thr):
            return feature / lo - 1.0
        return None

    def _drift_range(self) -> tuple[float, float]:
        """(lowest, highest) drift feature of the lock's step and its round's trial steps."""
        f = self._locked().feature
        lo, hi = self._trial_features or (f, f)
        return min(lo, f), max(hi, f)

    def _lock(self, clock: int | None, feature: float, slowdown: bool) -> None:
        round_steps = self.round_steps
        self.locked_clock_mhz = clock
        self._previous_lock_mhz = clock
        self.stage = Locked(
            threshold=self.threshold,
            target=self.lock_target,
            feature=feature,
            slowdown=slowdown,
            round_steps=round_steps,
        )
        self.selections += 1
        self._monitor = probe.RatioStats()

    def _set_lock_clock(self, clock: int | None, reason: str) -> None:
        """Move the held lock to ``clock`` (its monitor starts again); ``reason`` is recorded."""
        self.retrial_reasons.append(reason)
        self.locked_clock_mhz = clock
        self._monitor = probe.RatioStats()
        self.selections += 1

    def _refine_locked(self) -> None:
        """Monitor blocks also sharpen the model: move to a lower clock once it is proven.

        A monitor that shows the model misfitted, with clocks below the lock not yet tested,
        starts a bracketing search (a re-trial that keeps every block).
        """
        self.fit = probe.fit_corrected(self.blocks, self.settings.max_clock_mhz, self.f_default_mhz)
        search = self._search_clock()
        lock = self.locked_clock_mhz
        if search is not None and lock is not None and search < lock:
            self._retrial(f"model misfit: search below {lock} MHz", keep_floor=True, keep_all=True)
            return
        choice, _ = self._choose(self.lock_target)
        current = self.locked_clock_mhz
        if choice is not None and current is not None and choice < current:
            self.retrial_reasons.append(f"refined {current} -> {choice} MHz")
            self.locked_clock_mhz = choice
            self.selections += 1
            self._monitor = probe.RatioStats()

    def _check_locked(
        self, obs: base.PhaseObservation, workload: api_workload.TokenWorkload
    ) -> None:
        """Check a held lock after a window: its target, its monitor, the workload, slowdowns.

        Each check may move the lock or start a re-trial; the first that does ends the check.
        """
        lock = self._locked()
        if self._check_target(lock) or self.stage is not lock:
            return
        if self._check_monitor():
            return
        drift = self._drift(_drift_feature(self.settings.name, workload))
        if drift is not None:
            self._retrial(f"workload drift {drift:+.0%}", carry=True)
            return
        if obs.slowdown and not lock.slowdown and self.locked_clock_mhz is not None:
            lock.slowdowns += 1
            if lock.slowdowns >= 2:
                self._retrial("clock-event reasons (power or thermal slowdown)")
        else:
            lock.slowdowns = 0

    def _check_target(self, lock: Locked) -> bool:
        """Follow the lock target (threshold or the run's deficit) as it moves.

        Returns True when the lock's clock moved (the check ends there). Where the async slack
        grew, the model may allow a lower clock (``_refine_locked``, which may start a
        re-trial).
        """
        fit, clock = self.fit, self.locked_clock_mhz
        if fit is None:
            return False
        if clock is None:
            # Held at the default governor while the run's deficit is repaid: lock once a clock
            # meets the (falling) target.
            choice, _ = self._choose(self.lock_target)
            if choice is not None:
                reason = f"target {self.lock_target:.3f}: default governor -> {choice} MHz"
                self._set_lock_clock(choice, reason)
                lock.target = self.lock_target
                return True
            return False
        target = self.lock_target
        threshold_moved = abs(self.threshold - lock.threshold) > 1e-9
        moved = threshold_moved or target > lock.target + 1e-9
        lock.target = min(lock.target, target)
        choice = None
        short = moved and not self._meets(clock, target)
        if short:
            choice, _ = self._choose(target)
        if choice is None and moved and not threshold_moved:
            # Only the run's deficit grew and no clock is shown to repay it: keep the
            # lock (the monitor still steps it up on its own blocks' evidence).
            lock.target = max(lock.target, target)
        elif short:
            # The threshold rose (async slack shrank) or the run's deficit grew (monitor
            # slices): step up to what the model supports.
            reason = (
                f"target {target:.3f} (threshold {self.threshold:.3f}): {clock} -> {choice} MHz"
            )
            self._set_lock_clock(choice, reason)
            lock.threshold = self.threshold
            lock.target = target
            return True
        if self.threshold < self.settings.min_throughput_ratio:
            self._refine_locked()  # async slack grew: the model may allow a lower clock
        return False

    def _check_monitor(self) -> bool:
        """Step the lock up (or re-trial) when its monitor blocks miss the threshold.

        Returns True when they did (the check ends there).
        """
        mon = self._monitor
        if not (mon.n >= self.ctl.min_blocks and self._upper(mon) < self.threshold):
            return False
        failed = self.locked_clock_mhz or 0
        self.floor_mhz = max(self.floor_mhz, failed)
        reason = (
            f"throughput ratio {mon.throughput_mean:.3f} below {self.threshold:.3f} at {failed} MHz"
        )
        choice, _ = self._choose(self.lock_target)
        if choice is not None:
            # Step up at once to the next clock the model supports; no default-governor gap.
            self._set_lock_clock(choice, f"{reason}: stepped up to {choice} MHz")
        else:
            self._retrial(reason, keep_floor=True)
        return True

    # ----- reporting ---------------------------------------------------------------------
    def default_equivalent(
        self, obs: base.PhaseObservation, workload: api_workload.TokenWorkload
    ) -> DefaultEquivalent:
        """What the default governor would have needed for this phase window (energy J, time s).

        Default-governor windows are their own answer. Probed windows are measured: their
        paired default-governor slices give the default governor's rate and power on the same
        work (``probe.paired_default``; slices outside complete blocks use this window's
        blocks or the fit), scaled from the slices to the whole window. Windows at a locked
        clock use the paired-probe fit (``probe.PhaseModelFit``, fitted to every block the
        phase measured): time x throughput ratio and energy / energy-per-token ratio. Without
        either (or without power data) the default-governor model over tokens is used (step 2
        above); it is the least precise estimate on real traces (2-11 % per step).
        Returns (None, None) for windows with errors or when nothing is known yet.
        """
        if obs.error is not None:
            return DefaultEquivalent(None, None)
        if obs.requested_clock_mhz is None and not obs.slices:
            return DefaultEquivalent(obs.energy_j, obs.duration_s)
        fit = self.fit
        if obs.slices and obs.energy_j is not None:
            paired = probe.paired_default(obs.slices, fit)
            slice_s = sum(s.duration_s for s in obs.slices)
            slice_j = sum(s.energy_j or 0.0 for s in obs.slices)
            if paired is not None and slice_s > 0 and slice_j > 0:
                return DefaultEquivalent(
                    obs.energy_j * paired[1] / slice_j, obs.duration_s * paired[0] / slice_s
                )
        if fit is not None and fit.beta is not None and obs.energy_j is not None:
            if obs.slices:
                ran = [base.ran_slice_clock_mhz(s) for s in obs.slices]  # caps credited
                time_s = sum(
                    s.work_s * (fit.throughput_ratio(c) if c else 1.0) + s.lead_s
                    for s, c in zip(obs.slices, ran, strict=True)
                )
                total_slice_s = sum(s.duration_s for s in obs.slices)
                # Energy: scale the measured window by the slice-time-weighted energy ratio.
                weights = [
                    (s.duration_s, (fit.energy_ratio(c) or 1.0) if c else 1.0)
                    for s, c in zip(obs.slices, ran, strict=True)
                ]
                mean_ratio = sum(w * e for w, e in weights) / max(total_slice_s, 1e-9)
                scale = obs.duration_s / max(total_slice_s, 1e-9)
                return DefaultEquivalent(obs.energy_j / mean_ratio, time_s * scale)
            clock = base.ran_clock_mhz(obs)
            if clock is not None:
                thr, e_ratio = self._locked_ratios(fit, clock)
                if e_ratio:
                    return DefaultEquivalent(obs.energy_j / e_ratio, obs.duration_s * thr)
        if not self.default_model.ready:
            return DefaultEquivalent(None, None)
        tokens = workload.phase_tokens(self.settings.name)
        return DefaultEquivalent(
            self.default_model.energy_fit()(tokens), self.default_model.time_fit()(tokens)
        )

    def _locked_ratios(self, fit: probe.CorrectedFit, clock_mhz: int) -> tuple[float, float | None]:
        """(throughput ratio, energy-per-token ratio) vs default a locked window is judged by.

        The fit's, checked against the paired probe blocks measured at that clock (the trials'
        and, at the locked clock, the monitor's, pooled): where the blocks' mean is more than
        ``MEASURED_Z`` standard errors off the fit, the blocks' own ratio (the fit's shape can
        miss the curve between its blocks: ``h100-sxm:saturating-decode``'s status saving read
        4.7 pp off the truth through the fit); else the fit (pooled over every
        block, it is the more precise of the two where its shape holds). Sync mode only: in
        async the blocks' own ratio moved the status further from the truth (``make
        bench-energy``, seed 0: first family async worst saving error 1.06 -> 1.77 pp,
        TinyZero on h100-sxm), a cause not found yet, so async keeps the fit.
        """
        thr_fit, e_fit = fit.throughput_ratio(clock_mhz), fit.energy_ratio(clock_mhz)
        if self.ctl.async_mode:
            return thr_fit, e_fit  # measured: the blocks' own ratio made async rows worse
        measured = self._measured_ratios(clock_mhz)
        if measured is None or e_fit is None:
            return thr_fit, e_fit
        thr, thr_se, e, e_se = measured
        return (
            thr if abs(thr - thr_fit) > MEASURED_Z * thr_se else thr_fit,
            e if abs(e - e_fit) > MEASURED_Z * e_se else e_fit,
        )

    def _measured_ratios(self, clock_mhz: int) -> tuple[float, float, float, float] | None:
        """The paired blocks measured at ``clock_mhz`` (trials' and, at the lock, monitor's).

        Returns:
            (throughput ratio, its standard error, energy-per-token ratio, its standard
            error), pooled over the blocks; None below ``min_blocks`` blocks with power.
        """
        pools = [self.stats.get(clock_mhz)]
        if clock_mhz == self.locked_clock_mhz:
            pools.append(self._monitor)
        used = [st for st in pools if st is not None and st.n >= 2 and st.power_n >= 2]
        n = sum(st.n for st in used)
        if n < self.ctl.min_blocks:
            return None
        thr = sum(st.n * st.throughput_mean for st in used) / n
        power = sum(st.n * (st.power_ratio or 0.0) for st in used) / n
        if thr <= 0 or power <= 0:
            return None
        thr_se = math.sqrt(sum((st.n * st.stderr) ** 2 for st in used)) / n
        power_se = math.sqrt(sum((st.n * st.power_stderr) ** 2 for st in used)) / n
        e = power / thr
        return thr, thr_se, e, e * math.hypot(power_se / power, thr_se / thr)

    def default_equivalent_range(
        self, obs: base.PhaseObservation, workload: api_workload.TokenWorkload
    ) -> tuple[DefaultEquivalent, DefaultEquivalent]:
        """Bounds of ``default_equivalent``: (low, high) energy J and time s of the window.

        Only a window at a locked clock judged by the fit carries an error that does not
        average out over windows: every window at that clock shares it. Its bounds span the
        fit's ratios, widened by ``STATUS_Z`` standard errors that carry the model's
        discrepancy, and the ratios the paired blocks measured at that clock
        (``_locked_ratio_range``): where the fit's shape misses the curve between or above
        its blocks, the range holds how far it can be off. Every
        other window returns its ``default_equivalent`` as both bounds (default-governor
        windows are exact; probed windows' paired slices are independent per window).
        """
        point = DefaultEquivalent(*self.default_equivalent(obs, workload))
        fit, clock = self.fit, base.ran_clock_mhz(obs)
        if (
            point.energy_j is None
            or point.time_s is None
            or obs.error is not None
            or obs.slices
            or obs.energy_j is None
            or clock is None
            or fit is None
            or fit.beta is None
        ):
            return point, point
        bounds = self._locked_ratio_range(fit, clock)
        if bounds is None:
            return point, point
        (thr_lo, thr_hi), (e_lo, e_hi) = bounds
        low = DefaultEquivalent(
            min(point.energy_j, obs.energy_j / e_hi), min(point.time_s, obs.duration_s * thr_lo)
        )
        high = DefaultEquivalent(
            max(point.energy_j, obs.energy_j / e_lo), max(point.time_s, obs.duration_s * thr_hi)
        )
        return low, high

    def _locked_ratio_range(
        self, fit: probe.CorrectedFit, clock_mhz: int
    ) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """((throughput low, high), (energy-per-token low, high)) ratios at a locked clock.

        The fit's throughput ratio +- ``STATUS_Z`` of its standard error with the model's
        discrepancy (``probe.CorrectedFit.discrepancy_stderr``), at most 1 (no clock below the
        default runs faster than it); its power ratio +- ``STATUS_Z`` of its own; between
        measured clocks each held inside what monotonicity in clock allows
        (``probe.CorrectedFit.monotone_bracket``, the point kept); the energy ratio (power /
        throughput) spans the corners, joined with the blocks' own ratios
        (``_measured_ratios``) +- ``STATUS_Z`` of theirs. The power's error is what the bounds
        missed before: they moved the energy ratio with the throughput alone, and a lock
        between the measured clocks and the default (TinyZero / ``b200:saturating-decode``,
        sync, seed 0: generation locked at 1,560-1,680 MHz, probed at 990-1,350 MHz) read a
        power ratio 0.732 against a true 0.713 (``power_tau2`` 0.00066), the truth outside
        the phase's saving bounds. None without a fitted energy ratio.
        """
        thr_fit, e_fit = fit.throughput_ratio(clock_mhz), fit.energy_ratio(clock_mhz)
        if e_fit is None or thr_fit <= 0:
            return None
        thr_sd, power_sd = fit.discrepancy_stderr(clock_mhz)
        thr_lo, thr_hi = thr_fit - STATUS_Z * thr_sd, min(thr_fit + STATUS_Z * thr_sd, 1.0)
        power = e_fit * thr_fit
        power_lo, power_hi = power - STATUS_Z * power_sd, power + STATUS_Z * power_sd
        bracket = fit.monotone_bracket(clock_mhz, STATUS_Z)
        if bracket is not None and fit.measured_at(clock_mhz) is None:
            # Between measured clocks: no wider than monotonicity allows (the point kept).
            (b_thr_lo, b_thr_hi), (b_p_lo, b_p_hi) = bracket
            thr_lo = max(thr_lo, min(b_thr_lo, thr_fit))
            thr_hi = min(thr_hi, max(b_thr_hi, thr_fit))
            power_lo = max(power_lo, min(b_p_lo, power))
            power_hi = min(power_hi, max(b_p_hi, power))
        if power_lo <= 0 or thr_lo <= 0:
            return None
        e_lo, e_hi = power_lo / max(thr_hi, 1e-9), power_hi / max(thr_lo, 1e-9)
        measured = self._measured_ratios(clock_mhz)
        if measured is not None:
            thr, thr_se, e, e_se = measured
            thr_lo = min(thr_lo, thr - STATUS_Z * thr_se)
            thr_hi = max(thr_hi, thr + STATUS_Z * thr_se)
            e_lo = min(e_lo, e - STATUS_Z * e_se)
            e_hi = max(e_hi, e + STATUS_Z * e_se)
        if thr_lo <= 0 or e_lo <= 0:
            return None
        return (thr_lo, thr_hi), (e_lo, e_hi)

    def estimate(self) -> tuple[float | None, float | None]:
        """(throughput ratio, energy-per-token ratio) of the locked clock vs default, if known."""
        clock = self.locked_clock_mhz
        if self.state is not base.PhaseState.LOCKED:
            return None, None
        if clock is None:
            return 1.0, 1.0
        if self._monitor.n >= self.ctl.min_blocks:
            return self._monitor.throughput_mean, self._monitor.energy_per_token_ratio
        if self.fit is not None:
            return self.fit.throughput_ratio(clock), self.fit.energy_ratio(clock)
        return None, None


class EERLController:
    """Job-level EE-RL controller over all phases; satisfies ``base.FrequencyPolicy``."""

    def __init__(
        self, phases: Sequence[PhaseSettings], settings: ControllerSettings | None = None
    ) -> None:
        self.settings = settings or ControllerSettings()
        self.phases: dict[str, PhaseController] = {
            p.name: PhaseController(p, self.settings) for p in phases
        }
        self.trial_steps = 0
        self.steps_seen = 0
        self._last_workload: api_workload.TokenWorkload | None = None
        self._pool_times: list[dict[str, float]] = []
        self._pool_idle: dict[str, tuple[float, float, int]] = {}
        """Async mode, per phase: its pool's idle energy J, idle GPU-s and GPUs, summed."""

    def _trial_budget_left(self, step: int) -> bool:
        horizon = max(step + 1, TRIAL_BUDGET_MIN_STEPS)
        return self.trial_steps + 1 <= self.settings.max_trial_fraction * horizon

    def decide(self, step: int) -> base.Plan:
        """Plan for ``step`` (see ``base.FrequencyPolicy``)."""
        if self.settings.async_mode:
            self._update_async_thresholds()
        allow = self._trial_budget_left(step)
        # Extended trials share the same budget; phases probe in the same steps.
        decisions = {name: pc.decide(allow, allow) for name, pc in self.phases.items()}
        if any(d.probing for d in decisions.values()):
            self.trial_steps += 1
        return base.Plan(step, decisions)

    def observe(self, observation: base.StepObservation) -> None:
        """Feed a step's measurements to every phase."""
        self.steps_seen += 1
        for name, pc in self.phases.items():
            obs = observation.phases.get(name)
            if obs is None:
                pc.observe(
                    base.PhaseObservation(
                        name, 0.0, None, None, error="no measurement (lost signal)"
                    ),
                    observation.workload,
                )
            else:
                pc.observe(obs, observation.workload)
        self._last_workload = observation.workload
        if self.settings.async_mode:
            self._record_pool_times(observation)
            for name, pool in observation.pool_idle.items():
                if pool.energy_j is not None and pool.gpu_seconds and name in self.phases:
                    j, s, _ = self._pool_idle.get(name, (0.0, 0.0, 0))
                    self._pool_idle[name] = (j + pool.energy_j, s + pool.gpu_seconds, pool.gpus)

    def report_error(self, phase: str, message: str) -> None:
        """An agent-side error outside a step's observation: that phase falls back to default."""
        pc = self.phases[phase]
        pc.observe(
            base.PhaseObservation(phase, 0.0, None, None, error=message),
            self._last_workload or _EMPTY,
        )

    def _record_pool_times(self, observation: base.StepObservation) -> None:
        """Keep default-equivalent pool times of plain (non-probe) steps for the async slack."""
        times: dict[str, float] = {}
        for name, pc in self.phases.items():
            obs = observation.phases.get(name)
            if obs is None or obs.slices or obs.error is not None:
                return
            if obs.requested_clock_mhz is None:
                times[name] = obs.duration_s
            elif pc.fit is not None:
                ran = base.ran_clock_mhz(obs) or obs.requested_clock_mhz
                times[name] = obs.duration_s * pc.fit.throughput_ratio(ran)
            else:
                return
        self._pool_times.append(times)
        del self._pool_times[: max(len(self._pool_times) - 64, 0)]

    def _update_async_thresholds(self) -> None:
        """Relax the non-bottleneck pools' thresholds to the slack the bottleneck leaves.

        Uses the joint history of default-equivalent pool times (a step lasts as long as the
        slower pool). The bottleneck pool (largest total time) keeps its threshold plus
        ``ASYNC_SLACK / 10`` (per-step noise makes the max of two pools slower than either);
        for each
        other pool p the smallest ratio r with sum(max_i) / sum(max(t_p / r, t_o / theta_o))
        >= theta + ASYNC_SLACK / 25, where the other pools run at ``_expected_ratio`` (their
        threshold, or their lock's lower confidence bound where that is higher).
        """
        hist = self._pool_times
        if len(hist) < ASYNC_MIN_HISTORY:
            return
        theta = min(pc.settings.min_throughput_ratio for pc in self.phases.values())
        totals = {name: sum(h[name] for h in hist) for name in self.phases}
        bottleneck = max(totals, key=lambda n: totals[n])
        base_total = sum(max(h.values()) for h in hist)
        order = sorted(self.phases, key=lambda n: n != bottleneck)
        for name in order:
            pc = self.phases[name]
            if name == bottleneck:
                # The slower pool sets the step time; keep a margin for the step-to-step max().
                pc.threshold = min(1.0, pc.settings.min_throughput_ratio + ASYNC_SLACK / 10)
                pc.idle_credit = 0.0
                continue
            pc.idle_credit = self._idle_credit(name)
            need = pc.settings.min_throughput_ratio
            others = {o: self._expected_ratio(o) for o in self.phases if o != name}
            for step in range(30, 101):
                r = step / 100.0
                total = 0.0
                for h in hist:
                    total += max(
                        t / (r if other == name else others[other]) for other, t in h.items()
                    )
                if base_total / total >= theta + ASYNC_SLACK / 25:
                    need = min(need, r)
                    break
            if need < pc.threshold - 1e-9:
                pc.floor_mhz = 0  # floors were measured against the stricter threshold
            pc.threshold = need

    def _idle_credit(self, name: str) -> float:
        """A pool's idle power over its phase's default-governor power (0: unknown)."""
        pc = self.phases[name]
        j, gpu_s, gpus = self._pool_idle.get(name, (0.0, 0.0, 0))
        if gpu_s <= 0 or pc.default_s <= 0 or pc.default_j <= 0:
            return 0.0
        return min((j / gpu_s) * gpus / (pc.default_j / pc.default_s), 1.0)

    def _expected_ratio(self, name: str) -> float:
        """Throughput ratio a pool is expected to run at: its threshold, or its lock's if higher.

        A lock sits at or above its threshold by the clock grid and the confidence margin; the
        fit's estimate at the lock (never below the threshold) is the slack the other pools may
        use.
        """
        pc = self.phases[name]
        clock, fit = pc.locked_clock_mhz, pc.fit
        if pc.state is not base.PhaseState.LOCKED or fit is None:
            return pc.threshold
        if clock is None:
            return 1.0
        return min(
            max(pc.threshold, fit.throughput_lower_bound(clock, self.settings.confidence_z)), 1.0
        )

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
                "probe_evidence": pc.probe_evidence,
            }
        return out


_EMPTY = api_workload.TokenWorkload(0, 0.0, 0.0, 0.0, 0.0)
