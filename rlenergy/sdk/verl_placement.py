"""FlexFloor placement of verl's rollout requests: the planner as verl's request router.

verl 0.9.1 picks the rollout server of every generation request in one load-balancer Ray actor
shared by all agent-loop workers: ``LLMServerClient.generate`` calls
``acquire_server(request_id, **fields)`` on it, with the request's ``generate`` arguments that
the balancer declares in ``require_acquire_fields`` (``verl/workers/rollout/llm_server.py``,
``verl/workers/rollout/router.py``). verl's own setting
``actor_rollout_ref.rollout.router_config_path`` names a YAML file whose ``router_class`` verl
builds as that actor, with the server map and the whole YAML as a dict
(``router._create_plugin_extension``). So the one setting that turns FlexFloor placement on is::

    actor_rollout_ref.rollout.router_config_path=/etc/rlenergy/flexfloor-router.yaml

with ``router_class: rlenergy.sdk.verl_placement.PlannerRouter`` and the rollout's memory in
that file (:class:`RouterSettings`), next to the hook's setting (``docs/verl.md``), which this
needs: the hook wraps ``AgentLoopManager.generate_sequences`` in the driver
(:func:`patch_agent_loop_manager`) to announce each batch to the router before verl hands it
to the agent-loop workers, and to teach the planner the batch's response lengths after it.

Per batch, the router holds every sample's first request until all samples of the announced
batch asked (or ``gatherTimeoutS`` passed), then calls ``RolloutPlanner.assign`` once over the
batch: prompt lengths are the real ``prompt_ids`` the agent loop built, prompts are identified
by the dataset's ``index`` (stable across epochs, so the predictor learns per prompt) and a
sample by the ``priority`` verl's manager gives each sample of a batch (its position,
``AgentLoopManager.generate_sequences``). Each server is a rank of ``assign`` (servers in verl's
order), with ``MoeLayout.kv_budget_bytes`` as its KV budget. Everything else (later turns of a
multi-turn sample, validation batches, a request without ``priority``, any failure of the
planner's part) goes to verl's own sticky, least-loaded ``GlobalRequestLoadBalancer``, which
also keeps the in-flight counts: the router never fails a request for its own sake.

Not covered: verl's v1 TransferQueue agent loop (``AgentLoopManagerTQ`` gives no per-sample
``priority``), whose requests go to verl's balancer unplanned.

Nothing here imports verl or Ray at module import: verl imports this module by its name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from rlenergy import errors
from rlenergy.control.moe import base, placement
from rlenergy.sdk import planner, verl_hook

log = logging.getLogger(__name__)

MANAGER_CLASS = ("verl.experimental.agent_loop.agent_loop", "AgentLoopManager")
"""verl's agent-loop manager: splits a batch over the agent-loop workers."""
ACQUIRE_FIELDS = ("prompt_ids", "priority")
"""What the router reads of each request: the prompt's tokens and the sample's position."""
_PATCHED = "__rlenergy_patched__"


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    """The router YAML (``router_config_path``): the rollout's memory and timing.

    Field names are the policy's camelCase (``spec.rollout``), units in the names.

    Attributes:
        layout: ``experts`` (count), ``bytesPerExpert``, ``denseBytes`` (default 0),
            ``kvBytesPerToken``, ``workerMemoryBytes`` (weights + KV per server, e.g. GPU memory
            x vLLM's ``gpu_memory_utilization``), ``minActiveWorkers`` (default 1).
        decode_step_empty_s: ``decodeStepEmptyS``: measured decode-step time at an empty KV
            cache, s (> 0).
        decode_step_full_s: ``decodeStepFullS``: at a full KV cache, s (>= the empty one).
        max_running: ``maxRunning``: responses a server decodes at once (vLLM
            ``max_num_seqs``, default 256).
        gather_timeout_s: ``gatherTimeoutS``: longest a batch's first requests wait for the
            rest before the batch is placed with what arrived, s (default 30).
    """

    layout: base.MoeLayout
    decode_step_empty_s: float
    decode_step_full_s: float
    max_running: int = 256
    gather_timeout_s: float = 30.0

    @classmethod
    def from_yaml(cls, doc: Mapping[str, Any]) -> RouterSettings:
        """Read the router YAML verl hands the router (a dict).

        Raises:
            InvalidInputError: a required field is missing or a value is out of range; the
                message names the field.
        """

        def need(name: str) -> Any:
            if name not in doc:
                raise errors.InvalidInputError(name, "required in the FlexFloor router YAML")
            return doc[name]

        layout = base.MoeLayout(
            num_experts=int(need("experts")),
            expert_bytes=int(need("bytesPerExpert")),
            dense_bytes=int(doc.get("denseBytes", 0)),
            kv_bytes_per_token=int(need("kvBytesPerToken")),
            worker_memory_bytes=int(need("workerMemoryBytes")),
            min_active_workers=int(doc.get("minActiveWorkers", 1)),
        )
        settings = cls(
            layout=layout,
            decode_step_empty_s=float(need("decodeStepEmptyS")),
            decode_step_full_s=float(need("decodeStepFullS")),
            max_running=int(doc.get("maxRunning", 256)),
            gather_timeout_s=float(doc.get("gatherTimeoutS", 30.0)),
        )
        if not 0 < settings.decode_step_empty_s <= settings.decode_step_full_s:
            raise errors.InvalidInputError(
                "decodeStepEmptyS", "need 0 < decodeStepEmptyS <= decodeStepFullS"
            )
        if settings.max_running < 1 or settings.gather_timeout_s <= 0:
            raise errors.InvalidInputError("maxRunning", "need maxRunning >= 1, gatherTimeoutS > 0")
        return settings

    def planner(self) -> planner.RolloutPlanner:
        """A ``RolloutPlanner`` whose finish model is fit to the two measured step times.

        ``step_fixed_s`` is the empty-cache step, ``kv_s_per_byte`` the difference to the
        full-cache step over one server's KV memory (``workerMemoryBytes - denseBytes``).
        """
        capacity = max(self.layout.worker_memory_bytes - self.layout.dense_bytes, 1)
        fluid = placement.FluidFinishModel(
            step_fixed_s=self.decode_step_empty_s,
            kv_s_per_byte=(self.decode_step_full_s - self.decode_step_empty_s) / capacity,
            kv_capacity_bytes=float(capacity),
            kv_bytes_per_token=self.layout.kv_bytes_per_token,
            max_running=self.max_running,
        )
        return planner.RolloutPlanner(self.layout, fluid)


@dataclasses.dataclass(frozen=True)
class PlacedSample:
    """Where one sample of a batch was placed.

    Attributes:
        sample: its position in the batch (verl's ``priority``).
        prompt: its prompt's id (the dataset ``index``).
        server: the server's id (its address, verl's key).
        prompt_tokens: its prompt length, tokens.
        predicted_tokens: the predictor's response length, tokens.
        kv_bytes: its predicted peak KV, bytes.
        queued: it fit no server's KV budget left (the engine admits it when memory frees);
            it counts toward no budget.
    """

    sample: int
    prompt: Hashable
    server: str
    prompt_tokens: int
    predicted_tokens: float
    kv_bytes: int
    queued: bool


class RequestBatch:
    """One announced batch: its samples' first requests gathered, then placed once (pure).

    Args:
        prompts: the prompt id of each sample, in batch order, shape ``(n,)``.
        started_s: when it was announced (the gather timeout counts from here), s.
    """

    def __init__(self, prompts: Sequence[Hashable], started_s: float) -> None:
        self.prompts = list(prompts)
        self.started_s = started_s
        self.tokens: dict[int, int] = {}
        self.requests: dict[int, str] = {}
        self.placed: dict[int, PlacedSample] | None = None

    def arrive(self, sample: int, request_id: str, prompt_tokens: int) -> bool:
        """Record sample ``sample``'s first request; ``False`` when it is not this batch's.

        A position outside the batch, a batch already placed, or a second request for a
        position (an agent loop that sends no ``priority`` of its own) is not planned.
        """
        if self.placed is not None or not 0 <= sample < len(self.prompts):
            return False
        if sample in self.requests:
            return False
        self.requests[sample] = request_id
        self.tokens[sample] = prompt_tokens
        return True

    @property
    def complete(self) -> bool:
        """Every sample of the batch has asked."""
        return len(self.tokens) == len(self.prompts)

    def place(
        self, plan: planner.RolloutPlanner, servers: Sequence[str]
    ) -> dict[int, PlacedSample]:
        """Place the samples that arrived over ``servers`` with the planner's ``assign``.

        Returns:
            sample -> its placement; empty without servers or samples.
        """
        order = sorted(self.tokens)
        self.placed = {}
        if not order or not servers:
            return self.placed
        keys = [self.prompts[s] for s in order]
        tokens = [self.tokens[s] for s in order]
        budgets = plan.layout.kv_budget_bytes(len(servers))
        chosen, predicted = plan.assignment(keys, tokens, len(servers), kv_budget_bytes=budgets)
        kvb = plan.layout.kv_bytes_per_token
        for i, s in enumerate(order):
            self.placed[s] = PlacedSample(
                sample=s,
                prompt=keys[i],
                server=servers[chosen.worker_of[i]],
                prompt_tokens=tokens[i],
                predicted_tokens=predicted[i],
                kv_bytes=placement.response_kv_bytes(tokens[i], predicted[i], kvb),
                queued=chosen.queued[i],
            )
        return self.placed


def _verl_balancer(servers: Mapping[str, Any]) -> Any:
    from verl.workers.rollout import router  # noqa: PLC0415 - verl only where it runs

    return router.GlobalRequestLoadBalancer(servers=dict(servers))


class PlannerRouter:
    """verl's request router with FlexFloor's placement (``router_class`` of the router YAML).

    verl builds it as a Ray actor (``ray.remote(PlannerRouter).remote(servers, yaml)``); its
    ``acquire_server`` is a coroutine, so the actor is an async actor and held requests wait
    without blocking the others.

    Args:
        servers: server id (address) -> its Ray actor handle, verl's order.
        config: the router YAML as a dict (:meth:`RouterSettings.from_yaml`).
        balancer: verl's balancer for what is not planned (default: a
            ``GlobalRequestLoadBalancer`` over ``servers``).
        clock: monotonic seconds (injected for tests).

    Raises:
        InvalidInputError: the YAML is invalid (verl's job then fails at start, naming the
            field: a wrong setting is not run unplanned silently).
    """

    def __init__(
        self,
        servers: Mapping[str, Any],
        config: Mapping[str, Any],
        *,
        balancer: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = RouterSettings.from_yaml(config)
        self.plan = self.settings.planner()
        self._lb = balancer if balancer is not None else _verl_balancer(servers)
        self._clock = clock
        self._batch: RequestBatch | None = None
        self._placed_event: asyncio.Event | None = None
        self.history: list[list[PlacedSample]] = []
        """The placement of each batch, oldest first (the newest 16 kept)."""
        self.unplanned = 0
        """Requests handed to verl's balancer (no batch, later turns, late, failures)."""

    # The router protocol (verl/workers/rollout/router.py ``RequestLoadBalancer``).

    def require_acquire_fields(self) -> list[str]:
        """``generate`` arguments the router reads: ``prompt_ids``, ``priority``."""
        return list(ACQUIRE_FIELDS)

    def require_release_fields(self) -> list[str]:
        """What verl's balancer needs at release (nothing beyond the server)."""
        return list(self._lb.require_release_fields())

    async def acquire_server(
        self,
        request_id: str,
        prompt_ids: Sequence[int] | None = None,
        priority: int | None = None,
        **_: Any,
    ) -> tuple[str, Any]:
        """The server of a request: the planner's for a batch's first requests, else verl's."""
        server = None
        batch = verl_hook.safely(
            "hold the request for the batch's placement",
            lambda: self._join(request_id, prompt_ids, priority),
        )
        if batch is not None:
            await self._wait_placed(batch)
            server = verl_hook.safely(
                "place the rollout batch", lambda: self._server_of(batch, int(priority or 0))
            )
        if server is None:
            self.unplanned += 1
        else:
            verl_hook.safely("pin the planned server", lambda: self._pin(request_id, server))
        return self._lb.acquire_server(request_id)  # type: ignore[no-any-return]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        """The release in verl's balancer (in-flight count)."""
        self._lb.release_server(server_id, request_id=request_id)

    def add_servers(self, servers: dict[str, Any]) -> None:
        """Add servers (verl's bulk add); the next batch is placed over the new set."""
        self._lb.add_servers(servers)

    def remove_servers(self, server_ids: list[str]) -> None:
        """Remove servers (verl's bulk remove); the next batch is placed over the servers left."""
        self._lb.remove_servers(server_ids)

    def get_all_servers(self) -> list[str]:
        """The active servers, verl's order."""
        return list(self._lb.get_all_servers())

    def get_status(self) -> dict[str, Any]:
        """The balancer's status, the newest ``placement`` and ``unplanned``."""
        status = dict(self._lb.get_status())
        status["placement"] = [dataclasses.asdict(p) for p in (self.history or [[]])[-1]]
        status["unplanned"] = self.unplanned
        return status

    def clear_sticky_cache(self) -> dict[str, Any]:
        """Reset verl's sticky sessions (phase switches)."""
        return dict(self._lb.clear_sticky_cache())

    def get_total_inflight(self) -> int:
        """The in-flight requests in verl's balancer."""
        return int(self._lb.get_total_inflight())

    # What the hook in verl's driver calls (:func:`patch_agent_loop_manager`).

    async def announce(self, prompts: Sequence[Hashable]) -> int:
        """A batch of ``len(prompts)`` samples is about to be generated; returns its size.

        A batch still gathering is placed at once with what arrived. A coroutine, so that it
        runs on the actor's event loop with the held requests.
        """
        if self._batch is not None and self._batch.placed is None:
            self._place(self._batch)
        self._batch = RequestBatch(prompts, self._clock())
        self._placed_event = asyncio.Event()
        return len(prompts)

    async def observe(self, prompts: Sequence[Hashable], lengths_tokens: Sequence[float]) -> None:
        """The batch's response lengths, tokens: the predictor learns them per prompt."""
        self.plan.observe(list(prompts), [max(float(n), 1.0) for n in lengths_tokens])

    # Internals.

    def _join(
        self, request_id: str, prompt_ids: Sequence[int] | None, priority: int | None
    ) -> RequestBatch | None:
        batch = self._batch
        if batch is None or priority is None or prompt_ids is None:
            return None
        if not batch.arrive(int(priority), request_id, len(prompt_ids)):
            return None
        if batch.complete:
            self._place(batch)
        return batch

    async def _wait_placed(self, batch: RequestBatch) -> None:
        event = self._placed_event
        if batch.placed is not None or event is None or batch is not self._batch:
            return
        left_s = batch.started_s + self.settings.gather_timeout_s - self._clock()
        try:
            await asyncio.wait_for(event.wait(), timeout=max(left_s, 0.0))
        except TimeoutError:
            if batch.placed is None:
                log.warning(
                    "rlenergy FlexFloor router: %d of %d samples asked within %g s; placing those",
                    len(batch.tokens),
                    len(batch.prompts),
                    self.settings.gather_timeout_s,
                )
                self._place(batch)

    def _place(self, batch: RequestBatch) -> None:
        servers = self.get_all_servers()
        placed = verl_hook.safely(
            "place the rollout batch", lambda: batch.place(self.plan, servers)
        )
        batch.placed = placed if placed is not None else {}
        self.history = [*self.history[-15:], sorted(batch.placed.values(), key=lambda p: p.sample)]
        if self._placed_event is not None and batch is self._batch:
            self._placed_event.set()

    def _server_of(self, batch: RequestBatch, sample: int) -> str | None:
        placed = (batch.placed or {}).get(sample)
        if placed is None or placed.server not in self.get_all_servers():
            return None
        return placed.server

    def _pin(self, request_id: str, server: str) -> None:
        # verl's balancer routes a known request id to its server (its sticky session) and
        # counts it in flight there: the planned server becomes this request's session.
        self._lb._request_id_to_server[request_id] = server  # noqa: SLF001 - verl 0.9.1's map


def batch_prompts(prompts: Any) -> list[Hashable]:
    """The prompt id of each sample of a verl batch (a ``DataProto``), in batch order.

    The dataset's ``index`` (``RLHFDataset`` copies ``extra_info.index``; the samples of one
    prompt repeat it and it is the same in every epoch), else the step's ``uid``, else the
    sample's position (no history then).

    Raises:
        ValueError: the batch carries a ``priority`` of its own that is not each sample's
            position (verl sets it so only when the batch has none): its requests cannot be
            told apart, so the batch is not announced.
    """
    extra = prompts.non_tensor_batch
    if "priority" in extra and [int(p) for p in extra["priority"]] != list(range(len(prompts))):
        raise ValueError("the batch's own priority column is not the samples' positions")
    for key in ("index", "uid"):
        if key in extra:
            return [v.item() if hasattr(v, "item") else v for v in extra[key]]
    return list(range(len(prompts)))


def response_lengths(output: Any) -> list[float]:
    """Generated tokens per sample of the agent loop's output (``response_mask`` row sums)."""
    return [float(n) for n in output.batch["response_mask"].sum(-1).tolist()]


def _router_of(manager: Any) -> Any:
    handle = getattr(getattr(manager, "llm_client", None), "_load_balancer", None)
    return handle if handle is not None and hasattr(handle, "announce") else None


def _announcing(method: Callable[..., Any]) -> Callable[..., Any]:
    async def generate_sequences(self: Any, prompts: Any) -> Any:
        router = _router_of(self)
        keys: list[Hashable] | None = None
        if router is not None and not prompts.meta_info.get("validate", False):
            keys = verl_hook.safely("read the batch's prompt ids", lambda: batch_prompts(prompts))
            if keys is not None and await _guarded("announce the batch", router.announce, keys):
                log.debug("rlenergy FlexFloor router: batch of %d announced", len(keys))
            else:
                keys = None
        output = await method(self, prompts)
        if keys is not None:
            lengths = verl_hook.safely(
                "read the responses' lengths", lambda: response_lengths(output)
            )
            if lengths is not None:
                await _guarded("teach the predictor", router.observe, keys, lengths)
        return output

    return generate_sequences


async def _guarded(site: str, method: Any, *args: Any) -> bool:
    """Await a router actor call; ``False`` (logged once per site) when it failed."""
    ref = verl_hook.safely(site, lambda: method.remote(*args))
    if ref is None:
        return False
    try:
        await ref
    except Exception as exc:  # noqa: BLE001 - the job never fails for the router's sake
        verl_hook.safely(site, functools.partial(_raise, exc))
        return False
    return True


def _raise(exc: BaseException) -> None:
    raise exc


def patch_agent_loop_manager(cls: type) -> None:
    """Wrap ``AgentLoopManager.generate_sequences``: announce each batch, teach its lengths.

    verl 0.9.1's method is ``auto_await(SkipManager.annotate(role="rollout")(coroutine))``;
    the new one wraps the coroutine below ``auto_await`` (so it is awaited or run as verl's
    callers expect) and above verl's skip logic. Without a :class:`PlannerRouter` as the
    job's router it does nothing. Idempotent.
    """
    from verl.utils.ray_utils import auto_await  # noqa: PLC0415 - verl only where it runs

    original = cls.__dict__["generate_sequences"]
    if getattr(original, _PATCHED, False):
        return
    new = functools.wraps(original)(auto_await(_announcing(original.__wrapped__)))
    setattr(new, _PATCHED, True)
    cls.generate_sequences = new  # type: ignore[attr-defined]


__all__ = [
    "ACQUIRE_FIELDS",
    "MANAGER_CLASS",
    "PlacedSample",
    "PlannerRouter",
    "RequestBatch",
    "RouterSettings",
    "batch_prompts",
    "patch_agent_loop_manager",
    "response_lengths",
]
