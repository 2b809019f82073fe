"""The CRD reference page generated from the models (docs/reference/crds.md).

We test these aspects:
* the committed page equals what the models generate (drift fails the test, like the CRDs);
* every field of the CRD schemas appears exactly once, with its type and description;
* units come from the field names; defaults and bounds are the schema's;
* every CEL rule of the CRD is listed with its message;
* ``--check`` exits 1 on a stale page and 0 on a fresh one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlenergy.api import crdgen, docgen
from rlenergy.api import crds as api_crds

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "reference" / "crds.md"


def _schema_paths(node: dict[str, Any], root: str) -> list[str]:
    out = []
    for name, sub in node.get("properties", {}).items():
        path = f"{root}.{name}"
        out.append(path)
        if sub.get("type") == "array" and "properties" in sub.get("items", {}):
            out += _schema_paths(sub["items"], f"{path}[]")
        elif "properties" in sub:
            out += _schema_paths(sub, path)
    return out


def _rules(node: Any) -> list[str]:
    if isinstance(node, list):
        return [m for n in node for m in _rules(n)]
    if not isinstance(node, dict):
        return []
    here = [r["message"] for r in node.get("x-kubernetes-validations", [])]
    return here + [m for v in node.values() for m in _rules(v)]


def test_committed_page_matches_the_models():
    assert not docgen.drift(PAGE), "run: python -m rlenergy.api.crdgen"


def test_check_mode(tmp_path: Path):
    out = tmp_path / "crds.md"
    assert docgen.main(["--out", str(out)]) == 0
    assert docgen.main(["--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("minClockMHz", "minClock"))
    assert docgen.main(["--out", str(out), "--check"]) == 1


def test_every_schema_field_is_documented_once():
    text = docgen.render()
    policy = api_crds.policy_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    report = api_crds.nodereport_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    policy_paths = _schema_paths(policy["properties"]["spec"], "spec") + _schema_paths(
        policy["properties"]["status"], "status"
    )
    report_paths = _schema_paths(report["properties"]["spec"], "spec")
    assert len(policy_paths) > 60 and len(report_paths) > 30
    policy_part, report_part = text.split("## RLEnergyNodeReport")
    for part, paths in ((policy_part, policy_paths), (report_part, report_paths)):
        field_rows = [line for line in part.splitlines() if line.startswith("| `")]
        documented = [line.split("`")[1] for line in field_rows]
        assert sorted(documented) == sorted(paths)
        assert len(set(documented)) == len(documented)


def test_rows_carry_type_unit_default_bounds_and_description():
    rows = {
        r.path: r
        for r in docgen.walk(
            api_crds.policy_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], ""
        )
        if isinstance(r, docgen.FieldRow)
    }
    ratio = rows[".spec.phases[].minThroughputRatio"]
    assert (ratio.type, ratio.default, ratio.required) == ("number", "0.95", False)
    assert ratio.constraints == "> 0.0; <= 1.0"
    assert ratio.unit.startswith("ratio")
    assert "predicted default governor" in ratio.description
    assert rows[".spec.phases[].clockRangeMHz.minClockMHz"].unit == "MHz"
    assert rows[".spec.phases[].clockRangeMHz.minClockMHz"].required
    assert rows[".status.totals.savedJoules"].unit == "J"
    assert rows[".status.totals.savingPercent"].unit == "%"
    assert rows[".status.rollout.releasedGpuSeconds"].unit == "GPU-s"
    assert rows[".spec.mode"].type == "string: `sync`, `async`"
    assert rows[".spec.mode"].default == '"sync"'
    assert rows[".spec.phases[].clockCandidatesMHz"].type == "array of integer (set)"
    assert rows[".status.conditions"].type == "array of object (map keyed by type)"
    assert rows[".status.conditions[].lastTransitionTime"].type == "string (RFC 3339 time)"
    assert rows[".status.kopf"].type == "object (free-form)"
    assert rows[".spec.selector.matchLabels"].type == "map of string to string"


@pytest.mark.parametrize(
    ("name", "unit"),
    [
        ("clockMHz", "MHz"),
        ("probeClocksMHz", "MHz"),
        ("energyJoulesTotal", "J"),
        ("durationSeconds", "s"),
        ("tokensPerOccupiedGpuSecond", "tokens / GPU-s"),
        ("bytesPerExpert", "bytes"),
        ("warmupSteps", "RL steps"),
        ("name", ""),
        ("selector", ""),
    ],
)
def test_unit_of(name: str, unit: str):
    assert docgen.unit_of(name) == unit


def test_every_cel_rule_is_listed():
    text = docgen.render()
    messages = _rules(api_crds.policy_crd()) + _rules(api_crds.nodereport_crd())
    assert len(messages) >= 8
    for message in messages:
        assert f": {message}. Rule: `" in text, message


def _cells(line: str) -> list[str]:
    """Table cells of a Markdown row as Python-Markdown splits it: not at an escaped pipe, nor
    at a pipe inside a code span."""
    cells, cur, in_code, prev = [], "", False, ""
    for ch in line.strip()[1:-1]:
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code and prev != "\\":
            cells.append(cur)
            cur = ""
        else:
            cur += ch
        prev = ch
    return [*cells, cur]


def test_every_table_row_has_its_columns():
    lines = docgen.render().splitlines()
    for line in lines:
        if line.startswith("| `"):
            assert len(_cells(line)) == 7, line
        elif line.startswith("| ") and not line.startswith("| ---"):
            assert len(_cells(line)) in (7, 4), line  # field header 7, printer columns 4
    rules = [line for line in lines if line.startswith("* `")]
    assert any("||" in line for line in rules)  # CEL rules with pipes live in a list


def test_crdgen_writes_and_checks_the_page_too(tmp_path: Path):
    crds, page = tmp_path / "crds", tmp_path / "crds.md"
    assert crdgen.main(["--out", str(crds), "--docs", str(page)]) == 0
    assert page.read_text() == docgen.render()
    assert crdgen.main(["--out", str(crds), "--docs", str(page), "--check"]) == 0
    page.write_text("stale")
    assert crdgen.main(["--out", str(crds), "--docs", str(page), "--check"]) == 1
    assert crdgen.main(["--out", str(crds), "--check"]) == 0  # not the default dir: no page
