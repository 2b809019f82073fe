"""Locked clocks as caps, through the real agent over the stand-in NVML.

Faults of the stand-in: a power cap that appears minutes after the lock was accepted
(``clock_cap_mhz`` set later), and a shortfall with no clock-event reason (``silent_cap``). The
agent re-reads each lock after the settle time and while it holds (``Agent.observe``, the
sampling loop); the node report carries requested / effective clock and the limiting reason per
GPU, the metrics the state, and the operator's node summary turns an unexplained shortfall into a
node error (Degraded).
"""

from __future__ import annotations

import pytest
from agent_support import DriverFactory, standin_agent
from prometheus_client.parser import text_string_to_metric_families
from rlenergy_agent import caps, metrics, service
from rlenergy_operator import builders

from rlenergy.api import node as api_node
from rlenergy.gpu import base

pytestmark = pytest.mark.field

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
LOCK_MHZ = 1395
PLAN = api_node.ClockPlan(
    step=0, phases=[api_node.PhasePlan(phase="generation", clockMHz=LOCK_MHZ, state="locked")]
)


def _tick(drv, agent: service.Agent, seconds: float) -> None:
    """The sampling loop for ``seconds`` of virtual time (1 s period)."""
    for _ in range(int(seconds)):
        drv.advance(1.0)
        agent.meter.sample()
        agent.observe()


def _gpu(agent: service.Agent, uuid: str) -> api_node.GpuStatus:
    return next(g for g in agent.report().gpus if g.uuid == uuid)


def _state_metric(agent: service.Agent, uuid: str) -> dict[str, str]:
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render(agent).decode())}
    (sample,) = [
        s for s in fams["rlenergy_agent_gpu_clock_state"].samples if s.labels["gpu_uuid"] == uuid
    ]
    return dict(sample.labels)


def test_a_cap_that_arrives_after_the_lock_shows_with_its_reason(make_driver: DriverFactory):
    drv = make_driver(2)
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s)
    u = drv.uuids[0]
    drv.set_work(drv.uuids, "generation")
    agent.phase(POD, "generation", 0)
    assert _gpu(agent, u).clock_state == "settling"  # judged only after the settle time
    _tick(drv, agent, 2)
    g = _gpu(agent, u)
    assert (g.requested_clock_mhz, g.effective_clock_mhz, g.clock_state) == (
        LOCK_MHZ,
        LOCK_MHZ,
        "asRequested",
    )
    drv.gpu(u).clock_cap_mhz = 1200  # a power cap, minutes after the apply
    _tick(drv, agent, int(caps.INTERVAL_S) + 1)
    g = _gpu(agent, u)
    assert g.effective_clock_mhz is not None and g.effective_clock_mhz <= 1200
    assert (g.clock_state, g.clock_limit, g.locked_clock_mhz) == ("capped", "SwPowerCap", LOCK_MHZ)
    assert _state_metric(agent, u)["state"] == "capped"
    assert _gpu(agent, drv.uuids[1]).clock_state == "asRequested"  # the other GPU is fine
    # a capped GPU is physics, not a fault: no node error
    nodes = builders.node_summary([agent.report()])
    assert not [e for e in nodes.errors if e.gpu == u]


def test_a_shortfall_with_no_reason_is_flagged_and_degrades(make_driver: DriverFactory):
    drv = make_driver(2)
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s, node="gpu-a")
    u = drv.uuids[1]
    drv.set_work(drv.uuids, "generation")
    agent.phase(POD, "generation", 0)
    _tick(drv, agent, 2)
    drv.gpu(u).clock_cap_mhz = 1005
    drv.gpu(u).silent_cap = 1
    assert not base.SLOWDOWN_REASONS & agent.actuator.gpus[u].clock_event_reasons()
    agent.report_due = False
    _tick(drv, agent, int(caps.INTERVAL_S) + 1)
    assert agent.report_due  # the shortfall goes out without waiting for the step's report
    g = _gpu(agent, u)
    assert (g.clock_state, g.clock_limit) == ("unexplained", "")
    assert g.effective_clock_mhz is not None and g.effective_clock_mhz <= 1005
    labels = _state_metric(agent, u)
    assert labels["state"] == "unexplained" and labels["limit"] == ""
    assert agent.actuator.caps.get(u).shortfalls >= 1
    nodes = builders.node_summary([agent.report()])
    (err,) = [e for e in nodes.errors if e.gpu == u]
    assert err.reason == "ClockShortfallUnexplained" and err.node == "gpu-a"
    assert f"locked {LOCK_MHZ} MHz" in err.message and "no clock-event reason" in err.message
    status, reason, message = builders.degraded_condition(nodes, True, True)
    assert (status, reason) == (True, "ClockShortfallUnexplained"), message
    # the cap goes away: the next re-read clears the flag
    drv.gpu(u).clock_cap_mhz = 0
    _tick(drv, agent, int(caps.INTERVAL_S) + 1)
    assert _gpu(agent, u).clock_state == "asRequested"
    assert not builders.node_summary([agent.report()]).errors


def test_release_ends_the_watch(make_driver: DriverFactory):
    drv = make_driver(1)
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s)
    (u,) = drv.uuids
    drv.set_work(drv.uuids, "generation")
    agent.phase(POD, "generation", 0)
    _tick(drv, agent, 2)
    agent.pod_gone(POD)
    g = _gpu(agent, u)
    assert (g.clock_state, g.effective_clock_mhz, g.locked_clock_mhz) == ("unlocked", None, None)
    assert agent.actuator.caps.due(drv.virtual_s + 100) == []


@pytest.mark.parametrize(
    ("effective", "reasons", "want"),
    [
        (1395, set(), ("asRequested", "")),
        (1380, set(), ("asRequested", "")),  # one clock-table step below: the lock
        (1365, set(), ("unexplained", "")),
        (1200, {base.ClockEventReason.SW_POWER_CAP}, ("capped", "SwPowerCap")),
        (
            1100,
            {base.ClockEventReason.HW_SLOWDOWN, base.ClockEventReason.SW_THERMAL_SLOWDOWN},
            ("capped", "HwSlowdown,SwThermalSlowdown"),
        ),
        (345, {base.ClockEventReason.GPU_IDLE}, ("idle", "")),
        (None, set(), ("settling", "")),
    ],
)
def test_classify(effective, reasons, want):
    assert caps.classify(1395, effective, frozenset(reasons)) == want
    assert caps.classify(None, effective, frozenset(reasons)) == ("unlocked", "")
