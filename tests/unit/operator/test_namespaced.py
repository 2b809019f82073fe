"""A namespaced install in the operator process: served namespaces, kopf flags and settings.

We test: ``RLENERGY_OPERATOR_WATCH_NAMESPACES`` becomes one ``--namespace`` flag per namespace
(none: ``--all-namespaces``; explicit flags win), kopf's cluster scan is off exactly when it is
set, a bad value is refused, and ``kube.live_policies`` lists per namespace then (never
cluster-wide, which a namespaced install may not do). The e2e proof with the chart's Roles is
``tests/e2e/test_privilege.py``.
"""

from __future__ import annotations

from typing import Any

import kopf
import pydantic
import pytest
from rlenergy_operator import __main__ as op_main
from rlenergy_operator import kube, settings


def _argv(monkeypatch: pytest.MonkeyPatch, *args: str) -> list[str]:
    seen: list[list[str]] = []
    monkeypatch.setattr("kopf.cli.main", lambda argv, standalone_mode: seen.append(list(argv)))
    op_main.main(list(args))
    return seen[0]


def test_served_namespaces_become_kopf_namespace_flags(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("RLENERGY_OPERATOR_WATCH_NAMESPACES", raising=False)
    assert _argv(monkeypatch, "--standalone")[3:] == ["--all-namespaces", "--standalone"]
    monkeypatch.setenv("RLENERGY_OPERATOR_WATCH_NAMESPACES", "team-a,team-b")
    assert _argv(monkeypatch)[3:] == ["--namespace=team-a", "--namespace=team-b"]
    assert _argv(monkeypatch, "--namespace=x")[3:] == ["--namespace=x"]


def test_scanning_is_off_only_for_a_namespaced_operator():
    for value, off in (("", False), ("team-a", True)):
        s = kopf.OperatorSettings()
        cfg = settings.OperatorConfig(watch_namespaces=value)
        settings.configure_kopf(s, cfg)
        assert s.scanning.disabled is off
        assert cfg.served_namespaces == ((value,) if value else ())
    with pytest.raises(pydantic.ValidationError):
        settings.OperatorConfig(watch_namespaces="Team A")


def test_live_policies_are_listed_per_served_namespace(monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[str, ...]] = []

    class Api:
        def __init__(self, _client: Any) -> None:
            pass

        def list_namespaced_custom_object(self, g: str, v: str, ns: str, plural: str) -> Any:
            calls.append(("ns", ns))
            return {"items": [{"metadata": {"name": f"p-{ns}"}}]}

        def list_cluster_custom_object(self, g: str, v: str, plural: str) -> Any:
            calls.append(("cluster",))
            return {"items": [{"metadata": {"name": "x", "deletionTimestamp": "t"}}]}

    monkeypatch.setattr(kube, "_api", lambda: None)
    monkeypatch.setattr("kubernetes.client.CustomObjectsApi", Api)
    got = kube.live_policies(("a", "b"))
    assert [p["metadata"]["name"] for p in got] == ["p-a", "p-b"]
    assert calls == [("ns", "a"), ("ns", "b")]
    assert kube.live_policies() == [] and calls[-1] == ("cluster",)
