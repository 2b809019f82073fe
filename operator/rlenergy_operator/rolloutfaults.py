"""FlexFloor's failed shrink steps in the operator: ``status.rollout.failure``, Degraded, Events.

Two sources, both real (docs/flexfloor.md, "Shrinks that fail safe"):

* **a rollout worker lost mid-rollout**: a node agent that sees a pod it governs end (the
  API shows it deleted, being deleted, terminal or replaced, or the kubelet no longer
  allocates it GPUs: ``rlenergy_agent.podlife``) resets its GPUs to the default governor at
  once and lists it in its node report (``endedPods``: how, its GPUs, whether all were
  parked, the newest step seen). A pod the dispatcher's newest publication names as an
  active rank (``workerPods``) that ended at or after that publication's step, not parked
  (a parked pod is a released worker whose removal was planned), is a lost worker:
  ``RolloutWorkerLost``. The dispatcher learns it from the policy's status and calls
  ``RolloutPlanner.rank_lost`` (abort-style teardown).
* **a failed step the dispatcher reports**: its publication's ``failure``
  (``ReleaseAborted``, ``ResizeInFlight``, ``RankLost``, ``EngineDegraded``,
  ``ShrinkRecoveryFailed``; ``rlenergy.sdk.rollout.failure_of`` and ``rollout.grow_back``).

The failure stands (Degraded with its reason, ``status.rollout.failure``) until the
dispatcher publishes a later step without one and no lost worker remains; one Warning Event
per new failure (a new reason, step or set of lost pods). ``reloadedExperts`` and
``placementUnbalanced`` mirror the newest publication.

Pure. Callers: ``rlenergy_operator.rollout.reconcile``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy_operator import builders

LOST = "RolloutWorkerLost"


@dataclasses.dataclass(frozen=True)
class Assessment:
    """One pass's finding.

    Attributes:
        failure: ``status.rollout.failure`` (``None``: no failure stands).
        degraded: (reason, message) of the policy's Degraded, or ``None``.
        event: a Warning Event (type, reason, message) for a new failure, or ``None``.
    """

    failure: api_status.RolloutFailureStatus | None
    degraded: tuple[str, str] | None
    event: builders.Event | None


def lost_workers(
    dispatch: api_node.RolloutDispatch, reports: Sequence[api_node.NodeReport]
) -> list[tuple[str, api_node.EndedPod]]:
    """``(node, ended pod)`` per active worker pod of ``dispatch`` that ended mid-rollout.

    Sorted by pod, one entry per pod (its newest ending).
    """
    active = set(dispatch.worker_pods)
    found: dict[str, tuple[str, api_node.EndedPod]] = {}
    for r in reports:
        for e in r.ended_pods:
            if e.pod in active and not e.parked and e.step >= dispatch.step:
                found[e.pod] = (r.node_name, e)
    return [found[p] for p in sorted(found)]


def _lost_message(lost: Sequence[tuple[str, api_node.EndedPod]], step: int) -> str:
    how = {
        "EndedInApi": "deleted, preempted or terminal in the API",
        "NotAllocated": "no longer allocated GPUs by the kubelet",
    }
    pods = "; ".join(
        f"{e.pod} on node {node} ({how[e.how]}; GPUs {', '.join(e.gpus) or 'none'} reset to "
        "the default governor)"
        for node, e in lost
    )
    return (
        f"rollout worker pod ended mid-rollout after step {step}: {pods}. The dispatcher must "
        "tear the engine group down abort-style (RolloutPlanner.rank_lost) and publish the "
        "ranks left"
    )


def assess(
    previous: api_status.RolloutFailureStatus | None,
    dispatch: api_node.RolloutDispatch | None,
    reports: Sequence[api_node.NodeReport],
    now: str,
) -> Assessment:
    """The failure that stands after this pass, its Degraded and its Event (see module doc).

    Args:
        previous: ``status.rollout.failure`` now.
        dispatch: the dispatcher's newest publication (``rollout.newest_dispatch``).
        reports: the policy's node reports.
        now: RFC 3339 time (``since`` of a new failure).
    """
    if dispatch is None:
        return Assessment(None, None, None)
    lost = lost_workers(dispatch, reports)
    if lost:
        reason, message = LOST, _lost_message(lost, dispatch.step)
        pods: list[str] | None = [e.pod for _, e in lost]
    elif dispatch.failure is not None:
        f = dispatch.failure
        reason, pods = f.reason, None
        ranks = f" (ranks {f.ranks})" if f.ranks else ""
        message = f"step {dispatch.step}{ranks}: {f.message or f.reason}"
    else:
        return Assessment(None, None, None)
    same = previous is not None and (previous.reason, previous.step, previous.lost_workers) == (
        reason,
        dispatch.step,
        pods,
    )
    failure = api_status.RolloutFailureStatus(
        reason=reason,
        message=message,
        step=dispatch.step,
        lost_workers=pods,
        since=previous.since if same and previous is not None else now,
    )
    event = None if same else builders.Event("Warning", reason, message)
    return Assessment(failure, (reason, message), event)
