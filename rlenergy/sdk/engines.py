"""``ElasticEngine`` adapters for the elastic expert-parallel endpoints of vLLM and SGLang.

Both engines resize an EP group through one HTTP call and report progress through another:

* vLLM (``vllm/entrypoints/serve/elastic_ep/api_router.py``): ``POST /scale_elastic_ep``
  with ``{"new_data_parallel_size": N, "drain_timeout": s}`` (positive integers, 400
  otherwise) blocks until the resize has ended: 200 when done, 408 when draining the removed
  ranks' requests outlived ``drain_timeout`` (before any change), 400 for a size the engine
  refuses (a ``ValueError``), 500 when the scale failed (its body says only "Scale failed").
  ``POST /is_scaling_elastic_ep`` -> ``{"is_scaling_elastic_ep": bool, "phase", "epoch",
  "error", "requested_data_parallel_size"}``; while a resize runs vLLM's ``ScalingMiddleware``
  answers every request with 503, which here reads "scaling". vLLM removes the highest DP
  ranks, so a release must name the top ranks of the group. vLLM records the new
  ``parallel_config.data_parallel_size`` only after a commit succeeded
  (``vllm/v1/engine/async_llm.py``); ``GET /server_info?config_format=json`` (served with
  ``VLLM_SERVER_DEV_MODE=1``) shows it, with the TP size, the LB mode and whether elastic EP
  and EPLB are on, and ``GET /version`` the version.
* SGLang (``sglang/srt/entrypoints/elastic_ep.py``): ``POST /scale_elastic_ep`` with
  ``{"new_ep_size": N}`` starts an asynchronous scale-*up* (200 ``{"message", "old_ep_size",
  "new_ep_size"}``; 409 while one is pending; 400 for a size not above the effective one) and
  ``GET /is_scaling_elastic_ep`` -> ``{"is_scaling_elastic_ep": bool, "effective_ep_size": N,
  "pending_ep_size": N | null, "scale_phase": str, "last_error": str | null}``
  (``TokenizerManager.get_elastic_ep_state``; ``scale_phase`` ``serving_expanded`` after a
  grow, ``failed`` with ``last_error``); ``GET /server_info`` has its ``version``. Its
  scheduler refuses a ``new_ep_size`` not above the effective size, so
  ``SglangElasticEngine`` refuses every release (nothing sent) and only grows. Dynamo fronts
  the same SGLang route under its control prefix (``.../engine/control``).

The versions are pinned in ``pyproject.toml`` ``[tool.rlenergy.engines]`` (vLLM 0.33.0,
SGLang 0.5.23); ``tests/unit/sdk/test_engine_source.py`` checks these routes, methods and
fields against the pinned wheels' source (``make engine-wheels``).

How the adapters meet an engine that fails:

* **Capabilities at registration.** The constructor probes the engine (``probe``): version,
  group size, whether it can shrink and grow, the fewest ranks a shrink may leave (vLLM's
  EPLB refuses ``TP x PCP x DP <= 1`` at start-up, ``vllm/config/parallel.py``, so at TP = 1
  the floor is DP = 2) and its load-balancing mode (an external-LB vLLM must get every scale
  call on every rank's API server, which one adapter cannot do). ``prepare_release`` refuses
  what the engine cannot do; a probe that failed is retried there, and until it succeeds
  every release is refused (nothing is sent to an engine whose limits are unknown).
* **Terminal conflicts.** A 409, or an error that says a reconfiguration is "already active"
  or "already in progress" (vLLM's ``EngineCore`` after a failed scale keeps its prepared
  reconfiguration until a restart; Dynamo's worker holds its scale flag), leaves the engine
  unable to resize until someone restarts it. The adapter marks itself ``degraded`` with the
  reason, sends no further resize, and every later ``prepare_release`` refuses at once: no
  retry loop. ``rlenergy.sdk.rollout.failure_of`` publishes it as ``EngineDegraded``.
* **The size read back.** After every commit and every grow-back the adapter reads the
  group size the engine reports (vLLM's data-parallel size, then a 1-token completion that
  proves the resized engine serves; SGLang's ``effective_ep_size`` and ``scale_phase``) and
  records that, never the size it asked for: ranks still in the reported group are not
  released, parked or credited (``rollout.park_if_released`` parks only ranks outside
  ``activeWorkers``), and a scale the engine did not apply aborts with the group unchanged.

The two-phase ``ElasticEngine`` contract maps as: ``prepare_release`` checks the request
against the engine and sends nothing that mutates it, so ``abort_release`` has nothing to
undo; ``commit_release`` sends the scale call, polls until the engine reports it done and
reads the size back; once the call was sent, no answer, a 5xx or a resize still running at
``commit_timeout_s`` raise ``errors.InFlightError`` (``apply_release`` reports ``InFlight``,
never ``Aborted``). ``grow_back`` returns the group to its full size before the next rollout
(``rollout.grow_back``). Only ``urllib`` from the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from rlenergy import errors
from rlenergy.api import rollout as api
from rlenergy.sdk import http

TERMINAL_MARKERS = ("already active", "already in progress", "has not completed yet")
"""Error texts that mean the engine holds a reconfiguration it will not let go of: vLLM's
``"Elastic EP reconfiguration is already active"`` (``vllm/v1/engine/core.py``) and
``"Another external Elastic EP scaling operation is already active."``
(``vllm/distributed/elastic_ep/external_elastic_ep.py``), Dynamo's worker "already in
progress", SGLang's 409 "A previous scale operation has not completed yet"."""


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do to its EP group, as probed when the adapter registers.

    Attributes:
        engine: ``vllm`` or ``sglang``.
        version: the version the engine reports (``""`` when it does not say).
        ranks: the EP group size the engine reports (DP ranks for vLLM, EP ranks for SGLang).
        can_shrink: whether a release may be sent at all.
        can_grow: whether ``grow_back`` may be sent.
        floor_ranks: fewest ranks a shrink may leave (>= 1).
        lb_mode: vLLM's load balancing: ``internal``, ``external`` or ``hybrid``
            (``""`` for SGLang).
        refusal: why shrinks are refused (``None`` when ``can_shrink``).
    """

    engine: str
    version: str
    ranks: int
    can_shrink: bool
    can_grow: bool
    floor_ranks: int
    lb_mode: str
    refusal: str | None = None


class _HttpEngine:
    """Shared HTTP plumbing; ``ranks`` is the EP group at start-up (0..n-1)."""

    engine = ""
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
        probe: bool = True,
    ) -> None:
        if ranks < 1:
            raise errors.InvalidInputError("ranks", "an EP group has at least one rank")
        self.base_url = base_url.rstrip("/")
        self.full_ranks = ranks
        self._active = tuple(range(ranks))
        self._timeout_s = timeout_s
        self._commit_timeout_s = commit_timeout_s
        self._poll_interval_s = poll_interval_s
        self._sleep = sleep
        self._monotonic = monotonic
        self._prepared: dict[int, api.ReleaseDecision] = {}
        self._degraded: str | None = None
        self.capabilities: EngineCapabilities | None = None
        self._probe_error = "not probed yet"
        if probe:
            self._try_probe()

    # -- state -------------------------------------------------------------------------------

    def active_ranks(self) -> tuple[int, ...]:
        """EP ranks in the group now (as last read back from the engine), ascending."""
        return self._active

    @property
    def degraded(self) -> str | None:
        """Why the engine can no longer be resized (terminal), or ``None``."""
        return self._degraded

    def _degrade(self, reason: str) -> None:
        if self._degraded is None:
            self._degraded = (
                f"{self.base_url}: {reason}; no further resize is sent to this engine "
                "(restart it to resize again)"
            )[:900]

    @staticmethod
    def _terminal(text: str) -> bool:
        return ": HTTP 409:" in text or any(m in text.lower() for m in TERMINAL_MARKERS)

    # -- HTTP --------------------------------------------------------------------------------

    def _post(self, path: str, body: Mapping[str, Any] | None, timeout_s: float = 0.0) -> Any:
        reply = http.post_json(
            self.base_url + path, json.dumps(body or {}).encode(), timeout_s or self._timeout_s
        )
        return {} if reply is None else reply

    def _get(self, path: str) -> Any:
        reply = http.post_json(self.base_url + path, None, self._timeout_s, "GET")
        return {} if reply is None else reply

    def _status(self) -> Any:
        if self.status_method == "GET":
            return self._get(self.status_path)
        return self._post(self.status_path, None)

    def _scale_timeout_s(self) -> float:
        """How long the scale call itself may block, s (per request timeout by default)."""
        return self._timeout_s

    def _scaling(self) -> bool:
        """Whether a resize runs; a terminal status error degrades the engine.

        Raises:
            RetryableError: the status is unreadable or reports a scaling error.
        """
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
            if self._terminal(str(error)):
                self._degrade(f"the engine reports {error!r}")
            raise errors.RetryableError(f"engine reports a scaling error: {error}")
        return self._busy(state)

    def _busy(self, state: Mapping[str, Any]) -> bool:
        """Whether a readable, error-free status reply says a resize runs."""
        return bool(state.get("is_scaling_elastic_ep", False))

    # -- capabilities ------------------------------------------------------------------------

    def probe(self) -> EngineCapabilities:
        """Read what the engine can do to its group (see the module docstring).

        Raises:
            RLEnergyError: the engine did not answer, or answered what cannot be read.
        """
        raise NotImplementedError

    def _try_probe(self) -> EngineCapabilities | None:
        try:
            self.capabilities = self.probe()
        except errors.RLEnergyError as exc:
            self._probe_error = str(exc)
            return None
        except (KeyError, TypeError, ValueError) as exc:
            self._probe_error = f"unreadable capabilities ({exc!r})"
            return None
        return self.capabilities

    def _read_size(self) -> int:
        """The group size the engine reports now (after a resize).

        Raises:
            RetryableError: unreadable, or the engine does not serve at that size.
        """
        raise NotImplementedError

    # -- release -----------------------------------------------------------------------------

    def _refuse(self, decision: api.ReleaseDecision, reason: str) -> api.ReleaseAck:
        return api.ReleaseAck(
            rollout_id=decision.rollout_id,
            decision_id=decision.decision_id,
            worker=min(decision.active_before),
            ok=False,
            reason=reason[:1000],
        )

    def prepare_release(self, decision: api.ReleaseDecision) -> api.ReleaseAck:
        """Check the release against the engine; nothing is sent that changes it."""
        if self._degraded is not None:
            return self._refuse(decision, f"engine degraded: {self._degraded}")
        caps = self.capabilities or self._try_probe()
        if caps is None:
            return self._refuse(
                decision,
                f"engine capabilities unknown ({self._probe_error}): no resize is sent to an "
                "engine whose limits were not read",
            )
        if not caps.can_shrink:
            return self._refuse(decision, caps.refusal or "the engine cannot shrink")
        if tuple(decision.active_before) != self._active:
            return self._refuse(
                decision, f"engine group is {list(self._active)}, not {decision.active_before}"
            )
        keep = len(decision.active_after)
        if keep < caps.floor_ranks:
            return self._refuse(
                decision,
                f"a shrink to {keep} ranks is below this engine's floor of {caps.floor_ranks} "
                f"({caps.refusal or self._floor_why(caps)}); the release floor must be at "
                f"least {caps.floor_ranks}",
            )
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
            if self._degraded is not None:
                return self._refuse(decision, f"engine degraded: {self._degraded}")
            return self._refuse(decision, str(exc))
        self._prepared[decision.decision_id] = decision
        return api.ReleaseAck(
            rollout_id=decision.rollout_id,
            decision_id=decision.decision_id,
            worker=min(decision.active_before),
        )

    def _floor_why(self, caps: EngineCapabilities) -> str:
        return f"{caps.engine} {caps.version or '(version unknown)'}"

    def _scale_body(self, new_size: int) -> Mapping[str, Any]:
        raise NotImplementedError

    def _resize(self, new_size: int) -> int:
        """Send one resize, wait until the engine reports it ended, read the size back.

        Returns:
            The group size the engine reports afterwards.

        Raises:
            PermanentError: the engine refused before changing anything (4xx); a 409 or an
                "already active" refusal also degrades the engine.
            InFlightError: sent, and no answer, a 5xx, a scaling error, a resize still
                running at ``commit_timeout_s``, or a size that cannot be read back.
        """
        try:
            self._post(self.scale_path, self._scale_body(new_size), self._scale_timeout_s())
        except errors.PermanentError as exc:
            if self._terminal(str(exc)):
                self._degrade(f"resize to {new_size} refused: {exc}")
            raise
        except errors.RetryableError as exc:
            self._failed_send(new_size, exc)
        deadline = self._monotonic() + self._commit_timeout_s
        while True:
            try:
                scaling = self._scaling()
            except errors.RetryableError as exc:
                raise errors.InFlightError(
                    f"resize to {new_size} ranks sent; status unreadable: {exc}"
                ) from None
            if not scaling:
                break
            if self._monotonic() >= deadline:
                raise errors.InFlightError(
                    f"engine still scaling to {new_size} ranks after {self._commit_timeout_s} s"
                )
            self._sleep(self._poll_interval_s)
        try:
            return self._read_size()
        except errors.RLEnergyError as exc:
            raise errors.InFlightError(
                f"resize to {new_size} ranks ended but the size was not read back: {exc}"
            ) from None

    def _failed_send(self, new_size: int, exc: errors.RetryableError) -> NoReturn:
        """A resize was sent and got no answer or a 5xx: in flight, unless the status says why.

        Raises:
            PermanentError: the status reports a terminal error (the engine is degraded;
                the new resize never started).
            InFlightError: otherwise (the engine may be resizing or half-resized).
        """
        try:
            self._scaling()
        except errors.RLEnergyError:
            pass
        if self._degraded is not None:
            raise errors.PermanentError(f"resize to {new_size} refused: {self._degraded}")
        raise errors.InFlightError(
            f"resize to {new_size} ranks sent, outcome unknown ({exc}); poll {self.status_path}"
        )

    def commit_release(self, decision: api.ReleaseDecision) -> tuple[int, ...]:
        """Send the scale call, wait until the engine reports it done, read the size back.

        Returns:
            The group as the engine reports it (ranks ``0 .. size - 1``), never the size asked.

        Raises:
            PermanentError: the decision was not prepared, the engine refused it (4xx:
                vLLM's 400 for a bad size, 408 when draining the removed ranks' requests
                outlived ``drain_timeout``; both before any rank changes), or the engine
                still reports the whole group afterwards (nothing was released).
            InFlightError: as ``_resize``.
        """
        if self._prepared.pop(decision.decision_id, None) is None:
            raise errors.PermanentError(f"release {decision.decision_id} was not prepared")
        asked = len(decision.active_after)
        size = self._resize(asked)
        before = len(self._active)
        if size >= before:
            raise errors.PermanentError(
                f"the engine reports {size} ranks after the resize to {asked}: nothing was released"
            )
        self._active = tuple(range(size))
        return self._active

    def abort_release(self, decision: api.ReleaseDecision) -> None:
        """Forget a prepared release (nothing was sent to the engine)."""
        self._prepared.pop(decision.decision_id, None)

    def grow_back(self, ranks: int | None = None) -> tuple[int, ...]:
        """Return the group to ``ranks`` (default: its start-up size) and read the size back.

        Returns:
            The group as the engine reports it afterwards.

        Raises:
            PermanentError: the engine is degraded, cannot grow, refused, or reports fewer
                ranks than asked afterwards.
            InFlightError: as ``_resize``.
        """
        target = self.full_ranks if ranks is None else ranks
        if self._degraded is not None:
            raise errors.PermanentError(f"engine degraded: {self._degraded}")
        if len(self._active) >= target:
            return self._active
        caps = self.capabilities or self._try_probe()
        if caps is not None and not caps.can_grow:
            raise errors.PermanentError(f"the engine cannot grow ({caps.refusal})")
        size = self._resize(target)
        self._active = tuple(range(size))
        if size < target:
            raise errors.PermanentError(
                f"the engine reports {size} ranks after the grow-back to {target}"
            )
        return self._active


class VllmElasticEngine(_HttpEngine):
    """vLLM elastic EP (``/scale_elastic_ep`` with ``new_data_parallel_size``).

    Args:
        base_url: the vLLM API server, e.g. ``http://127.0.0.1:8000``.
        ranks: DP (= EP) ranks at start-up.
        drain_timeout_s: how long vLLM may drain requests on removed ranks, s.
        timeout_s: per HTTP request, s.
        commit_timeout_s: how long a scale may take before ``InFlightError``, s.
        poll_interval_s: ``/is_scaling_elastic_ep`` polling period, s.
        sleep: injected for tests.
        monotonic: injected for tests.
        probe: probe the engine's capabilities now (else at the first ``prepare_release``).
    """

    engine = "vllm"

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
        probe: bool = True,
    ) -> None:
        if drain_timeout_s < 1:
            raise errors.InvalidInputError("drain_timeout_s", "vLLM needs a positive integer")
        self.drain_timeout_s = drain_timeout_s
        self._model = ""
        super().__init__(
            base_url,
            ranks=ranks,
            timeout_s=timeout_s,
            commit_timeout_s=commit_timeout_s,
            poll_interval_s=poll_interval_s,
            sleep=sleep,
            monotonic=monotonic,
            probe=probe,
        )

    def _scale_timeout_s(self) -> float:
        """How long the scale call may block: ``drain_timeout`` plus the resize, s.

        vLLM's ``/scale_elastic_ep`` returns only when the resize has ended; it drains the
        removed ranks' requests for up to ``drain_timeout`` first.
        """
        return self.drain_timeout_s + self._commit_timeout_s

    def _scale_body(self, new_size: int) -> Mapping[str, Any]:
        return {"new_data_parallel_size": new_size, "drain_timeout": self.drain_timeout_s}

    def _parallel_config(self) -> Mapping[str, Any]:
        try:
            info = self._get("/server_info?config_format=json")
        except errors.PermanentError as exc:
            raise errors.PermanentError(
                f"{exc}: vLLM serves /server_info only with VLLM_SERVER_DEV_MODE=1, and the "
                "adapter reads the data-parallel size there before and after every resize; "
                "start the server with it, or leave rollout release off"
            ) from None
        config = info["vllm_config"]
        if not isinstance(config, dict):
            raise errors.PermanentError(
                "/server_info returned the config as text: ask for config_format=json"
            )
        pc = config["parallel_config"]
        if not isinstance(pc, dict):
            raise TypeError("parallel_config is not an object")
        return pc

    def probe(self) -> EngineCapabilities:
        """Version (``/version``), DP/TP sizes, LB mode and elastic EP (``/server_info``).

        The floor is the fewest DP ranks with ``TP x PCP x DP > 1`` (vLLM's EPLB, which
        elastic EP requires, refuses anything less at start-up: ``vllm/config/parallel.py``).
        """
        version = str(self._get("/version").get("version", ""))
        pc = self._parallel_config()
        dp = int(pc["data_parallel_size"])
        tp_pcp = int(pc.get("tensor_parallel_size", 1)) * int(
            pc.get("prefill_context_parallel_size", 1)
        )
        lb = (
            "external"
            if pc.get("data_parallel_external_lb")
            else "hybrid"
            if pc.get("data_parallel_hybrid_lb")
            else "internal"
        )
        floor = 1 if tp_pcp > 1 else 2
        refusal = None
        if not pc.get("enable_elastic_ep"):
            refusal = f"vLLM {version} runs without --enable-elastic-ep: it cannot resize"
        elif lb != "internal":
            refusal = (
                f"vLLM {version} balances DP ranks {lb}ly: a resize must reach every rank's "
                "API server, and this adapter drives one"
            )
        elif dp != self.full_ranks:
            refusal = f"vLLM {version} runs {dp} DP ranks, the adapter was told {self.full_ranks}"
        models = self._get("/v1/models").get("data") or []
        self._model = str(models[0]["id"]) if models else ""
        return EngineCapabilities(
            engine="vllm",
            version=version,
            ranks=dp,
            can_shrink=refusal is None,
            can_grow=bool(pc.get("enable_elastic_ep")) and lb == "internal",
            floor_ranks=floor,
            lb_mode=lb,
            refusal=refusal,
        )

    def _floor_why(self, caps: EngineCapabilities) -> str:
        return (
            f"vLLM {caps.version}'s EPLB refuses TP x PCP x DP <= 1 at start-up "
            "(vllm/config/parallel.py)"
        )

    def _failed_send(self, new_size: int, exc: errors.RetryableError) -> NoReturn:
        """A 500 with the engine idle and its DP size unchanged is terminal (see below).

        vLLM answers a scale that failed with 500 "Scale failed" whatever the cause. When the
        engine is then idle (not scaling, no error) at its old size, the scale failed before
        its commit; vLLM 0.33.0 then keeps the prepared reconfiguration
        (``EngineCore.eep_scaling_state`` is cleared only by a commit,
        ``vllm/v1/engine/core.py``), so every later resize fails with "Elastic EP
        reconfiguration is already active" until the engine restarts. No answer at all (a
        timeout) stays in flight.

        Raises:
            PermanentError: that terminal case, or a terminal status error (degraded).
            InFlightError: otherwise.
        """
        if ": HTTP 5" in str(exc) and ": HTTP 503:" not in str(exc):
            try:
                idle = not self._scaling()
                size = int(self._parallel_config()["data_parallel_size"]) if idle else -1
            except (errors.RLEnergyError, KeyError, TypeError, ValueError):
                idle, size = False, -1
            if self._degraded is None and idle and size == len(self._active):
                self._degrade(
                    f"the resize to {new_size} DP ranks failed ({exc}) with the engine idle at "
                    f"{size} ranks: vLLM keeps a failed reconfiguration prepared, and every "
                    "later resize fails with 'Elastic EP reconfiguration is already active' "
                    "(vllm/v1/engine/core.py)"
                )
            if self._degraded is not None:
                raise errors.PermanentError(f"resize to {new_size} refused: {self._degraded}")
        super()._failed_send(new_size, exc)

    def _read_size(self) -> int:
        """The data-parallel size vLLM reports, then a 1-token completion that proves it serves."""
        size = int(self._parallel_config()["data_parallel_size"])
        if self._model:
            try:
                self._post(
                    "/v1/completions",
                    {"model": self._model, "prompt": "0", "max_tokens": 1, "temperature": 0},
                )
            except errors.RLEnergyError as exc:
                raise errors.RetryableError(
                    f"vLLM reports {size} DP ranks but does not serve a 1-token completion: {exc}"
                ) from None
        return size


class SglangElasticEngine(_HttpEngine):
    """SGLang elastic EP (``/scale_elastic_ep`` with ``new_ep_size``): grows, never shrinks.

    SGLang 0.5.23 only scales an EP group up (``SCALE_UP_ONLY``); ``prepare_release`` refuses
    with that reason, so ``apply_release`` reports ``Aborted`` with the group unchanged.
    ``grow_back`` is sent (a joining group must be up), and its end is read from
    ``effective_ep_size`` / ``scale_phase``.

    Args:
        base_url: the SGLang server (or its control prefix, e.g. ``.../engine/control``).
        ranks: EP ranks at start-up.
        timeout_s: per HTTP request, s.
        commit_timeout_s: how long a scale may take before ``InFlightError``, s.
        poll_interval_s: ``/is_scaling_elastic_ep`` polling period, s.
        sleep: injected for tests.
        monotonic: injected for tests.
        probe: probe the engine's capabilities now.
    """

    engine = "sglang"
    status_method = "GET"
    error_field = "last_error"
    SCALE_UP_ONLY = (
        "SGLang 0.5.23 elastic EP scales up only: /scale_elastic_ep refuses a new_ep_size not "
        "above the effective EP size (sglang/srt/managers/scheduler.py, "
        "handle_scale_elastic_ep), so a release cannot shrink this engine's EP group"
    )
    SETTLED_PHASES = ("idle", "serving_expanded", "serving_shrunk")
    """``scale_phase`` values of an engine serving at its effective size."""

    def probe(self) -> EngineCapabilities:
        """Version (``/server_info``) and effective EP size (``/is_scaling_elastic_ep``)."""
        try:
            version = str(self._get("/server_info").get("version", ""))
        except errors.PermanentError:
            version = ""  # Dynamo's control prefix serves the elastic routes only
        state = self._get(self.status_path)
        return EngineCapabilities(
            engine="sglang",
            version=version,
            ranks=int(state["effective_ep_size"]),
            can_shrink=False,
            can_grow=True,
            floor_ranks=int(state["effective_ep_size"]),
            lb_mode="",
            refusal=self.SCALE_UP_ONLY,
        )

    def prepare_release(self, decision: api.ReleaseDecision) -> api.ReleaseAck:
        """Refuse every release: the pinned SGLang cannot shrink an EP group (nothing sent)."""
        return self._refuse(decision, self.SCALE_UP_ONLY)

    def _busy(self, state: Mapping[str, Any]) -> bool:
        """Scaling, or a ``scale_phase`` not yet settled (``warming_up``, ``joining``, ...).

        Raises:
            RetryableError: ``scale_phase`` is ``failed``.
        """
        phase = str(state.get("scale_phase", "idle"))
        if phase == "failed":
            raise errors.RetryableError("engine reports scale_phase 'failed'")
        return bool(state.get("is_scaling_elastic_ep")) or phase not in self.SETTLED_PHASES

    def _read_size(self) -> int:
        """``effective_ep_size`` once ``scale_phase`` is settled."""
        state = self._status()
        phase = str(state.get("scale_phase", ""))
        if phase not in self.SETTLED_PHASES:
            raise errors.RetryableError(
                f"scale_phase {phase!r} (last_error {state.get('last_error')!r})"
            )
        return int(state["effective_ep_size"])

    def _scale_body(self, new_size: int) -> Mapping[str, Any]:
        return {"new_ep_size": new_size}
