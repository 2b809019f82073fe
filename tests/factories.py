"""Builders of the objects many test files need: policies from the shipped samples, node reports.

A test states only what it is about (a node, its steps, a controller setting); everything else
takes the value a valid object needs. Import as ``from tests import factories``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rlenergy.api import node as api_node

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "crds" / "samples"
"""The policies a user starts from (``crds/samples/*.yaml``), also applied by the e2e tests."""


def sample_policy(
    sample: str = "sync-job",
    *,
    name: str | None = None,
    selector: dict[str, Any] | None = None,
    **controller: Any,
) -> dict[str, Any]:
    """The RLEnergyPolicy of ``crds/samples/<sample>.yaml`` as a dict, with overrides.

    Args:
        sample: File name in ``crds/samples`` without ``.yaml``.
        name: ``metadata`` becomes ``{"name": name}`` (the sample's own otherwise).
        selector: Replaces ``spec.selector``.
        **controller: When given, ``spec.controller`` becomes exactly these fields (camelCase,
            e.g. ``warmupSteps=4``).
    """
    body: dict[str, Any] = yaml.safe_load((SAMPLES / f"{sample}.yaml").read_text())
    if name is not None:
        body["metadata"] = {"name": name}
    if selector is not None:
        body["spec"]["selector"] = selector
    if controller:
        body["spec"]["controller"] = controller
    return body


def node_report(
    node: str = "gpu-a",
    steps: Sequence[api_node.StepRecord] = (),
    *,
    policy: str = "pol",
    gpus: Sequence[api_node.GpuStatus] | None = None,
    **fields: Any,
) -> api_node.NodeReport:
    """A node's report: one GPU ``GPU-<node>`` unless ``gpus`` says otherwise.

    ``last_step`` is the newest of ``steps`` (the model's -1 without steps) unless given in
    ``fields``; other ``fields`` (snake_case) go to ``NodeReport`` as they are.
    """
    if steps and "last_step" not in fields:
        fields["last_step"] = max(s.step for s in steps)
    return api_node.NodeReport(
        policy_name=policy,
        node_name=node,
        gpus=list(gpus) if gpus is not None else [api_node.GpuStatus(uuid=f"GPU-{node}")],
        steps=list(steps),
        **fields,
    )


def report_object(
    policy: str, node: str, *, namespace: str | None = None, **spec: Any
) -> dict[str, Any]:
    """An RLEnergyNodeReport object as the API server returns it (``kubectl get -o json``).

    Named ``<policy>.<node>`` as the agent names it; ``spec`` holds the other spec fields in
    camelCase (``gpus``, ``lastStep``, ``measuredJoulesTotal``, ...), validated by the model.
    """
    body = api_node.NodeReport.model_validate({"policyName": policy, "nodeName": node, **spec})
    metadata = {"name": f"{policy}.{node}"}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyNodeReport",
        "metadata": metadata,
        "spec": body.model_dump(by_alias=True, exclude_none=True),
    }


def report_schema() -> dict[str, Any]:
    """The OpenAPI schema of ``RLEnergyNodeReport.spec`` in the shipped CRD (crds/)."""
    crd = yaml.safe_load((ROOT / "crds" / "rlenergy.io_rlenergynodereports.yaml").read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return dict(schema["properties"]["spec"])


def crd_stored(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` as the API server stores it: nulls pruned, then the schema's defaults filled in.

    What the API server does to a custom object on every write and read (structural schema
    pruning of a null member unless its schema says ``nullable``, then defaulting of the
    missing members; nested objects and list items included). A copy; ``value`` is unchanged.
    """
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        out = {k: v for k, v in value.items() if v is not None or props.get(k, {}).get("nullable")}
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = sub["default"]
            if key in out:
                out[key] = crd_stored(out[key], sub)
        return out
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        sub = schema["additionalProperties"]
        return {
            k: crd_stored(v, sub) for k, v in value.items() if v is not None or sub.get("nullable")
        }
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [crd_stored(v, schema["items"]) for v in value]
    return value
