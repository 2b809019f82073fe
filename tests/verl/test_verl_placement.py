"""FlexFloor's router places verl's rollout requests: verl 0.9.1's real agent loop on a CPU.

The job's settings are the documented ones: the hook (``verl_hook.install``) and verl's
``actor_rollout_ref.rollout.router_config_path`` naming a YAML whose ``router_class`` is
``rlenergy.sdk.verl_placement.PlannerRouter``. What runs for real: a local Ray on loopback,
verl's router factory (``get_router_handle``), ``LLMServerClient``, ``AgentLoopManager``
(hook-wrapped), its ``AgentLoopWorker`` actors and ``SingleTurnAgentLoop`` with a real
tokenizer; the rollout servers are stand-ins that generate a scripted number of tokens per
prompt (``rlenergy_dev.verlrouting``).

We test these aspects:
* every request of a batch reaches the server the planner's ``assign`` gives its sample (the
  prompts each server saw, against a planner fed the same history);
* no server holds more KV than its budget (``MoeLayout.kv_budget_bytes``: its experts leave
  it less), counted with the real prompt and response lengths, on a batch whose longest-first
  deal alone overflows the first server;
* the predictor learns each prompt's response length from the batch verl returns (the second
  step's predictions are the first step's lengths);
* without the hook the same router hands every request to verl's own balancer and the batch
  completes;
* a router YAML without a required field fails at the router's start, naming the field.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import numpy as np
    import ray
    import yaml
    from rlenergy_dev import verlrouting
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.protocol import DataProto
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

from rlenergy.control.moe import placement
from rlenergy.sdk import verl_placement

GROUP = 2
"""rollout.n: samples per prompt."""
SCRIPT = {4: 400, 5: 300, 6: 200, 7: 100, 8: 50, 9: 20}
"""Prompt tokens -> the response tokens a server generates for it (one prompt per length)."""
ROUTER = {
    "router_class": "rlenergy.sdk.verl_placement.PlannerRouter",
    "experts": 3,
    "bytesPerExpert": 100_000,
    "denseBytes": 0,
    "kvBytesPerToken": 1_000,
    "workerMemoryBytes": 1_300_000,
    "decodeStepEmptyS": 0.02,
    "decodeStepFullS": 0.05,
    "gatherTimeoutS": 60,
}
"""Two servers: server 0 holds 2 of the 3 experts (KV budget 1.1 MB), server 1 one (1.2 MB);
the batch's KV is 2.216 MB."""


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return verlrouting.tiny_model(tmp_path_factory.mktemp("tiny-model"))


def _router(tmp_path: Path, doc: dict[str, Any], servers: dict[str, Any]) -> Any:
    path = tmp_path / "flexfloor-router.yaml"
    path.write_text(yaml.safe_dump(doc))
    return get_router_handle(servers=servers, router_config_path=str(path))


def _rollout(tmp_path: Path, model: Path) -> tuple[AgentLoopManager, Any, dict[str, Any]]:
    config = verlrouting.agent_loop_config(model, workers=2, prompt_tokens=16, response_tokens=512)
    server_cls = ray.remote(verlrouting.ScriptedServer)
    servers = {f"127.0.0.1:{9000 + k}": server_cls.remote(f"s{k}", SCRIPT) for k in range(2)}
    router = _router(tmp_path, ROUTER, servers)
    client = LLMServerClient(config, load_balancer_handle=router)
    manager = AgentLoopManager.create(config=config, llm_client=client)
    return manager, router, servers


def _batch() -> DataProto:
    """One prompt per length of ``SCRIPT``, each repeated ``GROUP`` times (verl's interleave)."""
    prompts = list(SCRIPT)
    messages = [[{"role": "user", "content": verlrouting.prompt_words(k, k)}] for k in prompts]
    batch = DataProto.from_dict(
        non_tensors={
            "raw_prompt": np.array(messages, dtype=object),
            "index": np.array([100 + k for k in prompts], dtype=object),
        }
    )
    return batch.repeat(repeat_times=GROUP, interleave=True)


def _served(servers: dict[str, Any]) -> dict[str, Counter[int]]:
    """Prompt lengths each server generated for (a multiset), since the last call."""
    return {
        name: Counter(p for p, _ in ray.get(handle.requests.remote()))
        for name, handle in servers.items()
    }


def _since(
    now: dict[str, Counter[int]], before: dict[str, Counter[int]]
) -> dict[str, Counter[int]]:
    return {name: now[name] - before[name] for name in now}


@pytest.mark.usefixtures("hooked")
def test_the_planner_places_every_request_within_each_servers_kv_budget(
    local_ray: None, model: Path, tmp_path: Path
) -> None:
    assert getattr(AgentLoopManager.__dict__["generate_sequences"], "__rlenergy_patched__", False)
    manager, router, servers = _rollout(tmp_path, model)
    names = list(servers)
    settings = verl_placement.RouterSettings.from_yaml(ROUTER)
    budgets = settings.layout.kv_budget_bytes(len(names))
    assert budgets == (1_100_000, 1_200_000)

    first = manager.generate_sequences(_batch())
    lengths = verl_placement.response_lengths(first)
    keys = verl_placement.batch_prompts(_batch())
    assert lengths == [float(SCRIPT[k - 100]) for k in keys]  # as the servers generated them
    step1 = _served(servers)

    second = manager.generate_sequences(_batch())
    assert verl_placement.response_lengths(second) == lengths
    served = _since(_served(servers), step1)
    status = ray.get(router.get_status.remote())
    assert status["unplanned"] == 0

    # The planner's own assignment for this batch, from the same history.
    expected = settings.planner()
    expected.observe(keys, lengths)
    tokens = [k - 100 for k in keys]  # the prompt of index 100 + k has k tokens
    chosen, predicted = expected.assignment(keys, tokens, len(names), kv_budget_bytes=budgets)
    assert predicted == pytest.approx(lengths)  # learned from verl's output
    want = {name: Counter[int]() for name in names}
    for sample, server in enumerate(chosen.worker_of):
        want[names[server]][tokens[sample]] += 1
    assert served == want

    placed = status["placement"]
    assert [p["server"] for p in placed] == [names[w] for w in chosen.worker_of]
    kv = dict.fromkeys(names, 0)
    for p in placed:
        assert p["prompt_tokens"] == tokens[p["sample"]]
        if not p["queued"]:
            kv[p["server"]] += placement.response_kv_bytes(
                p["prompt_tokens"], SCRIPT[p["prompt_tokens"]], ROUTER["kvBytesPerToken"]
            )
    for name, budget in zip(names, budgets, strict=True):
        assert 0 < kv[name] <= budget
    assert not any(p["queued"] for p in placed)

    # The longest-first deal alone would not fit: the memory rule moved a response.
    dealt = placement.place_lockstep(lengths, len(names))
    deal_kv = [0, 0]
    for i, w in enumerate(dealt):
        deal_kv[w] += placement.response_kv_bytes(tokens[i], lengths[i], 1_000)
    assert deal_kv[0] > budgets[0]


def test_without_the_hook_verls_balancer_serves_every_request(
    local_ray: None, model: Path, tmp_path: Path
) -> None:
    assert not getattr(AgentLoopManager.__dict__["generate_sequences"], "__rlenergy_patched__", 0)
    manager, router, servers = _rollout(tmp_path, model)
    out = manager.generate_sequences(_batch())
    assert len(out) == len(SCRIPT) * GROUP
    status = ray.get(router.get_status.remote())
    assert status["unplanned"] == len(SCRIPT) * GROUP
    assert sum(sum(c.values()) for c in _served(servers).values()) == len(SCRIPT) * GROUP


def test_a_router_yaml_without_a_field_names_it(local_ray: None, tmp_path: Path) -> None:
    doc = {k: v for k, v in ROUTER.items() if k != "kvBytesPerToken"}
    router = _router(tmp_path, doc, {})
    with pytest.raises(Exception, match="kvBytesPerToken"):
        ray.get(router.get_all_servers.remote())
