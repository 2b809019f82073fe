"""Elastic-EP engine adapters and the rollout client against a fake HTTP server on 127.0.0.1.

We test these aspects:
* vLLM and SGLang adapters send their engine's scale body and poll until scaling ends;
* prepare refuses what the engine cannot do (non-top ranks, expert copies, scaling running),
  and then nothing is sent; apply_release aborts with the group unchanged;
* a scale that outlives the commit timeout aborts; the client parses planner replies;
* the simulated engine: an unresponsive rank aborts, an orphaning release is refused.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from rlenergy import errors
from rlenergy.api import rollout as api
from rlenergy.control.moe import base
from rlenergy.sdk import engines, rollout
from rlenergy.sim import moe_engine


class FakeEngine(http.server.BaseHTTPRequestHandler):
    calls: list[tuple[str, Any]] = []
    scaling_polls = 1  # how many status polls report "scaling" after a scale call
    pending = 0
    replies: dict[str, Any] = {}

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        FakeEngine.calls.append((self.path, body))
        if self.path.endswith("/scale_elastic_ep"):
            FakeEngine.pending = FakeEngine.scaling_polls
            reply: Any = {"ok": True}
        elif self.path.endswith("/is_scaling_elastic_ep"):
            scaling = FakeEngine.pending > 0
            FakeEngine.pending = max(FakeEngine.pending - 1, 0)
            reply = {"is_scaling_elastic_ep": scaling, "last_error": None}
        elif self.path in FakeEngine.replies:
            reply = FakeEngine.replies[self.path]
        else:
            self.send_response(404)
            self.end_headers()
            return
        data = b"" if reply is None else json.dumps(reply).encode()
        self.send_response(200 if data else 204)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    FakeEngine.calls = []
    FakeEngine.pending = 0
    FakeEngine.scaling_polls = 1
    FakeEngine.replies = {}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def decision(release=(2, 3), active=(0, 1, 2, 3), moves=()) -> api.ReleaseDecision:
    return api.ReleaseDecision.model_validate(
        {
            "rolloutId": "step-7",
            "decisionId": 3,
            "release": list(release),
            "moves": [dict(expert=e, source=s, target=t) for e, s, t in moves],
            "activeBefore": list(active),
            "decidedAtStep": 100,
            "ackDeadlineStep": 108,
            "applyAtStep": 110,
        }
    )


def no_sleep(_: float) -> None:
    pass


def test_vllm_commit_sends_new_dp_size_and_polls(server):
    eng = engines.VllmElasticEngine(server, ranks=4, sleep=no_sleep, drain_timeout_s=30)
    outcome = rollout.apply_release(eng, decision())
    assert outcome.status == "Committed" and outcome.active_workers == [0, 1]
    scale = [b for p, b in FakeEngine.calls if p == "/scale_elastic_ep"]
    assert scale == [{"new_data_parallel_size": 2, "drain_timeout": 30}]
    assert eng.active_ranks() == (0, 1)


def test_sglang_commit_sends_new_ep_size(server):
    eng = engines.SglangElasticEngine(server, ranks=4, sleep=no_sleep)
    assert rollout.apply_release(eng, decision(release=(3,))).status == "Committed"
    assert [b for p, b in FakeEngine.calls if p == "/scale_elastic_ep"] == [{"new_ep_size": 3}]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"release": (0,)}, "highest ranks"),
        ({"release": (3,), "moves": [(7, 3, 0)]}, "rebalances experts"),
        ({"release": (2,), "active": (0, 1, 2)}, "engine group"),
    ],
)
def test_prepare_refusal_aborts_and_sends_nothing(server, kwargs, reason):
    eng = engines.VllmElasticEngine(server, ranks=4, sleep=no_sleep)
    outcome = rollout.apply_release(eng, decision(**kwargs))
    assert outcome.status == "Aborted" and reason in (outcome.reason or "")
    assert outcome.active_workers == [0, 1, 2, 3]
    assert not [p for p, _ in FakeEngine.calls if p == "/scale_elastic_ep"]


def test_scaling_in_progress_refuses(server):
    FakeEngine.pending = 5
    eng = engines.VllmElasticEngine(server, ranks=4, sleep=no_sleep)
    outcome = rollout.apply_release(eng, decision())
    assert outcome.status == "Aborted" and "already running" in (outcome.reason or "")


def test_commit_timeout_aborts(server):
    FakeEngine.scaling_polls = 10**6
    clock = iter(range(0, 10**6, 5))
    eng = engines.VllmElasticEngine(
        server, ranks=4, sleep=no_sleep, commit_timeout_s=20, monotonic=lambda: next(clock)
    )
    outcome = rollout.apply_release(eng, decision())
    assert outcome.status == "Aborted" and "still scaling" in (outcome.reason or "")
    assert eng.active_ranks() == (0, 1, 2, 3)


def test_unreachable_engine_aborts():
    eng = engines.VllmElasticEngine("http://127.0.0.1:9", ranks=4, sleep=no_sleep, timeout_s=1)
    assert rollout.apply_release(eng, decision()).status == "Aborted"


def test_client_round_trip(server):
    FakeEngine.replies = {
        "/v1/rollout/placement": {
            "rolloutId": "step-7",
            "assignments": [
                {"promptId": "a", "responseIndex": 0, "worker": 1, "predictedTokens": 120.0}
            ],
        },
        "/v1/rollout/progress": decision().model_dump(by_alias=True),
        "/v1/rollout/ack": None,
    }
    client = rollout.RolloutClient(server)
    placed = client.request_placement(
        api.PlacementRequest.model_validate(
            {
                "rolloutId": "step-7",
                "workers": [0, 1],
                "prompts": [{"promptId": "a", "promptTokens": 10}],
            }
        )
    )
    assert placed.assignments[0].worker == 1
    report = api.ProgressReport.model_validate(
        {
            "rolloutId": "step-7",
            "worker": 3,
            "decodeStep": 100,
            "unfinished": 0,
            "experts": [6, 7],
            "kvBytes": 0,
        }
    )
    assert client.report_progress(report) == decision()
    ack = api.ReleaseAck.model_validate({"rolloutId": "step-7", "decisionId": 3, "worker": 0})
    assert client.acknowledge(ack) is None
    sent = dict(FakeEngine.calls)
    assert sent["/v1/rollout/progress"]["decodeStep"] == 100


def test_client_bad_reply_is_permanent(server):
    FakeEngine.replies = {"/v1/rollout/placement": {"nope": 1}}
    client = rollout.RolloutClient(server)
    with pytest.raises(errors.PermanentError):
        client.request_placement(
            api.PlacementRequest.model_validate(
                {
                    "rolloutId": "s",
                    "workers": [0],
                    "prompts": [{"promptId": "a", "promptTokens": 1}],
                }
            )
        )


def test_wire_decision_validation():
    with pytest.raises(ValueError, match="subset"):
        decision(release=(9,))
    with pytest.raises(ValueError, match="at least one active"):
        decision(release=(0, 1, 2, 3))


LAYOUT = base.MoeLayout(
    num_experts=8,
    expert_bytes=10**9,
    dense_bytes=2 * 10**9,
    kv_bytes_per_token=1,
    worker_memory_bytes=20 * 10**9,
)
SHARDS = [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_simulated_engine_commits_with_moves():
    eng = moe_engine.SimulatedElasticEngine(LAYOUT, SHARDS)
    d = decision(release=(3,), moves=[(6, 3, 0), (7, 3, 1)])
    assert rollout.apply_release(eng, d).status == "Committed"
    assert eng.active_ranks() == (0, 1, 2)
    assert {6, 7} <= eng.experts_of[0] | eng.experts_of[1]


def test_simulated_engine_refuses_orphaning_release():
    eng = moe_engine.SimulatedElasticEngine(LAYOUT, SHARDS)
    outcome = rollout.apply_release(eng, decision(release=(3,)))
    assert outcome.status == "Aborted" and "orphans experts" in (outcome.reason or "")
    assert eng.active_ranks() == (0, 1, 2, 3)


def test_simulated_engine_unresponsive_rank_aborts_and_group_is_whole():
    eng = moe_engine.SimulatedElasticEngine(LAYOUT, SHARDS, unresponsive=[1])
    outcome = rollout.apply_release(eng, decision(release=(3,), moves=[(6, 3, 0), (7, 3, 0)]))
    assert outcome.status == "Aborted" and "missed the ack deadline" in (outcome.reason or "")
    assert outcome.active_workers == [0, 1, 2, 3] and eng.active_ranks() == (0, 1, 2, 3)
    assert eng.experts_of[0] == {0, 1}


def test_adapters_satisfy_the_protocol():
    def use(engine: api.ElasticEngine) -> tuple[int, ...]:
        return engine.active_ranks()

    assert use(engines.SglangElasticEngine("http://127.0.0.1:1", ranks=2)) == (0, 1)
    assert use(moe_engine.SimulatedElasticEngine(LAYOUT, SHARDS)) == (0, 1, 2, 3)
