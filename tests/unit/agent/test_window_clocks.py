"""A window's and a slice's clock is one a GPU held, not one transient read (``caps``).

The agent reads each busy GPU's SM clock and clock-event reasons every sample. A cap holds a
clock for many reads; one low read between reads at the lock is a transient (the clock ramping
as the work begins, or the reasons and the clock read either side of the GPU going busy or
idle). In the full-stack e2e one such 345 MHz read in a 1.6 s training window at 1935 MHz made
the operator predict that window's default time 5x too short (status ratio 0.952 vs 0.972).
"""

from __future__ import annotations

import pytest
from agent_support import DriverFactory, probe_plan, standin_agent
from rlenergy_agent import caps, service

from rlenergy.api import node as api_node

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
LOCK_MHZ = 1395
CAP_MHZ = 1200
PLAN = api_node.ClockPlan(
    step=0, phases=[api_node.PhasePlan(phase="generation", clockMHz=LOCK_MHZ, state="locked")]
)
WORKLOAD = api_node.TokenWorkloadReport(
    samples=8, response_tokens=1000, prompt_tokens=100, valid_tokens=1000, mean_context_tokens=500
)


@pytest.mark.parametrize(
    ("reads", "want"),
    [
        ({"a": [1935, 345, 1935]}, 1935),  # one low read between two at the lock
        ({"a": [345, 1935, 1935]}, 1935),  # a low first read (work starting)
        ({"a": [1935, 1935, 345]}, 1935),  # a low last read (work ending)
        ({"a": [1935, 345, 345, 1935]}, 345),  # held for two reads: a cap
        ({"a": [1935, 1500, 1200, 1935]}, 1500),  # the lower clock held once only
        ({"a": [345]}, 345),  # read once: that read
        ({"a": [1935, 1935], "b": [1935, 1500, 1500]}, 1500),  # the lowest GPU's held clock
        ({"a": [1935, 1935], "b": []}, 1935),  # a GPU never read busy
        ({}, None),
    ],
)
def test_the_held_clock_is_the_lowest_of_two_consecutive_reads(
    reads: dict[str, list[int]], want: int | None
) -> None:
    assert caps.held_clock_mhz(reads) == want


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ({"a": [False, True, False]}, False),
        ({"a": [True, False, True]}, False),
        ({"a": [False, True, True]}, True),
        ({"a": [True]}, True),
        ({"a": [False]}, False),
        ({"a": [False, False], "b": [True, True]}, True),
        ({"a": []}, False),
        ({}, False),
    ],
)
def test_a_flag_counts_when_two_consecutive_reads_show_it(
    flags: dict[str, list[bool]], want: bool
) -> None:
    assert caps.held_flag(flags) is want


def _locked_window(make_driver: DriverFactory, capped_samples: range) -> api_node.PhaseWindowReport:
    """One generation window at ``LOCK_MHZ``, 20 samples; a cap at ``CAP_MHZ`` on GPU 0 over
    the samples in ``capped_samples``."""
    drv = make_driver(2)
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s)
    agent.phase(POD, "generation", 0)
    drv.set_work(drv.uuids, "generation")
    for i in range(20):
        drv.gpu(drv.uuids[0]).clock_cap_mhz = CAP_MHZ if i in capped_samples else 0
        drv.advance(0.05)
        agent.meter.sample()
        agent.observe()
    agent.progress_total(POD, 100.0)
    agent.end_step(POD, 0, WORKLOAD)
    (rec,) = agent.report().steps
    (win,) = rec.phases
    assert win.requested_clock_mhz == LOCK_MHZ
    return win


def test_one_capped_read_is_a_transient(make_driver: DriverFactory) -> None:
    win = _locked_window(make_driver, range(7, 8))
    assert win.applied_clock_mhz == LOCK_MHZ
    assert win.slowdown is False


def test_a_cap_over_two_reads_is_the_windows_clock(make_driver: DriverFactory) -> None:
    win = _locked_window(make_driver, range(7, 9))
    assert win.applied_clock_mhz == CAP_MHZ
    assert win.slowdown is True


def test_without_a_cap_the_window_reads_its_lock(make_driver: DriverFactory) -> None:
    win = _locked_window(make_driver, range(0))
    assert win.applied_clock_mhz == LOCK_MHZ
    assert win.slowdown is False


def _locked_slices(make_driver: DriverFactory, capped_s: tuple[float, float]) -> list[int | None]:
    """Two probe slices of 0.4 s, both at ``LOCK_MHZ`` (four power samples each, at 0.05,
    0.15, 0.25 and 0.35 s into a slice, each with a clock read), in 20 ms ticks; a cap at
    ``CAP_MHZ`` over the ticks ending in ``capped_s`` (s from the phase start). Returns each
    slice's effective clock."""
    drv = make_driver(1)
    plan = probe_plan([LOCK_MHZ], 0.4)
    agent = standin_agent({POD: list(drv.uuids)}, plan, lambda: drv.virtual_s)
    t0 = drv.virtual_s
    agent.phase(POD, "generation", 0)
    drv.set_work(drv.uuids, "generation")
    for i in range(1, 40):  # to 0.78 s: two slices
        end = round(drv.virtual_s - t0 + 0.02, 6)
        capped = capped_s[0] <= end <= capped_s[1]
        drv.gpu(drv.uuids[0]).clock_cap_mhz = CAP_MHZ if capped else 0
        drv.advance(0.02)
        agent.probe_tick()
        agent.progress_total(POD, 5.0 * i)
    agent.end_step(POD, 0, WORKLOAD)
    (rec,) = agent.report().steps
    (win,) = rec.phases
    assert [s.clock_mhz for s in win.slices] == [LOCK_MHZ, LOCK_MHZ]
    return [s.effective_clock_mhz for s in win.slices]


def test_one_capped_slice_read_is_a_transient(make_driver: DriverFactory) -> None:
    assert _locked_slices(make_driver, (0.16, 0.16)) == [LOCK_MHZ, LOCK_MHZ]


def test_a_cap_over_two_slice_reads_is_the_slices_clock(make_driver: DriverFactory) -> None:
    assert _locked_slices(make_driver, (0.16, 0.26)) == [CAP_MHZ, LOCK_MHZ]
