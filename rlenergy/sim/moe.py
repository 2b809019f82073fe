"""Expert-parallel MoE rollout simulator: verl-style baseline vs FlexFloor on identical inputs.

A rollout step is a batch of responses decoded by ``W`` rollout workers that form one
expert-parallel (EP) group: each worker (one GPU) holds the dense weights, a shard of the
experts and the KV cache of its own responses (data-parallel attention). Every decode step is
taken by all active workers together: each runs attention on its own batch, tokens go to their
experts and back through two all-to-alls per MoE layer, so a worker with no response left still
steps (a dummy batch) while its experts are needed. That idle-but-occupied time is what
FlexFloor removes.

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

Policies: ``baseline`` places with ``placement.place_even`` (verl ``DataProto.chunk``) and keeps
every worker until the last response ends; ``flexfloor`` predicts lengths
(``predictor.LengthPredictor``), places with ``placement.place_lockstep`` (longest predicted
first, dealt so that the lock-stepped ranks carry equal loads at every decode step; the guard
keeps the even placement unless the dealt one is forecast cheaper), and whenever a worker
runs out of responses asks ``release.FlexFloorPlanner`` for a release, committed through
``protocol.ReleaseRound`` (acks, deadline, abort). Expert copies cost their transfer time as a
stall at the apply step. Invariants are checked at every decode step: every expert hosted by an
active worker, no worker above its memory; every response must complete (a released worker
stops decoding, so a response it still held is lost and counted incomplete).

A pool of independent replicas of such a group (verl's engine replicas, each progressing on its
own, all waiting at the RL step barrier) is ``simulate_pool``: the baseline keeps every GPU
until the slowest replica ends; FlexFloor also frees a replica whose responses are all done.

Callers: ``rlenergy.sim.rollout_report`` (CLI ``rollout-sim``, ``bench/rollout.py``) and the
simulated ``ElasticEngine`` in ``rlenergy.sim.moe_engine``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from rlenergy import errors
from rlenergy.control.moe import base, placement, predictor, protocol, release
from rlenergy.gpu import models
from rlenergy.sim import moe_kernels

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True)
class MoeModel:
    """An MoE model's shape as the rollout simulator needs it.

    Attributes:
        key: CLI name.
        num_experts: routed experts per MoE layer.
        experts_per_token: routed experts per token (top-k).
        num_layers: transformer layers (all MoE in Qwen3 MoE).
        hidden_size: model width (all-to-all payload per token and expert is ``hidden`` BF16).
        expert_params: parameters of one expert index over all layers.
        dense_params: non-expert parameters (attention, embeddings, norms, router).
        active_params: parameters used per token (dense + top-k experts).
        kv_bytes_per_token: KV cache per context token, bytes (BF16).
        bytes_per_param: weight dtype bytes (BF16: 2).
    """

    key: str
    num_experts: int
    experts_per_token: int
    num_layers: int
    hidden_size: int
    expert_params: float
    dense_params: float
    active_params: float
    kv_bytes_per_token: int
    bytes_per_param: int = 2

    @property
    def expert_bytes(self) -> int:
        """One expert index over all layers, bytes."""
        return int(self.expert_params * self.bytes_per_param)

    @property
    def dense_bytes(self) -> int:
        """Non-expert weights, bytes."""
        return int(self.dense_params * self.bytes_per_param)


def _qwen3_moe(
    key: str,
    *,
    layers: int,
    hidden: int,
    moe_intermediate: int,
    total_params: float,
    active_params: float,
    kv_heads: int,
    head_dim: int,
) -> MoeModel:
    expert = 3 * hidden * moe_intermediate * layers  # gate, up, down projections
    return MoeModel(
        key=key,
        num_experts=128,
        experts_per_token=8,
        num_layers=layers,
        hidden_size=hidden,
        expert_params=float(expert),
        dense_params=total_params - 128 * expert,
        active_params=active_params,
        kv_bytes_per_token=layers * kv_heads * head_dim * 2 * 2,
    )


def _dense(
    key: str, *, layers: int, hidden: int, params: float, kv_heads: int, head_dim: int
) -> MoeModel:
    """A dense model in the MoE shape: one routed expert of no weight, every parameter dense."""
    return MoeModel(
        key=key,
        num_experts=1,
        experts_per_token=1,
        num_layers=layers,
        hidden_size=hidden,
        expert_params=0.0,
        dense_params=params,
        active_params=params,
        kv_bytes_per_token=layers * kv_heads * head_dim * 2 * 2,
    )


MOE_MODELS: Mapping[str, MoeModel] = {
    # Hugging Face Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 128 experts, top-8,
    # moe_intermediate_size 768, 4 KV heads x 128; model card: 30.5B total, 3.3B active.
    "qwen3-30b-a3b": _qwen3_moe(
        "qwen3-30b-a3b",
        layers=48,
        hidden=2048,
        moe_intermediate=768,
        total_params=30.5e9,
        active_params=3.3e9,
        kv_heads=4,
        head_dim=128,
    ),
    # Hugging Face Qwen/Qwen3-235B-A22B config.json: 94 layers, hidden 4096, 128 experts, top-8,
    # moe_intermediate_size 1536, 4 KV heads x 128; model card: 235B total, 22B active.
    "qwen3-235b-a22b": _qwen3_moe(
        "qwen3-235b-a22b",
        layers=94,
        hidden=4096,
        moe_intermediate=1536,
        total_params=235e9,
        active_params=22e9,
        kv_heads=4,
        head_dim=128,
    ),
    # Hugging Face Qwen/Qwen2-VL-72B-Instruct config.json: 80 layers, hidden 8192, 8 KV heads
    # x 128 (64 attention heads); model card: 72B parameters, dense (Seer's dense workload).
    "qwen2-vl-72b": _dense(
        "qwen2-vl-72b", layers=80, hidden=8192, params=72e9, kv_heads=8, head_dim=128
    ),
}

GPU_MEMORY_GB: Mapping[str, float] = {
    "h100-sxm": 80.0,  # NVIDIA H100 SXM datasheet
    "h200": 141.0,  # NVIDIA H200 datasheet
    "b200": 180.0,  # NVIDIA HGX B200 datasheet (per GPU)
}
"""HBM per GPU, GB (1e9 bytes)."""

GPU_MEMORY_UTILIZATION = 0.9
"""Share of HBM the engine may use: vLLM's ``gpu_memory_utilization`` default."""

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
class RolloutBatch:
    """One rollout step's responses (identical for both policies).

    Attributes:
        prompt_ids: prompt id per response, shape ``(n,)`` (a GRPO group shares one).
        prompt_tokens: prompt length per response, tokens, shape ``(n,)``.
        lengths_tokens: true response length per response, tokens (>= 1), shape ``(n,)``.
    """

    prompt_ids: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    lengths_tokens: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """One policy on one rollout step.

    Attributes:
        policy: ``baseline`` or ``flexfloor``.
        wall_s: rollout time, first decode step to last token, s.
        decode_steps: decode steps taken.
        tokens: response tokens delivered (recomputed tokens after preemption not counted).
        occupied_gpu_s: sum over workers of the time each stayed in the EP group, GPU-s.
        idle_after_finish_gpu_s: sum over workers of time in the group after their own last
            response ended, GPU-s.
        finish_s: per worker, when its last response ended, s, shape ``(workers,)``.
        release_s: per worker, when it left the group (``wall_s`` if it never left), s.
        expert_unavailable_steps: decode steps on which some expert had no active host.
        memory_overflow_steps: decode steps on which some active worker exceeded its memory.
        incomplete_responses: responses not finished at the end, those lost on a worker
            released before they finished included (must be 0).
        releases_committed: release rounds committed.
        releases_aborted: release rounds aborted (missed deadline or refusal).
        expert_moves: expert copies made.
        preemptions: responses preempted for KV memory (recomputed later).
        active_workers_min: fewest workers in the group at any decode step.
    """

    policy: str
    wall_s: float
    decode_steps: int
    tokens: int
    occupied_gpu_s: float
    idle_after_finish_gpu_s: float
    finish_s: tuple[float, ...]
    release_s: tuple[float, ...]
    expert_unavailable_steps: int
    memory_overflow_steps: int
    incomplete_responses: int
    releases_committed: int
    releases_aborted: int
    expert_moves: int
    preemptions: int
    active_workers_min: int


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


class _Round:
    """A release round in flight in the simulator (ack arrival per rank)."""

    def __init__(self, decision: base.ReleaseDecision, ack_at_step: Mapping[int, int]) -> None:
        self.round = protocol.ReleaseRound(decision)
        self.ack_at_step = dict(ack_at_step)


KV_HEADROOM_STEPS = 128
"""Decode steps of KV growth a preemption frees room for, and an admission must leave room
for [MODEL: vLLM frees exactly one step's blocks; freeing 16 steps' (under 1 % of the KV cache
at 150 running responses of a 72B model) batches the preemptions of a KV-bound engine into
one event instead of one per step, which made a 600-response engine 16x cheaper to
simulate]."""

RELEASE_MAX_SLOWDOWN = 0.02
"""The job owner's slowdown allowance a release may spend: a release whose forecast lengthens
the rest of the rollout step by more than 2 % is refused (``FlexFloorPlanner``'s
``max_slowdown``). Not a model constant: the owner's throughput floor of 0.98, as
``minThroughputRatio`` is for the clocks; per release, so several releases can add up."""

PLAN_RETRY_STEPS = 64
"""Decode steps before the planner is asked again after it released nobody [MODEL]."""


def simulate_rollout(
    config: RolloutConfig,
    batch: RolloutBatch,
    *,
    policy: str,
    predictions: Sequence[float] | None = None,
    dropped_acks: Mapping[int, frozenset[int]] | None = None,
    check_every_step: bool = True,
    guard: bool = True,
    coarse: bool = True,
    residual: predictor.ResidualLength | None = None,
    prediction_log_sigma: Sequence[float] | None = None,
    max_length_tokens: float | None = None,
    placement_mode: str = "lockstep",
) -> RolloutResult:
    """Decode one batch under ``policy`` and check the invariants at every decode step.

    Event-driven: a decode step on which something discrete happens (a response finishes, is
    admitted or preempted, a release round acks, commits or aborts, the planner is asked) is
    simulated on its own; the quiet steps between two such events, where the batch is constant
    and only contexts grow, are advanced together (``coarse=True``): their times come from
    ``DecodeStepModel.steps_s`` in one vectorised call, and the invariants are evaluated in
    closed form for every one of them (hosted experts do not change between events; KV grows
    linearly, so the first overflowing step is computed, not sampled). ``coarse=False`` steps
    one at a time; both give the same result up to float summation order.

    Args:
        config: the EP group.
        batch: the responses; both policies must get the same batch.
        policy: ``baseline`` or ``flexfloor``.
        predictions: predicted response length per response, tokens (FlexFloor placement,
            memory reservation and the guard's horizon); ``None``: every response predicted at
            the batch median.
        dropped_acks: fault injection: decision id -> ranks whose ack never arrives (the
            round must abort at its deadline and the group stay whole).
        check_every_step: run the invariant checks on every decode step (tests, bench).
        guard: FlexFloor only: give the planner the cost-aware guard (``DecodeStepModel``);
            ``False`` releases whenever the rule allows (the previous behaviour, for
            comparison).
        coarse: advance quiet decode steps together (see above).
        residual: remaining-length model for responses past their prediction (the guard's
            horizon); ``None``: such a response is expected to end at the next step.
        prediction_log_sigma: per response, the predictor's log error
            (``LengthPredictor.log_error_sigma``): the placement guard forecasts over it
            (``placement.expected_occupied_gpu_s``); ``None``: point predictions.
        max_length_tokens: the run's ``max_response_length`` (caps the forecast's draws).
        placement_mode: FlexFloor only: ``lockstep`` (``placement.place_lockstep``: equal
            loads on the lock-stepped ranks at every step, longest first; the policy),
            ``balanced`` (``placement.place_balanced``: equal predicted finish times per rank,
            as for independent engines; inside a group it measured x0.994 tokens per occupied
            GPU-s on ``verl-ppo-qwen25-7b-gsm8k-16gpu`` where ``lockstep`` gives x1.000) or
            ``length`` (the earlier ``placement.place_by_length``: concentrate long
            responses on few ranks). ``lockstep`` is ``placement.place_lockstep_within``, the
            rule the trainer SDK's planner calls too: dealt longest first, then kept within
            each rank's KV budget.

    Returns:
        The result, with its invariant-violation counters.

    Raises:
        InvalidInputError: unknown policy, inputs of different lengths, or a response whose
            prompt alone does not fit its worker.
    """
    if policy not in ("baseline", "flexfloor"):
        raise errors.InvalidInputError("policy", f"unknown policy {policy!r}")
    if placement_mode not in ("balanced", "length", "lockstep"):
        raise errors.InvalidInputError("placement", f"unknown placement {placement_mode!r}")
    n = len(batch.lengths_tokens)
    if len(batch.prompt_tokens) != n or len(batch.prompt_ids) != n:
        raise errors.InvalidInputError("batch", "prompt ids, prompt tokens and lengths differ")
    layout = config.layout()
    step_model = step_model_for(config)
    kvb = layout.kv_bytes_per_token
    workers = config.workers
    experts_of = config.initial_experts()
    lengths = np.asarray(batch.lengths_tokens, dtype=np.int64)
    prompts = np.asarray(batch.prompt_tokens, dtype=np.int64)
    if predictions is None:
        median = float(np.median(lengths)) if n else 1.0
        predicted = np.full(n, median)
    else:
        predicted = np.asarray(predictions, dtype=np.float64)

    budgets = [
        layout.worker_memory_bytes - layout.dense_bytes - len(e) * layout.expert_bytes
        for e in experts_of
    ]
    if policy == "baseline":
        worker_of = np.asarray(placement.place_even(n, workers), dtype=np.int64)
    else:
        pred_list = [float(x) for x in predicted]
        if placement_mode == "length":
            candidate: Sequence[int] = placement.place_by_length(
                pred_list, list(batch.prompt_tokens), budgets, kvb
            ).worker_of
        elif placement_mode == "lockstep":
            candidate = placement.place_lockstep_within(
                pred_list, list(batch.prompt_tokens), budgets, kvb
            ).worker_of
        else:
            candidate = placement.place_balanced(
                pred_list, batch.prompt_tokens, workers, fluid_model(config, per_rank=True)
            )
        worker_of = np.asarray(candidate, dtype=np.int64)
        if guard and workers > 1:
            # Placement half of the guard: keep verl's even placement (releases still allowed)
            # when the candidate is forecast not to pay. Both are forecast over the
            # predictions' error (common draws), so a worker holding many responses predicted
            # alike is charged for the longest it will likely hold.
            even = placement.place_even(n, workers)
            shards = [frozenset(e) for e in experts_of]
            sigma = list(prediction_log_sigma) if prediction_log_sigma is not None else [0.0] * n
            placed_cost, spread = (
                placement.expected_occupied_gpu_s(
                    option,
                    pred_list,
                    sigma,
                    batch.prompt_tokens,
                    shards,
                    layout,
                    step_model,
                    elastic=True,
                    max_tokens=max_length_tokens,
                )
                for option in (candidate, even)
            )
            if spread <= placed_cost:
                # verl's chunks, kept within each rank's KV budget like the candidate.
                kept = placement.fit_kv_budget(even, pred_list, batch.prompt_tokens, budgets, kvb)
                worker_of = np.asarray(kept.worker_of, dtype=np.int64)

    queued = np.ones(n, dtype=bool)
    running = np.zeros(n, dtype=bool)
    done = np.zeros(n, dtype=bool)
    lost = np.zeros(n, dtype=bool)  # on a worker released before they finished: never complete
    generated = np.zeros(n, dtype=np.int64)
    admit_seq = np.zeros(n, dtype=np.int64)  # admission order (preempt the newest first)
    seq = 0
    active = [True] * workers
    finish_s = [0.0] * workers
    release_s = [-1.0] * workers
    worker_done = [False] * workers
    planner = release.FlexFloorPlanner(
        layout, step_model if guard else None, max_slowdown=RELEASE_MAX_SLOWDOWN
    )
    rounds: _Round | None = None
    decision_id = 0
    retry_at_step = 0
    time_s = 0.0
    step = 0
    occupied = 0.0
    idle_after = 0.0
    unavailable = overflow = 0
    committed = aborted = moves_made = preemptions = 0
    min_active = workers
    all_experts = set(range(config.experts))
    drop = dropped_acks or {}
    order = np.argsort(worker_of, kind="stable")  # queue order: placement order per worker

    def kv_bytes_per_worker() -> FloatArray:
        ctx = (prompts + generated).astype(np.float64)
        out: FloatArray = np.bincount(
            worker_of[running], weights=ctx[running] * kvb, minlength=workers
        ).astype(np.float64)
        return out

    def kv_capacity(w: int) -> int:
        return (
            layout.worker_memory_bytes
            - layout.dense_bytes
            - len(experts_of[w]) * layout.expert_bytes
        )

    def fits(kv_w: float, need: float, count: int, w: int) -> bool:
        # vLLM V1 schedules the running requests' next token first and admits a waiting one
        # only into the blocks left after that, so an admission never forces a preemption
        # in the same step (before: the admitted response was preempted at once, a ping-pong
        # that cost an event per step under KV pressure).
        return kv_w + need + (count + 1) * kvb * KV_HEADROOM_STEPS <= kv_capacity(w)

    def admit() -> None:
        nonlocal seq
        kv = kv_bytes_per_worker()
        counts = np.bincount(worker_of[running], minlength=workers)
        blocked: set[int] = set()  # FIFO per worker: the head waits, so does the rest
        for i in order[queued[order]]:
            w = int(worker_of[i])
            if w in blocked:
                continue
            need = float((prompts[i] + 1) * kvb)
            if counts[w] < MAX_RUNNING_PER_WORKER and fits(kv[w], need, counts[w], w):
                queued[i] = False
                running[i] = True
                admit_seq[i] = seq
                seq += 1
                kv[w] += need
                counts[w] += 1
            else:
                blocked.add(w)
                if len(blocked) == workers:
                    break  # every worker's queue head waits: nothing more can be admitted

    def admissible() -> bool:
        """Would ``admit`` admit anything now (the head of some worker's queue fits)?"""
        if not queued.any():
            return False
        kv = kv_bytes_per_worker()
        counts = np.bincount(worker_of[running], minlength=workers)
        seen: set[int] = set()
        for i in order[queued[order]]:
            w = int(worker_of[i])
            if w in seen:
                continue
            seen.add(w)
            need = float((prompts[i] + 1) * kvb)
            if counts[w] < MAX_RUNNING_PER_WORKER and fits(kv[w], need, counts[w], w):
                return True
            if len(seen) == workers:
                break
        return False

    def preempt_for_growth() -> None:
        nonlocal preemptions
        kv = kv_bytes_per_worker()
        counts = np.bincount(worker_of[running], minlength=workers)
        for w in range(workers):
            cap = kv_capacity(w)
            if counts[w] == 0 or kv[w] + counts[w] * kvb <= cap:
                continue
            # Preempt (newest first) until the rest can grow KV_HEADROOM_STEPS more steps.
            while counts[w] > 0 and kv[w] + counts[w] * kvb * KV_HEADROOM_STEPS > cap:
                on_w = np.flatnonzero(running & (worker_of == w))
                victim = int(on_w[np.argmax(admit_seq[on_w])])
                kv[w] -= float((prompts[victim] + generated[victim]) * kvb)
                counts[w] -= 1
                running[victim] = False
                queued[victim] = True
                generated[victim] = 0  # recompute from the prompt (vLLM V1 preemption)
                preemptions += 1

    def worker_states() -> list[base.WorkerState]:
        kv = kv_bytes_per_worker()
        unfinished = np.bincount(worker_of[~done], minlength=workers)
        n_running = np.bincount(worker_of[running], minlength=workers)
        remaining = np.clip(predicted - generated, 1.0, None)
        if residual is not None:
            over = np.flatnonzero(~done & (generated >= predicted))
            for i in over:
                remaining[i] = residual.remaining(float(predicted[i]), float(generated[i]))
        remaining_kv = np.bincount(
            worker_of[~done], weights=remaining[~done] * kvb, minlength=workers
        )
        remaining_steps = np.zeros(workers)
        np.maximum.at(remaining_steps, worker_of[~done], remaining[~done])
        left = np.flatnonzero(~done)
        profile: list[list[float]] = [[] for _ in range(workers)]
        for i in left[np.argsort(worker_of[left], kind="stable")]:
            profile[int(worker_of[i])].append(float(remaining[i]))
        return [
            base.WorkerState(
                worker=w,
                experts=frozenset(experts_of[w]),
                unfinished=int(unfinished[w]),
                kv_bytes=int(kv[w]),
                kv_reserved_bytes=int(remaining_kv[w]),
                running=int(n_running[w]),
                remaining_steps=float(remaining_steps[w]),
                remaining_profile=tuple(profile[w]),
            )
            for w in range(workers)
            if active[w]
        ]

    def batch_shape(active_ranks: list[int]) -> tuple[IntArray, FloatArray, IntArray]:
        run_idx = np.flatnonzero(running)
        n_w = np.bincount(worker_of[run_idx], minlength=workers)
        ctx_w = np.bincount(
            worker_of[run_idx], weights=(prompts[run_idx] + generated[run_idx]), minlength=workers
        )
        experts_w = np.asarray([len(experts_of[w]) for w in active_ranks], dtype=np.int64)
        return n_w[active_ranks], ctx_w[active_ranks].astype(np.float64), experts_w

    def quiet_steps(active_ranks: list[int]) -> int:
        """Decode steps from now on which nothing discrete can happen (see docstring)."""
        if rounds is not None or not running.any():
            return 0
        run_idx = np.flatnonzero(running)
        quiet = int((lengths[run_idx] - generated[run_idx]).min()) - 1  # next finish: singly
        if policy == "flexfloor" and any(active[w] and worker_done[w] for w in range(workers)):
            quiet = min(quiet, retry_at_step - step - 1)  # the planner is asked at retry
        if quiet <= 0 or admissible():
            return 0
        kv = kv_bytes_per_worker()
        n_w = np.bincount(worker_of[run_idx], minlength=workers)
        for w in range(workers):
            if n_w[w]:
                # Preemption check of quiet step j: kv + j x running x kvb > capacity.
                quiet = min(quiet, int((kv_capacity(w) - kv[w]) // (n_w[w] * kvb)))
        return max(quiet, 0)

    def check_invariants(active_ranks: list[int], count: int) -> None:
        """Count violations over ``count`` steps with this batch (contexts growing)."""
        nonlocal unavailable, overflow
        hosted: set[int] = set()
        for w in active_ranks:
            hosted |= experts_of[w]
        if hosted != all_experts:
            unavailable += count
        kv = kv_bytes_per_worker()
        n_w = np.bincount(worker_of[running], minlength=workers)
        first_bad = count  # first 0-based step of the run with some worker over memory
        for w in active_ranks:
            cap = kv_capacity(w)
            if kv[w] > cap:
                first_bad = 0
            elif n_w[w]:
                first_bad = min(first_bad, int((cap - kv[w]) // (n_w[w] * kvb)) + 1)
        overflow += max(count - first_bad, 0)

    for w in range(workers):
        if not (worker_of == w).any():
            worker_done[w] = True  # nothing placed on it: finished from the start

    while not (done | lost).all():
        if queued.any():
            admit()
        preempt_for_growth()
        active_ranks = [w for w in range(workers) if active[w]]
        min_active = min(min_active, len(active_ranks))
        if not running.any():
            raise errors.InvalidInputError(
                "batch", "a response cannot be admitted on its worker (prompt larger than memory)"
            )
        if check_every_step:
            check_invariants(active_ranks, 1)
        # --- time of this decode step -------------------------------------------------------
        run_idx = np.flatnonzero(running)
        dt = float(step_model.steps_s(*batch_shape(active_ranks))[0])
        # --- advance -----------------------------------------------------------------------
        generated[run_idx] += 1
        finished = run_idx[generated[run_idx] >= lengths[run_idx]]
        running[finished] = False
        done[finished] = True
        time_s += dt
        step += 1
        occupied += dt * len(active_ranks)
        if finished.size:
            left = np.bincount(worker_of[~done], minlength=workers)
            for w in set(worker_of[finished].tolist()):
                if left[w] == 0 and not worker_done[w]:
                    worker_done[w] = True
                    finish_s[w] = time_s
        idle_after += dt * sum(1 for w in active_ranks if worker_done[w])
        if policy == "flexfloor":
            # --- FlexFloor release ----------------------------------------------------------
            if rounds is not None:
                r = rounds.round
                for rank, at in rounds.ack_at_step.items():
                    if step >= at and rank not in drop.get(r.decision.decision_id, frozenset()):
                        r.ack(rank, r.decision.decision_id)
                status = r.advance(step)
                if status is protocol.RoundStatus.ABORTED:
                    aborted += 1
                    rounds = None
                    retry_at_step = step + config.timing.ack_window_steps
                elif status is protocol.RoundStatus.COMMITTED and step >= r.decision.apply_at_step:
                    for move in r.decision.moves:
                        experts_of[move.target].add(move.expert)
                    moves_made += len(r.decision.moves)
                    # The copies run before the apply step; conservatively charge them as a
                    # stall of the whole group (they share HBM and links with decoding) [MODEL].
                    stall = step_model.copy_s(r.decision.moves)
                    time_s += stall
                    occupied += stall * len(active_ranks)
                    for w in r.decision.release:
                        active[w] = False
                        release_s[w] = time_s
                    # A released worker stops decoding: what it still held is lost.
                    gone = ~done & np.isin(worker_of, r.decision.release)
                    lost |= gone
                    queued[gone] = running[gone] = False
                    committed += 1
                    rounds = None
            if rounds is None and step >= retry_at_step:
                candidates = [w for w in range(workers) if active[w] and worker_done[w]]
                if candidates and not (done | lost).all():
                    plan = planner.plan(worker_states(), step)
                    if plan.release:
                        decision = protocol.make_decision(
                            plan,
                            decision_id=decision_id,
                            active_before=tuple(w for w in range(workers) if active[w]),
                            step=step,
                            timing=config.timing,
                        )
                        decision_id += 1
                        rounds = _Round(decision, {w: step + 1 for w in decision.active_before})
                    else:
                        retry_at_step = step + PLAN_RETRY_STEPS  # wait for the batch to change
        if not coarse or (done | lost).all():
            continue
        # --- quiet steps until the next event, all at once --------------------------------
        active_ranks = [w for w in range(workers) if active[w]]
        quiet = quiet_steps(active_ranks)
        if quiet <= 0:
            continue
        if check_every_step:
            check_invariants(active_ranks, quiet)
        dts = step_model.steps_s(*batch_shape(active_ranks), growth_steps=quiet)
        span = float(dts.sum())
        generated[running] += quiet
        time_s += span
        step += quiet
        occupied += span * len(active_ranks)
        idle_after += span * sum(1 for w in active_ranks if worker_done[w])
    wall = time_s
    rel = tuple(wall if r < 0 else r for r in release_s)
    tp = config.tensor_parallel  # a worker occupies this many GPUs
    return RolloutResult(
        policy=policy,
        wall_s=wall,
        decode_steps=step,
        tokens=int(lengths.sum()),
        occupied_gpu_s=occupied * tp,
        idle_after_finish_gpu_s=idle_after * tp,
        finish_s=tuple(finish_s),
        release_s=rel,
        expert_unavailable_steps=unavailable,
        memory_overflow_steps=overflow,
        incomplete_responses=int((~done).sum()) + int((generated[done] < lengths[done]).sum()),
        releases_committed=committed,
        releases_aborted=aborted,
        expert_moves=moves_made,
        preemptions=preemptions,
        active_workers_min=min_active,
    )


def predictor_for(max_response_length: int) -> predictor.LengthPredictor:
    """The FlexFloor length predictor the simulator uses (fallback: the median)."""
    return predictor.LengthPredictor(
        history_epochs=3,
        fallback_quantile=0.5,
        default_length_tokens=max(max_response_length / 2, 1),
    )


def simulate_pool(
    config: RolloutConfig,
    batch: RolloutBatch,
    *,
    replicas: int,
    policy: str,
    predictions: Sequence[float] | None = None,
    check_every_step: bool = True,
    guard: bool = True,
    residual: predictor.ResidualLength | None = None,
    prediction_log_sigma: Sequence[float] | None = None,
    max_length_tokens: float | None = None,
    placement_mode: str = "lockstep",
) -> RolloutResult:
    """Decode one batch on ``replicas`` independent EP groups of ``config.workers`` ranks each.

    verl runs a rollout pool as independent inference-engine replicas (vLLM / SGLang servers,
    each ``TP x DP x PP`` GPUs; with expert parallelism the DP-attention ranks of a replica
    form one EP group and step together, while replicas progress independently) and waits at
    the RL step barrier for the last one. Within a replica this is ``simulate_rollout``;
    across replicas:

    * ``baseline``: the batch is split into equal contiguous chunks over the replicas
      (``placement.place_even``: verl's ``DataProto.chunk`` / even dispatch), and every GPU
      stays occupied until the slowest replica ends: a replica that ends at ``wall_r`` adds
      ``workers x (wall - wall_r)`` GPU-s of occupied time, all of it idle after finish.
    * ``flexfloor``: the responses are placed on the replicas by ``placement.place_balanced``
      (longest predicted first, each to the replica predicted to finish earliest, with the
      replica's ``FluidFinishModel`` fitted to the step model: memory-aware through its KV
      capacity), unless the guard predicts the even split to end no later; each replica
      places its responses on its DP ranks (``placement_mode``: by default dealt for equal
      per-step loads, since the ranks of one group step together) and releases
      its ranks with the FlexFloor planner, and a replica whose responses are all done
      leaves the pool at once: its experts serve only its own EP group, so no expert becomes
      unavailable to anyone still decoding. (Concentrating predicted-long prompts on few
      replicas, ``placement.place_by_length`` at replica granularity, was measured earlier on
      verl#3727 with 16 one-GPU replicas at x0.773 generation throughput: it lengthens the
      makespan, balancing shortens it.)

    With ``replicas == 1`` this is exactly ``simulate_rollout``. Ranks are numbered replica by
    replica (``finish_s``, ``release_s``); ``active_workers_min`` is the sum of each replica's
    fewest ranks; the wall time is the slowest replica's.

    Raises:
        InvalidInputError: ``replicas < 1``, or as ``simulate_rollout``.
    """
    if replicas < 1:
        raise errors.InvalidInputError("--replicas", f"need >= 1 replica, got {replicas}")
    if policy not in ("baseline", "flexfloor"):
        raise errors.InvalidInputError("policy", f"unknown policy {policy!r}")

    def run(part: RolloutBatch, idx: Sequence[int] | None) -> RolloutResult:
        def pick(values: Sequence[float] | None) -> Sequence[float] | None:
            return values if values is None or idx is None else [values[i] for i in idx]

        return simulate_rollout(
            config,
            part,
            policy=policy,
            predictions=pick(predictions),
            check_every_step=check_every_step,
            guard=guard,
            residual=residual,
            prediction_log_sigma=pick(prediction_log_sigma),
            max_length_tokens=max_length_tokens,
            placement_mode=placement_mode,
        )

    if replicas == 1:
        return run(batch, None)
    n = len(batch.lengths_tokens)
    replica_of = list(placement.place_even(n, replicas))
    if policy == "flexfloor" and predictions is not None:
        # Balance the replicas' predicted finish times (longest first); the guard keeps the
        # even split unless the balanced one is predicted to end no later.
        model = fluid_model(config, per_rank=False)
        preds = [float(x) for x in predictions]
        balanced = list(placement.place_balanced(preds, batch.prompt_tokens, replicas, model))
        makespans = [
            placement.predicted_makespan_s(option, preds, batch.prompt_tokens, replicas, model)
            for option in (balanced, replica_of)
        ]
        if makespans[0] <= makespans[1]:
            replica_of = balanced
    results: list[RolloutResult] = []
    for r in range(replicas):
        idx = [i for i in range(n) if replica_of[i] == r]
        sub = RolloutBatch(
            prompt_ids=tuple(batch.prompt_ids[i] for i in idx),
            prompt_tokens=tuple(batch.prompt_tokens[i] for i in idx),
            lengths_tokens=tuple(batch.lengths_tokens[i] for i in idx),
        )
        if not idx:
            results.append(_empty_result(policy, config.workers))
            continue
        results.append(run(sub, idx))
    wall = max(r.wall_s for r in results)
    g = config.workers * config.tensor_parallel
    barrier = policy == "baseline"
    wait = sum(g * (wall - r.wall_s) for r in results) if barrier else 0.0
    return RolloutResult(
        policy=policy,
        wall_s=wall,
        decode_steps=max(r.decode_steps for r in results),
        tokens=sum(r.tokens for r in results),
        occupied_gpu_s=sum(r.occupied_gpu_s for r in results) + wait,
        idle_after_finish_gpu_s=sum(r.idle_after_finish_gpu_s for r in results) + wait,
        finish_s=tuple(f for r in results for f in r.finish_s),
        release_s=tuple(wall if barrier else s for r in results for s in r.release_s),
        expert_unavailable_steps=sum(r.expert_unavailable_steps for r in results),
        memory_overflow_steps=sum(r.memory_overflow_steps for r in results),
        incomplete_responses=sum(r.incomplete_responses for r in results),
        releases_committed=sum(r.releases_committed for r in results),
        releases_aborted=sum(r.releases_aborted for r in results),
        expert_moves=sum(r.expert_moves for r in results),
        preemptions=sum(r.preemptions for r in results),
        active_workers_min=sum(r.active_workers_min for r in results),
    )


def _empty_result(policy: str, workers: int) -> RolloutResult:
    """A replica that got no response: it finishes (and, under FlexFloor, leaves) at 0."""
    return RolloutResult(
        policy=policy,
        wall_s=0.0,
        decode_steps=0,
        tokens=0,
        occupied_gpu_s=0.0,
        idle_after_finish_gpu_s=0.0,
        finish_s=(0.0,) * workers,
        release_s=(0.0,) * workers,
        expert_unavailable_steps=0,
        memory_overflow_steps=0,
        incomplete_responses=0,
        releases_committed=0,
        releases_aborted=0,
        expert_moves=0,
        preemptions=0,
        active_workers_min=0,
    )
