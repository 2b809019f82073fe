"""Shared inputs of the FlexFloor unit tests."""

from __future__ import annotations

from collections.abc import Sequence

from rlenergy.control.moe import base, placement

MODEL = placement.FluidFinishModel(
    step_fixed_s=0.01,
    kv_s_per_byte=1e-12,
    kv_capacity_bytes=1e9,
    kv_bytes_per_token=1000,
    max_running=64,
)
"""A fluid finish model with round numbers: 10 ms per decode step, 1 ps per KV byte per step,
1 GB of KV, 1 kB per token, 64 responses running at once."""


class LinearCost:
    """Step time = fixed + per_expert x experts of the busiest worker (a pure test model)."""

    def __init__(self, fixed_s: float, per_expert_s: float, copy_s: float = 0.0) -> None:
        self.fixed_s = fixed_s
        self.per_expert_s = per_expert_s
        self.copy_each_s = copy_s

    def decode_step_s(self, workers: Sequence[base.WorkerState]) -> float:
        return self.fixed_s + self.per_expert_s * max(len(w.experts) for w in workers)

    def copy_s(self, moves: Sequence[base.ExpertMove]) -> float:
        return self.copy_each_s * len(moves)
