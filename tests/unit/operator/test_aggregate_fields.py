"""The fold of nodes' step records, field by field (rlenergy.control.freq.aggregate).

Written against the surviving mutants of ``make mutation`` (docs/mutation.md, control-freq-rest):
every field ``_phase``, ``probe_slice``, ``records``, ``job_step`` and ``plan_decisions``
produce is checked against the value worked out by hand from the reports, including the
edges (no windows, one node missing a window, mixed energy sources, stalls larger than the
energy, async pools, observe mode).
"""

from __future__ import annotations

import math

import pytest

from rlenergy.api import node as api_node
from rlenergy.control.freq import aggregate, base

W = api_node.TokenWorkloadReport(
    samples=8, responseTokens=800.0, promptTokens=200.0, validTokens=700.0, meanContextTokens=600.0
)
NONE = api_node.TokenWorkloadReport(
    samples=0, responseTokens=0.0, promptTokens=0.0, validTokens=0.0, meanContextTokens=0.0
)


def sl(clock: int | None, **kw: object) -> api_node.SliceReport:
    fields: dict[str, object] = {
        "clockMHz": clock,
        "durationSeconds": 0.25,
        "progress": 10.0,
        "energyJoules": 50.0,
    }
    fields.update(kw)
    return api_node.SliceReport.model_validate(fields)


def win(phase: str, **kw: object) -> api_node.PhaseWindowReport:
    fields: dict[str, object] = {"phase": phase, "durationSeconds": 2.0, "energyJoules": 100.0}
    fields.update(kw)
    return api_node.PhaseWindowReport.model_validate(fields)


def rec(
    step: int,
    phases: list[api_node.PhaseWindowReport],
    workload: api_node.TokenWorkloadReport = W,
    idle: float | None = 1.0,
) -> api_node.StepRecord:
    return api_node.StepRecord(step=step, workload=workload, phases=phases, idleEnergyJoules=idle)


def report(
    node: str, steps: list[api_node.StepRecord], condition: str = "ok"
) -> api_node.NodeReport:
    return api_node.NodeReport(
        policyName="p",
        nodeName=node,
        gpus=[api_node.GpuStatus(uuid=f"GPU-{node}", condition=condition)],
        steps=steps,
        lastStep=steps[-1].step if steps else -1,
    )


def test_probe_slice_carries_every_field() -> None:
    p = sl(
        1395,
        durationSeconds=0.3,
        progress=12.5,
        energyJoules=61.0,
        stalled=True,
        effectiveClockMHz=1380,
        energySource="instant_power",
        rateReports=4,
        leadSeconds=0.012,
        leadEnergyJoules=1.5,
    )
    assert aggregate.probe_slice(p) == base.ProbeSlice(
        clock_mhz=1395,
        duration_s=0.3,
        progress=12.5,
        energy_j=61.0,
        stalled=True,
        effective_clock_mhz=1380,
        energy_source="instant_power",
        rate_reports=4,
        lead_s=0.012,
        lead_energy_j=1.5,
    )


def test_records_of_ready_nodes_in_node_order() -> None:
    g = win("generation")
    b = report("b", [rec(0, [g]), rec(1, [g, win("training")])])
    a = report("a", [rec(1, [g])])
    gone = report("c", [rec(1, [g])], condition="lost")
    got = aggregate.records(1, [b, gone, a])
    assert [len(r.phases) for r in got] == [1, 2]  # a's, then b's; c has no usable GPU
    assert all(r.step == 1 for r in got)
    assert aggregate.records(5, [a, b]) == []


def test_one_phase_folded_field_by_field() -> None:
    a = win(
        "generation",
        durationSeconds=3.0,
        energyJoules=300.0,
        requestedClockMHz=1395,
        appliedClockMHz=1380,
        stalledSeconds=0.5,
        stalledEnergyJoules=20.0,
        progressMeanGapSeconds=0.05,
        energySource="counter",
    )
    b = win(
        "generation",
        durationSeconds=2.8,
        energyJoules=280.0,
        requestedClockMHz=1410,
        appliedClockMHz=1365,
        slowdown=True,
        stalledSeconds=0.1,
        stalledEnergyJoules=5.0,
        progressMeanGapSeconds=0.08,
        energySource="counter",
        error="nvml: timeout",
    )
    ph = aggregate._phase("generation", [("a", a), ("b", b)])
    assert ph.phase == "generation"
    assert ph.duration_s == pytest.approx(2.7)  # max(3.0 - 0.5, 2.8 - 0.1)
    assert ph.energy_j == pytest.approx(300.0 + 280.0 - 25.0)
    assert ph.requested_clock_mhz == 1395  # the first node's
    assert ph.applied_clock_mhz == 1365
    assert ph.slowdown is True
    assert ph.error == "b: nvml: timeout"
    assert ph.stalled_s == 0.5
    assert ph.stalled_energy_j == 25.0
    assert ph.progress_gap_s == 0.08  # the slowest reporter's
    assert ph.energy_source == "counter"
    assert ph.slices == ()


def test_phase_edges() -> None:
    # Stalled energy above the window's: never negative.
    w = win("training", energyJoules=10.0, stalledEnergyJoules=15.0)
    assert aggregate._phase("training", [("a", w)]).energy_j == 0.0
    # Stalled energy unknown on one node: the phase's energy is unknown, not overstated.
    ws = [("a", win("training")), ("b", win("training", stalledEnergyJoules=None))]
    ph = aggregate._phase("training", ws)
    assert ph.energy_j is None and ph.stalled_energy_j is None
    # A node without progress reports: no gap known (inf), whatever the others say.
    ws = [("a", win("training", progressMeanGapSeconds=0.02)), ("b", win("training"))]
    assert aggregate._phase("training", ws).progress_gap_s == math.inf
    # Mixed sources say so; none reported: None.
    ws = [
        ("a", win("training", energySource="counter")),
        ("b", win("training", energySource="power")),
    ]
    assert aggregate._phase("training", ws).energy_source == "mixed"
    assert aggregate._phase("training", [("a", win("training"))]).energy_source is None
    # No applied clock read anywhere: None, and no slowdown.
    ph = aggregate._phase("training", [("a", win("training")), ("b", win("training"))])
    assert ph.applied_clock_mhz is None and ph.slowdown is False and ph.error is None
    assert ph.requested_clock_mhz is None
    assert ph.stalled_s == 0.0 and ph.stalled_energy_j == 0.0


def test_phase_with_a_missing_window() -> None:
    a = win("generation", durationSeconds=2.0, appliedClockMHz=1500, slices=[sl(1500)] * 8)
    ph = aggregate._phase("generation", [("a", a), ("b", None), ("c", None)])
    assert ph.energy_j is None  # never the present nodes' sum
    assert ph.error == "no generation window from b, c"
    assert ph.slices == ()  # a block from part of the job is no evidence
    assert ph.duration_s == 2.0 and ph.applied_clock_mhz == 1500
    both = aggregate._phase("generation", [("a", win("generation", error="x")), ("b", None)])
    assert both.error == "a: x; no generation window from b"


def test_phase_with_no_window_at_all() -> None:
    ph = aggregate._phase("generation", [("a", None)])
    assert ph.duration_s == 0.0
    assert ph.energy_j is None
    assert ph.stalled_s == 0.0 and ph.stalled_energy_j == 0.0
    assert ph.progress_gap_s == math.inf
    assert ph.requested_clock_mhz is None and ph.energy_source is None
    assert ph.error == "no generation window from a"


def test_job_step_folds_phases_workload_and_idle_energy() -> None:
    a = report("a", [rec(3, [win("generation", durationSeconds=2.0), win("training")], idle=1.5)])
    b = report(
        "b",
        [rec(3, [win("training", durationSeconds=3.0), win("generation")], NONE, idle=2.5)],
    )
    js = aggregate.job_step(3, [b, a])
    assert js.nodes == 2
    assert js.idle_energy_j == 4.0
    obs = js.observation
    assert obs.step == 3
    assert list(obs.phases) == ["generation", "training"]  # a's order (node order)
    assert obs.phases["training"].duration_s == 3.0
    assert obs.phases["training"].energy_j == 200.0
    assert obs.workload.samples == 8 and obs.workload.valid_tokens == 700.0
    assert obs.workload.response_tokens == 800.0 and obs.workload.prompt_tokens == 200.0
    assert obs.workload.mean_context_tokens == 600.0
    assert js.energy_j == pytest.approx(200.0 + 200.0 + 4.0)


def test_job_step_takes_the_first_workload_with_samples() -> None:
    a = report("a", [rec(0, [win("generation")], NONE)])
    b = report("b", [rec(0, [win("training")], W)])
    assert aggregate.job_step(0, [a, b]).observation.workload.samples == 8
    # No record carries one: the first node's (empty) workload.
    c = report("c", [rec(0, [win("training")], NONE)])
    assert aggregate.job_step(0, [a, c]).observation.workload.samples == 0


def test_job_step_unknown_idle_energy_and_no_record() -> None:
    a = report("a", [rec(0, [win("generation")], idle=None)])
    b = report("b", [rec(0, [win("generation")])])
    js = aggregate.job_step(0, [a, b])
    assert js.idle_energy_j is None and js.energy_j is None
    with pytest.raises(ValueError, match="no ready node reported step 7"):
        aggregate.job_step(7, [a, b])
    lost = report("c", [rec(0, [win("generation")])], condition="lost")
    with pytest.raises(ValueError, match="step 0"):
        aggregate.job_step(0, [lost])


def test_async_pools_count_a_node_only_in_its_phases() -> None:
    gen = report("a", [rec(0, [win("generation")], NONE)])
    train = report("b", [rec(0, [win("training")])])
    empty = report("c", [rec(0, [])])
    synced = aggregate.job_step(0, [gen, train])
    assert synced.observation.phases["generation"].error == "no generation window from b"
    pooled = aggregate.job_step(0, [gen, train], pools=True)
    assert pooled.observation.phases["generation"].error is None
    assert pooled.observation.phases["training"].error is None
    assert pooled.observation.phases["generation"].energy_j == 100.0
    # A node with no window at all is missing from every phase, pools or not.
    both = aggregate.job_step(0, [gen, train, empty], pools=True)
    assert both.observation.phases["generation"].error == "no generation window from c"
    assert both.observation.phases["training"].error == "no training window from c"
    assert both.nodes == 3


def test_async_pools_carry_each_pool_s_idle_time_energy_and_gpus() -> None:
    """``StepObservation.pool_idle``: per phase, the idle of the nodes that ran only it."""

    def node(name: str, phase: str, gpus: int, idle_j: float | None, idle_gpu_s: float | None):
        window = win(phase, gpuEnergyJoules={f"GPU-{name}-{i}": 50.0 for i in range(gpus)})
        record = api_node.StepRecord(
            step=0, workload=W, phases=[window], idleEnergyJoules=idle_j, idleGpuSeconds=idle_gpu_s
        )
        return report(name, [record])

    gen = [node("a", "generation", 2, 300.0, 3.0), node("b", "generation", 2, 100.0, 1.0)]
    train = node("c", "training", 4, 40.0, 0.4)
    pooled = aggregate.job_step(0, [*gen, train], pools=True).observation.pool_idle
    assert pooled == {
        "generation": base.PoolIdle(energy_j=400.0, gpu_seconds=4.0, gpus=4),
        "training": base.PoolIdle(energy_j=40.0, gpu_seconds=0.4, gpus=4),
    }
    # Sync mode has no pools; an older agent's record (no idle time) leaves it unknown.
    assert aggregate.job_step(0, [*gen, train]).observation.pool_idle == {}
    old = node("d", "training", 4, 40.0, None)
    assert aggregate.job_step(0, [*gen, old], pools=True).observation.pool_idle[
        "training"
    ] == base.PoolIdle(40.0, None, 4)
    # A node with windows of both phases belongs to no one pool: no pools at all.
    both = report("e", [rec(0, [win("generation"), win("training")])])
    assert aggregate.job_step(0, [*gen, both], pools=True).observation.pool_idle == {}


def test_slices_from_every_node_and_none_on_error_free_missing() -> None:
    a = report("a", [rec(0, [win("generation", slices=[sl(1500)] * 9)])])
    b = report("b", [rec(0, [win("generation", slices=[sl(None, progress=4.0)] * 3)])])
    got = aggregate.job_step(0, [a, b]).observation.phases["generation"].slices
    assert len(got) == 8 + 3  # a cut to whole blocks, the last node kept whole
    assert got[0].clock_mhz == 1500 and got[-1].clock_mhz is None and got[-1].progress == 4.0


def test_plan_decisions_enforced_and_observed() -> None:
    plan = api_node.ClockPlan(
        step=4,
        phases=[
            api_node.PhasePlan(
                phase="generation",
                clockMHz=1395,
                state="trial",
                probeClocksMHz=[1395, None],
                probeSliceSeconds=0.2,
                reason="probing",
            ),
            api_node.PhasePlan(phase="training", clockMHz=None, state="locked", reason="default"),
        ],
    )
    got = aggregate.plan_decisions(plan)
    assert got.step == 4
    assert got.phases["generation"] == base.PhaseDecision(
        1395, base.PhaseState.TRIAL, (1395, None), 0.2, "probing"
    )
    assert got.phases["training"] == base.PhaseDecision(
        None, base.PhaseState.LOCKED, (), 0.0, "default"
    )
    observed = aggregate.plan_decisions(plan.model_copy(update={"enforce": False}))
    assert observed.phases["generation"] == base.PhaseDecision(
        None, base.PhaseState.TRIAL, (), 0.2, "probing"
    )


def test_node_windows_and_step_states_at_their_edges() -> None:
    g = [win("generation")]
    a = report("a", [rec(2, g), rec(3, g)])
    # lastStep beyond the newest record counts as the window's end.
    ahead = a.model_copy(update={"last_step": 5})
    assert aggregate.step_state(4, [ahead]) is aggregate.StepState.LOST
    assert aggregate.step_state(4, [a]) is aggregate.StepState.PENDING
    assert aggregate.step_state(3, [a]) is aggregate.StepState.COMPLETE
    assert aggregate.step_state(1, [a]) is aggregate.StepState.PENDING  # before its window
    empty = report("b", [])
    assert aggregate.step_state(2, [a, empty]) is aggregate.StepState.PENDING
    assert aggregate.step_state(2, []) is aggregate.StepState.PENDING
    assert aggregate.known_steps([a, report("c", [rec(7, g), rec(2, g)])]) == [2, 3, 7]
    assert aggregate.node_ready(report("d", [], condition="degraded"))
    assert aggregate.node_ready(report("e", [], condition="measureOnly"))
    assert not aggregate.node_ready(report("f", [], condition="lost"))


def test_unready_nodes_are_skipped_wherever_they_sort() -> None:
    g = [win("generation")]
    first = report("0-gone", [rec(1, g)], condition="lost")
    a = report("a", [rec(0, g), rec(1, g, W)])
    b = report("b", [rec(0, g), rec(2, g)])  # moved past 1
    assert aggregate.step_state(1, [first, a]) is aggregate.StepState.COMPLETE
    assert aggregate.step_state(1, [first, a, b]) is aggregate.StepState.LOST
    assert [r.step for r in aggregate.records(1, [first, a])] == [1]
    assert aggregate.job_step(1, [first, a]).nodes == 1


def test_a_one_sample_workload_is_a_workload() -> None:
    one = W.model_copy(update={"samples": 1})
    a = report("a", [rec(0, [win("generation")], NONE)])
    b = report("b", [rec(0, [win("training")], one)])
    assert aggregate.job_step(0, [a, b]).observation.workload.samples == 1


def test_clock_table_skips_gpus_without_one_and_unusable_gpus() -> None:
    def gpu(uuid: str, clocks: list[int], condition: str = "ok") -> api_node.GpuStatus:
        return api_node.GpuStatus(uuid=uuid, condition=condition, supportedClocksMHz=clocks)

    rep = report("a", []).model_copy(
        update={
            "gpus": [
                gpu("GPU-0", [1980, 1500, 1200]),
                gpu("GPU-1", []),  # not read yet: no constraint
                gpu("GPU-2", [1500], condition="lost"),  # gone: no constraint
            ]
        }
    )
    assert aggregate.supported_clocks([rep]) == (1980, 1500, 1200)
    assert aggregate.supported_clocks([report("b", [])]) == ()
