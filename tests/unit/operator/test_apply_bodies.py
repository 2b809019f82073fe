"""Server-side apply of the objects the operator owns (builders.apply_body, kube.ensure_daemonset).

We test these aspects:
* the apply configuration is the whole desired DaemonSet with no server-owned metadata or
  status; a setting the user unsets (a nodeSelector key, runtimeClassName) is absent from it,
  so the API server removes the field the operator applied before;
* ensure_daemonset sends one apply PATCH (apply-patch content type, the operator's field
  manager, force) and tells created, updated and unchanged apart;
* the fields the operator's pre-apply writes own (the Python client's default manager, an
  Update) move into its Apply entry, other managers' entries untouched, and the upgrade
  patch tests the resourceVersion it read;
* unchanged means the same content: a status write between the read and the apply (it moves
  the resourceVersion) is still unchanged, a changed label is updated.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from rlenergy_operator import builders, kube, settings


def _cfg(**kw: Any) -> settings.OperatorConfig:
    return settings.OperatorConfig(namespace="rl-energy", **kw)


def test_the_apply_body_is_the_desired_daemonset_without_server_fields():
    ds = builders.agent_daemonset(_cfg(agent_node_selector={"pool": "gpu"}))
    live_like = {
        **ds,
        "metadata": {**ds["metadata"], "resourceVersion": "9", "uid": "u", "managedFields": []},
        "status": {"numberReady": 1},
    }
    body = builders.apply_body(live_like)
    assert body == builders.apply_body(ds)
    assert set(body) == {"apiVersion", "kind", "metadata", "spec"}
    assert body["metadata"] == {
        "name": "rlenergy-node-agent",
        "namespace": "rl-energy",
        "labels": builders.AGENT_LABELS,
    }
    assert body["spec"] == ds["spec"] and body["spec"] is not ds["spec"]  # a copy
    with pytest.raises(ValueError, match="apiVersion, kind and metadata.name"):
        builders.apply_body({"kind": "DaemonSet", "metadata": {"name": "x"}})


def test_an_unset_setting_is_absent_from_the_apply_body():
    before = builders.apply_body(
        builders.agent_daemonset(
            _cfg(agent_node_selector={"pool": "gpu", "zone": "a"}, agent_runtime_class="nvidia")
        )
    )
    after = builders.apply_body(builders.agent_daemonset(_cfg(agent_node_selector={"pool": "gpu"})))
    pod, pod_after = before["spec"]["template"]["spec"], after["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu", "zone": "a"}
    assert pod["runtimeClassName"] == "nvidia"
    assert pod_after["nodeSelector"] == {"pool": "gpu"} and "runtimeClassName" not in pod_after
    empty = builders.apply_body(builders.agent_daemonset(_cfg()))["spec"]["template"]["spec"]
    assert "nodeSelector" not in empty


class _Apps:
    """AppsV1Api double: one DaemonSet; PATCH calls recorded."""

    def __init__(self, live: dict[str, Any] | None) -> None:
        self.live = live
        self.patches: list[tuple[Any, dict[str, Any]]] = []

    def read_namespaced_daemon_set(self, name: str, ns: str) -> dict[str, Any]:
        if self.live is None:
            raise kube.ApiError(status=404, reason="Not Found")
        return self.live

    def patch_namespaced_daemon_set(
        self, name: str, ns: str, body: Any, **kw: Any
    ) -> dict[str, Any]:
        self.patches.append((body, kw))
        if kw.get("_content_type") == kube.APPLY_PATCH:
            rv = "1" if self.live is None else self.live["metadata"]["resourceVersion"]
            if self.live is not None and body["spec"] != self.live["spec"]:
                rv = str(int(rv) + 1)
            self.live = {**body, "metadata": {**body["metadata"], "resourceVersion": rv}}
        else:
            assert self.live is not None
            rv = str(int(self.live["metadata"]["resourceVersion"]) + 1)
            self.live = {**self.live, "metadata": {**self.live["metadata"], "resourceVersion": rv}}
        return self.live


@pytest.fixture
def apps(monkeypatch: pytest.MonkeyPatch) -> _Apps:
    fake = _Apps(None)
    client = SimpleNamespace(sanitize_for_serialization=lambda obj: obj)
    monkeypatch.setattr(kube, "_api", lambda: client)
    monkeypatch.setattr(kube.kubernetes.client, "AppsV1Api", lambda _c: fake)
    return fake


def test_ensure_daemonset_applies_with_its_field_manager_and_force(apps: _Apps):
    ds = builders.agent_daemonset(_cfg(agent_runtime_class="nvidia"))
    assert kube.ensure_daemonset(ds) == "created"
    ((body, kw),) = apps.patches
    assert body == builders.apply_body(ds)
    assert kw == {
        "field_manager": "rlenergy-operator",
        "force": True,
        "_content_type": "application/apply-patch+yaml",
    }
    assert kube.ensure_daemonset(ds) == "unchanged"
    assert kube.ensure_daemonset(builders.agent_daemonset(_cfg())) == "updated"
    assert "runtimeClassName" not in apps.patches[-1][0]["spec"]["template"]["spec"]
    assert len(apps.patches) == 3  # no managed-fields upgrade: nothing legacy


LEGACY = {
    "manager": "OpenAPI-Generator",
    "operation": "Update",
    "apiVersion": "apps/v1",
    "fieldsType": "FieldsV1",
    "fieldsV1": {
        "f:metadata": {"f:labels": {".": {}, "f:app.kubernetes.io/name": {}}},
        "f:spec": {"f:template": {"f:spec": {"f:nodeSelector": {".": {}, "f:zone": {}}}}},
    },
}
OTHERS = [
    {
        "manager": "kubectl-label",
        "operation": "Update",
        "apiVersion": "apps/v1",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:labels": {"f:team": {}}}},
    },
    {
        "manager": "kube-controller-manager",
        "operation": "Update",
        "apiVersion": "apps/v1",
        "subresource": "status",
        "fieldsType": "FieldsV1",
        "fieldsV1": {"f:status": {"f:numberReady": {}}},
    },
]


def test_the_legacy_writes_move_into_the_operators_apply_entry():
    assert builders.upgraded_managed_fields(OTHERS, "apps/v1") is None
    out = builders.upgraded_managed_fields([LEGACY, *OTHERS], "apps/v1")
    assert out is not None
    assert out[:2] == OTHERS  # other managers and subresources untouched
    assert out[2] == {**LEGACY, "manager": "rlenergy-operator", "operation": "Apply"}
    # An Apply entry of the operator's already there: the legacy fields join it.
    mine = {
        **LEGACY,
        "manager": "rlenergy-operator",
        "operation": "Apply",
        "fieldsV1": {"f:spec": {"f:template": {"f:spec": {"f:runtimeClassName": {}}}}},
    }
    out = builders.upgraded_managed_fields([mine, LEGACY], "apps/v1")
    assert out is not None and len(out) == 1
    pod = out[0]["fieldsV1"]["f:spec"]["f:template"]["f:spec"]
    assert pod == {"f:runtimeClassName": {}, "f:nodeSelector": {".": {}, "f:zone": {}}}
    assert out[0]["fieldsV1"]["f:metadata"] == LEGACY["fieldsV1"]["f:metadata"]
    assert mine["fieldsV1"] == {"f:spec": {"f:template": {"f:spec": {"f:runtimeClassName": {}}}}}


def test_a_daemonset_written_before_apply_is_upgraded_first(apps: _Apps):
    ds = builders.agent_daemonset(_cfg())
    apps.live = {
        **ds,
        "metadata": {**ds["metadata"], "resourceVersion": "4", "managedFields": [LEGACY]},
    }
    assert kube.ensure_daemonset(ds) == "unchanged"  # only the managed fields moved
    (ops, kw), (body, apply_kw) = apps.patches
    assert kw == {"_content_type": "application/json-patch+json"}
    assert ops[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "4"}
    assert ops[1]["path"] == "/metadata/managedFields"
    assert [e["manager"] for e in ops[1]["value"]] == ["rlenergy-operator"]
    assert apply_kw["field_manager"] == "rlenergy-operator" and apply_kw["force"] is True


def test_an_upgrade_that_loses_the_race_reads_again(apps: _Apps, monkeypatch: pytest.MonkeyPatch):
    """The DaemonSet controller writes status between our read and our patch: read again."""
    ds = builders.agent_daemonset(_cfg())
    apps.live = {
        **ds,
        "metadata": {**ds["metadata"], "resourceVersion": "4", "managedFields": [LEGACY]},
    }
    patch = apps.patch_namespaced_daemon_set
    refusals = {"left": 2}

    def racing(name: str, ns: str, body: Any, **kw: Any) -> dict[str, Any]:
        if kw.get("_content_type") != kube.APPLY_PATCH and refusals["left"]:
            refusals["left"] -= 1
            assert apps.live is not None
            rv = str(int(apps.live["metadata"]["resourceVersion"]) + 1)  # the status write
            apps.live = {**apps.live, "metadata": {**apps.live["metadata"], "resourceVersion": rv}}
            raise kube.ApiError(status=422, reason="Unprocessable Entity")
        return patch(name, ns, body, **kw)

    monkeypatch.setattr(apps, "patch_namespaced_daemon_set", racing)
    assert kube.ensure_daemonset(ds) == "unchanged"
    (ops, _), _apply = apps.patches
    assert ops[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "6"}
    refusals["left"] = kube.UPGRADE_ATTEMPTS  # never wins: the refusal propagates
    apps.live = {**apps.live, "metadata": {**apps.live["metadata"], "managedFields": [LEGACY]}}
    with pytest.raises(kube.ApiError) as refused:
        kube.ensure_daemonset(ds)
    assert refused.value.status == 422


def test_a_status_write_between_read_and_apply_is_still_unchanged(
    apps: _Apps, monkeypatch: pytest.MonkeyPatch
):
    """The DaemonSet controller writes status after our GET: same content, unchanged."""
    ds = builders.agent_daemonset(_cfg())
    assert kube.ensure_daemonset(ds) == "created"
    read = apps.read_namespaced_daemon_set

    def read_then_status_write(name: str, ns: str) -> dict[str, Any]:
        seen = read(name, ns)
        assert apps.live is not None
        rv = str(int(apps.live["metadata"]["resourceVersion"]) + 1)
        apps.live = {
            **apps.live,
            "metadata": {**apps.live["metadata"], "resourceVersion": rv},
            "status": {"numberReady": 1},
        }
        return seen

    monkeypatch.setattr(apps, "read_namespaced_daemon_set", read_then_status_write)
    assert kube.ensure_daemonset(ds) == "unchanged"
    labelled = {
        **ds,
        "metadata": {**ds["metadata"], "labels": {**ds["metadata"]["labels"], "x": "y"}},
    }
    assert kube.ensure_daemonset(labelled) == "updated"
