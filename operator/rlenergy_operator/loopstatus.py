"""The status one job-loop pass publishes: plan, phases, totals, nodes and conditions.

Pure (no kopf, no Kubernetes client, time passed in): ``handlers.policy_loop`` folds the node
reports into its ``jobloop.JobLoop`` and hands the loop here; what comes back is written into
``status`` as a merge patch against what is there, plus the events the pass raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy_operator import builders, conditions, jobloop


@dataclasses.dataclass(frozen=True)
class LoopStatus:
    """What one pass publishes.

    Attributes:
        fields: the ``status`` fields of the pass (camelCase, JSON-ready): ``plan``,
            ``phases``, ``totals``, ``nodes`` and ``conditions``.
        plan: the plan published for the next step.
        plan_changed: a phase's clock or state differs from the published plan (an Event).
        degraded: (status, reason, message) of Degraded.
        degraded_now: Degraded turned True, or changed its reason while True, in this pass (a
            Warning Event).
        nodes: the node summary of the pass (also in ``fields``).
    """

    fields: dict[str, Any]
    plan: api_node.ClockPlan
    plan_changed: bool
    degraded: builders.Finding
    degraded_now: bool
    nodes: api_status.NodesStatus


def _dump(model: Any) -> Any:
    return model.model_dump(by_alias=True, exclude_none=True)


def assemble(
    loop: jobloop.JobLoop,
    reports: Sequence[api_node.NodeReport],
    published_plan: Mapping[str, Any] | None,
    conds: conditions.PassConditions,
    unschedulable: builders.Finding | None,
    missing: builders.Finding | None = None,
) -> LoopStatus:
    """The status of one pass after ``loop`` folded ``reports``.

    Args:
        loop: the policy's job loop, advanced over ``reports``.
        reports: the policy's node reports.
        published_plan: ``status.plan`` as read (camelCase; None: none yet). Its ``issuedAt``
            stays unless a phase's clock or state changes.
        conds: the pass's conditions (``conds.now`` stamps a changed plan).
        unschedulable: Degraded from ``policy_agents_check`` (no agent can schedule), which
            explains everything else and goes first; None when the agents schedule.
        missing: Degraded for GPU nodes without an agent (``coverage.finding``), used when no
            node or clock-table finding stands; None when every GPU node has an agent.
    """
    plan = loop.plan(issued_at=(published_plan or {}).get("issuedAt") or conds.now)
    plan_changed = builders.plan_changed(published_plan, plan)
    if plan_changed:
        plan = plan.model_copy(update={"issued_at": conds.now})
    phases = loop.phase_status()
    nodes = builders.node_summary(reports)
    has_table = loop.controller is not None
    prog = (
        builders.progress_condition(phases)
        if has_table
        else builders.Finding(
            True, "WaitingForReports", "no complete RL step with a clock table reported yet"
        )
    )
    base = builders.degraded_condition(nodes, has_table, bool(reports))
    deg = unschedulable or (base if base.status else missing or base)
    conds.condition("Progressing", *prog)
    conds.condition("Degraded", *deg)
    conds.condition("RolloutStalled", *builders.stall_condition(reports))
    fields = {
        "plan": _dump(plan),
        "phases": [_dump(p) for p in phases],
        "totals": _dump(loop.totals()),
        "nodes": _dump(nodes),
        "conditions": conds.merged(),
    }
    # A Warning Event when Degraded turns True, and when a True Degraded changes its reason
    # (AgentsMissing found first, then AgentsUnschedulable once the DaemonSet placed nothing).
    before = conds.previous_of("Degraded") or {}
    degraded_now = deg.status and (
        not conds.was_true("Degraded") or before.get("reason") != deg.reason
    )
    return LoopStatus(fields, plan, plan_changed, deg, degraded_now, nodes)
