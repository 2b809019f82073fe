"""Between-steps resizing of a disaggregated rollout worker set (``releaseAction: scale``).

Pure decisions for the operator's rollout handler (``rlenergy_operator.rollout``): the dispatcher
publishes how many rollout workers the next RL step needs; the operator asks ``decide_scale``
whether and how to resize the worker set (StatefulSet or LeaderWorkerSet ``/scale`` subresource) and
applies only a ``resize``. The floor is the planner's own (``base.MoeLayout.release_floor``:
``max(expert floor, minActiveWorkers)``), raised to the expert replica count, so a shrink never
leaves an expert without a host (docs/troubleshooting.md, "Shrinking expert parallelism below
the floor": a target below the minimum is refused with ``minimum is N`` and the set stays
untouched).

A KubeRay ``RayCluster`` worker group has no ``/scale``: ``decide_group_scale`` adds to
``decide_scale`` which pods a shrink deletes (``scaleStrategy.workersToDelete``). Only the
group's released workers are named: its pods whose GPUs are all parked in the node reports.
When fewer are known than the shrink needs, the shrink is refused (``WorkersUnknown``), never
filled with a guess.

Callers: ``rlenergy_operator.rollout``, ``tests/unit/control/moe``.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable

from rlenergy import errors
from rlenergy.control.moe import base


def worker_set_floor(layout: base.MoeLayout, expert_replicas: int = 1) -> int:
    """Fewest rollout workers a resize may leave.

    ``max(layout.release_floor(), expert_replicas, ceil(E x replicas / slots per worker))``:
    the planner's floor (every expert held once, ``minActiveWorkers``), and with
    ``expert_replicas`` > 1 every replica of an expert on a distinct worker.

    Args:
        layout: the group's memory layout (experts, bytes per expert, dense bytes, memory per
            worker, ``minActiveWorkers``).
        expert_replicas: replicas every expert must keep (the policy's
            ``rollout.experts.replicas``), >= 1.

    Returns:
        The floor, workers (>= 1).

    Raises:
        InvalidInputError: ``expert_replicas < 1``, or a worker cannot hold one expert.
    """
    if expert_replicas < 1:
        raise errors.InvalidInputError(
            "rollout.experts.replicas", f"must be >= 1, got {expert_replicas}"
        )
    slots = layout.expert_slots_per_worker
    replicated = base.expert_floor(layout.num_experts * expert_replicas, slots)
    return max(layout.release_floor(), expert_replicas, replicated)


class ScaleAction(enum.Enum):
    """What the operator does with the worker set."""

    NONE = "none"
    """Already at the target (or nothing asked)."""
    RESIZE = "resize"
    """Set the replicas to ``ScaleDecision.target`` (``/scale``; a RayCluster group's
    ``replicas`` with ``workersToDelete``)."""
    REFUSED = "refused"
    """The target is below the floor: the set stays as it is."""


@dataclasses.dataclass(frozen=True)
class ScaleDecision:
    """The outcome of ``decide_scale``.

    Attributes:
        action: none, resize or refused.
        current: replicas now, workers.
        target: replicas after the action, workers (``current`` unless ``RESIZE``).
        floor: the floor used, workers.
        reason: CamelCase reason (``AtTarget``, ``ShrinkBetweenSteps``, ``GrowBetweenSteps``,
            ``ShrinkRejected``, ``AboveMaxWorkers``; a RayCluster group also ``WorkersUnknown``,
            ``OutsideWorkerGroupBounds``, ``UnsupportedWorkerSet``).
        message: for humans; a refusal says ``minimum is N`` and why.
    """

    action: ScaleAction
    current: int
    target: int
    floor: int
    reason: str
    message: str


def decide_scale(
    current: int, desired: int, floor: int, ceiling: int | None = None
) -> ScaleDecision:
    """Decide a between-steps resize of a worker set from ``current`` to ``desired`` workers.

    A shrink below ``floor`` is refused whole (never clamped: the dispatcher planned its step
    for ``desired`` workers, and a different size would surprise it); the set keeps
    ``current`` workers. Growing past ``ceiling`` is refused whole the same way
    (``AboveMaxWorkers``): the dispatcher's count is a trainer's word, the ceiling the policy's
    and the workload owner's. ``desired == current`` does nothing.

    Args:
        current: replicas of the worker set now, >= 0.
        desired: replicas the dispatcher asks for the next step, >= 1.
        floor: ``worker_set_floor`` of the policy, >= 1.
        ceiling: most workers the set may have (``spec.rollout.maxWorkers``, lowered by the
            workload's own bound), >= 1; ``None``: unbounded.

    Returns:
        The decision.

    Raises:
        InvalidInputError: a negative ``current`` or a non-positive ``desired`` / ``floor``.
    """
    if current < 0:
        raise errors.InvalidInputError("current", f"must be >= 0, got {current}")
    if desired < 1:
        raise errors.InvalidInputError("nextStepWorkers", f"must be >= 1, got {desired}")
    if floor < 1:
        raise errors.InvalidInputError("floor", f"must be >= 1, got {floor}")
    if ceiling is not None and ceiling < 1:
        raise errors.InvalidInputError("maxWorkers", f"must be >= 1, got {ceiling}")
    if ceiling is not None and desired > ceiling and desired != current:
        return ScaleDecision(
            ScaleAction.REFUSED,
            current,
            current,
            floor,
            "AboveMaxWorkers",
            f"cannot scale from {current} to {desired} workers: maximum is {ceiling}; "
            f"the worker set stays at {current}",
        )
    if desired < floor:
        return ScaleDecision(
            ScaleAction.REFUSED,
            current,
            current,
            floor,
            "ShrinkRejected",
            f"cannot scale from {current} to {desired} workers: minimum is {floor}; "
            f"the worker set stays at {current}",
        )
    if desired == current:
        return ScaleDecision(
            ScaleAction.NONE, current, current, floor, "AtTarget", f"{current} workers"
        )
    grow = desired > current
    return ScaleDecision(
        ScaleAction.RESIZE,
        current,
        desired,
        floor,
        "GrowBetweenSteps" if grow else "ShrinkBetweenSteps",
        f"{'grow' if grow else 'shrink'} from {current} to {desired} workers (floor {floor})",
    )


# ----- KubeRay worker groups --------------------------------------------------------------------
_POD_PREFIX_MAX = 50
"""KubeRay cuts ``<cluster>-<group>`` to 50 characters before ``-worker-`` (its
``utils.PodGenerateName``), so pod names stay within 63 with the 5 generated characters."""
_GENERATED = re.compile(r"[a-z0-9]{5}")


@dataclasses.dataclass(frozen=True)
class WorkerGroup:
    """One worker group of a KubeRay ``RayCluster``, as the operator read it.

    Attributes:
        cluster: the RayCluster's name.
        namespace: its namespace (its pods').
        group: ``workerGroupSpecs[].groupName``.
        replicas: ``replicas`` now, workers.
        min_replicas: ``minReplicas`` (KubeRay runs at least this many), workers.
        max_replicas: ``maxReplicas`` (at most this many; ``None``: unbounded), workers.
        hosts_per_replica: ``numOfHosts`` (pods per replica; only 1 is resized here).
        autoscaling: ``spec.enableInTreeAutoscaling`` (the Ray autoscaler then owns
            ``replicas`` and ``workersToDelete``).
        workers_to_delete: ``scaleStrategy.workersToDelete`` now (pod names).
    """

    cluster: str
    namespace: str
    group: str
    replicas: int
    min_replicas: int = 0
    max_replicas: int | None = None
    hosts_per_replica: int = 1
    autoscaling: bool = False
    workers_to_delete: tuple[str, ...] = ()

    @property
    def pod_prefix(self) -> str:
        """``generateName`` of the group's worker pods (KubeRay: ``<cluster>-<group>-worker-``)."""
        return f"{self.cluster}-{self.group}"[:_POD_PREFIX_MAX].lower() + "-worker-"

    def member(self, pod: str | None) -> str | None:
        """The pod's name when ``pod`` ("namespace/name") is a worker pod of this group."""
        if pod is None:
            return None
        ns, sep, name = pod.partition("/")
        prefix = self.pod_prefix
        if not sep or ns != self.namespace or not name.startswith(prefix):
            return None
        return name if _GENERATED.fullmatch(name[len(prefix) :]) else None


def group_pods(group: WorkerGroup, gpus: Iterable[tuple[str | None, bool]]) -> dict[str, bool]:
    """The group's pods seen in the node reports -> whether every GPU of the pod is parked.

    Args:
        group: the worker group.
        gpus: ``(pod "namespace/name" or None, parked)`` of every GPU in the policy's newest node
            reports.
    """
    seen: dict[str, bool] = {}
    for pod, parked in gpus:
        name = group.member(pod)
        if name is not None:
            seen[name] = seen.get(name, True) and parked
    return seen


@dataclasses.dataclass(frozen=True)
class GroupScaleDecision:
    """The outcome of ``decide_group_scale``.

    Attributes:
        decision: as ``decide_scale``'s, with the RayCluster reasons added (``WorkersUnknown``,
            ``OutsideWorkerGroupBounds``, ``UnsupportedWorkerSet``: all ``REFUSED``).
        workers_to_delete: the group's new ``scaleStrategy.workersToDelete`` (pod names) for a
            ``RESIZE``: entries still pending (the pod is still reported) plus, for a shrink,
            the released pods chosen; the group's current list otherwise.
        chosen: the pods this decision deletes (a shrink), sorted.
        needed: pods a shrink must delete (0 for growth), pods.
        known: released pods of the group known and not already being deleted, pods.
    """

    decision: ScaleDecision
    workers_to_delete: tuple[str, ...]
    chosen: tuple[str, ...] = ()
    needed: int = 0
    known: int = 0


def decide_group_scale(
    group: WorkerGroup,
    desired: int,
    floor: int,
    gpus: Iterable[tuple[str | None, bool]],
    ceiling: int | None = None,
) -> GroupScaleDecision:
    """Decide a between-steps resize of a RayCluster worker group, naming the pods to delete.

    ``decide_scale`` first (below the floor: ``ShrinkRejected``; at the target: nothing). Then, for
    a resize: a group owned by the
    in-tree autoscaler or with several hosts per replica is ``UnsupportedWorkerSet``; a target
    outside ``[minReplicas, maxReplicas]`` is refused (KubeRay would clamp it). Growth only
    raises ``replicas`` and drops ``workersToDelete`` entries whose pods are no longer
    reported. A shrink by ``n`` names ``n`` released pods (every reported GPU parked, pod of
    this group, not already being deleted; by name order); with fewer known it is refused
    (``WorkersUnknown``): KubeRay deletes exactly the named pods, and a guessed name could be a
    worker the dispatcher still uses.

    Args:
        group: the worker group now.
        desired: workers the dispatcher asks for the next step, >= 1.
        floor: ``worker_set_floor`` of the policy, >= 1.
        gpus: ``(pod "namespace/name" or None, parked)`` of every GPU in the newest reports.
        ceiling: as ``decide_scale``'s (``spec.rollout.maxWorkers``).

    Returns:
        The decision; ``workers_to_delete`` is to be written only on ``RESIZE``.

    Raises:
        InvalidInputError: as ``decide_scale``.
    """
    current = group.replicas
    d = decide_scale(current, desired, floor, ceiling)
    unchanged = group.workers_to_delete

    def refused(reason: str, why: str) -> ScaleDecision:
        return ScaleDecision(
            ScaleAction.REFUSED,
            current,
            current,
            floor,
            reason,
            f"cannot scale from {current} to {desired} workers: {why}; "
            f"the worker group stays at {current}",
        )

    if d.action is not ScaleAction.RESIZE:
        return GroupScaleDecision(d, unchanged)
    if group.autoscaling:
        why = (
            "the RayCluster's in-tree autoscaler owns replicas and workersToDelete "
            "(enableInTreeAutoscaling)"
        )
        return GroupScaleDecision(refused("UnsupportedWorkerSet", why), unchanged)
    if group.hosts_per_replica != 1:
        why = f"numOfHosts is {group.hosts_per_replica} (a replica of several pods is not resized)"
        return GroupScaleDecision(refused("UnsupportedWorkerSet", why), unchanged)
    high = group.max_replicas
    if desired < group.min_replicas or (high is not None and desired > high):
        bounds = f"[{group.min_replicas}, {'unbounded' if high is None else high}]"
        why = f"the worker group's minReplicas..maxReplicas is {bounds} (KubeRay would clamp)"
        return GroupScaleDecision(refused("OutsideWorkerGroupBounds", why), unchanged)
    pods = group_pods(group, gpus)
    pending = tuple(p for p in group.workers_to_delete if p in pods)
    if desired > current:
        return GroupScaleDecision(d, pending)
    needed = current - desired
    released = sorted(p for p, parked in pods.items() if parked and p not in pending)
    if len(released) < needed:
        why = (
            f"{needed} released worker pod{'s' if needed != 1 else ''} needed, "
            f"{len(released)} known (pods of worker group {group.group} with every GPU parked "
            "in the node reports); not guessing which to delete"
        )
        return GroupScaleDecision(
            refused("WorkersUnknown", why), unchanged, needed=needed, known=len(released)
        )
    chosen = tuple(released[:needed])
    d = dataclasses.replace(d, message=f"{d.message}; deleting {', '.join(chosen)}")
    return GroupScaleDecision(d, pending + chosen, chosen, needed, len(released))
