"""The rollout simulator's model catalogue: MoE (and dense) model shapes and GPU memory.

``rlenergy.sim.moe_cost`` prices a decode step of these models; ``rlenergy.sim.moe`` runs the
rollout on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


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
