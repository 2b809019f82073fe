"""The Argo CD health check for RLEnergyPolicy (docs/gitops/argocd-health.lua), run in Lua 5.1.

Argo CD runs health checks in gopher-lua (Lua 5.1); the test runs the shipped file in Lua 5.1
(lupa) with ``obj`` set to a policy, as Argo CD does.

We test these aspects:
* every condition (type, status, reason) the operator can write is read out of its source
  (``builders.condition`` calls with literal arguments, and the ``*_condition`` builders'
  returned findings); Degraded=True and Ready=False are Degraded whatever the reason, and each
  Progressing=True reason has a decided health here: a new one fails this test until someone
  decides it;
* for each of them, on an otherwise healthy policy, the script returns the expected health,
  with the condition's reason and message in the health message;
* no status, or a status for an older generation, is Progressing;
* the docs page carries the same script in its argocd-cm snippet.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import lupa.lua51 as lua51
import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "docs" / "gitops" / "argocd-health.lua"
GITOPS_PAGE = ROOT / "docs" / "gitops.md"
OPERATOR = ROOT / "operator" / "rlenergy_operator"
NOW = "2026-11-29T18:00:00Z"

PROGRESSING_TRUE: dict[str, str] = {
    "WaitingForReports": "Healthy",
    "SelectingClocks": "Healthy",
    "ResettingClocks": "Progressing",
}
"""Progressing=True is the one case that needs a decision per reason: clock selection (which
restarts on every workload drift) stays Healthy; the deletion wait is Progressing."""


def expected_health(type_: str, status: str, reason: str) -> str:
    """Argo CD health of an otherwise healthy policy with this one condition."""
    if type_ == "Degraded":
        return "Degraded" if status == "True" else "Healthy"
    if type_ == "Ready":
        return "Degraded" if status == "False" else "Healthy"
    if type_ == "RolloutStalled":
        return "Degraded" if status == "True" else "Healthy"
    if type_ == "Progressing" and status == "True":
        return PROGRESSING_TRUE[reason]
    return "Healthy"


_TYPES = ("Ready", "Progressing", "Degraded", "RolloutStalled")
_BUILDER_TYPES = {
    "progress": "Progressing",
    "degraded": "Degraded",
    "ready": "Ready",
    "stall": "RolloutStalled",
}


def _builder_type(fn: ast.FunctionDef) -> str | None:
    """Condition type a ``(status, reason, message)`` builder produces, or None if it is none.

    Builders are named ``<type>_condition`` or annotated ``builders.Finding`` with the type
    named in the first docstring line (e.g. ``scheduling.agents_unschedulable``).
    """
    if fn.name.endswith("_condition"):
        prefix = fn.name.split("_")[0]
        assert prefix in _BUILDER_TYPES, f"{fn.name}: which condition type?"
        return _BUILDER_TYPES[prefix]
    if fn.returns is None or "Finding" not in ast.unparse(fn.returns):
        return None
    first = (ast.get_docstring(fn) or "").split("\n")[0]
    named = [t for t in _TYPES if t in first]
    assert len(named) == 1, f"{fn.name}: name its condition type in the docstring's first line"
    return named[0]


def _finding_fields(node: ast.expr | None) -> list[ast.expr]:
    """The ``(status, reason, message)`` a builder returns: a ``Finding(...)`` or a tuple."""
    if isinstance(node, ast.Tuple):
        return list(node.elts)
    if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "Finding":
        return list(node.args)
    return []


def _literal(node: ast.expr, consts: dict[str, str]) -> object:
    """The value of a literal, or of a name bound to a module-level string constant."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    return None


def operator_conditions() -> set[tuple[str, str, str]]:
    """(type, status, reason) the operator's source can write.

    From ``builders.condition(...)`` calls with literal arguments and from the returned
    ``(status, reason, message)`` findings of condition builders; a reason may be a
    module-level string constant.
    """
    found: set[tuple[str, str, str]] = set()
    for path in sorted(OPERATOR.glob("*.py")):
        tree = ast.parse(path.read_text())
        consts = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)
            for t in n.targets
            if isinstance(t, ast.Name)
        }

        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "condition"
                and len(node.args) >= 3
            ):
                type_, status, reason = (_literal(a, consts) for a in node.args[:3])
                if isinstance(type_, str) and isinstance(status, bool) and isinstance(reason, str):
                    found.add((type_, "True" if status else "False", reason))
            if isinstance(node, ast.FunctionDef) and (kind := _builder_type(node)):
                for ret in ast.walk(node):
                    fields = _finding_fields(ret.value) if isinstance(ret, ast.Return) else []
                    if len(fields) >= 2:
                        status, reason = (_literal(e, consts) for e in fields[:2])
                        if isinstance(status, bool) and isinstance(reason, str):
                            found.add((kind, "True" if status else "False", reason))
    return found


def _cond(type_: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": NOW,
        "observedGeneration": 2,
    }


HEALTHY = [
    _cond("Ready", "True", "AgentsDeployed", "spec accepted"),
    _cond("Progressing", "False", "ClocksLocked", "every phase runs its selected clock"),
    _cond("Degraded", "False", "AsExpected", "no errors"),
]


def _policy(conditions: list[dict[str, Any]] | None, observed: int = 2) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": "p", "namespace": "ns", "generation": 2},
        "spec": {"selector": {"matchLabels": {"app": "x"}}},
    }
    if conditions is not None:
        obj["status"] = {"observedGeneration": observed, "conditions": conditions}
    return obj


def health(obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) the shipped script returns for ``obj`` in Lua 5.1."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(SCRIPT.read_text())
    return str(result["status"]), str(result["message"])


WRITTEN = sorted(operator_conditions())


def test_the_scan_finds_the_operator_conditions():
    assert ("Ready", "True", "AgentsDeployed") in WRITTEN  # handlers' literal calls
    assert ("Ready", "False", "InvalidSpec") in WRITTEN
    assert ("Degraded", "True", "ResetDeadlineExceeded") in WRITTEN
    assert ("Progressing", "True", "SelectingClocks") in WRITTEN  # builders' returned tuples
    assert ("Degraded", "True", "NodeErrors") in WRITTEN
    assert ("Degraded", "True", "AgentsUnschedulable") in WRITTEN  # via a module constant
    assert ("RolloutStalled", "True", "ProgressFrozen") in WRITTEN
    assert {t for t, _, _ in WRITTEN} == {"Ready", "Progressing", "Degraded", "RolloutStalled"}


def test_every_progressing_reason_has_a_decided_health():
    undecided = [r for t, s, r in WRITTEN if t == "Progressing" and s == "True"]
    undecided = [r for r in undecided if r not in PROGRESSING_TRUE]
    assert not undecided, (
        f"the operator writes Progressing=True with {undecided}: decide their Argo CD health "
        "in docs/gitops/argocd-health.lua, docs/gitops.md and PROGRESSING_TRUE here"
    )


@pytest.mark.parametrize(("type_", "status", "reason"), WRITTEN)
def test_health_of_each_operator_condition(type_: str, status: str, reason: str):
    message = f"what happened: {reason}"
    conds = [c for c in HEALTHY if c["type"] != type_] + [_cond(type_, status, reason, message)]
    got, text = health(_policy(conds))
    assert got == expected_health(type_, status, reason)
    if got != "Healthy" or (type_ == "Progressing" and status == "True"):
        assert f"{type_}={status} ({reason}): {message}" in text


def test_invalid_spec_names_the_field():
    msg = "spec.phases[0].minThroughputRatio: Input should be less than or equal to 1"
    conds = [
        _cond("Ready", "False", "InvalidSpec", msg),
        _cond("Degraded", "True", "InvalidSpec", msg),
    ]
    assert health(_policy(conds)) == ("Degraded", f"Degraded=True (InvalidSpec): {msg}")


def test_no_status_or_an_older_generation_is_progressing():
    status, text = health(_policy(None))
    assert status == "Progressing" and "Waiting for the rl-energy operator" in text
    status, text = health(_policy(HEALTHY, observed=1))
    assert status == "Progressing" and "generation 2" in text
    status, _ = health(_policy([]))
    assert status == "Progressing"


def test_healthy_policy():
    assert health(_policy(HEALTHY)) == ("Healthy", "Ready=True (AgentsDeployed): spec accepted")


def test_the_docs_snippet_is_the_shipped_script():
    page = GITOPS_PAGE.read_text()
    key = "resource.customizations.health.rlenergy.io_RLEnergyPolicy: |"
    assert key in page
    block = page.split(key, 1)[1].split("```", 1)[0]
    indent = "    "
    snippet = "\n".join(
        line[len(indent) :] if line.startswith(indent) else line.strip()
        for line in block.strip("\n").splitlines()
    )
    assert snippet.strip() == SCRIPT.read_text().strip()
