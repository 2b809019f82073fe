"""``JobLoop`` accounting on hand-written node reports whose figures are known exactly.

Every window runs at the default governor, which is its own counterfactual
(``EERLController.default_equivalent``), so each running sum is a sum the test can write down:
sync steps last the sum of their phases, async steps (pools at once) their slowest phase;
energy per valid token is the phase's energy over the step's valid tokens; a window whose
prediction is unknown (an error) is measured but never compared, and its step is not a compared
step; an unknown energy makes an unknown-energy step each time. Written against the mutmut
survivors of ``_account`` (docs/mutation.md).
"""

from __future__ import annotations

import pytest
from rlenergy_operator import jobloop

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy
from rlenergy.gpu import models

NODE = "gpu-node-0"
CLOCKS = list(models.get_sku("h100-sxm").supported_sm_clocks_mhz())

# step -> (valid tokens, idle J, {phase: (duration s, energy J or None, error or None)})
Steps = dict[int, tuple[float, float, dict[str, tuple[float, float | None, str | None]]]]
STEPS: Steps = {
    0: (1000.0, 100.0, {"generation": (10.0, 3000.0, None), "training": (4.0, 2000.0, None)}),
    1: (500.0, 50.0, {"generation": (8.0, 2500.0, None), "training": (5.0, 2200.0, None)}),
}


def _report(steps: Steps) -> api_node.NodeReport:
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
                api_node.PhaseWindowReport(
                    phase=name,
                    duration_seconds=duration,
                    energy_joules=energy,
                    requested_clock_mhz=None,
                    error=error,
                    energy_source="counter",
                    progress_mean_gap_seconds=0.0,
                )
                for name, (duration, energy, error) in phases.items()
            ],
            idle_energy_joules=idle,
        )
        for step, (valid, idle, phases) in sorted(steps.items())
    ]
    return api_node.NodeReport(
        policy_name="p",
        node_name=NODE,
        gpus=[api_node.GpuStatus(uuid="GPU-a", name="NVIDIA H100", supported_clocks_mhz=CLOCKS)],
        steps=records,
        last_step=max(steps),
    )


def _loop(mode: str, steps: Steps) -> jobloop.JobLoop:
    spec = policy.parse_policy({"selector": {"matchLabels": {"a": "b"}}, "mode": mode})
    loop = jobloop.JobLoop(spec, 1)
    assert loop.advance([_report(steps)]) == sorted(steps)
    return loop


@pytest.mark.parametrize(("mode", "step_seconds"), [("sync", 14.0 + 13.0), ("async", 10.0 + 8.0)])
def test_default_governor_steps_add_up_exactly(mode: str, step_seconds: float) -> None:
    loop = _loop(mode, STEPS)
    acc = loop.account
    assert (acc.steps, acc.compared_steps, acc.through_step) == (2, 2, 1)
    assert acc.valid_tokens == 1500.0
    assert acc.measured_joules == acc.compared_measured_joules == 5100.0 + 4750.0
    assert acc.predicted_default_joules == 9850.0
    assert acc.measured_seconds == acc.predicted_default_seconds == step_seconds
    gen, train = acc.phases["generation"], acc.phases["training"]
    assert (gen.measured_joules, gen.compared_measured_joules) == (5500.0, 5500.0)
    assert (gen.measured_seconds, gen.predicted_default_seconds) == (18.0, 18.0)
    assert train.predicted_default_joules == 4200.0
    # the last step's energy per valid token: 2500 J / 500 tokens, 2200 J / 500 tokens
    assert gen.energy_per_valid_token_joules == 5.0
    assert gen.predicted_default_energy_per_valid_token_joules == 5.0
    assert train.energy_per_valid_token_joules == 4.4
    totals = loop.totals()
    assert (totals.saved_joules, totals.saving_percent, totals.throughput_ratio) == (
        0.0,
        0.0,
        1.0,
    )


def test_an_unpredictable_window_is_measured_never_compared() -> None:
    steps = dict(STEPS)
    steps[2] = (0.0, 10.0, {"generation": (6.0, 1800.0, None), "training": (3.0, 900.0, "NVML")})
    loop = _loop("sync", steps)
    acc = loop.account
    assert (acc.steps, acc.compared_steps) == (3, 2)
    assert acc.measured_joules == 9850.0 + 2710.0
    assert acc.compared_measured_joules == acc.predicted_default_joules == 9850.0
    assert acc.measured_seconds == 27.0
    train = acc.phases["training"]
    assert train.measured_joules == 4200.0 + 900.0
    assert train.compared_measured_joules == train.predicted_default_joules == 4200.0
    assert train.measured_seconds == 9.0
    gen = acc.phases["generation"]
    assert gen.compared_measured_joules == 5500.0 + 1800.0  # its own window still compares
    # no valid tokens in the step: no energy per token (never a division by zero)
    assert gen.energy_per_valid_token_joules is None
    assert gen.predicted_default_energy_per_valid_token_joules is None


def test_every_unknown_energy_step_is_counted() -> None:
    steps = dict(STEPS)
    for step in (2, 3):
        steps[step] = (
            400.0,
            10.0,
            {"generation": (6.0, None, None), "training": (3.0, 900.0, None)},
        )
    loop = _loop("sync", steps)
    acc = loop.account
    assert (acc.steps, acc.unknown_energy_steps, acc.compared_steps) == (4, 2, 2)
    assert acc.measured_joules == 9850.0  # an unknown step adds nothing, never 0 as known
    assert acc.valid_tokens == 1500.0 + 800.0
    assert acc.phases["generation"].energy_per_valid_token_joules is None
    assert acc.phases["training"].energy_per_valid_token_joules == 900.0 / 400.0
