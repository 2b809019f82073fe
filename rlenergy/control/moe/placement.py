"""Placement of one rollout batch on the EP workers (FlexFloor step 2), and verl's baseline.

``place_by_length`` sorts responses by predicted length and fills workers in rank order, the
longest first, each up to ``max_responses_per_worker`` (default: an even share, so the decode
batch stays balanced at the start) and up to its KV budget: the predicted peak KV of the
responses it holds (``(prompt + predicted response tokens) x kv_bytes_per_token``, counted as
if they all ran to the end together) never exceeds the memory left after dense weights and the
worker's resident experts. Long responses therefore concentrate on the first workers, and the
last workers hold only short ones, finish early and can be released. A response that fits no
worker's budget is still assigned (to the worker with the most budget left) but marked
``queued``: the engine admits it only when memory frees, as vLLM's scheduler does.

``place_lockstep_within`` is FlexFloor's placement, the one rule the simulator and the
trainer SDK's planner both call: ``place_lockstep`` deals the responses over the lock-stepped
ranks longest predicted first, and ``fit_kv_budget`` keeps every rank's predicted peak KV
within its budget (a response that does not fit moves to the rank with the most KV left, or
waits ``queued``).

``place_even`` is the verl baseline: ``DataProto.chunk`` splits the batch into equal contiguous
chunks, one per rollout worker, in dataset order (a GRPO group stays on one worker).

Concentrating long responses is not free: the worker holding them reads more KV per decode
step, and every rank waits for the slowest at the all-to-all. ``forecast_occupied_gpu_s``
predicts a placement's occupied GPU-seconds from the predicted lengths and a
``base.StepCostModel``, so a caller can keep the even placement when concentration does not
pay (the placement half of the cost-aware guard); ``expected_occupied_gpu_s`` averages that
forecast over the predictor's measured error, because a worker's time is set by the longest
of its (noisy) lengths, which point predictions hide.

Pure and deterministic (ties broken by response index).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Literal

from rlenergy import errors
from rlenergy.control.moe import base


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each response of a batch decodes.

    Attributes:
        worker_of: worker rank per response, shape ``(n_responses,)``.
        queued: per response, ``True`` when it did not fit its worker's KV budget at placement
            time and must wait for memory to free.
        predicted_kv_bytes: per worker, predicted peak KV of its non-queued responses, bytes,
            shape ``(n_workers,)``.
    """

    worker_of: tuple[int, ...]
    queued: tuple[bool, ...]
    predicted_kv_bytes: tuple[int, ...]

    def responses_of(self, worker: int) -> tuple[int, ...]:
        """Indices of the responses placed on ``worker``, ascending."""
        return tuple(i for i, w in enumerate(self.worker_of) if w == worker)


def response_kv_bytes(prompt_tokens: int, response_tokens: float, kv_bytes_per_token: int) -> int:
    """Peak KV of one response: ``(prompt + ceil(response)) x kv_bytes_per_token``, bytes."""
    return (int(prompt_tokens) + math.ceil(response_tokens)) * kv_bytes_per_token


def place_by_length(
    predicted_tokens: Sequence[float],
    prompt_tokens: Sequence[int],
    kv_budget_bytes: Sequence[int],
    kv_bytes_per_token: int,
    *,
    max_responses_per_worker: int | None = None,
    balance: Literal["tokens", "count"] = "count",
) -> Placement:
    """Concentrate long responses on few workers within memory (see module docstring).

    Args:
        predicted_tokens: predicted response length per response, tokens, shape ``(n,)``.
        prompt_tokens: prompt length per response, tokens, shape ``(n,)``.
        kv_budget_bytes: KV memory per worker (memory minus dense weights minus resident
            experts), bytes, shape ``(n_workers,)``.
        kv_bytes_per_token: KV cache per context token, bytes.
        max_responses_per_worker: cap on responses per worker; ``None``: ``ceil(n / workers)``.
        balance: ``"count"`` (default) fills each worker up to the cap (an even share of
            responses), so the longest responses share as few workers as possible;
            ``"tokens"`` moves on once a worker holds an even share of the predicted response
            tokens, so the long-response worker gets fewer responses (in the simulator both
            give the same ratios within 1 %, and ``count`` concentrates a few very long
            responses where ``tokens`` spreads them one per worker).

    Returns:
        The placement; the predicted KV of every worker's non-queued responses is within its
        budget.

    Raises:
        InvalidInputError: no worker, lengths of the inputs differ, a cap below 1, a
            ``balance`` other than ``"count"`` or ``"tokens"``, or a single response needs more
            KV than any worker has.
    """
    n = len(predicted_tokens)
    workers = len(kv_budget_bytes)
    if workers < 1:
        raise errors.InvalidInputError("workers", "need at least one rollout worker")
    if len(prompt_tokens) != n:
        raise errors.InvalidInputError("prompt_tokens", "need one prompt length per response")
    cap = math.ceil(n / workers) if max_responses_per_worker is None else max_responses_per_worker
    if cap < 1:
        raise errors.InvalidInputError("max_responses_per_worker", "must be >= 1")
    if balance not in ("count", "tokens"):
        raise errors.InvalidInputError("balance", f'must be "count" or "tokens", not {balance!r}')
    demand = [
        response_kv_bytes(prompt_tokens[i], predicted_tokens[i], kv_bytes_per_token)
        for i in range(n)
    ]
    largest_budget = max(kv_budget_bytes)
    order = sorted(range(n), key=lambda i: (-predicted_tokens[i], i))
    worker_of = [0] * n
    queued = [False] * n
    used = [0] * workers
    count = [0] * workers
    tokens = [0.0] * workers
    share = sum(predicted_tokens) / workers
    k = 0
    for i in order:
        # Equal predicted decode work per worker: the long-response worker gets few responses.
        if (
            k < workers
            and balance == "tokens"
            and count[k]
            and tokens[k] + predicted_tokens[i] / 2 > share
        ):
            k += 1
        if demand[i] > largest_budget:
            raise errors.InvalidInputError(
                "placement",
                f"response {i} needs {demand[i] / 1e9:.2f} GB of KV cache, more than any worker "
                f"has ({largest_budget / 1e9:.2f} GB): shorten max_response_length or add memory",
            )
        while k < workers and (count[k] >= cap or used[k] + demand[i] > kv_budget_bytes[k]):
            k += 1
        target = k
        if target == workers:
            # Past the last worker: the emptiest worker that still fits, else queue on the one
            # with the most budget left (it waits for memory to free).
            fits = [w for w in range(workers) if used[w] + demand[i] <= kv_budget_bytes[w]]
            pool = fits or list(range(workers))
            target = max(pool, key=lambda w: (kv_budget_bytes[w] - used[w], -w))
            if not fits:
                queued[i] = True
        worker_of[i] = target
        count[target] += 1
        tokens[target] += predicted_tokens[i]
        if not queued[i]:
            used[target] += demand[i]
    return Placement(tuple(worker_of), tuple(queued), tuple(used))


def fit_kv_budget(
    preferred: Sequence[int],
    predicted_tokens: Sequence[float],
    prompt_tokens: Sequence[int],
    kv_budget_bytes: Sequence[int],
    kv_bytes_per_token: int,
) -> Placement:
    """Keep a placement within each worker's KV budget, moving only what does not fit.

    Responses are taken longest predicted first (ties by index). Each stays on its
    ``preferred`` worker when its predicted peak KV (``response_kv_bytes``) fits what that
    worker has left; otherwise it moves to the worker with the most KV left that still fits
    it (ties: the lowest rank); when none fits, it stays on its preferred worker marked
    ``queued`` (the engine admits it when memory frees, as vLLM's scheduler does) and counts
    toward no budget. So the non-queued responses' predicted peak KV never exceeds a worker's
    budget, and a placement that already fits is returned unchanged.

    Args:
        preferred: worker per response before the memory check, shape ``(n,)``.
        predicted_tokens: predicted response length per response, tokens, shape ``(n,)``.
        prompt_tokens: prompt length per response, tokens, shape ``(n,)``.
        kv_budget_bytes: KV memory per worker (memory minus dense weights minus resident
            experts), bytes, shape ``(n_workers,)``.
        kv_bytes_per_token: KV cache per context token, bytes.

    Returns:
        The placement with its ``queued`` flags and per-worker predicted KV.

    Raises:
        InvalidInputError: no worker, inputs of different lengths, or a preferred worker
            outside ``[0, n_workers)``.
    """
    n = len(preferred)
    workers = len(kv_budget_bytes)
    if workers < 1:
        raise errors.InvalidInputError("workers", "need at least one rollout worker")
    if len(predicted_tokens) != n or len(prompt_tokens) != n:
        raise errors.InvalidInputError("placement", "need one prediction and prompt per response")
    if any(not 0 <= w < workers for w in preferred):
        raise errors.InvalidInputError("placement", f"a worker outside [0, {workers})")
    used = [0] * workers
    worker_of = list(preferred)
    queued = [False] * n
    for i in sorted(range(n), key=lambda i: (-predicted_tokens[i], i)):
        need = response_kv_bytes(prompt_tokens[i], predicted_tokens[i], kv_bytes_per_token)
        w = preferred[i]
        if used[w] + need > kv_budget_bytes[w]:
            fits = [v for v in range(workers) if used[v] + need <= kv_budget_bytes[v]]
            if not fits:
                queued[i] = True
                continue
            w = max(fits, key=lambda v: (kv_budget_bytes[v] - used[v], -v))
            worker_of[i] = w
        used[w] += need
    return Placement(tuple(worker_of), tuple(queued), tuple(used))


def place_lockstep_within(
    predicted_tokens: Sequence[float],
    prompt_tokens: Sequence[int],
    kv_budget_bytes: Sequence[int],
    kv_bytes_per_token: int,
) -> Placement:
    """FlexFloor's placement: ``place_lockstep`` kept within each rank's KV budget.

    The one placement rule of the policy, called by the simulator (``rlenergy.sim.moe``) and
    by the trainer SDK's planner (``rlenergy.sdk.planner.RolloutPlanner``): responses sorted
    by predicted length are dealt over the ranks longest first (``place_lockstep``: long
    responses spread, equal loads at every decode step), then ``fit_kv_budget`` moves a
    response whose predicted peak KV does not fit its rank to the rank with the most KV left,
    or marks it ``queued`` when no rank has room.

    Args:
        predicted_tokens: predicted response length per response, tokens, shape ``(n,)``.
        prompt_tokens: prompt length per response, tokens, shape ``(n,)``.
        kv_budget_bytes: KV memory per rank, bytes, shape ``(n_ranks,)`` (``n_ranks >= 1``).
        kv_bytes_per_token: KV cache per context token, bytes.

    Returns:
        The placement; the predicted peak KV of every rank's non-queued responses is within
        its budget.

    Raises:
        InvalidInputError: no rank, or inputs of different lengths.
    """
    dealt = place_lockstep(predicted_tokens, len(kv_budget_bytes))
    return fit_kv_budget(
        dealt, predicted_tokens, prompt_tokens, kv_budget_bytes, kv_bytes_per_token
    )


def place_even(n_responses: int, workers: int) -> tuple[int, ...]:
    """The verl baseline: equal contiguous chunks in dataset order, worker rank per response.

    Raises:
        InvalidInputError: ``workers < 1``.
    """
    if workers < 1:
        raise errors.InvalidInputError("workers", "need at least one rollout worker")
    chunk = math.ceil(n_responses / workers) if n_responses else 1
    return tuple(min(i // chunk, workers - 1) for i in range(n_responses))


FORECAST_SEGMENTS = 16
"""Segments the placement forecast cuts the predicted rollout into (piecewise constant) [MODEL]."""


def forecast_occupied_gpu_s(
    worker_of: Sequence[int],
    predicted_tokens: Sequence[float],
    prompt_tokens: Sequence[int],
    experts_of: Sequence[frozenset[int]],
    layout: base.MoeLayout,
    cost_model: base.StepCostModel,
    *,
    elastic: bool,
) -> float:
    """Predicted occupied GPU-seconds of a placement, from predicted lengths only, GPU-s.

    The rollout is cut at ``FORECAST_SEGMENTS`` order statistics of the predicted lengths and
    at each worker's predicted last end (when it may leave); in a segment starting ``t``
    decode steps in, a worker runs the responses predicted longer than ``t`` (context
    ``prompt + t`` each). ``elastic=False`` keeps every worker for the whole rollout (the verl
    baseline); ``elastic=True`` keeps the workers with a running response, topped up to
    ``layout.release_floor()`` by the lowest idle ranks, plus the fewest further idle ranks
    (lowest first) needed for the kept workers' memory left after their responses' predicted
    peak KV to hold the experts of the idle workers that leave (as the release rule refuses
    a release without that room; all idle workers stay when even that fails), and spreads
    those experts over the kept workers round-robin. (Before: all idle workers stayed
    whenever the busy ones could not hold every idle worker's experts, and only the 16
    order statistics cut the rollout, which overstated a concentrated placement's occupancy
    up to 2.3-fold with exact lengths and made the guard keep verl's even placement.) A
    worker whose responses' predicted peak KV
    is ``x`` times its KV budget runs them in ``x`` waves: its responses' spans are stretched
    ``x``-fold and ``1/x`` of them run at a time. The copies are not charged [MODEL].

    Args:
        worker_of: worker rank per response, shape ``(n,)``.
        predicted_tokens: predicted response length per response, tokens, shape ``(n,)``.
        prompt_tokens: prompt length per response, tokens, shape ``(n,)``.
        experts_of: resident experts per worker at the start, shape ``(workers,)``.
        layout: the group's memory layout (KV bytes per token, floor).
        cost_model: the decode-step time model.
        elastic: whether finished workers leave the group.

    Returns:
        The forecast, GPU-s (0 for an empty batch).

    Raises:
        InvalidInputError: inputs of different lengths.
    """
    n = len(worker_of)
    if len(predicted_tokens) != n or len(prompt_tokens) != n:
        raise errors.InvalidInputError("placement", "need one prediction and prompt per response")
    if n == 0:
        return 0.0
    workers = len(experts_of)
    kvb = layout.kv_bytes_per_token
    # A worker whose responses' predicted peak KV exceeds its KV budget runs them in waves
    # (the engine queues the rest): stretch its responses by that over-subscription [MODEL].
    demand = [0.0] * workers
    for i in range(n):
        demand[worker_of[i]] += (prompt_tokens[i] + predicted_tokens[i]) * kvb
    stretch = [
        max(
            1.0,
            demand[w]
            / max(
                layout.worker_memory_bytes
                - layout.dense_bytes
                - len(experts_of[w]) * layout.expert_bytes,
                1,
            ),
        )
        for w in range(workers)
    ]
    span = [max(float(predicted_tokens[i]), 1.0) * stretch[worker_of[i]] for i in range(n)]
    ends = sorted(span)
    if len(ends) > FORECAST_SEGMENTS:
        last = len(ends) - 1
        ends = [ends[round(i * last / (FORECAST_SEGMENTS - 1))] for i in range(FORECAST_SEGMENTS)]
    # Cut also where each worker's last response is predicted to end: that is when a release
    # becomes possible, so a long last segment does not hide it.
    last_end = [0.0] * workers
    for i in range(n):
        last_end[worker_of[i]] = max(last_end[worker_of[i]], span[i])
    ends.extend(e for e in last_end if e > 0)
    floor = min(layout.release_floor(), workers)
    budget = [
        layout.worker_memory_bytes - layout.dense_bytes - len(experts_of[w]) * layout.expert_bytes
        for w in range(workers)
    ]
    total = 0.0
    start = 0.0
    for cut in sorted(set(ends)):
        running = [0] * workers
        context = [0.0] * workers
        peak = [0.0] * workers  # predicted peak KV of the responses still running, tokens
        for i in range(n):
            if span[i] > start:
                w = worker_of[i]
                running[w] += 1
                context[w] += prompt_tokens[i] + start / stretch[w]
                peak[w] += prompt_tokens[i] + predicted_tokens[i]
        for w in range(workers):
            if stretch[w] > 1.0:  # one wave runs at a time
                running[w] = math.ceil(running[w] / stretch[w])
                context[w] /= stretch[w]
                peak[w] /= stretch[w]
        if elastic:
            group, held = _elastic_group(running, peak, budget, experts_of, floor, layout)
        else:
            group = list(range(workers))
            held = {w: set(experts_of[w]) for w in group}
        states = [
            base.WorkerState(
                worker=w,
                experts=frozenset(held[w]),
                unfinished=running[w],
                kv_bytes=int(context[w] * kvb),
                running=running[w],
            )
            for w in group
        ]
        total += (cut - start) * len(group) * cost_model.decode_step_s(states)
        start = cut
    return total


def _elastic_group(
    running: Sequence[int],
    peak: Sequence[float],
    budget: Sequence[int],
    experts_of: Sequence[frozenset[int]],
    floor: int,
    layout: base.MoeLayout,
) -> tuple[list[int], dict[int, set[int]]]:
    """The workers an elastic group keeps in a forecast segment, and the experts each holds.

    Busy workers (``running > 0``) stay, topped up to ``floor`` by the lowest idle ranks. The
    release rule copies experts only into memory the survivors' predicted KV leaves free
    (``budget - peak x kv_bytes_per_token``, ``peak`` in tokens): keep the fewest further idle
    workers (lowest ranks first) whose room, with that of the busy ones, holds the experts of
    those that leave; as the planner does, part of the idle workers may leave when not all
    can. The leavers' experts go to the kept workers round-robin.
    """
    workers = len(experts_of)
    kvb = layout.kv_bytes_per_token
    busy = [w for w in range(workers) if running[w]]
    idle = [w for w in range(workers) if not running[w]]
    kept = busy + idle[: max(floor - len(busy), 0)]
    spare = idle[max(floor - len(busy), 0) :]
    while True:
        gone = [e for w in spare for e in sorted(experts_of[w])]
        free = sum(budget[w] - peak[w] * kvb for w in kept)
        if free >= len(gone) * layout.expert_bytes or not spare:
            break
        kept.append(spare.pop(0))
    if not spare:
        group = list(range(workers))
        return group, {w: set(experts_of[w]) for w in group}
    group = sorted(kept)
    held = {w: set(experts_of[w]) for w in group}
    for k, expert in enumerate(gone):
        held[group[k % len(group)]].add(expert)
    return group, held


FORECAST_DRAWS = 4
"""Length draws ``expected_occupied_gpu_s`` averages over [MODEL: enough to see the expected
maximum of a worker's noisy lengths; more cost time in the simulator]."""


def expected_occupied_gpu_s(
    worker_of: Sequence[int],
    predicted_tokens: Sequence[float],
    log_sigma: Sequence[float],
    prompt_tokens: Sequence[int],
    experts_of: Sequence[frozenset[int]],
    layout: base.MoeLayout,
    cost_model: base.StepCostModel,
    *,
    elastic: bool,
    max_tokens: float | None = None,
    draws: int = FORECAST_DRAWS,
    seed: int = 0,
) -> float:
    """``forecast_occupied_gpu_s`` averaged over the predictions' error, GPU-s.

    Point predictions hide that a worker's time is set by the *longest* of its responses: a
    worker holding many responses predicted equal will, with noisy predictions, hold one
    that runs much longer. Each draw takes ``predicted x exp(sigma x z)`` per response (``z``
    standard normal, ``sigma`` the predictor's log error for that response,
    ``LengthPredictor.log_error_sigma``), clipped to ``[1, max_tokens]``; the same draws
    serve every placement compared (common random numbers, fixed ``seed``: deterministic).
    With every ``sigma`` 0 this is ``forecast_occupied_gpu_s``.

    Raises:
        InvalidInputError: inputs of different lengths or ``draws < 1``.
    """
    n = len(predicted_tokens)
    if len(log_sigma) != n:
        raise errors.InvalidInputError("log_sigma", "need one error sigma per prediction")
    if draws < 1:
        raise errors.InvalidInputError("draws", "must be >= 1")
    if not any(sg > 0 for sg in log_sigma):
        draws = 1
    rng = random.Random(seed)
    total = 0.0
    for _ in range(draws):
        lengths = []
        for i in range(n):
            x = predicted_tokens[i] * math.exp(log_sigma[i] * rng.gauss(0.0, 1.0))
            if max_tokens is not None:
                x = min(x, max_tokens)
            lengths.append(max(x, 1.0))
        total += forecast_occupied_gpu_s(
            worker_of, lengths, prompt_tokens, experts_of, layout, cost_model, elastic=elastic
        )
    return total / draws


@dataclasses.dataclass(frozen=True)
class FluidFinishModel:
    """Predicted time for one engine (replica, or one DP rank) to decode a set of responses.

    A fluid view of continuous batching: the engine decodes all admitted responses together;
    each decode step costs ``step_fixed_s`` (weights, collectives) plus ``kv_s_per_byte`` for
    every byte of KV cache it reads; it admits responses while their KV fits
    ``kv_capacity_bytes`` and runs at most ``max_running`` at once. For responses with
    prompts ``p_i`` and lengths ``L_i`` (tokens) the KV byte-steps are ``A = sum (p_i + L_i
    / 2) x L_i x kv_bytes_per_token``, the decode steps ``max(max L_i, A / capacity, sum L_i
    / max_running)`` and the time ``steps x step_fixed_s + A x kv_s_per_byte``, at least
    ``sum L_i x compute_s_per_token``. Pure; additive, so a placement can add responses one
    at a time. The simulator fits the parameters to its own step model
    (``rlenergy.sim.moe.fluid_model``); a deployment fits them to measured decode-step times
    (the step time at an empty and at a full KV cache).

    Attributes:
        step_fixed_s: decode step time at (almost) no KV, s.
        kv_s_per_byte: added step time per byte of KV in the batch, s/B.
        kv_capacity_bytes: KV memory of the engine, bytes (> 0).
        kv_bytes_per_token: KV per context token, bytes.
        max_running: responses decoded at once at most (vLLM ``max_num_seqs``).
        compute_s_per_token: compute-bound floor per generated token, s (0: none).
    """

    step_fixed_s: float
    kv_s_per_byte: float
    kv_capacity_bytes: float
    kv_bytes_per_token: int
    max_running: int
    compute_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_capacity_bytes <= 0 or self.max_running < 1:
            raise errors.InvalidInputError(
                "placement", "an engine needs KV memory and room for one running response"
            )

    def finish_s(self, load: EngineLoad) -> float:
        """Predicted time to decode everything in ``load``, s (0 for no response)."""
        if load.tokens <= 0:
            return 0.0
        steps = max(
            load.longest_tokens,
            load.kv_byte_steps / self.kv_capacity_bytes,
            load.tokens / self.max_running,
        )
        memory = steps * self.step_fixed_s + load.kv_byte_steps * self.kv_s_per_byte
        return max(memory, load.tokens * self.compute_s_per_token)

    def add(self, load: EngineLoad, prompt_tokens: float, length_tokens: float) -> EngineLoad:
        """``load`` with one more response of ``prompt_tokens`` and ``length_tokens``."""
        length = max(float(length_tokens), 1.0)
        return EngineLoad(
            tokens=load.tokens + length,
            longest_tokens=max(load.longest_tokens, length),
            kv_byte_steps=load.kv_byte_steps
            + (float(prompt_tokens) + length / 2.0) * length * self.kv_bytes_per_token,
        )


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """What ``FluidFinishModel`` needs of the responses on one engine.

    Attributes:
        tokens: predicted response tokens, tokens.
        longest_tokens: the longest predicted response, tokens.
        kv_byte_steps: ``sum (prompt + length / 2) x length x kv_bytes_per_token``, B x steps.
    """

    tokens: float = 0.0
    longest_tokens: float = 0.0
    kv_byte_steps: float = 0.0


def place_balanced(
    predicted_tokens: Sequence[float],
    prompt_tokens: Sequence[int],
    engines: int,
    model: FluidFinishModel,
) -> tuple[int, ...]:
    """Balance predicted finish times over ``engines``: longest first, to the earliest finisher.

    The longest-processing-time-first rule (Graham 1969: makespan within 4/3 of optimal for
    identical machines): responses sorted by predicted length, longest first, each placed on
    the engine whose predicted finish (``model.finish_s``) after adding it is earliest (ties:
    the engine with fewer predicted tokens, then the lowest). Memory-aware through the model:
    KV byte-steps beyond an engine's capacity cost extra decode steps (waves), so a placement
    that would overfill an engine's KV is predicted slower and avoided. Responses of one
    prompt (a GRPO group, predicted alike) are spread over engines, which hedges against a
    group that runs long together.

    Args:
        predicted_tokens: predicted response length per response, tokens, shape ``(n,)``.
        prompt_tokens: prompt length per response, tokens, shape ``(n,)``.
        engines: engines (replicas or DP ranks), >= 1.
        model: the finish-time model of one engine.

    Returns:
        Engine per response, shape ``(n,)``.

    Raises:
        InvalidInputError: ``engines < 1`` or inputs of different lengths.
    """
    n = len(predicted_tokens)
    if engines < 1:
        raise errors.InvalidInputError("workers", "need at least one rollout engine")
    if len(prompt_tokens) != n:
        raise errors.InvalidInputError("prompt_tokens", "need one prompt length per response")
    loads = [EngineLoad() for _ in range(engines)]
    out = [0] * n
    for i in sorted(range(n), key=lambda i: (-predicted_tokens[i], i)):
        best_e, best_load, best = 0, loads[0], (math.inf, math.inf)
        for e in range(engines):
            cand = model.add(loads[e], prompt_tokens[i], predicted_tokens[i])
            key = (model.finish_s(cand), cand.tokens)  # ties: the engine with less work
            if key < best:
                best_e, best_load, best = e, cand, key
        loads[best_e] = best_load
        out[i] = best_e
    return tuple(out)


def predicted_makespan_s(
    engine_of: Sequence[int],
    predicted_tokens: Sequence[float],
    prompt_tokens: Sequence[int],
    engines: int,
    model: FluidFinishModel,
) -> float:
    """The latest predicted engine finish (``model.finish_s``) of a placement, s.

    Raises:
        InvalidInputError: inputs of different lengths or an engine outside ``[0, engines)``.
    """
    if len(engine_of) != len(predicted_tokens) or len(prompt_tokens) != len(engine_of):
        raise errors.InvalidInputError("placement", "need one engine, length and prompt each")
    loads = [EngineLoad() for _ in range(engines)]
    for e, length, prompt in zip(engine_of, predicted_tokens, prompt_tokens, strict=True):
        if not 0 <= e < engines:
            raise errors.InvalidInputError("placement", f"engine {e} outside [0, {engines})")
        loads[e] = model.add(loads[e], prompt, length)
    return max((model.finish_s(x) for x in loads), default=0.0)


def place_lockstep(predicted_tokens: Sequence[float], ranks: int) -> tuple[int, ...]:
    """Deal a batch over the ranks of one lock-stepped EP group, longest predicted first.

    The ranks of one EP group take every decode step together, so a step lasts as long as the
    slowest rank's (its KV reads, its batch) plus the all-to-all: what a group needs is the
    same load on every rank at *every* step, not equal predicted finish times per rank (which
    ``place_balanced`` gives independent engines; inside a group it piles the short responses
    on the ranks that drew no long one, and that rank then sets every step's time: measured
    x0.957 in one step of ``verl-ppo-qwen25-7b-gsm8k-16gpu``, ranks holding 1 to 74
    responses). Responses sorted by predicted length (longest first, ties by index) are dealt
    in boustrophedon order (0, 1, .., R-1, R-1, .., 0, ...): at every decode step, under the
    predictions, the ranks' running responses differ by at most one, as do their counts, and
    each rank's predicted tokens are within one response of the others'. Responses predicted
    alike (one GRPO group before any history) are dealt to different ranks, which hedges
    against a group that runs long together. Ranks of one group have equal memory, so equal
    loads also keep the KV within each rank's share.

    Args:
        predicted_tokens: predicted response length per response, tokens, shape ``(n,)``.
        ranks: ranks of the group, >= 1.

    Returns:
        Rank per response, shape ``(n,)``.

    Raises:
        InvalidInputError: ``ranks < 1``.
    """
    if ranks < 1:
        raise errors.InvalidInputError("workers", "need at least one rollout worker")
    n = len(predicted_tokens)
    out = [0] * n
    for k, i in enumerate(sorted(range(n), key=lambda i: (-predicted_tokens[i], i))):
        lap, pos = divmod(k, ranks)
        out[i] = pos if lap % 2 == 0 else ranks - 1 - pos
    return tuple(out)


def lockstep_makespan_s(
    rank_of: Sequence[int],
    predicted_tokens: Sequence[float],
    prompt_tokens: Sequence[int],
    ranks: int,
    model: FluidFinishModel,
) -> float:
    """Predicted time of one lock-stepped EP group to decode a placement, s.

    Every rank takes every step until the longest response ends; a step costs
    ``model.step_fixed_s`` plus ``model.kv_s_per_byte`` times the KV of the rank reading
    the most (the all-to-all waits for it). A rank's KV at decode step ``t`` is ``sum over
    its responses still running (prompt + t) x kv_bytes_per_token``; between two predicted
    ends it is linear in ``t``, and the maximum over ranks is integrated by the trapezoid
    rule at the ends [MODEL: exact when one rank leads the whole segment, else an upper
    bound, the maximum of lines being convex]. KV over the rank's capacity is not modelled
    (``place_lockstep`` loads the ranks equally).

    Raises:
        InvalidInputError: inputs of different lengths or a rank outside ``[0, ranks)``.
    """
    n = len(rank_of)
    if len(predicted_tokens) != n or len(prompt_tokens) != n:
        raise errors.InvalidInputError("placement", "need one rank, length and prompt each")
    if any(not 0 <= r < ranks for r in rank_of):
        raise errors.InvalidInputError("placement", f"a rank outside [0, {ranks})")
    span = [max(float(x), 1.0) for x in predicted_tokens]
    kvb = model.kv_bytes_per_token
    count = [0] * ranks  # responses still running per rank
    prompts = [0.0] * ranks  # their prompt tokens
    for i in range(n):
        count[rank_of[i]] += 1
        prompts[rank_of[i]] += prompt_tokens[i]

    def peak_kv(t: float) -> float:
        return max((prompts[r] + count[r] * t) * kvb for r in range(ranks))

    total = 0.0
    start = 0.0
    order = sorted(range(n), key=lambda i: span[i])
    k = 0
    while k < n:
        end = span[order[k]]
        # The responses ending at ``end`` still run up to it.
        area = (peak_kv(start) + peak_kv(end)) / 2
        total += (end - start) * (model.step_fixed_s + model.kv_s_per_byte * area)
        while k < n and span[order[k]] == end:
            count[rank_of[order[k]]] -= 1
            prompts[rank_of[order[k]]] -= prompt_tokens[order[k]]
            k += 1
        start = end
    return total
