"""Vocabulary of FlexFloor planning: the MoE memory layout, a worker's state, release outcomes.

FlexFloor (docs/flexfloor.md) plans an expert-parallel (EP) MoE rollout: which rollout worker
decodes which prompt, and when a worker whose own responses are done may leave the EP group
while every expert stays available to the all-to-all. Everything here is pure data: the
planner modules (``predictor``, ``placement``, ``release``, ``protocol``) are deterministic and
do no I/O; the step index (one decode step = one token for every running response, taken by
all EP ranks together) is the only clock they know.

Callers: ``rlenergy.sim.moe`` (the simulator), the trainer SDK (``rlenergy.sdk``) and, later,
the operator's rollout handler, which turns ``ReleaseDecision``s into parked GPUs or a smaller
worker set.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from rlenergy import errors


@dataclasses.dataclass(frozen=True)
class MoeLayout:
    """Memory layout of one EP rollout group: what every rollout worker must hold.

    Attributes:
        num_experts: routed experts per MoE layer (E); expert ``e`` means expert ``e`` of every
            MoE layer, which is how EP shards them (Qwen3-30B-A3B: 128).
        expert_bytes: weights of one expert index over all MoE layers, bytes.
        dense_bytes: non-expert weights (attention, embeddings, router) resident on every
            worker, bytes.
        kv_bytes_per_token: KV cache per token of context, bytes (layers x KV heads x head
            dim x 2 (K and V) x dtype bytes).
        worker_memory_bytes: memory a worker may use for weights and KV cache, bytes (GPU
            memory x the engine's memory utilisation, e.g. vLLM ``gpu_memory_utilization``).
        min_active_workers: the policy's ``minActiveWorkers``: never release below this.
    """

    num_experts: int
    expert_bytes: int
    dense_bytes: int
    kv_bytes_per_token: int
    worker_memory_bytes: int
    min_active_workers: int = 1

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise errors.InvalidInputError("experts", f"need >= 1 expert, got {self.num_experts}")
        for name in ("expert_bytes", "dense_bytes", "kv_bytes_per_token", "worker_memory_bytes"):
            if getattr(self, name) < 0:
                raise errors.InvalidInputError(name, "must be >= 0")
        if self.min_active_workers < 1:
            raise errors.InvalidInputError(
                "minActiveWorkers", f"must be >= 1, got {self.min_active_workers}"
            )
        if self.dense_bytes + self.expert_bytes > self.worker_memory_bytes:
            raise errors.InvalidInputError(
                "rollout.experts",
                f"one worker cannot hold the dense weights ({self.dense_bytes / 1e9:.1f} GB) and "
                f"one expert ({self.expert_bytes / 1e9:.2f} GB) in "
                f"{self.worker_memory_bytes / 1e9:.1f} GB",
            )

    @property
    def expert_slots_per_worker(self) -> int:
        """Experts one worker can hold with no KV cache at all (dense weights resident)."""
        if self.expert_bytes == 0:
            return self.num_experts
        return (self.worker_memory_bytes - self.dense_bytes) // self.expert_bytes

    def expert_floor(self) -> int:
        """Fewest workers that can hold every expert once (see ``expert_floor``)."""
        return expert_floor(self.num_experts, self.expert_slots_per_worker)

    def kv_budget_bytes(self, ranks: int) -> tuple[int, ...]:
        """KV memory per rank of a ``ranks``-rank group at start-up, bytes, shape ``(ranks,)``.

        EP shards the experts in even contiguous blocks of ``ceil(num_experts / ranks)``
        (``rlenergy.sim.moe.RolloutConfig.initial_experts`` places them the same way); a
        rank's KV budget is ``worker_memory_bytes - dense_bytes - experts x expert_bytes``,
        at least 0.

        Raises:
            InvalidInputError: ``ranks < 1``.
        """
        if ranks < 1:
            raise errors.InvalidInputError("workers", "need at least one rollout worker")
        shard = math.ceil(self.num_experts / ranks)
        held = [max(min((w + 1) * shard, self.num_experts) - w * shard, 0) for w in range(ranks)]
        free = self.worker_memory_bytes - self.dense_bytes
        return tuple(max(free - k * self.expert_bytes, 0) for k in held)

    def release_floor(self) -> int:
        """Fewest workers a release may leave: the expert floor or ``minActiveWorkers``."""
        return max(self.expert_floor(), self.min_active_workers)


def expert_floor(num_experts: int, expert_slots_per_worker: int) -> int:
    """Fewest EP workers that hold all experts: ``ceil(num_experts / slots_per_worker)``.

    This is the check vLLM added after a DP2->DP1 shrink killed its engine (vllm-project/vllm PR
    #52702; docs/troubleshooting.md, "Shrinking expert parallelism below the floor"): with
    ``current_dp`` ranks and ``num_physical_experts`` expert slots in total, the minimum is
    ``ceil(num_experts * current_dp / num_physical_experts)``, i.e.
    ``slots_per_worker = num_physical_experts / current_dp``.

    Args:
        num_experts: logical experts per MoE layer.
        expert_slots_per_worker: experts one worker holds (physical slots per rank).

    Returns:
        The minimum worker count (>= 1).

    Raises:
        InvalidInputError: ``expert_slots_per_worker < 1`` (no worker can hold an expert).
    """
    if expert_slots_per_worker < 1:
        raise errors.InvalidInputError(
            "rollout.experts", "a worker cannot hold a single expert: no valid worker set"
        )
    return max(1, math.ceil(num_experts / expert_slots_per_worker))


def validate_parallelism(data_parallel_size: int, expert_parallel_size: int) -> None:
    """Refuse DP/EP combinations that hang or cannot shrink.

    FlexFloor releases data-parallel attention ranks of one expert-parallel group, so the
    rollout must run EP across its DP ranks: ``expert_parallel_size == data_parallel_size``
    (verl #5607: DP > 1 with EP = 1 hung because DP settings were only passed when EP > 1).

    Raises:
        InvalidInputError: a non-positive size, or EP differing from DP; the message says what
            to set.
    """
    if data_parallel_size < 1 or expert_parallel_size < 1:
        raise errors.InvalidInputError(
            "rollout.parallelism", "data and expert parallel sizes must be >= 1"
        )
    if expert_parallel_size != data_parallel_size:
        raise errors.InvalidInputError(
            "rollout.parallelism",
            f"DP={data_parallel_size} with EP={expert_parallel_size} is not an elastic EP "
            "rollout: run expert parallelism across all data-parallel ranks (EP = DP), or "
            "leave rollout release off for this job",
        )


@dataclasses.dataclass(frozen=True)
class WorkerState:
    """What the planner knows of one active rollout worker at a decode step.

    Attributes:
        worker: the worker's rank in the EP group (stable for the whole rollout).
        experts: the expert indices resident on the worker.
        unfinished: responses placed on the worker that have not finished (queued or running).
        kv_bytes: KV cache in use now, bytes.
        kv_reserved_bytes: predicted further KV growth of its unfinished responses, bytes (the
            planner keeps this free when it moves experts onto the worker).
        running: responses the worker decodes in the current decode step (its attention
            batch); the cost-aware guard's step-time model reads it.
        remaining_steps: predicted decode steps until the worker's last unfinished response
            ends (0 when it has none), from the length predictor; the guard's horizon is the
            largest value over the group.
        remaining_profile: predicted remaining decode steps of each unfinished response on
            the worker (any order); lets the guard forecast how the batch shrinks. Empty:
            the batch is taken as constant for ``remaining_steps``.
    """

    worker: int
    experts: frozenset[int]
    unfinished: int
    kv_bytes: int
    kv_reserved_bytes: int = 0
    running: int = 0
    remaining_steps: float = 0.0
    remaining_profile: tuple[float, ...] = ()

    def free_bytes(self, layout: MoeLayout) -> int:
        """Memory the worker can still give to migrated experts, bytes (may be < 0)."""
        used = (
            layout.dense_bytes
            + len(self.experts) * layout.expert_bytes
            + self.kv_bytes
            + self.kv_reserved_bytes
        )
        return layout.worker_memory_bytes - used


@dataclasses.dataclass(frozen=True)
class ExpertMove:
    """Copy one expert's weights from a leaving worker to a survivor before the release."""

    expert: int
    source: int
    target: int


class RefusalReason(enum.Enum):
    """Why a release was refused (stable strings for conditions and logs)."""

    UNFINISHED = "WorkerBusy"
    """The worker still has unfinished responses."""
    BELOW_MIN_ACTIVE = "BelowMinActiveWorkers"
    """The release would leave fewer than ``minActiveWorkers``."""
    BELOW_FLOOR = "BelowExpertFloor"
    """The release would leave fewer workers than can hold every expert."""
    ORPHAN_EXPERT = "ExpertWouldBeOrphaned"
    """An expert would have no replica among the survivors and no survivor has room for it."""
    UNKNOWN_WORKER = "UnknownWorker"
    """The worker is not in the active set."""
    OCCUPANCY_WOULD_RISE = "OccupancyWouldRise"
    """The release is allowed by the rule but the step-time model predicts more occupied
    GPU-seconds for the rest of the rollout step with it than without it."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A release the planner refused, with a message a person can act on."""

    worker: int
    reason: RefusalReason
    message: str


@dataclasses.dataclass(frozen=True)
class ReleasePlan:
    """Workers that may leave now, the expert copies that must happen first, and refusals.

    Attributes:
        release: workers to release, ascending.
        moves: expert copies onto survivors, applied before the release step.
        refused: candidates that may not leave, each with its reason.
        active_after: the active worker set after the release, ascending.
        predicted_keep_gpu_s: with a ``StepCostModel``: predicted occupied GPU-seconds for the
            rest of the rollout step if nobody leaves, GPU-s; ``None`` without one.
        predicted_gpu_s: with a ``StepCostModel``: the same prediction with this plan applied
            (copy stall included), GPU-s; ``None`` without one.
    """

    release: tuple[int, ...]
    moves: tuple[ExpertMove, ...]
    refused: tuple[Refusal, ...]
    active_after: tuple[int, ...]
    predicted_keep_gpu_s: float | None = None
    predicted_gpu_s: float | None = None


@dataclasses.dataclass(frozen=True)
class ReleaseDecision:
    """A release every EP rank must apply at the same decode step, or all must abort.

    Attributes:
        decision_id: unique per rollout (monotonic).
        release: workers that leave the EP group.
        moves: expert copies that must be loaded on survivors before ``apply_at_step``.
        active_before: the EP group when the decision was made; every member must ack.
        decided_at_step: decode step at which the planner decided.
        ack_deadline_step: a rank that has not acknowledged when the group reaches this step
            makes the whole release abort (the group stays ``active_before``).
        apply_at_step: the first decode step taken without the released workers
            (``> ack_deadline_step``).
    """

    decision_id: int
    release: tuple[int, ...]
    moves: tuple[ExpertMove, ...]
    active_before: tuple[int, ...]
    decided_at_step: int
    ack_deadline_step: int
    apply_at_step: int

    @property
    def active_after(self) -> tuple[int, ...]:
        """The EP group from ``apply_at_step`` on, if the release commits."""
        gone = set(self.release)
        return tuple(w for w in self.active_before if w not in gone)


class StepCostModel(Protocol):
    """Predicts what one decode step of an EP group costs (pure; injected into the planner).

    The planner calls it on hypothetical groups (the workers left after a release, with the
    experts copied onto them), so it must depend only on its arguments: no I/O, no clock.
    ``rlenergy.sim.moe.DecodeStepModel`` is the simulator's implementation; a deployment
    fits one to its engine's measured decode-step times.
    """

    def decode_step_s(self, workers: Sequence[WorkerState]) -> float:
        """Wall time of one decode step taken by exactly ``workers``, s (> 0)."""
        ...

    def copy_s(self, moves: Sequence[ExpertMove]) -> float:
        """Stall of the whole group while ``moves`` are copied before the apply step, s."""
        ...


class ReleasePlanner(Protocol):
    """Decides which finished rollout workers may leave at a decode step."""

    def plan(self, workers: Sequence[WorkerState], step: int) -> ReleasePlan:
        """Plan releases for the active ``workers`` at decode ``step`` (pure)."""
        ...


def expert_hosts(workers: Sequence[WorkerState]) -> Mapping[int, tuple[int, ...]]:
    """Map every expert to the workers hosting it (ascending worker ranks)."""
    hosts: dict[int, list[int]] = {}
    for state in sorted(workers, key=lambda s: s.worker):
        for expert in state.experts:
            hosts.setdefault(expert, []).append(state.worker)
    return {e: tuple(ws) for e, ws in hosts.items()}
