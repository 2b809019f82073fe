"""EE-RL on curves its phase model cannot represent: a step, a plateau and a smooth curve.

The controller alone (no simulator): a ``PhaseController`` is fed probe slices whose candidate
side runs at ``truth(clock)`` of the default governor's rate (2 % block noise), and whole-phase
windows at its locks. On a step (x1.8 time below a kernel threshold) and on a plateau that
falls off below a knee, the one-parameter fit of ``probe.PhaseModelFit`` is biased at the clock
that matters; the corrected fit (``probe.CorrectedFit``) flags the misfit and the bracketing
search (``PhaseController.bracket``) decides clock by clock. We check that the lock keeps the
threshold by the truth and lies within a few clock steps of the lowest clock that does; and,
as a control, that a curve of the model's own shape is not flagged.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from rlenergy.api import workload as api_workload
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import base, config, eerl, probe
from rlenergy.gpu import models

SKU = models.get_sku("h100-sxm")
F_MAX = SKU.max_sm_clock_mhz
WL = api_workload.TokenWorkload(10, 1000.0, 100.0, 1000.0, 150.0)
THRESHOLD = 0.95


def _step(clock: float) -> float:
    """Clock-insensitive decode above 1095 MHz, x1.8 slower below (a kernel threshold)."""
    return 1.0 if clock >= 1095 else 1.0 / 1.8


def _plateau(clock: float) -> float:
    """Flat down to a knee at 1500 MHz, then falling with the clock (compute takes over)."""
    return 1.0 if clock >= 1500 else 1.0 / (1.0 + 0.9 * (1500 / clock - 1.0))


def _model_shape(clock: float) -> float:
    """The model's own shape, ``u = 0.12``."""
    return 1.0 / (0.12 * (F_MAX / clock - 1.0) + 1.0)


def _power(clock: float) -> float:
    """Power ratio vs default: falls with the clock, so energy per token does too."""
    return 0.5 + 0.5 * (clock / F_MAX) ** 2


def _slices(
    schedule: tuple[int | None, ...], truth: Callable[[float], float], rng: random.Random
) -> tuple[base.ProbeSlice, ...]:
    out = []
    for c in schedule:
        rate = (truth(c) if c is not None else 1.0) * rng.gauss(1.0, 0.02)
        power = _power(c) if c is not None else 1.0
        out.append(base.ProbeSlice(c, 0.05, 100.0 * rate * 0.05, 300.0 * power * 0.05))
    return tuple(out)


def _run(truth: Callable[[float], float], steps: int = 160) -> eerl.PhaseController:
    settings = config.phase_settings(api_policy.RLEnergyPolicySpec(), SKU.supported_sm_clocks_mhz())
    pc = eerl.PhaseController(settings[0], eerl.ControllerSettings())
    rng = random.Random(7)
    for _ in range(steps):
        d = pc.decide(allow_probe=True)
        if d.probe_clocks_mhz:
            obs = base.PhaseObservation(
                "generation",
                2.4,
                700.0,
                d.clock_mhz,
                slices=_slices(d.probe_clocks_mhz, truth, rng),
            )
        else:
            clock = d.clock_mhz
            obs = base.PhaseObservation("generation", 2.4, 700.0, clock, clock or F_MAX)
        pc.observe(obs, WL)
    return pc


def _energy(truth: Callable[[float], float], clock: float) -> float:
    """True energy per token vs default at ``clock``."""
    return _power(clock) / truth(clock)


def _best_energy(truth: Callable[[float], float]) -> float:
    """The lowest true energy per token of a clock (990 MHz or above) keeping the threshold."""
    return min(
        _energy(truth, c)
        for c in SKU.supported_sm_clocks_mhz()
        if truth(c) >= THRESHOLD and c >= 990
    )


@pytest.mark.parametrize(("truth", "energy_gap"), [(_step, 0.005), (_plateau, 0.01)])
def test_on_a_step_and_a_plateau_the_lock_keeps_the_threshold_near_the_best_clock(
    truth: Callable[[float], float], energy_gap: float
) -> None:
    """Keeps the threshold by the truth and gives up little energy per token against the best
    clock: on the step one 15 MHz clock step (0.4 %); on the plateau the most efficient clock is
    not the lowest that keeps the threshold (above the knee throughput is flat, so power falls
    faster than throughput down to it, and below it throughput falls faster)."""
    pc = _run(truth)
    assert pc.state is base.PhaseState.LOCKED, pc.retrial_reasons
    lock = pc.locked_clock_mhz
    assert lock is not None
    assert pc.fit is not None and pc.fit.misfit
    assert truth(lock) >= THRESHOLD
    assert _energy(truth, lock) - _best_energy(truth) <= energy_gap, (lock, pc.retrial_reasons)
    lo, hi = pc.bracket()
    assert lo < hi <= lock and truth(hi) >= THRESHOLD  # the search closed below the lock


def test_the_plain_model_on_its_own_shape_is_not_flagged_and_locks_near_the_best() -> None:
    pc = _run(_model_shape)
    assert pc.state is base.PhaseState.LOCKED
    assert pc.fit is not None and not pc.fit.misfit
    lock = pc.locked_clock_mhz
    assert lock is not None and _model_shape(lock) >= THRESHOLD
    # Energy falls with the clock on this shape: the best is the lowest clock keeping the
    # threshold, and the lock lies within four 15 MHz steps of it.
    best = min(c for c in SKU.supported_sm_clocks_mhz() if _model_shape(c) >= THRESHOLD)
    assert _energy(_model_shape, best) == _best_energy(_model_shape)
    assert lock - best <= 60


def test_the_corrected_fit_follows_each_probed_clock_where_the_model_misfits() -> None:
    # Blocks from the step: the plain model reads the lever's 0.56 as a compute-bound phase and
    # predicts ~0.6 at 1110 MHz, where the probed blocks measured 1.0.
    rng = random.Random(3)
    blocks: list[tuple[int, float, float | None]] = []
    for clock in (990, 1110, 1500):
        for _ in range(6):
            blocks.append((clock, _step(clock) * rng.gauss(1.0, 0.01), _power(clock)))
    plain = probe.fit_phase_model(blocks, F_MAX, F_MAX)
    fit = probe.fit_corrected(blocks, F_MAX, F_MAX)
    assert plain is not None and fit is not None
    assert plain.throughput_ratio(1110) < 0.9
    assert fit.misfit
    assert fit.throughput_ratio(1110) == pytest.approx(1.0, abs=0.01)
    assert fit.throughput_lower_bound(1110, 1.5) > THRESHOLD
    assert fit.throughput_ratio(990) == pytest.approx(1 / 1.8, abs=0.02)
