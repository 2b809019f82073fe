"""EE-RL keeps a phase's threshold over the whole run, trials included (the run ledger).

Trial slices at the lever-arm clock run the phase at about ``PROBE_MIN_RATIO`` of the default
governor's throughput; a lock that only meets ``threshold + LOCK_MARGIN`` cannot pay that back
(TinyZero's training phase ended a 200-step run at 0.9495 of default, docs/simulator.md). The
controller books every window's default-equivalent time (``PhaseController.ledger_default_s``)
beside its wall time, and a lock meets ``lock_target``: the ratio that brings the whole run back
to the threshold over ``REPAY_HORIZON`` times the phase time so far.

The controller alone (no simulator): probe windows carry slices whose candidate side runs at
``truth(clock)`` of the default rate (``NOISE`` per slice); locked windows last ``T / truth(clock)``.
The truth of the run (default time / wall time, from ``truth`` without noise) is summed here.
"""

from __future__ import annotations

import random

import pytest

from rlenergy.api import workload as api_workload
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import base, config, eerl
from rlenergy.gpu import models

SKU = models.get_sku("h100-sxm")
F_MAX = SKU.max_sm_clock_mhz
WL = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)
NOISE = 0.1
"""Per-slice progress noise: a short phase's slices hold few micro-batches (blocks about 7 %;
TinyZero's in the simulator about 9 %, docs/simulator.md)."""
PHASE_S = 0.6
"""A short phase (TinyZero's on an H100): 24 slices of 25 ms, three probe blocks a step."""


def _truth(clock: float) -> float:
    """The model's own shape, ``u = 0.9``: a compute-bound training phase."""
    return 1.0 / (0.9 * (F_MAX / clock - 1.0) + 1.0)


def _power(clock: float) -> float:
    return 0.5 + 0.5 * (clock / F_MAX) ** 2


def _run(steps: int, seed: int) -> tuple[eerl.PhaseController, float]:
    """Run one phase controller; return it and the run's true throughput ratio."""
    settings = config.phase_settings(api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz())
    pc = eerl.PhaseController(settings[1], eerl.ControllerSettings())
    rng = random.Random(seed)
    default_s = wall_s = 0.0
    for _ in range(steps):
        d = pc.decide(allow_probe=True)
        if d.probe_clocks_mhz:
            slice_s = PHASE_S / len(d.probe_clocks_mhz)
            slices = []
            for c in d.probe_clocks_mhz:
                rate = _truth(c) if c is not None else 1.0
                slices.append(
                    base.ProbeSlice(
                        c,
                        slice_s,
                        100.0 * rate * rng.gauss(1.0, NOISE) * slice_s,
                        300.0 * (_power(c) if c is not None else 1.0) * slice_s,
                    )
                )
                default_s += rate * slice_s
            obs = base.PhaseObservation(
                "training", PHASE_S, 300.0 * PHASE_S, d.clock_mhz, slices=tuple(slices)
            )
            wall_s += PHASE_S
        else:
            c = d.clock_mhz
            ratio = _truth(c) if c is not None else 1.0
            t = PHASE_S / ratio
            obs = base.PhaseObservation(
                "training", t, 300.0 * (_power(c) if c else 1.0) * t, c, c or F_MAX
            )
            default_s += PHASE_S
            wall_s += t
        pc.observe(obs, WL)
    return pc, default_s / wall_s


def test_the_repay_ratio_brings_the_whole_run_back_to_the_threshold() -> None:
    settings = config.phase_settings(api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz())
    pc = eerl.PhaseController(settings[1], eerl.ControllerSettings())
    theta = pc.threshold
    pc.ledger_default_s, pc.ledger_actual_s, pc.ledger_windows = 94.0, 100.0, 100
    r = pc.repay_ratio
    h = eerl.REPAY_HORIZON * 94.0
    assert r < 1.0
    assert (94.0 + h) / (100.0 + h / r) == pytest.approx(theta)
    assert pc.lock_target == pytest.approx(r + eerl.LOCK_MARGIN)
    # Few windows: the horizon is at least REPAY_MIN_WINDOWS mean windows, so less to repay
    # per second.
    pc.ledger_windows = 10
    assert theta < pc.repay_ratio < r
    # A run at the default governor has no deficit: the threshold alone sets the target.
    pc.ledger_default_s = pc.ledger_actual_s = 100.0
    assert pc.repay_ratio < theta
    assert pc.lock_target == pytest.approx(theta + eerl.LOCK_MARGIN)
    # A deficit no clock can repay inside the horizon asks for the default governor.
    pc.ledger_default_s, pc.ledger_windows = 40.0, 100
    assert pc.repay_ratio == 1.0


def test_a_pool_the_async_slack_relaxed_repays_nothing() -> None:
    settings = config.phase_settings(api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz())
    pc = eerl.PhaseController(settings[1], eerl.ControllerSettings())
    pc.ledger_default_s, pc.ledger_actual_s, pc.ledger_windows = 94.0, 100.0, 100
    pc.threshold = pc.settings.min_throughput_ratio - 0.05
    assert pc.repay_ratio == 0.0
    assert pc.lock_target == pytest.approx(pc.threshold + eerl.LOCK_MARGIN)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_short_phase_keeps_its_threshold_over_the_run_trials_included(seed: int) -> None:
    pc, ratio = _run(200, seed)
    assert pc.state is base.PhaseState.LOCKED
    assert pc.locked_clock_mhz is not None
    assert ratio >= pc.settings.min_throughput_ratio, ratio
    # The ledger the controller kept is the truth's, within the blocks' noise.
    assert pc.ledger_default_s / pc.ledger_actual_s == pytest.approx(ratio, abs=0.005)


def test_without_repayment_the_trials_cost_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same runs with the repayment off end below the threshold."""
    monkeypatch.setattr(eerl, "REPAY_HORIZON", 1e9)
    ratios = [_run(200, seed)[1] for seed in (0, 1, 2)]
    assert min(ratios) < 0.95, ratios
