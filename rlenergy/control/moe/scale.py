"""Between-steps resizing of a disaggregated rollout worker set (``releaseAction: scale``).

Pure decisions for the operator's rollout handler (``rlenergy_operator.rollout``): the
dispatcher publishes how many rollout workers the next RL step needs; the operator asks
``decide_scale`` whether and how to resize the worker set (StatefulSet or LeaderWorkerSet
``/scale`` subresource) and applies only a ``resize``. The floor is the planner's own
(``base.MoeLayout.release_floor``: ``max(expert floor, minActiveWorkers)``), raised to the
expert replica count, so a shrink never leaves an expert without a host (CASES.md #29: a
target below the minimum is refused with ``minimum is N`` and the set stays untouched).

Callers: ``rlenergy_operator.rollout``, ``tests/unit/control/moe``.
"""

from __future__ import annotations

import dataclasses
import enum

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
    """Patch the ``/scale`` subresource to ``ScaleDecision.target``."""
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
            ``ShrinkRejected``).
        message: for humans; a refusal says ``minimum is N`` and why.
    """

    action: ScaleAction
    current: int
    target: int
    floor: int
    reason: str
    message: str


def decide_scale(current: int, desired: int, floor: int) -> ScaleDecision:
    """Decide a between-steps resize of a worker set from ``current`` to ``desired`` workers.

    A shrink below ``floor`` is refused whole (never clamped: the dispatcher planned its step
    for ``desired`` workers, and a different size would surprise it); the set keeps
    ``current`` workers. Growing is always allowed; ``desired == current`` does nothing.

    Args:
        current: replicas of the worker set now, >= 0.
        desired: replicas the dispatcher asks for the next step, >= 1.
        floor: ``worker_set_floor`` of the policy, >= 1.

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
