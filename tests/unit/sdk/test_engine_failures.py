"""Elastic-EP adapters against engines that fail, as fake HTTP servers on 127.0.0.1.

The fakes answer as the pinned engines' source does (``rlenergy/sdk/engines.py`` cites it):
vLLM 0.33.0 (``/version``, ``/server_info?config_format=json`` with its ``parallel_config``,
``/v1/models``, ``/v1/completions``, ``POST /is_scaling_elastic_ep``, ``/scale_elastic_ep``
answering 500 "Scale failed" whatever the cause) and SGLang 0.5.23 (``GET
/is_scaling_elastic_ep`` with ``effective_ep_size`` / ``scale_phase`` / ``last_error``, 409
while a scale is pending). We test one failure each:
* capabilities: a shrink below vLLM's EPLB floor (DP = 1 at TP = 1), an engine whose
  capabilities cannot be read (no ``VLLM_SERVER_DEV_MODE``), an external-LB engine: refused
  at prepare, nothing sent;
* terminal conflicts: a 409 ("already in progress"), a status error "already active", and
  vLLM's 500 that leaves its reconfiguration prepared: the engine is degraded, later releases
  send nothing, ``failure_of`` says ``EngineDegraded``, the planner stops releasing, and the
  operator shows a Warning Event;
* the size read back: a partial shrink records the reported group and parks only the ranks
  outside it; a scale the engine did not apply aborts; an engine that does not serve a
  1-token request afterwards is in flight, not committed;
* grow-back: a partial or refused grow-back is ``ShrinkRecoveryFailed`` with the size read
  back; SGLang's grow-back waits for ``scale_phase`` to settle and reads ``effective_ep_size``.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from rlenergy_operator import rolloutfaults

from rlenergy.api import node as api_node
from rlenergy.api import rollout as api
from rlenergy.control.moe import base, placement
from rlenergy.sdk import engines, planner, rollout


class Engine(http.server.BaseHTTPRequestHandler):
    """One fake engine per test (class state reset by the fixture)."""

    kind = "vllm"
    requests: list[tuple[str, str, Any]] = []
    dp = 4  # vLLM: data_parallel_size; SGLang: effective_ep_size
    tp = 1
    dev_mode = True  # vLLM serves /server_info only with VLLM_SERVER_DEV_MODE=1
    external_lb = False
    scale_to: int | None = None  # the size a scale really reaches (None: the size asked)
    scale_status = 200
    scale_reply: Any = None
    status_error: str | None = None
    completions_ok = True
    phases: list[str] = []  # SGLang scale_phase replies after a scale, then "serving_expanded"

    def _send(self, code: int, reply: Any) -> None:
        data = json.dumps(reply).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        Engine.requests.append(("GET", self.path, None))
        if Engine.kind == "sglang":
            if self.path == "/server_info":
                return self._send(200, {"version": "0.5.23", "ep_size": Engine.dp})
            if self.path == "/is_scaling_elastic_ep":
                phase = Engine.phases.pop(0) if Engine.phases else "serving_expanded"
                return self._send(
                    200,
                    {
                        "is_scaling_elastic_ep": phase in ("waiting_for_cohort", "pending"),
                        "effective_ep_size": Engine.dp,
                        "pending_ep_size": None,
                        "scale_phase": phase,
                        "last_error": Engine.status_error,
                    },
                )
            return self._send(404, {"detail": "Not Found"})
        if self.path == "/version":
            return self._send(200, {"version": "0.33.0"})
        if self.path == "/server_info?config_format=json" and Engine.dev_mode:
            pc = {
                "tensor_parallel_size": Engine.tp,
                "prefill_context_parallel_size": 1,
                "data_parallel_size": Engine.dp,
                "data_parallel_external_lb": Engine.external_lb,
                "data_parallel_hybrid_lb": False,
                "enable_expert_parallel": True,
                "enable_eplb": True,
                "enable_elastic_ep": True,
            }
            return self._send(200, {"vllm_config": {"parallel_config": pc}, "vllm_env": {}})
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "qwen3", "object": "model"}]})
        return self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        Engine.requests.append(("POST", self.path, body))
        if self.path == "/scale_elastic_ep":
            if Engine.scale_status != 200:
                return self._send(Engine.scale_status, Engine.scale_reply)
            asked = body.get("new_data_parallel_size", body.get("new_ep_size"))
            old = Engine.dp
            Engine.dp = Engine.scale_to if Engine.scale_to is not None else asked
            if Engine.kind == "sglang":
                return self._send(
                    200, {"message": "scale requested", "old_ep_size": old, "new_ep_size": asked}
                )
            return self._send(200, {"message": f"Scaled to {asked} data parallel engines"})
        if self.path == "/is_scaling_elastic_ep" and Engine.kind == "vllm":
            return self._send(
                200,
                {
                    "is_scaling_elastic_ep": False,
                    "phase": "failed" if Engine.status_error else "idle",
                    "epoch": None,
                    "error": Engine.status_error,
                    "requested_data_parallel_size": None,
                },
            )
        if self.path == "/v1/completions":
            if Engine.completions_ok:
                return self._send(200, {"object": "text_completion", "choices": [{"text": "0"}]})
            return self._send(500, {"error": {"message": "EngineCore encountered an issue"}})
        return self._send(404, {"detail": "Not Found"})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    Engine.kind = "vllm"
    Engine.requests = []
    Engine.dp, Engine.tp = 4, 1
    Engine.dev_mode, Engine.external_lb = True, False
    Engine.scale_to, Engine.scale_status, Engine.scale_reply = None, 200, None
    Engine.status_error, Engine.completions_ok, Engine.phases = None, True, []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def decision(release: Sequence[int] = (2, 3), active: Sequence[int] = (0, 1, 2, 3), n: int = 1):
    return api.ReleaseDecision.model_validate(
        {
            "rolloutId": "step-9",
            "decisionId": n,
            "release": list(release),
            "moves": [],
            "activeBefore": list(active),
            "decidedAtStep": 100,
            "ackDeadlineStep": 108,
            "applyAtStep": 110,
        }
    )


def scales() -> list[Any]:
    return [b for m, p, b in Engine.requests if m == "POST" and p == "/scale_elastic_ep"]


def vllm(url: str, ranks: int = 4) -> engines.VllmElasticEngine:
    return engines.VllmElasticEngine(url, ranks=ranks, sleep=lambda _: None, timeout_s=5)


class Agent:
    def __init__(self) -> None:
        self.parks: list[int] = []

    def park(self, step: int, *, gpus: Sequence[str] = ()) -> dict[str, Any]:
        self.parks.append(step)
        return {}


# -- capabilities ------------------------------------------------------------------------------


def test_probe_reads_the_capabilities_when_the_adapter_registers(url):
    eng = vllm(url)
    caps = eng.capabilities
    assert caps is not None and (caps.version, caps.ranks, caps.lb_mode) == (
        "0.33.0",
        4,
        "internal",
    )
    assert caps.can_shrink and caps.can_grow and caps.floor_ranks == 2


def test_shrink_below_the_eplb_floor_is_refused_at_prepare(url):
    # vLLM's EPLB refuses TP x PCP x DP <= 1 at start-up: DP 2 -> 1 at TP 1 must never be sent.
    Engine.dp = 2
    eng = vllm(url, ranks=2)
    outcome = rollout.apply_release(eng, decision(release=(1,), active=(0, 1)))
    assert outcome.status == "Aborted" and "floor of 2" in (outcome.reason or "")
    assert scales() == [] and eng.active_ranks() == (0, 1)


def test_engine_whose_capabilities_cannot_be_read_is_never_resized(url):
    Engine.dev_mode = False  # /server_info is 404 without VLLM_SERVER_DEV_MODE=1
    eng = vllm(url)
    outcome = rollout.apply_release(eng, decision())
    assert outcome.status == "Aborted" and "VLLM_SERVER_DEV_MODE=1" in (outcome.reason or "")
    assert scales() == []


def test_external_lb_engine_is_refused_at_prepare(url):
    Engine.external_lb = True
    outcome = rollout.apply_release(vllm(url), decision())
    assert outcome.status == "Aborted" and "every rank's API server" in (outcome.reason or "")
    assert scales() == []


# -- terminal conflicts ------------------------------------------------------------------------


def test_409_is_terminal_for_the_engine(url):
    # Dynamo's worker answers a scale while its scale flag is held with 409 "already in progress".
    Engine.scale_status = 409
    Engine.scale_reply = {"error": "scale_elastic_ep already in progress"}
    eng = vllm(url)
    first = rollout.apply_release(eng, decision())
    assert first.status == "Aborted" and first.active_workers == [0, 1, 2, 3]
    failure = rollout.failure_of(first, eng)
    assert failure is not None and failure.reason == "EngineDegraded"
    assert "409" in failure.message
    before = len(Engine.requests)
    again = rollout.apply_release(eng, decision(n=2))
    assert again.status == "Aborted" and "engine degraded" in (again.reason or "")
    assert len(Engine.requests) == before  # no retry: nothing at all is sent again
    assert len(scales()) == 1


def test_status_error_already_active_is_terminal(url):
    Engine.status_error = "Another external Elastic EP scaling operation is already active."
    eng = vllm(url)
    assert rollout.apply_release(eng, decision()).status == "Aborted"
    assert eng.degraded is not None and "already active" in eng.degraded
    before = len(Engine.requests)
    rollout.apply_release(eng, decision(n=2))
    assert len(Engine.requests) == before and scales() == []


def test_vllm_500_with_the_engine_idle_and_unchanged_is_terminal(url):
    # vLLM keeps a failed reconfiguration prepared ("... already active" on every later scale)
    # and answers 500 "Scale failed"; the engine is idle at its old size afterwards.
    Engine.scale_status = 500
    Engine.scale_reply = {"error": {"message": "Scale failed", "type": "Internal Server Error"}}
    eng = vllm(url)
    outcome = rollout.apply_release(eng, decision())
    assert outcome.status == "Aborted" and outcome.active_workers == [0, 1, 2, 3]
    assert "already active" in (outcome.reason or "")
    rollout.apply_release(eng, decision(n=2))
    assert len(scales()) == 1


def test_planner_stops_releasing_on_a_degraded_engine():
    layout = base.MoeLayout(
        num_experts=8,
        expert_bytes=1,
        dense_bytes=0,
        kv_bytes_per_token=1,
        worker_memory_bytes=10**6,
    )
    p = planner.RolloutPlanner(layout, placement.FluidFinishModel(0.01, 0.0, 1e6, 1, 256))
    p.place(
        api.PlacementRequest.model_validate(
            {"rolloutId": "s", "workers": [0, 1], "prompts": [{"promptId": "a", "promptTokens": 1}]}
        )
    )
    p.stop_releases("engine degraded: 409")
    reports = [
        api.ProgressReport.model_validate(
            {
                "rolloutId": "s",
                "worker": w,
                "decodeStep": 10,
                "unfinished": u,
                "experts": e,
                "kvBytes": 0,
            }
        )
        for w, u, e in ((0, 1, [0, 1, 2, 3]), (1, 0, [4, 5, 6, 7]))
    ]
    assert p.progress(reports) is None and p.releases_stopped == "engine degraded: 409"


def test_operator_shows_engine_degraded_with_a_warning_event():
    dispatch = api_node.RolloutDispatch.model_validate(
        {
            "step": 9,
            "activeWorkers": 4,
            "workerPods": [],
            "failure": {"reason": "EngineDegraded", "message": "409 already in progress"},
        }
    )
    found = rolloutfaults.assess(None, dispatch, [], "2026-01-01T00:00:00Z")
    assert found.degraded is not None and found.degraded[0] == "EngineDegraded"
    assert found.event is not None and found.event[:2] == ("Warning", "EngineDegraded")
    again = rolloutfaults.assess(found.failure, dispatch, [], "2026-01-01T00:01:00Z")
    assert again.event is None  # one Event per failure, no repeat


# -- the size read back ------------------------------------------------------------------------


def test_commit_records_the_size_read_back_and_parks_only_ranks_outside_it(url):
    Engine.scale_to = 3  # asked 2, the engine reports 3 DP ranks afterwards
    eng = vllm(url)
    d = decision()
    outcome = rollout.apply_release(eng, d)
    assert outcome.status == "Committed" and outcome.active_workers == [0, 1, 2]
    assert eng.active_ranks() == (0, 1, 2)
    agent = Agent()
    assert not rollout.park_if_released(agent, outcome, d, 2, 9)  # still in the engine's group
    assert rollout.park_if_released(agent, outcome, d, 3, 9)
    assert agent.parks == [9]


def test_a_scale_the_engine_did_not_apply_aborts_with_the_group_unchanged(url):
    Engine.scale_to = 4  # 200 "Scaled to 2 ...", yet the engine still runs 4 DP ranks
    eng = vllm(url)
    d = decision()
    outcome = rollout.apply_release(eng, d)
    assert outcome.status == "Aborted" and outcome.active_workers == [0, 1, 2, 3]
    assert "nothing was released" in (outcome.reason or "")
    assert not rollout.park_if_released(Agent(), outcome, d, 3, 9)


def test_an_engine_that_does_not_serve_after_the_resize_is_in_flight(url):
    Engine.completions_ok = False
    outcome = rollout.apply_release(vllm(url), decision())
    assert outcome.status == "InFlight" and "1-token completion" in (outcome.reason or "")
    assert outcome.active_workers == [0, 1, 2, 3]


# -- grow-back ---------------------------------------------------------------------------------


def test_grow_back_reads_the_size_back_and_a_short_one_is_shrink_recovery_failed(url):
    eng = vllm(url)
    assert rollout.apply_release(eng, decision()).active_workers == [0, 1]
    Engine.scale_to = 3  # the grow-back to 4 reaches only 3 DP ranks
    grown = rollout.grow_back(eng, 4)
    assert grown.active == (0, 1, 2)
    assert grown.failure is not None and grown.failure.reason == "ShrinkRecoveryFailed"
    assert "3 ranks" in grown.failure.message
    assert scales()[-1] == {"new_data_parallel_size": 4, "drain_timeout": 120}


def test_a_refused_grow_back_is_shrink_recovery_failed_and_keeps_the_size(url):
    eng = vllm(url)
    rollout.apply_release(eng, decision())
    Engine.scale_status, Engine.scale_reply = 409, {"error": "already in progress"}
    grown = rollout.grow_back(eng, 4)
    assert grown.active == (0, 1) and grown.failure is not None
    assert grown.failure.reason == "ShrinkRecoveryFailed" and eng.degraded is not None


def test_sglang_grows_back_once_scale_phase_settles(url):
    Engine.kind, Engine.dp = "sglang", 4
    eng = engines.SglangElasticEngine(url, ranks=8, sleep=lambda _: None, timeout_s=5)
    assert eng.capabilities is not None and not eng.capabilities.can_shrink
    eng._active = (0, 1, 2, 3)  # started at 4 of --max-ep-size 8: grow into the joiners
    Engine.phases = ["pending", "joining", "warming_up"]
    grown = rollout.grow_back(eng, 8)
    assert grown.failure is None and grown.active == tuple(range(8))
    assert scales() == [{"new_ep_size": 8}]


def test_sglang_failed_scale_phase_is_shrink_recovery_failed(url):
    Engine.kind, Engine.dp = "sglang", 4
    eng = engines.SglangElasticEngine(url, ranks=8, sleep=lambda _: None, timeout_s=5)
    eng._active = (0, 1, 2, 3)
    Engine.scale_to = 4  # the joiners never arrive
    Engine.phases = ["pending", "failed", "failed"]
    grown = rollout.grow_back(eng, 8)
    assert grown.active == (0, 1, 2, 3)
    assert grown.failure is not None and grown.failure.reason == "ShrinkRecoveryFailed"


def test_sglang_409_for_a_pending_scale_is_terminal(url):
    # SGLang answers a scale while one is pending with 409 and this text (tokenizer_manager).
    Engine.kind, Engine.dp = "sglang", 4
    eng = engines.SglangElasticEngine(url, ranks=8, sleep=lambda _: None, timeout_s=5)
    eng._active = (0, 1, 2, 3)
    Engine.scale_status = 409
    Engine.scale_reply = {
        "error": "A previous scale operation has not completed yet. Wait until all pending "
        "ranks have joined before issuing another scale."
    }
    grown = rollout.grow_back(eng, 8)
    assert grown.failure is not None and grown.failure.reason == "ShrinkRecoveryFailed"
    assert eng.degraded is not None and "not completed yet" in eng.degraded
    again = rollout.grow_back(eng, 8)
    assert again.failure is not None and len(scales()) == 1  # nothing sent a second time


def test_planner_follows_the_engines_floor_and_shrink_capability(url):
    layout = base.MoeLayout(
        num_experts=8,
        expert_bytes=1,
        dense_bytes=0,
        kv_bytes_per_token=1,
        worker_memory_bytes=10**6,
    )

    def planner_after(follow: engines.EngineCapabilities | None) -> api.ReleaseDecision | None:
        p = planner.RolloutPlanner(layout, placement.FluidFinishModel(0.01, 0.0, 1e6, 1, 256))
        if follow is not None:
            p.follow_engine(follow.can_shrink, follow.floor_ranks, follow.refusal)
        p.place(
            api.PlacementRequest.model_validate(
                {
                    "rolloutId": "s",
                    "workers": [0, 1],
                    "prompts": [{"promptId": "a", "promptTokens": 1}],
                }
            )
        )
        reports = [
            api.ProgressReport.model_validate(
                {
                    "rolloutId": "s",
                    "worker": w,
                    "decodeStep": 10,
                    "unfinished": u,
                    "experts": e,
                    "kvBytes": 0,
                }
            )
            for w, u, e in ((0, 1, [0, 1, 2, 3]), (1, 0, [4, 5, 6, 7]))
        ]
        return p.progress(reports)

    Engine.dp = 2
    caps = vllm(url, ranks=2).capabilities
    assert caps is not None and caps.floor_ranks == 2
    assert planner_after(None) is not None  # without the engine's floor: DP 2 -> 1 decided
    assert planner_after(caps) is None  # with it: never decided, never refused at prepare
    Engine.kind = "sglang"
    grow_only = engines.SglangElasticEngine(url, ranks=2, timeout_s=5).capabilities
    assert grow_only is not None and planner_after(grow_only) is None
