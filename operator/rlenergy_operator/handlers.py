"""kopf handlers for ``RLEnergyPolicy``: thin ``<kind>_<event>`` functions.

* ``policy_reconcile`` (create, update of spec, resume): validate, ensure the node-agent
  DaemonSet, record ``observedGeneration``, set conditions; resets the in-memory job loop.
* ``policy_loop`` (timer): read the policy's node reports, fold complete steps into the
  job-level EE-RL controller (``jobloop``), publish ``status.plan`` and the accounting; fold
  released rollout workers into ``status.rollout`` and resize the rollout worker set between
  steps (``rollout``, FlexFloor).
* ``policy_delete`` (finalizer): publish a reset plan, wait until every GPU acknowledges the
  reset (or the deadline passes, with a Degraded condition and a Warning event), then remove
  the DaemonSet when no other policy needs it.

The handlers write only ``status`` (through the /status subresource, which kopf detects) and
one finalizer; never the spec, labels or annotations (GitOps). They return None, so kopf
stores no handler results in status. Errors from the library become kopf errors here.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any

import kopf
import pydantic

from rlenergy import errors
from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import nodereport as api_nodereport
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy_operator import (
    builders,
    coverage,
    findings,
    jobloop,
    kube,
    liveness,
    metrics,
    rollout,
    scheduling,
)
from rlenergy_operator import reports as node_reports
from rlenergy_operator import settings as op_settings

CFG = op_settings.OperatorConfig()
RESOURCE = (api_policy.GROUP, api_policy.VERSION, api_policy.PLURAL)
REPORT_RESOURCE = (api_nodereport.GROUP, api_nodereport.VERSION, api_nodereport.PLURAL)

ECHOES = liveness.EchoTracker(CFG.watch_echo_bound_s)
"""Status writes of the job loop waiting for the policy watch to bring them back."""
_CHECKPOINTS: dict[tuple[str, str], int] = {}
"""(namespace, policy) -> the job loop's ``totals.throughStep``: the index drops older records."""


def _now() -> str:
    return (
        datetime.datetime.now(datetime.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


@kopf.on.startup()
def operator_startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Apply the kopf settings (finalizer, status storage, peering, timeouts); serve metrics."""
    op_settings.configure_kopf(settings, CFG)
    metrics.serve(CFG.metrics_port)


def _parse(spec: Any) -> api_policy.RLEnergyPolicySpec:
    return api_policy.parse_policy({"spec": dict(spec)}, require_selector=True)


@kopf.on.probe(id="policy_watch")
def policy_watch_probe(**_: Any) -> str:
    """Liveness: fail while a status write has not come back through the policy watch.

    Raises:
        kopf.PermanentError: a write waited longer than ``watch_echo_bound_s`` (``/healthz``
            then answers 500 and the kubelet restarts the operator).
    """
    overdue = ECHOES.overdue()
    if overdue:
        (ns, name), waited = max(overdue.items(), key=lambda kv: kv[1])
        raise kopf.PermanentError(
            f"policy watch silent: the status written to {ns}/{name} {waited:.0f} s ago never "
            f"came back ({len(overdue)} policies waiting)"
        )
    return "ok"


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
@metrics.counted("policy_reconcile")
def policy_reconcile(
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    body: kopf.Body,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Validate, ensure the node agents, set observedGeneration and conditions."""
    generation = int(meta.get("generation") or 0)
    previous = list(status.get("conditions") or [])
    now = _now()
    memo["loop"] = None  # rebuilt by the next loop pass (restart or new spec)
    try:
        parsed = _parse(spec)
    except errors.InvalidInputError as exc:
        # Admission refuses almost every bad spec; what it cannot check lands here.
        bad = [
            builders.condition(
                "Ready",
                False,
                "InvalidSpec",
                str(exc),
                generation=generation,
                now=now,
                previous=previous,
            ),
            builders.condition(
                "Degraded",
                True,
                "InvalidSpec",
                str(exc),
                generation=generation,
                now=now,
                previous=previous,
            ),
        ]
        patch.status["conditions"] = builders.merge_conditions(previous, bad)
        patch.status["observedGeneration"] = generation
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(exc))
        logger.warning("invalid spec: %s", exc)
        return
    try:
        action = kube.ensure_daemonset(builders.agent_daemonset(CFG))
    except kube.ApiError as exc:
        raise kopf.TemporaryError(
            f"node-agent DaemonSet {CFG.namespace}/{CFG.agent_daemonset_name}: "
            f"{exc.status} {exc.reason}",
            delay=CFG.retry_delay_s,
        ) from exc
    if action != "unchanged":
        logger.info(
            "node-agent DaemonSet %s/%s %s", CFG.namespace, CFG.agent_daemonset_name, action
        )
    conds = [
        builders.condition(
            "Ready",
            True,
            "AgentsDeployed",
            f"spec accepted; node agents: DaemonSet {CFG.namespace}/{CFG.agent_daemonset_name}",
            generation=generation,
            now=now,
            previous=previous,
        )
    ]
    have = {c.get("type") for c in previous}
    if "Progressing" not in have:
        conds.append(
            builders.condition(
                "Progressing",
                True,
                "WaitingForReports",
                "no complete RL step reported yet",
                generation=generation,
                now=now,
            )
        )
    degraded = next((c for c in previous if c.get("type") == "Degraded"), None)
    if degraded is None or degraded.get("reason") == "InvalidSpec":
        conds.append(
            builders.condition(
                "Degraded",
                False,
                "AsExpected",
                "no errors",
                generation=generation,
                now=now,
                previous=previous,
            )
        )
    patch.status["conditions"] = builders.merge_conditions(previous, conds)
    patch.status["observedGeneration"] = generation
    if not status.get("plan"):
        loop = jobloop.JobLoop(parsed, generation)
        patch.status["plan"] = loop.plan(now).model_dump(by_alias=True, exclude_none=True)


@kopf.index(*REPORT_RESOURCE)
def policy_node_reports(
    namespace: str, name: str, meta: kopf.Meta, spec: kopf.Spec, **_: Any
) -> dict[tuple[str, str], node_reports.IndexedReport] | None:
    """Index every node report by (namespace, policy), as the watch delivers it.

    The job loop reads its reports from here instead of listing them each pass
    (``reports.ReportCache``); records already folded into the policy's totals are dropped.
    kopf calls no other handler before the first listing is indexed.
    """
    policy = spec.get("policyName")
    if not policy:
        return None
    key = (namespace, str(policy))
    return {
        key: node_reports.IndexedReport.from_spec(
            name, str(meta.get("resourceVersion") or ""), spec, _CHECKPOINTS.get(key, -1)
        )
    }


@kopf.timer(*RESOURCE, interval=CFG.reconcile_interval_s, idle=None)
@metrics.counted("policy_loop")
def policy_loop(
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    body: kopf.Body,
    namespace: str,
    name: str,
    logger: logging.Logger,
    policy_node_reports: kopf.Index[tuple[str, str], node_reports.IndexedReport] | None = None,
    **_: Any,
) -> None:
    """One pass of the job loop: node reports -> controller -> plan, status.

    Reports come from the ``policy_node_reports`` index (``reports.ReportCache.refresh``); a
    restore after a new spec generation replays every record and GETs the reports whose indexed
    copies were trimmed.
    """
    if meta.get("deletionTimestamp"):
        return
    version = str(meta.get("resourceVersion") or "")
    ECHOES.seen((namespace, name), version)
    generation = int(meta.get("generation") or 0)
    if status.get("observedGeneration") != generation:
        # policy_reconcile has not recorded this generation yet. The timer starts beside the
        # create/update handler; a pass on the older status would write conditions without
        # the Ready that the handler is about to set, and Ready would be lost.
        return
    try:
        parsed = _parse(spec)
    except errors.InvalidInputError:
        return  # policy_reconcile reported it
    loop: jobloop.JobLoop | None = memo.get("loop")
    rebuild = loop is None or loop.generation != generation
    cache = memo.get("reports")
    if cache is None:
        cache = memo["reports"] = node_reports.ReportCache(
            kube.node_report_versions, kube.node_report
        )
    try:
        # Only records after the checkpoint are parsed; a rebuild replays every record.
        after = -1 if rebuild or loop is None else loop.account.through_step
        indexed = (
            None if policy_node_reports is None else policy_node_reports.get((namespace, name), [])
        )
        reports = cache.refresh(namespace, name, after, logger, indexed)
    except kube.ApiError as exc:
        raise kopf.TemporaryError(
            f"listing node reports: {exc.status} {exc.reason}", delay=CFG.retry_delay_s
        ) from exc
    current = api_status.RLEnergyPolicyStatus.model_validate(dict(status))
    if loop is None or loop.generation != generation:
        loop = jobloop.JobLoop.restore(parsed, generation, current, reports)
        memo["loop"] = loop
        logger.info(
            "job loop rebuilt: %d steps replayed from %d node reports, totals through step %d",
            loop.replayed,
            len(reports),
            loop.account.through_step,
        )
    folded = loop.advance(reports)
    _CHECKPOINTS[(namespace, name)] = loop.account.through_step
    old_plan = status.get("plan")
    plan = loop.plan(issued_at=(old_plan or {}).get("issuedAt") or _now())
    plan_changed = builders.plan_changed(old_plan, plan)
    if plan_changed:
        plan = plan.model_copy(update={"issued_at": _now()})
    phases = loop.phase_status()
    nodes = builders.node_summary(reports)
    now = _now()
    previous = list(status.get("conditions") or [])
    prog = (
        builders.progress_condition(phases)
        if loop.controller is not None
        else (True, "WaitingForReports", "no complete RL step with a clock table reported yet")
    )
    # No agent can schedule (policy_agents_check) explains everything else: it goes first;
    # after a restart the last finding stands until the first check (no Degraded flap).
    unschedulable = (
        memo["agents_unschedulable"]
        if "agents_unschedulable" in memo
        else scheduling.last_finding(previous)
    )
    base = builders.degraded_condition(nodes, loop.controller is not None, bool(reports))
    # Some GPU nodes without an agent (policy_agents_check) unless a stronger finding stands.
    deg = unschedulable or (base if base[0] else memo.get("agents_missing") or base)
    conds = builders.merge_conditions(
        previous,
        [
            builders.condition(
                "Progressing",
                prog[0],
                prog[1],
                prog[2],
                generation=generation,
                now=now,
                previous=previous,
            ),
            builders.condition(
                "Degraded",
                deg[0],
                deg[1],
                deg[2],
                generation=generation,
                now=now,
                previous=previous,
            ),
        ],
    )
    new: dict[str, Any] = {
        "plan": plan.model_dump(by_alias=True, exclude_none=True),
        "phases": [p.model_dump(by_alias=True, exclude_none=True) for p in phases],
        "totals": loop.totals().model_dump(by_alias=True, exclude_none=True),
        "nodes": nodes.model_dump(by_alias=True, exclude_none=True),
        "conditions": conds,
    }
    ro = rollout.reconcile(parsed, current.rollout, reports, namespace, now)
    if ro.status is not None:
        new["rollout"] = ro.status.model_dump(by_alias=True, exclude_none=True)
    old = {k: status.get(k) for k in new}
    # Compare first: status-only writes cause watch events (HARNESS section 6, pitfall 4).
    diff = builders.merge_patch(old, new)
    for key, value in diff.items():
        patch.status[key] = value
    if diff:
        ECHOES.wrote((namespace, name), version)
    metrics.policy_pass(
        namespace,
        name,
        nodes.total,
        nodes.ready,
        max((r.last_step for r in reports), default=-1),
        loop.account.through_step,
    )
    if folded:
        logger.info("accounted steps %s; totals through step %d", folded, loop.account.through_step)
    if plan_changed:
        kopf.event(body, type="Normal", reason="PlanChanged", message=builders.describe_plan(plan))
    if ro.event is not None:
        kopf.event(body, type=ro.event[0], reason=ro.event[1], message=ro.event[2])
    posted = memo.setdefault("cross_checks", {})
    for (node, gpu, count), message in findings.cross_check_events(reports, posted):
        kopf.event(body, type="Warning", reason=findings.REASON, message=message)
        posted[(node, gpu)] = count
    if (
        deg[0]
        and next(
            (c for c in previous if c.get("type") == "Degraded" and c.get("status") == "True"), None
        )
        is None
    ):
        kopf.event(body, type="Warning", reason=deg[1], message=deg[2])


_AGENT_CHECK: dict[str, Any] = {
    "at": float("-inf"),
    "found": None,
    "coverage_at": float("-inf"),
    "missing": None,
}
_AGENT_CHECK_LOCK = threading.Lock()


@kopf.timer(*RESOURCE, interval=CFG.agent_check_interval_s, idle=None)
@metrics.counted("policy_agents_check")
def policy_agents_check(meta: kopf.Meta, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Whether the node agents can schedule; what blocks them feeds ``policy_loop``'s Degraded.

    One read of the DaemonSet; only when it schedules no agent, the GPU nodes and their taints.
    """
    if meta.get("deletionTimestamp"):
        return
    with _AGENT_CHECK_LOCK:
        # One DaemonSet serves every policy: one check per interval for all of them.
        if time.monotonic() - _AGENT_CHECK["at"] < CFG.agent_check_interval_s:
            found = _AGENT_CHECK["found"]
        else:
            try:
                ds = kube.read_daemonset(CFG.namespace, CFG.agent_daemonset_name)
                st = (ds or {}).get("status") or {}
                current = int(st.get("observedGeneration") or 0) >= int(
                    ((ds or {}).get("metadata") or {}).get("generation") or 0
                )
                # The nodes only when the controller has seen the template and placed nothing.
                nodes = (
                    kube.labelled_nodes(CFG.agent_gpu_node_label)
                    if ds is not None and current and not int(st.get("desiredNumberScheduled") or 0)
                    else []
                )
            except kube.ApiError as exc:
                logger.warning("agent scheduling check: %s %s", exc.status, exc.reason)
                return  # keep the last finding
            template = builders.agent_daemonset(CFG)["spec"]["template"]["spec"]
            found = scheduling.agents_unschedulable(ds, template.get("tolerations") or [], nodes)
            _AGENT_CHECK.update(at=time.monotonic(), found=found)
            metrics.daemonset(st if ds is not None else None)
            _check_coverage(template, logger)
    if found != memo.get("agents_unschedulable"):
        logger.log(logging.WARNING if found else logging.INFO, "%s", found or "agents schedule")
    memo["agents_unschedulable"] = found
    missing = _AGENT_CHECK["missing"]
    if missing != memo.get("agents_missing"):
        logger.log(logging.WARNING if missing else logging.INFO, "%s", missing or "agents cover")
    memo["agents_missing"] = missing


def _check_coverage(template: dict[str, Any], logger: logging.Logger) -> None:
    """Every ``agent_coverage_interval_s``: which GPU nodes have no agent (all policies)."""
    if time.monotonic() - _AGENT_CHECK["coverage_at"] < CFG.agent_coverage_interval_s:
        return
    try:
        nodes = kube.all_nodes()
    except kube.ApiError as exc:
        logger.warning("agent coverage check: %s %s", exc.status, exc.reason)
        return  # keep the last finding
    cov = coverage.check(
        nodes,
        CFG.agent_gpu_node_label,
        template.get("tolerations") or [],
        template.get("nodeSelector") or {},
    )
    metrics.coverage(len(cov.unlabelled), len(cov.blocked))
    _AGENT_CHECK.update(coverage_at=time.monotonic(), missing=coverage.finding(cov))


@kopf.on.delete(*RESOURCE)
@metrics.counted("policy_delete")
def policy_delete(
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    body: kopf.Body,
    namespace: str,
    name: str,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Hold the finalizer until the GPUs are reset (or the deadline), then clean up."""
    _CHECKPOINTS.pop((namespace, name), None)
    metrics.policy_gone(namespace, name)
    ECHOES.forget((namespace, name))
    generation = int(meta.get("generation") or 0)
    now = _now()
    previous = list(status.get("conditions") or [])
    old_plan = status.get("plan") or {}
    reset = api_node.ClockPlan(
        step=int(old_plan.get("step") or 0),
        policyGeneration=generation,
        enforce=False,
        phases=[
            api_node.PhasePlan(
                phase=p.get("phase", ""),
                clockMHz=None,
                state="fallback",
                reason="policy deleted: reset to default",
            )
            for p in old_plan.get("phases", [])
        ],
        issuedAt=now,
    )
    if old_plan.get("enforce", True) or any(p.get("clockMHz") for p in old_plan.get("phases", [])):
        patch.status["plan"] = reset.model_dump(by_alias=True, exclude_none=True)
    try:
        raw = kube.node_reports(namespace, name)
    except kube.ApiError as exc:
        raise kopf.TemporaryError(
            f"listing node reports: {exc.status} {exc.reason}", delay=2
        ) from exc
    pending = []
    for item in raw:
        try:
            rep = api_node.NodeReport.model_validate(item.get("spec") or {})
        except pydantic.ValidationError:
            continue
        pending += [f"{rep.node_name}/{g.uuid}" for g in rep.gpus if not g.reset_acknowledged]
    deleted = datetime.datetime.fromisoformat(str(meta["deletionTimestamp"]).replace("Z", "+00:00"))
    waited = (datetime.datetime.now(datetime.UTC) - deleted).total_seconds()
    if pending and waited < CFG.reset_deadline_s:
        msg = (
            f"waiting for {len(pending)} GPUs to acknowledge the clock reset "
            f"({waited:.0f}/{CFG.reset_deadline_s:.0f} s)"
        )
        patch.status["conditions"] = builders.merge_conditions(
            previous,
            [
                builders.condition(
                    "Progressing",
                    True,
                    "ResettingClocks",
                    msg,
                    generation=generation,
                    now=now,
                    previous=previous,
                )
            ],
        )
        raise kopf.TemporaryError(msg, delay=min(2.0, CFG.reset_deadline_s))
    if pending:
        msg = (
            f"reset deadline {CFG.reset_deadline_s:.0f} s passed; {len(pending)} GPUs never "
            f"acknowledged the reset (first: {pending[0]}); the finalizer is lifted anyway"
        )
        patch.status["conditions"] = builders.merge_conditions(
            previous,
            [
                builders.condition(
                    "Degraded",
                    True,
                    "ResetDeadlineExceeded",
                    msg,
                    generation=generation,
                    now=now,
                    previous=previous,
                )
            ],
        )
        kopf.event(body, type="Warning", reason="ResetDeadlineExceeded", message=msg)
        logger.warning("%s", msg)
    try:
        others = [p for p in kube.live_policies() if p["metadata"].get("uid") != meta.get("uid")]
        if not others and kube.delete_daemonset(CFG.namespace, CFG.agent_daemonset_name):
            logger.info(
                "no policy left: deleted DaemonSet %s/%s", CFG.namespace, CFG.agent_daemonset_name
            )
    except kube.ApiError as exc:
        raise kopf.TemporaryError(
            f"DaemonSet clean-up: {exc.status} {exc.reason}", delay=2
        ) from exc
