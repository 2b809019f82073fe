"""A node report's wire form: without the members the CRD restores, the same stored object."""

from __future__ import annotations

import json
import typing

import pydantic
from pydantic_core import PydanticUndefined

from rlenergy.api import node as api_node
from tests import factories


def _scalar_defaults(
    cls: type[pydantic.BaseModel], schema: dict[str, typing.Any], path: str
) -> list[tuple[str, object, object]]:
    """(path, model default, CRD default) of every scalar field default under ``cls``."""
    found = []
    for name, field in cls.model_fields.items():
        key = field.alias or name
        sub = schema["properties"][key]
        default = field.default
        if isinstance(default, bool | int | float | str) and default is not PydanticUndefined:
            found.append((f"{path}.{key}", default, sub.get("default", "<none>")))
        for arg in typing.get_args(field.annotation) or (field.annotation,):
            for inner in typing.get_args(arg) or (arg,):
                if isinstance(inner, type) and issubclass(inner, pydantic.BaseModel):
                    nested = sub["items"] if sub.get("type") == "array" else sub
                    found.extend(_scalar_defaults(inner, nested, f"{path}.{key}"))
    return found


def test_the_crd_declares_every_scalar_default_the_wire_form_leaves_out():
    found = _scalar_defaults(api_node.NodeReport, factories.report_schema(), "spec")
    assert len(found) > 20
    assert [(p, m, c) for p, m, c in found if m != c] == []


def _report() -> api_node.NodeReport:
    """A report with defaults and non-defaults side by side (a lock, a stall, slices)."""
    slices = [
        api_node.SliceReport(clockMHz=1395, durationSeconds=0.5, progress=10.0, energyJoules=300.0),
        api_node.SliceReport(
            clockMHz=None, durationSeconds=0.5, progress=9.0, energyJoules=None, stalled=True,
            leadSeconds=0.02,
        ),
    ]  # fmt: skip
    window = api_node.PhaseWindowReport(
        phase="generation", durationSeconds=1.0, energyJoules=None, slices=slices,
        gpuEnergyJoules={"GPU-a": 150.0, "GPU-b": None}, stalledEnergyJoules=None,
    )  # fmt: skip
    record = api_node.StepRecord(
        step=3,
        workload=api_node.TokenWorkloadReport(
            samples=8, responseTokens=800, promptTokens=80, validTokens=700, meanContextTokens=90
        ),
        phases=[window],
    )
    gpus = [
        api_node.GpuStatus(uuid="GPU-a", lockedClockMHz=1395, supportedClocksMHz=[1395, 1980]),
        api_node.GpuStatus(uuid="GPU-b", reason="", parked=True),
    ]
    return api_node.NodeReport(
        policyName="p", nodeName="n", gpus=gpus, steps=[record], lastStep=3, measuredJoulesTotal=0.0
    )


def test_the_api_server_stores_the_wire_form_as_the_whole_dump():
    report = _report()
    schema = factories.report_schema()
    whole = report.model_dump(by_alias=True, mode="json")
    wire = api_node.wire_form(report)
    # What the API server stores either way: nulls pruned where not nullable, then the
    # defaults filled in; and what a reader parses of it is the report.
    stored = factories.crd_stored(wire, schema)
    assert stored == factories.crd_stored(whole, schema)
    parsed = api_node.NodeReport.model_validate(stored)
    # The report as read back: the same, but for a GPU of unknown energy, left out of the map
    # (a missing GPU and a null one mean unknown alike).
    window = report.steps[0].phases[0]
    known = {u: j for u, j in window.gpu_energy_joules.items() if j is not None}
    assert parsed.steps[0].phases[0].gpu_energy_joules == known
    assert parsed.model_dump(exclude={"steps"}) == report.model_dump(exclude={"steps"})
    # An unknown stalled energy (null, its default 0.0) stays null, not 0.0.
    assert stored["steps"][0]["phases"][0]["stalledEnergyJoules"] is None
    slice_wire = wire["steps"][0]["phases"][0]["slices"][0]
    assert "stalled" not in slice_wire and "leadSeconds" not in slice_wire
    assert wire["gpus"][1]["parked"] is True and wire["lastStep"] == 3
    assert len(json.dumps(wire)) < len(json.dumps(whole))
