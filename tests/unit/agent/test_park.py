"""Parking released rollout workers (FlexFloor ``releaseAction: park``) on the stand-in NVML.

SDK -> Unix socket (peer credentials) -> agent: a park locks the pod's named GPUs at their
lowest supported SM clock (read back), idempotently, until the pod's next working phase or a
later step, the step's end, ``unpark``, the pod's end or the policy's removal; the released
GPU time, counted from the GPU's power drop, lands in the metrics (a counter), the step record
and the node report; a GPU that keeps decoding after its park is credited nothing until its
power drops; a pod cannot park another pod's GPU. The dispatcher's publication (``/v1/rollout``) reaches the report.
"""

from __future__ import annotations

import re
from pathlib import Path

import pydantic
import pytest
from agent_support import DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import metrics, server, service
from rlenergy_dev import standin

from rlenergy.api import node as api_node
from rlenergy.sdk import trainer

POD_A = service.PodRef("team-a", "rollout-0", "11111111-2222-3333-4444-555555555555")
POD_B = service.PodRef("team-b", "rollout-1", "66666666-7777-8888-9999-000000000000")
GEN_MHZ = 1395
PLAN = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=GEN_MHZ, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=None, state="locked"),
    ],
)


def _agent(
    drv: standin.StandinDriver,
    pods: dict[service.PodRef, list[str]],
    plan: api_node.ClockPlan | None = PLAN,
) -> service.Agent:
    return standin_agent(pods, plan, lambda: drv.virtual_s)


def _metric(text: str, name: str, uuid: str) -> float | None:
    m = re.search(rf'^{name}{{gpu_uuid="{re.escape(uuid)}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def _lowest(agent: service.Agent, uuid: str) -> int:
    return min(agent.actuator.controls[uuid].supported_mhz)


def test_park_locks_the_lowest_clock_until_the_next_step(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    drv = make_driver(4)
    gpus = list(drv.uuids)
    worker, others = gpus[2:], gpus[:2]  # one rollout worker = 2 GPUs of the pod
    agent = _agent(drv, {POD_A: gpus})
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        client = reviews.client(sock, POD_A, short_tmp, strict=True)
        client.phase("generation", step=0)
        drv.set_work(gpus, "generation", "gen-0")
        drv.advance(4.0)
        answer = client.park(0, gpus=worker)
        drv.set_work(worker, "idle")  # the released rank's engine stops decoding on them
        drv.advance(0.0)
        agent.observe_parks()  # the sampling loop sees the power drop: released from now
        lowest = _lowest(agent, worker[0])
        assert lowest < GEN_MHZ
        assert set(answer["parked"]) == set(worker)
        assert all(v["clockMHz"] == lowest for v in answer["parked"].values())
        for u in worker:
            assert drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == lowest
            # read back through NVML by the actuator
            assert answer["applied"][u]["effectiveMHz"] == agent.actuator.controls[u].effective_mhz
            assert agent.actuator.controls[u].effective_mhz == int(drv.clock_mhz(u))
        assert all(drv.gpu(u).lock_max_mhz == GEN_MHZ for u in others)

        # idempotent: a second park writes nothing
        writes = {u: agent.actuator.controls[u].writes for u in worker}
        again = client.park(0, gpus=worker)
        assert again["parked"] == {} and set(again["already"]) == set(worker)
        assert {u: agent.actuator.controls[u].writes for u in worker} == writes

        drv.advance(6.0)
        client.phase("idle", step=0)  # same step, idle: stays parked
        assert all(drv.gpu(u).lock_max_mhz == lowest for u in worker)
        text = metrics.render(agent).decode()
        for u in worker:
            assert _metric(text, "rlenergy_agent_gpu_parked", u) == 1.0
            assert _metric(text, "rlenergy_agent_gpu_parked_clock_hertz", u) == lowest * 1e6
            assert _metric(text, "rlenergy_agent_released_gpu_seconds_total", u) == pytest.approx(
                6.0, abs=0.05
            )
        assert _metric(text, "rlenergy_agent_gpu_parked", others[0]) == 0.0
        assert _metric(text, "rlenergy_agent_gpu_parked_clock_hertz", others[0]) is None
        assert {g.uuid for g in agent.report().gpus if g.parked} == set(worker)

        drv.advance(2.0)
        client.phase("generation", step=1)  # the next step un-parks: the plan's clock again
        assert all(drv.gpu(u).lock_max_mhz == GEN_MHZ for u in gpus)
        assert not agent.parked
        text = metrics.render(agent).decode()
        for u in worker:
            assert _metric(text, "rlenergy_agent_gpu_parked", u) == 0.0
            assert _metric(text, "rlenergy_agent_released_gpu_seconds_total", u) == pytest.approx(
                8.0, abs=0.05
            )
        drv.advance(1.0)
        client.end_step(0, samples=8, response_tokens=800, prompt_tokens=400, valid_tokens=800)
        rep = agent.report()
        rec = next(r for r in rep.steps if r.step == 0)
        assert rec.released_gpu_seconds == pytest.approx(16.0, abs=0.1)  # 2 GPUs x 8 s
        gen = next(p for p in rec.phases if p.phase == "generation")
        # generation window: 4 GPUs x 10 s, of which 2 GPUs x 6 s parked
        assert gen.gpu_seconds == pytest.approx(40.0, abs=0.1)
        assert gen.released_gpu_seconds == pytest.approx(12.0, abs=0.1)
        assert rep.released_gpu_seconds_total == pytest.approx(16.0, abs=0.1)
        client.close()
    finally:
        srv.stop()


def test_a_pod_cannot_park_another_pods_gpu(make_driver: DriverFactory, short_tmp: Path) -> None:
    drv = make_driver(2)
    agent = _agent(drv, {POD_A: [drv.uuids[0]], POD_B: [drv.uuids[1]]})
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        client = reviews.client(sock, POD_A, short_tmp, strict=True)
        with pytest.raises(trainer.AgentRefusedError) as info:
            client.park(0, gpus=[drv.uuids[1]])
        assert info.value.status == 403
        assert not drv.gpu(drv.uuids[1]).locked and not agent.parked
        with pytest.raises(pydantic.ValidationError, match="greater than or equal to 0"):
            client.park(-1)  # the SDK builds the typed request: refused before sending
        client.close()
    finally:
        srv.stop()


def test_step_end_unpark_pod_end_and_policy_removal_leave_nothing_locked(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(3)
    a, b = [drv.uuids[0], drv.uuids[1]], [drv.uuids[2]]
    agent = _agent(drv, {POD_A: a, POD_B: b})
    # the step's end un-parks to the default governor
    agent.phase(POD_A, "generation", 0)
    agent.park(POD_A, 0)
    drv.advance(3.0)
    agent.end_step(POD_A, 0, api_node.TokenWorkloadReport.model_validate(_workload()))
    assert not any(drv.gpu(u).locked for u in a) and not agent.parked
    assert agent.report().steps[0].released_gpu_seconds == pytest.approx(6.0, abs=0.05)
    # unpark inside a phase returns to the plan's clock of that phase
    agent.phase(POD_A, "generation", 1)
    agent.park(POD_A, 1, gpu_uuids=[a[1]])
    drv.advance(1.0)
    assert agent.unpark(POD_A) == pytest.approx(1.0, abs=0.01)
    assert drv.gpu(a[1]).lock_max_mhz == GEN_MHZ
    # the pod's end and the policy's removal reset a parked GPU
    agent.park(POD_A, 1)
    agent.phase(POD_B, "generation", 1)
    agent.park(POD_B, 1)
    agent.pod_gone(POD_A)
    assert not any(drv.gpu(u).locked for u in a)
    assert drv.gpu(b[0]).locked and set(agent.parked) == set(b)
    agent.set_plan(None)
    assert not drv.gpu(b[0]).locked and not agent.parked
    assert all(g.reset_acknowledged and not g.parked for g in agent.report().gpus)


def test_observe_plan_accounts_released_time_without_writing_clocks(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    observe = PLAN.model_copy(update={"enforce": False})
    agent = _agent(drv, {POD_A: list(drv.uuids)}, plan=observe)
    agent.phase(POD_A, "generation", 0)
    res = agent.park(POD_A, 0)
    assert res.parked == {drv.uuids[0]: None} and not drv.gpu(drv.uuids[0]).locked
    drv.advance(2.0)
    assert agent.released_gpu_seconds(drv.uuids[0]) == pytest.approx(2.0, abs=0.01)


def test_dispatcher_publication_reaches_the_report(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    drv = make_driver(1)
    agent = _agent(drv, {POD_A: list(drv.uuids)})
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        client = reviews.client(sock, POD_A, short_tmp, strict=True)
        client.publish_rollout(3, active_workers=4, released_workers=2, next_step_workers=2)
        assert agent.report_due
        rollout = agent.report().rollout
        assert rollout is not None
        assert (rollout.step, rollout.active_workers, rollout.next_step_workers) == (3, 4, 2)
        with pytest.raises(trainer.AgentRefusedError) as info:
            client.publish_rollout(2, active_workers=4)
        assert info.value.status == 409
        with pytest.raises(ValueError, match="greater than or equal to 1"):
            client.publish_rollout(4, active_workers=4, next_step_workers=0)
        # the agent checks it too (a client that skips the SDK's model)
        with pytest.raises(trainer.AgentRefusedError) as info:
            client._post("/v1/rollout", {"step": 4, "activeWorkers": 4, "nextStepWorkers": 0})
        assert info.value.status == 400
        client.close()
    finally:
        srv.stop()


def _workload() -> dict[str, float]:
    return {
        "samples": 8,
        "responseTokens": 800,
        "promptTokens": 400,
        "validTokens": 800,
        "meanContextTokens": 0,
    }


def test_a_park_credits_released_time_only_after_the_power_drops(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    gpus = list(drv.uuids)
    agent = _agent(drv, {POD_A: gpus})
    agent.phase(POD_A, "generation", 0)
    drv.set_work(gpus, "generation", "gen-0")
    drv.advance(1.0)
    agent.park(POD_A, 0)  # parked, but the engine still decodes on both GPUs (lowest clock)
    drv.advance(5.0)
    agent.observe_parks()
    assert all(agent.released_gpu_seconds(u) == 0.0 for u in gpus)  # full power: nothing
    drv.set_work(gpus[:1], "idle")  # the engine let go of the first GPU only
    drv.advance(1.0)
    agent.observe_parks()
    drv.advance(4.0)
    assert agent.released_gpu_seconds(gpus[0]) == pytest.approx(4.0, abs=0.05)
    assert agent.released_gpu_seconds(gpus[1]) == 0.0
    agent.end_step(POD_A, 0, api_node.TokenWorkloadReport.model_validate(_workload()))
    assert agent.report().steps[0].released_gpu_seconds == pytest.approx(4.0, abs=0.05)
