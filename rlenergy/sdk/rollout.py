"""Trainer-side FlexFloor client: placement, progress reports and release rounds over HTTP.

The rollout dispatcher (verl's rollout manager, or any loop that hands prompts to rollout
workers) uses ``RolloutClient``:

* ``request_placement`` before a batch: where each response decodes;
* ``report_progress`` while decoding: one ``ProgressReport`` per worker; the reply is a
  ``ReleaseDecision`` when the planner releases workers, else ``None``;
* ``acknowledge`` after ``apply_release`` readied the engine; the reply is the round's
  ``ReleaseOutcome`` once decided.

``apply_release`` runs the engine side of a decision through an ``ElasticEngine``
(``rlenergy.sdk.engines`` or the simulator's engine): prepare, then commit or abort, so the
engine's group is either ``activeAfter`` or exactly ``activeBefore``; ``park_if_released``
then parks a released rank's GPUs through its node agent. Endpoint paths are
``/v1/rollout/{placement,progress,ack}`` (JSON bodies, camelCase); stdlib ``urllib`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import pydantic

from rlenergy import errors
from rlenergy.api import rollout as api
from rlenergy.sdk import http


class RolloutClient:
    """HTTP client of the FlexFloor planner.

    Args:
        base_url: the planner's URL, e.g. ``http://127.0.0.1:8089``.
        timeout_s: per request, s.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, path: str, message: pydantic.BaseModel) -> Any:
        body = message.model_dump_json(by_alias=True).encode()
        return http.post_json(self.base_url + path, body, self.timeout_s)

    def request_placement(self, request: api.PlacementRequest) -> api.PlacementResponse:
        """Ask where each response of a batch decodes.

        Raises:
            PermanentError: the planner refused the request (4xx) or replied a bad message.
            RetryableError: the planner is unreachable or failed (5xx).
        """
        return _parse(api.PlacementResponse, self._post("/v1/rollout/placement", request))

    def report_progress(self, report: api.ProgressReport) -> api.ReleaseDecision | None:
        """Report one worker's progress; returns a release decision when there is one."""
        reply = self._post("/v1/rollout/progress", report)
        return None if reply is None else _parse(api.ReleaseDecision, reply)

    def acknowledge(self, ack: api.ReleaseAck) -> api.ReleaseOutcome | None:
        """Send a rank's ack; returns the outcome once the round is decided, else ``None``."""
        reply = self._post("/v1/rollout/ack", ack)
        return None if reply is None else _parse(api.ReleaseOutcome, reply)


_M = TypeVar("_M", bound=pydantic.BaseModel)


def _parse(model: type[_M], data: Any) -> _M:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise errors.PermanentError(f"bad {model.__name__} from the planner: {exc}") from None


def apply_release(engine: api.ElasticEngine, decision: api.ReleaseDecision) -> api.ReleaseOutcome:
    """Run one release on an engine: prepare, then commit, or abort on any refusal or error.

    Returns:
        ``Committed`` with the new group, or ``Aborted`` with the unchanged group and why.
    """
    ack = engine.prepare_release(decision)
    if not ack.ok:
        engine.abort_release(decision)
        return _outcome(decision, "Aborted", engine.active_ranks(), ack.reason)
    try:
        active = engine.commit_release(decision)
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
