"""Shared inputs of the FlexFloor unit tests."""

from __future__ import annotations

from rlenergy.control.moe import placement

MODEL = placement.FluidFinishModel(
    step_fixed_s=0.01,
    kv_s_per_byte=1e-12,
    kv_capacity_bytes=1e9,
    kv_bytes_per_token=1000,
    max_running=64,
)
"""A fluid finish model with round numbers: 10 ms per decode step, 1 ps per KV byte per step,
1 GB of KV, 1 kB per token, 64 responses running at once."""
