"""The FlexFloor request router's own logic (``rlenergy.sdk.verl_placement``), without verl.

verl's balancer is replaced by a small in-process one with the same sticky-session contract
(a request id it knows goes to its server); ``tests/verl/test_verl_placement.py`` runs the
router inside verl's real agent loop.

We test these aspects:
* the router YAML: a missing field or decode-step times out of order fail naming the field;
* a batch's first requests are held until every announced sample asked, then each goes to
  the server the planner's ``assignment`` gives it, within each server's KV budget;
* a batch whose samples do not all ask within ``gatherTimeoutS`` is placed with those that
  did; a late sample goes to verl's choice;
* requests outside an announced batch (none announced, a repeated ``priority``, no
  ``prompt_ids``) go to verl's choice and count as unplanned;
* a failure in the planner's part leaves the request to verl's choice instead of failing it;
* ``observe`` teaches the predictor: the next batch's predictions are the lengths seen;
* the router YAML the verl guide shows is valid and names this router;
* a batch's prompt ids: the dataset ``index``, else ``uid``, else positions; a batch with a
  ``priority`` column of its own that is not the positions is not announced.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlenergy import errors
from rlenergy.control.moe import placement
from rlenergy.sdk import verl_placement

YAML = {
    "router_class": "rlenergy.sdk.verl_placement.PlannerRouter",
    "experts": 4,
    "bytesPerExpert": 10,
    "kvBytesPerToken": 1,
    "workerMemoryBytes": 500,
    "decodeStepEmptyS": 0.01,
    "decodeStepFullS": 0.02,
    "gatherTimeoutS": 5,
}
SERVERS = ("a:1", "b:2")


class Balancer:
    """verl's ``GlobalRequestLoadBalancer`` contract, small: sticky map, else the last server."""

    def __init__(self, servers: Mapping[str, Any]) -> None:
        self._servers = dict(servers)
        self._request_id_to_server: dict[str, str] = {}
        self.acquired: dict[str, str] = {}

    def acquire_server(self, request_id: str) -> tuple[str, Any]:
        sid = self._request_id_to_server.get(request_id, list(self._servers)[-1])
        self._request_id_to_server[request_id] = sid
        self.acquired[request_id] = sid
        return sid, self._servers[sid]

    def get_all_servers(self) -> list[str]:
        return list(self._servers)

    def require_release_fields(self) -> list[str]:
        return []


def _router(**changes: Any) -> tuple[verl_placement.PlannerRouter, Balancer]:
    lb = Balancer({s: f"handle-{s}" for s in SERVERS})
    return verl_placement.PlannerRouter({}, {**YAML, **changes}, balancer=lb), lb


@pytest.mark.parametrize(
    ("drop", "change", "field"),
    [
        ("kvBytesPerToken", {}, "kvBytesPerToken"),
        ("experts", {}, "experts"),
        (None, {"decodeStepFullS": 0.001}, "decodeStepEmptyS"),
    ],
)
def test_a_bad_router_yaml_names_the_field(drop: str | None, change: dict[str, Any], field: str):
    doc = {k: v for k, v in YAML.items() if k != drop} | change
    with pytest.raises(errors.InvalidInputError, match=field):
        verl_placement.RouterSettings.from_yaml(doc)


async def _acquire(router: verl_placement.PlannerRouter, rid: str, tokens: int, prio: int) -> str:
    sid, _ = await router.acquire_server(rid, prompt_ids=[7] * tokens, priority=prio)
    return sid


def test_a_batch_is_held_until_complete_then_placed_by_the_planner() -> None:
    router, lb = _router()
    keys = ["p0", "p0", "p1", "p1", "p2", "p2"]
    tokens = [30, 30, 20, 20, 10, 10]
    asyncio.run(router.observe(keys, [150, 150, 90, 90, 10, 10]))
    expected, _ = router.plan.assignment(
        keys, tokens, 2, kv_budget_bytes=router.plan.layout.kv_budget_bytes(2)
    )

    async def run() -> list[str]:
        assert await router.announce(keys) == len(keys)
        first = [asyncio.create_task(_acquire(router, f"r{i}", tokens[i], i)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in first)  # held: sample 5 has not asked
        last = await _acquire(router, "r5", tokens[5], 5)
        return [*(await asyncio.gather(*first)), last]

    got = asyncio.run(run())
    assert got == [SERVERS[w] for w in expected.worker_of]
    assert router.unplanned == 0
    budgets = router.plan.layout.kv_budget_bytes(2)
    kv = [0, 0]
    for p in router.history[-1]:
        assert not p.queued
        kv[SERVERS.index(p.server)] += placement.response_kv_bytes(
            p.prompt_tokens, p.predicted_tokens, 1
        )
    assert all(used <= b for used, b in zip(kv, budgets, strict=True))
    assert kv[0] > 0 and kv[1] > 0


def test_a_batch_not_all_asking_is_placed_at_the_timeout_and_a_late_one_goes_to_verl() -> None:
    router, lb = _router(gatherTimeoutS=0.1)

    async def run() -> tuple[list[str], str]:
        await router.announce(["p0", "p1", "p2"])
        placed = await asyncio.gather(_acquire(router, "r0", 5, 0), _acquire(router, "r1", 5, 1))
        late = await _acquire(router, "r2", 5, 2)
        return placed, late

    placed, late = asyncio.run(run())
    assert [p.sample for p in router.history[-1]] == [0, 1]
    assert placed == [p.server for p in router.history[-1]]
    assert late == SERVERS[-1] and router.unplanned == 1


def test_requests_outside_a_batch_go_to_verls_choice() -> None:
    router, lb = _router()

    async def run() -> list[str]:
        alone = await _acquire(router, "x", 5, 0)  # nothing announced
        await router.announce(["p0"])
        no_ids, _ = await router.acquire_server("y", priority=0)  # no prompt_ids
        first = await _acquire(router, "z0", 5, 0)
        again = await _acquire(router, "z1", 5, 0)  # the same position again
        return [alone, no_ids, first, again]

    got = asyncio.run(run())
    assert got[1] == got[3] == SERVERS[-1]
    assert router.unplanned == 3


def test_a_failing_planner_leaves_the_request_to_verl(monkeypatch: pytest.MonkeyPatch) -> None:
    router, lb = _router()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("planner broke")

    monkeypatch.setattr(router.plan, "assignment", broken)

    async def run() -> str:
        await router.announce(["p0"])
        return await _acquire(router, "r0", 5, 0)

    assert asyncio.run(run()) == SERVERS[-1]
    assert router.unplanned == 1 and lb.acquired == {"r0": SERVERS[-1]}


def test_observe_teaches_the_next_batchs_predictions() -> None:
    router, _ = _router()
    asyncio.run(router.observe(["p0", "p0", "p1"], [100, 100, 40]))
    predicted = [m.length_tokens for m in router.plan.predictor.predict(["p0", "p1"])]
    assert predicted == pytest.approx([100, 40])


def test_the_router_yaml_in_the_verl_guide_is_valid() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "verl.md").read_text()
    block = re.search(r"```yaml\n(router_class: .*?|#[^\n]*\nrouter_class: .*?)```", text, re.S)
    assert block, "docs/verl.md lost its FlexFloor router YAML"
    doc = yaml.safe_load(block.group(1))
    assert (
        doc["router_class"] == f"{verl_placement.__name__}.{verl_placement.PlannerRouter.__name__}"
    )
    settings = verl_placement.RouterSettings.from_yaml(doc)
    assert settings.layout.kv_budget_bytes(8)[0] > 0


class Columns:
    """A verl batch's non-tensor columns (``DataProto.non_tensor_batch``)."""

    def __init__(self, **columns: list[Any]) -> None:
        self.non_tensor_batch = columns

    def __len__(self) -> int:
        return len(next(iter(self.non_tensor_batch.values())))


def test_batch_prompts_reads_the_dataset_index_and_refuses_a_foreign_priority() -> None:
    assert verl_placement.batch_prompts(Columns(index=[7, 7, 9], uid=["a", "a", "b"])) == [7, 7, 9]
    assert verl_placement.batch_prompts(Columns(uid=["a", "b"], priority=[0, 1])) == ["a", "b"]
    assert verl_placement.batch_prompts(Columns(raw_prompt=["x", "y"])) == [0, 1]
    with pytest.raises(ValueError, match="priority"):
        verl_placement.batch_prompts(Columns(index=[1, 2], priority=[5, 3]))
