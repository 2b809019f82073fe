"""FlexFloor release rule: who may leave, and why not.

We test these aspects:
* a release that would orphan an expert is refused (and allowed once a survivor has room);
* a release below minActiveWorkers or below the expert floor is refused with a clear reason;
* busy workers never leave; planned copies keep every expert hosted;
* the expert floor and DP/EP combinations of vllm-project/vllm PR #52702 and the rollout long
  tail's wait time of verl-project/verl #658, with the values those reports give.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlenergy import errors
from rlenergy.control.moe import base, release

GB = 10**9


def layout(memory_gb: float = 20, expert_gb: float = 1, experts: int = 8, min_active: int = 1):
    return base.MoeLayout(
        num_experts=experts,
        expert_bytes=int(expert_gb * GB),
        dense_bytes=2 * GB,
        kv_bytes_per_token=1000,
        worker_memory_bytes=int(memory_gb * GB),
        min_active_workers=min_active,
    )


def states(shards, unfinished=None, kv_gb=None):
    unfinished = unfinished or [0] * len(shards)
    kv_gb = kv_gb or [0] * len(shards)
    return [
        base.WorkerState(w, frozenset(es), unfinished[w], int(kv_gb[w] * GB))
        for w, es in enumerate(shards)
    ]


SHARDS = [{0, 1}, {2, 3}, {4, 5}, {6, 7}]


def test_orphaning_release_is_refused_when_no_survivor_has_room():
    # 6 GB each: dense 2 + 2 experts + 2 GB KV in use: no survivor has room for an expert.
    lay = layout(memory_gb=6)
    assert lay.expert_floor() == 2
    plan = release.FlexFloorPlanner(lay).check(states(SHARDS, kv_gb=[2, 2, 2, 0]), [3])
    assert plan.release == ()
    assert plan.refused[0].reason is base.RefusalReason.ORPHAN_EXPERT
    assert "orphan expert 6" in plan.refused[0].message


def test_orphaned_experts_move_to_a_survivor_with_free_memory():
    plan = release.FlexFloorPlanner(layout(memory_gb=20)).check(states(SHARDS), [3])
    assert plan.release == (3,)
    assert {m.expert for m in plan.moves} == {6, 7}
    assert all(m.source == 3 and m.target != 3 for m in plan.moves)


def test_replicated_experts_need_no_copy():
    shards = [{0, 1, 2, 3}, {0, 1, 2, 3}]
    plan = release.FlexFloorPlanner(layout(memory_gb=7, experts=4)).check(states(shards), [1])
    assert plan.release == (1,) and plan.moves == ()


def test_busy_worker_is_refused():
    plan = release.FlexFloorPlanner(layout()).check(states(SHARDS, unfinished=[0, 0, 0, 5]), [3])
    assert plan.refused[0].reason is base.RefusalReason.UNFINISHED
    assert "5 unfinished" in plan.refused[0].message


def test_below_min_active_workers_is_refused():
    planner = release.FlexFloorPlanner(layout(min_active=3))
    plan = planner.check(states(SHARDS), [2, 3])
    assert plan.release == (2,)
    assert plan.refused[0].reason is base.RefusalReason.BELOW_MIN_ACTIVE
    assert "minActiveWorkers=3" in plan.refused[0].message


def test_below_expert_floor_is_refused_with_the_minimum():
    # 6 GB: dense 2 + room for 4 experts: 8 experts need 2 workers.
    lay = layout(memory_gb=6)
    assert lay.expert_floor() == 2
    plan = release.FlexFloorPlanner(lay).check(states(SHARDS), [1, 2, 3])
    assert len(plan.active_after) == 2
    refused = [r for r in plan.refused if r.reason is base.RefusalReason.BELOW_FLOOR]
    assert refused and "minimum is 2" in refused[0].message


def test_kv_reservation_counts_against_free_memory():
    # Survivors have 16 GB of KV in use: no room for the leaving worker's experts.
    plan = release.FlexFloorPlanner(layout(memory_gb=20)).check(
        states(SHARDS, kv_gb=[16, 16, 16, 0]), [3]
    )
    assert plan.refused[0].reason is base.RefusalReason.ORPHAN_EXPERT


def test_plan_releases_only_finished_workers():
    plan = release.FlexFloorPlanner(layout()).plan(states(SHARDS, unfinished=[3, 0, 0, 1]), step=10)
    assert set(plan.release) <= {1, 2}
    assert 0 in plan.active_after and 3 in plan.active_after


@settings(max_examples=200, deadline=None)
@given(
    workers=st.integers(1, 8),
    experts_per_worker=st.integers(1, 4),
    memory_gb=st.integers(3, 30),
    min_active=st.integers(1, 4),
    busy=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    kv=st.lists(st.integers(0, 10), min_size=8, max_size=8),
)
def test_property_every_expert_keeps_a_replica(
    workers, experts_per_worker, memory_gb, min_active, busy, kv
):
    experts = workers * experts_per_worker
    if 2 + experts_per_worker > memory_gb:
        return
    lay = layout(memory_gb=memory_gb, experts=experts, min_active=min(min_active, workers))
    shards = [
        set(range(w * experts_per_worker, (w + 1) * experts_per_worker)) for w in range(workers)
    ]
    ws = states(shards, unfinished=busy[:workers], kv_gb=[min(k, memory_gb) for k in kv[:workers]])
    plan = release.FlexFloorPlanner(lay).plan(ws, step=0)
    hosts = {e: set() for e in range(experts)}
    for w in plan.active_after:
        for e in shards[w]:
            hosts[e].add(w)
    for m in plan.moves:
        assert m.target in plan.active_after
        hosts[m.expert].add(m.target)
    assert all(hosts[e] for e in range(experts)), "an expert lost its last replica"
    assert len(plan.active_after) >= max(lay.release_floor(), 1) or not plan.release
    assert all(busy[w] == 0 for w in plan.release)
    # Targets never exceed their memory.
    added = {}
    for m in plan.moves:
        added[m.target] = added.get(m.target, 0) + 1
    for s in ws:
        if s.worker in added:
            assert s.free_bytes(lay) >= added[s.worker] * lay.expert_bytes


def test_case_29_minimum_dp():
    assert release.minimum_data_parallel_size(128, 2, 128) == 2
    assert release.minimum_data_parallel_size(128, 2, 256) == 1
    assert base.expert_floor(128, 128 // 2) == 2
    assert base.expert_floor(128, 256 // 2) == 1


def test_case_29_scale_below_floor_rejected_with_minimum():
    lay = base.MoeLayout(
        num_experts=128,
        expert_bytes=GB,
        dense_bytes=0,
        kv_bytes_per_token=1,
        worker_memory_bytes=64 * GB,
    )
    with pytest.raises(errors.InvalidInputError, match="minimum is 2"):
        release.check_scale_target(2, 1, lay)
    release.check_scale_target(2, 2, lay)


def test_case_29_dp_without_ep_rejected():
    with pytest.raises(errors.InvalidInputError, match="DP=2 with EP=1"):
        base.validate_parallelism(2, 1)
    base.validate_parallelism(4, 4)


def test_case_26_wait_time():
    assert release.wait_after_finish_worker_s([73.067, 118.574, 166.683]) == pytest.approx(141.725)
