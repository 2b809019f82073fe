"""The in-process planner places within each rank's KV memory (``RolloutPlanner.place`` and
``RolloutPlanner.assign``).

We test these aspects:
* a placement never puts more predicted peak KV on a rank than its budget (property, over
  random histories, prompts and memory sizes); what does not fit is marked ``queued``;
* long prompts spread over the ranks by predicted length, and a rank whose experts leave no
  room for a long response does not get one;
* ``assign`` gives the hook's plain server index per sample with the same rule, and refuses
  a budget list of the wrong length with a message that says what to pass.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlenergy import errors
from rlenergy.api import rollout as api
from rlenergy.control.moe import base, placement
from rlenergy.sdk import planner


def _planner(
    memory_bytes: int, *, experts: int = 8, expert_bytes: int = 0
) -> planner.RolloutPlanner:
    layout = base.MoeLayout(
        num_experts=experts,
        expert_bytes=expert_bytes,
        dense_bytes=0,
        kv_bytes_per_token=1,
        worker_memory_bytes=memory_bytes,
    )
    fluid = placement.FluidFinishModel(0.01, 1e-6, float(memory_bytes), 1, 256)
    return planner.RolloutPlanner(layout, fluid)


def _request(prompts: list[tuple[str, int, int]], workers: int) -> api.PlacementRequest:
    return api.PlacementRequest.model_validate(
        {
            "rolloutId": "step-1",
            "workers": list(range(workers)),
            "prompts": [
                {"promptId": pid, "promptTokens": tokens, "responses": n}
                for pid, tokens, n in prompts
            ],
        }
    )


def _kv_per_rank(placed: api.PlacementResponse, tokens: dict[str, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for a in placed.assignments:
        if not a.queued:
            need = placement.response_kv_bytes(tokens[a.prompt_id], a.predicted_tokens, 1)
            out[a.worker] = out.get(a.worker, 0) + need
    return out


@settings(max_examples=120, deadline=None)
@given(
    history=st.lists(st.integers(1, 4000), min_size=1, max_size=12),
    prompt_tokens=st.integers(0, 500),
    group=st.integers(1, 8),
    workers=st.integers(1, 6),
    memory=st.integers(5_000, 60_000),
)
def test_property_placement_never_exceeds_a_ranks_kv_budget(
    history, prompt_tokens, group, workers, memory
):
    p = _planner(memory)
    ids = [f"p{k}" for k in range(len(history))]
    p.observe(ids, history)  # one response each: the next prediction is its length
    placed = p.place(_request([(i, prompt_tokens, group) for i in ids], workers))
    assert len(placed.assignments) == len(ids) * group
    budgets = [memory] * workers  # no expert weights: the whole memory holds KV
    for rank, kv in _kv_per_rank(placed, dict.fromkeys(ids, prompt_tokens)).items():
        assert kv <= budgets[rank]


def test_long_prompts_spread_by_predicted_length():
    # 4 ranks with ample memory: the four longest responses go one per rank, longest first.
    p = _planner(10**6)
    ids = ["long-a", "long-b", "long-c", "short"]
    p.observe(ids, [10_000, 9_000, 8_000, 100])
    prompts = [("long-a", 100, 2), ("long-b", 100, 1), ("long-c", 100, 1), ("short", 100, 4)]
    placed = p.place(_request(prompts, 4))
    rank = {(a.prompt_id, a.response_index): a.worker for a in placed.assignments}
    longs = [rank[("long-a", 0)], rank[("long-a", 1)], rank[("long-b", 0)], rank[("long-c", 0)]]
    assert sorted(longs) == [0, 1, 2, 3]


def test_a_rank_without_room_for_a_long_response_does_not_get_it():
    # 3 experts on 2 ranks (2 + 1) of 31,000 B, 9,000 B each: KV budgets 13,000 and 22,000 B.
    # Four responses predicted 7,000 tokens (7,100 B with the prompt): dealing alone puts two
    # on rank 0 (14,200 B > 13,000 B); within memory rank 0 keeps one and rank 1 takes three.
    p = _planner(31_000, experts=3, expert_bytes=9_000)
    p.observe(["long"] * 4, [7_000] * 4)
    placed = p.place(_request([("long", 100, 4)], 2))
    ranks = sorted(a.worker for a in placed.assignments)
    assert ranks == [0, 1, 1, 1] and not any(a.queued for a in placed.assignments)
    kv = _kv_per_rank(placed, {"long": 100})
    assert kv == {0: 7_100, 1: 21_300}
    assert p.layout.kv_budget_bytes(2) == (13_000, 22_000)


def test_assign_is_the_hooks_server_index_per_sample():
    p = _planner(10**6)
    p.observe(["a", "a", "b", "b"], [4000, 4000, 100, 100])
    servers = p.assign(["a", "a", "b", "b"], [10, 10, 10, 10], 2)
    assert len(servers) == 4 and set(servers) <= {0, 1}
    assert servers[0] != servers[1]  # the two long samples of prompt a on different servers
    with pytest.raises(errors.InvalidInputError, match="one KV budget per rank"):
        p.assign(["a"], [10], 2, kv_budget_bytes=[10**6])
    with pytest.raises(errors.InvalidInputError, match="at least one rollout server"):
        p.assign(["a"], [10], 0)
