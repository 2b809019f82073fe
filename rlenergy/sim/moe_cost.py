"""The rollout simulator's cost model: one EP group's configuration and its decode-step time.

Per decode step (time in s, every term [MODEL] unless sourced in ``MoeModel``/``Fabric``):

* worker time ``t_w = max(memory_w / HBM bandwidth, flops_w / (peak x MFU))`` with
  ``memory_w = dense + context_tokens_w x kv_bytes_per_token + touched_experts_w x expert``
  (decode is memory bound: weights and KV are read once per step) and ``flops_w = 2 x active
  params x running_w``; ``touched_experts_w = experts_w x (1 - (1 - k / E) ** tokens)`` with
  uniform top-``k`` routing of the group's ``tokens`` running responses;
* all-to-all: ``2 x layers x (latency(n) + max_w running_w x k x hidden x 2 B / bw(n))`` over
  the ``n`` active workers (NVLink inside a node of 8, RDMA across nodes), 0 when ``n == 1``;
* step time ``max_w t_w + all-to-all``; an engine admits queued responses while their prompt's
  KV fits beside the running responses' growth and preempts (recompute, as vLLM V1) the newest
  running response when growth would overflow memory (``KV_HEADROOM_STEPS``).

``RolloutConfig.step_model = "kernels"`` replaces this roofline by the measured H200 kernel
tables (``moe_kernels``: survivors of a shrink get slower, idle ranks padded as vLLM does);
``tensor_parallel`` makes a worker a TP engine of that many GPUs (a dense model is an MoE
shape with one weightless expert, ``qwen2-vl-72b``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from rlenergy import errors
from rlenergy.control.moe import base, placement, protocol
from rlenergy.gpu import models
from rlenergy.sim import moe_kernels
from rlenergy.sim.moe_models import GPU_MEMORY_GB, GPU_MEMORY_UTILIZATION, MoeModel

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


DECODE_MFU = 0.5
"""Share of dense BF16 peak a decode GEMM reaches when compute bound [MODEL]."""

MAX_RUNNING_PER_WORKER = 1024
"""Running responses per engine (vLLM ``max_num_seqs``; 256 to 1024 by version and GPU) [MODEL]."""


@dataclasses.dataclass(frozen=True)
class Fabric:
    """All-to-all cost model between EP workers.

    Attributes:
        gpus_per_node: GPUs joined by NVLink (HGX: 8).
        nvlink_bytes_per_s: per-GPU NVLink bandwidth one way, bytes/s (H100/H200 NVLink 4:
            900 GB/s bidirectional, NVIDIA datasheet).
        rdma_bytes_per_s: per-GPU network bandwidth, bytes/s (one 400 Gb/s ConnectX-7 NIC per
            GPU, as on HGX H100 systems).
        latency_s: fixed cost of one all-to-all (dispatch or combine) of one layer, s; DeepEP's
            low-latency kernels take 77-194 us per dispatch at 128 tokens per rank over 8-256
            ranks (deepseek-ai/DeepEP README), of which this is the size-independent part
            [MODEL].
    """

    gpus_per_node: int = 8
    nvlink_bytes_per_s: float = 450e9
    rdma_bytes_per_s: float = 50e9
    latency_s: float = 20e-6

    def all_to_all_s(
        self, active_workers: int, max_tokens_per_worker: int, payload_bytes: int
    ) -> float:
        """One all-to-all of one layer across ``active_workers``, s (0 for one worker).

        ``payload_bytes`` is what one token sends (top-k copies of the hidden state); the
        share ``(n - 1) / n`` leaves the worker, the part leaving its node goes at RDMA speed.
        """
        n = active_workers
        if n <= 1:
            return 0.0
        out_bytes = max_tokens_per_worker * payload_bytes * (n - 1) / n
        in_node = min(n, self.gpus_per_node)
        off_node_share = (n - in_node) / (n - 1)
        seconds = out_bytes * (
            (1.0 - off_node_share) / self.nvlink_bytes_per_s
            + off_node_share / self.rdma_bytes_per_s
        )
        latency = self.latency_s * (1.0 + math.log2(n) / 8.0)  # DeepEP: slow growth with ranks
        return latency + seconds

    def copy_s(self, nbytes: int, same_node: bool) -> float:
        """Point-to-point copy of ``nbytes`` (an expert's weights), s."""
        return nbytes / (self.nvlink_bytes_per_s if same_node else self.rdma_bytes_per_s)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """One EP rollout group.

    Attributes:
        model: the MoE model.
        gpu: GPU SKU key (``rlenergy.gpu.models``; memory from ``GPU_MEMORY_GB``).
        workers: rollout workers in the EP group (one GPU each).
        num_experts: experts (default: the model's); the model's expert weights are split
            evenly over them, so the weight footprint stays the model's.
        min_active_workers: ``minActiveWorkers``.
        fabric: all-to-all cost model.
        timing: release-round deadlines.
        tensor_parallel: GPUs per worker (a TP engine rank): its memory, bandwidth and
            compute are that many GPUs', and it occupies that many GPUs.
        step_model: ``roofline`` (``DecodeStepModel``) or ``kernels`` (the measured H200
            kernel tables, ``moe_kernels.KernelTableStepModel``; qwen3-30b-a3b on h200 only).
        padded: ``kernels`` only: idle EP ranks push dummy tokens (vLLM with CUDA graphs).
        resize_s: ``kernels`` only: stall of the group per committed shrink, s.
    """

    model: MoeModel
    gpu: str = "h100-sxm"
    workers: int = 8
    num_experts: int | None = None
    min_active_workers: int = 1
    fabric: Fabric = Fabric()
    timing: protocol.ProtocolTiming = protocol.ProtocolTiming()
    tensor_parallel: int = 1
    step_model: str = "roofline"
    padded: bool = True
    resize_s: float = 0.0

    def __post_init__(self) -> None:
        if self.gpu not in GPU_MEMORY_GB:
            raise errors.InvalidInputError(
                "--gpu", f"unknown GPU {self.gpu!r}; known: {', '.join(GPU_MEMORY_GB)}"
            )
        if self.workers < 1:
            raise errors.InvalidInputError("--workers", f"need >= 1 worker, got {self.workers}")
        if self.experts < self.workers:
            raise errors.InvalidInputError(
                "--experts",
                f"{self.experts} experts cannot be sharded over {self.workers} EP workers: "
                "need at least one expert per worker",
            )
        if self.min_active_workers > self.workers:
            raise errors.InvalidInputError(
                "--min-active-workers", f"{self.min_active_workers} > --workers {self.workers}"
            )
        if self.tensor_parallel < 1:
            raise errors.InvalidInputError("--tensor-parallel", "must be >= 1")
        if self.step_model not in ("roofline", "kernels"):
            raise errors.InvalidInputError(
                "step_model", f"unknown step model {self.step_model!r}: roofline or kernels"
            )
        if self.step_model == "kernels" and (
            self.model.key != "qwen3-30b-a3b" or self.gpu != "h200" or self.tensor_parallel != 1
        ):
            raise errors.InvalidInputError(
                "step_model",
                "the kernel tables are measured for qwen3-30b-a3b on one h200 per rank only",
            )
        self.layout()  # validates that the weights fit

    @property
    def experts(self) -> int:
        """Experts per MoE layer."""
        return self.num_experts or self.model.num_experts

    @property
    def expert_bytes(self) -> int:
        """One expert over all layers, bytes (model expert weights / experts)."""
        return int(self.model.expert_bytes * self.model.num_experts / self.experts)

    def layout(self) -> base.MoeLayout:
        """The planner's view of the group's memory.

        Raises:
            InvalidInputError: the initial expert shard and dense weights do not fit a worker.
        """
        memory = int(GPU_MEMORY_GB[self.gpu] * 1e9 * GPU_MEMORY_UTILIZATION * self.tensor_parallel)
        layout = base.MoeLayout(
            num_experts=self.experts,
            expert_bytes=self.expert_bytes,
            dense_bytes=self.model.dense_bytes,
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            worker_memory_bytes=memory,
            min_active_workers=self.min_active_workers,
        )
        shard = math.ceil(self.experts / self.workers)
        if layout.dense_bytes + shard * layout.expert_bytes > memory:
            raise errors.InvalidInputError(
                "--workers",
                f"{self.model.key} does not fit on {self.workers} x {self.gpu}: each worker "
                f"needs {(layout.dense_bytes + shard * layout.expert_bytes) / 1e9:.0f} GB of "
                f"weights, {memory / 1e9:.0f} GB usable; use more workers or a larger GPU",
            )
        return layout

    def initial_experts(self) -> list[set[int]]:
        """Even contiguous expert shards, as EP places them at start-up."""
        shard = math.ceil(self.experts / self.workers)
        return [
            set(range(w * shard, min((w + 1) * shard, self.experts))) for w in range(self.workers)
        ]


@dataclasses.dataclass(frozen=True)
class DecodeStepModel:
    """The simulator's decode-step time model (implements ``base.StepCostModel``).

    One function gives the time of a decode step from each active worker's attention batch
    (running responses, context tokens) and resident experts, so the simulated truth and the
    cost-aware release guard agree by construction: the guard's only error is its length
    prediction (a deployment would fit this model to measured step times instead).

    Worker time ``max(memory_w / HBM bandwidth, 2 x active params x running_w / (peak x
    DECODE_MFU))`` with ``memory_w = dense + context_w x kv_bytes_per_token + experts_w x
    touched x expert_bytes`` and ``touched = 1 - (1 - k / E) ** tokens`` (uniform top-k routing
    of the group's running tokens); step time ``max_w`` of it plus ``2 x layers`` all-to-alls
    over the active workers (``Fabric.all_to_all_s``). Every term is [MODEL] unless sourced in
    ``MoeModel`` / ``Fabric``.

    Attributes:
        config: the EP group (model, GPU, experts, fabric).
    """

    config: RolloutConfig

    @functools.cached_property
    def _bandwidth(self) -> float:
        tp = self.config.tensor_parallel
        return models.get_sku(self.config.gpu).memory_bandwidth_tbps * 1e12 * tp

    @functools.cached_property
    def _flops(self) -> float:
        tp = self.config.tensor_parallel
        return models.get_sku(self.config.gpu).dense_bf16_tflops * 1e12 * DECODE_MFU * tp

    def steps_s(
        self,
        running: IntArray,
        context_tokens: FloatArray,
        experts: IntArray,
        growth_steps: int = 1,
    ) -> FloatArray:
        """Times of ``growth_steps`` consecutive decode steps of a fixed batch, s.

        Between two completion (or admission, preemption, release) events the batch is
        constant and every running response's context grows by one token per step, so step
        ``j`` (0-based) sees ``context_w + j x running_w`` context tokens on worker ``w``.

        Args:
            running: running responses per active worker, shape ``(n_active,)``.
            context_tokens: context tokens (prompt + generated) of those responses per active
                worker at the first step, tokens, shape ``(n_active,)``.
            experts: experts resident per active worker, shape ``(n_active,)``.
            growth_steps: consecutive steps to time (>= 1).

        Returns:
            Step times, s, shape ``(growth_steps,)``.
        """
        cfg = self.config
        model = cfg.model
        tokens = int(running.sum())
        touched = 1.0 - (1.0 - model.experts_per_token / cfg.experts) ** tokens
        fixed = model.dense_bytes + experts.astype(np.float64) * (touched * cfg.expert_bytes)
        kvb = float(model.kv_bytes_per_token)
        j = np.arange(growth_steps, dtype=np.float64)[:, None]
        mem = fixed[None, :] + (context_tokens[None, :] + j * running[None, :]) * kvb
        compute = 2.0 * model.active_params * running.astype(np.float64) / self._flops
        worker_t = np.maximum(mem / self._bandwidth, compute[None, :]).max(axis=1)
        payload = model.experts_per_token * model.hidden_size * 2
        a2a = (
            2
            * model.num_layers
            * cfg.fabric.all_to_all_s(len(running), int(running.max(initial=0)), payload)
        )
        out: FloatArray = worker_t + a2a
        return out

    def decode_step_s(self, workers: Sequence[base.WorkerState]) -> float:
        """One decode step taken by exactly ``workers`` (``base.StepCostModel``), s."""
        kvb = self.config.model.kv_bytes_per_token
        running = np.asarray([w.running for w in workers], dtype=np.int64)
        ctx = np.asarray([w.kv_bytes / kvb for w in workers], dtype=np.float64)
        experts = np.asarray([len(w.experts) for w in workers], dtype=np.int64)
        return float(self.steps_s(running, ctx, experts)[0])

    def copy_s(self, moves: Sequence[base.ExpertMove]) -> float:
        """Expert copies done one after the other, s (NVLink inside a node, RDMA across)."""
        fabric = self.config.fabric
        return sum(
            fabric.copy_s(
                self.config.expert_bytes,
                m.source // fabric.gpus_per_node == m.target // fabric.gpus_per_node,
            )
            for m in moves
        )


StepModel = DecodeStepModel | moe_kernels.KernelTableStepModel
"""A decode-step time model the simulator can run (both implement ``base.StepCostModel``)."""


def step_model_for(config: RolloutConfig) -> StepModel:
    """The decode-step model ``config.step_model`` names."""
    if config.step_model == "kernels":
        return moe_kernels.KernelTableStepModel(
            padded=config.padded,
            resize_s=config.resize_s,
            kv_bytes_per_token=config.model.kv_bytes_per_token,
        )
    return DecodeStepModel(config)


def fluid_model(config: RolloutConfig, *, per_rank: bool) -> placement.FluidFinishModel:
    """``placement.FluidFinishModel`` fitted to the group's step model by two probes.

    The step time with one running response per rank at no context and at a full KV cache
    gives ``step_fixed_s`` and ``kv_s_per_byte`` (as a deployment would fit it to two measured
    step times). ``per_rank``: one DP rank of the group (its KV budget, 1,024 running);
    else the whole replica (the ranks' KV together, each reading its own share).
    """
    layout = config.layout()
    model = step_model_for(config)
    w = config.workers
    shard = math.ceil(config.experts / w)
    capacity = layout.worker_memory_bytes - layout.dense_bytes - shard * layout.expert_bytes
    kvb = layout.kv_bytes_per_token
    ones = np.ones(w, dtype=np.int64)
    experts = np.full(w, shard, dtype=np.int64)
    t0 = float(model.steps_s(ones, np.zeros(w), experts)[0])
    t1 = float(model.steps_s(ones, np.full(w, capacity / kvb), experts)[0])
    per_byte = max(t1 - t0, 0.0) / capacity
    compute = 0.0
    if isinstance(model, DecodeStepModel):
        sku = models.get_sku(config.gpu)
        flops = sku.dense_bf16_tflops * 1e12 * DECODE_MFU * config.tensor_parallel
        compute = 2.0 * config.model.active_params / flops
    if per_rank:
        return placement.FluidFinishModel(
            step_fixed_s=t0,
            kv_s_per_byte=per_byte,
            kv_capacity_bytes=float(capacity),
            kv_bytes_per_token=kvb,
            max_running=MAX_RUNNING_PER_WORKER,
            compute_s_per_token=compute,
        )
    return placement.FluidFinishModel(
        step_fixed_s=t0,
        kv_s_per_byte=per_byte / w,
        kv_capacity_bytes=float(capacity * w),
        kv_bytes_per_token=kvb,
        max_running=MAX_RUNNING_PER_WORKER * w,
        compute_s_per_token=compute / w,
    )
