"""FlexFloor release rule and guard in detail: the exact refusals, copies and forecasts.

We test these aspects:
* each refusal names the worker, its reason and the limit in words a person acts on;
* free memory counts KV in use and the KV still reserved for unfinished responses;
* the planner releases the worker needing the fewest sole-hosted experts first, copies an
  orphaned expert to a survivor that is not leaving itself, the one with the most free memory,
  and copies an expert that was headed for a worker that leaves after all straight from its
  original source (one copy, every expert hosted);
* the guard's forecast: segments cut at the predicted ends of the responses (thinned to 16,
  the last cut the end of the step), the batch and KV of each worker shrinking as its
  responses end, the copy stall charged to the whole group, the slowdown measured over every
  segment; a release that does not lower the forecast strictly is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from moe_support import LinearCost

from rlenergy.control.moe import base, release

GB = 10**9
SHARDS = [{0, 1}, {2, 3}, {4, 5}, {6, 7}]


def layout(memory_gb: float = 20, expert_bytes: int = GB, min_active: int = 1) -> base.MoeLayout:
    return base.MoeLayout(
        num_experts=8,
        expert_bytes=expert_bytes,
        dense_bytes=2 * GB,
        kv_bytes_per_token=1000,
        worker_memory_bytes=int(memory_gb * GB),
        min_active_workers=min_active,
    )


def states(
    unfinished: Sequence[int] = (0, 0, 0, 0), kv: Sequence[int] = (0, 0, 0, 0)
) -> list[base.WorkerState]:
    return [
        base.WorkerState(w, frozenset(SHARDS[w]), unfinished[w], kv[w], running=unfinished[w])
        for w in range(4)
    ]


def test_refusals_name_the_worker_the_reason_and_the_limit():
    planner = release.FlexFloorPlanner(layout(min_active=3))
    plan = planner.check(states(unfinished=(0, 0, 0, 1)), [9, 3, 2, 2, 1])
    assert plan.refused == (
        base.Refusal(9, base.RefusalReason.UNKNOWN_WORKER, "worker 9 is not active"),
        base.Refusal(
            3,
            base.RefusalReason.UNFINISHED,
            "worker 3 still has 1 unfinished response(s)",
        ),
        base.Refusal(2, base.RefusalReason.UNKNOWN_WORKER, "worker 2 is not active"),  # gone
        base.Refusal(
            1,
            base.RefusalReason.BELOW_MIN_ACTIVE,
            "releasing worker 1 would leave 2 active worker(s), below minActiveWorkers=3",
        ),
    )
    assert plan.release == (2,)
    # 6 GB per worker: 4 expert slots after 2 GB dense, so 8 experts need 2 workers.
    floor = release.FlexFloorPlanner(layout(memory_gb=6)).check(states(), [3, 2, 1])
    assert floor.release == (2, 3)
    assert floor.refused == (
        base.Refusal(
            1,
            base.RefusalReason.BELOW_FLOOR,
            "releasing worker 1 would leave 1 worker(s): minimum is 2 (expert floor: 8 "
            "experts, 4 per worker)",
        ),
    )


def test_orphan_refusal_quotes_the_expert_size():
    # 1.215 GB experts, 6 GB workers: dense 2 + 2 experts 2.43 leave 1.57 GB; 1 GB of KV in
    # use leaves 0.57 GB, too little for worker 3's expert 6.
    lay = layout(memory_gb=6, expert_bytes=1_215_000_000)
    plan = release.FlexFloorPlanner(lay).check(states(kv=(GB, GB, GB, 0)), [3])
    assert plan.refused == (
        base.Refusal(
            3,
            base.RefusalReason.ORPHAN_EXPERT,
            "releasing worker 3 would orphan expert 6: no other active worker hosts it and "
            "none has 1.22 GB free",
        ),
    )
    assert plan.active_after == (0, 1, 2, 3)


def test_free_memory_counts_kv_in_use_and_reserved():
    w = base.WorkerState(0, frozenset({0, 1}), 2, 3 * GB, kv_reserved_bytes=2 * GB)
    # 20 GB - 2 dense - 2 experts - 3 in use - 2 reserved
    assert w.free_bytes(layout()) == 11 * GB


def test_fewest_sole_hosted_experts_leave_first():
    # Worker 1's expert 2 is also on worker 2; worker 0 is the sole host of 0 and 1. Only one
    # may leave (minActiveWorkers 2): worker 1, which needs no copy.
    lay = base.MoeLayout(4, GB, 2 * GB, 1000, 20 * GB, min_active_workers=2)
    ws = [
        base.WorkerState(0, frozenset({0, 1}), 0, 0),
        base.WorkerState(1, frozenset({2}), 0, 0),
        base.WorkerState(2, frozenset({2, 3}), 1, 0, running=1),
    ]
    plan = release.FlexFloorPlanner(lay).plan(ws, 0)
    assert (plan.release, plan.moves, plan.active_after) == ((1,), (), (0, 2))
    assert [(r.worker, r.reason) for r in plan.refused] == [
        (0, base.RefusalReason.BELOW_MIN_ACTIVE)
    ]


def test_copies_go_to_a_staying_worker_with_the_most_free_memory():
    # Workers 0 and 1 are busy with 5 and 10 GB free; 2 and 3 are finished (16 GB free), but
    # only one may leave (minActiveWorkers 3). Worker 2 goes first (rank order); its experts
    # go to worker 1, not to worker 3, which has more room but is itself a candidate.
    ws = states(unfinished=(1, 1, 0, 0), kv=(11 * GB, 6 * GB, 0, 0))
    plan = release.FlexFloorPlanner(layout(min_active=3)).plan(ws, 0)
    assert plan.release == (2,)
    assert plan.moves == (base.ExpertMove(4, 2, 1), base.ExpertMove(5, 2, 1))
    assert plan.active_after == (0, 1, 3)
    assert [(r.worker, r.reason) for r in plan.refused] == [
        (3, base.RefusalReason.BELOW_MIN_ACTIVE)
    ]


def test_a_copy_headed_for_a_leaving_worker_comes_from_its_original_source():
    # Worker 0 is busy and full (0.5 GB free). Worker 3 leaves first: its experts go to
    # worker 2 (16 GB free, more than worker 1's 6). Worker 2 then leaves too: its own experts
    # and those headed for it go to worker 1, experts 6 and 7 straight from worker 3.
    ws = states(unfinished=(1, 0, 0, 0), kv=(15_500_000_000, 10 * GB, 0, 0))
    plan = release.FlexFloorPlanner(layout(min_active=2)).check(ws, [3, 2, 1])
    assert plan.release == (2, 3)
    assert plan.moves == (
        base.ExpertMove(4, 2, 1),
        base.ExpertMove(5, 2, 1),
        base.ExpertMove(6, 3, 1),
        base.ExpertMove(7, 3, 1),
    )
    assert plan.active_after == (0, 1)
    assert plan.refused == (
        base.Refusal(
            1,
            base.RefusalReason.BELOW_MIN_ACTIVE,
            "releasing worker 1 would leave 1 active worker(s), below minActiveWorkers=2",
        ),
    )


class BatchCost:
    """Step time = responses running in the group + KV in the group / 1000 B (pure)."""

    def __init__(self, copy_fixed_s: float = 0.0, copy_each_s: float = 0.0) -> None:
        self.copy_fixed_s = copy_fixed_s
        self.copy_each_s = copy_each_s

    def decode_step_s(self, workers: Sequence[base.WorkerState]) -> float:
        return sum(w.running for w in workers) + sum(w.kv_bytes for w in workers) / 1000

    def copy_s(self, moves: Sequence[base.ExpertMove]) -> float:
        # A fixed overhead per copy round: no copy, no round.
        return self.copy_fixed_s + self.copy_each_s * len(moves)


def one(running: int, kv: int, **kw: object) -> base.WorkerState:
    return base.WorkerState(0, frozenset(range(8)), running, kv, running=running, **kw)  # type: ignore[arg-type]


def test_forecast_cuts_at_every_predicted_end_thinned_to_16():
    # 17 responses predicted to end after 1, 2, .., 17 steps (no KV): from step t the batch is
    # the responses with more than t steps left. 17 ends are thinned to 16 order statistics
    # (index round(i x 16 / 15)): the cut at 9 goes, so [8, 10) runs at 9 responses:
    # (17 + .. + 10) + 2 x 9 + (7 + .. + 1) = 108 + 18 + 28.
    w = one(17, 0, remaining_profile=tuple(float(t) for t in range(1, 18)))
    no_kv = base.MoeLayout(8, GB, 2 * GB, 0, 20 * GB)  # contexts do not grow: batch only
    planner = release.FlexFloorPlanner(no_kv, BatchCost())
    assert planner.predicted_occupied_gpu_s([w]) == pytest.approx(154.0)
    # 16 ends are all kept: 1 + 2 + .. + 16.
    w16 = one(16, 0, remaining_profile=tuple(float(t) for t in range(1, 17)))
    assert planner.predicted_occupied_gpu_s([w16]) == pytest.approx(136.0)
    # A fraction of a step left is a segment too.
    assert planner.predicted_occupied_gpu_s([one(1, 0, remaining_profile=(0.5,))]) == 0.5


def test_forecast_batch_and_kv_shrink_as_responses_end():
    # Two responses with 1 token of context each (2000 B), predicted to end after 2 and 4
    # steps: [0, 2): 2 running + 2 KV units; [2, 4): 1 running, (1000 + 2 x 1000) B.
    w = one(2, 2000, remaining_profile=(2.0, 4.0))
    planner = release.FlexFloorPlanner(layout(), BatchCost())
    assert planner.predicted_occupied_gpu_s([w]) == pytest.approx(2 * 4 + 2 * 4)
    # Queued responses (none running now) count once they may run: each starts with no KV.
    queued = one(0, 0, remaining_profile=(2.0, 4.0))
    # [0, 2): nothing runs; [2, 4): 1 response with 2 tokens of context.
    assert planner.predicted_occupied_gpu_s([queued]) == pytest.approx(2 * (1 + 2))
    # No profile: a worker's batch runs whole until its remaining_steps, then ends.
    a = base.WorkerState(0, frozenset({0, 1, 2, 3}), 2, 0, running=2, remaining_steps=10.0)
    b = base.WorkerState(1, frozenset({4, 5, 6, 7}), 1, 0, running=1, remaining_steps=20.0)
    # [0, 10): 3 running (no KV); [10, 20): 1 running with 10 tokens: 1 + 10; 2 workers.
    assert planner.predicted_occupied_gpu_s([a, b]) == pytest.approx(2 * (10 * 3 + 10 * 11))


def test_forecast_charges_the_copy_stall_to_the_whole_group():
    ws = states(unfinished=(1, 1, 1, 0))
    ws = [
        base.WorkerState(
            w.worker,
            w.experts,
            w.unfinished,
            0,
            running=w.running,
            remaining_steps=10.0 if w.unfinished else 0.0,
        )
        for w in ws
    ]
    planner = release.FlexFloorPlanner(layout(), BatchCost(copy_fixed_s=1.0, copy_each_s=0.5))
    moves = (base.ExpertMove(6, 3, 2), base.ExpertMove(7, 3, 2))
    # Keeping: no copy round; 10 steps x 4 workers x 3 running.
    assert planner.predicted_occupied_gpu_s(ws) == pytest.approx(120.0)
    # Releasing 3: a 2 s stall for all 4 workers, then 10 steps x 3 workers x 3 running.
    assert planner.predicted_occupied_gpu_s(ws, (3,), moves) == pytest.approx(8.0 + 90.0)


class TouchedExperts:
    """Step time = 1 ms per distinct expert the group hosts (every expert is touched)."""

    def decode_step_s(self, workers: Sequence[base.WorkerState]) -> float:
        return 1e-3 * len(set().union(*(w.experts for w in workers)))

    def copy_s(self, moves: Sequence[base.ExpertMove]) -> float:
        return 0.0


def test_forecast_survivors_hold_the_copied_experts():
    ws = [
        base.WorkerState(w, frozenset(SHARDS[w]), 1, 0, running=1, remaining_steps=10.0)
        for w in range(3)
    ] + [base.WorkerState(3, frozenset(SHARDS[3]), 0, 0)]
    planner = release.FlexFloorPlanner(layout(), TouchedExperts())
    moves = (base.ExpertMove(6, 3, 2), base.ExpertMove(7, 3, 2))
    # All 8 experts still hosted by the 3 survivors: 10 steps x 3 workers x 8 ms.
    assert planner.predicted_occupied_gpu_s(ws, (3,), moves) == pytest.approx(0.24)


class PerWorker:
    """Step time = ``per_group_s / workers``: a release never changes the occupied GPU-s."""

    def decode_step_s(self, workers: Sequence[base.WorkerState]) -> float:
        return 2.0 / len(workers)

    def copy_s(self, moves: Sequence[base.ExpertMove]) -> float:
        return 0.0


def test_a_release_that_does_not_lower_the_forecast_strictly_is_refused():
    ws = [
        base.WorkerState(0, frozenset(range(4)), 0, 0),
        base.WorkerState(1, frozenset(range(4, 8)), 1, 0, running=1, remaining_steps=10.0),
    ]
    plan = release.FlexFloorPlanner(layout(), PerWorker()).plan(ws, 0)
    # Keeping: 10 steps x 2 workers x 1 s; releasing worker 0: 10 x 1 x 2 s. Equal: refused.
    assert plan.release == () and plan.moves == () and plan.active_after == (0, 1)
    assert plan.refused == (
        base.Refusal(
            0,
            base.RefusalReason.OCCUPANCY_WOULD_RISE,
            "releasing worker 0 would not lower the predicted occupied GPU-seconds for the "
            "rest of the step within the slowdown allowed (20 GPU-s keeping the group, 20 "
            "with the best allowed release)",
        ),
    )
    assert (plan.predicted_keep_gpu_s, plan.predicted_gpu_s) == (20.0, 20.0)


def test_a_granted_release_refuses_nobody_and_a_held_one_is_named_once():
    ws = [
        base.WorkerState(w, frozenset(SHARDS[w]), 5, 0, running=5, remaining_steps=100.0)
        for w in range(3)
    ] + [base.WorkerState(3, frozenset(SHARDS[3]), 0, 0)]
    plan = release.FlexFloorPlanner(layout(), LinearCost(1e-2, 1e-3)).plan(ws, 0)
    # Experts 6 and 7 go to the survivors with the most free memory (ties: lowest rank), one
    # each: 12 -> 13 ms per step on 3 workers for 100 steps, 3.9 < 4.8 GPU-s.
    assert plan.release == (3,) and plan.refused == ()
    assert plan.moves == (base.ExpertMove(6, 3, 0), base.ExpertMove(7, 3, 1))
    assert plan.predicted_keep_gpu_s == pytest.approx(4.8)
    assert plan.predicted_gpu_s == pytest.approx(3.9)
    # minActiveWorkers 4: the rule refuses worker 3 and the guard does not name it again.
    held = release.FlexFloorPlanner(layout(min_active=4), LinearCost(1e-2, 1e-3)).plan(ws, 0)
    assert held.release == ()
    assert [(r.worker, r.reason) for r in held.refused] == [
        (3, base.RefusalReason.BELOW_MIN_ACTIVE)
    ]


class ExpertsAndBatch:
    """Step time = 1 ms per expert on the busiest worker + 1 ms per running response."""

    def decode_step_s(self, workers: Sequence[base.WorkerState]) -> float:
        return 1e-3 * (max(len(w.experts) for w in workers) + sum(w.running for w in workers))

    def copy_s(self, moves: Sequence[base.ExpertMove]) -> float:
        return 0.0


def test_the_slowdown_counts_every_segment():
    # Workers 0 and 1 run 2 responses each, predicted to end after 50 and 100 steps; worker 2
    # is finished and its experts 4 and 5 go one to each survivor (3 experts on the busiest).
    # Keeping: 50 x (2 + 4) + 50 x (2 + 2) = 500 ms of wall time; releasing: 50 x (3 + 4) +
    # 50 x (3 + 2) = 600 ms, +20 % (the last segment alone would say +25 %). Occupancy: 3 x
    # 0.5 > 2 x 0.6 GPU-s, so the allowance decides.
    ws = [
        base.WorkerState(w, frozenset(SHARDS[w]), 2, 0, running=2, remaining_profile=(50.0, 100.0))
        for w in range(2)
    ] + [base.WorkerState(2, frozenset(SHARDS[2]), 0, 0)]
    lay = base.MoeLayout(6, GB, 2 * GB, 1000, 20 * GB)
    cost = ExpertsAndBatch()
    loose = release.FlexFloorPlanner(lay, cost, max_slowdown=0.22).plan(ws, 0)
    assert loose.release == (2,)
    assert loose.predicted_keep_gpu_s == pytest.approx(1.5)
    assert loose.predicted_gpu_s == pytest.approx(1.2)
    assert release.FlexFloorPlanner(lay, cost, max_slowdown=0.18).plan(ws, 0).release == ()
