"""Node step records -> job-level steps (rlenergy.control.freq.aggregate).

We test these aspects:
* a step is complete only when every ready node reported it; pending while a node lags;
  lost when a ready node moved past it without a record;
* nodes without a usable GPU do not hold steps back;
* energies sum over nodes, an unknown energy stays unknown (never 0);
* durations take the slowest node, applied clocks the lowest, slices align by index;
* the clock table is the intersection of the GPUs' supported clocks.
"""

from __future__ import annotations

from rlenergy.api import node as api_node
from rlenergy.control.freq import aggregate

W = api_node.TokenWorkloadReport(
    samples=8, responseTokens=800.0, promptTokens=200.0, validTokens=700.0, meanContextTokens=600.0
)


def rec(
    step: int, e_gen: float | None = 10.0, t_gen: float = 2.0, **kw: object
) -> api_node.StepRecord:
    return api_node.StepRecord(
        step=step,
        workload=W,
        phases=[
            api_node.PhaseWindowReport(
                phase="generation",
                durationSeconds=t_gen,
                energyJoules=e_gen,
                appliedClockMHz=kw.get("applied", 1500),
                slices=kw.get("slices", []),
            ),
            api_node.PhaseWindowReport(phase="training", durationSeconds=1.0, energyJoules=5.0),
        ],
        idleEnergyJoules=1.0,
    )


def report(
    node: str, steps: list[api_node.StepRecord], condition: str = "ok"
) -> api_node.NodeReport:
    return api_node.NodeReport(
        policyName="p",
        nodeName=node,
        gpus=[
            api_node.GpuStatus(
                uuid=f"GPU-{node}", condition=condition, supportedClocksMHz=[1980, 1500, 1200]
            )
        ],
        steps=steps,
        lastStep=steps[-1].step if steps else -1,
    )


def test_complete_pending_lost():
    a = report("a", [rec(0), rec(1)])
    b = report("b", [rec(0)])
    assert aggregate.step_state(0, [a, b]) is aggregate.StepState.COMPLETE
    assert aggregate.step_state(1, [a, b]) is aggregate.StepState.PENDING
    c = report("c", [rec(0), rec(2)])  # moved past 1 without a record
    assert aggregate.step_state(1, [a, c]) is aggregate.StepState.LOST


def test_a_node_without_usable_gpus_does_not_hold_steps_back():
    a = report("a", [rec(0), rec(1)])
    lost = report("b", [rec(0)], condition="lost")
    assert aggregate.step_state(1, [a, lost]) is aggregate.StepState.COMPLETE
    assert aggregate.job_step(1, [a, lost]).nodes == 1


def test_a_node_that_joined_later_is_not_waited_for_on_old_steps():
    a = report("a", [rec(0), rec(1), rec(2)])
    late = report("b", [rec(2)])
    assert aggregate.step_state(0, [a, late]) is aggregate.StepState.COMPLETE


def test_sums_max_min_and_unknown_energy():
    a = report("a", [rec(0, e_gen=10.0, t_gen=2.0, applied=1500)])
    b = report("b", [rec(0, e_gen=12.0, t_gen=2.5, applied=1410)])
    job = aggregate.job_step(0, [a, b])
    gen = job.observation.phases["generation"]
    assert gen.energy_j == 22.0 and gen.duration_s == 2.5 and gen.applied_clock_mhz == 1410
    assert job.idle_energy_j == 2.0 and job.energy_j == 22.0 + 10.0 + 2.0
    assert job.observation.workload.valid_tokens == 700.0
    c = report("c", [rec(0, e_gen=None)])
    unknown = aggregate.job_step(0, [a, c])
    assert unknown.observation.phases["generation"].energy_j is None
    assert unknown.energy_j is None


def test_slices_concatenate_node_by_node():
    # Nodes switch on their own timers: slices are never merged across nodes; every node but
    # the last is cut to whole probe blocks so no block spans two nodes.
    s = [
        api_node.SliceReport(clockMHz=c, durationSeconds=0.1, progress=10.0, energyJoules=1.0)
        for c in (1500, None)
    ]
    a = report("a", [rec(0, slices=s)])
    b = report("b", [rec(0, slices=s[:1])])
    gen = aggregate.job_step(0, [a, b]).observation.phases["generation"]
    assert len(gen.slices) == 1  # a's two slices are no whole block; b (last) keeps its one
    assert gen.slices[0].progress == 10.0 and gen.slices[0].energy_j == 1.0


def test_missing_phase_window_is_an_error_not_zero():
    a = report("a", [rec(0)])
    only_train = api_node.StepRecord(
        step=0,
        workload=W,
        phases=[
            api_node.PhaseWindowReport(phase="training", durationSeconds=1.0, energyJoules=5.0)
        ],
    )
    b = report("b", [only_train])
    gen = aggregate.job_step(0, [a, b]).observation.phases["generation"]
    assert gen.energy_j is None and gen.error is not None and "b" in gen.error


def test_clock_table_is_the_intersection():
    a = report("a", [])
    b = api_node.NodeReport(
        policyName="p",
        nodeName="b",
        gpus=[api_node.GpuStatus(uuid="G", supportedClocksMHz=[1980, 1200, 900])],
    )
    assert aggregate.supported_clocks([a, b]) == (1980, 1200)
    assert aggregate.supported_clocks([]) == ()
