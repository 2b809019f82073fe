"""The status figures a simulated run would report (``sim.status``) against the simulator's truth.

``bench/energy.py`` prints the same errors for every row; here two rows of it, sync and async,
must keep the status targets: saving within 1 percentage point and throughput ratio within
0.01 of the truth, per phase and for the job.
"""

from __future__ import annotations

import pytest

from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import base, config
from rlenergy.gpu import models
from rlenergy.sim import report, status, traces, workload

SAVING_TOLERANCE_PP = 1.0
RATIO_TOLERANCE = 0.01


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_reported_saving_and_ratio_match_the_truth(mode: str) -> None:
    rep = report.simulate("verl-gpg-qwen2-7b-fsdp-8gpu", "h100-sxm", mode, steps=80, seed=1)
    assert set(rep.reported) == {"generation", "training", "total"}
    saving_pp, ratio = rep.status_errors
    assert saving_pp is not None and ratio is not None, rep.reported
    assert saving_pp <= SAVING_TOLERANCE_PP, (rep.reported, rep.truth)
    assert ratio <= RATIO_TOLERANCE, (rep.reported, rep.truth)
    # The figures are real: the run saved energy and the status says so.
    assert rep.reported["total"][0] is not None and rep.reported["total"][0] > 0.01


def test_the_async_job_total_counts_each_pool_s_wait_under_the_default() -> None:
    """An async row whose slowed pool waits less than it would under the default governor: the
    status's job saving counted the idle the same under either and read 11.90 % against a true
    12.96 % (``make bench-energy``, 2026-12-04); each pool's wait, ``base.async_default_idle_j``."""
    rep = report.simulate("verl-grpo-deepseek7b-mi300-8gpu", "b200", "async", steps=200, seed=0)
    saving, _ = rep.reported["total"]
    true_saving, _ = rep.truth["total"]
    assert saving is not None
    assert abs(saving - true_saving) * 100.0 <= 0.25, (saving, true_saving)


def test_the_account_folds_what_the_controller_predicts() -> None:
    """A locked window: measured beside the controller's default equivalent; errors skipped."""
    sku = models.get_sku("h100-sxm")
    ctl = config.build_controller(api_policy.RLEnergyPolicySpec(), sku.supported_sm_clocks_mhz())
    acc = status.StatusAccount(ctl)
    tokens = workload.from_trace(traces.load_trace("verl-gpg-qwen2-7b-fsdp-8gpu"), sku, 1)
    step_work = tokens.steps[0].workload
    default = base.PhaseObservation("generation", 2.0, 1000.0, None, 1980)
    failed = base.PhaseObservation("training", 3.0, 2000.0, None, 1980, error="GPU lost")
    acc.observe(base.StepObservation(0, step_work, {"generation": default, "training": failed}))
    gen = acc.phases["generation"]
    assert (gen.measured_j, gen.predicted_j, gen.measured_s, gen.predicted_s) == (
        1000.0,
        1000.0,
        2.0,
        2.0,
    )
    assert "training" not in acc.phases  # no counterfactual for a failed window
    assert acc.total.measured_s == 0.0  # a step with an uncompared phase is not in the total
    assert acc.phase_measured_j == 3000.0
    acc.add_idle(50.0)
    assert (acc.total.measured_j, acc.total.predicted_j) == (50.0, 50.0)
    assert gen.saving == 0.0 and gen.throughput_ratio == 1.0
    assert status.Sums().saving is None and status.Sums().throughput_ratio is None


def test_the_status_bounds_hold_the_point_and_count_what_they_miss() -> None:
    """``Sums`` folds each window's default-counterfactual bounds beside its point; the
    saving and ratio ranges bracket the point figures, and ``status_misses`` counts a figure
    off its tolerance as unresolved only where the truth lies outside its bounds."""
    acc = status.Sums()
    acc.add((90.0, 10.0), (100.0, 9.5), (95.0, 9.0), (110.0, 9.8))
    acc.add((45.0, 5.0), (50.0, 4.75), (50.0, 4.75), (50.0, 4.75))  # a default-like window
    assert acc.saving == pytest.approx(1 - 135.0 / 150.0)
    assert acc.saving_range == pytest.approx((1 - 135.0 / 145.0, 1 - 135.0 / 160.0))
    assert acc.throughput_ratio_range == pytest.approx((13.75 / 15.0, 14.55 / 15.0))
    lo, hi = acc.saving_range or (0.0, 0.0)
    assert lo <= acc.saving <= hi
    assert status.Sums().saving_range is None and status.Sums().throughput_ratio_range is None
    rep = report.simulate("tinyzero-ppo-qwen25-05b-countdown-rtx4090", "b200:hbm-decode", steps=40)
    for key, (sav, thr) in rep.reported.items():
        sav_range, thr_range = rep.reported_range[key]
        assert sav_range is not None and thr_range is not None and sav is not None
        assert sav_range[0] - 1e-12 <= sav <= sav_range[1] + 1e-12, key
        assert thr is not None and thr_range[0] - 1e-12 <= thr <= thr_range[1] + 1e-12, key
    off, unresolved, wide_pp, wide_ratio = rep.status_misses()
    assert 0 <= unresolved <= off and wide_pp > 0 and wide_ratio > 0
    # With no tolerance every figure is off; the truth inside the bounds resolves it.
    off_all, unresolved_all, _, _ = rep.status_misses(saving_pp=-1.0, ratio=-1.0)
    assert off_all == 2 * len(rep.reported)
    inside = sum(
        rng is not None and rng[0] - 1e-12 <= truth <= rng[1] + 1e-12
        for key, (true_sav, true_thr) in rep.truth.items()
        for truth, rng in zip((true_sav, true_thr), rep.reported_range[key], strict=True)
    )
    assert unresolved_all == off_all - inside
