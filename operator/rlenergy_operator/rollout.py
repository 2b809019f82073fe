"""FlexFloor actuation in the operator: ``status.rollout`` and between-steps worker-set resizing.

Where the numbers come from (docs/architecture.md: agents never write the policy, the trainer has
no Kubernetes credentials):

* **released GPU time and occupancy**: each node agent parks a released rollout worker's GPUs
  (``POST /v1/park`` from the worker's SDK) and reports per step ``releasedGpuSeconds`` and,
  per phase window, ``gpuSeconds`` and its parked part. ``fold`` adds every complete step once
  to ``status.rollout`` (``throughStep`` is the restart checkpoint, as ``totals.throughStep``):
  occupied GPU time = generation ``gpuSeconds`` - parked part; tokens per occupied GPU-second =
  the steps' response tokens / occupied GPU time.
* **the desired worker count**: the rollout dispatcher publishes ``nextStepWorkers`` after a
  step through its own node agent (``POST /v1/rollout``); the agent carries it in its node
  report (``spec.rollout``). ``reconcile`` takes the newest publication (highest step) over
  the policy's reports and, with ``releaseAction: scale``, decides once per published step
  (``rlenergy.control.moe.scale.decide_scale``) and patches the worker set's ``/scale``
  subresource (StatefulSet, LeaderWorkerSet). A target below the floor is refused
  (``ShrinkRejected: ... minimum is N``) and the set is left untouched.
* **a RayCluster worker group** (``workerGroupName``) has no ``/scale``: ``reconcile`` reads
  the RayCluster, asks ``decide_group_scale`` which pods to delete (the group's pods whose GPUs
  are all parked in the node reports) and patches the group's ``replicas`` and
  ``scaleStrategy.workersToDelete`` (KubeRay deletes exactly those pods). Fewer released pods
  known than the shrink needs: refused (``WorkersUnknown``), never guessed.
* **the workload's opt-in** (no confused deputy, ``optin``): a worker set whose annotation
  ``rlenergy.io/allow-scale-by`` does not name the policy is never resized; the decision is
  ``ScaleNotAllowed``, the policy ``Degraded`` with how to opt in, re-checked every pass.

Pure: ``layout``, ``floor``, ``newest_dispatch``, ``fold``, ``worker_group``; failed shrink
steps (Degraded, Event, ``status.rollout.failure``): ``rolloutfaults``. I/O (through
``kube``): ``resize``, ``reconcile``. Callers: ``rlenergy_operator.handlers.policy_loop``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from rlenergy import errors
from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.freq import aggregate
from rlenergy.control.moe import base as moe_base
from rlenergy.control.moe import scale
from rlenergy_operator import builders, kube, optin, rolloutfaults

ROLLOUT_PHASE = "generation"
"""The phase whose windows are rollout (occupied GPU time)."""


def layout(spec: api_policy.RolloutSpec) -> moe_base.MoeLayout | None:
    """The planner's memory layout of one rollout worker; ``None`` without workerMemoryBytes.

    Raises:
        InvalidInputError: a worker cannot hold the dense weights and one expert.
    """
    if spec.worker_memory_bytes is None:
        return None
    return moe_base.MoeLayout(
        num_experts=spec.experts.count,
        expert_bytes=spec.experts.bytes_per_expert,
        dense_bytes=spec.dense_bytes,
        kv_bytes_per_token=0,
        worker_memory_bytes=spec.worker_memory_bytes,
        min_active_workers=spec.min_active_workers,
    )


def floor(spec: api_policy.RolloutSpec) -> int | None:
    """Fewest workers a resize may leave (``scale.worker_set_floor``), workers.

    Returns:
        ``None`` without ``workerMemoryBytes`` (the expert floor is then unknown).

    Raises:
        InvalidInputError: a worker cannot hold the dense weights and one expert.
    """
    lay = layout(spec)
    return None if lay is None else scale.worker_set_floor(lay, spec.experts.replicas)


def newest_dispatch(reports: Sequence[api_node.NodeReport]) -> api_node.RolloutDispatch | None:
    """The dispatcher's newest publication over the reports (highest step; ties: node name)."""
    found = [(r.rollout.step, r.node_name, r.rollout) for r in reports if r.rollout is not None]
    if not found:
        return None
    return max(found, key=lambda t: (t[0], t[1]))[2]


def fold(
    previous: api_status.RolloutStatus | None, reports: Sequence[api_node.NodeReport]
) -> api_status.RolloutStatus:
    """Add every complete step after ``previous.throughStep`` to the rollout sums.

    Steps are folded in order and only when complete over the ready nodes
    (``aggregate.step_state``); a lost step moves the checkpoint without adding anything.

    Args:
        previous: the status so far (``None``: nothing folded yet).
        reports: the policy's node reports.

    Returns:
        The sums, ratio and ``throughStep``; ``active``, ``released``, ``parkedGpus`` from the
        newest publication and the reports' GPUs (``floor`` and ``scale`` are left as they
        were: ``reconcile`` sets them).
    """
    prev = previous or api_status.RolloutStatus()
    released_s = prev.released_gpu_seconds
    occupied_s = prev.occupied_gpu_seconds
    tokens = prev.response_tokens
    through = prev.through_step
    for step in aggregate.known_steps(reports):
        if step <= through:
            continue
        state = aggregate.step_state(step, reports)
        if state is aggregate.StepState.PENDING:
            break
        through = step
        if state is aggregate.StepState.LOST:
            continue
        recs = aggregate.records(step, reports)
        released_s += sum(r.released_gpu_seconds for r in recs)
        occupied_s += sum(
            max(w.gpu_seconds - w.released_gpu_seconds, 0.0)
            for r in recs
            for w in r.phases
            if w.phase == ROLLOUT_PHASE
        )
        tokens += max((r.workload.response_tokens for r in recs), default=0.0)
    dispatch = newest_dispatch(reports)
    return prev.model_copy(
        update={
            "active": dispatch.active_workers if dispatch is not None else prev.active,
            "released": dispatch.released_workers if dispatch is not None else prev.released,
            "released_gpu_seconds": released_s,
            "parked_gpus": sum(g.parked for r in reports for g in r.gpus),
            "occupied_gpu_seconds": occupied_s,
            "response_tokens": tokens,
            "tokens_per_occupied_gpu_second": round(tokens / occupied_s, 6)
            if occupied_s > 0
            else None,
            "through_step": through,
        }
    )


@dataclasses.dataclass(frozen=True)
class Result:
    """What one ``reconcile`` pass produced.

    Attributes:
        status: the new ``status.rollout`` (``None``: the policy has no rollout section).
        event: a Kubernetes event to emit (type, reason, message), when a decision was made.
        degraded: (reason, message) of a Degraded condition the policy should show (the worker
            set does not opt in), else ``None``.
    """

    status: api_status.RolloutStatus | None
    event: builders.Event | None = None
    degraded: tuple[str, str] | None = None
    fault_event: builders.Event | None = None


def reconcile(
    spec: api_policy.RLEnergyPolicySpec,
    previous: api_status.RolloutStatus | None,
    reports: Sequence[api_node.NodeReport],
    namespace: str,
    now: str,
    *,
    policy: str,
) -> Result:
    """``resize`` (fold, scale) and the failed shrink steps (``rolloutfaults``).

    ``status.rollout`` gains ``failure`` (the failure that stands), ``reloadedExperts`` and
    ``placementUnbalanced`` (the newest publication); the policy is Degraded with the
    failure's reason (after the worker set's opt-in refusal, which the owner must fix first),
    and ``fault_event`` is a Warning Event for a new failure. Arguments as ``resize``.
    """
    res = resize(spec, previous, reports, namespace, now, policy=policy)
    if res.status is None:
        return res
    dispatch = newest_dispatch(reports)
    fault = rolloutfaults.assess(
        previous.failure if previous is not None else None, dispatch, reports, now
    )
    status = res.status.model_copy(
        update={
            "failure": fault.failure,
            "reloaded_experts": list(dispatch.reloaded_experts) or None if dispatch else None,
            "placement_unbalanced": dispatch is not None and dispatch.placement_unbalanced,
        }
    )
    return dataclasses.replace(
        res, status=status, degraded=res.degraded or fault.degraded, fault_event=fault.event
    )


def resize(
    spec: api_policy.RLEnergyPolicySpec,
    previous: api_status.RolloutStatus | None,
    reports: Sequence[api_node.NodeReport],
    namespace: str,
    now: str,
    *,
    policy: str,
) -> Result:
    """Fold the reports into ``status.rollout`` and, for ``scale``, resize the worker set.

    A resize is decided once per published step (``scale.forStep`` in status); a missing
    worker set, one that does not opt in (``optin``) or an API error is retried at the next
    pass (reason ``WorkerSetNotFound`` / ``ScaleNotAllowed`` / ``ScaleFailed``), never raised.

    Args:
        spec: the validated policy spec.
        previous: ``status.rollout`` now.
        reports: the policy's node reports.
        namespace: the policy's namespace (the worker set's too).
        now: RFC 3339 time for ``scale.decidedAt``.
        policy: the policy's name (the one the worker set's opt-in must name).
    """
    ro = spec.rollout
    if ro is None:
        return Result(None)
    status = fold(previous, reports)
    try:
        minimum = floor(ro)
    except errors.InvalidInputError:
        minimum = None  # admission refuses it; nothing to resize against
    status = status.model_copy(update={"floor": minimum})
    dispatch = newest_dispatch(reports)
    ref = ro.worker_set_ref
    if (
        ro.release_action != "scale"
        or ref is None
        or minimum is None
        or dispatch is None
        or dispatch.next_step_workers is None
    ):
        return Result(_with_active(status))
    for_step = dispatch.step + 1
    desired = dispatch.next_step_workers
    prev = status.scale
    retry = ("WorkerSetNotFound", "ScaleFailed", "WorkersUnknown", optin.REASON)
    if prev is not None and (
        prev.for_step > for_step or (prev.for_step == for_step and prev.reason not in retry)
    ):
        return Result(_with_active(status))

    def decided(
        current: int,
        target: int,
        reason: str,
        message: str,
        workers_to_delete: Sequence[str] | None = None,
    ) -> api_status.ScaleStatus:
        return api_status.ScaleStatus(
            for_step=for_step,
            desired=desired,
            current=current,
            target=target,
            floor=minimum,
            reason=reason,
            message=message,
            workers_to_delete=list(workers_to_delete) if workers_to_delete else None,
            decided_at=now,
        )

    what = f"{ref.kind} {namespace}/{ref.name}"
    if ref.kind == "RayCluster":
        return _reconcile_ray_group(
            status,
            prev,
            decided,
            what,
            namespace,
            ref,
            (for_step, desired, minimum, ro.max_workers),
            reports,
            policy,
        )
    if ref.kind not in kube.SCALE_RESOURCES:
        s = decided(0, 0, "UnsupportedWorkerSet", f"{what}: {ref.kind} cannot be resized")
        return Result(_with_active(status, s), builders.Event("Warning", s.reason, s.message))
    try:
        annotations = kube.worker_set_annotations(ref.kind, namespace, ref.name)
    except kube.ApiError as exc:
        s = decided(0, 0, "ScaleFailed", f"{what}: reading: {exc.status} {exc.reason}")
        return Result(_with_active(status, s))
    if annotations is not None and not optin.allows(annotations, policy):
        return _not_allowed(status, prev, decided, ref, namespace, policy)
    try:
        current = kube.scale_replicas(ref.kind, namespace, ref.name)
    except kube.ApiError as exc:
        s = decided(0, 0, "ScaleFailed", f"{what}: reading /scale: {exc.status} {exc.reason}")
        return Result(_with_active(status, s))
    if current is None:
        s = decided(0, 0, "WorkerSetNotFound", f"{what} not found; retrying")
        return Result(_with_active(status, s))
    d = scale.decide_scale(current, desired, minimum, optin.ceiling(annotations, ro.max_workers))
    if d.action is scale.ScaleAction.RESIZE:
        try:
            kube.set_scale_replicas(ref.kind, namespace, ref.name, d.target)
        except kube.ApiError as exc:
            s = decided(
                current,
                current,
                "ScaleFailed",
                f"{what}: patching /scale: {exc.status} {exc.reason}",
            )
            return Result(_with_active(status, s), builders.Event("Warning", s.reason, s.message))
    s = decided(d.current, d.target, d.reason, f"{what}: {d.message} for step {for_step}")
    if d.action is scale.ScaleAction.NONE:
        return Result(_with_active(status, s))
    kind = "Warning" if d.action is scale.ScaleAction.REFUSED else "Normal"
    return Result(_with_active(status, s), builders.Event(kind, s.reason, s.message))


class _Decided(Protocol):
    def __call__(
        self,
        current: int,
        target: int,
        reason: str,
        message: str,
        workers_to_delete: Sequence[str] | None = None,
    ) -> api_status.ScaleStatus: ...


def worker_group(
    obj: dict[str, Any], group_name: str, namespace: str
) -> tuple[int, scale.WorkerGroup] | None:
    """``(index, group)`` of the worker group ``group_name`` in a RayCluster object, or None."""
    spec = obj.get("spec") or {}
    for i, g in enumerate(spec.get("workerGroupSpecs") or []):
        if g.get("groupName") != group_name:
            continue
        high = g.get("maxReplicas")
        return i, scale.WorkerGroup(
            cluster=str(obj["metadata"]["name"]),
            namespace=namespace,
            group=group_name,
            replicas=int(g.get("replicas") or 0),
            min_replicas=int(g.get("minReplicas") or 0),
            max_replicas=None if high is None else int(high),
            hosts_per_replica=max(int(g.get("numOfHosts") or 1), 1),
            autoscaling=bool(spec.get("enableInTreeAutoscaling")),
            workers_to_delete=tuple(
                str(p) for p in (g.get("scaleStrategy") or {}).get("workersToDelete") or []
            ),
        )
    return None


def _reconcile_ray_group(
    status: api_status.RolloutStatus,
    prev: api_status.ScaleStatus | None,
    decided: _Decided,
    what: str,
    namespace: str,
    ref: api_policy.WorkerSetRef,
    counts: tuple[int, int, int, int],
    reports: Sequence[api_node.NodeReport],
    policy: str,
) -> Result:
    """Resize a RayCluster worker group: ``replicas`` and ``scaleStrategy.workersToDelete``.

    The pods to delete are the group's released workers (``scale.decide_group_scale``: every
    GPU parked in the node reports). ``WorkersUnknown`` (fewer known than the shrink needs) is
    retried at the next pass, as a missing object is, since the parks may reach the reports
    after the publication; its Warning event and status are written once per step. ``counts``:
    (the step decided for, the desired workers, the floor, ``spec.rollout.maxWorkers``).
    """
    for_step, desired, minimum, max_workers = counts
    group_name = ref.worker_group_name or ""
    what = f"{what} worker group {group_name}"
    try:
        obj = kube.ray_cluster(namespace, ref.name)
    except kube.ApiError as exc:
        s = decided(0, 0, "ScaleFailed", f"{what}: reading: {exc.status} {exc.reason}")
        return Result(_with_active(status, s))
    found = None if obj is None else worker_group(obj, group_name, namespace)
    if obj is None or found is None:
        s = decided(0, 0, "WorkerSetNotFound", f"{what} not found; retrying")
        return Result(_with_active(status, s))
    if not optin.allows((obj.get("metadata") or {}).get("annotations"), policy):
        return _not_allowed(status, prev, decided, ref, namespace, policy)
    index, group = found
    gpus = [(g.pod, g.parked) for r in reports for g in r.gpus]
    ceiling = optin.ceiling((obj.get("metadata") or {}).get("annotations"), max_workers)
    g = scale.decide_group_scale(group, desired, minimum, gpus, ceiling)
    d = g.decision
    if d.action is scale.ScaleAction.RESIZE:
        strategy = dict((obj["spec"]["workerGroupSpecs"][index].get("scaleStrategy")) or {})
        strategy["workersToDelete"] = list(g.workers_to_delete)
        try:
            kube.patch_ray_worker_group(
                namespace,
                ref.name,
                str(obj["metadata"].get("resourceVersion", "")),
                index,
                group_name,
                d.target,
                strategy,
            )
        except kube.ApiError as exc:
            s = decided(
                group.replicas,
                group.replicas,
                "ScaleFailed",
                f"{what}: patching: {exc.status} {exc.reason}",
            )
            return Result(_with_active(status, s), builders.Event("Warning", s.reason, s.message))
    s = decided(d.current, d.target, d.reason, f"{what}: {d.message} for step {for_step}", g.chosen)
    if d.action is scale.ScaleAction.NONE:
        return Result(_with_active(status, s))
    if prev is not None and (prev.for_step, prev.reason, prev.message) == (
        s.for_step,
        s.reason,
        s.message,
    ):  # the same WorkersUnknown refusal again: no second event, no new decidedAt
        return Result(_with_active(status, prev))
    kind = "Warning" if d.action is scale.ScaleAction.REFUSED else "Normal"
    return Result(_with_active(status, s), builders.Event(kind, s.reason, s.message))


def _not_allowed(
    status: api_status.RolloutStatus,
    prev: api_status.ScaleStatus | None,
    decided: _Decided,
    ref: api_policy.WorkerSetRef,
    namespace: str,
    policy: str,
) -> Result:
    """``ScaleNotAllowed``: the worker set is left alone; Degraded says how to opt in.

    The same refusal again keeps the stored decision (no new ``decidedAt``, no status write).
    """
    message = optin.refusal(ref.kind, namespace, ref.name, policy)
    s = decided(0, 0, optin.REASON, message)
    if prev is not None and (prev.for_step, prev.reason, prev.message) == (
        s.for_step,
        s.reason,
        s.message,
    ):
        s = prev
    return Result(_with_active(status, s), degraded=(optin.REASON, message))


def _with_active(
    status: api_status.RolloutStatus, decision: api_status.ScaleStatus | None = None
) -> api_status.RolloutStatus:
    """``status`` with ``decision`` as ``scale`` and, after a resize decision, its target active."""
    s = decision or status.scale
    update: dict[str, object] = {"scale": s}
    if s is not None and s.reason in (
        "AboveMaxWorkers",
        "AtTarget",
        "ShrinkBetweenSteps",
        "GrowBetweenSteps",
        "ShrinkRejected",
        "WorkersUnknown",
        "OutsideWorkerGroupBounds",
    ):
        update["active"] = s.target
    return status.model_copy(update=update)
