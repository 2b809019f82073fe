"""Rollout scenarios from real traces, both policies side by side, metrics and rendering.

Response lengths come from a trace's per-step ``response_length/{mean,min,max}`` (and
``clip_ratio`` where logged): each simulated step draws from a lognormal fitted to that step
(``fit_lognormal``) clipped to ``[min, max]``, optionally with a synthetic heavy tail. A
response's log length is a per-prompt effect (``PROMPT_SHARE_OF_LOG_VARIANCE`` of the variance,
fitted to verl#3727's logged per-rank finish spread) plus per-sample noise; prompts recur every
``STEPS_PER_EPOCH`` steps and their effect drifts between epochs (``PROMPT_PERSISTENCE``
[MODEL]), so the FlexFloor predictor has a history of known quality to learn from; the first
epoch runs on its quantile fallback. Both policies decode the identical batches on a pool of
``Scenario.replicas`` independent EP groups (``rlenergy.sim.moe.simulate_pool``).

Callers: the CLI ``rlenergy rollout-sim`` and ``bench/rollout.py``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import statistics
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import numpy as np
import numpy.typing as npt

from rlenergy import errors
from rlenergy.sim import moe, traces

VARIANCE_SHARE_PROMPT = 0.648
"""Share of response-length variance explained by prompt identity (TailSieve App. B, two-factor
decomposition over up to 30 checkpoints, Qwen3 / Qwen3.5 incl. 30B-A3B, max 16K:
``data/flexfloor/length_predictability.csv``) [V]."""

VARIANCE_SHARE_SAMPLING = 0.261
"""Share from sampling (same prompt, same checkpoint) (TailSieve App. B) [V]."""

VARIANCE_SHARE_CHECKPOINT = 0.022
"""Share from the checkpoint (policy drift of the whole distribution) (TailSieve App. B) [V].
The simulator takes each step's mean and spread from the trace, which carries this drift."""

VARIANCE_SHARE_INTERACTION = 0.069
"""Prompt x checkpoint interaction: a prompt's own drift between checkpoints (TailSieve) [V]."""

PROMPT_SHARE_OF_LOG_VARIANCE = (VARIANCE_SHARE_PROMPT + VARIANCE_SHARE_INTERACTION) / (
    1.0 - VARIANCE_SHARE_CHECKPOINT
)
"""Share of a response's log-length variance within one step that belongs to its prompt
(shared by the responses of one GRPO group): (prompt + interaction) / (1 - checkpoint) =
0.733 [D from TailSieve's decomposition; applied to log length, which the generator draws:
the decomposition was of raw length, an approximation]. The rest (0.267) is per-sample noise.
Before: 0.25, fitted to verl#3727's logged rank spread with an unmeasured group size (and
0.5 before that, a mid-point); the measured decomposition replaces both."""

PROMPT_PERSISTENCE = VARIANCE_SHARE_PROMPT / (VARIANCE_SHARE_PROMPT + VARIANCE_SHARE_INTERACTION)
"""Correlation of a prompt's length effect between any two epochs: prompt / (prompt +
interaction) = 0.904 [D from TailSieve]. A prompt's effect is a permanent part (this share of
its variance) plus a fresh per-epoch part (the interaction), so the correlation does not decay
with distance, as TailSieve's tail-ranking AUC does not (0.957-0.985 between adjacent
checkpoints, 0.952-0.985 from checkpoint 1 to 30). Before: 0.7 [MODEL] in an AR(1)."""

STEPS_PER_EPOCH = 4
"""Simulated steps per dataset epoch: prompts recur every 4 steps, so steps after the first
four have one or more epochs of history [MODEL: short epochs keep the run small]. A real epoch
is much longer (e.g. 17k prompts at 128 per step: about 130 steps) and long-reasoning runs
often see each prompt only 1-3 times, so the share of cold steps (quantile fallback, no
per-prompt history) is far larger than here: the ``warm`` ratios are an upper bound on what a
real run's first epoch sees."""

PROMPT_TOKENS_SIGMA = 0.3
"""Lognormal spread of prompt lengths around the logged mean [MODEL]."""

HEAVY_TAIL_ALPHA = 1.2
"""Pareto shape of the synthetic heavy tail (smaller: heavier) [MODEL]."""

MAX_RESPONSES_PER_STEP = 4096
"""Responses simulated per step at most (larger logged batches are subsampled; only the
length distribution and responses per worker matter) [MODEL: keeps the bench fast]."""

DEFAULT_GROUP_SIZE = 8
"""Responses per prompt when the trace does not state ``rollout_n`` [MODEL: common GRPO n]."""


@dataclasses.dataclass(frozen=True)
class StepLengths:
    """Response-length statistics of one logged step.

    Attributes:
        step: logged step number.
        mean_tokens: ``response_length/mean``.
        min_tokens: ``response_length/min`` (1 when not logged).
        max_tokens: ``response_length/max``.
        clip_ratio: ``response_length/clip_ratio`` (share at the length limit), if logged.
        responses: responses generated in the step.
        group_size: responses per prompt (``rollout_n``).
        prompt_tokens_mean: ``prompt_length/mean`` (0 when not logged).
        max_response_tokens: the run's ``max_response_length`` limit.
        log_sigma: the spread of the log length when known from elsewhere (then the mean
            alone fixes the lognormal, clipped at ``max_response_tokens``); ``None``: fitted
            to mean and max (``fit_lognormal``).
    """

    step: int
    mean_tokens: float
    min_tokens: float
    max_tokens: float
    clip_ratio: float | None
    responses: int
    group_size: int
    prompt_tokens_mean: float
    max_response_tokens: int
    log_sigma: float | None = None


def _csv_rows(name: str) -> list[dict[str, str]]:
    root = resources.files("rlenergy.sim").joinpath("data/traces")
    return list(csv.DictReader(io.StringIO(root.joinpath(f"{name}.csv").read_text())))


def _num(row: Mapping[str, str] | Mapping[str, float], key: str) -> float | None:
    cell = row.get(key)
    try:
        value = float(cell if isinstance(cell, float) else (cell or "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def trace_step_lengths(name: str) -> tuple[StepLengths, ...]:
    """Per-step length statistics of a packaged trace, or of one ``samples:<sample_id>`` row.

    Raises:
        InvalidInputError: unknown trace or sample, or no step with mean and max lengths.
    """
    if name.startswith("samples:"):
        return (_sample_row(name.split(":", 1)[1]),)
    label, rows, meta_rows = traces.load_rows(name)  # a packaged name, a CSV or a verl log
    trace = traces.build_trace(label, rows, meta_rows)  # samples per step and meta
    meta: Mapping[str, Any] = trace.meta
    group = int(meta.get("rollout_n") or 1)
    limit_meta = meta.get("max_response_length")
    by_step = {int(r["step"]): r for r in rows if math.isfinite(r.get("step", math.nan))}
    out = []
    for rec in trace.steps:
        row = by_step.get(rec.step, {})
        mean = _num(row, "response_length/mean")
        high = _num(row, "response_length/max")
        if mean is None or high is None or mean < 1:
            continue
        limit = int(limit_meta) if isinstance(limit_meta, int | float) else int(high)
        out.append(
            StepLengths(
                step=rec.step,
                mean_tokens=mean,
                min_tokens=max(_num(row, "response_length/min") or 1.0, 1.0),
                max_tokens=max(high, mean),
                clip_ratio=_num(row, "response_length/clip_ratio"),
                responses=rec.generated_samples,
                group_size=group,
                prompt_tokens_mean=rec.prompt_length_mean,
                max_response_tokens=max(limit, int(high)),
            )
        )
    if not out:
        raise errors.InvalidInputError("--trace", f"{name}: no step logs response length mean/max")
    return tuple(out)


def _sample_row(sample_id: str) -> StepLengths:
    rows = [r for r in _csv_rows("samples") if r.get("sample_id") == sample_id]
    ids = sorted({r.get("sample_id", "") for r in _csv_rows("samples")})
    if not rows:
        raise errors.InvalidInputError(
            "--trace", f"unknown sample {sample_id!r}; samples: {', '.join(ids)}"
        )
    row = rows[0]
    mean = _num(row, "response_length/mean")
    high = _num(row, "response_length/max")
    if mean is None or high is None:
        raise errors.InvalidInputError("--trace", f"sample {sample_id} logs no length mean/max")
    meta = _samples_meta().get(sample_id, {})
    batch = int(meta.get("train_batch_size") or 128)
    limit = _num(row, "max_response_length") or high
    return StepLengths(
        step=int(_num(row, "step") or 0),
        mean_tokens=mean,
        min_tokens=max(_num(row, "response_length/min") or 1.0, 1.0),
        max_tokens=high,
        clip_ratio=_num(row, "response_length/clip_ratio"),
        responses=batch * DEFAULT_GROUP_SIZE,
        group_size=DEFAULT_GROUP_SIZE,
        prompt_tokens_mean=_num(row, "prompt_length/mean") or 0.0,
        max_response_tokens=int(limit),
    )


def _samples_meta() -> Mapping[str, Mapping[str, Any]]:
    import json

    root = resources.files("rlenergy.sim").joinpath("data/traces")
    data = json.loads(root.joinpath("samples.meta.json").read_text())
    rows = data.get("rows", {})
    return rows if isinstance(rows, dict) else {}


def _clipped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """``E[min(X, cap)]`` for ``ln X ~ N(mu, sigma^2)``."""
    dist = statistics.NormalDist()
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * dist.cdf(z - sigma) + cap * (1 - dist.cdf(z))


def solve_log_mean(mean_tokens: float, sigma: float, cap_tokens: float) -> float:
    """``mu`` such that ``E[min(X, cap)] = mean_tokens`` for ``ln X ~ N(mu, sigma^2)``.

    Raises:
        InvalidInputError: the mean is not below the cap, or ``sigma <= 0``.
    """
    if not 1.0 <= mean_tokens < cap_tokens or sigma <= 0:
        raise errors.InvalidInputError(
            "lengths", f"need 1 <= mean {mean_tokens} < cap {cap_tokens} and sigma > 0"
        )
    lo, hi = -20.0, math.log(cap_tokens) + 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _clipped_lognormal_mean(mid, sigma, cap_tokens) > mean_tokens:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def fit_lognormal(
    mean_tokens: float,
    max_tokens: float,
    n: int,
    clip_ratio: float | None,
    *,
    min_tokens: float | None = None,
    limit_tokens: float | None = None,
) -> tuple[float, float]:
    """Fit ``ln L ~ N(mu, sigma^2)`` clipped at ``max_tokens`` to a step's mean and max (or min).

    The logged max anchors a quantile: ``1 - clip_ratio`` when responses hit the limit and the
    clip ratio is logged, else the expected maximum of ``n`` draws (``1 - 1 / (n + 1)``);
    ``sigma`` is then solved (bisection) so the clipped mean equals the logged mean.

    When the max *is* the run's limit (``max_tokens >= limit_tokens``) and no clip ratio is
    logged, the max is a censoring point, not an order statistic: some unknown share of the
    responses was truncated there. The logged min then anchors the lower quantile instead
    (``ln min = mu - z sigma`` with ``z`` the expected minimum of ``n`` draws), and ``sigma``
    is solved so the mean clipped at the limit equals the logged mean; the implied clip share
    follows from the fit (verl#3727's Qwen3-VL-30B-A3B step: mean 11,018, min 665, max =
    limit 30,000 gives sigma 0.82 and 6.4 % at the limit).

    Returns:
        ``(mu, sigma)`` of the log length (natural log of tokens).
    """
    if max_tokens <= mean_tokens * 1.0001:
        return math.log(max(mean_tokens, 1.0)), 1e-3
    if (
        clip_ratio is None
        and min_tokens is not None
        and limit_tokens is not None
        and max_tokens >= limit_tokens
        and 1.0 < min_tokens < mean_tokens
    ):
        z_min = statistics.NormalDist().inv_cdf(1.0 - 1.0 / (n + 1))
        log_min = math.log(min_tokens)
        lo, hi = 1e-3, 4.0
        for _ in range(80):
            mid = (lo + hi) / 2
            if _clipped_lognormal_mean(log_min + mid * z_min, mid, max_tokens) > mean_tokens:
                hi = mid
            else:
                lo = mid
        sigma = (lo + hi) / 2
        return log_min + sigma * z_min, sigma
    q = 1.0 - 1.0 / (n + 1)
    if clip_ratio is not None and 0 < clip_ratio < 0.5:
        q = 1.0 - clip_ratio
    z = statistics.NormalDist().inv_cdf(q)
    log_max = math.log(max_tokens)
    lo, hi = 1e-3, 4.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if _clipped_lognormal_mean(log_max - mid * z, mid, max_tokens) > mean_tokens:
            lo = mid
        else:
            hi = mid
    sigma = (lo + hi) / 2
    return log_max - sigma * z, sigma


@dataclasses.dataclass(frozen=True)
class Scenario:
    """What to simulate.

    Attributes:
        trace: packaged trace name or ``samples:<sample_id>``.
        config: the EP group.
        steps: rollout steps to simulate (evenly spaced over the trace's steps).
        heavy_tail_fraction: share of responses replaced by a synthetic Pareto tail reaching
            the run's length limit (0: lengths from the trace fit only).
        seed: random seed (identical inputs for both policies by construction).
        replicas: independent EP groups (engine replicas) of ``config.workers`` ranks each;
            the pool has ``replicas x workers`` GPUs (``moe.simulate_pool``).
        prompt_persistence: correlation of a prompt's length effect between consecutive
            epochs (``PROMPT_PERSISTENCE``).
        prompt_share: share of the log-length variance that is per prompt
            (``PROMPT_SHARE_OF_LOG_VARIANCE``).
        exact_lengths: give FlexFloor the true lengths instead of the predictor's (an upper
            bound on what prediction can give; not a deployable policy).
        name: the named scenario (``rollout_scenarios``) this is, if any.
        lengths: per-step length statistics to use instead of the trace's.
        max_responses: responses simulated per step at most.
    """

    trace: str
    config: moe.RolloutConfig
    steps: int = 12
    heavy_tail_fraction: float = 0.0
    seed: int = 0
    replicas: int = 1
    prompt_persistence: float = PROMPT_PERSISTENCE
    prompt_share: float = PROMPT_SHARE_OF_LOG_VARIANCE
    exact_lengths: bool = False
    name: str | None = None
    lengths: tuple[StepLengths, ...] | None = None
    max_responses: int = MAX_RESPONSES_PER_STEP

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise errors.InvalidInputError("--steps", "must be >= 1")
        if self.replicas < 1:
            raise errors.InvalidInputError("--replicas", "must be >= 1")
        if not 0.0 <= self.prompt_persistence <= 1.0:
            raise errors.InvalidInputError("--prompt-persistence", "must be within [0, 1]")
        if not 0.0 <= self.prompt_share <= 1.0:
            raise errors.InvalidInputError("--prompt-share", "must be within [0, 1]")
        if not 0.0 <= self.heavy_tail_fraction < 1.0:
            raise errors.InvalidInputError("--heavy-tail", "must be within [0, 1)")


def make_batches(scenario: Scenario) -> tuple[list[moe.RolloutBatch], int]:
    """Draw the rollout batches of a scenario (both policies get these).

    Returns:
        The batches and the run's ``max_response_length``.
    """
    stats = scenario.lengths or trace_step_lengths(scenario.trace)
    rng = np.random.default_rng(scenario.seed)
    picks = np.linspace(0, len(stats) - 1, num=scenario.steps).round().astype(int)
    first = stats[int(picks[0])]
    n = min(first.responses, scenario.max_responses)
    group = max(1, min(first.group_size, n))
    prompts_per_step = max(1, n // group)
    n = prompts_per_step * group
    dataset = prompts_per_step * STEPS_PER_EPOCH
    prompt_scale = rng.lognormal(0.0, PROMPT_TOKENS_SIGMA, dataset)
    rho = scenario.prompt_share
    c = scenario.prompt_persistence
    # A prompt's length effect per epoch: a permanent part and a fresh part per epoch, so any
    # two epochs correlate by ``c`` (unit variance every epoch).
    permanent = rng.standard_normal(dataset)
    effects: list[npt.NDArray[np.float64]] = []
    batches = []
    for k, idx in enumerate(picks):
        epoch = k // STEPS_PER_EPOCH
        while len(effects) <= epoch:
            fresh = rng.standard_normal(dataset)
            effects.append(math.sqrt(c) * permanent + math.sqrt(1.0 - c) * fresh)
        prompt_effect = effects[epoch]
        st = stats[int(idx)]
        if st.log_sigma is not None:
            sigma = st.log_sigma
            mu = solve_log_mean(st.mean_tokens, sigma, float(st.max_response_tokens))
        else:
            mu, sigma = fit_lognormal(
                st.mean_tokens,
                st.max_tokens,
                n,
                st.clip_ratio,
                min_tokens=st.min_tokens,
                limit_tokens=st.max_response_tokens,
            )
        chunk = (k % STEPS_PER_EPOCH) * prompts_per_step
        pid = np.repeat(np.arange(chunk, chunk + prompts_per_step), group)
        z = math.sqrt(rho) * prompt_effect[pid] + math.sqrt(1 - rho) * rng.standard_normal(n)
        lengths = np.exp(mu + sigma * z)
        if scenario.heavy_tail_fraction > 0:
            tail = rng.random(n) < scenario.heavy_tail_fraction
            pareto = np.exp(mu) * (1.0 + rng.pareto(HEAVY_TAIL_ALPHA, n))
            lengths = np.where(tail, np.maximum(lengths, pareto), lengths)
            high = float(st.max_response_tokens)
        else:
            high = st.max_tokens
        lengths = np.clip(np.rint(lengths), max(st.min_tokens, 1.0), high).astype(np.int64)
        prompt_tokens = np.rint(st.prompt_tokens_mean * prompt_scale[pid]).astype(np.int64)
        batches.append(
            moe.RolloutBatch(
                prompt_ids=tuple(f"p{int(p)}" for p in pid),
                prompt_tokens=tuple(int(x) for x in prompt_tokens),
                lengths_tokens=tuple(int(x) for x in lengths),
            )
        )
    return batches, max(s.max_response_tokens for s in stats)


@dataclasses.dataclass(frozen=True)
class PolicyTotals:
    """One policy summed over the simulated steps.

    ``finish_min_over_max`` is the mean over steps of the earliest worker's finish time over
    the latest's (verl logs the same ratio as ``timing_s/generation_timing/min`` / ``max``);
    ``finish_mean_over_max`` the same with the workers' mean finish time (verl:
    ``timing_s/generate_sequences``, the rank mean, over ``generation_timing/max``).
    """

    policy: str
    wall_s: float
    tokens: int
    occupied_gpu_s: float
    idle_after_finish_gpu_s: float
    releases_committed: int
    releases_aborted: int
    expert_moves: int
    preemptions: int
    active_workers_min: int
    expert_unavailable_steps: int
    memory_overflow_steps: int
    incomplete_responses: int
    finish_min_over_max: float = 1.0
    finish_mean_over_max: float = 1.0

    @property
    def tokens_per_occupied_gpu_s(self) -> float:
        """Response tokens per GPU-second of worker occupancy."""
        return self.tokens / self.occupied_gpu_s if self.occupied_gpu_s else 0.0

    @property
    def generation_throughput_tokens_per_s(self) -> float:
        """Response tokens per second of rollout wall time."""
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def idle_after_finish_fraction(self) -> float:
        """Share of occupied GPU time spent after a worker's own responses ended."""
        return self.idle_after_finish_gpu_s / self.occupied_gpu_s if self.occupied_gpu_s else 0.0


def _totals(policy: str, results: Sequence[moe.RolloutResult]) -> PolicyTotals:
    return PolicyTotals(
        policy=policy,
        wall_s=sum(r.wall_s for r in results),
        tokens=sum(r.tokens for r in results),
        occupied_gpu_s=sum(r.occupied_gpu_s for r in results),
        idle_after_finish_gpu_s=sum(r.idle_after_finish_gpu_s for r in results),
        releases_committed=sum(r.releases_committed for r in results),
        releases_aborted=sum(r.releases_aborted for r in results),
        expert_moves=sum(r.expert_moves for r in results),
        preemptions=sum(r.preemptions for r in results),
        active_workers_min=min(r.active_workers_min for r in results),
        expert_unavailable_steps=sum(r.expert_unavailable_steps for r in results),
        memory_overflow_steps=sum(r.memory_overflow_steps for r in results),
        incomplete_responses=sum(r.incomplete_responses for r in results),
        finish_min_over_max=statistics.fmean(
            min(r.finish_s) / max(r.finish_s) if max(r.finish_s) > 0 else 1.0 for r in results
        ),
        finish_mean_over_max=statistics.fmean(
            statistics.fmean(r.finish_s) / max(r.finish_s) if max(r.finish_s) > 0 else 1.0
            for r in results
        ),
    )


@dataclasses.dataclass(frozen=True)
class ScenarioResult:
    """Both policies on identical inputs."""

    scenario: Scenario
    baseline: PolicyTotals
    flexfloor: PolicyTotals
    warm_baseline: PolicyTotals | None
    warm_flexfloor: PolicyTotals | None
    expert_floor: int

    def to_json(self) -> dict[str, Any]:
        """Flat JSON summary (keys documented in docs/flexfloor.md)."""
        b, f = self.baseline, self.flexfloor
        cfg = self.scenario.config
        out: dict[str, Any] = {
            "scenario": self.scenario.name,
            "trace": self.scenario.trace,
            "model": self.scenario.config.model.key,
            "gpu": self.scenario.config.gpu,
            "workers": self.scenario.config.workers,
            "replicas": self.scenario.replicas,
            "gpus": cfg.workers * cfg.tensor_parallel * self.scenario.replicas,
            "tensor_parallel": cfg.tensor_parallel,
            "step_model": cfg.step_model,
            "prompt_share": self.scenario.prompt_share,
            "prompt_persistence": self.scenario.prompt_persistence,
            "exact_lengths": self.scenario.exact_lengths,
            "experts": self.scenario.config.experts,
            "expert_floor": self.expert_floor,
            "steps": self.scenario.steps,
            "heavy_tail_fraction": self.scenario.heavy_tail_fraction,
            "tokens_per_occupied_gpu_s_ratio": _ratio(
                f.tokens_per_occupied_gpu_s, b.tokens_per_occupied_gpu_s
            ),
            "generation_throughput_ratio": _ratio(
                f.generation_throughput_tokens_per_s, b.generation_throughput_tokens_per_s
            ),
            "baseline_idle_after_finish_fraction": b.idle_after_finish_fraction,
            "baseline_worker_finish_min_over_max": b.finish_min_over_max,
            "baseline_worker_finish_mean_over_max": b.finish_mean_over_max,
            "flexfloor_idle_after_finish_fraction": f.idle_after_finish_fraction,
            "expert_unavailable_steps": b.expert_unavailable_steps + f.expert_unavailable_steps,
            "memory_overflow_steps": b.memory_overflow_steps + f.memory_overflow_steps,
            "incomplete_responses": b.incomplete_responses + f.incomplete_responses,
        }
        if self.warm_baseline is not None and self.warm_flexfloor is not None:
            out["warm_tokens_per_occupied_gpu_s_ratio"] = _ratio(
                self.warm_flexfloor.tokens_per_occupied_gpu_s,
                self.warm_baseline.tokens_per_occupied_gpu_s,
            )
            out["warm_generation_throughput_ratio"] = _ratio(
                self.warm_flexfloor.generation_throughput_tokens_per_s,
                self.warm_baseline.generation_throughput_tokens_per_s,
            )
        for t in (b, f):
            out[t.policy] = {
                "wall_s": t.wall_s,
                "tokens": t.tokens,
                "occupied_gpu_s": t.occupied_gpu_s,
                "tokens_per_occupied_gpu_s": t.tokens_per_occupied_gpu_s,
                "generation_throughput_tokens_per_s": t.generation_throughput_tokens_per_s,
                "idle_after_finish_fraction": t.idle_after_finish_fraction,
                "releases_committed": t.releases_committed,
                "releases_aborted": t.releases_aborted,
                "expert_moves": t.expert_moves,
                "preemptions": t.preemptions,
                "active_workers_min": t.active_workers_min,
            }
        return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def run_scenario(scenario: Scenario) -> ScenarioResult:
    """Simulate baseline and FlexFloor on the same batches; invariants checked every step.

    Raises:
        InvalidInputError: bad trace, model, GPU or group size (message names the flag).
    """
    batches, max_response = make_batches(scenario)
    config = scenario.config
    predictor = moe.predictor_for(max_response)
    base_results, ff_results = [], []
    for batch in batches:
        base_results.append(
            moe.simulate_pool(config, batch, replicas=scenario.replicas, policy="baseline")
        )
        if scenario.exact_lengths:
            preds = [float(x) for x in batch.lengths_tokens]
            sigma = [0.0] * len(preds)
        else:
            made = predictor.predict(batch.prompt_ids)
            preds = [p.length_tokens for p in made]
            sigma = [predictor.log_error_sigma(p.from_history) or 0.0 for p in made]
        ff_results.append(
            moe.simulate_pool(
                config,
                batch,
                replicas=scenario.replicas,
                policy="flexfloor",
                predictions=preds,
                residual=predictor.residual(),
                prediction_log_sigma=sigma,
                max_length_tokens=float(max_response),
            )
        )
        predictor.observe_step(batch.prompt_ids, batch.lengths_tokens)
    warm = slice(STEPS_PER_EPOCH, None)
    has_warm = len(batches) > STEPS_PER_EPOCH
    return ScenarioResult(
        scenario=scenario,
        baseline=_totals("baseline", base_results),
        flexfloor=_totals("flexfloor", ff_results),
        warm_baseline=_totals("baseline", base_results[warm]) if has_warm else None,
        warm_flexfloor=_totals("flexfloor", ff_results[warm]) if has_warm else None,
        expert_floor=config.layout().release_floor(),
    )


def replica_finish_spread(scenario: Scenario) -> tuple[float, float]:
    """Baseline finish spread over the scenario's replicas (engines), mean over its steps.

    An engine's time is its slowest rank's (``max`` of ``finish_s`` over the replica's
    ranks), which is what verl logs per rank when every rank runs its own engine
    (``timing_s/generation_timing/{min,max}``, ``timing_s/generate_sequences`` the mean).
    Used to fit ``PROMPT_SHARE_OF_LOG_VARIANCE`` (``bench/rollout.py --calibrate``).

    Returns:
        ``(min / max, mean / max)`` of the engines' finish times.
    """
    batches, _ = make_batches(scenario)
    g = scenario.config.workers
    lows, means = [], []
    for batch in batches:
        result = moe.simulate_pool(
            scenario.config,
            batch,
            replicas=scenario.replicas,
            policy="baseline",
            check_every_step=False,
        )
        ends = [max(result.finish_s[r * g : (r + 1) * g]) for r in range(scenario.replicas)]
        top = max(ends)
        lows.append(min(ends) / top if top > 0 else 1.0)
        means.append(statistics.fmean(ends) / top if top > 0 else 1.0)
    return statistics.fmean(lows), statistics.fmean(means)


def render(result: ScenarioResult) -> Any:
    """A rich table: both policies side by side, then the ratios and invariant counters."""
    from rich.table import Table

    b, f = result.baseline, result.flexfloor
    cfg = result.scenario.config
    table = Table(
        title=(
            f"MoE rollout {result.scenario.name or result.scenario.trace}: {cfg.model.key}, "
            f"{result.scenario.replicas} x {cfg.workers} x {cfg.gpu}"
            f"{f' (TP{cfg.tensor_parallel})' if cfg.tensor_parallel > 1 else ''}, "
            f"{cfg.experts} experts (floor {result.expert_floor}), {result.scenario.steps} steps"
        )
    )
    table.add_column("metric")
    table.add_column("verl-style baseline", justify="right")
    table.add_column("FlexFloor", justify="right")
    rows: list[tuple[str, str, str]] = [
        ("rollout wall time, s", f"{b.wall_s:,.1f}", f"{f.wall_s:,.1f}"),
        ("response tokens", f"{b.tokens:,}", f"{f.tokens:,}"),
        ("occupied GPU-s", f"{b.occupied_gpu_s:,.1f}", f"{f.occupied_gpu_s:,.1f}"),
        (
            "tokens / occupied GPU-s",
            f"{b.tokens_per_occupied_gpu_s:,.1f}",
            f"{f.tokens_per_occupied_gpu_s:,.1f}",
        ),
        (
            "generation throughput, tokens/s",
            f"{b.generation_throughput_tokens_per_s:,.1f}",
            f"{f.generation_throughput_tokens_per_s:,.1f}",
        ),
        (
            "idle after own responses, share",
            f"{b.idle_after_finish_fraction:.3f}",
            f"{f.idle_after_finish_fraction:.3f}",
        ),
        ("fewest active workers", str(b.active_workers_min), str(f.active_workers_min)),
        (
            "releases committed / aborted",
            f"{b.releases_committed} / {b.releases_aborted}",
            f"{f.releases_committed} / {f.releases_aborted}",
        ),
        ("expert copies", str(b.expert_moves), str(f.expert_moves)),
        ("preemptions (KV memory)", str(b.preemptions), str(f.preemptions)),
        (
            "expert-unavailable / memory-overflow steps",
            f"{b.expert_unavailable_steps} / {b.memory_overflow_steps}",
            f"{f.expert_unavailable_steps} / {f.memory_overflow_steps}",
        ),
        ("incomplete responses", str(b.incomplete_responses), str(f.incomplete_responses)),
    ]
    for row in rows:
        table.add_row(*row)
    summary = result.to_json()
    table.caption = (
        f"tokens per occupied GPU-s: x{summary['tokens_per_occupied_gpu_s_ratio']:.2f}  "
        f"generation throughput: x{summary['generation_throughput_ratio']:.2f}"
    )
    return table


def add_arguments(parser: Any) -> None:
    """Flags of ``rlenergy rollout-sim`` (``parser`` is an ``argparse.ArgumentParser``)."""
    parser.add_argument(
        "--scenario",
        default=None,
        help="a calibrated scenario (seer-long-cot, verl3727, qwen3-30b-a3b-long-cot); "
        "sets trace, model, GPU and pool (other shape flags are ignored)",
    )
    parser.add_argument(
        "--trace",
        default="verl-grpo-uitars15-7b-gui-agent-8gpu",
        help="packaged step trace, a CSV trace or verl console log path, or "
        "samples:<sample_id> for a logged MoE step",
    )
    parser.add_argument(
        "--workers", type=int, default=8, help="EP rollout workers (GPUs) per replica"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="independent engine replicas (EP groups of --workers each)",
    )
    parser.add_argument("--experts", type=int, default=None, help="experts (default: model's)")
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(moe.MOE_MODELS))
    parser.add_argument("--gpu", default="h100-sxm", choices=sorted(moe.GPU_MEMORY_GB))
    parser.add_argument("--min-active-workers", type=int, default=1, help="minActiveWorkers")
    parser.add_argument(
        "--steps", type=int, default=None, help="rollout steps to simulate (default 8)"
    )
    parser.add_argument(
        "--heavy-tail", type=float, default=0.0, help="share of synthetic heavy-tail responses"
    )
    parser.add_argument(
        "--prompt-persistence",
        type=float,
        default=PROMPT_PERSISTENCE,
        help="correlation of a prompt's length effect between epochs (default: TailSieve 0.904)",
    )
    parser.add_argument(
        "--prompt-share",
        type=float,
        default=PROMPT_SHARE_OF_LOG_VARIANCE,
        help="share of log-length variance per prompt (default: TailSieve's measured 0.733)",
    )
    parser.add_argument(
        "--exact-lengths",
        action="store_true",
        help="FlexFloor gets the true lengths (upper bound, not deployable)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: Any) -> int:
    """Run ``rlenergy rollout-sim`` from parsed flags; print a table or JSON; exit code.

    Raises:
        InvalidInputError: a bad flag value (the CLI prints one line and exits 2).
    """
    import json

    from rich.console import Console

    steps = 8 if args.steps is None else args.steps
    if args.scenario is not None:
        from rlenergy.sim import rollout_scenarios

        scenario = rollout_scenarios.scenario(args.scenario, steps=steps, seed=args.seed)
    else:
        config = moe.RolloutConfig(
            model=moe.MOE_MODELS[args.model],
            gpu=args.gpu,
            workers=args.workers,
            num_experts=args.experts,
            min_active_workers=args.min_active_workers,
        )
        scenario = Scenario(
            trace=args.trace,
            config=config,
            steps=steps,
            heavy_tail_fraction=args.heavy_tail,
            seed=args.seed,
            replicas=args.replicas,
            prompt_persistence=args.prompt_persistence,
            prompt_share=args.prompt_share,
            exact_lengths=args.exact_lengths,
        )
    result = run_scenario(scenario)
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    else:
        Console(width=120).print(render(result))
    return 0
