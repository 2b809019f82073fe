"""Probe slices credit the clock the GPU ran, over the stand-in NVML.

A power cap (stand-in ``clock_cap_mhz``) holds the GPUs below the probe's candidate lock: each
locked slice reads the SM clock back with its power samples, reports the lowest as
``effectiveClockMHz``, and the probe's blocks are credited to the clock the candidate slices
ran, not the lock. Without a cap (or within one clock step) the lock stays the label.
"""

from __future__ import annotations

import pytest
from agent_support import DriverFactory, probe_plan, standin_agent
from rlenergy_agent import service

from rlenergy.api import node as api_node
from rlenergy.control.freq import aggregate, base, probe
from tests import factories

pytestmark = pytest.mark.field

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
LOCK_MHZ = 1395
PLAN = probe_plan(probe.block_schedule([LOCK_MHZ]), 0.4)
WORKLOAD = api_node.TokenWorkloadReport(
    samples=8, response_tokens=1000, prompt_tokens=100, valid_tokens=1000, mean_context_tokens=500
)


def _probed_step(
    make_driver: DriverFactory, cap_mhz: int, idle_start_s: float = 0.0
) -> api_node.PhaseWindowReport:
    """One probed generation phase; its work starts ``idle_start_s`` after the phase signal."""
    drv = make_driver(2)
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s)
    for u in drv.uuids:
        drv.gpu(u).clock_cap_mhz = cap_mhz  # 0: no cap
    drv.set_work(drv.uuids, "idle" if idle_start_s else "generation")
    agent.phase(POD, "generation", 0)
    for _ in range(round(idle_start_s / 0.02)):
        drv.advance(0.02)
        agent.probe_tick()
    drv.set_work(drv.uuids, "generation")
    done = 0.0
    for _ in range(int(3 * 8 * 0.4 / 0.02)):  # three blocks in 20 ms steps
        drv.advance(0.02)
        agent.probe_tick()
        done += 5.0
        agent.progress_total(POD, done)
    agent.end_step(POD, 0, WORKLOAD)
    (rec,) = agent.report().steps
    (win,) = rec.phases
    return win


def test_a_capped_candidate_is_credited_at_the_clock_it_ran(make_driver: DriverFactory):
    win = _probed_step(make_driver, cap_mhz=1200)
    locked = [s for s in win.slices if s.clock_mhz == LOCK_MHZ]
    assert locked and all(s.effective_clock_mhz == 1200 for s in locked)
    assert all(s.effective_clock_mhz is None for s in win.slices if s.clock_mhz is None)
    slices = aggregate.job_step(0, [_report(win)]).observation.phases["generation"].slices
    blocks, _ = probe.blocks_from_slices(slices)
    assert len(blocks) >= 2
    assert {clock for clock, _, _ in blocks} == {1200}  # the clock it ran, not the lock


def test_an_uncapped_candidate_keeps_its_lock(make_driver: DriverFactory):
    win = _probed_step(make_driver, cap_mhz=0)
    locked = [s for s in win.slices if s.clock_mhz == LOCK_MHZ]
    assert locked and all(s.effective_clock_mhz == LOCK_MHZ for s in locked)
    assert {s.energy_source for s in win.slices} == {"instant_power"}  # one source per block
    slices = aggregate.job_step(0, [_report(win)]).observation.phases["generation"].slices
    assert {clock for clock, _, _ in probe.blocks_from_slices(slices)[0]} == {LOCK_MHZ}


@pytest.mark.parametrize("cap_mhz", [0, 1200])
def test_an_idle_gpu_is_no_cap(make_driver: DriverFactory, cap_mhz: int):
    # The work starts after the first slice's first power sample (50 ms in): the GPUs read
    # their idle clock then, with NVML's GPU_IDLE reason; the slice is credited at its lock
    # (or the cap it ran under once working), not the idle clock.
    win = _probed_step(make_driver, cap_mhz, idle_start_s=0.08)
    first = win.slices[0]
    assert first.clock_mhz == LOCK_MHZ
    assert first.effective_clock_mhz == (cap_mhz or LOCK_MHZ), first


def _report(win: api_node.PhaseWindowReport) -> api_node.NodeReport:
    return factories.node_report(
        steps=[api_node.StepRecord(step=0, workload=WORKLOAD, phases=[win])],
        gpus=[api_node.GpuStatus(uuid="GPU-1")],
    )


@pytest.mark.parametrize(
    ("effective", "credited"),
    [(None, 1395), (1395, 1395), (1380, 1395), (1365, 1365), (1200, 1200)],
)
def test_block_credit_rule(effective, credited):
    slices = [
        base.ProbeSlice(
            LOCK_MHZ if cand else None,
            1.0,
            9.0 if cand else 10.0,
            300.0 if cand else 400.0,
            effective_clock_mhz=effective if cand else None,
        )
        for cand in probe.THUE_MORSE
    ]
    ((clock, thr, power),), used = probe.blocks_from_slices(slices)
    assert (clock, used) == (credited, 8)
    assert thr == pytest.approx(0.9) and power == pytest.approx(0.75)
    assert base.ran_slice_clock_mhz(slices[0]) == credited
