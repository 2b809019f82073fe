"""Every CRD field is read by code a test exercises: docs/crd-fields.md, kept honest here.

We test these aspects:
* the page lists exactly the ``spec`` fields of the generated CRD schemas (``crds/``), one row
  each, so a new field fails this test until someone says who reads it and which test covers it;
* every cited test exists and names the field (its camelCase name or Python attribute, in the
  test function or its module's helpers);
* every ``RLEnergyPolicy`` field is read by component code (``.attribute`` in the operator, the
  agent, the control algorithms, the SDK or the selector), so an accepted field nobody reads
  (``controller.objective`` before its removal) cannot come back;
* the two rows this page cites here: phase settings and ``spec.mode`` reach the controller and
  the job loop.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from rlenergy_operator import jobloop

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import config
from rlenergy.gpu import models

pytestmark = pytest.mark.field

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "crd-fields.md"
CRDS = {
    "RLEnergyPolicy": ROOT / "crds" / "rlenergy.io_rlenergypolicies.yaml",
    "RLEnergyNodeReport": ROOT / "crds" / "rlenergy.io_rlenergynodereports.yaml",
}
READERS = [
    ROOT / "operator" / "rlenergy_operator",
    ROOT / "agent" / "rlenergy_agent",
    ROOT / "rlenergy" / "control",
    ROOT / "rlenergy" / "sdk",
    ROOT / "rlenergy" / "api" / "selector.py",
    ROOT / "rlenergy" / "api" / "v1alpha1" / "policy.py",
]
"""Code that may read a policy field: the components, and the API models' own methods
(``LabelSelector.to_query``, validators: ``self.<field>``; a field's declaration is no read)."""
ROW = re.compile(r"^\| `(spec[^`]*)` \| ([^|]+) \| `([^`]+)::([A-Za-z0-9_]+)` \|$")


def _paths(schema: dict[str, Any], path: str, out: list[str]) -> None:
    if schema.get("properties"):
        for key, sub in schema["properties"].items():
            out.append(f"{path}.{key}")
            _paths(sub, f"{path}.{key}", out)
    elif schema.get("type") == "array" and "items" in schema:
        _paths(schema["items"], path + "[]", out)


def schema_fields(kind: str) -> list[str]:
    doc = yaml.safe_load(CRDS[kind].read_text())
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    out: list[str] = []
    _paths(spec, "spec", out)
    return out


def page_rows() -> dict[str, list[tuple[str, str, str, str]]]:
    """Per CRD section: (field, reader, test file, test function)."""
    rows: dict[str, list[tuple[str, str, str, str]]] = {}
    section = ""
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].split()[0]
        elif m := ROW.match(line):
            rows.setdefault(section, []).append((m[1], m[2].strip(), m[3], m[4]))
    return rows


def _attrs(module: Any) -> dict[str, str]:
    """camelCase name -> Python attribute over every pydantic model of ``module``."""
    out: dict[str, str] = {}
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, pydantic.BaseModel):
            for attr, info in obj.model_fields.items():
                out[info.alias or attr] = attr
    return out


ATTRS = {"RLEnergyPolicy": _attrs(api_policy), "RLEnergyNodeReport": _attrs(api_node)}


def _leaf(field: str) -> str:
    return field.rsplit(".", 1)[-1].removesuffix("[]")


def _test_source(path: str, name: str) -> tuple[str, str]:
    """(function source, module source) of a cited test."""
    file = ROOT / path
    assert file.is_file(), f"{path} does not exist"
    module = file.read_text()
    for node in ast.walk(ast.parse(module)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(module, node) or "", module
    raise AssertionError(f"{path} has no test {name}")


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_the_page_lists_every_schema_field_once(kind: str):
    rows = page_rows().get(kind, [])
    listed = [r[0] for r in rows]
    assert len(listed) == len(set(listed)), "a field is listed twice"
    fields = schema_fields(kind)
    assert set(listed) == set(fields), (
        f"docs/crd-fields.md ({kind}) misses {sorted(set(fields) - set(listed))} and lists "
        f"fields the schema lacks {sorted(set(listed) - set(fields))}"
    )


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_every_cited_test_exists_and_names_its_field(kind: str):
    silent = []
    for field, _reader, path, name in page_rows()[kind]:
        leaf = _leaf(field)
        attr = ATTRS[kind].get(leaf, leaf)
        func, module = _test_source(path, name)
        if not re.search(rf"\b({re.escape(leaf)}|{re.escape(attr)})\b", func + module):
            silent.append(f"{field}: {path}::{name} never names {leaf} or {attr}")
    assert not silent, "\n".join(silent)


def test_every_policy_field_is_read_by_component_code():
    sources = "\n".join(
        p.read_text()
        for root in READERS
        for p in ([root] if root.is_file() else sorted(root.rglob("*.py")))
        if "testing" not in p.parts
    )
    unread = []
    for field, reader, _path, _name in page_rows()["RLEnergyPolicy"]:
        attr = ATTRS["RLEnergyPolicy"].get(_leaf(field), _leaf(field))
        if reader.strip() == "people" or not re.search(rf"\.{re.escape(attr)}\b", sources):
            unread.append(f"{field} (.{attr})")
    assert not unread, f"policy fields no component reads: {unread}"


H100 = models.get_sku("h100-sxm")


def test_phase_fields_reach_the_controller():
    spec = api_policy.RLEnergyPolicySpec.model_validate(
        {
            "phases": [
                {
                    "name": "generation",
                    "minThroughputRatio": 0.9,
                    "clockCandidatesMHz": [1500, 1200],
                },
                {
                    "name": "training",
                    "minThroughputRatio": 0.97,
                    "clockRangeMHz": {"minClockMHz": 1200, "maxClockMHz": 1800},
                    "stepMHz": 300,
                },
            ]
        }
    )
    gen, train = config.phase_settings(spec, H100.supported_sm_clocks_mhz())
    assert (gen.name, gen.min_throughput_ratio, gen.candidates_mhz) == (
        "generation",
        0.9,
        (1500, 1200),
    )
    assert (train.name, train.min_throughput_ratio) == ("training", 0.97)
    assert train.candidates_mhz == (1800, 1500, 1200)  # the range every stepMHz
    assert min(train.allowed_mhz) == 1200 and max(train.allowed_mhz) == 1800


def _step(step: int) -> api_node.StepRecord:
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
                phase="generation", duration_seconds=100.0, energy_joules=4e4
            ),
            api_node.PhaseWindowReport(phase="training", duration_seconds=60.0, energy_joules=3e4),
        ],
        idle_energy_joules=0.0,
    )


@pytest.mark.parametrize(("mode", "seconds"), [("sync", 3 * 160.0), ("async", 3 * 100.0)])
def test_spec_mode_async_times_the_slower_pool(mode: str, seconds: float):
    spec = api_policy.RLEnergyPolicySpec.model_validate(
        {"selector": {"matchLabels": {"app": "x"}}, "mode": mode}
    )
    assert config.controller_settings(spec).async_mode == (mode == "async")
    report = api_node.NodeReport(
        policy_name="pol",
        node_name="gpu-a",
        gpus=[api_node.GpuStatus(uuid="GPU-1", supported_clocks_mhz=[1980, 1500, 1005])],
        steps=[_step(s) for s in range(3)],
        last_step=2,
    )
    loop = jobloop.JobLoop(spec, 1)
    loop.advance([report])
    assert loop.totals().measured_seconds == pytest.approx(seconds)  # sync: sum; async: max
