"""kopf field faults as unit tests (status fields the schema drops, status through /status,
timers and finalizers on deletion, two operator replicas); the e2e module runs them on a
real API server.

* #16: every status key the operator writes is declared in the generated CRD schema;
* #17: handlers write status only through kopf's patch (no raw client PATCH of status, no
  Pod status writes): kube.py has no status call at all;
* #18: the loop timer does nothing for an object marked for deletion; the delete handler has
  a deadline (settings) so deletion never hangs;
* #20: peering name and priority are our own (also in test_builders).
"""

from __future__ import annotations

import inspect
from typing import Any

from kopf_doubles import serving
from rlenergy_operator import builders, handlers, jobloop, kube, settings
from sim_nodes import SimNodes

from rlenergy.api import crds as api_crds
from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy


def _paths(value: Any, prefix: str) -> set[str]:
    out = {prefix}
    if isinstance(value, dict):
        for k, v in value.items():
            out |= _paths(v, f"{prefix}.{k}")
    elif isinstance(value, list):
        for v in value:
            out |= _paths(v, f"{prefix}[]")
    return out


def _schema_paths(node: dict[str, Any], prefix: str) -> set[str]:
    out = {prefix}
    for k, v in node.get("properties", {}).items():
        out |= _schema_paths(v, f"{prefix}.{k}")
    if isinstance(node.get("items"), dict):
        out |= _schema_paths(node["items"], f"{prefix}[]")
    return out


def test_case16_every_written_status_key_is_declared():
    spec = policy.parse_policy({"selector": {"matchLabels": {"a": "b"}}})
    loop = jobloop.JobLoop(spec, 1)
    seen: dict[str, Any] = {}

    def publish(reports: list[api_node.NodeReport]) -> None:
        loop.advance(reports)
        seen["reports"] = reports

    SimNodes("p", 12, publish).run(lambda step: loop.plan("t"))
    written = {
        "observedGeneration": 1,
        "conditions": [
            builders.condition("Ready", True, "AgentsDeployed", "m", generation=1, now="t")
        ],
        "plan": loop.plan("t").model_dump(by_alias=True, exclude_none=True),
        "phases": [p.model_dump(by_alias=True, exclude_none=True) for p in loop.phase_status()],
        "totals": loop.totals().model_dump(by_alias=True, exclude_none=True),
        "nodes": builders.node_summary(seen["reports"]).model_dump(
            by_alias=True, exclude_none=True
        ),
    }
    schema = api_crds.policy_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    declared = _schema_paths(schema["properties"]["status"], ".status")
    assert _paths(written, ".status") - declared == set()


def test_case17_no_raw_status_writes_outside_kopf():
    source = inspect.getsource(kube)
    assert "custom_object_status" not in source and "replace_namespaced" not in source
    assert "patch_namespaced_pod" not in inspect.getsource(handlers)


def test_case18_timer_ignores_objects_being_deleted_and_deletion_has_a_deadline():
    assert settings.OperatorConfig().reset_deadline_s > 0
    patch: dict[str, Any] = {}

    class _Patch(dict[str, Any]):
        status = patch

    handlers.policy_loop(
        spec={"selector": {"matchLabels": {"a": "b"}}},
        meta={"deletionTimestamp": "2026-01-01T00:00:00Z", "generation": 1},
        status={},
        patch=_Patch(),
        memo={"operator": handlers.OperatorMemo(), "handover": serving()},
        body={},
        namespace="ns",
        name="p",
        logger=None,
    )
    assert patch == {}
