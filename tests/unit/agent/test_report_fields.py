"""Node report fields written for people (docs/crd-fields.md): the agent writes them truthfully.

Over the stand-in NVML, a node with a GPU whose energy nothing can read and a working
one: the report's ``energyKnown``, ``energySource`` and ``energyJoulesTotal`` per GPU, and a
closed window's ``gpuEnergyJoules`` (per GPU, unknown stays null), ``energyJoules`` (unknown:
null, never 0), ``energySource`` and ``requestedClockMHz``.
"""

from __future__ import annotations

import pytest
from agent_support import DriverFactory, standin_agent
from rlenergy_agent import service
from rlenergy_dev import standin

from rlenergy.api import node as api_node

pytestmark = pytest.mark.field

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
PLAN = api_node.ClockPlan(
    step=0, phases=[api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked")]
)


def test_energy_fields_per_gpu_and_window(make_driver: DriverFactory):
    drv = make_driver(2)
    blind, seen = drv.uuids
    g = drv.gpu(blind)
    g.fail_energy = g.fail_power = g.fail_instant = standin.NOT_SUPPORTED
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s)
    drv.set_work(drv.uuids, "generation")
    start = drv.truth_j(seen)
    agent.phase(POD, "generation", 0)
    for _ in range(5):
        drv.advance(1.0)
        agent.meter.sample()
    agent.phase(POD, "idle", 0)
    gpus = {x.uuid: x for x in agent.report().gpus}
    assert (gpus[blind].energy_known, gpus[blind].energy_source) == (False, "unavailable")
    assert (gpus[seen].energy_known, gpus[seen].energy_source) == (True, "counter")
    assert gpus[seen].energy_joules_total > 0 and gpus[blind].energy_joules_total == 0.0
    (win,) = [w for w in agent.step_record(0).phases if w.phase == "generation"]
    assert win.gpu_energy_joules[blind] is None
    assert win.gpu_energy_joules[seen] == pytest.approx(drv.truth_j(seen) - start, rel=0.01)
    assert win.energy_joules is None  # one GPU unknown: the window is unknown, never a part
    assert win.energy_source == "mixed" and win.requested_clock_mhz == 1395
