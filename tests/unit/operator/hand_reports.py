"""Hand-written node reports whose figures are known exactly, for the ``JobLoop`` unit tests.

A step is (valid tokens, idle J, {phase: (duration s, energy J or None, error or None)}): every
window at the default governor from an energy counter unless ``extra`` gives more of its
``PhaseWindowReport`` fields by (step, phase).
"""

from __future__ import annotations

from typing import Any

from rlenergy_operator import jobloop

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy
from rlenergy.gpu import models

NODE = "gpu-node-0"
GPU = "NVIDIA H100 80GB HBM3"
CLOCKS = list(models.get_sku("h100-sxm").supported_sm_clocks_mhz())

Window = tuple[float, float | None, str | None]
Steps = dict[int, tuple[float, float | None, dict[str, Window]]]
Extra = dict[tuple[int, str], dict[str, Any]]

STEPS: Steps = {
    0: (1000.0, 100.0, {"generation": (10.0, 3000.0, None), "training": (4.0, 2000.0, None)}),
    1: (500.0, 50.0, {"generation": (8.0, 2500.0, None), "training": (5.0, 2200.0, None)}),
}


def report(
    steps: Steps,
    *,
    node: str = NODE,
    extra: Extra | None = None,
    gpus: tuple[str, ...] = (GPU,),
    clocks: list[int] = CLOCKS,
    last_step: int | None = None,
) -> api_node.NodeReport:
    """One node's report of ``steps`` (its GPUs named ``gpus``, supporting ``clocks``)."""
    extra = extra or {}
    records = [
        api_node.StepRecord(
            step=step,
            workload=api_node.TokenWorkloadReport(
                samples=8,
                response_tokens=valid,
                prompt_tokens=100.0,
                valid_tokens=valid,
                mean_context_tokens=512.0,
            ),
            phases=[
                api_node.PhaseWindowReport.model_validate(
                    {
                        "phase": name,
                        "duration_seconds": duration,
                        "energy_joules": energy,
                        "error": error,
                        "energy_source": "counter",
                        "progress_mean_gap_seconds": 0.0,
                        **extra.get((step, name), {}),
                    }
                )
                for name, (duration, energy, error) in phases.items()
            ],
            idle_energy_joules=idle,
        )
        for step, (valid, idle, phases) in sorted(steps.items())
    ]
    return api_node.NodeReport(
        policy_name="p",
        node_name=node,
        gpus=[
            api_node.GpuStatus(uuid=f"GPU-{node}-{i}", name=name, supported_clocks_mhz=clocks)
            for i, name in enumerate(gpus)
        ],
        steps=records,
        last_step=max(steps) if last_step is None else last_step,
    )


def spec(mode: str = "sync", **fields: Any) -> policy.RLEnergyPolicySpec:
    """A policy spec: ``fields`` as written in the resource (camelCase)."""
    return policy.parse_policy({"selector": {"matchLabels": {"a": "b"}}, "mode": mode, **fields})


def folded(
    mode: str, steps: Steps, *, extra: Extra | None = None, **fields: Any
) -> jobloop.JobLoop:
    """A loop that has folded every step of one node's report (``fields``: the spec's)."""
    out = jobloop.JobLoop(spec(mode, **fields), 1)
    assert out.advance([report(steps, extra=extra)]) == sorted(steps)
    return out
