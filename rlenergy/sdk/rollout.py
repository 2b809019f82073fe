"""Trainer-side FlexFloor actuation: a release decision onto the engine and the parked GPUs.

The rollout dispatcher plans with ``rlenergy.sdk.planner.RolloutPlanner`` in its own process
(placement, releases, release rounds; no planner server). ``apply_release`` runs the engine
side of a decision through an ``ElasticEngine`` (``rlenergy.sdk.engines`` or the simulator's
engine): prepare, then commit or abort, so the engine's group is ``activeAfter``, exactly
``activeBefore``, or, when a resize was sent and has not ended, reported ``InFlight`` (never
``Aborted``: the engine may still be shrinking). ``park_if_released`` then parks a released
rank's GPUs through its node agent. (The HTTP client of ``/v1/rollout/{placement,progress,
ack}`` was removed: nothing served those endpoints.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rlenergy import errors
from rlenergy.api import rollout as api


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
