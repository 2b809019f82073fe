"""Elastic-EP engine adapters against a fake HTTP server on 127.0.0.1; the in-process planner.

We test these aspects:
* the vLLM adapter sends its scale body and polls until scaling ends; vLLM's 503 "currently
  scaling" reads as scaling; the SGLang adapter refuses every release (the pinned SGLang scales
  up only) and sends nothing;
* prepare refuses what the engine cannot do (non-top ranks, expert copies, scaling running),
  and then nothing is sent; apply_release aborts with the group unchanged;
* a scale that was sent and outlives the commit timeout, or whose blocking call gets no
  answer, is reported InFlight (never Aborted); vLLM's scale call may block for
  drain_timeout plus the commit timeout;
* the in-process planner: balanced placement, a release round committed by acks, a hung rank
  aborted by the wall-clock deadline although no decode step passes;
* the simulated engine: an unresponsive rank aborts, an orphaning release is refused.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rlenergy import errors
from rlenergy.api import rollout as api
from rlenergy.control.moe import base
from rlenergy.sdk import engines, rollout
from rlenergy.sim import moe_engine


class FakeEngine(http.server.BaseHTTPRequestHandler):
    calls: list[tuple[str, Any]] = []  # POSTs (GET probes are not recorded)
    scaling_polls = 1  # how many status polls report "scaling" after a scale call
    pending = 0
    replies: dict[str, Any] = {}
    busy_503 = False  # answer the status probe 503 while scaling, as vLLM's middleware does
    scale_delay_s = 0.0  # the scale call blocks this long before it answers
    dp = 4  # the data-parallel size vLLM reports in /server_info (set by a scale call)

    def do_GET(self) -> None:  # noqa: N802
        # What vLLM 0.33.0 serves (VLLM_SERVER_DEV_MODE=1) and SGLang 0.5.23's status route.
        if self.path == "/version":
            reply: Any = {"version": "0.33.0"}
        elif self.path == "/server_info?config_format=json":
            pc = {
                "tensor_parallel_size": 1,
                "data_parallel_size": FakeEngine.dp,
                "enable_elastic_ep": True,
                "enable_eplb": True,
                "data_parallel_external_lb": False,
            }
            reply = {"vllm_config": {"parallel_config": pc}}
        elif self.path == "/v1/models":
            reply = {"object": "list", "data": [{"id": "m", "object": "model"}]}
        elif self.path == "/is_scaling_elastic_ep":
            reply = {
                "is_scaling_elastic_ep": False,
                "effective_ep_size": 4,
                "pending_ep_size": None,
                "scale_phase": "idle",
                "last_error": None,
            }
        else:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        FakeEngine.calls.append((self.path, body))
        if self.path.endswith("/scale_elastic_ep"):
            time.sleep(FakeEngine.scale_delay_s)
            FakeEngine.pending = FakeEngine.scaling_polls
            FakeEngine.dp = body.get("new_data_parallel_size", FakeEngine.dp)
            reply: Any = {"message": f"Scaled to {FakeEngine.dp} data parallel engines"}
        elif self.path == "/v1/completions":
            reply = {"object": "text_completion", "choices": [{"text": "1"}]}
        elif self.path.endswith("/is_scaling_elastic_ep"):
            scaling = FakeEngine.pending > 0
            FakeEngine.pending = max(FakeEngine.pending - 1, 0)
            if scaling and FakeEngine.busy_503:
                data = b'{"error": "The model is currently scaling. Please try again later."}'
                self.send_response(503)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
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
    FakeEngine.busy_503 = False
    FakeEngine.scale_delay_s = 0.0
    FakeEngine.dp = 4
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


def test_sglang_refuses_every_release_and_sends_nothing(server):
    # SGLang 0.5.23's scheduler refuses a new_ep_size not above the effective EP size.
    eng = engines.SglangElasticEngine(server, ranks=4, sleep=no_sleep)
    outcome = rollout.apply_release(eng, decision(release=(3,)))
    assert outcome.status == "Aborted" and "scales up only" in (outcome.reason or "")
    assert outcome.active_workers == [0, 1, 2, 3] and FakeEngine.calls == []


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


def test_commit_timeout_is_in_flight_not_aborted(server):
    FakeEngine.scaling_polls = 10**6
    clock = iter(range(0, 10**6, 5))
    eng = engines.VllmElasticEngine(
        server, ranks=4, sleep=no_sleep, commit_timeout_s=20, monotonic=lambda: next(clock)
    )
    outcome = rollout.apply_release(eng, decision())
    assert outcome.status == "InFlight" and "still scaling" in (outcome.reason or "")
    assert outcome.active_workers == [0, 1, 2, 3]  # the group before: not known to be after


def test_vllm_503_while_scaling_reads_as_scaling(server):
    FakeEngine.busy_503 = True
    FakeEngine.scaling_polls = 3
    eng = engines.VllmElasticEngine(server, ranks=4, sleep=no_sleep)
    outcome = rollout.apply_release(eng, decision())
    assert outcome.status == "Committed" and outcome.active_workers == [0, 1]
    polls = [p for p, _ in FakeEngine.calls if p == "/is_scaling_elastic_ep"]
    assert len(polls) == 1 + 4  # prepare's check, then 3 x 503 and the final "done"


def test_vllm_scale_call_may_block_for_the_drain(server):
    # vLLM answers /scale_elastic_ep only when the resize ended; the adapter waits for
    # drain_timeout + commit_timeout, not the 1 s per-request timeout.
    FakeEngine.scale_delay_s = 1.5
    eng = engines.VllmElasticEngine(
        server, ranks=4, sleep=no_sleep, timeout_s=1, drain_timeout_s=2, commit_timeout_s=2
    )
    assert rollout.apply_release(eng, decision()).status == "Committed"


def test_scale_call_without_answer_is_in_flight(server):
    FakeEngine.scale_delay_s = 2.0  # longer than drain_timeout 1 s + commit timeout 0.5 s
    eng = engines.VllmElasticEngine(
        server, ranks=4, sleep=no_sleep, timeout_s=0.5, drain_timeout_s=1, commit_timeout_s=0.5
    )
    outcome = rollout.apply_release(eng, decision())
    assert outcome.status == "InFlight" and "outcome unknown" in (outcome.reason or "")


def test_vllm_refuses_a_non_positive_drain_timeout():
    with pytest.raises(errors.InvalidInputError):
        engines.VllmElasticEngine("http://127.0.0.1:9", ranks=2, drain_timeout_s=0)


def test_unreachable_engine_aborts():
    eng = engines.VllmElasticEngine("http://127.0.0.1:9", ranks=4, sleep=no_sleep, timeout_s=1)
    assert rollout.apply_release(eng, decision()).status == "Aborted"


def _planner(clock):
    from rlenergy.control.moe import placement
    from rlenergy.sdk import planner

    layout = base.MoeLayout(
        num_experts=8,
        expert_bytes=1,
        dense_bytes=0,
        kv_bytes_per_token=1,
        worker_memory_bytes=10**6,
    )
    fluid = placement.FluidFinishModel(0.01, 0.0, 1e6, 1, 256)
    return planner.RolloutPlanner(layout, fluid, ack_timeout_s=5.0, clock=lambda: clock[0])


def _report(worker, step, unfinished, experts):
    return api.ProgressReport.model_validate(
        {
            "rolloutId": "step-7",
            "worker": worker,
            "decodeStep": step,
            "unfinished": unfinished,
            "experts": experts,
            "kvBytes": 0,
        }
    )


def _request():
    return api.PlacementRequest.model_validate(
        {
            "rolloutId": "step-7",
            "workers": [0, 1],
            "prompts": [
                {"promptId": "long", "promptTokens": 10, "responses": 2},
                {"promptId": "short", "promptTokens": 10, "responses": 2},
            ],
        }
    )


def test_planner_balances_and_commits_a_release_by_acks():
    clock = [0.0]
    p = _planner(clock)
    p.observe(["long", "long", "short", "short"], [4000, 4000, 100, 100])
    placed = p.place(_request())
    by = {(a.prompt_id, a.response_index): a.worker for a in placed.assignments}
    # The two long responses go to different ranks (contiguous chunks would pair them).
    assert by[("long", 0)] != by[("long", 1)]
    assert p.progress([_report(0, 50, 1, [0, 1, 2, 3])]) is None  # rank 1 not reported yet
    d = p.progress([_report(1, 50, 0, [4, 5, 6, 7])])
    assert d is not None and d.release == [1] and d.ack_deadline_step > 50
    assert {m.expert for m in d.moves} == {4, 5, 6, 7}
    assert (
        p.acknowledge(api.ReleaseAck(rolloutId="step-7", decisionId=d.decision_id, worker=0))
        is None
    )
    out = p.acknowledge(api.ReleaseAck(rolloutId="step-7", decisionId=d.decision_id, worker=1))
    assert out is not None and out.status == "Committed" and out.active_workers == [0]
    assert p.active_workers == (0,)


def test_planner_wall_clock_deadline_aborts_a_hung_round():
    # A hung collective takes no decode step: only the clock can end the round.
    clock = [0.0]
    p = _planner(clock)
    p.place(_request())
    d = p.progress([_report(0, 10, 2, [0, 1, 2, 3]), _report(1, 10, 0, [4, 5, 6, 7])])
    assert d is not None
    p.acknowledge(api.ReleaseAck(rolloutId="step-7", decisionId=d.decision_id, worker=1))
    clock[0] = 4.9
    assert p.poll(decode_step=10) is None
    clock[0] = 5.0
    out = p.poll(decode_step=10)
    assert out is not None and out.status == "Aborted" and out.active_workers == [0, 1]
    assert "within 5 s" in (out.reason or "")
    assert p.active_workers == (0, 1)


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


def test_planner_rank_lost_aborts_the_round_and_tears_down():
    clock = [0.0]
    p = _planner(clock)
    p.place(_request())
    d = p.progress([_report(0, 10, 2, [0, 1, 2, 3]), _report(1, 10, 0, [4, 5, 6, 7])])
    assert d is not None
    loss = p.rank_lost(0, "pod rl/worker-0 deleted")
    assert loss.teardown and loss.active_workers == (1,)
    assert loss.aborted is not None and loss.aborted.status == "Aborted"
    assert "rank 0 lost" in (loss.aborted.reason or "")
    assert p.poll(decode_step=100) is None  # the round is gone, nothing waits on rank 0
    with pytest.raises(errors.InvalidInputError):
        p.rank_lost(0, "again")
