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

Each handler is I/O and kopf glue over pure modules: ``jobloop`` (plans, accounting),
``loopstatus`` (the loop's status), ``conditions`` (one pass's conditions), ``builders`` and
``scheduling``. State lives in kopf's memo, none in this module, as one typed object per scope:
``OperatorMemo`` (set at start-up, shared by every object's memo copy: the checkpoints the
report index trims by, the agent-scheduling check, the liveness trackers) under
``memo["operator"]``, ``shards.Handover`` (whether this process serves its shard yet, read by
the handlers' ``when`` filters) under ``memo["handover"]``, and ``PolicyMemo`` (per policy:
the job loop, its report cache, the findings it last saw) under ``memo["policy"]``.

With operator shards (``shards``), every policy handler matches only this shard's policies.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from typing import Any, cast

import kopf

from rlenergy import errors
from rlenergy.api import node as api_node
from rlenergy.api import selector as api_selector
from rlenergy.api.v1alpha1 import nodereport as api_nodereport
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy_operator import (
    builders,
    conditions,
    coverage,
    findings,
    jobloop,
    kube,
    liveness,
    loopstatus,
    metrics,
    podnodes,
    rollout,
    scheduling,
    shards,
)
from rlenergy_operator import reports as node_reports
from rlenergy_operator import settings as op_settings

CFG = op_settings.OperatorConfig()
RESOURCE = (api_policy.GROUP, api_policy.VERSION, api_policy.PLURAL)
REPORT_RESOURCE = (api_nodereport.GROUP, api_nodereport.VERSION, api_nodereport.PLURAL)
DAEMONSET = f"{CFG.namespace}/{CFG.agent_daemonset_name}"
SHARD = CFG.layout
HANDOVER_LOG = logging.getLogger("rlenergy_operator.shards")
_owned = shards.when_owned(SHARD)
_served = shards.when_served(SHARD)


@dataclasses.dataclass
class AgentCheck:
    """The last agent-scheduling finding, operator-wide (in the start-up memo).

    One DaemonSet serves every policy, so one check per interval serves them all.
    """

    at: float = float("-inf")
    found: builders.Finding | None = None
    coverage_at: float = float("-inf")
    missing: builders.Finding | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class OperatorMemo:
    """Operator-wide state: set at start-up, shared by every object's memo copy.

    Attributes:
        checkpoints: (namespace, policy) -> the loop's ``totals.throughStep`` (the report
            index drops the records folded up to it).
        agent_check: the last agent-scheduling and coverage findings.
        echoes: status writes waiting for the policy watch to bring them back.
        watch_lag: the API server's versions of the watched objects against the watches'.
    """

    checkpoints: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    agent_check: AgentCheck = dataclasses.field(default_factory=AgentCheck)
    echoes: liveness.EchoTracker = dataclasses.field(default_factory=liveness.EchoTracker)
    watch_lag: liveness.WatchLag = dataclasses.field(default_factory=liveness.WatchLag)


@dataclasses.dataclass
class PolicyMemo:
    """One policy's state (in its own memo copy).

    Attributes:
        loop: the job loop (None: rebuilt by the next pass, after a restart or a new spec).
        reports: the node-report cache the loop reads.
        lagging: (generation, monotonic s of the first pass that saw it unrecorded).
        cross_checks: (node, GPU) -> the energy cross-check mismatch count last posted.
        agents_checked: whether ``policy_agents_check`` has run for this policy.
        agents_unschedulable: its last finding that no agent can schedule.
        agents_missing: its last finding of GPU nodes without an agent.
        pod_nodes: the nodes hosting its pods, whose reports the loop reads (``podnodes``).
        ignored_nodes: nodes whose reports the last pass ignored (none of its pods there).
    """

    loop: jobloop.JobLoop | None = None
    reports: node_reports.ReportCache | None = None
    lagging: tuple[int, float] | None = None
    cross_checks: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    agents_checked: bool = False
    agents_unschedulable: builders.Finding | None = None
    agents_missing: builders.Finding | None = None
    pod_nodes: podnodes.PodNodes | None = None
    ignored_nodes: frozenset[str] = frozenset()


def _shared(memo: kopf.Memo) -> OperatorMemo:
    """The operator-wide state (``operator_startup`` sets it)."""
    return cast(OperatorMemo, memo["operator"])


def _policy(memo: kopf.Memo) -> PolicyMemo:
    """The policy's own state, made on its first use (kopf gives each object a memo copy)."""
    return cast(PolicyMemo, memo.setdefault("policy", PolicyMemo()))


@dataclasses.dataclass(frozen=True)
class _Object:
    """The kopf arguments a pass over one policy object works on."""

    spec: kopf.Spec
    status: kopf.Status
    meta: kopf.Meta
    patch: kopf.Patch
    memo: kopf.Memo
    body: kopf.Body
    logger: kopf.Logger


@dataclasses.dataclass(frozen=True)
class _PassResult:
    """What one loop pass produced, for its log line, metrics and Events (``_after_pass``)."""

    key: tuple[str, str]
    loop: jobloop.JobLoop
    reports: list[api_node.NodeReport]
    folded: list[int]
    out: loopstatus.LoopStatus
    ro: rollout.Result


def _now() -> str:
    return (
        datetime.datetime.now(datetime.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def _pass(meta: kopf.Meta, status: kopf.Status) -> conditions.PassConditions:
    generation = int(meta.get("generation") or 0)
    return conditions.PassConditions(status.get("conditions"), generation=generation, now=_now())


def _dump(model: Any) -> Any:
    return model.model_dump(by_alias=True, exclude_none=True)


def _temporary(
    what: str, exc: kube.ApiError, delay: float = CFG.retry_delay_s
) -> kopf.TemporaryError:
    return kopf.TemporaryError(f"{what}: {exc.status} {exc.reason}", delay=delay)


@kopf.on.startup()
def operator_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Apply the kopf settings (finalizer, status storage, peering, timeouts); serve metrics.

    The global memo gets the operator-wide state (``OperatorMemo``); kopf gives each object a
    shallow copy, so every policy and node report sees the same one.
    """
    op_settings.configure_kopf(settings, CFG)
    metrics.serve(CFG.metrics_port)
    stale_s = 3 * CFG.watch_check_interval_s + 2 * CFG.request_timeout_s
    memo["operator"] = OperatorMemo(
        echoes=liveness.EchoTracker(CFG.watch_echo_bound_s),
        watch_lag=liveness.WatchLag(CFG.watch_echo_bound_s, stale_s),
    )
    memo["handover"] = handover = shards.Handover(timeout_s=CFG.handover_timeout_s)
    if not _handover_read(handover, HANDOVER_LOG):
        threading.Thread(
            target=_await_handover,
            args=(handover, HANDOVER_LOG),
            name="shard-handover",
            daemon=True,
        ).start()


def _handover_read(handover: shards.Handover, logger: logging.Logger | kopf.Logger) -> bool:
    """One read of the peering objects (``shards.Handover.observe``); whether this serves now.

    Once it serves, it hands this shard's policies over from any layout gone (``_adopt``).
    A failed read serves nothing yet.
    """
    try:
        peerings = kube.peering_objects(CFG.served_namespaces)
    except kube.ApiError as exc:
        logger.warning("shard hand-over: peering objects unreadable: %s %s", exc.status, exc.reason)
        return False
    waited_for = handover.waiting_for
    others = shards.other_layouts(SHARD, CFG.peering_name, peerings, _utcnow())
    if not handover.observe(others, time.monotonic()):
        if handover.waiting_for != waited_for:
            logger.warning(
                "shard hand-over: waiting for the pods of another shard layout to exit (live "
                "peers in %s) before serving shard %d of %d",
                ", ".join(handover.waiting_for), SHARD.index, SHARD.count,
            )  # fmt: skip
        return False
    if handover.timed_out:
        logger.warning(
            "shard hand-over: %s still live after %.0f s: serving shard %d of %d anyway",
            ", ".join(waited_for), handover.timeout_s, SHARD.index, SHARD.count,
        )  # fmt: skip
    _adopt(logger)
    logger.info("shard hand-over: serving shard %d of %d", SHARD.index, SHARD.count)
    return True


def _await_handover(handover: shards.Handover, logger: logging.Logger | kopf.Logger) -> None:
    """Read the peering objects every ``handover_check_interval_s`` until this serves."""
    while not _handover_read(handover, logger):
        time.sleep(CFG.handover_check_interval_s)


def _adopt(logger: logging.Logger | kopf.Logger) -> None:
    """Hand this shard's policies their finalizer from any layout that is gone.

    Run once this process serves: a finalizer of another layout (``shards.adoption_patch``)
    would otherwise stay on the policy after its pods left, and a deleted policy would wait
    for it for ever. A policy that cannot be patched now is logged; its deletion then needs
    that finalizer removed by hand.
    """
    own = shards.finalizer_of(op_settings.FINALIZER, SHARD)
    try:
        policies = kube.live_policies(CFG.served_namespaces)
    except kube.ApiError as exc:
        logger.warning("shard hand-over: policies unreadable: %s %s", exc.status, exc.reason)
        return
    for p in policies:
        meta = p.get("metadata") or {}
        ns, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        ops = shards.adoption_patch(meta.get("finalizers") or [], op_settings.FINALIZER, own)
        if not ops or not SHARD.owns(ns, name):
            continue
        try:
            kube.json_patch_policy(ns, name, ops)
        except kube.ApiError as exc:
            logger.warning(
                "shard hand-over: the finalizers of %s/%s not handed over: %s %s",
                ns, name, exc.status, exc.reason,
            )  # fmt: skip


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _parse(spec: Any) -> api_policy.RLEnergyPolicySpec:
    return api_policy.parse_policy({"spec": dict(spec)}, require_selector=True)


@kopf.on.probe(id="policy_watch")
def policy_watch_probe(memo: kopf.Memo, **_: Any) -> str:
    """Liveness: fail while the watches do not deliver what the API server has.

    Not while the API server is unreachable (``liveness.WatchLag``: a restart would not help).

    Raises:
        kopf.PermanentError: a status write has not come back through the policy watch, or
            an object listed by the API server has not been delivered at that version, for
            longer than ``watch_echo_bound_s`` (``/healthz`` then answers 500 and the kubelet
            restarts the operator).
    """
    overdue = _shared(memo).echoes.overdue()
    if overdue:
        key, waited = max(overdue.items(), key=lambda kv: kv[1])
        ns, name = cast(tuple[str, str], key)
        raise kopf.PermanentError(
            f"policy watch silent: the status written to {ns}/{name} {waited:.0f} s ago never "
            f"came back ({len(overdue)} policies waiting)"
        )
    silent = _shared(memo).watch_lag.silent()
    if silent:
        (plural, ns, name), waited = max(silent.items(), key=lambda kv: kv[1])
        raise kopf.PermanentError(
            f"watches silent: the API server has had {plural} {ns}/{name} for {waited:.0f} s "
            f"at a version the watch never delivered ({len(silent)} objects waiting)"
        )
    return "ok"


@kopf.timer(*RESOURCE, interval=CFG.watch_check_interval_s, idle=None, when=_owned)
def policy_watch_check(*, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """The API server's versions of the watched objects, for the probe (``liveness.WatchLag``).

    One metadata-only read per kind every ``watch_check_interval_s`` serves every policy, and
    never two at once (``WatchLag.due``); a failed read (API server unreachable) judges nothing.
    """
    lag = _shared(memo).watch_lag
    if not shards.serving(memo) or not lag.due(0.9 * CFG.watch_check_interval_s):
        return
    started_s = lag.now()
    try:
        versions = kube.watched_versions(
            CFG.served_namespaces, CFG.request_timeout_s, SHARD.report_selector()
        )
    except kube.ApiError as exc:
        logger.info("watch check: API server read failed: %s %s", exc.status, exc.reason)
        lag.unreachable()
        return
    except BaseException:
        lag.unreachable()  # the read ended: the next one may start
        raise
    # Another shard's policies never reach this shard's handlers, nor its reports its watch:
    # only what this shard's watches should deliver is judged.
    lag.listed(
        {k: v for k, v in versions.items() if k[0] != api_policy.PLURAL or SHARD.owns(k[1], k[2])},
        started_s,
    )


@kopf.on.resume(*RESOURCE, when=_served)
@kopf.on.create(*RESOURCE, when=_served)
@kopf.on.update(*RESOURCE, field="spec", when=_served)
@metrics.counted("policy_reconcile")
def policy_reconcile(
    *,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    patch: kopf.Patch,
    memo: kopf.Memo,
    body: kopf.Body,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Validate, ensure the node agents, set observedGeneration, conditions, the first plan."""
    _reconcile(_Object(spec, status, meta, patch, memo, body, logger))


def _reconcile(obj: _Object) -> None:
    """``policy_reconcile``'s work; also run by ``policy_loop`` when no change handler ran.

    Raises:
        kopf.TemporaryError: the node-agent DaemonSet could not be read or written.
    """
    spec, status, patch, body, logger = obj.spec, obj.status, obj.patch, obj.body, obj.logger
    conds = _pass(obj.meta, status)
    _policy(obj.memo).loop = None  # rebuilt by the next loop pass (restart or new spec)
    try:
        parsed = _parse(spec)
    except errors.InvalidInputError as exc:
        # Admission refuses almost every bad spec; what it cannot check lands here.
        conditions.invalid_spec(conds, str(exc))
        patch.status["conditions"] = conds.merged()
        patch.status["observedGeneration"] = conds.generation
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(exc))
        logger.warning("invalid spec: %s", exc)
        return
    try:
        action = kube.ensure_daemonset(builders.agent_daemonset(CFG))
    except kube.ApiError as exc:
        raise _temporary(f"node-agent DaemonSet {DAEMONSET}", exc) from exc
    if action != "unchanged":
        logger.info("node-agent DaemonSet %s %s", DAEMONSET, action)
    conditions.accepted(conds, DAEMONSET)
    patch.status["conditions"] = conds.merged()
    patch.status["observedGeneration"] = conds.generation
    if not status.get("plan"):
        patch.status["plan"] = _dump(jobloop.first_plan(parsed, conds.generation, conds.now))


@kopf.index(*REPORT_RESOURCE)
def policy_node_reports(
    *, namespace: str | None, name: str, meta: kopf.Meta, spec: kopf.Spec, memo: kopf.Memo, **_: Any
) -> dict[tuple[str, str], node_reports.IndexedReport] | None:
    """Index every node report by (namespace, policy), as the watch delivers it.

    The job loop reads its reports from here instead of listing them each pass
    (``reports.ReportCache``); records already folded into the policy's totals are dropped.
    kopf calls no other handler before the first listing is indexed.
    """
    version = str(meta.get("resourceVersion") or "")
    shared = _shared(memo)
    shared.watch_lag.delivered((api_nodereport.PLURAL, str(namespace), name), version)
    policy = spec.get("policyName")
    if not policy or not SHARD.owns(str(namespace), str(policy)):
        return None  # another shard's policy: not held here
    key = (str(namespace), str(policy))
    after = shared.checkpoints.get(key, -1)
    return {key: node_reports.IndexedReport.from_spec(name, version, spec, after)}


def _fold(
    memo: kopf.Memo,
    parsed: api_policy.RLEnergyPolicySpec,
    generation: int,
    current: api_status.RLEnergyPolicyStatus,
    key: tuple[str, str],
    logger: kopf.Logger,
    indexed: kopf.Index[tuple[str, str], node_reports.IndexedReport] | None,
) -> tuple[jobloop.JobLoop, list[api_node.NodeReport], list[int]]:
    """The policy's job loop (rebuilt after a restart or a new generation) over its reports.

    Reports come from the ``policy_node_reports`` index (``reports.ReportCache.refresh``); a
    rebuild replays the records the reports hold (not the folded ones: ``_not_behind``) and
    GETs the reports whose indexed copies were trimmed. Returns the loop, the reports and the
    steps folded in this pass.
    """
    pm = _policy(memo)
    loop = pm.loop if pm.loop is not None and pm.loop.generation == generation else None
    if pm.reports is None:
        pm.reports = node_reports.ReportCache(kube.node_report_versions, kube.node_report)
    after = -1 if loop is None else loop.account.through_step  # records after the checkpoint
    got = None if indexed is None else indexed.get(key, ())
    try:
        fresh = pm.reports.refresh(*key, after, logger, got)
        reports = _from_pod_nodes(pm, parsed, key[0], fresh, logger)
    except kube.ApiError as exc:
        raise _temporary("listing node reports or the policy's pods", exc) from exc
    _not_behind(pm, loop, current, reports)
    if loop is None:
        loop = pm.loop = jobloop.JobLoop.restore(parsed, generation, current, reports)
        logger.info(
            "job loop rebuilt: %d steps replayed from %d node reports (%d the index lacked so "
            "far), totals through step %d (measured totals %s)",
            loop.replayed, len(reports), pm.reports.completed, loop.account.through_step,
            "recomputed from the reports" if loop.rebuilt else "from the status checkpoint",
        )  # fmt: skip
    folded = loop.advance(reports)
    _shared(memo).checkpoints[key] = loop.account.through_step
    return loop, reports, folded


def _not_behind(
    pm: PolicyMemo, loop: jobloop.JobLoop | None, current: api_status.RLEnergyPolicyStatus,
    reports: list[api_node.NodeReport],
) -> None:  # fmt: skip
    """Refuse to fold from a checkpoint older than one the agents read.

    An agent leaves out the records up to the ``totals.throughStep`` it read from the API
    server (``api_node.unfolded_steps``) and says so in ``foldedThroughStep``. A replica whose
    checkpoint (its loop's, else the status it was handed) is older, a status its watch has
    not delivered yet, would fold the steps between from reports that no longer hold them;
    the pass waits instead, and the loop is rebuilt from the newer status.

    Raises:
        kopf.TemporaryError: a report was pruned past this replica's checkpoint.
    """
    ahead = max((r.folded_through_step for r in reports), default=-1)
    if loop is not None:
        mark = loop.account.through_step
    else:
        mark = current.totals.through_step if current.totals is not None else -1
    if ahead > mark:
        pm.loop = None
        raise kopf.TemporaryError(
            f"node reports were pruned through step {ahead}, past this replica's checkpoint "
            f"{mark}: waiting for the newer status",
            delay=CFG.retry_delay_s,
        )


def _from_pod_nodes(
    pm: PolicyMemo, parsed: api_policy.RLEnergyPolicySpec, namespace: str,
    reports: list[api_node.NodeReport], logger: kopf.Logger,
) -> list[api_node.NodeReport]:  # fmt: skip
    """The reports of the nodes that host the policy's pods (``podnodes``).

    The other reports' nodes go to ``pm.ignored_nodes``; those the pass before did not ignore
    are logged once. A malformed selector reads no report (``policy_reconcile`` reports it).

    Raises:
        kube.ApiError: the pods could not be listed.
    """
    if parsed.selector is None:
        return reports
    if pm.pod_nodes is None:
        pm.pod_nodes = podnodes.PodNodes(kube.pods, time.monotonic)
    try:
        nodes = pm.pod_nodes.nodes(namespace, parsed.selector, (r.node_name for r in reports))
    except api_selector.InvalidSelectorError:
        return []
    kept, ignored = podnodes.from_hosting_nodes(reports, nodes)
    new = sorted(set(ignored) - pm.ignored_nodes)
    pm.ignored_nodes = frozenset(ignored)
    if new:
        logger.warning(
            "ignoring the node reports of %s: no pod of this policy runs there (the agent "
            "of a node reports only for the policy of its own pods)",
            ", ".join(new),
        )
    return kept


def _delivered(memo: kopf.Memo, key: tuple[str, str], version: str) -> None:
    """The policy watch brought ``key`` at ``version`` (what the liveness probe compares)."""
    shared = _shared(memo)
    shared.watch_lag.delivered((api_policy.PLURAL, *key), version)
    shared.echoes.seen(key, version)


@kopf.timer(*RESOURCE, interval=CFG.reconcile_interval_s, idle=None, when=_owned)
@metrics.counted("policy_loop")
def policy_loop(
    *,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    logger: kopf.Logger,
    policy_node_reports: kopf.Index[tuple[str, str], node_reports.IndexedReport] | None = None,
    **_: Any,
) -> None:
    """One pass of the job loop: node reports -> controller -> plan, status.

    Not before ``policy_reconcile`` recorded this generation: kopf runs timers beside change
    handlers, and a pass on the older status would drop the Ready it is about to set.
    """
    key, version = (str(namespace), name), str(meta.get("resourceVersion") or "")
    _delivered(memo, key, version)
    if meta.get("deletionTimestamp") or not shards.serving(memo):
        return
    conds = _pass(meta, status)
    if not _recorded(_Object(spec, status, meta, patch, memo, body, logger)):
        return
    try:
        parsed = _parse(spec)
    except errors.InvalidInputError:
        return  # policy_reconcile reported it
    current = api_status.RLEnergyPolicyStatus.model_validate(dict(status))
    loop, reports, folded = _fold(
        memo, parsed, conds.generation, current, key, logger, policy_node_reports
    )
    ro = rollout.reconcile(parsed, current.rollout, reports, key[0], conds.now, policy=name)
    out = loopstatus.assemble(loop, reports, status.get("plan"), conds, *_findings(memo, conds, ro))
    new = dict(out.fields) | ({} if ro.status is None else {"rollout": _dump(ro.status)})
    if _write_status(patch, status, new):
        _shared(memo).echoes.wrote(key, version)
    _after_pass(_PassResult(key, loop, reports, folded, out, ro), memo, body, logger)


def _recorded(obj: _Object) -> bool:
    """True when status records this generation; else reconcile once it lagged long enough.

    A generation unrecorded for ``reconcile_catchup_s`` (monotonic) is reconciled here (the
    pass then ends). ``PolicyMemo.lagging`` keeps (generation, first pass that saw it
    unrecorded, s); kopf runs timers beside change handlers, so a shorter lag is a change
    handler at work.
    """
    generation = int(obj.meta.get("generation") or 0)
    if obj.status.get("observedGeneration") == generation:
        return True
    now_s = time.monotonic()
    pm = _policy(obj.memo)
    lagging = pm.lagging
    if lagging is None or lagging[0] != generation:
        pm.lagging = (generation, now_s)
        return False
    waited_s = now_s - lagging[1]
    if waited_s < CFG.reconcile_catchup_s:
        return False
    obj.logger.warning(
        "generation %d not reconciled %.0f s after the loop first saw it (no change handler "
        "ran in this replica): reconciling it from the job loop",
        generation,
        waited_s,
    )
    pm.lagging = (generation, now_s)
    _reconcile(obj)
    return False


def _findings(
    memo: kopf.Memo, conds: conditions.PassConditions, ro: rollout.Result
) -> tuple[builders.Finding | None, builders.Finding | None]:
    """(what no agent can do, GPU nodes without an agent) for the pass's Degraded.

    The first is ``policy_agents_check``'s scheduling finding (after a restart the last one
    stands until the first check: no flap), else a worker set that does not opt in to scaling
    (``rollout``, opt-in): both are what the policy's owner has to act on.
    """
    pm = _policy(memo)
    unschedulable = (
        pm.agents_unschedulable if pm.agents_checked else scheduling.last_finding(conds.previous)
    )
    refused = None if ro.degraded is None else builders.Finding(True, *ro.degraded)
    return unschedulable or refused, pm.agents_missing


def _write_status(patch: kopf.Patch, status: kopf.Status, new: dict[str, Any]) -> bool:
    """Patch the fields of ``new`` that differ from ``status``; whether any did.

    Compare first: status-only writes cause watch events.
    """
    diff = builders.merge_patch({k: status.get(k) for k in new}, new)
    patch.status.update(diff)
    return bool(diff)


def _cross_check_events(
    memo: kopf.Memo, body: kopf.Body, reports: list[api_node.NodeReport]
) -> None:
    """A Warning per new energy cross-check finding (``findings``), once per GPU and count."""
    posted = _policy(memo).cross_checks
    for (node, gpu, count), message in findings.cross_check_events(reports, posted):
        kopf.event(body, type="Warning", reason=findings.REASON, message=message)
        posted[(node, gpu)] = count


def _after_pass(done: _PassResult, memo: kopf.Memo, body: kopf.Body, logger: kopf.Logger) -> None:
    """The log line, metrics and Events of one pass (plan, rollout, Degraded, cross-checks)."""
    through = done.loop.account.through_step
    if done.folded:
        logger.info("accounted steps %s; totals through step %d", done.folded, through)
    newest = max((r.last_step for r in done.reports), default=-1)
    out = done.out
    metrics.policy_pass(*done.key, out.nodes.total, out.nodes.ready, newest, through)
    if out.plan_changed:
        message = builders.describe_plan(out.plan)
        kopf.event(body, type="Normal", reason="PlanChanged", message=message)
    deg = out.degraded
    for e in (done.ro.event, done.ro.fault_event):
        if e is not None and not (
            out.degraded_now and (deg.reason, deg.message) == (e.reason, e.message)
        ):
            kopf.event(body, type=e.type, reason=e.reason, message=e.message)
    _cross_check_events(memo, body, done.reports)
    if out.degraded_now:
        kopf.event(body, type="Warning", reason=deg.reason, message=deg.message)


def _agents_finding(check: AgentCheck, logger: kopf.Logger) -> builders.Finding | None:
    """Degraded from one read of the DaemonSet (``scheduling.agents_unschedulable``).

    The GPU nodes are read only when the controller has seen the template and placed nothing.

    Raises:
        rlenergy_operator.kube.ApiError: a read failed.
    """
    ds = kube.read_daemonset(CFG.namespace, CFG.agent_daemonset_name)
    st = (ds or {}).get("status") or {}
    seen = int(st.get("observedGeneration") or 0) >= int(
        ((ds or {}).get("metadata") or {}).get("generation") or 0
    )
    nodes = (
        kube.labelled_nodes(CFG.agent_gpu_node_label)
        if ds is not None and seen and not int(st.get("desiredNumberScheduled") or 0)
        else []
    )
    template = builders.agent_daemonset(CFG)["spec"]["template"]["spec"]
    found = scheduling.agents_unschedulable(ds, template.get("tolerations") or [], nodes)
    metrics.daemonset(st if ds is not None else None)
    _check_coverage(check, template, logger)
    return found


def _check_coverage(check: AgentCheck, template: dict[str, Any], logger: kopf.Logger) -> None:
    """Every ``agent_coverage_interval_s``: which GPU nodes have no agent (all policies)."""
    if time.monotonic() - check.coverage_at < CFG.agent_coverage_interval_s:
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
    check.coverage_at, check.missing = time.monotonic(), coverage.finding(cov)


@kopf.timer(*RESOURCE, interval=CFG.agent_check_interval_s, idle=None, when=_owned)
@metrics.counted("policy_agents_check")
def policy_agents_check(*, meta: kopf.Meta, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Whether the node agents can schedule; what blocks them feeds ``policy_loop``'s Degraded.

    One check per interval serves every policy (``AgentCheck`` in the start-up memo). A
    policy whose timer fires while another policy's timer is reading takes the last finding
    instead of waiting: waiting parked one handler thread per policy on the lock while the
    reads were slow (``bench/scale.py``, 250 nodes: 11-15 of the 16 threads), and the node
    reports' index and the job-loop passes queued behind them.
    """
    if meta.get("deletionTimestamp") or not shards.serving(memo):
        return
    check = _shared(memo).agent_check
    if check.lock.acquire(blocking=False):
        try:
            if time.monotonic() - check.at >= CFG.agent_check_interval_s:
                try:
                    check.found = _agents_finding(check, logger)
                except kube.ApiError as exc:
                    logger.warning("agent scheduling check: %s %s", exc.status, exc.reason)
                    return  # keep the last finding
                check.at = time.monotonic()
        finally:
            check.lock.release()
    pm = _policy(memo)
    for before, found, fine in (
        (pm.agents_unschedulable, check.found, "agents schedule"),
        (pm.agents_missing, check.missing, "agents cover"),
    ):
        if found != before:
            logger.log(logging.WARNING if found else logging.INFO, "%s", found or fine)
    pm.agents_checked = True
    pm.agents_unschedulable, pm.agents_missing = check.found, check.missing


def _unacknowledged(namespace: str, name: str) -> list[str]:
    try:
        raw = kube.node_reports(namespace, name)
    except kube.ApiError as exc:
        raise _temporary("listing node reports", exc, delay=2) from exc
    return builders.unacknowledged_resets(raw)


def _delete_daemonset_if_last(meta: kopf.Meta, logger: kopf.Logger) -> None:
    try:
        others = [
            p
            for p in kube.live_policies(CFG.served_namespaces)
            if p["metadata"].get("uid") != meta.get("uid")
        ]
        if not others and kube.delete_daemonset(CFG.namespace, CFG.agent_daemonset_name):
            logger.info("no policy left: deleted DaemonSet %s", DAEMONSET)
    except kube.ApiError as exc:
        raise _temporary("DaemonSet clean-up", exc, delay=2) from exc


@kopf.on.delete(*RESOURCE, when=_served)
@metrics.counted("policy_delete")
def policy_delete(
    *,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Hold the finalizer until the GPUs are reset (or the deadline), then clean up."""
    shared = _shared(memo)
    shared.checkpoints.pop((str(namespace), name), None)
    metrics.policy_gone(str(namespace), name)
    shared.echoes.forget((str(namespace), name))
    conds = _pass(meta, status)
    reset = jobloop.reset_plan(status.get("plan") or {}, conds.generation, conds.now)
    if reset is not None:
        patch.status["plan"] = _dump(reset)
    pending = _unacknowledged(str(namespace), name)
    deleted = datetime.datetime.fromisoformat(str(meta["deletionTimestamp"]).replace("Z", "+00:00"))
    waited = (datetime.datetime.now(datetime.UTC) - deleted).total_seconds()
    if pending and waited < CFG.reset_deadline_s:
        msg = builders.reset_wait_message(len(pending), waited, CFG.reset_deadline_s)
        conds.condition("Progressing", True, "ResettingClocks", msg)
        patch.status["conditions"] = conds.merged()
        raise kopf.TemporaryError(msg, delay=min(2.0, CFG.reset_deadline_s))
    if pending:
        msg = builders.reset_deadline_message(pending, CFG.reset_deadline_s)
        conds.condition("Degraded", True, "ResetDeadlineExceeded", msg)
        patch.status["conditions"] = conds.merged()
        kopf.event(body, type="Warning", reason="ResetDeadlineExceeded", message=msg)
        logger.warning("%s", msg)
    _delete_daemonset_if_last(meta, logger)
