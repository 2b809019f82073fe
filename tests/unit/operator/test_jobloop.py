"""The job-level loop (rlenergy_operator.jobloop) on 3 simulated nodes.

We test these aspects:
* the plan follows warm-up -> trials -> clocks, and savings and totals appear;
* totals equal the sum of the node reports;
* a restart (loop rebuilt from a status checkpoint plus the reports) continues exactly as if
  nothing happened: same totals, same next plan; restoring twice never double counts;
* a spec change keeps the totals; observe mode never asks for a clock;
* an unknown energy is counted as unknown, never as 0.
"""

from __future__ import annotations

import pytest
from rlenergy_operator import jobloop
from sim_nodes import SimNodes

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy
from rlenergy.api.v1alpha1 import status as api_status

SPEC = policy.parse_policy(
    {"selector": {"matchLabels": {"a": "b"}}, "controller": {"trialSteps": 4}}
)


def _status(loop: jobloop.JobLoop) -> api_status.RLEnergyPolicyStatus:
    """What the operator would have written, read back through JSON."""
    body = {
        "plan": loop.plan("t").model_dump(by_alias=True, exclude_none=True),
        "phases": [p.model_dump(by_alias=True, exclude_none=True) for p in loop.phase_status()],
        "totals": loop.totals().model_dump(by_alias=True, exclude_none=True),
    }
    return api_status.RLEnergyPolicyStatus.model_validate(body)


def _run(steps: int, spec: policy.RLEnergyPolicySpec = SPEC, snapshot_at: int | None = None):
    loop = jobloop.JobLoop(spec, 1)
    seen: dict[str, object] = {"plans": []}

    def publish(reports: list[api_node.NodeReport]) -> None:
        seen["reports"] = reports
        loop.advance(reports)
        if snapshot_at is not None and loop.account.through_step == snapshot_at:
            seen["snapshot"] = _status(loop)

    def plan_for(step: int) -> api_node.ClockPlan:
        plan = loop.plan("t")
        assert plan.step == step
        seen["plans"].append(plan)  # type: ignore[union-attr]
        return plan

    SimNodes("p", steps, publish).run(plan_for)
    return loop, seen


def test_plan_goes_through_warmup_and_trials_and_savings_appear():
    loop, seen = _run(30)
    states = [{p.state for p in plan.phases} for plan in seen["plans"]]
    assert states[0] == {"warmup"} and any("trial" in s for s in states)
    assert any(p.probe_clocks_mhz or p.clock_mhz for plan in seen["plans"] for p in plan.phases)
    totals = loop.totals()
    assert totals.steps == 30 and totals.through_step == 29 and totals.compared_steps == 30
    assert totals.saving_percent is not None and totals.saving_percent > 0
    for ph in loop.phase_status():
        assert ph.saving.percent is not None
        assert (
            ph.energy_per_valid_token_joules and ph.predicted_default_energy_per_valid_token_joules
        )


def test_totals_equal_the_sum_of_the_reports():
    loop, seen = _run(12)
    reports = seen["reports"]
    joules = sum(
        sum(p.energy_joules or 0.0 for p in r.phases) + (r.idle_energy_joules or 0.0)
        for rep in reports
        for r in rep.steps
    )
    assert loop.totals().measured_joules == pytest.approx(joules, rel=1e-12)


def test_restart_from_checkpoint_is_exact_and_never_double_counts():
    live, seen = _run(26, snapshot_at=14)
    reports = seen["reports"]
    snapshot = seen["snapshot"]
    assert isinstance(snapshot, api_status.RLEnergyPolicyStatus)
    restored = jobloop.JobLoop.restore(SPEC, 1, snapshot, reports)
    assert restored.replayed == 15
    restored.advance(reports)
    assert restored.totals() == live.totals()
    assert restored.plan("t") == live.plan("t")
    assert restored.phase_status() == live.phase_status()
    # A second restore from the final checkpoint folds nothing again.
    again = jobloop.JobLoop.restore(SPEC, 1, _status(live), reports)
    assert again.advance(reports) == []
    assert again.totals() == live.totals()


def test_spec_change_keeps_totals():
    live, seen = _run(10)
    new_spec = SPEC.model_copy(
        update={
            "phases": [
                policy.PhaseSpec(name="generation", minThroughputRatio=0.9),
                policy.PhaseSpec(name="training"),
            ]
        }
    )
    loop = jobloop.JobLoop.restore(new_spec, 2, _status(live), seen["reports"])
    assert loop.totals() == live.totals() and loop.plan("t").policy_generation == 2


def test_observe_mode_never_asks_for_a_clock():
    spec = policy.parse_policy(
        {"selector": {"matchLabels": {"a": "b"}}, "controller": {"mode": "observe"}}
    )
    loop, seen = _run(8, spec)
    for plan in seen["plans"]:
        assert plan.enforce is False
        assert all(p.clock_mhz is None and not p.probe_clocks_mhz for p in plan.phases)
    assert loop.totals().saved_joules == pytest.approx(0.0, abs=1e-6)
    # It still recommends: the GPU model's clock per phase, labelled as a model estimate.
    phases = {p.name: p for p in loop.phase_status()}
    gen, train = phases["generation"], phases["training"]
    assert gen.recommended_clock_mhz and train.recommended_clock_mhz
    assert gen.recommended_clock_mhz < train.recommended_clock_mhz < 1980  # decode is memory bound
    for ph in (gen, train):
        assert ph.clock_mhz is None and ph.state == "observe"
        assert ph.estimated_saving_percent is not None and 0 < ph.estimated_saving_percent < 50
        assert "h100-sxm [MODEL]" in (ph.recommendation_basis or "")


def test_observe_mode_says_why_it_cannot_recommend():
    spec = policy.parse_policy(
        {
            "selector": {"matchLabels": {"a": "b"}},
            "controller": {"mode": "observe"},
            "phases": [{"name": "generation"}, {"name": "reward"}],
        }
    )
    loop = jobloop.JobLoop(spec, 1)
    assert "waiting" in (loop.phase_status()[0].recommendation_basis or "")
    loop, _ = _run(4, spec)
    reward = {p.name: p for p in loop.phase_status()}["reward"]
    assert reward.recommended_clock_mhz is None
    assert "custom phase 'reward'" in (reward.recommendation_basis or "")
    loop.gpu_name = "NVIDIA A100-SXM4-80GB"
    gen = {p.name: p for p in loop.phase_status()}["generation"]
    assert gen.recommended_clock_mhz is None
    assert "no GPU model for NVIDIA A100" in (gen.recommendation_basis or "")


def test_unknown_energy_is_not_zero():
    loop = jobloop.JobLoop(SPEC, 1)
    w = api_node.TokenWorkloadReport(
        samples=1, responseTokens=10, promptTokens=1, validTokens=10, meanContextTokens=5
    )
    rec = api_node.StepRecord(
        step=0,
        workload=w,
        phases=[
            api_node.PhaseWindowReport(phase="generation", durationSeconds=1.0, energyJoules=None),
            api_node.PhaseWindowReport(phase="training", durationSeconds=1.0, energyJoules=3.0),
        ],
    )
    rep = api_node.NodeReport(
        policyName="p",
        nodeName="n",
        gpus=[api_node.GpuStatus(uuid="G", supportedClocksMHz=[1980, 1500, 990])],
        steps=[rec],
        lastStep=0,
    )
    assert loop.advance([rep]) == [0]
    totals = loop.totals()
    assert totals.unknown_energy_steps == 1 and totals.measured_joules == 0.0
    assert totals.saving_percent is None and totals.compared_steps == 0
    gen = next(p for p in loop.phase_status() if p.name == "generation")
    assert gen.saving.percent is None and gen.energy_per_valid_token_joules is None


def _without_progress(report: api_node.NodeReport) -> api_node.NodeReport:
    """The node report of trainers that sent no in-phase progress (no engine counter)."""
    steps = [
        s.model_copy(
            update={
                "phases": [
                    p.model_copy(
                        update={
                            "progress_mean_gap_seconds": None,
                            "slices": [sl.model_copy(update={"progress": 0.0}) for sl in p.slices],
                        }
                    )
                    for p in s.phases
                ]
            }
        )
        for s in report.steps
    ]
    return report.model_copy(update={"steps": steps})


def test_status_says_which_probe_evidence_and_falls_back_without_progress():
    loop, _ = _run(12)
    evidence = {p.name: p.probe_evidence for p in _status(loop).phases}
    assert all(e and e.startswith("in-phase slices (progress exact)") for e in evidence.values())

    blind = jobloop.JobLoop(SPEC, 1)
    plans: list[api_node.ClockPlan] = []

    def plan_for(step: int) -> api_node.ClockPlan:
        plans.append(blind.plan("t"))
        return plans[-1]

    SimNodes("p", 20, lambda reps: blind.advance([_without_progress(r) for r in reps])).run(
        plan_for
    )
    # No in-phase slice is ever planned again after the first window without progress, but
    # trials go on as whole steps at the trial clock.
    trials = [p for plan in plans[3:] for p in plan.phases if p.state == "trial"]
    assert trials and all(not p.probe_clocks_mhz for p in trials)
    assert any(p.clock_mhz for p in trials)
    for ph in _status(blind).phases:
        assert ph.probe_evidence and "whole-phase: no in-phase progress" in ph.probe_evidence


def test_annotation_phase_source_plans_whole_step_trials_only():
    """phaseSource annotation: no plan the operator publishes has probe slices; trials are whole
    steps at the trial clock, and the status says why (docs/agent.md)."""
    spec = SPEC.model_copy(update={"phase_source": "annotation"})
    loop, seen = _run(30, spec)
    entries = [p for plan in seen["plans"] for p in plan.phases]  # type: ignore[attr-defined]
    assert not any(p.probe_clocks_mhz for p in entries)
    assert any(p.state == "trial" and p.clock_mhz for p in entries)  # a whole-step trial
    for ph in loop.phase_status():
        assert ph.probe_evidence is not None and "phaseSource annotation" in ph.probe_evidence
    assert loop.totals().steps == 30


def test_observe_mode_recommends_for_named_training_subphases():
    """A policy naming verl's sub-phases gets a prior per sub-phase kind (rlenergy.api.phases)."""
    spec = policy.parse_policy(
        {
            "selector": {"matchLabels": {"a": "b"}},
            "controller": {"mode": "observe"},
            "phases": [{"name": "generation"}, {"name": "old-log-prob"}, {"name": "update-actor"}],
        }
    )
    loop, _ = _run(4, spec)
    phases = {p.name: p for p in loop.phase_status()}
    forward, update = phases["old-log-prob"], phases["update-actor"]
    assert forward.recommended_clock_mhz and update.recommended_clock_mhz
    # Forward-only passes are less compute bound than the update [MODEL]: a lower clock.
    assert forward.recommended_clock_mhz < update.recommended_clock_mhz
    assert "h100-sxm [MODEL]" in (forward.recommendation_basis or "")
