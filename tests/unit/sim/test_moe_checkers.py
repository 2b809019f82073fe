"""The MoE rollout simulator's invariant counters fire when a release breaks an invariant.

A planner that does what FlexFloor must never do stands in for ``release.FlexFloorPlanner``
(the simulator's only planner), and the counter for that invariant must see it, the others
staying at 0, with coarse (event-driven) and fine (every step) stepping alike:

* releasing a finished worker without copying its experts: ``expert_unavailable_steps``;
* copying every expert onto one finished survivor (its weights alone exceed its memory):
  ``memory_overflow_steps``;
* releasing a worker that still holds responses (its experts copied first):
  ``incomplete_responses`` (a released worker stops decoding).

The real planner on the same batches keeps every counter at 0 (the control).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rlenergy.control.moe import base, release
from rlenergy.sim import moe

MODEL = moe.MOE_MODELS["qwen3-30b-a3b"]
BIG = moe.MOE_MODELS["qwen3-235b-a22b"]
"""Every expert of the 235B model (about 470 GB) cannot fit on one 80 GB worker; the 30B
model's (58 GB) can."""


def _batch(lengths: Sequence[int], prompt: int = 64) -> moe.RolloutBatch:
    return moe.RolloutBatch(
        tuple(f"p{i}" for i in range(len(lengths))),
        tuple([prompt] * len(lengths)),
        tuple(lengths),
    )


# Worker 0 holds the long responses; 1-3 finish early (place_by_length on exact predictions).
LENGTHS = [1500] * 4 + [20] * 60


class _BadPlanner:
    """Plans one release that breaks one invariant (``mode``), then nothing."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.planned = False

    def __call__(
        self, layout: base.MoeLayout, cost_model: object = None, **kwargs: object
    ) -> _BadPlanner:
        del layout, cost_model, kwargs
        return self  # stands in for the FlexFloorPlanner class

    def plan(self, workers: Sequence[base.WorkerState], step: int) -> base.ReleasePlan:
        del step
        done = [w for w in workers if w.unfinished == 0]
        busy = [w for w in workers if w.unfinished > 0]
        ranks = [w.worker for w in workers]
        if self.planned or not done or not busy:
            return base.ReleasePlan((), (), (), tuple(ranks))
        moves: tuple[base.ExpertMove, ...] = ()
        if self.mode == "orphan":
            leaving = done[0]
        elif self.mode == "overload":
            if len(done) < 2:
                return base.ReleasePlan((), (), (), tuple(ranks))
            leaving, target = done[0], done[1]
            moves = tuple(
                base.ExpertMove(e, w.worker, target.worker)
                for w in workers
                if w.worker != target.worker
                for e in sorted(w.experts)
            )
        else:  # abandon: a busy worker leaves, its experts copied so availability holds
            leaving, target = busy[0], done[0]
            moves = tuple(
                base.ExpertMove(e, leaving.worker, target.worker) for e in sorted(leaving.experts)
            )
        self.planned = True
        after = tuple(r for r in ranks if r != leaving.worker)
        return base.ReleasePlan((leaving.worker,), moves, (), after)


def _run(monkeypatch: pytest.MonkeyPatch, mode: str | None, *, coarse: bool) -> moe.RolloutResult:
    if mode is not None:
        monkeypatch.setattr(release, "FlexFloorPlanner", _BadPlanner(mode))
    if mode == "overload":
        config = moe.RolloutConfig(model=BIG, workers=16)
    else:
        config = moe.RolloutConfig(model=MODEL, workers=4)
    return moe.simulate_rollout(
        config,
        _batch(LENGTHS),
        policy="flexfloor",
        predictions=[float(x) for x in LENGTHS],
        guard=False,
        coarse=coarse,
        placement_mode="length",  # concentrate, so workers 1-3 finish early
    )


def _counters(r: moe.RolloutResult) -> tuple[int, int, int]:
    return r.expert_unavailable_steps, r.memory_overflow_steps, r.incomplete_responses


def test_the_real_planner_breaks_no_invariant(monkeypatch: pytest.MonkeyPatch):
    r = _run(monkeypatch, None, coarse=True)
    assert r.releases_committed >= 1  # it did release workers
    assert _counters(r) == (0, 0, 0)


def test_a_release_that_orphans_experts_is_counted(monkeypatch: pytest.MonkeyPatch):
    r = _run(monkeypatch, "orphan", coarse=True)
    assert r.releases_committed == 1
    unavailable, overflow, incomplete = _counters(r)
    # From the apply step on, every decode step runs without the orphaned experts.
    assert unavailable > 1000, unavailable
    assert (overflow, incomplete) == (0, 0)


def test_a_survivor_over_its_memory_is_counted(monkeypatch: pytest.MonkeyPatch):
    r = _run(monkeypatch, "overload", coarse=True)
    assert r.releases_committed == 1 and r.expert_moves > BIG.num_experts // 2
    unavailable, overflow, incomplete = _counters(r)
    assert overflow > 1000, overflow
    assert (unavailable, incomplete) == (0, 0)


def test_responses_on_a_released_busy_worker_are_counted(
    monkeypatch: pytest.MonkeyPatch,
):
    r = _run(monkeypatch, "abandon", coarse=True)
    assert r.releases_committed == 1
    unavailable, overflow, incomplete = _counters(r)
    assert incomplete == 4, incomplete  # the four long responses never finish
    assert (unavailable, overflow) == (0, 0)


def test_the_counters_agree_between_coarse_and_fine_steps(monkeypatch: pytest.MonkeyPatch):
    for mode in (None, "orphan", "overload", "abandon"):
        coarse = _counters(_run(monkeypatch, mode, coarse=True))
        fine = _counters(_run(monkeypatch, mode, coarse=False))
        assert coarse == fine, mode
