"""The clock a window or slice ran, and the two fixed policies (``rlenergy.control.freq.base``).

A lock whose read-back sits more than ``CLOCK_TOLERANCE_MHZ`` (15 MHz, one clock-table step)
below it ran at the read-back (a power or thermal cap); closer, it ran at the lock.
"""

from __future__ import annotations

import pytest

from rlenergy.control.freq import base


def _window(requested: int | None, applied: int | None) -> base.PhaseObservation:
    return base.PhaseObservation("generation", 1.0, 10.0, requested, applied_clock_mhz=applied)


@pytest.mark.parametrize(
    ("requested", "applied", "want"),
    [
        (None, None, None),  # default governor
        (None, 1200, None),  # default governor, whatever it read
        (1500, None, 1500),  # locked, not read back: the lock
        (1500, 1500, 1500),
        (1500, 1485, 1500),  # one clock step below: the lock
        (1500, 1484, 1484),  # further: a cap, the clock it ran
        (1500, 1200, 1200),
        (1500, 1600, 1500),  # above the lock: the lock
    ],
)
def test_a_window_ran_its_lock_unless_held_below_it(requested, applied, want) -> None:
    assert base.ran_clock_mhz(_window(requested, applied)) == want
    s = base.ProbeSlice(requested, 0.1, 5.0, 1.0, effective_clock_mhz=applied)
    assert base.ran_slice_clock_mhz(s) == want


def test_the_default_governor_never_locks() -> None:
    plan = base.DefaultGovernor(("generation", "training")).decide(7)
    assert plan.step == 7
    assert set(plan.phases) == {"generation", "training"}
    for d in plan.phases.values():
        assert (d.clock_mhz, d.state, d.reason) == (None, base.PhaseState.OBSERVE, "default")
        assert (d.probe_clocks_mhz, d.probe_slice_s, d.step_probe) == ((), 0.0, False)


def test_fixed_clocks_lock_the_same_clocks_every_step() -> None:
    clocks = {"generation": 1410, "training": None}
    policy = base.FixedClocks(clocks)
    clocks["generation"] = 900  # the policy keeps its own copy
    for step in (0, 3):
        plan = policy.decide(step)
        assert plan.step == step
        assert {p: (d.clock_mhz, d.state, d.reason) for p, d in plan.phases.items()} == {
            "generation": (1410, base.PhaseState.LOCKED, "fixed"),
            "training": (None, base.PhaseState.LOCKED, "fixed"),
        }
