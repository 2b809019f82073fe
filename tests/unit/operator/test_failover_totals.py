"""Exact accounting across an operator failover.

We test these aspects:
* a new leader whose status holds totals written mid-way by the old leader, and whose index
  still refills (a replica resumed by peering: one of two reports indexed), folds the later
  steps over both nodes: the totals equal the sum of the node reports' records;
* a new leader recomputes the measured totals of a checkpoint that the old leader folded from
  a view lacking a node's report, so they equal the sum of the records; restoring again from
  its own checkpoint changes nothing (a record read twice is counted once);
* where the reports no longer hold every step a checkpoint counted (the agents' bounded
  window), or a node's GPUs no longer measure, the checkpoint stands as written.
"""

from __future__ import annotations

from typing import Any

import pytest
from hand_reports import STEPS, report
from kopf_doubles import StatusPatch, WarningLog, serving
from rlenergy_operator import handlers, jobloop, kube
from rlenergy_operator import reports as node_reports

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import status as api_status

SPEC = {"selector": {"matchLabels": {"job": "grpo"}}}
NODES = ("gpu-node-0", "gpu-node-1")


def _steps(upto: int) -> dict:
    return {s: STEPS[s % 2] for s in range(upto + 1)}


def _report(node: str, upto: int, first: int = 0) -> api_node.NodeReport:
    steps = {s: v for s, v in _steps(upto).items() if s >= first}
    return report(steps, node=node)


def _joules(reports: list[api_node.NodeReport], upto: int) -> float:
    return sum(
        sum(p.energy_joules or 0.0 for p in r.phases) + (r.idle_energy_joules or 0.0)
        for rep in reports
        for r in rep.steps
        if r.step <= upto
    )


def _wire(rep: api_node.NodeReport) -> dict[str, Any]:
    return rep.model_dump(by_alias=True, exclude_none=True, mode="json")


def _status_of(loop: jobloop.JobLoop) -> dict[str, Any]:
    """What the old leader wrote: its plan, phases and totals, as JSON."""
    return {
        "observedGeneration": 1,
        "plan": loop.plan("t").model_dump(by_alias=True, exclude_none=True, mode="json"),
        "phases": [
            p.model_dump(by_alias=True, exclude_none=True, mode="json") for p in loop.phase_status()
        ],
        "totals": loop.totals().model_dump(by_alias=True, exclude_none=True, mode="json"),
    }


def test_a_new_leader_folds_over_every_report_while_its_index_refills(monkeypatch):
    spec = handlers._parse(SPEC)
    # The old leader folded steps 0-2 over both nodes and wrote its checkpoint; then died.
    old = jobloop.JobLoop(spec, 1)
    assert old.advance([_report(n, 2) for n in NODES]) == [0, 1, 2]
    status = _status_of(old)
    # Steps 3-5 ran meanwhile; the API server has both reports, the resumed replica's index
    # holds one so far.
    now = [_report(n, 5) for n in NODES]
    api = {f"p.{r.node_name}": ("9", _wire(r)) for r in now}
    monkeypatch.setattr(
        kube, "node_report_versions", lambda ns, p: {n: v for n, (v, _) in api.items()}
    )
    monkeypatch.setattr(kube, "node_report", lambda ns, name: api.get(name))
    # the job's pods, one per node (the loop reads the reports of their nodes only)
    pods = [{"metadata": {"labels": {"job": "grpo"}}, "spec": {"nodeName": n}} for n in NODES]
    monkeypatch.setattr(kube, "pods", lambda ns, selector: pods if selector == "job=grpo" else [])
    indexed = {
        ("ns", "p"): [node_reports.IndexedReport.from_spec("p.gpu-node-0", "9", _wire(now[0]), -1)]
    }
    memo: dict[str, Any] = {"operator": handlers.OperatorMemo(), "handover": serving()}
    patch = StatusPatch()
    handlers.policy_loop(
        spec=SPEC,
        meta={"generation": 1, "resourceVersion": "7"},
        status=status,
        patch=patch,
        memo=memo,
        body={},
        namespace="ns",
        name="p",
        logger=WarningLog(),
        policy_node_reports=indexed,
    )
    totals = patch.status["totals"]
    assert totals["throughStep"] == 5 and totals["steps"] == 6
    assert totals["measuredJoules"] == pytest.approx(_joules(now, 5), rel=1e-12)
    assert totals["validTokens"] == pytest.approx(3 * (1000.0 + 500.0))


def test_a_checkpoint_folded_from_a_partial_view_is_rebuilt_from_the_reports():
    spec = handlers._parse(SPEC)
    both = [_report(n, 2) for n in NODES]
    # The old leader folded steps 0-2 while gpu-node-1's report was missing from its view.
    partial = jobloop.JobLoop(spec, 1)
    assert partial.advance(both[:1]) == [0, 1, 2]
    checkpoint = api_status.RLEnergyPolicyStatus.model_validate(_status_of(partial))
    assert checkpoint.totals is not None
    assert checkpoint.totals.measured_joules == pytest.approx(_joules(both[:1], 2))
    now = [_report(n, 5) for n in NODES]
    new = jobloop.JobLoop.restore(spec, 1, checkpoint, now)
    assert new.rebuilt and new.replayed == 3
    assert new.advance(now) == [3, 4, 5]
    assert new.totals().measured_joules == pytest.approx(_joules(now, 5), rel=1e-12)
    assert new.totals().steps == 6 and new.totals().missed_steps == 0
    per_phase = {p.name: p.measured_joules for p in new.phase_status()}
    windows = [(p.phase, p.energy_joules) for rep in now for r in rep.steps for p in r.phases]
    for name in ("generation", "training"):
        assert per_phase[name] == pytest.approx(sum(j or 0.0 for n, j in windows if n == name))
    # A loop that saw every report from the start books the same; restoring again from the new
    # leader's own checkpoint counts nothing twice.
    live = jobloop.JobLoop(spec, 1)
    live.advance(now)
    assert new.totals().measured_joules == pytest.approx(live.totals().measured_joules, rel=1e-12)
    again = jobloop.JobLoop.restore(
        spec, 1, api_status.RLEnergyPolicyStatus.model_validate(_status_of(new)), now
    )
    assert again.advance(now) == [] and again.totals() == new.totals()


def test_a_checkpoint_the_reports_no_longer_hold_stands_as_written():
    spec = handlers._parse(SPEC)
    partial = jobloop.JobLoop(spec, 1)
    partial.advance([_report(NODES[0], 4)])
    checkpoint = api_status.RLEnergyPolicyStatus.model_validate(_status_of(partial))
    assert checkpoint.totals is not None
    written = checkpoint.totals.measured_joules
    # The agents' windows start at step 2 now: steps 0 and 1 cannot be recomputed.
    windowed = [_report(n, 6, first=2) for n in NODES]
    kept = jobloop.JobLoop.restore(spec, 1, checkpoint, windowed)
    assert not kept.rebuilt and kept.account.measured_joules == written
    # Nor when a node's GPUs no longer measure: it would drop out of every step.
    whole_1 = report(_steps(6), node=NODES[1])
    lost = whole_1.model_copy(
        update={"gpus": [g.model_copy(update={"condition": "lost"}) for g in whole_1.gpus]}
    )
    gone = jobloop.JobLoop.restore(spec, 1, checkpoint, [_report(NODES[0], 6), lost])
    assert not gone.rebuilt and gone.account.measured_joules == written
    # With both windows back from step 0, the same checkpoint is rebuilt.
    whole = jobloop.JobLoop.restore(spec, 1, checkpoint, [_report(n, 6) for n in NODES])
    assert whole.rebuilt
    assert whole.account.measured_joules == pytest.approx(
        _joules([_report(n, 6) for n in NODES], 4)
    )
