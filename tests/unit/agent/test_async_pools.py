"""Async verl pools: each pool's phases and tokens signalled from its own workers.

In verl's one-step-off and fully-async recipes the rollout replicas serve requests on their own
GPU pool while the trainer pool trains. Here the rollout pool's worker runs
``rlenergy.sdk.progress.RolloutPoolPhases`` over its engine's exposition (vLLM 0.33.0's
``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` gauges and
``vllm:generation_tokens`` counter, served on 127.0.0.1 by
``rlenergy_dev.vllmserver.VllmServer``) and signals the node agent of its own
node; the trainer pool's worker signals training and closes each step on the other node's
agent. The operator's async fold takes each phase from its own pool's node, and the async
policy's job loop accounts both pools' steps.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from agent_support import DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import server, service
from rlenergy_dev.vllmserver import VllmServer
from rlenergy_operator import jobloop

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy
from rlenergy.control.freq import aggregate
from rlenergy.sdk import progress

ROLLOUT = service.PodRef("team-a", "rollout-0", "11111111-2222-3333-4444-555555555555")
ACTOR = service.PodRef("team-a", "actor-0", "66666666-7777-8888-9999-000000000000")
TOKENS_PER_S = 20_000.0
BUSY_S = 0.5
PLAN = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=None, state="warmup"),
        api_node.PhasePlan(phase="training", clockMHz=None, state="warmup"),
    ],
)


def test_each_pool_signals_its_own_phases_and_the_async_fold_uses_them(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    drv = make_driver(2)
    rollout_gpu, actor_gpu = drv.uuids
    nodes = {
        "node-a": standin_agent({ROLLOUT: [rollout_gpu]}, PLAN, time.monotonic, node="node-a"),
        "node-b": standin_agent({ACTOR: [actor_gpu]}, PLAN, time.monotonic, node="node-b"),
    }
    servers = []
    clients = {}
    for name, agent in nodes.items():
        sock = short_tmp / f"{name}.sock"
        reviews = FakeReviews(node=name)  # each pod's token is bound to its own node
        servers.append(server.SignalServer(sock, agent, reviews.authenticator()))
        servers[-1].start()
        pod = ROLLOUT if name == "node-a" else ACTOR
        clients[name] = reviews.client(sock, pod, short_tmp, strict=True)
    engine = VllmServer(TOKENS_PER_S, max_running=4)  # vLLM's names, decoding while it holds
    asyncio.run(engine.launch_server())
    pool = progress.RolloutPoolPhases(
        progress.HttpExposition(engine.url, "vllm"), clients["node-a"], idle_after_s=0.1
    )
    decoded: list[float] = []
    try:
        pool.start()
        trainer = clients["node-b"]
        for step in range(3):
            pool.set_step(step)  # the rollout worker's update_weights(global_steps=step)
            before = engine.decoded
            engine.serve(6)  # the rollouter's requests for the next batch
            trainer.phase("training", step=step)  # the trainer pool trains at the same time
            time.sleep(BUSY_S)
            trainer.progress_total(1000.0)
            trainer.end_step(
                step,
                samples=64,
                response_tokens=6e4,
                prompt_tokens=6e3,
                valid_tokens=5e4,
                mean_context_tokens=1000.0,
            )
            engine.serve(0)
            decoded.append(engine.decoded - before)
            time.sleep(0.25)  # the pool's window closes after 0.1 s without requests
        pool.stop()
    finally:
        for c in clients.values():
            c.close()
        for s in servers:
            s.stop()
        engine.close()

    assert pool.last_error is None and pool.windows == 3
    reports = [agent.report() for agent in nodes.values()]
    a = {r.step: r for r in reports[0].steps}
    assert sorted(a) == [0, 1]  # the rollout node's newest step is still open
    for step, rec in a.items():
        assert [p.phase for p in rec.phases] == ["generation"]
        gen = rec.phases[0]
        # From the pool's first read with requests held to 0.1 s after the last (a loaded
        # machine delays the reads): the window covers most of the busy time, and its progress
        # is the engine's own count, never more than it decoded.
        assert 0.5 * BUSY_S <= gen.duration_seconds <= BUSY_S + 0.4
        assert 0.5 * decoded[step] <= gen.progress <= decoded[step] * 1.001
        # Read every 20 ms; the HTTP read and the signal take their share on a loaded machine.
        assert gen.progress_mean_gap_seconds is not None
        assert gen.progress_mean_gap_seconds <= 0.1

    # A sync fold would call the other pool's phase lost on each node; the async fold takes
    # each phase from its own pool and the workload from the trainer pool's end_step.
    sync = aggregate.job_step(0, reports).observation
    assert "no generation window from node-b" in (sync.phases["generation"].error or "")
    obs = aggregate.job_step(0, reports, pools=True).observation
    assert obs.phases["generation"].error is None and obs.phases["training"].error is None
    assert obs.workload.samples == 64 and obs.workload.valid_tokens == 5e4
    assert obs.phases["generation"].progress_gap_s <= 0.1

    spec = policy.parse_policy({"selector": {"matchLabels": {"a": "b"}}, "mode": "async"})
    loop = jobloop.JobLoop(spec, 1)
    assert loop.advance(reports) == [0, 1]
    totals = loop.totals()
    assert totals.steps == 2 and totals.compared_steps == 2
    want = sum(
        max(
            next(p.duration_seconds for p in r.phases if p.phase == phase)
            for r, phase in ((a[s], "generation"), (reports[1].steps[s], "training"))
        )
        for s in (0, 1)
    )
    assert totals.measured_seconds == pytest.approx(want)  # async: the slower pool per step
    # Two clean warm-up steps of both pools (no lost window, no fallback): trials start.
    assert {p.name: p.state for p in loop.phase_status()} == {
        "generation": "trial",
        "training": "trial",
    }
