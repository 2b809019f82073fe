"""What ``JobLoop`` writes for users and agents: ``status.phases``, the published plan, the
first plan, and the loop a restart rebuilds, on hand-written node reports (``hand_reports``).

Written against the mutmut survivors of ``phase_status``, ``_recommend``, ``plan``,
``first_plan``, ``_decide``, ``advance`` and ``restore`` (docs/mutation.md): every field is
compared whole, so a field read from the wrong key, a default or a label changed shows.
"""

from __future__ import annotations

import pytest
from hand_reports import STEPS, Steps, folded, report, spec
from rlenergy_operator import jobloop

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.freq import eerl
from rlenergy.gpu import models

AT = "2026-12-02T05:00:00Z"
PHASES = ("generation", "training")
BASIS = "h100-sxm [MODEL] phase curves at the newest step's tokens, not measured"


def _fresh(name: str, state: str, **fields: object) -> api_status.PhaseStatus:
    return api_status.PhaseStatus.model_validate(
        {"name": name, "state": state, "min_throughput_ratio": 0.95, "selections": 0, **fields}
    )


@pytest.mark.parametrize("mode", ["enforce", "observe"])
def test_before_any_report_each_phase_waits_on_the_default_governor(mode: str) -> None:
    loop = jobloop.JobLoop(spec(controller={"mode": mode}), 7)
    state = "warmup" if mode == "enforce" else "observe"
    advice = (
        {}
        if mode == "enforce"
        else {"recommendation_basis": "waiting for a complete step with a clock table"}
    )
    assert loop.phase_status() == [
        _fresh(name, state, saving=api_status.Saving(percent=None, joules=None), **advice)
        for name in PHASES
    ]
    expected = api_node.ClockPlan(
        step=0,
        policy_generation=7,
        enforce=mode == "enforce",
        phases=[
            api_node.PhasePlan(
                phase=name, clock_mhz=None, state=state, reason="waiting for clock table"
            )
            for name in PHASES
        ],
        issued_at=AT,
    )
    assert jobloop.first_plan(loop.spec, 7, AT) == expected
    assert loop.plan(AT) == expected


def test_a_saving_is_in_joules_once_anything_is_predicted() -> None:
    loop = jobloop.JobLoop(spec(), 1)
    pa = loop.account.phases["generation"]
    pa.predicted_default_joules, pa.compared_measured_joules = 0.5, 0.25
    gen = loop.phase_status()[0]
    assert gen.saving == api_status.Saving(percent=50.0, joules=0.25)
    assert loop.phase_status()[1].saving == api_status.Saving(percent=None, joules=None)


def test_the_status_reads_the_controller_state_of_each_phase() -> None:
    # A generation window failed on step 1: that phase falls back to the default governor and
    # says why. The selection figures are set on the real phase controllers (as after two
    # rounds and an async threshold relaxed to 0.93): a lock held through a fallback is not
    # shown as the phase's clock.
    steps: Steps = {**STEPS, 1: (500.0, 50.0, {**STEPS[1][2], "generation": (8.0, 2500.0, "NVML")})}
    loop = folded("sync", steps)
    assert loop.controller is not None
    gen, train = loop.controller.phases["generation"], loop.controller.phases["training"]
    gen.locked_clock_mhz, gen.selections, gen.threshold = 1500, 2, 0.93
    train.stage = eerl.Locked(threshold=train.threshold, target=train.lock_target)
    train.locked_clock_mhz, train.selections = 1700, 1
    status = {p.name: p for p in loop.phase_status()}
    g, t = status["generation"], status["training"]
    assert (g.state, g.clock_mhz, g.selections, g.min_throughput_ratio) == (
        "fallback",
        None,
        2,
        0.93,
    )
    assert g.last_retrial_reason == "error: gpu-node-0: NVML"
    assert (t.state, t.clock_mhz, t.selections, t.min_throughput_ratio) == ("locked", 1700, 1, 0.95)
    assert t.last_retrial_reason == "warm-up done"  # its trial round opened after warm-up
    assert g.recommendation_basis is None  # enforce mode measures, it does not recommend


def test_observe_mode_recommends_from_the_candidates_or_says_why_not() -> None:
    phases = [
        {"name": "generation", "clockCandidatesMHz": [1980, 1755]},
        {"name": "training", "minThroughputRatio": 1.0, "clockCandidatesMHz": [1005]},
    ]
    loop = folded("sync", STEPS, controller={"mode": "observe"}, phases=phases)
    gen, train = loop.phase_status()
    est = models.estimate_best_clock(
        models.get_sku("h100-sxm"), "generation", 0.95, 512.0, [1980, 1755]
    )
    assert est is not None and est.clock_mhz == 1755  # the table's best, 1365 MHz, is no candidate
    assert (gen.recommended_clock_mhz, gen.recommendation_basis) == (1755, BASIS)
    assert gen.estimated_saving_percent == round(100.0 * (1.0 - est.energy_ratio), 2) == 9.41
    assert (train.recommended_clock_mhz, train.estimated_saving_percent) == (None, None)
    assert train.recommendation_basis == f"{BASIS}: no clock keeps the threshold"
    two = jobloop.JobLoop(spec(controller={"mode": "observe"}), 1)
    two.advance([report(STEPS, gpus=("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"))])
    assert two.phase_status()[0].recommendation_basis == "no GPU model for mixed or unnamed GPUs"


def test_each_plan_says_since_which_step_its_phase_holds_its_state() -> None:
    loop = jobloop.JobLoop(spec(), 1)
    plans = []
    for last in (0, 1):
        assert loop.advance([report({s: STEPS[s] for s in range(last + 1)})]) == [last]
        plans.append(loop.plan(AT))
    decided = loop.decisions[2].phases
    warm, trial = plans
    assert [(p.step, p.issued_at) for p in plans] == [(1, AT), (2, AT)]
    assert [(p.state, p.since_step, p.reason) for p in warm.phases] == [("warmup", 0, "warmup")] * 2
    assert [(p.phase, p.state, p.since_step) for p in trial.phases] == [
        (name, "trial", 2) for name in PHASES
    ]
    assert [p.reason for p in trial.phases] == [decided[n].reason for n in PHASES]
    assert all(p.reason.startswith("trial ") for p in trial.phases)
    # the last windows (8 s, 5 s) cut into 48 probe slices, to the microsecond
    assert [p.probe_slice_seconds for p in trial.phases] == [0.166667, 0.104167]


def test_lost_steps_are_missed_and_the_steps_after_them_still_fold() -> None:
    # gpu-node-1 moved past steps 1 and 2 without records: both are lost for the job.
    steps = {s: STEPS[s % 2] for s in range(4)}
    full = report(steps)
    gaps = report({0: steps[0], 3: steps[3]}, node="gpu-node-1")
    loop = jobloop.JobLoop(spec(), 1)
    assert loop.advance([full, gaps]) == [0, 3]
    acc = loop.account
    assert (acc.missed_steps, acc.steps, acc.through_step) == (2, 2, 3)
    # Warm-up ended with step 3: the trials start at step 4, the step the plan is for.
    assert [(p.state, p.since_step) for p in loop.plan(AT).phases] == [("trial", 4)] * 2
    # A node still behind holds the job at its last complete step.
    behind = jobloop.JobLoop(spec(), 1)
    late = report({0: steps[0], 1: steps[1]}, node="gpu-node-1")
    assert behind.advance([full, late]) == [0, 1]
    assert behind.advance([full, late]) == []
    assert behind.account.through_step == 1 and behind.plan(AT).step == 2


def test_after_a_restart_a_lost_first_step_leaves_observe_mode_waiting() -> None:
    # The operator restarts at checkpoint step 5 before any report is listed; then step 6 turns
    # out lost (gpu-node-1 skipped it) and step 7 pending (gpu-node-2 is behind): the clock
    # table is known, but no step's tokens yet to estimate a clock on.
    status = api_status.RLEnergyPolicyStatus(totals=api_status.Totals(through_step=5, steps=6))
    loop = jobloop.JobLoop.restore(spec(controller={"mode": "observe"}), 1, status, [])
    steps = {s: STEPS[s % 2] for s in (5, 6, 7)}
    reports = [
        report(steps),
        report({5: steps[5], 7: steps[7]}, node="gpu-node-1"),
        report({5: steps[5], 6: steps[6]}, node="gpu-node-2"),
    ]
    assert loop.advance(reports) == []
    assert loop.controller is not None and loop.account.missed_steps == 1
    assert [p.recommendation_basis for p in loop.phase_status()] == [
        "waiting for a complete step with a clock table"
    ] * 2


def test_without_a_clock_table_nothing_folds_and_the_first_plan_stays() -> None:
    blind = report(STEPS, clocks=[])
    loop = jobloop.JobLoop(spec(), 3)
    assert loop.advance([blind]) == []
    assert loop.controller is None and loop.account.through_step == -1
    # A restart from a checkpoint at step 4 with still no table: the first plan at step 5.
    status = api_status.RLEnergyPolicyStatus(totals=api_status.Totals(through_step=4, steps=5))
    restored = jobloop.JobLoop.restore(loop.spec, 3, status, [blind])
    assert (restored.replayed, restored.account.steps) == (0, 5)
    assert restored.plan(AT) == jobloop.first_plan(loop.spec, 3, AT, step=5)


def _checkpoint(loop: jobloop.JobLoop) -> api_status.RLEnergyPolicyStatus:
    return api_status.RLEnergyPolicyStatus(totals=loop.totals(), phases=loop.phase_status())


def test_a_restart_replays_the_complete_steps_past_a_lost_one() -> None:
    steps = {s: STEPS[s % 2] for s in range(5)}
    reports = [report(steps), report({0: steps[0], 2: steps[2], 3: steps[3]}, node="gpu-node-1")]
    live = jobloop.JobLoop(spec(), 1)
    assert live.advance(reports) == [0, 2, 3]
    restored = jobloop.JobLoop.restore(live.spec, 1, _checkpoint(live), reports)
    assert restored.replayed == 3
    assert restored.plan(AT) == live.plan(AT)
    assert restored.totals() == live.totals()
    # No checkpoint (a first start): nothing is restored, every step folds.
    fresh = jobloop.JobLoop.restore(live.spec, 1, None, reports)
    assert (fresh.replayed, fresh.account.through_step) == (0, -1)
    assert fresh.advance(reports) == [0, 2, 3]
    assert fresh.totals() == live.totals()


def _pools(steps: Steps) -> list[api_node.NodeReport]:
    """An async job: generation on one node's pool, training on the other's."""

    def pool(name: str, phase: str) -> api_node.NodeReport:
        return report(
            {s: (v, idle, {phase: w[phase]}) for s, (v, idle, w) in steps.items()}, node=name
        )

    return [pool("gen-0", "generation"), pool("train-0", "training")]


def test_async_pools_fold_each_phase_from_its_own_nodes_live_and_after_a_restart() -> None:
    steps = {s: STEPS[s % 2] for s in range(4)}
    reports = _pools(steps)
    live = jobloop.JobLoop(spec("async"), 1)
    assert live.advance(reports) == [0, 1, 2, 3]
    acc = live.account
    assert (acc.compared_steps, acc.unknown_energy_steps) == (4, 0)
    # each pool's node meters its own idle energy: 3000 + 2000 + 2 x 100 J, 2500 + 2200 + 2 x 50 J
    assert acc.measured_joules == 2 * (5200.0 + 4800.0)
    assert acc.measured_seconds == 2 * 18.0
    restored = jobloop.JobLoop.restore(live.spec, 1, _checkpoint(live), reports)
    assert restored.replayed == 4
    assert restored.plan(AT) == live.plan(AT)
    assert restored.phase_status() == live.phase_status()
