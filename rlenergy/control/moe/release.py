"""Progressive rollout-worker release that keeps every expert available (FlexFloor step 3).

Release rule (docs/flexfloor.md, "Release rule"): a worker may leave the EP group only when

1. it has no unfinished response (queued or running);
2. the group keeps at least ``minActiveWorkers`` workers and at least the expert floor
   (``MoeLayout.release_floor``; docs/troubleshooting.md, "Shrinking expert parallelism below
   the floor": a shrink below ``ceil(num_experts * dp / num_physical_experts)`` kills vLLM's
   engine);
3. every expert it hosts keeps a replica on a remaining worker, or is copied to a survivor
   whose free memory (after dense weights, resident experts, KV in use and the KV its
   unfinished responses are predicted to still need) holds it.

``FlexFloorPlanner.plan`` greedily releases every finished worker that passes the rule, in an
order that needs the fewest expert copies first, and returns the copies to make.

Cost-aware guard (with a ``base.StepCostModel``): the rule says when a release is *safe*, not
when it *pays*. A released worker's experts move to survivors, whose memory-bound decode steps
then read more expert weights, and the copies stall the group. So for each prefix of the
greedy order the planner predicts the occupied GPU-seconds for the rest of the rollout step,
``copy_s(moves) x |before| + sum_seg len(seg) x |after| x decode_step_s(after at seg)``,
against keeping the group, ``sum_seg len(seg) x |before| x decode_step_s(before at seg)``.
The segments cut the predicted remaining decode steps at the predicted ends of the unfinished
responses (``WorkerState.remaining_profile``, at most ``FORECAST_SEGMENTS`` cuts), so the
forecast batch shrinks as responses are predicted to end (fewer tokens, fewer touched experts,
less KV); neither branch assumes further releases. It releases the cheapest prefix only if it
is strictly cheaper than keeping and, with ``max_slowdown``, its forecast wall time for the
rest of the step (``copy_s + sum_seg len(seg) x decode_step_s(after at seg)``) is at most
``1 + max_slowdown`` times keeping's; the workers it holds back are refused with
``OccupancyWouldRise``. ``check``
answers for an explicit request and says why a refused worker may not go. The step-synchronous
commit of a plan (same decode step on every rank, deadline, abort) is
``rlenergy.control.moe.protocol``.

``minimum_workers_for_scale`` is the seam for the operator's ``releaseAction: scale`` (shrink a
disaggregated worker set between RL steps): it returns the replica count to refuse below.

Pure and deterministic (ties broken by worker rank, then expert index).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from rlenergy import errors
from rlenergy.control.moe import base


@dataclasses.dataclass
class _Tentative:
    survivors: set[int]
    hosts: dict[int, set[int]]
    free: dict[int, int]
    moves: list[base.ExpertMove]


class FlexFloorPlanner:
    """The FlexFloor release rule over one EP group (implements ``base.ReleasePlanner``).

    Args:
        layout: the group's memory layout and ``minActiveWorkers``.
        cost_model: decode-step time model for the cost-aware guard; ``None`` releases
            whenever the rule allows (no guard).
        max_slowdown: with a cost model: the largest share by which a release may lengthen
            the predicted rest of the rollout step (survivors hold more experts and step
            slower; the copies stall the group); ``None``: no limit. The job owner's
            allowance, as ``minThroughputRatio`` is for the clock (0.02: throughput >= 0.98).

    Raises:
        InvalidInputError: ``max_slowdown < 0``.
    """

    def __init__(
        self,
        layout: base.MoeLayout,
        cost_model: base.StepCostModel | None = None,
        *,
        max_slowdown: float | None = None,
    ) -> None:
        if max_slowdown is not None and max_slowdown < 0:
            raise errors.InvalidInputError("max_slowdown", "must be >= 0")
        self.layout = layout
        self.cost_model = cost_model
        self.max_slowdown = max_slowdown

    def plan(self, workers: Sequence[base.WorkerState], step: int) -> base.ReleasePlan:
        """Release every finished worker that the rule allows at decode ``step``.

        Args:
            workers: the active workers (each rank once).
            step: the decode step (informational; planning depends only on ``workers``).

        Returns:
            The release plan; busy workers are neither released nor listed as refused. With a
            cost model, only the prefix of the greedy order that lowers the predicted occupied
            GPU-seconds (strictly) is released, the rest refused with ``OccupancyWouldRise``,
            and the plan carries both predictions.

        Raises:
            InvalidInputError: a worker rank appears twice.
        """
        del step
        finished = [w for w in workers if w.unfinished == 0]
        # Fewest sole-hosted expert bytes first, then lowest rank: cheap releases go first.
        hosts = base.expert_hosts(workers)
        finished.sort(key=lambda w: (sum(1 for e in w.experts if len(hosts[e]) == 1), w.worker))
        order = [w.worker for w in finished]
        if self.cost_model is None:
            return self._plan(workers, order)
        return self._plan_guarded(workers, order)

    def predicted_occupied_gpu_s(
        self,
        workers: Sequence[base.WorkerState],
        release: Sequence[int] = (),
        moves: Sequence[base.ExpertMove] = (),
    ) -> float:
        """Predicted occupied GPU-seconds for the rest of the step if ``release`` leaves now.

        ``copy_s(moves) x |workers| + H x |after| x decode_step_s(after)`` with ``H`` the
        largest ``remaining_steps`` (decode steps) and ``after`` the survivors holding the
        copied experts.

        Raises:
            InvalidInputError: no cost model was given, or ``release`` empties the group.
        """
        if self.cost_model is None:
            raise errors.InvalidInputError("cost_model", "the planner has no step-time model")
        after = _survivors(workers, release, moves)
        if not after:
            raise errors.InvalidInputError("release", "a release may not empty the EP group")
        return self._forecast(workers, after, moves)[0]

    def _forecast(
        self,
        workers: Sequence[base.WorkerState],
        after: Sequence[base.WorkerState],
        moves: Sequence[base.ExpertMove],
    ) -> tuple[float, float]:
        """``(occupied GPU-s, wall s)`` predicted for the rest of the step with ``after``."""
        assert self.cost_model is not None
        stall = self.cost_model.copy_s(moves) if moves else 0.0
        total, wall = stall * len(workers), stall
        for start, length in _forecast_segments(workers):
            group = [_at(w, start, self.layout.kv_bytes_per_token) for w in after]
            step_s = self.cost_model.decode_step_s(group)
            total += length * len(after) * step_s
            wall += length * step_s
        return total, wall

    def _predicted(
        self,
        workers: Sequence[base.WorkerState],
        release: Sequence[int] = (),
        moves: Sequence[base.ExpertMove] = (),
    ) -> tuple[float, float]:
        return self._forecast(workers, _survivors(workers, release, moves), moves)

    def _plan_guarded(
        self, workers: Sequence[base.WorkerState], order: list[int]
    ) -> base.ReleasePlan:
        snapshots: list[tuple[tuple[int, ...], tuple[base.ExpertMove, ...], tuple[int, ...]]] = []
        full = self._plan(workers, order, snapshots)
        keep, keep_wall = self._predicted(workers)
        best: tuple[float, int] = (keep, -1)
        for k, (released, moves, _) in enumerate(snapshots):
            cost, wall = self._predicted(workers, released, moves)
            slower = self.max_slowdown is not None and wall > keep_wall * (1 + self.max_slowdown)
            if cost < best[0] and not slower:
                best = (cost, k)
        cost, k = best
        chosen: tuple[int, ...] = snapshots[k][0] if k >= 0 else ()
        held = [r for r in order if r in set(full.release) and r not in set(chosen)]
        refused = list(full.refused) + [
            base.Refusal(
                r,
                base.RefusalReason.OCCUPANCY_WOULD_RISE,
                f"releasing worker {r} would not lower the predicted occupied GPU-seconds for "
                f"the rest of the step within the slowdown allowed ({keep:.3g} GPU-s keeping "
                f"the group, {cost:.3g} with the best allowed release)",
            )
            for r in held
        ]
        if k < 0:
            return base.ReleasePlan(
                release=(),
                moves=(),
                refused=tuple(refused),
                active_after=tuple(sorted(w.worker for w in workers)),
                predicted_keep_gpu_s=keep,
                predicted_gpu_s=keep,
            )
        released, moves, survivors = snapshots[k]
        return base.ReleasePlan(
            release=tuple(sorted(released)),
            moves=moves,
            refused=tuple(refused),
            active_after=survivors,
            predicted_keep_gpu_s=keep,
            predicted_gpu_s=cost,
        )

    def check(
        self, workers: Sequence[base.WorkerState], release: Iterable[int]
    ) -> base.ReleasePlan:
        """Evaluate an explicit release request, worker by worker in the order given.

        Returns:
            The plan: ``release`` holds the requested workers that may go, ``refused`` the
            others with a reason and a message naming the limit.

        Raises:
            InvalidInputError: a worker rank appears twice in ``workers``.
        """
        return self._plan(workers, list(release))

    def _plan(
        self,
        workers: Sequence[base.WorkerState],
        candidates: list[int],
        snapshots: list[tuple[tuple[int, ...], tuple[base.ExpertMove, ...], tuple[int, ...]]]
        | None = None,
    ) -> base.ReleasePlan:
        by_rank = {w.worker: w for w in workers}
        if len(by_rank) != len(workers):
            raise errors.InvalidInputError("workers", "a worker rank appears twice")
        layout = self.layout
        floor = layout.expert_floor()
        state = _Tentative(
            survivors=set(by_rank),
            hosts={e: set(ws) for e, ws in base.expert_hosts(workers).items()},
            free={w.worker: w.free_bytes(layout) for w in workers},
            moves=[],
        )
        released: list[int] = []
        refused: list[base.Refusal] = []
        for rank in candidates:
            refusal = self._try_release(rank, by_rank, state, floor, set(candidates))
            if refusal is None:
                released.append(rank)
                if snapshots is not None:
                    snapshots.append(
                        (tuple(released), tuple(state.moves), tuple(sorted(state.survivors)))
                    )
            else:
                refused.append(refusal)
        return base.ReleasePlan(
            release=tuple(sorted(released)),
            moves=tuple(state.moves),
            refused=tuple(refused),
            active_after=tuple(sorted(state.survivors)),
        )

    def _try_release(
        self,
        rank: int,
        by_rank: dict[int, base.WorkerState],
        state: _Tentative,
        floor: int,
        candidates: set[int],
    ) -> base.Refusal | None:
        layout = self.layout
        worker = by_rank.get(rank)
        if worker is None or rank not in state.survivors:
            return base.Refusal(
                rank, base.RefusalReason.UNKNOWN_WORKER, f"worker {rank} is not active"
            )
        if worker.unfinished > 0:
            return base.Refusal(
                rank,
                base.RefusalReason.UNFINISHED,
                f"worker {rank} still has {worker.unfinished} unfinished response(s)",
            )
        left = len(state.survivors) - 1
        if left < layout.min_active_workers:
            return base.Refusal(
                rank,
                base.RefusalReason.BELOW_MIN_ACTIVE,
                f"releasing worker {rank} would leave {left} active worker(s), below "
                f"minActiveWorkers={layout.min_active_workers}",
            )
        if left < floor:
            return base.Refusal(
                rank,
                base.RefusalReason.BELOW_FLOOR,
                f"releasing worker {rank} would leave {left} worker(s): minimum is {floor} "
                f"(expert floor: {layout.num_experts} experts, "
                f"{layout.expert_slots_per_worker} per worker)",
            )
        remaining = state.survivors - {rank}
        orphans = sorted(e for e in worker.experts if not (state.hosts.get(e, set()) & remaining))
        # Also experts copied onto this worker by an earlier tentative move.
        orphans += sorted(
            e
            for e, hs in state.hosts.items()
            if rank in hs and e not in worker.experts and not (hs & remaining)
        )
        free = dict(state.free)
        moves: list[base.ExpertMove] = []
        for expert in orphans:
            # Prefer survivors that are not about to leave themselves, then the most free memory.
            targets = sorted(remaining, key=lambda w: (w in candidates, -free[w], w))
            target = next((w for w in targets if free[w] >= layout.expert_bytes), None)
            if target is None:
                return base.Refusal(
                    rank,
                    base.RefusalReason.ORPHAN_EXPERT,
                    f"releasing worker {rank} would orphan expert {expert}: no other active "
                    f"worker hosts it and none has {layout.expert_bytes / 1e9:.2f} GB free",
                )
            free[target] -= layout.expert_bytes
            moves.append(base.ExpertMove(expert=expert, source=rank, target=target))
        state.survivors.discard(rank)
        state.free = free
        for move in moves:
            state.hosts.setdefault(move.expert, set()).add(move.target)
        for hs in state.hosts.values():
            hs.discard(rank)
        # A copy planned onto this worker earlier and now moved on: copy from the original
        # source straight to the new target instead (one copy, no chain).
        for i, move in enumerate(moves):
            earlier = next(
                (m for m in state.moves if m.expert == move.expert and m.target == rank), None
            )
            if earlier is not None:
                state.moves.remove(earlier)
                moves[i] = dataclasses.replace(move, source=earlier.source)
        state.moves.extend(moves)
        return None


FORECAST_SEGMENTS = 16
"""Most segments the guard's forecast cuts the remaining decode steps into (cost of a plan
grows linearly with it; the forecast is piecewise constant per segment) [MODEL]."""


def _survivors(
    workers: Sequence[base.WorkerState],
    release: Sequence[int],
    moves: Sequence[base.ExpertMove],
) -> list[base.WorkerState]:
    """The workers left after ``release``, each holding the experts ``moves`` copy onto it."""
    gone = set(release)
    gained: dict[int, set[int]] = {}
    for move in moves:
        gained.setdefault(move.target, set()).add(move.expert)
    return [
        dataclasses.replace(w, experts=w.experts | gained.get(w.worker, set()))
        if w.worker in gained
        else w
        for w in workers
        if w.worker not in gone
    ]


def _forecast_segments(workers: Sequence[base.WorkerState]) -> list[tuple[float, float]]:
    """``(start, length)`` in decode steps of the forecast segments of the rest of the step.

    Cuts at the predicted ends of the unfinished responses (``remaining_profile``, else the
    worker's ``remaining_steps``), thinned to ``FORECAST_SEGMENTS`` evenly spaced order
    statistics; the last cut is the predicted end of the step.
    """
    ends: list[float] = []
    for w in workers:
        ends.extend(w.remaining_profile or ((w.remaining_steps,) if w.remaining_steps else ()))
    ends = sorted(e for e in ends if e > 0)
    if not ends:
        return []
    if len(ends) > FORECAST_SEGMENTS:
        last = len(ends) - 1
        ends = [ends[round(i * last / (FORECAST_SEGMENTS - 1))] for i in range(FORECAST_SEGMENTS)]
    cuts = sorted(set(ends))
    out = []
    start = 0.0
    for cut in cuts:
        out.append((start, cut - start))
        start = cut
    return out


def _at(worker: base.WorkerState, start: float, kv_bytes_per_token: int) -> base.WorkerState:
    """The worker's forecast batch ``start`` decode steps from now (no further release).

    Responses predicted to end by ``start`` are gone; the rest keep running (at most as many
    as run now, when some are queued); each survivor's context grew by ``start`` tokens.
    """
    if start <= 0:
        return worker
    profile = worker.remaining_profile
    if not profile:
        alive = worker.running if worker.remaining_steps > start else 0
    else:
        alive = sum(1 for r in profile if r > start)
        if worker.running:
            alive = min(alive, worker.running)
    if worker.running:
        per_response = worker.kv_bytes / worker.running
    else:
        per_response = 0.0
    kv = alive * (per_response + start * kv_bytes_per_token)
    return dataclasses.replace(worker, running=alive, kv_bytes=int(kv))


def minimum_workers_for_scale(layout: base.MoeLayout) -> int:
    """Replica count a ``releaseAction: scale`` shrink must not go below (expert floor, min)."""
    return layout.release_floor()


def check_scale_target(current_workers: int, target_workers: int, layout: base.MoeLayout) -> None:
    """Validate a between-steps shrink or grow of a disaggregated rollout worker set.

    Raises:
        InvalidInputError: the target is below ``minimum_workers_for_scale`` (message:
            ``minimum is N``; docs/troubleshooting.md, "Shrinking expert parallelism below the
            floor") or not positive; running engines stay untouched.
    """
    minimum = minimum_workers_for_scale(layout)
    if target_workers < minimum:
        raise errors.InvalidInputError(
            "rollout.replicas",
            f"cannot scale from {current_workers} to {target_workers} workers: minimum is "
            f"{minimum} ({layout.num_experts} experts, {layout.expert_slots_per_worker} per "
            f"worker, minActiveWorkers={layout.min_active_workers})",
        )


def minimum_data_parallel_size(num_experts: int, current_dp: int, num_physical_experts: int) -> int:
    """The vLLM elastic-EP floor: ``ceil(num_experts * current_dp / num_physical_experts)``.

    Source: vllm-project/vllm PR #52702 (docs/troubleshooting.md, "Shrinking expert parallelism
    below the floor"). With 128 experts, DP 2 and 128 physical experts the minimum is 2; with 256
    physical experts it is 1.

    Raises:
        InvalidInputError: a non-positive argument.
    """
    if num_experts < 1 or current_dp < 1 or num_physical_experts < 1:
        raise errors.InvalidInputError("rollout.experts", "counts must be >= 1")
    return math.ceil(num_experts * current_dp / num_physical_experts)


def wait_after_finish_worker_s(finish_s: Sequence[float]) -> float:
    """Worker-seconds spent waiting for the slowest worker: ``sum(max(finish) - finish)``.

    The rollout long tail of verl-project/verl #658 (docs/troubleshooting.md, "Most rollout
    workers wait for the slowest one"): workers finishing at 73.067, 118.574 and 166.683 s wait
    141.725 worker-seconds (multiply by GPUs per worker for GPU-seconds).

    Raises:
        InvalidInputError: no finish time.
    """
    if not finish_s:
        raise errors.InvalidInputError("finish_s", "need at least one worker finish time")
    last = max(finish_s)
    return sum(last - t for t in finish_s)
