"""What the operator relies on: CRD status subresource + pruning, kubectl apply, scheduling."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from e2e_support import MANIFESTS, get_json, wait_until
from rlenergy_dev.devcluster import DevCluster

CRD = "gpuwidgets.e2e.rlenergy.dev"


@pytest.fixture(scope="module")
def widget_crd(dev_cluster: DevCluster) -> Iterator[str]:
    dev_cluster.kubectl("apply", "-f", str(MANIFESTS / "widget-crd.yaml"))
    dev_cluster.wait_crds_established(CRD)
    yield CRD
    dev_cluster.kubectl("delete", "crd", CRD, "--wait=false", check=False)


def _widget(name: str, **spec: object) -> str:
    return json.dumps(
        {
            "apiVersion": "e2e.rlenergy.dev/v1alpha1",
            "kind": "GpuWidget",
            "metadata": {"name": name},
            "spec": {"gpus": 8, **spec},
        }
    )


def test_status_subresource_accepts_status_and_prunes_undeclared_fields(
    dev_cluster: DevCluster, widget_crd: str, namespace: str
):
    # kubectl's default (fieldValidation=Strict) rejects an undeclared field ...
    strict = dev_cluster.kubectl(
        "create", "-n", namespace, "-f", "-", input=_widget("w1", bogus="x"), check=False
    )
    assert strict.returncode != 0 and 'unknown field "spec.bogus"' in strict.stderr
    # ... clients that send no fieldValidation (the Python client, kopf) get Warn: it is pruned.
    warn = dev_cluster.kubectl(
        "create", "-n", namespace, "--validate=warn", "-f", "-", input=_widget("w1", bogus="x")
    )
    assert 'unknown field "spec.bogus"' in warn.stderr
    created = get_json(dev_cluster, "gpuwidget", "w1", "-n", namespace)
    assert "bogus" not in created["spec"], "undeclared spec fields are pruned on create"
    assert "status" not in created

    # A status write on the main resource is silently ignored when status is a subresource.
    dev_cluster.kubectl(
        "patch", "gpuwidget", "w1", "-n", namespace, "--type=merge",
        "-p", json.dumps({"status": {"phase": "Ignored"}}),
    )  # fmt: skip
    assert "status" not in get_json(dev_cluster, "gpuwidget", "w1", "-n", namespace)

    # On /status it is accepted, and an undeclared status field is dropped.
    status = {"phase": "Running", "observedGeneration": 1, "undeclared": {"x": 1}}
    patched = dev_cluster.kubectl(
        "patch", "gpuwidget", "w1", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    after = get_json(dev_cluster, "gpuwidget", "w1", "-n", namespace)
    assert 'unknown field "status.undeclared"' in patched.stderr
    assert after["status"] == {"phase": "Running", "observedGeneration": 1}
    # A status write does not bump the generation (the operator must use observedGeneration).
    assert after["metadata"]["generation"] == created["metadata"]["generation"]

    # The schema is enforced: a wrong type is rejected, not stored.
    bad = dev_cluster.kubectl(
        "patch", "gpuwidget", "w1", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"observedGeneration": "one"}}), check=False,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "observedGeneration" in bad.stderr


def test_kubectl_apply_of_a_sample_resource(
    dev_cluster: DevCluster, widget_crd: str, namespace: str
):
    sample = str(MANIFESTS / "sample-gpuwidget.yaml")
    first = dev_cluster.kubectl("apply", "-n", namespace, "-f", sample)
    assert "gpuwidget.e2e.rlenergy.dev/sample created" in first.stdout
    assert "configmap/sample-settings created" in first.stdout
    again = dev_cluster.kubectl("apply", "-n", namespace, "-f", sample)
    assert "gpuwidget.e2e.rlenergy.dev/sample unchanged" in again.stdout
    widget = get_json(dev_cluster, "gpuwidget", "sample", "-n", namespace)
    assert widget["spec"] == {"gpus": 8, "smClockMHz": 1410}
    rejected = dev_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=_widget("zero", gpus=0), check=False
    )
    assert rejected.returncode != 0
    assert "spec.gpus" in rejected.stderr


def _daemonset(name: str, tolerate: bool) -> str:
    pod_spec: dict[str, object] = {
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "containers": [{"name": "probe", "image": "registry.invalid/gpu-probe:1"}],
    }
    if tolerate:
        pod_spec["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    return json.dumps(
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": name},
            "spec": {
                "selector": {"matchLabels": {"app": name}},
                "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec},
            },
        }
    )


def test_daemonset_lands_only_with_the_gpu_toleration(dev_cluster: DevCluster, namespace: str):
    dev_cluster.kubectl("create", "-n", namespace, "-f", "-", input=_daemonset("tolerant", True))
    dev_cluster.kubectl("create", "-n", namespace, "-f", "-", input=_daemonset("plain", False))
    nodes = set(dev_cluster.nodes)

    def running_tolerant() -> list[dict[str, object]] | None:
        pods = get_json(dev_cluster, "pods", "-n", namespace, "-l", "app=tolerant")["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        return running if len(running) == len(nodes) else None

    pods = wait_until(running_tolerant, timeout=120, what="one Running pod per GPU node")
    assert {p["spec"]["nodeName"] for p in pods} == nodes  # type: ignore[index]
    for pod in pods:
        assert pod["status"]["podIP"].startswith("10.244.")  # type: ignore[index]
        assert pod["status"]["hostIP"] == "127.0.0.1"  # type: ignore[index]

    def plain_observed() -> dict[str, object] | None:
        ds = get_json(dev_cluster, "daemonset", "plain", "-n", namespace)
        return ds if ds["status"].get("observedGeneration", 0) >= 1 else None

    plain = wait_until(plain_observed, timeout=60, what="DaemonSet plain observed")
    assert plain["status"]["desiredNumberScheduled"] == 0  # type: ignore[index]
    assert get_json(dev_cluster, "pods", "-n", namespace, "-l", "app=plain")["items"] == []
    tolerant = get_json(dev_cluster, "daemonset", "tolerant", "-n", namespace)
    assert tolerant["status"]["desiredNumberScheduled"] == len(nodes)


def test_gpu_requests_are_scheduled_against_the_fake_capacity(
    dev_cluster: DevCluster, namespace: str
):
    """8 GPUs per node: a 6-GPU pod fits anywhere; after one per node, a fourth cannot."""
    gpu_nodes = len(dev_cluster.nodes)

    def pod(name: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "registry.invalid/trainer:1",
                            "resources": {"limits": {"nvidia.com/gpu": "6"}},
                        }
                    ],
                },
            }
        )

    for i in range(gpu_nodes + 1):
        dev_cluster.kubectl("create", "-n", namespace, "-f", "-", input=pod(f"train-{i}"))

    def settled() -> list[dict[str, object]] | None:
        pods = get_json(dev_cluster, "pods", "-n", namespace)["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        unschedulable = [
            p
            for p in pods
            if any(c.get("reason") == "Unschedulable" for c in p["status"].get("conditions", []))
        ]
        return pods if len(running) == gpu_nodes and len(unschedulable) == 1 else None

    pods = wait_until(settled, timeout=120, what="3 Running + 1 Unschedulable GPU pods")
    placed = [p["spec"].get("nodeName") for p in pods if p["status"]["phase"] == "Running"]  # type: ignore[index,union-attr]
    assert sorted(placed) == sorted(dev_cluster.nodes)
