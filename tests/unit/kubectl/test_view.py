"""``kubectl rlenergy status`` formatting, on constructed policy and node-report objects.

We test these aspects:
* the detailed view shows per-phase clocks (``default`` for the default governor), plan,
  throughput ratio against its threshold, saving, energy per valid token, job totals and the
  three conditions with reasons;
* per-node health comes from the node reports: ready by the operator's rule (some GPU still
  measures energy), GPU condition counts, locked clocks, last step, energy, problems with the
  GPU UUID and reason;
* unknown numbers show as ``—``, never as 0; a policy without status and one with an
  unreadable status or node report still render, saying so;
* the summary table has one row per policy with its node health;
* number formats (SI prefixes, decimals).
"""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console, RenderableType
from rlenergy_kubectl import view

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import status as api_status
from tests import factories

NOW = "2026-11-29T18:00:00Z"


def _text(renderable: RenderableType, width: int = 250) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def _cond(type_: str, status: str, reason: str, message: str = "") -> api_status.Condition:
    return api_status.Condition.model_validate(
        {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": NOW,
        }
    )


def _status() -> api_status.RLEnergyPolicyStatus:
    return api_status.RLEnergyPolicyStatus(
        observed_generation=3,
        conditions=[
            _cond("Ready", "True", "AgentsDeployed"),
            _cond("Progressing", "False", "ClocksLocked", "every phase runs its selected clock"),
            _cond("Degraded", "False", "AsExpected"),
        ],
        plan=api_node.ClockPlan(
            step=25,
            enforce=True,
            phases=[
                api_node.PhasePlan(
                    phase="generation", clock_mhz=1395, state="locked", since_step=12
                ),
                api_node.PhasePlan(
                    phase="training",
                    clock_mhz=None,
                    state="trial",
                    probe_clocks_mhz=[1755, None],
                    probe_slice_seconds=0.5,
                ),
            ],
        ),
        phases=[
            api_status.PhaseStatus(
                name="generation",
                state="locked",
                clock_mhz=1395,
                min_throughput_ratio=0.95,
                throughput_ratio=0.9612,
                energy_per_valid_token_joules=0.01234,
                predicted_default_energy_per_valid_token_joules=0.01456,
                saving=api_status.Saving(percent=14.27, joules=45300.0),
                selections=2,
            ),
            api_status.PhaseStatus(
                name="training",
                state="trial",
                clock_mhz=None,
                min_throughput_ratio=0.97,
                throughput_ratio=0.9411,
                selections=0,
            ),
        ],
        totals=api_status.Totals(
            steps=24,
            through_step=23,
            measured_joules=812000.0,
            predicted_default_joules=900000.0,
            compared_measured_joules=790000.0,
            saved_joules=110000.0,
            saving_percent=12.22,
            throughput_ratio=0.9734,
            valid_tokens=1.5e6,
            compared_steps=20,
            unknown_energy_steps=1,
            missed_steps=0,
        ),
        nodes=api_status.NodesStatus(
            ready=2,
            total=3,
            errors=[
                api_status.NodeError(
                    node="gpu-node-2",
                    gpu="GPU-lost-1",
                    reason="GPULost",
                    message="fell off the bus",
                )
            ],
        ),
    )


def _policy(status: api_status.RLEnergyPolicyStatus | None, **meta: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": "grpo-qwen-7b", "namespace": "rl", "generation": 3, **meta},
        "spec": {"selector": {"matchLabels": {"app": "x"}}, "controller": {"mode": "enforce"}},
    }
    if status is not None:
        obj["status"] = status.model_dump(by_alias=True, exclude_none=True)
    return obj


def _gpu(uuid: str, condition: str = "ok", lock: int | None = 1395, reason: str = "") -> dict:
    return {"uuid": uuid, "condition": condition, "lockedClockMHz": lock, "reason": reason}


def _report(node: str, gpus: list[dict], last_step: int = 23, joules: float = 270000.0) -> dict:
    return factories.report_object(
        "grpo-qwen-7b",
        node,
        namespace="rl",
        gpus=gpus,
        lastStep=last_step,
        measuredJoulesTotal=joules,
        unattributedJoulesTotal=0.0,
    )


def _reports() -> view.ReportsView:
    return view.parse_reports(
        [
            _report("gpu-node-1", [_gpu(f"GPU-a{i}") for i in range(8)]),
            _report(
                "gpu-node-0",
                [_gpu(f"GPU-b{i}") for i in range(7)]
                + [_gpu("GPU-mo", "measureOnly", None, "NoPermission (agent needs CAP_SYS_ADMIN)")],
            ),
            _report(
                "gpu-node-2", [_gpu("GPU-lost-1", "lost", None, "fell off the bus")], 19, 1500.0
            ),
        ]
    )


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(start))


def test_detail_shows_phases_with_clock_plan_ratio_and_saving():
    text = _text(view.render_policy(view.parse_policy(_policy(_status())), _reports()))
    gen = _line(text, "generation")
    assert "locked" in gen and "1395 MHz since step 12" in gen
    assert "0.961" in gen and "0.950" in gen and "14.3 %" in gen and "45.3 kJ" in gen
    assert "0.01234" in gen and "0.01456" in gen
    train = _line(text, "training")
    assert "trial" in train and "default" in train
    assert "probe 1755 MHz, default (0.5 s slices)" in train
    assert "0.941" in train and "0.970" in train
    # training has no saving yet: unknown, not 0
    assert "0.0 %" not in train and "—" in train


def test_detail_shows_conditions_and_totals():
    text = _text(view.render_policy(view.parse_policy(_policy(_status())), _reports()))
    assert "rl/grpo-qwen-7b" in text and "mode enforce (sync)" in text
    assert "generation 3, observed 3" in text
    assert "Ready True (AgentsDeployed)" in text
    assert "Progressing False (ClocksLocked: every phase runs its selected clock)" in text
    assert "Degraded False (AsExpected)" in text
    assert "Saving 12.2 % (110 kJ saved of 900 kJ predicted" in text
    assert "20 compared steps" in text and "throughput ratio 0.973" in text
    assert "steps 24 (through step 23, missed 0, energy unknown 1)" in text
    assert "valid tokens 1.5 M" in text


def test_detail_shows_per_node_health_from_the_reports():
    text = _text(view.render_policy(view.parse_policy(_policy(_status())), _reports()))
    assert "Node agents: 2/3 ready (operator), 3 node reports" in text
    n0 = _line(text, "gpu-node-0")
    assert " yes " in n0 and "7 ok, 1 measureOnly" in n0
    assert "1395 MHz x7, default x1" in n0 and "270 kJ" in n0
    assert "GPU-mo measureOnly: NoPermission (agent needs CAP_SYS_ADMIN)" in n0
    n1 = _line(text, "gpu-node-1")
    assert "8 ok" in n1 and "1395 MHz x8" in n1 and " 23 " in n1
    n2 = _line(text, "gpu-node-2")
    assert " no " in n2 and "1 lost" in n2 and " 19 " in n2 and "1.5 kJ" in n2
    assert "no GPU measures energy; GPU-lost-1 lost: fell off the bus" in n2
    # nodes are sorted by name
    assert text.index("gpu-node-0") < text.index("gpu-node-1") < text.index("gpu-node-2 ")
    assert "Errors (status.nodes.errors): gpu-node-2/GPU-lost-1 GPULost: fell off the bus" in text


def test_policy_without_status_or_reports_renders_unknowns():
    text = _text(view.render_policy(view.parse_policy(_policy(None)), view.parse_reports([])))
    assert "observed —" in text
    assert "Ready — " in text and "Degraded —" in text
    assert "Totals: no complete RL step accounted yet" in text
    assert "No RLEnergyNodeReport for this policy yet" in text


def test_unreadable_status_and_report_are_named_not_raised():
    obj = _policy(None)
    obj["status"] = {"phases": [{"name": "generation", "state": "sleeping"}]}
    bad_report = {"metadata": {"name": "grpo-qwen-7b.n9"}, "spec": {"nodeName": "n9"}}
    reports = view.parse_reports([bad_report, _report("gpu-node-1", [_gpu("GPU-a")])])
    assert len(reports.reports) == 1
    text = _text(view.render_policy(view.parse_policy(obj), reports))
    assert "status unreadable: status.phases.0.state" in text
    assert "unreadable node report grpo-qwen-7b.n9: spec.policyName: Field required" in text


def test_observe_mode_plan_and_recommendation():
    st = _status().model_copy(
        update={
            "plan": api_node.ClockPlan(
                step=5,
                enforce=False,
                phases=[api_node.PhasePlan(phase="generation", state="observe")],
            ),
            "phases": [
                api_status.PhaseStatus(
                    name="generation",
                    state="observe",
                    recommended_clock_mhz=1305,
                    estimated_saving_percent=9.14,
                )
            ],
        }
    )
    obj = _policy(st)
    obj["spec"]["controller"]["mode"] = "observe"
    text = _text(view.render_policy(view.parse_policy(obj), _reports()))
    gen = _line(text, "generation")
    assert "default (recommends 1305 MHz, [MODEL] est. saving 9.1 %)" in gen
    assert "observe (clocks untouched)" in gen
    # the measured saving stays unknown: the estimate is a model, not a measurement
    assert "9.1 %" not in gen.split("observe (clocks untouched)")[1]
    assert "mode observe (sync)" in text


def test_rollout_line_only_with_a_rollout_status():
    text = _text(view.render_policy(view.parse_policy(_policy(_status())), _reports()))
    assert "Rollout" not in text
    st = _status().model_copy(
        update={
            "rollout": api_status.RolloutStatus.model_validate(
                {
                    "active": 6,
                    "released": 2,
                    "releasedGpuSeconds": 812.5,
                    "parkedGpus": 4,
                    "occupiedGpuSeconds": 5120.0,
                    "tokensPerOccupiedGpuSecond": 41.27,
                    "floor": 4,
                    "scale": {
                        "forStep": 12,
                        "desired": 3,
                        "current": 6,
                        "target": 6,
                        "floor": 4,
                        "reason": "ShrinkRejected",
                        "message": "minimum is 4",
                    },
                }
            )
        }
    )
    text = _text(view.render_policy(view.parse_policy(_policy(st)), _reports()))
    line = _line(text, "Rollout (FlexFloor)")
    assert "6 active, 2 released, 4 GPUs parked now" in line
    assert "released 812.5 GPU-s of 5120.0 occupied" in line
    assert "tokens / occupied GPU-s 41.27" in line and "floor 4 workers" in line
    assert "scale for step 12: 6 -> 6 (asked 3, ShrinkRejected)" in line


def test_deleting_policy_says_so():
    obj = _policy(_status(), deletionTimestamp=NOW)
    assert "being deleted" in _text(view.render_policy(view.parse_policy(obj), _reports()))


def test_summary_has_one_row_per_policy_with_node_health():
    other = _policy(None)
    other["metadata"].update(name="observe-only", namespace="team-b")
    rows = [
        (view.parse_policy(_policy(_status())), _reports()),
        (view.parse_policy(other), view.parse_reports([])),
    ]
    text = _text(view.summary_table(rows))
    first = _line(text, "rl ")
    assert "grpo-qwen-7b" in first and "enforce" in first
    assert "generation 1395 MHz, training default" in first
    assert "12.2 %" in first and "0.973" in first
    assert " 2/3 " in first and "True (AgentsDeployed)" in first and "False (AsExpected)" in first
    # GPU problems: one measure-only, one lost
    assert first.split("2/3")[1].split()[0] == "2"
    second = _line(text, "team-b")
    assert "observe-only" in second and " 0/0 " in second
    assert "0.0 %" not in second and second.count("—") >= 4


@pytest.mark.parametrize(
    ("value", "shown"),
    [(None, "—"), (0.0, "0 J"), (812.0, "812 J"), (45300.0, "45.3 kJ"), (1.21e6, "1.21 MJ")],
)
def test_fmt_joules(value: float | None, shown: str):
    assert view.fmt_joules(value) == shown


def test_fmt_small_numbers():
    assert view.fmt_clock(None) == "default" and view.fmt_clock(1410) == "1410 MHz"
    assert view.fmt_ratio(None) == "—" and view.fmt_ratio(0.96123) == "0.961"
    assert view.fmt_percent(None) == "—" and view.fmt_percent(0.0) == "0.0 %"
    assert view.fmt_count(1.5e6) == "1.5 M" and view.fmt_count(950) == "950"


def test_a_stalled_rollout_shows_only_while_true():
    st = _status()
    calm = st.model_copy(
        update={"conditions": [*st.conditions, _cond("RolloutStalled", "False", "Progressing")]}
    )
    assert "RolloutStalled" not in _text(view.condition_line(calm))
    stalled = st.model_copy(
        update={
            "conditions": [
                *st.conditions,
                _cond("RolloutStalled", "True", "ProgressFrozen", "gpu-a team-a/r0 (generation)"),
            ]
        }
    )
    line = _text(view.condition_line(stalled))
    assert "RolloutStalled True (ProgressFrozen: gpu-a team-a/r0 (generation))" in line


@pytest.mark.parametrize(
    ("point", "low", "high", "shown"),
    [
        (12.34, 10.06, 13.01, "12.3 % (10.1..13.0)"),
        (12.34, 12.33, 12.36, "12.3 %"),  # narrower than the decimal shown
        (12.34, None, None, "12.3 %"),  # a status written without bounds
        (None, 1.0, 2.0, "—"),
    ],
)
def test_fmt_saving_shows_the_range_the_evidence_allows(
    point: float | None, low: float | None, high: float | None, shown: str
):
    assert view.fmt_saving(point, low, high) == shown
