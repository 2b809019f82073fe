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

``place_even`` is the verl baseline: ``DataProto.chunk`` splits the batch into equal contiguous
chunks, one per rollout worker, in dataset order (a GRPO group stays on one worker).

Pure and deterministic (ties broken by response index).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

from rlenergy import errors


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
        InvalidInputError: no worker, lengths of the inputs differ, a cap below 1, or a single
            response needs more KV than any worker has.
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


def place_even(n_responses: int, workers: int) -> tuple[int, ...]:
    """The verl baseline: equal contiguous chunks in dataset order, worker rank per response.

    Raises:
        InvalidInputError: ``workers < 1``.
    """
    if workers < 1:
        raise errors.InvalidInputError("workers", "need at least one rollout worker")
    chunk = math.ceil(n_responses / workers) if n_responses else 1
    return tuple(min(i // chunk, workers - 1) for i in range(n_responses))
