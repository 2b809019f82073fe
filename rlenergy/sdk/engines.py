"""``ElasticEngine`` adapters for the elastic expert-parallel endpoints of vLLM and SGLang.

Both engines shrink an EP group through one HTTP call and report progress through another:

* vLLM (``vllm/entrypoints/serve/elastic_ep/api_router.py``): ``POST /scale_elastic_ep``
  with ``{"new_data_parallel_size": N, "drain_timeout": s}`` (positive integers, 400
  otherwise) blocks until the resize has ended: 200 when done, 408 when draining the removed
  ranks' requests outlived ``drain_timeout`` (before any change), 500 when the scale failed.
  ``POST /is_scaling_elastic_ep`` -> ``{"is_scaling_elastic_ep": bool}``; while a resize runs
  vLLM's ``ScalingMiddleware`` answers every request with 503, which here reads "scaling".
  vLLM removes the highest DP ranks, so a release must name the top ranks of the group.
  The status reply also has ``phase``, ``epoch``, ``error``, ``requested_data_parallel_size``.
* SGLang (``sglang/srt/entrypoints/elastic_ep.py``): ``POST /scale_elastic_ep`` with
  ``{"new_ep_size": N}`` starts an asynchronous scale-*up* (409 while one is pending) and
  ``GET /is_scaling_elastic_ep`` -> ``{"is_scaling_elastic_ep": bool, "effective_ep_size": N,
  "pending_ep_size": N | null, "scale_phase": str, "last_error": str | null}``
  (``TokenizerManager.get_elastic_ep_state``). Its scheduler refuses a ``new_ep_size`` not
  above the effective size, so ``SglangElasticEngine`` refuses every release (nothing sent).

The versions are pinned in ``pyproject.toml`` ``[tool.rlenergy.engines]`` (vLLM 0.33.0,
SGLang 0.5.23); ``tests/unit/sdk/test_engine_source.py`` checks these routes, methods and
fields against the pinned wheels' source (``make engine-wheels``).

The two-phase ``ElasticEngine`` contract maps as: ``prepare_release`` checks the request
against the engine (no scaling in progress, ranks removable, group size as expected) and sends
nothing that mutates the engine, so ``abort_release`` has nothing to undo; ``commit_release``
sends the scale call and polls until the engine reports it done; once the call was sent,
no answer, a 5xx or a resize still running at ``commit_timeout_s`` raise
``errors.InFlightError`` (``apply_release`` reports ``InFlight``, never ``Aborted``). Only
``urllib`` from the standard library.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from rlenergy import errors
from rlenergy.api import rollout as api
from rlenergy.sdk import http


class _HttpEngine:
    """Shared HTTP plumbing; ``ranks`` is the EP group at start-up (0..n-1)."""

    scale_path = "/scale_elastic_ep"
    status_path = "/is_scaling_elastic_ep"
    status_method = "POST"
    """HTTP method of ``status_path`` in the pinned engine."""
    error_field = "error"
    """The status reply's field that carries a scaling error."""

    def __init__(
        self,
        base_url: str,
        *,
        ranks: int,
        timeout_s: float = 10.0,
        commit_timeout_s: float = 600.0,
        poll_interval_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if ranks < 1:
            raise errors.InvalidInputError("ranks", "an EP group has at least one rank")
        self.base_url = base_url.rstrip("/")
        self._active = tuple(range(ranks))
        self._timeout_s = timeout_s
        self._commit_timeout_s = commit_timeout_s
        self._poll_interval_s = poll_interval_s
        self._sleep = sleep
        self._monotonic = monotonic
        self._prepared: dict[int, api.ReleaseDecision] = {}

    def active_ranks(self) -> tuple[int, ...]:
        """EP ranks in the group now, ascending."""
        return self._active

    def _post(self, path: str, body: Mapping[str, Any] | None, timeout_s: float = 0.0) -> Any:
        reply = http.post_json(
            self.base_url + path, json.dumps(body or {}).encode(), timeout_s or self._timeout_s
        )
        return {} if reply is None else reply

    def _status(self) -> Any:
        if self.status_method == "GET":
            reply = http.post_json(self.base_url + self.status_path, None, self._timeout_s, "GET")
            return {} if reply is None else reply
        return self._post(self.status_path, None)

    def _scale_timeout_s(self) -> float:
        """How long the scale call itself may block, s (per request timeout by default)."""
        return self._timeout_s

    def _scaling(self) -> bool:
        try:
            state = self._status()
        except errors.RetryableError as exc:
            # vLLM's ScalingMiddleware answers every request, this probe included, with 503
            # "... currently scaling ..." while a resize runs.
            if ": HTTP 503:" in str(exc):
                return True
            raise
        if not isinstance(state, dict):
            raise errors.RetryableError(f"{self.base_url}{self.status_path}: unexpected reply")
        error = state.get(self.error_field)
        if error:
            raise errors.RetryableError(f"engine reports a scaling error: {error}")
        return bool(state.get("is_scaling_elastic_ep", False))

    def _refuse(self, decision: api.ReleaseDecision, reason: str) -> api.ReleaseAck:
        return api.ReleaseAck(
            rollout_id=decision.rollout_id,
            decision_id=decision.decision_id,
            worker=min(decision.active_before),
            ok=False,
            reason=reason,
        )

    def prepare_release(self, decision: api.ReleaseDecision) -> api.ReleaseAck:
        """Check the release against the engine; nothing is sent that changes it."""
        if tuple(decision.active_before) != self._active:
            return self._refuse(
                decision, f"engine group is {list(self._active)}, not {decision.active_before}"
            )
        keep = len(decision.active_after)
        if set(decision.release) != set(self._active[keep:]):
            return self._refuse(
                decision, "the engine can only remove the highest ranks of the group"
            )
        if decision.moves:
            return self._refuse(
                decision,
                "the engine rebalances experts itself (EPLB); the planner must not ask for "
                "expert copies",
            )
        try:
            if self._scaling():
                return self._refuse(decision, "a scaling operation is already running")
        except errors.RLEnergyError as exc:
            return self._refuse(decision, str(exc))
        self._prepared[decision.decision_id] = decision
        return api.ReleaseAck(
            rollout_id=decision.rollout_id,
            decision_id=decision.decision_id,
            worker=min(decision.active_before),
        )

    def _scale_body(self, new_size: int) -> Mapping[str, Any]:
        raise NotImplementedError

    def commit_release(self, decision: api.ReleaseDecision) -> tuple[int, ...]:
        """Send the scale call and wait until the engine reports it done.

        Raises:
            PermanentError: the decision was not prepared, or the engine refused it (4xx:
                vLLM's 400 for a bad size, 408 when draining the removed ranks' requests
                outlived ``drain_timeout``; both before any rank changes).
            InFlightError: the scale call was sent and got no answer or a 5xx, or the engine
                is still scaling after ``commit_timeout_s`` (never reported as aborted).
        """
        if self._prepared.pop(decision.decision_id, None) is None:
            raise errors.PermanentError(f"release {decision.decision_id} was not prepared")
        new_size = len(decision.active_after)
        try:
            self._post(self.scale_path, self._scale_body(new_size), self._scale_timeout_s())
        except errors.RetryableError as exc:
            # Sent, and no answer (timeout, dropped connection) or a 5xx: the engine may be
            # resizing or half-resized. Not an abort: the group is not known to be unchanged.
            raise errors.InFlightError(
                f"scale to {new_size} ranks sent, outcome unknown ({exc}); poll {self.status_path}"
            ) from None
        deadline = self._monotonic() + self._commit_timeout_s
        while True:
            try:
                scaling = self._scaling()
            except errors.RetryableError as exc:
                raise errors.InFlightError(
                    f"scale to {new_size} ranks sent; status unreadable: {exc}"
                ) from None
            if not scaling:
                break
            if self._monotonic() >= deadline:
                raise errors.InFlightError(
                    f"engine still scaling to {new_size} ranks after {self._commit_timeout_s} s"
                )
            self._sleep(self._poll_interval_s)
        self._active = tuple(decision.active_after)
        return self._active

    def abort_release(self, decision: api.ReleaseDecision) -> None:
        """Forget a prepared release (nothing was sent to the engine)."""
        self._prepared.pop(decision.decision_id, None)


class VllmElasticEngine(_HttpEngine):
    """vLLM elastic EP (``/scale_elastic_ep`` with ``new_data_parallel_size``).

    Args:
        base_url: the vLLM API server, e.g. ``http://127.0.0.1:8000``.
        ranks: DP (= EP) ranks at start-up.
        drain_timeout_s: how long vLLM may drain requests on removed ranks, s.
        timeout_s: per HTTP request, s.
        commit_timeout_s: how long a scale may take before ``RetryableError``, s.
        poll_interval_s: ``/is_scaling_elastic_ep`` polling period, s.
        sleep: injected for tests.
        monotonic: injected for tests.
    """

    def __init__(
        self,
        base_url: str,
        *,
        ranks: int,
        drain_timeout_s: int = 120,
        timeout_s: float = 10.0,
        commit_timeout_s: float = 600.0,
        poll_interval_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            base_url,
            ranks=ranks,
            timeout_s=timeout_s,
            commit_timeout_s=commit_timeout_s,
            poll_interval_s=poll_interval_s,
            sleep=sleep,
            monotonic=monotonic,
        )
        if drain_timeout_s < 1:
            raise errors.InvalidInputError("drain_timeout_s", "vLLM needs a positive integer")
        self.drain_timeout_s = drain_timeout_s

    def _scale_timeout_s(self) -> float:
        """How long the scale call may block: ``drain_timeout`` plus the resize, s.

        vLLM's ``/scale_elastic_ep`` returns only when the resize has ended; it drains the
        removed ranks' requests for up to ``drain_timeout`` first.
        """
        return self.drain_timeout_s + self._commit_timeout_s

    def _scale_body(self, new_size: int) -> Mapping[str, Any]:
        return {"new_data_parallel_size": new_size, "drain_timeout": self.drain_timeout_s}


class SglangElasticEngine(_HttpEngine):
    """SGLang elastic EP (``/scale_elastic_ep`` with ``new_ep_size``): refuses every release.

    SGLang 0.5.23 only scales an EP group up (``SCALE_UP_ONLY``); ``prepare_release`` refuses
    with that reason, so ``apply_release`` reports ``Aborted`` with the group unchanged.

    Args:
        base_url: the SGLang server (or its control prefix, e.g. ``.../engine/control``).
        ranks: EP ranks at start-up.
        timeout_s: per HTTP request, s.
        commit_timeout_s: how long a scale may take before ``RetryableError``, s.
        poll_interval_s: ``/is_scaling_elastic_ep`` polling period, s.
        sleep: injected for tests.
        monotonic: injected for tests.
    """

    status_method = "GET"
    error_field = "last_error"
    SCALE_UP_ONLY = (
        "SGLang 0.5.23 elastic EP scales up only: /scale_elastic_ep refuses a new_ep_size not "
        "above the effective EP size (sglang/srt/managers/scheduler.py, "
        "handle_scale_elastic_ep), so a release cannot shrink this engine's EP group"
    )

    def prepare_release(self, decision: api.ReleaseDecision) -> api.ReleaseAck:
        """Refuse every release: the pinned SGLang cannot shrink an EP group (nothing sent)."""
        return self._refuse(decision, self.SCALE_UP_ONLY)

    def _scale_body(self, new_size: int) -> Mapping[str, Any]:
        return {"new_ep_size": new_size}
