"""GPU lifecycle through the real agent over the stand-in NVML: resets, lost GPUs, drivers.

We test: a GPU reset under a lock (the stand-in clears the locked clocks, as NVML documents)
is found by the read-back of every pass and the lock is made again, the window on that GPU
carries an error (kept out of savings) and the node report says ``GpusSettled`` False until a
pass finds the lock holding; a GPU below its lock with no reason gets the lock again once, not
every pass; a lost GPU (NVML_ERROR_GPU_IS_LOST) makes the agent initialise NVML again, keeps
the other GPUs governed, and once it returns it is metered and governed again (a signal
locks it); an invalid handle is a lost GPU until NVML is initialised again; a changed driver
version re-initialises NVML and re-applies every lock; the metrics count the events.
"""

from __future__ import annotations

from pathlib import Path

from agent_support import LOCKED_PLAN as PLAN
from agent_support import POD_A, POD_B, DriverFactory, standin_agent
from rlenergy_agent import actuator, metrics, service
from rlenergy_agent.nvml import backend, lib
from rlenergy_dev import standin


def _agent(drv: standin.StandinDriver, pods: dict[service.PodRef, list[str]]) -> service.Agent:
    agent = standin_agent(pods, PLAN, lambda: drv.virtual_s)
    gpus = {u: g for u, g in agent.actuator.gpus.items() if isinstance(g, backend.NvmlGpu)}
    agent.actuator.library = backend.NvmlSession(gpus, lib.driver_version())
    return agent


def _pass(drv: standin.StandinDriver, agent: service.Agent, dt_s: float = 1.0) -> None:
    """One pass of the node loop's sampling (``nodeloop.NodeLoop.tick``)."""
    drv.advance(dt_s)
    agent.meter.sample()
    agent.observe()


def _settled(agent: service.Agent) -> tuple[str, str, str]:
    (cond,) = [c for c in agent.report().conditions if c.type == "GpusSettled"]
    return cond.status, cond.reason, cond.message


def test_a_gpu_reset_under_a_lock_is_found_and_the_lock_made_again(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    u, other = drv.uuids
    agent = _agent(drv, {POD_A: [u], POD_B: [other]})
    drv.set_work(drv.uuids, "generation")
    agent.phase(POD_A, "generation", 0)
    agent.phase(POD_B, "generation", 0)
    _pass(drv, agent)
    assert drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1395
    assert _settled(agent)[:2] == ("True", "Settled")
    drv.reset_gpu(u)  # the locked clocks are gone; the GPU boosts under load
    assert not drv.gpu(u).locked and drv.clock_mhz(u) > 1395
    _pass(drv, agent)
    assert drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1395  # made again
    assert drv.gpu(other).locked
    status, reason, message = _settled(agent)
    assert (status, reason) == ("False", "LockLost") and u in message and other not in message
    assert agent.report_due
    _pass(drv, agent)
    assert _settled(agent)[:2] == ("True", "Settled")
    text = metrics.render(agent).decode()
    assert (
        f'rlenergy_agent_gpu_lifecycle_events_total{{gpu_uuid="{u}",node="node-1",'
        'reason="LockLost"} 1.0' in text
    )
    # the window that ran through the reset is no evidence: it carries the error
    closed = agent.phase(POD_A, "idle", 0).closed
    assert closed is not None and closed.error is not None and "LockLost" in closed.error
    closed_b = agent.phase(POD_B, "idle", 0).closed
    assert closed_b is not None and closed_b.error is None


def test_a_gpu_below_its_lock_with_no_reason_gets_the_lock_again_once(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    (u,) = drv.uuids
    agent = _agent(drv, {POD_A: [u]})
    drv.set_work([u], "generation")
    agent.phase(POD_A, "generation", 0)
    _pass(drv, agent)
    writes = int(drv.gpu(u).clock_writes)
    drv.gpu(u).clock_cap_mhz = 1200
    drv.gpu(u).silent_cap = 1  # below the lock, no clock-event reason
    for _ in range(5):
        _pass(drv, agent)
    assert int(drv.gpu(u).clock_writes) == writes + 1  # once, not every pass
    assert agent.actuator.life_events == {(u, "LockLost"): 1}


def test_a_lost_gpu_that_returns_is_governed_again(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    u, other = drv.uuids
    agent = _agent(drv, {POD_A: [u], POD_B: [other]})
    session = agent.actuator.library
    assert isinstance(session, backend.NvmlSession)
    drv.set_work(drv.uuids, "generation")
    agent.phase(POD_A, "training", 0)
    agent.phase(POD_B, "generation", 0)
    _pass(drv, agent)
    inits = int(drv.state.init_count)
    drv.lose(u)
    _pass(drv, agent)
    assert agent.actuator.controls[u].condition == "lost"
    assert int(drv.state.init_count) == inits + 1  # NVML initialised again at once
    assert _settled(agent)[:2] == ("False", "GpuLost")
    assert drv.gpu(other).locked and agent.actuator.controls[other].condition == "ok"
    gpus = {g.uuid: g for g in agent.report().gpus}
    assert gpus[u].condition == "lost"
    # it comes back through a reset (its lock cleared): the next try finds it
    drv.recover(u)
    assert not drv.gpu(u).locked
    for _ in range(round(actuator.REINIT_RETRY_S)):
        _pass(drv, agent)
    assert int(drv.state.init_count) == inits + 2
    assert agent.actuator.controls[u].condition == "ok"
    assert drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1755  # the plan's clock again
    assert _settled(agent)[:2] == ("True", "Settled")
    gpus = {g.uuid: g for g in agent.report().gpus}
    assert gpus[u].condition == "ok" and gpus[u].locked_clock_mhz == 1755
    # metered again, and governed: a signal locks it
    before = agent.meter.total_j(u)
    _pass(drv, agent, 2.0)
    assert before is not None and (agent.meter.total_j(u) or 0.0) > before
    res = agent.phase(POD_A, "generation", 1)
    assert res.applied[u].skipped is None and drv.gpu(u).lock_max_mhz == 1395
    text = metrics.render(agent).decode()
    assert 'rlenergy_agent_nvml_reinits_total{node="node-1"} 2.0' in text
    assert f'rlenergy_agent_gpu_settled{{gpu_uuid="{u}",node="node-1"}} 1.0' in text


def test_an_invalid_handle_is_a_lost_gpu_until_nvml_is_initialised_again(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    (u,) = drv.uuids
    agent = _agent(drv, {POD_A: [u]})
    drv.set_work([u], "generation")
    agent.phase(POD_A, "generation", 0)
    _pass(drv, agent)
    gpu = agent.actuator.gpus[u]
    assert isinstance(gpu, backend.NvmlGpu)
    gpu.rebind(lib.Handle(None))  # a handle NVML no longer knows (a NULL device)
    inits = int(drv.state.init_count)
    _pass(drv, agent)
    assert int(drv.state.init_count) == inits + 1
    assert agent.actuator.controls[u].condition == "ok"  # re-bound by UUID
    assert gpu.sm_clock_mhz() == 1395
    assert agent.actuator.life_events.get((u, "GpuLost")) == 1


def test_a_changed_driver_version_reinitialises_nvml_and_reapplies_every_lock(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    agent = _agent(drv, {POD_A: list(drv.uuids)})
    drv.set_work(drv.uuids, "generation")
    agent.phase(POD_A, "generation", 0)
    _pass(drv, agent)
    writes = {u: int(drv.gpu(u).clock_writes) for u in drv.uuids}
    inits = int(drv.state.init_count)
    drv.set_driver_version("560.28.03")
    for _ in range(round(actuator.DRIVER_CHECK_S)):
        _pass(drv, agent)
    assert int(drv.state.init_count) == inits + 1
    assert agent.actuator.library is not None
    assert agent.actuator.library.version == "560.28.03"
    assert all(int(drv.gpu(u).clock_writes) == writes[u] + 1 for u in drv.uuids)
    assert all(drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1395 for u in drv.uuids)
    assert {r for _, r in agent.actuator.life_events} == {"DriverChanged"}
    _pass(drv, agent)
    assert _settled(agent)[:2] == ("True", "Settled")


def test_a_signal_for_the_same_clock_after_a_reset_makes_the_lock_again(
    make_driver: DriverFactory,
) -> None:
    """The reset comes between two signals of the same clock: the second one's read-back finds
    the GPU above its lock and writes it again at once, before any pass of the loop."""
    drv = make_driver(1)
    (u,) = drv.uuids
    agent = _agent(drv, {POD_A: [u]})
    drv.set_work([u], "generation")
    agent.phase(POD_A, "generation", 0)
    drv.advance(1.0)
    drv.reset_gpu(u)
    res = agent.phase(POD_A, "generation", 1)
    assert res.applied[u].wrote and drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1395
    assert res.closed is not None and "LockLost" in (res.closed.error or "")
    _pass(drv, agent)
    assert agent.actuator.life_events == {(u, "LockLost"): 1}
    assert _settled(agent)[:2] == ("False", "LockLost")


def test_the_agent_build_hands_the_actuator_its_nvml_session(
    make_driver: DriverFactory, tmp_path: Path
) -> None:
    from rlenergy_agent import __main__ as main
    from rlenergy_agent import config

    drv = make_driver(1)
    settings = config.AgentSettings(
        node_name="node-1",
        backend="nvml",
        kube=False,
        state_dir=tmp_path,
        static_pods='{"team-a/trainer-0": []}',
    )
    agent, _ = main.build(settings)
    session = agent.actuator.library
    assert isinstance(session, backend.NvmlSession)
    assert session.version == drv.state.driver_version.decode()
    assert set(session.gpus) == set(drv.uuids)
