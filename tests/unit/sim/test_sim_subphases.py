"""verl's training sub-phases in the simulator: traces, physics, grouping, runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlenergy import errors
from rlenergy.api import phases as api_phases
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import base
from rlenergy.gpu import models, published
from rlenergy.sim import job as sim_job
from rlenergy.sim import report, traces, workload

DEEPSEEK = "verl-grpo-deepseek7b-mi300-8gpu"  # logs old_log_prob, ref, update_actor
FINE = ("generation", "old-log-prob", "ref", "update-actor")


def _spec(*names: str) -> api_policy.RLEnergyPolicySpec:
    return api_policy.RLEnergyPolicySpec(phases=[api_policy.PhaseSpec(name=n) for n in names])


def test_a_trace_keeps_each_logged_training_part_in_step_order() -> None:
    t = traces.load_trace("verl-ppo-qwen25-7b-gsm8k-16gpu")
    for rec in t.steps:
        keys = [k for k, _ in rec.train_parts_s]
        assert keys == ["old_log_prob", "values", "update_critic", "update_actor"]
        assert sum(s for _, s in rec.train_parts_s) == pytest.approx(rec.train_time_s, rel=1e-12)


def test_split_replay_gives_each_part_its_kind_and_the_logged_time_at_the_default() -> None:
    sku = models.get_sku("h100-sxm")  # forward and update both run at max boost by default
    t = traces.load_trace(DEEPSEEK)
    whole = workload.from_trace(t, sku, 3)
    split = workload.from_trace(t, sku, 3, split=True)
    assert whole.phase_names == ("generation", "training")
    assert split.phase_names == FINE
    assert [p.kind for p in split.steps[0].phases] == [
        "generation",
        "forward",
        "forward",
        "training",
    ]
    for w, s in zip(whole.steps, split.steps, strict=True):
        train = sum(p.boost_time_s for p in s.phases[1:])
        assert train == pytest.approx(w.phase("training").boost_time_s, rel=1e-12)
        assert s.phase("generation") == w.phase("generation")


@pytest.mark.parametrize(
    ("policy", "groups"),
    [
        (
            ("generation", "training"),
            {"generation": ("generation",), "training": FINE[1:]},
        ),
        (
            ("generation", "update-actor"),
            {
                "generation": ("generation",),
                "training": ("old-log-prob", "ref"),
                "update-actor": ("update-actor",),
            },
        ),
        (FINE, {n: (n,) for n in FINE}),
        (
            ("generation", "ref"),  # training's sub-phases on both sides of a named one
            {
                "generation": ("generation",),
                "training": ("old-log-prob", "update-actor"),
                "ref": ("ref",),
            },
        ),
    ],
)
def test_phase_groups_put_every_unnamed_subphase_in_training(
    policy: tuple[str, ...], groups: dict[str, tuple[str, ...]]
) -> None:
    assert workload.phase_groups(FINE, policy) == groups
    assert api_phases.signal_name("ref", policy) == ("ref" if "ref" in policy else "training")


def test_grouping_changes_who_decides_not_the_physics() -> None:
    sku = published.get("b200:hbm-decode")
    replay = workload.from_trace(traces.load_trace(DEEPSEEK), sku, 12, split=True)
    two = sim_job.Job(replay, sku, "sync", seed=4)
    fine = sim_job.Job(replay, sku, "sync", seed=4, phases=FINE)
    assert two.phases == ("generation", "training")
    assert fine.phases == FINE
    d2, d4 = sim_job.default_run(two), sim_job.default_run(fine)
    assert d2.energy_j == pytest.approx(d4.energy_j, rel=1e-12)
    assert d2.time_s == pytest.approx(d4.time_s, rel=1e-12)
    assert d2.phase_time_s["training"] == pytest.approx(
        sum(d4.phase_time_s[n] for n in FINE[1:]), rel=1e-12
    )


def test_forward_passes_have_their_own_default_clock_where_the_update_is_power_capped() -> None:
    for sku in (models.get_sku("b200"), published.get("h100-sxm:hbm-decode")):
        f_fwd = sku.effective_clock_mhz("forward", None)
        f_upd = sku.effective_clock_mhz("training", None)
        assert f_fwd > f_upd
        assert sku.memory_share("forward", 500) > sku.memory_share("training", 500)
    # A SKU without forward parameters runs forward passes as its update.
    bare = models.get_sku("h100-sxm").model_copy(update={"forward": None})
    assert bare.time_factor("forward", 1200, 500) == bare.time_factor("training", 1200, 500)


def test_probe_slices_run_on_across_the_subphases_a_phase_covers() -> None:
    sku = models.get_sku("h100-sxm")
    replay = workload.from_trace(traces.load_trace(DEEPSEEK), sku, 2, split=True)
    job = sim_job.Job(replay, sku, "sync", seed=1)

    class Probe:
        def decide(self, step: int) -> base.Plan:
            d = base.PhaseDecision(
                None, base.PhaseState.TRIAL, probe_clocks_mhz=(1200, None), probe_slice_s=0.7
            )
            return base.Plan(step, {"training": d})

        def observe(self, obs: base.StepObservation) -> None:
            self.seen = obs

    policy = Probe()
    results, _ = sim_job.run_job(job, policy)
    obs = policy.seen.phases["training"]
    times = [s.duration_s for s in obs.slices]
    assert sum(times) == pytest.approx(obs.duration_s, rel=1e-9)
    # Every slice but the last is whole: none is cut where one sub-phase hands over.
    assert all(t == pytest.approx(0.7) for t in times[:-1])
    assert [s.clock_mhz for s in obs.slices[:4]] == [1200, None, 1200, None]
    assert sum(s.progress for s in obs.slices) == pytest.approx(
        replay.steps[1].workload.phase_tokens("training"), rel=0.05
    )
    assert results[-1].phase_time_s["training"] == pytest.approx(obs.duration_s, rel=1e-9)


def test_an_idle_gap_lock_costs_what_the_sku_draws_locked() -> None:
    sku = published.get("h100-sxm:hbm-decode")
    replay = workload.from_trace(traces.load_trace("verl-gpg-qwen2-7b-fsdp-8gpu"), sku, 6)
    job = sim_job.Job(replay, sku, "sync", seed=2)
    low = sku.supported_sm_clocks_mhz()[-1]
    free, _ = sim_job.run_job(job, base.DefaultGovernor(job.phases))
    held, _ = sim_job.run_job(job, base.DefaultGovernor(job.phases), idle_lock_mhz=low)
    gap_s = sum(s.other_time_s for s in replay.steps)
    extra = (sku.idle_power_for(low) - sku.idle_power_for(None)) * sum(job.power_spread) * gap_s
    assert extra > 0
    assert sum(r.energy_j for r in held) - sum(r.energy_j for r in free) == pytest.approx(
        extra, rel=1e-9
    )


def test_named_subphases_each_keep_their_threshold_on_both_families() -> None:
    for gpu in ("b200", "h100-sxm:hbm-decode"):
        rep = report.simulate(DEEPSEEK, gpu, "sync", steps=60, seed=0, policy=_spec(*FINE))
        assert [p.name for p in rep.phases] == list(FINE)
        for p in rep.phases:
            assert p.throughput_ratio >= p.min_throughput_ratio, (gpu, p)
        assert rep.online_saving > 0


def test_the_simulator_refuses_subphases_it_cannot_run() -> None:
    with pytest.raises(errors.InvalidInputError, match="sync mode only"):
        report.simulate(DEEPSEEK, "h100-sxm", "async", steps=4, policy=_spec(*FINE))
    with pytest.raises(errors.InvalidInputError, match="logs no values time"):
        report.simulate(DEEPSEEK, "h100-sxm", "sync", steps=4, policy=_spec("generation", "values"))
    with pytest.raises(errors.InvalidInputError, match="'reward' has no simulated work"):
        report.simulate(DEEPSEEK, "h100-sxm", "sync", steps=4, policy=_spec("generation", "reward"))


def test_the_shipped_subphase_sample_runs_as_a_user_runs_it() -> None:
    """``rlenergy simulate --policy crds/samples/subphases-job.yaml`` on a trace logging them."""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-m", "rlenergy.cli", "simulate", "--trace", DEEPSEEK, "--gpu", "b200"]
        + ["--policy", str(root / "crds" / "samples" / "subphases-job.yaml")]
        + ["--steps", "30", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    body = json.loads(out.stdout)
    # Every sub-phase this trace logs is listed: no step time is left to `training`.
    assert [p["name"] for p in body["phases"]] == list(FINE)
    assert "training split into the sub-phases the trace logs" in " ".join(body["notes"])
