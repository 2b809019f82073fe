"""The operator's status judged against the simulator's truth (3 simulated nodes, H100 sync).

The simulator knows what the job cost under the operator's plans and what the same steps, with
the same noise, would have cost under the default governor (``sim.job.default_run``). We test:

* every phase's reported saving is within ``SAVING_TOLERANCE_PP`` percentage points and its
  reported throughput ratio within ``RATIO_TOLERANCE`` of the truth, and so are the totals;
* every phase's measured energy is the true energy within ``ENERGY_TOLERANCE``;
* each locked clock keeps its phase's threshold in truth (the lock's own ratio), and the whole
  run, trials included, stays within ``TRIAL_ALLOWANCE`` of it;
* the comparison has teeth: a counterfactual biased by 10 % (every claimed saving inflated)
  misses the truth by more than the tolerance;
* the status's bounds (``saving.lowPercent``/``highPercent``, ``throughputRatioLow``/``High``,
  the totals' alike) bracket each point figure and hold the truth wherever the point is off by
  more than the tolerance; a checkpoint written without bounds restores them as the point.

The node reports carry no idle windows here (``SimNodes``), so the totals are compared with the
phases' truth.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rlenergy_operator import jobloop
from sim_nodes import SimNodes, _PlanPolicy

from rlenergy.api.v1alpha1 import policy
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.freq import eerl
from rlenergy.sim import job as sim_job

SAVING_TOLERANCE_PP = 1.0
"""Reported saving vs truth, percentage points (within 1 point)."""
RATIO_TOLERANCE = 0.01
"""Reported throughput ratio vs truth (within 0.01)."""
ENERGY_TOLERANCE = 0.01
"""Measured vs true phase energy, relative: the simulated counters' 20-100 ms update period."""
TRIAL_ALLOWANCE = 0.012
"""How far the whole run's true ratio, trials included, may fall below the threshold: a trial
runs half of its slices at the lever-arm clock (``eerl.PROBE_MIN_RATIO``, 0.85) and the 60-step
runs here spend 4-12 of their steps probing. Measured on seeds 0-5: training 0.960-0.974
against 0.97, generation 0.958-0.961 against 0.95."""
STEPS = 60
SPEC = policy.parse_policy(
    {
        "selector": {"matchLabels": {"a": "b"}},
        "phases": [
            {"name": "generation", "minThroughputRatio": 0.95},
            {"name": "training", "minThroughputRatio": 0.97},
        ],
        "controller": {"trialSteps": 4},
    }
)


def _run(seed: int) -> tuple[jobloop.JobLoop, sim_job.Job, sim_job.Totals]:
    loop = jobloop.JobLoop(SPEC, 1)
    nodes = SimNodes("p", STEPS, loop.advance, seed=seed)
    nodes.publish(nodes.reports())
    results, _ = sim_job.run_job(nodes.job, _PlanPolicy(nodes, lambda _step: loop.plan("t")))
    assert loop.totals().steps == STEPS and loop.totals().compared_steps == STEPS
    return loop, nodes.job, sim_job.totals(nodes.job, results)


def _truth(job: sim_job.Job, online: sim_job.Totals) -> Iterator[tuple[str, float, float]]:
    """(phase, true saving %, true throughput ratio) per phase, then ``total``."""
    default = sim_job.default_run(job)
    for ph in online.phase_energy_j:
        yield (
            ph,
            100.0 * (1.0 - online.phase_energy_j[ph] / default.phase_energy_j[ph]),
            default.phase_time_s[ph] / online.phase_time_s[ph],
        )
    e_on, e_def = sum(online.phase_energy_j.values()), sum(default.phase_energy_j.values())
    t_on, t_def = sum(online.phase_time_s.values()), sum(default.phase_time_s.values())
    yield "total", 100.0 * (1.0 - e_on / e_def), t_def / t_on


def _reported(loop: jobloop.JobLoop) -> dict[str, tuple[float, float]]:
    out = {}
    for ph in loop.phase_status():
        assert ph.saving.percent is not None and ph.throughput_ratio is not None
        out[ph.name] = (ph.saving.percent, ph.throughput_ratio)
    t = loop.totals()
    assert t.saving_percent is not None and t.throughput_ratio is not None
    out["total"] = (t.saving_percent, t.throughput_ratio)
    return out


@pytest.mark.parametrize("seed", [0, 4])
def test_status_and_thresholds_match_the_true_default_run(seed: int) -> None:
    loop, job, online = _run(seed)
    reported = _reported(loop)
    for name, saving, ratio in _truth(job, online):
        got_saving, got_ratio = reported[name]
        assert got_saving == pytest.approx(saving, abs=SAVING_TOLERANCE_PP), (name, reported)
        assert got_ratio == pytest.approx(ratio, abs=RATIO_TOLERANCE), (name, reported)
    assert reported["generation"][0] > 10.0  # a real saving, not 0 == 0
    # Energy: what the status measured is what the GPUs drew.
    for ph in loop.phase_status():
        assert ph.measured_joules == pytest.approx(
            online.phase_energy_j[ph.name], rel=ENERGY_TOLERANCE
        )
    # Thresholds: each lock keeps its own in truth; the whole run within the trials' cost.
    default = sim_job.default_run(job)
    for ph in loop.phase_status():
        threshold = ph.min_throughput_ratio
        # A workload drift may open a re-trial on the last steps; the clock held until then
        # (the controller keeps it while the new round runs) is the lock judged.
        clock = loop.controller.phases[ph.name].locked_clock_mhz
        drift = ph.state == "trial" and (ph.last_retrial_reason or "").startswith("workload drift")
        assert (ph.state == "locked" or drift) and clock is not None, ph
        fixed = sim_job.fixed_run(job, {ph.name: clock})
        assert default.phase_time_s[ph.name] / fixed.phase_time_s[ph.name] >= threshold, ph
        whole_run = default.phase_time_s[ph.name] / online.phase_time_s[ph.name]
        assert whole_run >= threshold - TRIAL_ALLOWANCE, (ph.name, whole_run)


def test_a_biased_counterfactual_misses_the_truth(monkeypatch: pytest.MonkeyPatch) -> None:
    honest = eerl.PhaseController.default_equivalent

    def inflated(self, obs, workload):  # type: ignore[no-untyped-def]
        energy, time_s = honest(self, obs, workload)
        biased = obs.requested_clock_mhz is not None or bool(obs.slices)
        return (energy * 1.1 if energy is not None and biased else energy), time_s

    monkeypatch.setattr(eerl.PhaseController, "default_equivalent", inflated)
    loop, job, online = _run(0)
    reported = _reported(loop)
    truth = {name: saving for name, saving, _ in _truth(job, online)}
    assert reported["total"][0] - truth["total"] > 3 * SAVING_TOLERANCE_PP, (reported, truth)


def _bounded(loop: jobloop.JobLoop) -> dict[str, tuple[tuple[float, float, float], ...]]:
    """Per phase and ``total``: ((low, point, high) saving %, (low, point, high) ratio)."""
    out = {}
    for ph in loop.phase_status():
        sav, thr = ph.saving, ph.throughput_ratio
        assert sav.percent is not None and sav.low_percent is not None
        assert sav.high_percent is not None and thr is not None
        assert ph.throughput_ratio_low is not None and ph.throughput_ratio_high is not None
        out[ph.name] = (
            (sav.low_percent, sav.percent, sav.high_percent),
            (ph.throughput_ratio_low, thr, ph.throughput_ratio_high),
        )
    t = loop.totals()
    assert t.saving_low_percent is not None and t.saving_percent is not None
    assert t.saving_high_percent is not None and t.throughput_ratio is not None
    assert t.throughput_ratio_low is not None and t.throughput_ratio_high is not None
    out["total"] = (
        (t.saving_low_percent, t.saving_percent, t.saving_high_percent),
        (t.throughput_ratio_low, t.throughput_ratio, t.throughput_ratio_high),
    )
    return out


def test_status_bounds_bracket_the_point_and_hold_the_truth_where_it_is_off() -> None:
    loop, job, online = _run(0)
    bounded = _bounded(loop)
    widths = []
    for name, saving, ratio in _truth(job, online):
        for (low, point, high), truth, tol in zip(
            bounded[name], (saving, ratio), (SAVING_TOLERANCE_PP, RATIO_TOLERANCE), strict=True
        ):
            assert low <= point + 1e-3 and point <= high + 1e-3, (name, low, point, high)
            assert abs(point - truth) <= tol or low <= truth <= high, (name, truth, low, high)
            widths.append(high - low)
    assert max(widths) > 0  # the locked windows widen the bounds: not the point twice
    # A checkpoint written before the bounds existed: its windows restore as exact.
    status = api_status.RLEnergyPolicyStatus(
        phases=[
            ph.model_copy(update={f: 0.0 for f in _BOUND_FIELDS}) for ph in loop.phase_status()
        ],
        totals=loop.totals().model_copy(update={f: 0.0 for f in _BOUND_FIELDS}),
    )
    restored = jobloop.JobLoop.restore(SPEC, 1, status, []).totals()
    assert restored.saving_low_percent == restored.saving_percent
    assert restored.saving_high_percent == restored.saving_percent
    assert restored.throughput_ratio_low == restored.throughput_ratio_high
    assert restored.throughput_ratio_low == restored.throughput_ratio


_BOUND_FIELDS = (
    "predicted_default_low_joules",
    "predicted_default_high_joules",
    "predicted_default_low_seconds",
    "predicted_default_high_seconds",
)
