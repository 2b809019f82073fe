"""The operator's server-side apply of the node-agent DaemonSet, on the real API server.

* a nodeSelector key and ``runtimeClassName`` the user unsets disappear from the DaemonSet,
  while a label another field manager (``kubectl label``) added stays; applying the same
  settings again changes nothing;
* a DaemonSet the operator wrote before it applied server-side (created by the Python client's
  default field manager) loses the unset fields too on the first apply.
"""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest
from rlenergy_dev.devcluster import DevCluster
from rlenergy_operator import builders, kube, settings

NAME = "ssa-node-agent"


@pytest.fixture
def api(dev_cluster: DevCluster, monkeypatch: pytest.MonkeyPatch) -> kubernetes.client.ApiClient:
    client = kubernetes.config.new_client_from_config(str(dev_cluster.kubeconfig))
    monkeypatch.setattr(kube, "_api", lambda: client)
    return client


def _ds(namespace: str, **kw: Any) -> dict[str, Any]:
    cfg = settings.OperatorConfig(namespace=namespace, agent_daemonset_name=NAME, **kw)
    return builders.agent_daemonset(cfg)


def _live(namespace: str) -> dict[str, Any]:
    got = kube.read_daemonset(namespace, NAME)
    assert got is not None
    return got


FULL = {"agent_node_selector": {"pool": "gpu", "zone": "a"}, "agent_runtime_class": "nvidia"}
UNSET = {"agent_node_selector": {"pool": "gpu"}}


def test_an_unset_field_disappears_and_another_managers_label_stays(
    api: kubernetes.client.ApiClient, dev_cluster: DevCluster, namespace: str
):
    assert kube.ensure_daemonset(_ds(namespace, **FULL)) == "created"
    pod = _live(namespace)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu", "zone": "a"}
    assert pod["runtimeClassName"] == "nvidia"
    dev_cluster.kubectl("label", "daemonset", NAME, "-n", namespace, "team=ml")
    assert kube.ensure_daemonset(_ds(namespace, **UNSET)) == "updated"
    live = _live(namespace)
    pod = live["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert "runtimeClassName" not in pod
    assert live["metadata"]["labels"]["team"] == "ml"  # another manager's field, left alone
    managers = {(e["manager"], e["operation"]) for e in live["metadata"]["managedFields"]}
    assert ("rlenergy-operator", "Apply") in managers
    assert ("kubectl-label", "Update") in managers
    assert kube.ensure_daemonset(_ds(namespace, **UNSET)) == "unchanged"


def test_a_daemonset_written_before_apply_loses_the_unset_fields(
    api: kubernetes.client.ApiClient, namespace: str
):
    apps = kubernetes.client.AppsV1Api(api)
    apps.create_namespaced_daemon_set(namespace, _ds(namespace, **FULL))  # the old create
    created = _live(namespace)["metadata"]["managedFields"]
    assert {e["manager"] for e in created if not e.get("subresource")} <= builders.LEGACY_MANAGERS
    assert kube.ensure_daemonset(_ds(namespace, **UNSET)) == "updated"
    live = _live(namespace)
    pod = live["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"} and "runtimeClassName" not in pod
    entries = live["metadata"]["managedFields"]
    assert {e["manager"] for e in entries if not e.get("subresource")} == {"rlenergy-operator"}
