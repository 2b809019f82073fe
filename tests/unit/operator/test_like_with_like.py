"""Savings compare like with like: both sides of a saving from one source.

The energy cross-check shows that a board's counter and its power sensor can disagree by tens of
percent; a saving whose measured side came from one and whose default-governor side from the
other would report that disagreement as a saving. So a phase window is compared only when its
source matches the phase's default-governor basis (its first default window), and a probe
block's power ratio needs one source on all its slices.
"""

from __future__ import annotations

import pytest
from rlenergy_operator import jobloop

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.freq import base, probe
from tests import factories

pytestmark = pytest.mark.field

SPEC = api_policy.RLEnergyPolicySpec.model_validate(
    {"selector": {"matchLabels": {"app": "x"}}, "controller": {"warmupSteps": 8}}
)


def _step(
    step: int, source: str, gen_j: float = 4e4, clock_mhz: int | None = None
) -> api_node.StepRecord:
    return api_node.StepRecord(
        step=step,
        workload=api_node.TokenWorkloadReport(
            samples=8,
            response_tokens=1000,
            prompt_tokens=100,
            valid_tokens=1000,
            mean_context_tokens=500,
        ),
        phases=[
            api_node.PhaseWindowReport(
                phase="generation",
                duration_seconds=100.0,
                energy_joules=gen_j,
                energy_source=source,
                requested_clock_mhz=clock_mhz,
            ),
            api_node.PhaseWindowReport(
                phase="training",
                duration_seconds=60.0,
                energy_joules=3e4,
                energy_source="counter",
            ),
        ],
        idle_energy_joules=0.0,
    )


def _report(steps: list[api_node.StepRecord]) -> api_node.NodeReport:
    gpu = api_node.GpuStatus(uuid="GPU-1", supported_clocks_mhz=[1980, 1500, 1005])
    return factories.node_report(steps=steps, gpus=[gpu], last_step=steps[-1].step)


def _loop(steps: list[api_node.StepRecord]) -> jobloop.JobLoop:
    loop = jobloop.JobLoop(SPEC, 1)
    loop.advance([_report(steps)])
    return loop


def test_a_window_from_another_source_is_measured_not_compared():
    warm = [_step(s, "counter") for s in range(3)]
    # Step 3 ran locked at 1500 MHz; its prediction is the default-governor model fitted on the
    # counter windows of the warm-up. Metered by the counter it is compared; metered by
    # integrated power reading 30 % low (a board whose sensors disagree) it must not be, or the
    # sensors' disagreement would be booked as a 30 % saving.
    same = _loop([*warm, _step(3, "counter", 3.6e4, clock_mhz=1500)])
    mixed = _loop([*warm, _step(3, "power_integration", 2.8e4, clock_mhz=1500)])
    ts, tm = same.totals(), mixed.totals()
    assert ts.compared_steps == 4 and ts.source_mismatch_steps == 0
    assert ts.saved_joules == pytest.approx(4e3, rel=0.05)  # 4e4 predicted, 3.6e4 measured
    assert mixed.basis_source == {"generation": "counter", "training": "counter"}
    assert (tm.source_mismatch_steps, tm.compared_steps) == (1, 3)
    assert tm.measured_joules == pytest.approx(ts.measured_joules - 8e3)  # measured, all of it
    assert tm.saved_joules == pytest.approx(0.0, abs=1e-6)  # no fake saving
    (gen,) = [p for p in mixed.phase_status() if p.name == "generation"]
    assert gen.compared_measured_joules == pytest.approx(1.2e5)


def test_the_basis_survives_a_restart_whose_reports_lost_the_default_windows():
    # The default-governor windows (steps 0-2, counter) are trimmed from the node report by the
    # time the operator restarts; the next default window is metered by integrated power (the
    # counter stopped). Restored from the status checkpoint, the loop keeps the counter basis
    # and books exactly what a loop that never restarted books.
    warm = [_step(s, "counter") for s in range(3)]
    later = [_step(3, "power_integration", 2.8e4, clock_mhz=1500), _step(4, "power_integration")]
    never = _loop([*warm, *later])
    before = _loop([*warm, later[0]])
    body = {
        "phases": [p.model_dump(by_alias=True, exclude_none=True) for p in before.phase_status()],
        "totals": before.totals().model_dump(by_alias=True, exclude_none=True),
    }
    checkpoint = api_status.RLEnergyPolicyStatus.model_validate(body)
    assert {p.name: p.basis_energy_source for p in checkpoint.phases}["generation"] == "counter"
    restored = jobloop.JobLoop.restore(SPEC, 1, checkpoint, [_report(later)])
    restored.advance([_report(later)])
    counter = {"generation": "counter", "training": "counter"}
    assert restored.basis_source == never.basis_source == counter
    assert restored.totals() == never.totals()
    assert restored.totals().source_mismatch_steps == 2


def _block(sources: list[str | None]) -> list[base.ProbeSlice]:
    return [
        base.ProbeSlice(
            1395 if cand else None,
            1.0,
            9.0 if cand else 10.0,
            300.0 if cand else 400.0,
            energy_source=src,
        )
        for cand, src in zip(probe.THUE_MORSE, sources, strict=True)
    ]


def test_a_probe_block_compares_power_within_one_source():
    ((_, thr, power),), _ = probe.blocks_from_slices(_block(["instant_power"] * 8))
    assert thr == pytest.approx(0.9) and power == pytest.approx(0.75)
    mixed = ["instant_power"] * 7 + ["counter"]  # one slice fell back to the counter
    ((_, thr, power),), _ = probe.blocks_from_slices(_block(mixed))
    assert thr == pytest.approx(0.9) and power is None  # throughput kept, power not mixed
