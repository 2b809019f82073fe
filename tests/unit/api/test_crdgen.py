"""CRDs generated from the models.

We test these aspects:
* the committed crds/*.yaml equal what the models generate (drift fails the test);
* the schema is structural: every object has properties or preserve-unknown-fields, no
  $ref, title, anyOf, const or JSON-Schema-2020 exclusive bounds remain;
* the status schema declares every field the status models can write;
* printer columns, short name, category and the status subresource are present;
* the CEL rules exist for the cross-field rules.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import pydantic
import yaml

from rlenergy.api import crdgen
from rlenergy.api import crds as api_crds
from rlenergy.api.v1alpha1 import status as api_status

CRDS = Path(__file__).resolve().parents[3] / "crds"


def _policy_schema() -> dict[str, Any]:
    return api_crds.policy_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crds_match_the_models():
    assert api_crds.drift(CRDS) == [], "run: python -m rlenergy.api.crdgen"


def test_check_mode_fails_on_drift(tmp_path: Path):
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 0
    victim = tmp_path / "rlenergy.io_rlenergypolicies.yaml"
    victim.write_text(victim.read_text().replace("rlep", "rlx"))
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 1


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, sub in node.get("properties", {}).items():
            out += _walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schemas_are_structural():
    for crd in (api_crds.policy_crd(), api_crds.nodereport_crd()):
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in _walk(schema):
            if path == ".metadata":
                continue  # the API server defines metadata's schema
            assert "type" in node, path
            for bad in ("$ref", "title", "anyOf", "const", "$defs", "uniqueItems"):
                assert bad not in node, (path, bad)
            for key in ("exclusiveMinimum", "exclusiveMaximum"):
                assert node.get(key, True) is True, (path, key)
            if node["type"] == "object":
                assert (
                    "properties" in node
                    or "additionalProperties" in node
                    or node.get("x-kubernetes-preserve-unknown-fields")
                ), path


def _type_paths(ann: Any, path: str) -> set[str]:
    origin = typing.get_origin(ann)
    if origin is list:
        return {path} | _type_paths(typing.get_args(ann)[0], path + "[]")
    if origin in (typing.Union, types.UnionType):
        out: set[str] = {path}
        for arg in typing.get_args(ann):
            out |= _type_paths(arg, path)
        return out
    if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
        return {path} | _model_paths(ann, path)
    return {path}


def _model_paths(model: type[pydantic.BaseModel], prefix: str) -> set[str]:
    """Dotted alias paths of every field a model can hold (list items as [])."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        out |= _type_paths(info.annotation, f"{prefix}.{info.alias or name}")
    return out


def test_status_schema_declares_every_status_field():
    schema_paths = {p for p, _ in _walk(_policy_schema()["properties"]["status"], ".status")}
    model_paths = _model_paths(api_status.RLEnergyPolicyStatus, ".status")
    assert model_paths - schema_paths == set()
    assert ".status.totals.savingPercent" in schema_paths
    assert ".status.phases[].saving.percent" in schema_paths
    assert ".status.plan.phases[].clockMHz" in schema_paths
    kopf = _policy_schema()["properties"]["status"]["properties"]["kopf"]
    assert kopf["x-kubernetes-preserve-unknown-fields"] is True
    # additionalProperties: true would prune nested kopf progress records (seen on 1.36).
    assert "additionalProperties" not in kopf


def test_names_columns_subresource():
    crd = api_crds.policy_crd()
    names = crd["spec"]["names"]
    assert names["shortNames"] == ["rlep"] and names["categories"] == ["rlenergy"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert cols["Mode"] == ".spec.controller.mode"
    assert "generation" in cols["Gen MHz"] and "training" in cols["Train MHz"]
    assert cols["Saving %"] == ".status.totals.savingPercent"
    assert cols["Low %"] == ".status.totals.savingLowPercent"  # the bounds the evidence allows
    assert cols["High %"] == ".status.totals.savingHighPercent"
    assert cols["Tput"] == ".status.totals.throughputRatio"
    assert cols["Ready Nodes"] == ".status.nodes.ready"
    assert cols["Age"] == ".metadata.creationTimestamp"


def test_cel_rules_cover_the_cross_field_rules():
    text = yaml.safe_dump(_policy_schema(), width=10000)
    for rule in (
        "self.minClockMHz < self.maxClockMHz",
        "exists_one(q, q.name == p.name)",
        "% self.stepMHz == 0",
        "size(self.matchLabels) > 0",
        "releaseAction != 'scale'",
    ):
        assert rule in text
    phase = _policy_schema()["properties"]["spec"]["properties"]["phases"]
    ratio = phase["items"]["properties"]["minThroughputRatio"]
    assert ratio["minimum"] == 0 and ratio["exclusiveMinimum"] is True and ratio["maximum"] == 1


def test_plan_probe_clocks_items_are_nullable():
    plan = _policy_schema()["properties"]["status"]["properties"]["plan"]
    probe = plan["properties"]["phases"]["items"]["properties"]["probeClocksMHz"]
    assert probe["items"]["nullable"] is True
