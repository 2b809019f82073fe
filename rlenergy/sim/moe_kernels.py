"""Decode-step time of a Qwen3-30B-A3B EP group on H200 from measured kernel tables.

The roofline step model (``moe.DecodeStepModel``) says survivors of a shrink get faster; the
measured kernels say otherwise (``data/flexfloor/README.md`` section 1). This model composes a
decode step from the aiconfigurator tables (``ai-dynamo/aiconfigurator`` @ 095f58a51c4c,
H200 SXM, vLLM 0.24.0, NCCL 2.29.2), as the README's section 1c does [I: a composition of
measured kernels, not an end-to-end measurement]:

``step = layers x (attention(b_max-rank) + moe(T, n) + all_gather(n) + reduce_scatter(n)) +
gemm(b)``

* ``moe(T, n)``: one MoE layer's per-rank time with ``T`` tokens in the EP group of ``n``
  ranks (``moe_layer_latency_qwen3_30b_h200_vllm.csv``, balanced routing), interpolated
  linearly in ``log T`` and ``log2 n``. ``T`` is ``n x`` the largest per-rank batch when idle
  ranks are padded (vLLM: ``vllm/v1/worker/dp_utils.py`` ``should_dp_pad`` with CUDA graphs
  on: finished ranks still push dummy tokens), else the sum of the ranks' batches.
* ``attention``: FA3 decode attention per layer (``decode_attention_h200_qwen3_30b_shape.csv``)
  fitted by least squares as ``c0 + c1 b + c2 b ctx`` (``b`` running responses of a rank,
  ``ctx`` their mean context) [D: the fit, residual in ``attention_fit_rms_ms``]; the group
  waits for its slowest rank.
* ``all_gather`` + ``reduce_scatter`` of ``T x hidden x 2`` bytes over ``n`` GPUs
  (``nccl_collective_latency_h200.csv``, 2/4/8 GPUs, interpolated in log message size); above
  8 ranks (across nodes) the 8-GPU time times DeepEP's measured EP16 / EP8 dispatch+combine
  ratio (``deepep_v1_ll_latency_vs_ep_h800.csv``: (118 + 195) / (77 + 114) = 1.64) [I].
* ``gemm(b)``: the QKV/O GEMMs, ``step - moe - comm - attention`` of the README's composed
  step table at EP 8 (``derived_survivor_step_ratio_qwen3_30b_h200.csv``), interpolated in
  ``log b`` [D].

The tables cover one model shape, so this model serves only ``qwen3-30b-a3b`` on ``h200``.
Expert copies are not charged per byte: vLLM's elastic EP rebalances experts itself (EPLB)
during the resize, whose measured wall time is ``RolloutConfig.resize_s``.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import math
from collections.abc import Sequence
from importlib import resources

import numpy as np
import numpy.typing as npt

from rlenergy.control.moe import base

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

LAYERS = 48
"""Qwen3-30B-A3B layers (Hugging Face config.json)."""
HIDDEN = 2048
"""Qwen3-30B-A3B hidden size (Hugging Face config.json)."""
CROSS_NODE_COMM_FACTOR = (118.0 + 195.0) / (77.0 + 114.0)
"""EP16 / EP8 DeepEP low-latency dispatch + combine (``deepep_v1_ll_latency_vs_ep_h800.csv``)."""


def _rows(name: str) -> list[dict[str, str]]:
    root = resources.files("rlenergy.sim").joinpath("data/flexfloor")
    return list(csv.DictReader(io.StringIO(root.joinpath(name).read_text())))


@dataclasses.dataclass(frozen=True)
class _Tables:
    moe_log_tokens: FloatArray  # sorted log T
    moe_ep: tuple[int, ...]  # EP sizes with data
    moe_ms: FloatArray  # (len(ep), len(T)) per layer per rank
    attn_coef: tuple[float, float, float]
    attn_rms_ms: float
    comm_gpus: tuple[int, ...]
    comm_log_bytes: dict[int, FloatArray]
    comm_ms: dict[int, FloatArray]  # all_gather + reduce_scatter per layer
    gemm_log_b: FloatArray
    gemm_ms: FloatArray  # per step (all layers)


@functools.cache
def tables() -> _Tables:
    """Load and fit the packaged kernel tables (cached)."""
    moe_rows = [
        r
        for r in _rows("moe_layer_latency_qwen3_30b_h200_vllm.csv")
        if r["distribution"] == "balanced"
    ]
    tokens = sorted({int(r["num_tokens_in_ep_group"]) for r in moe_rows})
    eps = sorted({int(r["ep_size"]) for r in moe_rows})
    grid = np.full((len(eps), len(tokens)), np.nan)
    for r in moe_rows:
        grid[eps.index(int(r["ep_size"])), tokens.index(int(r["num_tokens_in_ep_group"]))] = float(
            r["latency_ms_per_layer_per_rank"]
        )
    for k in range(len(eps)):  # fill gaps along T by interpolation
        row = grid[k]
        ok = ~np.isnan(row)
        grid[k] = np.interp(np.log(tokens), np.log(np.asarray(tokens))[ok], row[ok])
    attn = _rows("decode_attention_h200_qwen3_30b_shape.csv")
    b = np.asarray([float(r["batch_size"]) for r in attn])
    ctx = np.asarray([float(r["context_len_approx"]) for r in attn])
    y = np.asarray([float(r["latency_ms_per_layer"]) for r in attn])
    design = np.stack([np.ones_like(b), b, b * ctx], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    rms = float(np.sqrt(np.mean((design @ coef - y) ** 2)))
    comm: dict[int, dict[int, float]] = {}
    for r in _rows("nccl_collective_latency_h200.csv"):
        if r["op_name"] in ("all_gather", "reduce_scatter"):
            g, size = int(r["num_gpus"]), int(r["message_size_bytes"])
            comm.setdefault(g, {})
            comm[g][size] = comm[g].get(size, 0.0) + float(r["latency_ms"])
    gpus = tuple(sorted(comm))
    derived = [
        r
        for r in _rows("derived_survivor_step_ratio_qwen3_30b_h200.csv")
        if r["distribution"] == "balanced" and r["active_ranks"] == "8"
    ]
    gemm: dict[int, list[float]] = {}
    for r in derived:
        rest = float(r["step_ms_after_shrink"]) - sum(
            float(r[k]) for k in ("moe_ms", "comm_ms", "attn_ms")
        )
        gemm.setdefault(int(r["per_rank_batch"]), []).append(rest)
    gb = sorted(gemm)
    return _Tables(
        moe_log_tokens=np.log(np.asarray(tokens, dtype=np.float64)),
        moe_ep=tuple(eps),
        moe_ms=grid,
        attn_coef=(float(coef[0]), float(coef[1]), float(coef[2])),
        attn_rms_ms=rms,
        comm_gpus=gpus,
        comm_log_bytes={g: np.log(np.asarray(sorted(comm[g]), dtype=np.float64)) for g in gpus},
        comm_ms={g: np.asarray([comm[g][s] for s in sorted(comm[g])]) for g in gpus},
        gemm_log_b=np.log(np.asarray(gb, dtype=np.float64)),
        gemm_ms=np.asarray([sum(gemm[k]) / len(gemm[k]) for k in gb]),
    )


def attention_fit_rms_ms() -> float:
    """Root-mean-square error of the attention fit over the table's rows, ms per layer."""
    return tables().attn_rms_ms


def moe_layer_ms(tokens: float, ranks: int) -> float:
    """One MoE layer's per-rank time, ``tokens`` in an EP group of ``ranks``, ms."""
    t = tables()
    lt = math.log(max(tokens, 1.0))
    per_ep = [float(np.interp(lt, t.moe_log_tokens, t.moe_ms[k])) for k in range(len(t.moe_ep))]
    logs = [math.log2(e) for e in t.moe_ep]
    return float(np.interp(math.log2(max(ranks, 1)), logs, per_ep))


def comm_layer_ms(tokens: float, ranks: int) -> float:
    """all_gather + reduce_scatter of one layer's ``tokens`` hidden states over ``ranks``, ms."""
    if ranks <= 1:
        return 0.0
    t = tables()
    lb = math.log(max(tokens * HIDDEN * 2.0, 1.0))
    at = {g: float(np.interp(lb, t.comm_log_bytes[g], t.comm_ms[g])) for g in t.comm_gpus}
    top = max(t.comm_gpus)
    if ranks > top:
        return at[top] * CROSS_NODE_COMM_FACTOR
    logs = [math.log2(g) for g in t.comm_gpus]
    return float(np.interp(math.log2(ranks), logs, [at[g] for g in t.comm_gpus]))


def gemm_step_ms(batch: float) -> float:
    """The dense GEMMs of one decode step (all layers) at per-rank ``batch``, ms."""
    t = tables()
    return float(np.interp(math.log(max(batch, 1.0)), t.gemm_log_b, t.gemm_ms))


@dataclasses.dataclass(frozen=True)
class KernelTableStepModel:
    """``base.StepCostModel`` of a Qwen3-30B-A3B EP group on H200 from the kernel tables.

    Attributes:
        padded: idle ranks push the largest rank's batch of dummy tokens (vLLM with CUDA
            graphs) instead of none.
        resize_s: stall of the whole group for one committed shrink, s (the engine's measured
            elastic-EP resize time; expert copies are part of it).
        kv_bytes_per_token: KV per context token, bytes (to turn ``WorkerState.kv_bytes`` into
            context tokens).
    """

    padded: bool
    resize_s: float
    kv_bytes_per_token: int

    def steps_s(
        self,
        running: IntArray,
        context_tokens: FloatArray,
        experts: IntArray,
        growth_steps: int = 1,
    ) -> FloatArray:
        """Times of ``growth_steps`` decode steps of a fixed batch, s (as ``DecodeStepModel``).

        Args:
            running: running responses per active rank, shape ``(n,)``.
            context_tokens: their context tokens per active rank at the first step, tokens.
            experts: experts resident per active rank (unused: EP size sets the MoE time).
            growth_steps: consecutive steps (contexts grow one token per response per step).
        """
        del experts
        n = len(running)
        b = running.astype(np.float64)
        b_max = float(b.max(initial=0.0))
        tokens = n * b_max if self.padded else float(b.sum())
        c0, c1, c2 = tables().attn_coef
        j = np.arange(growth_steps, dtype=np.float64)[:, None]
        kv_tokens = context_tokens[None, :] + j * b[None, :]  # b x ctx per rank
        attn = np.where(b[None, :] > 0, c0 + c1 * b[None, :] + c2 * kv_tokens, 0.0)
        if self.padded and n > 1:
            attn = np.maximum(attn, c0 + c1 * b_max)  # dummy batch of the largest size
        per_layer = attn.max(axis=1) + moe_layer_ms(tokens, n) + comm_layer_ms(tokens, n)
        out: FloatArray = (LAYERS * per_layer + gemm_step_ms(b_max)) / 1e3
        return out

    def decode_step_s(self, workers: Sequence[base.WorkerState]) -> float:
        """One decode step taken by exactly ``workers`` (``base.StepCostModel``), s."""
        kvb = self.kv_bytes_per_token
        running = np.asarray([w.running for w in workers], dtype=np.int64)
        ctx = np.asarray([w.kv_bytes / kvb for w in workers], dtype=np.float64)
        experts = np.asarray([len(w.experts) for w in workers], dtype=np.int64)
        return float(self.steps_s(running, ctx, experts)[0])

    def copy_s(self, moves: Sequence[base.ExpertMove]) -> float:
        """The engine's resize stall for a shrink that moves ``moves`` (0 for none), s."""
        return self.resize_s if moves else 0.0
