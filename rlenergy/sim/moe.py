"""Expert-parallel MoE rollout simulator: verl-style baseline vs FlexFloor on identical inputs.

A rollout step is a batch of responses decoded by ``W`` rollout workers that form one
expert-parallel (EP) group: each worker (one GPU) holds the dense weights, a shard of the
experts and the KV cache of its own responses (data-parallel attention). Every decode step is
taken by all active workers together: each runs attention on its own batch, tokens go to their
experts and back through two all-to-alls per MoE layer, so a worker with no response left still
steps (a dummy batch) while its experts are needed. That idle-but-occupied time is what
FlexFloor removes.

The cost of a decode step is ``rlenergy.sim.moe_cost``'s (the model shapes are
``rlenergy.sim.moe_models``'); this module is the event loop that runs a batch on it.

Policies: ``baseline`` places with ``placement.place_even`` (verl ``DataProto.chunk``) and keeps
every worker until the last response ends; ``flexfloor`` predicts lengths
(``predictor.LengthPredictor``), places with ``placement.place_lockstep`` (longest predicted
first, dealt so that the lock-stepped ranks carry equal loads at every decode step; the guard
keeps the even placement unless the dealt one is forecast cheaper), and whenever a worker
runs out of responses asks ``release.FlexFloorPlanner`` for a release, committed through
``protocol.ReleaseRound`` (acks, deadline, abort). Expert copies cost their transfer time as a
stall at the apply step. Invariants are checked at every decode step: every expert hosted by an
active worker, no worker above its memory; every response must complete (a released worker
stops decoding, so a response it still held is lost and counted incomplete).

A pool of independent replicas of such a group (verl's engine replicas, each progressing on its
own, all waiting at the RL step barrier) is ``simulate_pool``: the baseline keeps every GPU
until the slowest replica ends; FlexFloor also frees a replica whose responses are all done.

Callers: ``rlenergy.sim.rollout_report`` (CLI ``rollout-sim``, ``bench/rollout.py``) and the
simulated ``ElasticEngine`` in ``rlenergy.sim.moe_engine``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

import numpy as np

from rlenergy import errors
from rlenergy.control.moe import base, placement, predictor, protocol, release
from rlenergy.sim.moe_cost import (
    DECODE_MFU,
    MAX_RUNNING_PER_WORKER,
    DecodeStepModel,
    Fabric,
    FloatArray,
    IntArray,
    RolloutConfig,
    StepModel,
    fluid_model,
    step_model_for,
)
from rlenergy.sim.moe_models import GPU_MEMORY_GB, GPU_MEMORY_UTILIZATION, MOE_MODELS, MoeModel

__all__ = [
    "DECODE_MFU",
    "GPU_MEMORY_GB",
    "GPU_MEMORY_UTILIZATION",
    "KV_HEADROOM_STEPS",
    "MAX_RUNNING_PER_WORKER",
    "MOE_MODELS",
    "PLAN_RETRY_STEPS",
    "RELEASE_MAX_SLOWDOWN",
    "DecodeStepModel",
    "Fabric",
    "MoeModel",
    "Placement",
    "Policy",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutResult",
    "StepModel",
    "fluid_model",
    "predictor_for",
    "simulate_pool",
    "simulate_rollout",
    "step_model_for",
]


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """One rollout step's responses (identical for both policies).

    Attributes:
        prompt_ids: prompt id per response, shape ``(n,)`` (a GRPO group shares one).
        prompt_tokens: prompt length per response, tokens, shape ``(n,)``.
        lengths_tokens: true response length per response, tokens (>= 1), shape ``(n,)``.
    """

    prompt_ids: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    lengths_tokens: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """One policy on one rollout step.

    Attributes:
        policy: ``baseline`` or ``flexfloor``.
        wall_s: rollout time, first decode step to last token, s.
        decode_steps: decode steps taken.
        tokens: response tokens delivered (recomputed tokens after preemption not counted).
        occupied_gpu_s: sum over workers of the time each stayed in the EP group, GPU-s.
        idle_after_finish_gpu_s: sum over workers of time in the group after their own last
            response ended, GPU-s.
        finish_s: per worker, when its last response ended, s, shape ``(workers,)``.
        release_s: per worker, when it left the group (``wall_s`` if it never left), s.
        expert_unavailable_steps: decode steps on which some expert had no active host.
        memory_overflow_steps: decode steps on which some active worker exceeded its memory.
        incomplete_responses: responses not finished at the end, those lost on a worker
            released before they finished included (must be 0).
        releases_committed: release rounds committed.
        releases_aborted: release rounds aborted (missed deadline or refusal).
        expert_moves: expert copies made.
        preemptions: responses preempted for KV memory (recomputed later).
        active_workers_min: fewest workers in the group at any decode step.
    """

    policy: str
    wall_s: float
    decode_steps: int
    tokens: int
    occupied_gpu_s: float
    idle_after_finish_gpu_s: float
    finish_s: tuple[float, ...]
    release_s: tuple[float, ...]
    expert_unavailable_steps: int
    memory_overflow_steps: int
    incomplete_responses: int
    releases_committed: int
    releases_aborted: int
    expert_moves: int
    preemptions: int
    active_workers_min: int


class _Round:
    """A release round in flight in the simulator (ack arrival per rank)."""

    def __init__(self, decision: base.ReleaseDecision, ack_at_step: Mapping[int, int]) -> None:
        self.round = protocol.ReleaseRound(decision)
        self.ack_at_step = dict(ack_at_step)


KV_HEADROOM_STEPS = 128
"""Decode steps of KV growth a preemption frees room for, and an admission must leave room
for [MODEL: vLLM frees exactly one step's blocks; freeing 16 steps' (under 1 % of the KV cache
at 150 running responses of a 72B model) batches the preemptions of a KV-bound engine into
one event instead of one per step, which made a 600-response engine 16x cheaper to
simulate]."""

RELEASE_MAX_SLOWDOWN = 0.02
"""The job owner's slowdown allowance a release may spend: a release whose forecast lengthens
the rest of the rollout step by more than 2 % is refused (``FlexFloorPlanner``'s
``max_slowdown``). Not a model constant: the owner's throughput floor of 0.98, as
``minThroughputRatio`` is for the clocks; per release, so several releases can add up."""

PLAN_RETRY_STEPS = 64
"""Decode steps before the planner is asked again after it released nobody [MODEL]."""


class Policy(enum.StrEnum):
    """Which rollout policy a simulation runs."""

    BASELINE = "baseline"
    """verl: even placement (``placement.place_even``), every worker kept to the end."""
    FLEXFLOOR = "flexfloor"
    """Predicted-length placement and releases of workers whose responses are done."""


class Placement(enum.StrEnum):
    """How FlexFloor places the responses on the ranks of one EP group."""

    LOCKSTEP = "lockstep"
    """``placement.place_lockstep_within``: equal loads on the lock-stepped ranks at every
    step, longest first, kept within each rank's KV budget (the policy; the trainer SDK's
    planner calls the same rule)."""
    LENGTH = "length"
    """``placement.place_by_length``: concentrate long responses on few ranks (kept for
    comparison: tests drive early finishes with it)."""


def simulate_rollout(
    config: RolloutConfig,
    batch: RolloutBatch,
    *,
    policy: str,
    predictions: Sequence[float] | None = None,
    dropped_acks: Mapping[int, frozenset[int]] | None = None,
    check_every_step: bool = True,
    guard: bool = True,
    coarse: bool = True,
    residual: predictor.ResidualLength | None = None,
    prediction_log_sigma: Sequence[float] | None = None,
    max_length_tokens: float | None = None,
    placement_mode: str = Placement.LOCKSTEP,
) -> RolloutResult:
    """Decode one batch under ``policy`` and check the invariants at every decode step.

    Event-driven: a decode step on which something discrete happens (a response finishes, is
    admitted or preempted, a release round acks, commits or aborts, the planner is asked) is
    simulated on its own; the quiet steps between two such events, where the batch is constant
    and only contexts grow, are advanced together (``coarse=True``): their times come from
    ``DecodeStepModel.steps_s`` in one vectorised call, and the invariants are evaluated in
    closed form for every one of them (hosted experts do not change between events; KV grows
    linearly, so the first overflowing step is computed, not sampled). ``coarse=False`` steps
    one at a time; both give the same result up to float summation order.

    Args:
        config: the EP group.
        batch: the responses; both policies must get the same batch.
        policy: ``baseline`` or ``flexfloor`` (``Policy``).
        predictions: predicted response length per response, tokens (FlexFloor placement,
            memory reservation and the guard's horizon); ``None``: every response predicted at
            the batch median.
        dropped_acks: fault injection: decision id -> ranks whose ack never arrives (the
            round must abort at its deadline and the group stay whole).
        check_every_step: run the invariant checks on every decode step (tests, bench).
        guard: FlexFloor only: give the planner the cost-aware guard (``DecodeStepModel``);
            ``False`` releases whenever the rule allows (for comparison).
        coarse: advance quiet decode steps together (see above).
        residual: remaining-length model for responses past their prediction (the guard's
            horizon); ``None``: such a response is expected to end at the next step.
        prediction_log_sigma: per response, the predictor's log error
            (``LengthPredictor.log_error_sigma``): the placement guard forecasts over it
            (``placement.expected_occupied_gpu_s``); ``None``: point predictions.
        max_length_tokens: the run's ``max_response_length`` (caps the forecast's draws).
        placement_mode: FlexFloor only: ``lockstep`` or ``length`` (``Placement``).

    Returns:
        The result, with its invariant-violation counters.

    Raises:
        InvalidInputError: unknown policy or placement, inputs of different lengths, or a
            response whose prompt alone does not fit its worker.
    """
    if policy not in tuple(Policy):
        raise errors.InvalidInputError("policy", f"unknown policy {policy!r}")
    if placement_mode not in tuple(Placement):
        raise errors.InvalidInputError("placement", f"unknown placement {placement_mode!r}")
    n = len(batch.lengths_tokens)
    if len(batch.prompt_tokens) != n or len(batch.prompt_ids) != n:
        raise errors.InvalidInputError("batch", "prompt ids, prompt tokens and lengths differ")
    rollout = _Rollout(
        config,
        batch,
        Policy(policy),
        predictions=predictions,
        dropped_acks=dropped_acks or {},
        guard=guard,
    )
    if rollout.policy is Policy.FLEXFLOOR:
        rollout.place_flexfloor(Placement(placement_mode), prediction_log_sigma, max_length_tokens)
    rollout.start(residual)
    return rollout.run(check_every_step=check_every_step, coarse=coarse)


class _Rollout:
    """One batch decoded by one EP group under one policy: the event loop's state and steps.

    Responses move ``queued -> running -> done`` (or back to ``queued`` when preempted, or to
    ``lost`` when their worker is released); ``generated`` counts each one's tokens.
    """

    def __init__(
        self,
        config: RolloutConfig,
        batch: RolloutBatch,
        policy: Policy,
        *,
        predictions: Sequence[float] | None,
        dropped_acks: Mapping[int, frozenset[int]],
        guard: bool,
    ) -> None:
        n = len(batch.lengths_tokens)
        self.config = config
        self.batch = batch
        self.policy = policy
        self.guard = guard
        self.drop = dropped_acks
        self.layout = config.layout()
        self.step_model = step_model_for(config)
        self.kvb = self.layout.kv_bytes_per_token
        self.workers = config.workers
        self.experts_of = config.initial_experts()
        self.lengths = np.asarray(batch.lengths_tokens, dtype=np.int64)
        self.prompts = np.asarray(batch.prompt_tokens, dtype=np.int64)
        if predictions is None:
            median = float(np.median(self.lengths)) if n else 1.0
            self.predicted = np.full(n, median)
        else:
            self.predicted = np.asarray(predictions, dtype=np.float64)
        self.worker_of = np.asarray(placement.place_even(n, self.workers), dtype=np.int64)

    def place_flexfloor(
        self,
        mode: Placement,
        prediction_log_sigma: Sequence[float] | None,
        max_length_tokens: float | None,
    ) -> None:
        """FlexFloor's placement, kept only where the guard forecasts it to pay."""
        layout, kvb, workers, n = self.layout, self.kvb, self.workers, len(self.lengths)
        prompt_tokens = self.batch.prompt_tokens
        budgets = [
            layout.worker_memory_bytes - layout.dense_bytes - len(e) * layout.expert_bytes
            for e in self.experts_of
        ]
        pred_list = [float(x) for x in self.predicted]
        rule = (
            placement.place_by_length
            if mode is Placement.LENGTH
            else placement.place_lockstep_within
        )
        candidate: Sequence[int] = rule(pred_list, list(prompt_tokens), budgets, kvb).worker_of
        self.worker_of = np.asarray(candidate, dtype=np.int64)
        if not self.guard or workers <= 1:
            return
        # Placement half of the guard: keep verl's even placement (releases still allowed)
        # when the candidate is forecast not to pay. Both are forecast over the
        # predictions' error (common draws), so a worker holding many responses predicted
        # alike is charged for the longest it will likely hold.
        even = placement.place_even(n, workers)
        shards = [frozenset(e) for e in self.experts_of]
        sigma = list(prediction_log_sigma) if prediction_log_sigma is not None else [0.0] * n
        placed_cost, spread = (
            placement.expected_occupied_gpu_s(
                option,
                pred_list,
                sigma,
                prompt_tokens,
                shards,
                layout,
                self.step_model,
                elastic=True,
                max_tokens=max_length_tokens,
            )
            for option in (candidate, even)
        )
        if spread <= placed_cost:
            # verl's chunks, kept within each rank's KV budget like the candidate.
            kept = placement.fit_kv_budget(even, pred_list, prompt_tokens, budgets, kvb)
            self.worker_of = np.asarray(kept.worker_of, dtype=np.int64)

    def start(self, residual: predictor.ResidualLength | None) -> None:
        """Every response queued, every worker active, the release planner ready."""
        n, workers = len(self.lengths), self.workers
        self.residual = residual
        self.queued = np.ones(n, dtype=bool)
        self.running = np.zeros(n, dtype=bool)
        self.done = np.zeros(n, dtype=bool)
        self.lost = np.zeros(n, dtype=bool)  # on a released worker: never complete
        self.generated = np.zeros(n, dtype=np.int64)
        self.admit_seq = np.zeros(n, dtype=np.int64)  # admission order (preempt the newest)
        self.seq = 0
        self.active = [True] * workers
        self.finish_s = [0.0] * workers
        self.release_s = [-1.0] * workers
        self.worker_done = [False] * workers
        self.planner = release.FlexFloorPlanner(
            self.layout, self.step_model if self.guard else None, max_slowdown=RELEASE_MAX_SLOWDOWN
        )
        self.rounds: _Round | None = None
        self.decision_id = 0
        self.retry_at_step = 0
        self.time_s = 0.0
        self.step = 0
        self.occupied = 0.0
        self.idle_after = 0.0
        self.unavailable = self.overflow = 0
        self.committed = self.aborted = self.moves_made = self.preemptions = 0
        self.min_active = workers
        self.all_experts = set(range(self.config.experts))
        self.order = np.argsort(self.worker_of, kind="stable")  # queue order per worker
        for w in range(workers):
            if not (self.worker_of == w).any():
                self.worker_done[w] = True  # nothing placed on it: finished from the start

    # ----- the loop ------------------------------------------------------------------------
    def run(self, *, check_every_step: bool, coarse: bool) -> RolloutResult:
        """Decode until every response is done or lost; the result."""
        while not self.finished():
            active_ranks = self.schedule()
            if check_every_step:
                self.check_invariants(active_ranks, 1)
            self.decode_step(active_ranks)
            if self.policy is Policy.FLEXFLOOR:
                self.advance_round()
                self.ask_planner()
            if not coarse or self.finished():
                continue
            self.quiet_run(check_every_step)
        return self.result()

    def finished(self) -> bool:
        """Every response done or lost."""
        return bool((self.done | self.lost).all())

    def active_ranks(self) -> list[int]:
        """The workers still in the group."""
        return [w for w in range(self.workers) if self.active[w]]

    def schedule(self) -> list[int]:
        """Admit and preempt as the engines would before a decode step; the active ranks.

        Raises:
            InvalidInputError: nothing runs (a prompt does not fit its worker).
        """
        if self.queued.any():
            self.admit()
        self.preempt_for_growth()
        active_ranks = self.active_ranks()
        self.min_active = min(self.min_active, len(active_ranks))
        if not self.running.any():
            raise errors.InvalidInputError(
                "batch", "a response cannot be admitted on its worker (prompt larger than memory)"
            )
        return active_ranks

    def decode_step(self, active_ranks: list[int]) -> None:
        """One decode step of the running batch: time, tokens, finishes."""
        workers, worker_of, done = self.workers, self.worker_of, self.done
        run_idx = np.flatnonzero(self.running)
        dt = float(self.step_model.steps_s(*self.batch_shape(active_ranks))[0])
        self.generated[run_idx] += 1
        finished = run_idx[self.generated[run_idx] >= self.lengths[run_idx]]
        self.running[finished] = False
        done[finished] = True
        self.time_s += dt
        self.step += 1
        self.occupied += dt * len(active_ranks)
        if finished.size:
            left = np.bincount(worker_of[~done], minlength=workers)
            for w in set(worker_of[finished].tolist()):
                if left[w] == 0 and not self.worker_done[w]:
                    self.worker_done[w] = True
                    self.finish_s[w] = self.time_s
        self.idle_after += dt * sum(1 for w in active_ranks if self.worker_done[w])

    def quiet_run(self, check_every_step: bool) -> None:
        """The quiet steps until the next event, all at once (``simulate_rollout``)."""
        active_ranks = self.active_ranks()
        quiet = self.quiet_steps(active_ranks)
        if quiet <= 0:
            return
        if check_every_step:
            self.check_invariants(active_ranks, quiet)
        dts = self.step_model.steps_s(*self.batch_shape(active_ranks), growth_steps=quiet)
        span = float(dts.sum())
        self.generated[self.running] += quiet
        self.time_s += span
        self.step += quiet
        self.occupied += span * len(active_ranks)
        self.idle_after += span * sum(1 for w in active_ranks if self.worker_done[w])

    # ----- FlexFloor releases ----------------------------------------------------------------
    def advance_round(self) -> None:
        """Deliver the acks due, then commit (apply the moves, release) or abort the round."""
        if self.rounds is None:
            return
        step = self.step
        r = self.rounds.round
        for rank, at in self.rounds.ack_at_step.items():
            if step >= at and rank not in self.drop.get(r.decision.decision_id, frozenset()):
                r.ack(rank, r.decision.decision_id)
        status = r.advance(step)
        if status is protocol.RoundStatus.ABORTED:
            self.aborted += 1
            self.rounds = None
            self.retry_at_step = step + self.config.timing.ack_window_steps
        elif status is protocol.RoundStatus.COMMITTED and step >= r.decision.apply_at_step:
            self.commit(r.decision)
            self.rounds = None

    def commit(self, decision: base.ReleaseDecision) -> None:
        """Apply a committed release: copy the experts, release the workers."""
        active_ranks = self.active_ranks()
        for move in decision.moves:
            self.experts_of[move.target].add(move.expert)
        self.moves_made += len(decision.moves)
        # The copies run before the apply step; conservatively charge them as a
        # stall of the whole group (they share HBM and links with decoding) [MODEL].
        stall = self.step_model.copy_s(decision.moves)
        self.time_s += stall
        self.occupied += stall * len(active_ranks)
        for w in decision.release:
            self.active[w] = False
            self.release_s[w] = self.time_s
        # A released worker stops decoding: what it still held is lost.
        gone = ~self.done & np.isin(self.worker_of, decision.release)
        self.lost |= gone
        self.queued[gone] = self.running[gone] = False
        self.committed += 1

    def ask_planner(self) -> None:
        """Ask the planner for a release while a finished worker is in the group."""
        step, workers = self.step, self.workers
        if self.rounds is not None or step < self.retry_at_step:
            return
        candidates = [w for w in range(workers) if self.active[w] and self.worker_done[w]]
        if not candidates or self.finished():
            return
        plan = self.planner.plan(self.worker_states(), step)
        if not plan.release:
            self.retry_at_step = step + PLAN_RETRY_STEPS  # wait for the batch to change
            return
        decision = protocol.make_decision(
            plan,
            decision_id=self.decision_id,
            active_before=tuple(w for w in range(workers) if self.active[w]),
            step=step,
            timing=self.config.timing,
        )
        self.decision_id += 1
        self.rounds = _Round(decision, {w: step + 1 for w in decision.active_before})

    # ----- the engines' memory ------------------------------------------------------------
    def kv_bytes_per_worker(self) -> FloatArray:
        """KV cache bytes of the running responses per worker."""
        running = self.running
        ctx = (self.prompts + self.generated).astype(np.float64)
        out: FloatArray = np.bincount(
            self.worker_of[running], weights=ctx[running] * self.kvb, minlength=self.workers
        ).astype(np.float64)
        return out

    def kv_capacity(self, w: int) -> int:
        """Bytes worker ``w`` has for KV beside its dense weights and resident experts."""
        layout = self.layout
        return (
            layout.worker_memory_bytes
            - layout.dense_bytes
            - len(self.experts_of[w]) * layout.expert_bytes
        )

    def fits(self, kv_w: float, need: float, count: int, w: int) -> bool:
        """Whether an admission of ``need`` bytes leaves ``KV_HEADROOM_STEPS`` of growth."""
        # vLLM V1 schedules the running requests' next token first and admits a waiting one
        # only into the blocks left after that, so an admission never forces a preemption
        # in the same step.
        return kv_w + need + (count + 1) * self.kvb * KV_HEADROOM_STEPS <= self.kv_capacity(w)

    def admit(self) -> None:
        """Admit queued responses, FIFO per worker, while they fit."""
        worker_of, queued, workers = self.worker_of, self.queued, self.workers
        kv = self.kv_bytes_per_worker()
        counts = np.bincount(worker_of[self.running], minlength=workers)
        blocked: set[int] = set()  # FIFO per worker: the head waits, so does the rest
        for i in self.order[queued[self.order]]:
            w = int(worker_of[i])
            if w in blocked:
                continue
            need = float((self.prompts[i] + 1) * self.kvb)
            if counts[w] < MAX_RUNNING_PER_WORKER and self.fits(kv[w], need, counts[w], w):
                queued[i] = False
                self.running[i] = True
                self.admit_seq[i] = self.seq
                self.seq += 1
                kv[w] += need
                counts[w] += 1
            else:
                blocked.add(w)
                if len(blocked) == workers:
                    break  # every worker's queue head waits: nothing more can be admitted

    def admissible(self) -> bool:
        """Would ``admit`` admit anything now (the head of some worker's queue fits)?"""
        worker_of, queued, workers = self.worker_of, self.queued, self.workers
        if not queued.any():
            return False
        kv = self.kv_bytes_per_worker()
        counts = np.bincount(worker_of[self.running], minlength=workers)
        seen: set[int] = set()
        for i in self.order[queued[self.order]]:
            w = int(worker_of[i])
            if w in seen:
                continue
            seen.add(w)
            need = float((self.prompts[i] + 1) * self.kvb)
            if counts[w] < MAX_RUNNING_PER_WORKER and self.fits(kv[w], need, counts[w], w):
                return True
            if len(seen) == workers:
                break
        return False

    def preempt_for_growth(self) -> None:
        """Preempt (newest first) where the running responses' growth would overflow memory."""
        worker_of, running, kvb = self.worker_of, self.running, self.kvb
        kv = self.kv_bytes_per_worker()
        counts = np.bincount(worker_of[running], minlength=self.workers)
        for w in range(self.workers):
            cap = self.kv_capacity(w)
            if counts[w] == 0 or kv[w] + counts[w] * kvb <= cap:
                continue
            # Preempt (newest first) until the rest can grow KV_HEADROOM_STEPS more steps.
            while counts[w] > 0 and kv[w] + counts[w] * kvb * KV_HEADROOM_STEPS > cap:
                on_w = np.flatnonzero(running & (worker_of == w))
                victim = int(on_w[np.argmax(self.admit_seq[on_w])])
                kv[w] -= float((self.prompts[victim] + self.generated[victim]) * kvb)
                counts[w] -= 1
                running[victim] = False
                self.queued[victim] = True
                self.generated[victim] = 0  # recompute from the prompt (vLLM V1 preemption)
                self.preemptions += 1

    # ----- views ----------------------------------------------------------------------------
    def worker_states(self) -> list[base.WorkerState]:
        """The planner's view of every active worker."""
        worker_of, done, workers, kvb = self.worker_of, self.done, self.workers, self.kvb
        predicted, generated = self.predicted, self.generated
        kv = self.kv_bytes_per_worker()
        unfinished = np.bincount(worker_of[~done], minlength=workers)
        n_running = np.bincount(worker_of[self.running], minlength=workers)
        remaining = np.clip(predicted - generated, 1.0, None)
        if self.residual is not None:
            over = np.flatnonzero(~done & (generated >= predicted))
            for i in over:
                remaining[i] = self.residual.remaining(float(predicted[i]), float(generated[i]))
        remaining_kv = np.bincount(
            worker_of[~done], weights=remaining[~done] * kvb, minlength=workers
        )
        remaining_steps = np.zeros(workers)
        np.maximum.at(remaining_steps, worker_of[~done], remaining[~done])
        left = np.flatnonzero(~done)
        profile: list[list[float]] = [[] for _ in range(workers)]
        for i in left[np.argsort(worker_of[left], kind="stable")]:
            profile[int(worker_of[i])].append(float(remaining[i]))
        return [
            base.WorkerState(
                worker=w,
                experts=frozenset(self.experts_of[w]),
                unfinished=int(unfinished[w]),
                kv_bytes=int(kv[w]),
                kv_reserved_bytes=int(remaining_kv[w]),
                running=int(n_running[w]),
                remaining_steps=float(remaining_steps[w]),
                remaining_profile=tuple(profile[w]),
            )
            for w in range(workers)
            if self.active[w]
        ]

    def batch_shape(self, active_ranks: list[int]) -> tuple[IntArray, FloatArray, IntArray]:
        """(running, context tokens, resident experts) per active rank: the step model's input."""
        worker_of, workers = self.worker_of, self.workers
        run_idx = np.flatnonzero(self.running)
        n_w = np.bincount(worker_of[run_idx], minlength=workers)
        ctx_w = np.bincount(
            worker_of[run_idx],
            weights=(self.prompts[run_idx] + self.generated[run_idx]),
            minlength=workers,
        )
        experts_w = np.asarray([len(self.experts_of[w]) for w in active_ranks], dtype=np.int64)
        return n_w[active_ranks], ctx_w[active_ranks].astype(np.float64), experts_w

    def quiet_steps(self, active_ranks: list[int]) -> int:
        """Decode steps from now on which nothing discrete can happen (``simulate_rollout``)."""
        running, worker_of, workers = self.running, self.worker_of, self.workers
        if self.rounds is not None or not running.any():
            return 0
        run_idx = np.flatnonzero(running)
        quiet = int((self.lengths[run_idx] - self.generated[run_idx]).min()) - 1  # next finish
        if self.policy is Policy.FLEXFLOOR and any(
            self.active[w] and self.worker_done[w] for w in range(workers)
        ):
            quiet = min(quiet, self.retry_at_step - self.step - 1)  # the planner is asked then
        if quiet <= 0 or self.admissible():
            return 0
        kv = self.kv_bytes_per_worker()
        n_w = np.bincount(worker_of[run_idx], minlength=workers)
        for w in range(workers):
            if n_w[w]:
                # Preemption check of quiet step j: kv + j x running x kvb > capacity.
                quiet = min(quiet, int((self.kv_capacity(w) - kv[w]) // (n_w[w] * self.kvb)))
        return max(quiet, 0)

    def check_invariants(self, active_ranks: list[int], count: int) -> None:
        """Count violations over ``count`` steps with this batch (contexts growing)."""
        hosted: set[int] = set()
        for w in active_ranks:
            hosted |= self.experts_of[w]
        if hosted != self.all_experts:
            self.unavailable += count
        kv = self.kv_bytes_per_worker()
        n_w = np.bincount(self.worker_of[self.running], minlength=self.workers)
        first_bad = count  # first 0-based step of the run with some worker over memory
        for w in active_ranks:
            cap = self.kv_capacity(w)
            if kv[w] > cap:
                first_bad = 0
            elif n_w[w]:
                first_bad = min(first_bad, int((cap - kv[w]) // (n_w[w] * self.kvb)) + 1)
        self.overflow += max(count - first_bad, 0)

    def result(self) -> RolloutResult:
        """The finished rollout's figures (GPU-s count a worker's ``tensor_parallel`` GPUs)."""
        wall = self.time_s
        rel = tuple(wall if r < 0 else r for r in self.release_s)
        tp = self.config.tensor_parallel  # a worker occupies this many GPUs
        done, lengths = self.done, self.lengths
        return RolloutResult(
            policy=self.policy.value,
            wall_s=wall,
            decode_steps=self.step,
            tokens=int(lengths.sum()),
            occupied_gpu_s=self.occupied * tp,
            idle_after_finish_gpu_s=self.idle_after * tp,
            finish_s=tuple(self.finish_s),
            release_s=rel,
            expert_unavailable_steps=self.unavailable,
            memory_overflow_steps=self.overflow,
            incomplete_responses=int((~done).sum())
            + int((self.generated[done] < lengths[done]).sum()),
            releases_committed=self.committed,
            releases_aborted=self.aborted,
            expert_moves=self.moves_made,
            preemptions=self.preemptions,
            active_workers_min=self.min_active,
        )


def predictor_for(max_response_length: int) -> predictor.LengthPredictor:
    """The FlexFloor length predictor the simulator uses (fallback: the median)."""
    return predictor.LengthPredictor(
        history_epochs=3,
        fallback_quantile=0.5,
        default_length_tokens=max(max_response_length / 2, 1),
    )


def simulate_pool(
    config: RolloutConfig,
    batch: RolloutBatch,
    *,
    replicas: int,
    policy: str,
    predictions: Sequence[float] | None = None,
    check_every_step: bool = True,
    guard: bool = True,
    residual: predictor.ResidualLength | None = None,
    prediction_log_sigma: Sequence[float] | None = None,
    max_length_tokens: float | None = None,
    placement_mode: str = Placement.LOCKSTEP,
) -> RolloutResult:
    """Decode one batch on ``replicas`` independent EP groups of ``config.workers`` ranks each.

    verl runs a rollout pool as independent inference-engine replicas (vLLM / SGLang servers,
    each ``TP x DP x PP`` GPUs; with expert parallelism the DP-attention ranks of a replica
    form one EP group and step together, while replicas progress independently) and waits at
    the RL step barrier for the last one. Within a replica this is ``simulate_rollout``;
    across replicas:

    * ``baseline``: the batch is split into equal contiguous chunks over the replicas
      (``placement.place_even``: verl's ``DataProto.chunk`` / even dispatch), and every GPU
      stays occupied until the slowest replica ends: a replica that ends at ``wall_r`` adds
      ``workers x (wall - wall_r)`` GPU-s of occupied time, all of it idle after finish.
    * ``flexfloor``: the responses are placed on the replicas by ``placement.place_balanced``
      (longest predicted first, each to the replica predicted to finish earliest, with the
      replica's ``FluidFinishModel`` fitted to the step model: memory-aware through its KV
      capacity), unless the guard predicts the even split to end no later; each replica
      places its responses on its DP ranks (``placement_mode``: by default dealt for equal
      per-step loads, since the ranks of one group step together) and releases
      its ranks with the FlexFloor planner, and a replica whose responses are all done
      leaves the pool at once: its experts serve only its own EP group, so no expert becomes
      unavailable to anyone still decoding. (Concentrating predicted-long prompts on few
      replicas, ``placement.place_by_length`` at replica granularity, was measured earlier on
      verl#3727 with 16 one-GPU replicas at x0.773 generation throughput: it lengthens the
      makespan, balancing shortens it.)

    With ``replicas == 1`` this is exactly ``simulate_rollout``. Ranks are numbered replica by
    replica (``finish_s``, ``release_s``); ``active_workers_min`` is the sum of each replica's
    fewest ranks; the wall time is the slowest replica's.

    Raises:
        InvalidInputError: ``replicas < 1``, or as ``simulate_rollout``.
    """
    if replicas < 1:
        raise errors.InvalidInputError("--replicas", f"need >= 1 replica, got {replicas}")
    if policy not in tuple(Policy):
        raise errors.InvalidInputError("policy", f"unknown policy {policy!r}")

    def run(part: RolloutBatch, idx: Sequence[int] | None) -> RolloutResult:
        def pick(values: Sequence[float] | None) -> Sequence[float] | None:
            return values if values is None or idx is None else [values[i] for i in idx]

        return simulate_rollout(
            config,
            part,
            policy=policy,
            predictions=pick(predictions),
            check_every_step=check_every_step,
            guard=guard,
            residual=residual,
            prediction_log_sigma=pick(prediction_log_sigma),
            max_length_tokens=max_length_tokens,
            placement_mode=placement_mode,
        )

    if replicas == 1:
        return run(batch, None)
    n = len(batch.lengths_tokens)
    replica_of = list(placement.place_even(n, replicas))
    if policy == Policy.FLEXFLOOR and predictions is not None:
        # Balance the replicas' predicted finish times (longest first); the guard keeps the
        # even split unless the balanced one is predicted to end no later.
        model = fluid_model(config, per_rank=False)
        preds = [float(x) for x in predictions]
        balanced = list(placement.place_balanced(preds, batch.prompt_tokens, replicas, model))
        makespans = [
            placement.predicted_makespan_s(option, preds, batch.prompt_tokens, replicas, model)
            for option in (balanced, replica_of)
        ]
        if makespans[0] <= makespans[1]:
            replica_of = balanced
    results: list[RolloutResult] = []
    for r in range(replicas):
        idx = [i for i in range(n) if replica_of[i] == r]
        sub = RolloutBatch(
            prompt_ids=tuple(batch.prompt_ids[i] for i in idx),
            prompt_tokens=tuple(batch.prompt_tokens[i] for i in idx),
            lengths_tokens=tuple(batch.lengths_tokens[i] for i in idx),
        )
        if not idx:
            results.append(_empty_result(policy, config.workers))
            continue
        results.append(run(sub, idx))
    wall = max(r.wall_s for r in results)
    g = config.workers * config.tensor_parallel
    barrier = policy == Policy.BASELINE
    wait = sum(g * (wall - r.wall_s) for r in results) if barrier else 0.0
    return RolloutResult(
        policy=policy,
        wall_s=wall,
        decode_steps=max(r.decode_steps for r in results),
        tokens=sum(r.tokens for r in results),
        occupied_gpu_s=sum(r.occupied_gpu_s for r in results) + wait,
        idle_after_finish_gpu_s=sum(r.idle_after_finish_gpu_s for r in results) + wait,
        finish_s=tuple(f for r in results for f in r.finish_s),
        release_s=tuple(wall if barrier else s for r in results for s in r.release_s),
        expert_unavailable_steps=sum(r.expert_unavailable_steps for r in results),
        memory_overflow_steps=sum(r.memory_overflow_steps for r in results),
        incomplete_responses=sum(r.incomplete_responses for r in results),
        releases_committed=sum(r.releases_committed for r in results),
        releases_aborted=sum(r.releases_aborted for r in results),
        expert_moves=sum(r.expert_moves for r in results),
        preemptions=sum(r.preemptions for r in results),
        active_workers_min=sum(r.active_workers_min for r in results),
    )


def _empty_result(policy: str, workers: int) -> RolloutResult:
    """A replica that got no response: it finishes (and, under FlexFloor, leaves) at 0."""
    return RolloutResult(
        policy=policy,
        wall_s=0.0,
        decode_steps=0,
        tokens=0,
        occupied_gpu_s=0.0,
        idle_after_finish_gpu_s=0.0,
        finish_s=(0.0,) * workers,
        release_s=(0.0,) * workers,
        expert_unavailable_steps=0,
        memory_overflow_steps=0,
        incomplete_responses=0,
        releases_committed=0,
        releases_aborted=0,
        expert_moves=0,
        preemptions=0,
        active_workers_min=0,
    )
