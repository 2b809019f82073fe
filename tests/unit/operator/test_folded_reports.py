"""Node reports that hold only the records the operator has not folded.

An agent leaves out of its report every record at or before the ``totals.throughStep`` it read
from the policy (``api_node.unfolded_steps``) and says so in ``foldedThroughStep``. We test
these aspects:
* the rule: a record after the folded step always stays, none at or before it does; a report
  that left nothing out says -1;
* the report's window: a step after ``foldedThroughStep`` that a pruned report lacks is LOST
  exactly as in the whole report, a late node still is not waited for, and a report with
  every record folded holds the next step pending;
* the job loop over pruning agents (their policy watch on time or several steps late) folds
  the same totals and plans as over whole reports, and equal to the sum of every record the
  nodes published; the reports hold a few records instead of 32 (object size printed);
* a failover: a replica rebuilt from the old leader's checkpoint over pruned reports books the
  same measured totals; a replica whose checkpoint is older than the one the agents pruned
  against does not fold (``handlers._not_behind``).
"""

from __future__ import annotations

import json
import statistics

import kopf
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rlenergy_operator import handlers, jobloop
from sim_nodes import SimNodes

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.freq import aggregate

SPEC = policy.parse_policy(
    {"selector": {"matchLabels": {"a": "b"}}, "controller": {"trialSteps": 4}}
)
WINDOW = 32  # the agent's MAX_STEPS_KEPT


def _prune(rep: api_node.NodeReport, folded: int) -> api_node.NodeReport:
    """``rep`` as an agent that read ``throughStep`` ``folded`` writes it."""
    kept, mark = api_node.unfolded_steps([r.step for r in rep.steps], folded)
    steps = [r for r in rep.steps if r.step in kept]
    return rep.model_copy(update={"steps": steps, "folded_through_step": mark})


def _rec(step: int) -> api_node.StepRecord:
    return api_node.StepRecord(
        step=step,
        workload=api_node.TokenWorkloadReport(
            samples=1, response_tokens=1, prompt_tokens=1, valid_tokens=1, mean_context_tokens=1
        ),
        phases=[api_node.PhaseWindowReport(phase="generation", duration_seconds=1.0)],
    )


def _report(node: str, steps: list[int]) -> api_node.NodeReport:
    gpu = api_node.GpuStatus(uuid=f"GPU-{node}", supported_clocks_mhz=[1410, 1980])
    return api_node.NodeReport(
        policy_name="p",
        node_name=node,
        gpus=[gpu],
        steps=[_rec(s) for s in steps],
        last_step=max(steps, default=-1),
    )


@given(
    steps=st.lists(st.integers(0, 40), unique=True).map(sorted),
    folded=st.integers(-1, 45),
)
def test_the_rule_keeps_every_unfolded_record_and_no_folded_one(
    steps: list[int], folded: int
) -> None:
    kept, mark = api_node.unfolded_steps(steps, folded)
    assert kept == [s for s in steps if s > folded]
    assert mark == (folded if any(s <= folded for s in steps) else -1)


def test_the_rule_by_example() -> None:
    assert api_node.unfolded_steps([3, 4, 5, 6], 4) == ([5, 6], 4)
    assert api_node.unfolded_steps([3, 4, 5, 6], -1) == ([3, 4, 5, 6], -1)
    assert api_node.unfolded_steps([7, 8], 4) == ([7, 8], -1)  # nothing left out
    assert api_node.unfolded_steps([3, 4], 9) == ([], 9)


def test_a_skipped_step_after_the_folded_ones_is_lost_as_before() -> None:
    a = _report("a", [0, 1, 2, 3])
    c = _report("c", [0, 1, 3])  # moved past 2 without a record
    whole = [a, c]
    pruned = [_prune(r, 1) for r in whole]
    assert [r.step for r in pruned[1].steps] == [3] and pruned[1].folded_through_step == 1
    for reports in (whole, pruned):
        assert aggregate.step_state(2, reports) is aggregate.StepState.LOST
        assert aggregate.step_state(3, reports) is aggregate.StepState.COMPLETE
    # A node that started late left nothing out: it is not waited for on earlier steps.
    late = _prune(_report("late", [3]), 1)
    assert late.folded_through_step == -1
    assert aggregate.step_state(2, [pruned[0], late]) is aggregate.StepState.COMPLETE
    # Every record folded: the node holds the next step back until it reports it.
    done = _prune(a, 3)
    assert done.steps == [] and done.folded_through_step == 3
    assert aggregate.step_state(4, [done, _report("b", [4])]) is aggregate.StepState.PENDING


def _run(steps: int, lag: int | None, snapshot_at: int | None = None) -> dict[str, object]:
    """Play ``steps`` RL steps; agents prune against the checkpoint ``lag`` writes old.

    ``lag`` None: whole reports (the 32-record window). Returns the loop, every record
    published, the newest reports, their object sizes and the status at ``snapshot_at``.
    """
    loop = jobloop.JobLoop(SPEC, 1)
    published: list[int] = []  # totals.throughStep after each status write
    out: dict[str, object] = {"records": {}, "sizes": [], "held": [], "plans": []}
    records: dict[tuple[str, int], api_node.StepRecord] = out["records"]  # type: ignore[assignment]

    def publish(reports: list[api_node.NodeReport]) -> None:
        if lag is not None:
            seen = published[-1 - lag] if len(published) > lag else -1
            reports = [_prune(r, seen) for r in reports]
        for rep in reports:
            for r in rep.steps:
                assert records.setdefault((rep.node_name, r.step), r) == r  # never changes
        out["reports"] = reports
        out["sizes"].append(len(json.dumps(reports[0].model_dump(by_alias=True, mode="json"))))  # type: ignore[union-attr]
        out["held"].append(max(len(r.steps) for r in reports))  # type: ignore[union-attr]
        loop.advance(reports)
        published.append(loop.account.through_step)
        if snapshot_at is not None and loop.account.through_step == snapshot_at:
            out["snapshot"] = _status(loop)

    def plan_for(step: int) -> api_node.ClockPlan:
        plan = loop.plan("t")
        out["plans"].append(plan)  # type: ignore[union-attr]
        return plan

    SimNodes("p", steps, publish, window=WINDOW).run(plan_for)
    out["loop"] = loop
    return out


def _status(loop: jobloop.JobLoop) -> api_status.RLEnergyPolicyStatus:
    body = {
        "plan": loop.plan("t").model_dump(by_alias=True, exclude_none=True),
        "phases": [p.model_dump(by_alias=True, exclude_none=True) for p in loop.phase_status()],
        "totals": loop.totals().model_dump(by_alias=True, exclude_none=True),
    }
    return api_status.RLEnergyPolicyStatus.model_validate(body)


def _joules(records: dict[tuple[str, int], api_node.StepRecord]) -> float:
    return sum(
        sum(p.energy_joules or 0.0 for p in r.phases) + (r.idle_energy_joules or 0.0)
        for r in records.values()
    )


@pytest.mark.parametrize("lag", [0, 3])
def test_pruning_agents_fold_into_the_same_totals_and_plans(lag: int) -> None:
    steps = 44
    whole, pruned = _run(steps, None), _run(steps, lag)
    live: jobloop.JobLoop = pruned["loop"]  # type: ignore[assignment]
    assert live.totals() == whole["loop"].totals()  # type: ignore[attr-defined]
    assert pruned["plans"] == whole["plans"]
    totals = live.totals()
    assert (totals.steps, totals.missed_steps, totals.through_step) == (steps, 0, steps - 1)
    assert totals.measured_joules == pytest.approx(_joules(pruned["records"]), rel=1e-12)  # type: ignore[arg-type]
    # A report holds the step the operator has not folded and those the late watch hides.
    assert max(pruned["held"]) <= lag + 1  # type: ignore[call-overload]
    full = statistics.median(whole["sizes"][WINDOW:])  # type: ignore[index]
    now = statistics.median(pruned["sizes"][WINDOW:])  # type: ignore[index]
    print(
        f"report object (3-node sim, 8 GPUs, policy watch {lag} writes late): whole "
        f"{full / 1e3:.1f} kB p50, unfolded only {now / 1e3:.1f} kB p50 "
        f"(max {max(pruned['sizes']) / 1e3:.1f} kB)"  # type: ignore[call-overload]
    )
    assert now * 4 <= full


def test_a_failover_over_pruned_reports_keeps_the_measured_totals() -> None:
    """The old leader folded through 14, wrote status and died; the agents pruned through 14
    and the job ran on; the new leader rebuilds from that status over the pruned reports."""
    live = _run(26, None, snapshot_at=14)
    snapshot: api_status.RLEnergyPolicyStatus = live["snapshot"]  # type: ignore[assignment]
    reports = [_prune(r, 14) for r in live["reports"]]  # type: ignore[attr-defined]
    assert min(r.steps[0].step for r in reports) == 15
    new = jobloop.JobLoop.restore(SPEC, 1, snapshot, reports)
    assert not new.rebuilt  # the records before 15 are folded into the checkpoint
    assert new.advance(reports) == list(range(15, 26))
    old: jobloop.JobLoop = live["loop"]  # type: ignore[assignment]
    for name in jobloop.MEASURED_TOTALS:
        assert getattr(new.account, name) == pytest.approx(getattr(old.account, name)), name
    for name, pa in old.account.phases.items():
        assert new.account.phases[name].measured_joules == pytest.approx(pa.measured_joules)
    assert new.account.measured_joules == pytest.approx(_joules(live["records"]), rel=1e-12)  # type: ignore[arg-type]
    # Restoring again from the new status folds nothing twice.
    again = jobloop.JobLoop.restore(SPEC, 1, _status(new), reports)
    assert again.advance(reports) == [] and again.totals() == new.totals()


def test_a_replica_behind_the_agents_checkpoint_does_not_fold() -> None:
    pm = handlers.PolicyMemo()
    reports = [_prune(_report("a", [7, 8, 9, 10]), 9), _report("b", [10])]
    behind = api_status.RLEnergyPolicyStatus.model_validate({"totals": {"throughStep": 5}})
    with pytest.raises(kopf.TemporaryError, match="pruned through step 9"):
        handlers._not_behind(pm, None, behind, reports)
    loop = jobloop.JobLoop(SPEC, 1)
    loop.account.through_step = 8
    pm.loop = loop
    with pytest.raises(kopf.TemporaryError):
        handlers._not_behind(pm, loop, behind, reports)
    assert pm.loop is None  # rebuilt from the newer status by the next pass
    current = api_status.RLEnergyPolicyStatus.model_validate({"totals": {"throughStep": 9}})
    handlers._not_behind(pm, None, current, reports)  # the status the agents read: folds
