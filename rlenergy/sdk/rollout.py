"""Trainer-side FlexFloor actuation: a release decision onto the engine and the parked GPUs.

The rollout dispatcher plans with ``rlenergy.sdk.planner.RolloutPlanner`` in its own process
(placement, releases, release rounds; no planner server). ``apply_release`` runs the engine
side of a decision through an ``ElasticEngine`` (``rlenergy.sdk.engines`` or the simulator's
engine): prepare, then commit or abort, so the engine's group is ``activeAfter``, exactly
``activeBefore``, or, when a resize was sent and has not ended, reported ``InFlight`` (never
``Aborted``: the engine may still be shrinking); the outcome carries the group the engine
reports after the resize, not the one asked for. ``park_if_released`` then parks a released
rank's GPUs through its node agent (only ranks outside that group). ``grow_back`` returns the
group to full size before the next rollout (``ShrinkRecoveryFailed`` when it cannot).
``failure_of`` turns a failed outcome or a lost rank into what the dispatcher publishes
(``RLEnergyClient.publish_rollout(failure=...)``), so the operator marks the policy Degraded
with its reason and an Event. (The HTTP client of
``/v1/rollout/{placement,progress,ack}`` was removed: nothing served those endpoints.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from rlenergy import errors
from rlenergy.api import node as api_node
from rlenergy.api import rollout as api
from rlenergy.sdk import planner


def apply_release(engine: api.ElasticEngine, decision: api.ReleaseDecision) -> api.ReleaseOutcome:
    """Run one release on an engine: prepare, then commit, or abort on any refusal or error.

    Returns:
        ``Committed`` with the new group; ``Aborted`` with the unchanged group and why (the
        engine refused, or failed before its resize began); ``InFlight`` with the group before
        and why, when the resize was sent and its end is not known (``errors.InFlightError``:
        nothing is aborted; the caller polls the engine).
    """
    ack = engine.prepare_release(decision)
    if not ack.ok:
        engine.abort_release(decision)
        return _outcome(decision, "Aborted", engine.active_ranks(), ack.reason)
    try:
        active = engine.commit_release(decision)
    except errors.InFlightError as exc:
        return _outcome(decision, "InFlight", tuple(decision.active_before), str(exc))
    except errors.RLEnergyError as exc:
        engine.abort_release(decision)
        return _outcome(decision, "Aborted", engine.active_ranks(), str(exc))
    return _outcome(decision, "Committed", active, None)


class Parker(Protocol):
    """What ``park_if_released`` needs of the node-agent client (``trainer.RLEnergyClient``)."""

    def park(self, step: int, *, gpus: Sequence[str] = ()) -> dict[str, Any]:
        """Park the caller's GPUs (or ``gpus``) for RL step ``step``."""
        ...


def park_if_released(
    agent: Parker,
    outcome: api.ReleaseOutcome,
    decision: api.ReleaseDecision,
    rank: int,
    step: int,
    *,
    gpus: Sequence[str] = (),
) -> bool:
    """On rank ``rank``: park its GPUs when a committed release took it out of the EP group.

    Args:
        agent: the rank's node-agent client.
        outcome: the round's outcome (only ``Committed`` parks).
        decision: the round's decision (``release`` names the leaving ranks).
        rank: this process's EP rank.
        step: the RL step (the park lasts until it ends).
        gpus: this rank's GPU UUIDs (empty: every GPU of the pod).

    Returns:
        Whether a park was sent.
    """
    if outcome.status != "Committed" or rank not in decision.release:
        return False
    if rank in outcome.active_workers:
        return False  # the engine kept it after all: never park an active rank
    agent.park(step, gpus=gpus)
    return True


class Degradable(Protocol):
    """What ``failure_of`` reads of an engine adapter (``engines._HttpEngine.degraded``)."""

    @property
    def degraded(self) -> str | None:
        """Why the engine can no longer be resized (terminal), or ``None``."""
        ...


def failure_of(
    what: api.ReleaseOutcome | planner.RankLoss,
    engine: Degradable | None = None,
) -> api_node.RolloutFailure | None:
    """What the dispatcher publishes for a failed shrink step; ``None`` for a committed one.

    ``Aborted`` -> ``ReleaseAborted`` (the group is unchanged), or ``EngineDegraded`` when
    ``engine`` reports itself degraded (a 409 or a reconfiguration already active: the
    dispatcher stops releasing on it, ``RolloutPlanner.stop_releases``); ``InFlight`` ->
    ``ResizeInFlight`` (the engine may still be resizing), a ``RankLoss`` -> ``RankLost``
    (the rank, the reloaded experts and the abort-style teardown in the message).
    """
    if isinstance(what, planner.RankLoss):
        targets = sorted(set(what.reload.values()))
        reload = f"; experts {sorted(what.reload)} reloaded onto ranks {targets}" if targets else ""
        return api_node.RolloutFailure(
            reason="RankLost",
            message=(
                f"rank {what.rank} lost ({what.reason}): engine group torn down abort-style, "
                f"restarted with ranks {list(what.active_workers)}{reload}"
            )[:1024],
            ranks=[what.rank],
        )
    if what.status == "Committed":
        return None
    degraded = engine.degraded if engine is not None else None
    if degraded is not None and what.status == "Aborted":
        return api_node.RolloutFailure(
            reason="EngineDegraded",
            message=f"release {what.decision_id}: {degraded}"[:1024],
            ranks=list(what.active_workers),
        )
    return api_node.RolloutFailure(
        reason="ReleaseAborted" if what.status == "Aborted" else "ResizeInFlight",
        message=f"release {what.decision_id}: {what.reason or what.status}"[:1024],
        ranks=list(what.active_workers),
    )


class Growable(Protocol):
    """What ``grow_back`` needs of an engine adapter (``engines.VllmElasticEngine``, ...)."""

    def active_ranks(self) -> tuple[int, ...]:
        """EP ranks in the group now, ascending."""
        ...

    def grow_back(self, ranks: int | None = None) -> tuple[int, ...]:
        """Return the group to ``ranks`` (default: start-up size); the size read back."""
        ...


@dataclasses.dataclass(frozen=True)
class GrowBack:
    """The group a grow-back left, for the next step.

    Attributes:
        active: the group as the engine reports it (the next step plans with these ranks).
        failure: ``ShrinkRecoveryFailed`` to publish when the group is not whole again.
    """

    active: tuple[int, ...]
    failure: api_node.RolloutFailure | None


def grow_back(engine: Growable, ranks: int) -> GrowBack:
    """Before the next rollout: grow the engine's group back to ``ranks`` ranks.

    The size is read back from the engine after the resize (``grow_back`` of the adapters);
    any failure (the engine refused, is degraded, did not end, or reports fewer ranks) is
    ``ShrinkRecoveryFailed`` with the group the engine reports, which the next step uses
    (``RolloutPlanner.place`` with those ranks; ``publish_rollout(next_step_workers=...)``).
    Never raises for an engine failure: the job goes on at the size read back.
    """
    try:
        active = engine.grow_back(ranks)
    except errors.RLEnergyError as exc:
        now = engine.active_ranks()
        return GrowBack(
            now,
            api_node.RolloutFailure(
                reason="ShrinkRecoveryFailed",
                message=(
                    f"growing the rollout group back to {ranks} ranks failed ({exc}); the next "
                    f"step runs with the {len(now)} ranks the engine reports"
                )[:1024],
                ranks=list(now),
            ),
        )
    return GrowBack(active, None)


def feed_lost_ranks(
    rollout_planner: planner.RolloutPlanner,
    lost_pods: Sequence[str],
    worker_pods: Sequence[str],
) -> list[planner.RankLoss]:
    """Tell the planner about every active rank whose pod was lost (``rank_lost``).

    Args:
        rollout_planner: the dispatcher's planner.
        lost_pods: ``namespace/name`` of the lost pods (``RLEnergyClient.lost_workers``).
        worker_pods: the pod of each rank, rank order (as published in ``workerPods``).

    Returns:
        One ``RankLoss`` per rank that was still active (tear the group down abort-style).
    """
    lost = set(lost_pods)
    return [
        rollout_planner.rank_lost(rank, f"pod {pod} ended mid-rollout (RolloutWorkerLost)")
        for rank, pod in enumerate(worker_pods)
        if pod in lost and rank in rollout_planner.active_workers
    ]


def _outcome(
    decision: api.ReleaseDecision, status: str, active: tuple[int, ...], reason: str | None
) -> api.ReleaseOutcome:
    return api.ReleaseOutcome.model_validate(
        {
            "rolloutId": decision.rollout_id,
            "decisionId": decision.decision_id,
            "status": status,
            "activeWorkers": list(active),
            "reason": reason,
        }
    )
