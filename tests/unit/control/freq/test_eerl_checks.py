"""EE-RL's own checks on a locked clock fire when their condition is forced.

We test these aspects, each by feeding a locked ``PhaseController`` the observations that
should trip the check, and a control run that must not:

* lock shortfall: a clock-event reason (power or thermal) holding the clock below the lock on
  two consecutive steps starts a re-trial; one step alone does not;
* monitor miss: monitor blocks at the locked clock whose upper confidence bound misses the
  threshold raise the floor to that clock and step the lock up at once; blocks that meet it
  keep the lock.
"""

from __future__ import annotations

from rlenergy.api import workload as api_workload
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import base, config, eerl, probe
from rlenergy.gpu import models

SKU = models.get_sku("h100-sxm")
WL = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)
LEVER_MHZ = 1200
U = 0.1
"""Clock-bound share of the phase behind the trial blocks (generation-like)."""


def _ratio(clock: int, u: float = U) -> float:
    return 1.0 / (u * (SKU.max_sm_clock_mhz / clock - 1.0) + 1.0)


def _block_slices(clock: int, ratio: float, power_ratio: float) -> list[base.ProbeSlice]:
    """One Thue-Morse block at ``clock`` whose candidate side runs at ``ratio`` of default."""
    out = []
    for c in probe.block_schedule([clock]):
        rate, power = (ratio, power_ratio) if c is not None else (1.0, 1.0)
        out.append(base.ProbeSlice(c, 0.025, 100.0 * rate * 0.025, 300.0 * power * 0.025))
    return out


def _locked() -> eerl.PhaseController:
    """Generation locked at the fit's choice after trial blocks consistent with ``U``."""
    settings = config.phase_settings(
        api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz()
    )[0]
    pc = eerl.PhaseController(settings, eerl.ControllerSettings())
    for _ in range(2):  # warm-up at the default governor
        pc.observe(base.PhaseObservation("generation", 1.2, 360.0, None, 1980), WL)
    assert pc.state is base.PhaseState.TRIAL
    for _ in range(6):
        pc.blocks.append((LEVER_MHZ, _ratio(LEVER_MHZ), 0.6))
    pc.fit = probe.fit_corrected(pc.blocks, SKU.max_sm_clock_mhz, pc.f_default_mhz)
    choice, _ = pc._choose()
    assert choice is not None and LEVER_MHZ < choice < SKU.max_sm_clock_mhz
    pc._lock(choice, eerl._drift_feature("generation", WL), slowdown=False)
    return pc


def _locked_step(pc: eerl.PhaseController, *, slowdown: bool = False) -> None:
    clock = pc.locked_clock_mhz
    pc.observe(base.PhaseObservation("generation", 1.25, 300.0, clock, 1400, slowdown=slowdown), WL)


def _monitor_step(pc: eerl.PhaseController, clock: int, ratio: float) -> None:
    slices = tuple(_block_slices(clock, ratio, 0.8))
    pc.observe(base.PhaseObservation("generation", 1.25, 300.0, clock, slices=slices), WL)


def test_a_clock_held_below_its_lock_on_two_steps_starts_a_retrial() -> None:
    pc = _locked()
    _locked_step(pc, slowdown=True)
    assert pc.state is base.PhaseState.LOCKED  # one step may be a transient
    _locked_step(pc)
    _locked_step(pc, slowdown=True)
    assert pc.state is base.PhaseState.LOCKED  # not consecutive: the count restarted
    _locked_step(pc, slowdown=True)
    assert pc.state is base.PhaseState.TRIAL
    assert pc.retrial_reasons[-1].startswith("clock-event reasons"), pc.retrial_reasons


def test_no_slowdown_keeps_the_lock() -> None:
    pc = _locked()
    lock = pc.locked_clock_mhz
    for _ in range(5):
        _locked_step(pc)
    assert pc.state is base.PhaseState.LOCKED and pc.locked_clock_mhz == lock


def test_monitor_blocks_that_miss_the_threshold_step_the_lock_up() -> None:
    pc = _locked()
    lock = pc.locked_clock_mhz
    assert lock is not None and _ratio(lock) > 0.95 + eerl.LOCK_MARGIN  # sound on trial data
    for _ in range(pc.ctl.min_blocks):
        _monitor_step(pc, lock, 0.90)  # but the lock's own blocks say 0.90 < 0.95
    assert pc.floor_mhz == lock
    assert pc.locked_clock_mhz is not None and pc.locked_clock_mhz > lock, pc.retrial_reasons
    assert pc.state is base.PhaseState.LOCKED
    assert "stepped up" in pc.retrial_reasons[-1], pc.retrial_reasons


def test_monitor_blocks_that_meet_the_threshold_keep_the_lock() -> None:
    pc = _locked()
    lock = pc.locked_clock_mhz
    assert lock is not None
    for _ in range(pc.ctl.min_blocks + 2):
        _monitor_step(pc, lock, _ratio(lock))
    assert pc.floor_mhz == 0
    assert pc.locked_clock_mhz == lock and pc.state is base.PhaseState.LOCKED
