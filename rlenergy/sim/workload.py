"""RL step workloads for the simulator: real traces rescaled to a SKU, and synthetic ones.

A ``StepWork`` is one RL step's GPU work on a simulated SKU: per phase the time it would take
at maximum boost clock (``boost_time_s``), the context length that sets how memory bound decode
is, and the token workload the SDK would report. Phase times logged on another GPU are
rescaled through ``rlenergy.gpu.models`` (generation by memory bandwidth, training by dense
BF16 throughput [MODEL]); token counts are used as logged.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Collection

from rlenergy.api import phases as api_phases
from rlenergy.api import workload as api_workload
from rlenergy.gpu import models
from rlenergy.sim import traces

PHASES: tuple[str, ...] = ("generation", "training")
"""Phase names of an RL step, in order (sync mode), as the default policy names them."""

DECODE_ITERATION_SHAPE = 0.15
"""How much decode iterations speed up as the batch drains, relative to token throughput
(which falls with the number of active sequences) [MODEL]."""


def reported_progress(x: float, k: float) -> float:
    """Share of a phase's progress the SDK has reported at work fraction ``x`` (0..1).

    The reporting rate per unit of work rises linearly over the phase, from 1 at the start to
    ``k`` times that at the end (``PhaseWork.progress_shape``; ``k = 1``: proportional):
    ``F(x) = (x + (k - 1) x**2 / 2) / ((k + 1) / 2)`` [MODEL]. Decode iterations get cheaper
    as sequences finish, so iterations speed up over a rollout and stay bounded at its end.
    (The earlier ``1 - (1 - x)**k`` had iterations slow down to a halt at the end, against
    that reasoning: its rate falls to 0 at ``x = 1`` with infinite slope, and a Thue-Morse
    probe block over a rollout's last slices then read the low clock 0.02-0.036 faster than
    it was, measured on the full-stack replay at 12-25 ms report gaps; a rate linear
    in ``x`` is a trend such a block cancels.)

    Args:
        x: work fraction done, clamped to [0, 1].
        k: the phase's progress shape, >= 1.

    Returns:
        Reported progress as a share of the phase's total, in [0, 1].
    """
    x = min(max(x, 0.0), 1.0)
    return (x + (k - 1.0) * x * x / 2.0) / ((k + 1.0) / 2.0)


@dataclasses.dataclass(frozen=True)
class PhaseWork:
    """One phase of one step on the simulated SKU.

    Attributes:
        name: phase name (``generation``, ``training``, or a training sub-phase of
            ``rlenergy.api.phases.TRAINING_SUBPHASES`` in a replay split by sub-phase).
        kind: phase kind for the GPU model.
        boost_time_s: time at max boost clock with all the job's GPUs, s.
        progress_shape: shape ``k`` of the progress the SDK reports over the phase's work
            fraction ``x`` (``reported_progress``: the rate rises linearly to ``k`` times its
            start). Generation reports decode iterations (engine steps): an iteration gets
            cheaper as sequences finish and their KV reads stop, so iterations speed up over
            the phase, ``k = 1 + DECODE_ITERATION_SHAPE * (max / mean response length - 1)``;
            training reports tokens of finished micro-batches, ``k = 1``.
    """

    name: str
    kind: models.PhaseKind
    boost_time_s: float
    progress_shape: float


@dataclasses.dataclass(frozen=True)
class StepWork:
    """One RL step.

    Attributes:
        index: position in the replay, 0-based.
        source_step: the step number in the trace (or the synthetic step).
        cycle: how many times the trace has wrapped before this step.
        phases: generation then training (or training's sub-phases, in step order).
        other_time_s: rest of the step with GPUs near idle, s.
        workload: the token workload the SDK reports.
    """

    index: int
    source_step: int
    cycle: int
    phases: tuple[PhaseWork, ...]
    other_time_s: float
    workload: api_workload.TokenWorkload

    def phase(self, name: str) -> PhaseWork:
        """The phase called ``name``."""
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(name)


@dataclasses.dataclass(frozen=True)
class Replay:
    """Steps to simulate plus what the conversion noted."""

    name: str
    steps: tuple[StepWork, ...]
    num_gpus: int
    notes: tuple[str, ...]

    @property
    def phase_names(self) -> tuple[str, ...]:
        """The phases every step runs, in order."""
        return tuple(p.name for p in self.steps[0].phases)


def phase_groups(
    replay_phases: tuple[str, ...], policy_phases: Collection[str]
) -> dict[str, tuple[str, ...]]:
    """The phases a policy sees, in step order, and the replay's phases each one covers.

    A replay phase the policy names is its own phase; a training sub-phase it does not name
    is part of ``training``, as the trainer signals it (``rlenergy.api.phases.signal_name``).
    ``training`` takes its place at its first sub-phase: a sub-phase named between two unnamed
    ones runs after them [MODEL: same time and energy in sync mode].

    Args:
        replay_phases: ``Replay.phase_names``.
        policy_phases: phase names of the policy.

    Returns:
        ``{policy-level phase: (replay phases, in order)}``, insertion-ordered.
    """
    groups: dict[str, list[str]] = {}
    for name in replay_phases:
        if name in policy_phases or name not in api_phases.SUBPHASE_BY_NAME:
            key = name
        else:
            key = api_phases.TRAINING
        groups.setdefault(key, []).append(name)
    return {k: tuple(v) for k, v in groups.items()}


def _subphases(
    rec: traces.StepRecord, parts: tuple[str, ...]
) -> tuple[tuple[api_phases.SubPhase, float], ...]:
    logged = dict(rec.train_parts_s)
    return tuple((api_phases.SUBPHASE_BY_TIMING_KEY[k], logged.get(k, 0.0)) for k in parts)


def _workload(rec: traces.StepRecord) -> api_workload.TokenWorkload:
    return api_workload.TokenWorkload(
        samples=rec.samples,
        response_tokens=rec.response_tokens,
        prompt_tokens=rec.prompt_tokens,
        valid_tokens=rec.valid_tokens,
        mean_context_tokens=rec.prompt_length_mean + rec.response_length_mean / 2.0,
    )


def from_trace(
    trace: traces.Trace, sku: models.GpuSku, steps: int, *, split: bool = False
) -> Replay:
    """Rescale a trace to ``sku`` and replay it for ``steps`` steps (cyclically if shorter).

    Args:
        trace: the parsed trace.
        sku: the simulated GPU.
        steps: steps to replay.
        split: run the training side as the sub-phases the trace logs
            (``StepRecord.train_parts_s``), each with its own kind (``forward`` for
            log-probability and value passes, ``training`` for updates); default: one
            ``training`` phase of kind ``training``, as before sub-phases existed.

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    notes = list(trace.notes)
    ref = models.match_reference_gpu(trace.gpu_description)
    if ref is None:
        gen_scale = train_scale = 1.0
        notes.append(
            f"trace GPU not identified ({trace.gpu_description or 'not stated'}): phase times "
            f"used as if recorded on {sku.key}"
        )
    else:
        gen_scale = ref.memory_bandwidth_tbps / sku.memory_bandwidth_tbps
        train_scale = ref.dense_bf16_tflops / sku.dense_bf16_tflops
        notes.append(
            f"phase times rescaled from {ref.key} to {sku.key}: generation x{gen_scale:.3f} "
            f"(memory bandwidth), training x{train_scale:.3f} (dense BF16)"
        )
    n = len(trace.steps)
    if steps > n:
        notes.append(
            f"trace has {n} steps, replayed cyclically to {steps} "
            f"({math.ceil(steps / n) - 1} wrap(s); each wrap is a workload jump)"
        )
    gen_default = sku.effective_clock_mhz("generation", None)
    part_default = {kind: sku.effective_clock_mhz(kind, None) for kind in ("forward", "training")}
    train_default = part_default["training"]
    logged = {k for rec in trace.steps for k, _ in rec.train_parts_s}
    parts = tuple(k for k in traces.TRAIN_TIME_PARTS if k in logged)
    if split:
        names = ", ".join(parts) or "none"
        notes.append(f"training split into the sub-phases the trace logs: {names}")
    out: list[StepWork] = []
    for i in range(steps):
        rec = trace.steps[i % n]
        wl = _workload(rec)
        gen_factor = sku.time_factor("generation", gen_default, wl.mean_context_tokens)
        tail = max(rec.response_length_max / max(rec.response_length_mean, 1.0), 1.0)
        shape = 1.0 + DECODE_ITERATION_SHAPE * (tail - 1.0)
        gen = PhaseWork("generation", "generation", rec.gen_time_s * gen_scale / gen_factor, shape)
        if split and parts:
            train = tuple(
                PhaseWork(
                    sub.name,
                    sub.kind,
                    seconds
                    * train_scale
                    / sku.time_factor(sub.kind, part_default[sub.kind], wl.mean_context_tokens),
                    1.0,
                )
                for sub, seconds in _subphases(rec, parts)
            )
        else:
            train_factor = sku.time_factor("training", train_default, wl.mean_context_tokens)
            train = (
                PhaseWork(
                    "training", "training", rec.train_time_s * train_scale / train_factor, 1.0
                ),
            )
        out.append(
            StepWork(
                index=i,
                source_step=rec.step,
                cycle=i // n,
                phases=(gen, *train),
                other_time_s=rec.other_time_s,
                workload=wl,
            )
        )
    return Replay(trace.name, tuple(out), trace.num_gpus, tuple(notes))


def synthetic(
    steps: int,
    *,
    seed: int = 0,
    samples: int = 1024,
    prompt_mean: float = 200.0,
    response_start: float = 400.0,
    response_end: float = 1600.0,
    response_cap: int = 4096,
    sigma: float = 0.8,
    drift_at: int | None = None,
    num_gpus: int = 8,
) -> Replay:
    """A synthetic heavy-tailed workload with response-length drift [MODEL].

    Response lengths are lognormal with shape ``sigma``; their mean moves from
    ``response_start`` to ``response_end`` linearly over the run, or jumps at step ``drift_at``
    when given. Generation time follows decode iterations (the longest response) and tokens;
    training time follows all tokens. Times are at max boost on an H100-class GPU [MODEL].

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    rng = random.Random(seed)
    out: list[StepWork] = []
    for i in range(steps):
        if drift_at is None:
            frac = i / max(steps - 1, 1)
            mean = response_start + (response_end - response_start) * frac
        else:
            mean = response_start if i < drift_at else response_end
        mu = math.log(mean) - sigma**2 / 2
        lengths = [min(response_cap, max(1, int(rng.lognormvariate(mu, sigma)))) for _ in range(64)]
        resp_mean = sum(lengths) / len(lengths)
        resp_max = float(max(lengths))
        wl = api_workload.TokenWorkload(
            samples=samples,
            response_tokens=samples * resp_mean,
            prompt_tokens=samples * prompt_mean,
            valid_tokens=samples * resp_mean,
            mean_context_tokens=prompt_mean + resp_mean / 2,
        )
        jitter = rng.lognormvariate(0.0, 0.02)
        gen_s = (0.012 * resp_max + 2.0e-6 * wl.response_tokens) * jitter
        train_s = 1.2e-5 * (wl.prompt_tokens + wl.response_tokens) * rng.lognormvariate(0.0, 0.01)
        out.append(
            StepWork(
                index=i,
                source_step=i,
                cycle=0,
                phases=(
                    PhaseWork(
                        "generation",
                        "generation",
                        gen_s,
                        1.0 + DECODE_ITERATION_SHAPE * max(resp_max / resp_mean - 1.0, 0.0),
                    ),
                    PhaseWork("training", "training", train_s, 1.0),
                ),
                other_time_s=0.02 * (gen_s + train_s),
                workload=wl,
            )
        )
    return Replay("synthetic", tuple(out), num_gpus, ("synthetic lognormal workload [MODEL]",))
