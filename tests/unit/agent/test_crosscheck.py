"""Energy cross-check through the real agent over the stand-in NVML.

The stand-in fault ``set_counter_gain``: a board whose energy counter runs 30 % fast while its
power sensor is true. The check (30 s of every 5 min) integrates instant power over the same
interval as the counter delta; a disagreement above 15 % is a mismatch carried with both numbers
in the node report and the metrics, and the operator turns it into a Warning Event message.
"""

from __future__ import annotations

import pytest
from agent_support import DriverFactory, standin_agent
from prometheus_client.parser import text_string_to_metric_families
from rlenergy_agent import crosscheck, metrics, service
from rlenergy_operator import findings

from rlenergy.api import node as api_node

pytestmark = pytest.mark.field

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
PLAN = api_node.ClockPlan(step=0, phases=[api_node.PhasePlan(phase="training", state="locked")])


def _run(drv, agent: service.Agent, seconds: int) -> list[str]:
    found: list[str] = []
    for _ in range(seconds):
        drv.advance(1.0)
        agent.meter.sample()
        agent.observe()
        found += [u for u, c in agent.crosscheck.gpus.items() if c.last and c.last.mismatch]
    return sorted(set(found))


def test_a_counter_that_disagrees_with_power_is_flagged_with_both_numbers(
    make_driver: DriverFactory,
):
    drv = make_driver(2)
    fast, fine = drv.uuids
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s, node="gpu-a")
    drv.set_work(drv.uuids, "training")
    agent.phase(POD, "training", 0)
    drv.set_counter_gain(fast, 1.3)
    agent.report_due = False
    assert _run(drv, agent, int(crosscheck.WINDOW_S) + 2) == [fast]
    assert agent.report_due
    gpus = {g.uuid: g for g in agent.report().gpus}
    bad, good = gpus[fast].energy_cross_check, gpus[fine].energy_cross_check
    assert bad is not None and good is not None
    assert bad.mismatch and bad.mismatches == 1
    assert bad.counter_joules / bad.power_joules == pytest.approx(1.3, rel=0.02)
    assert bad.window_seconds == pytest.approx(crosscheck.WINDOW_S, abs=1.0)
    assert not good.mismatch and good.counter_joules == pytest.approx(good.power_joules, rel=0.02)
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render(agent).decode())}
    ratio = {
        s.labels["gpu_uuid"]: s.value
        for s in fams["rlenergy_agent_energy_crosscheck_ratio"].samples
    }
    assert ratio[fast] == pytest.approx(1.3, rel=0.02) and ratio[fine] == pytest.approx(
        1.0, rel=0.02
    )
    # the operator's Event names the node, the GPU and both numbers
    (event,) = findings.cross_check_events(
        [agent.report()], {}
    )  # nothing seen yet: one new mismatch
    key, message = event
    assert key == ("gpu-a", fast, 1)
    assert f"counter {bad.counter_joules:.0f} J" in message
    assert f"integrated instant power {bad.power_joules:.0f} J" in message
    assert findings.cross_check_events([agent.report()], {("gpu-a", fast): 1}) == []


def test_low_duty_cycle_and_no_check_without_a_counter(make_driver: DriverFactory):
    drv = make_driver(1)
    (u,) = drv.uuids
    agent = standin_agent({POD: [u]}, PLAN, lambda: drv.virtual_s)
    drv.set_work(drv.uuids, "training")
    calls: list[int] = []
    gpu = agent.meter.gpus[u]
    real = gpu.instant_power_mw

    def counted() -> int:
        calls.append(1)
        return real()

    gpu.instant_power_mw = counted  # type: ignore[method-assign]
    _run(drv, agent, int(crosscheck.PERIOD_S) * 2)
    # 2 checks of 30 s (+ the first sample each) in 10 min of 1 s samples: ~10 % duty
    assert agent.crosscheck.gpus[u].checks == 2
    assert len(calls) <= 2 * (int(crosscheck.WINDOW_S) + 2)
    # a GPU metered by power integration is not cross-checked
    agent.meter.state[u].source = "power_integration"
    before = agent.crosscheck.gpus[u].checks
    _run(drv, agent, int(crosscheck.PERIOD_S))
    assert agent.crosscheck.gpus[u].checks == before


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="window_s"):
        crosscheck.CrossCheck(None, window_s=60, period_s=30, clock=lambda: 0.0)  # type: ignore[arg-type]
