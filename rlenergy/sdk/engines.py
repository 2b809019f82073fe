"""``ElasticEngine`` adapters for the elastic expert-parallel endpoints of vLLM and SGLang.

Both engines shrink an EP group through one HTTP call and report progress through another:

* vLLM: ``POST /scale_elastic_ep`` with ``{"new_data_parallel_size": N, "drain_timeout": s}``
  and ``POST /is_scaling_elastic_ep`` -> ``{"is_scaling_elastic_ep": bool}`` (routes listed by
  vLLM's API server; elastic EP RFC vllm-project/vllm #20323). vLLM removes the highest DP
  ranks, so a release must name the top ranks of the group.
* SGLang: ``POST /scale_elastic_ep`` with ``{"new_ep_size": N}`` and ``/is_scaling_elastic_ep``
  -> ``{"is_scaling_elastic_ep": bool, "effective_ep_size": N, "scale_phase": str,
  "last_error": str | null}`` (SGLang elastic EP with Mooncake, as driven by NVIDIA Dynamo's
  scale scripts). Paths are constructor arguments because deployments prefix them.

The two-phase ``ElasticEngine`` contract maps as: ``prepare_release`` checks the request
against the engine (no scaling in progress, ranks removable, group size as expected) and sends
nothing that mutates the engine, so ``abort_release`` has nothing to undo; ``commit_release``
sends the scale call and polls until the engine reports it done, or raises
``RetryableError`` at ``commit_timeout_s``. Only ``urllib`` from the standard library.
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

    def _post(self, path: str, body: Mapping[str, Any] | None) -> Any:
        reply = http.post_json(
            self.base_url + path, json.dumps(body or {}).encode(), self._timeout_s
        )
        return {} if reply is None else reply

    def _scaling(self) -> bool:
        state = self._post(self.status_path, None)
        if not isinstance(state, dict):
            raise errors.RetryableError(f"{self.base_url}{self.status_path}: unexpected reply")
        error = state.get("last_error")
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
            PermanentError: the decision was not prepared, or the engine refused it (4xx).
            RetryableError: the engine is unreachable, reports an error, or is still scaling
                after ``commit_timeout_s``.
        """
        if self._prepared.pop(decision.decision_id, None) is None:
            raise errors.PermanentError(f"release {decision.decision_id} was not prepared")
        new_size = len(decision.active_after)
        self._post(self.scale_path, self._scale_body(new_size))
        deadline = self._monotonic() + self._commit_timeout_s
        while self._scaling():
            if self._monotonic() >= deadline:
                raise errors.RetryableError(
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
        self.drain_timeout_s = drain_timeout_s

    def _scale_body(self, new_size: int) -> Mapping[str, Any]:
        return {"new_data_parallel_size": new_size, "drain_timeout": self.drain_timeout_s}


class SglangElasticEngine(_HttpEngine):
    """SGLang elastic EP (``/scale_elastic_ep`` with ``new_ep_size``).

    Args:
        base_url: the SGLang server (or its control prefix, e.g. ``.../engine/control``).
        ranks: EP ranks at start-up.
        timeout_s: per HTTP request, s.
        commit_timeout_s: how long a scale may take before ``RetryableError``, s.
        poll_interval_s: ``/is_scaling_elastic_ep`` polling period, s.
        sleep: injected for tests.
        monotonic: injected for tests.
    """

    def _scale_body(self, new_size: int) -> Mapping[str, Any]:
        return {"new_ep_size": new_size}
