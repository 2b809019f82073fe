"""``park_if_released``: only a rank that a committed release took out of the group parks.

We test these aspects: a committed release parks the released rank's GPUs (and only that
rank's); an aborted round (the simulated engine refuses an orphaning release) parks nobody.
The agent side of a park (clocks, accounting) is tested in ``tests/unit/agent/test_park.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlenergy.api import rollout as api
from rlenergy.control.moe import base
from rlenergy.sdk import rollout
from rlenergy.sim import moe_engine

LAYOUT = base.MoeLayout(
    num_experts=8,
    expert_bytes=10**9,
    dense_bytes=2 * 10**9,
    kv_bytes_per_token=1,
    worker_memory_bytes=20 * 10**9,
)
SHARDS = [[0, 1], [2, 3], [4, 5], [6, 7]]


class Agent:
    """Records park calls (what ``trainer.RLEnergyClient.park`` would send)."""

    def __init__(self) -> None:
        self.parks: list[tuple[int, tuple[str, ...]]] = []

    def park(self, step: int, *, gpus: Sequence[str] = ()) -> dict[str, Any]:
        self.parks.append((step, tuple(gpus)))
        return {}


def _decision(moves: list[tuple[int, int, int]]) -> api.ReleaseDecision:
    return api.ReleaseDecision.model_validate(
        {
            "rolloutId": "step-7",
            "decisionId": 1,
            "release": [3],
            "moves": [{"expert": e, "source": s, "target": t} for e, s, t in moves],
            "activeBefore": [0, 1, 2, 3],
            "decidedAtStep": 10,
            "ackDeadlineStep": 12,
            "applyAtStep": 14,
        }
    )


def test_committed_release_parks_only_the_released_rank():
    engine = moe_engine.SimulatedElasticEngine(LAYOUT, SHARDS)
    d = _decision([(6, 3, 0), (7, 3, 1)])
    outcome = rollout.apply_release(engine, d)
    assert outcome.status == "Committed"
    agents = {rank: Agent() for rank in range(4)}
    sent = {
        rank: rollout.park_if_released(agent, outcome, d, rank, 7, gpus=[f"GPU-{rank}"])
        for rank, agent in agents.items()
    }
    assert sent == {0: False, 1: False, 2: False, 3: True}
    assert agents[3].parks == [(7, ("GPU-3",))]
    assert all(not agents[r].parks for r in (0, 1, 2))


def test_aborted_release_parks_nobody():
    engine = moe_engine.SimulatedElasticEngine(LAYOUT, SHARDS)
    d = _decision([])  # experts 6 and 7 would be orphaned: the engine refuses
    outcome = rollout.apply_release(engine, d)
    assert outcome.status == "Aborted"
    agent = Agent()
    assert not rollout.park_if_released(agent, outcome, d, 3, 7)
    assert agent.parks == []
