"""``helm install oci://...`` of the published chart from a real OCI registry.

A Distribution registry (``rlenergy_dev.devcluster.registry.Registry``, built by ``make bins``)
runs on 127.0.0.1; the project's images (``make images``) are pushed to it with crane and the
chart with ``helm package`` + ``helm push --plain-http``, as a publisher does. The user then
installs the chart from the registry with its default values plus only the two values
docs/install.md tells a user of a private registry to set (``operator.image.repository``,
``agent.image.repository``). The operator runs as a local process from the chart's ConfigMap,
as in ``make demo`` (the KWOK nodes run no containers). We test these aspects:

* the release comes from the registry (chart name and version of the OCI artifact) and the
  operator Deployment, its pods and the agent DaemonSet the operator renders name the
  registry's images, whose manifests the registry serves with the digests ``make images``
  recorded;
* ``helm upgrade`` to a newer chart version pulled from the registry keeps the user's values
  and the registry image references.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import rlenergy_dev
from e2e_support import get_json, wait_until
from rlenergy_dev import fullstack, standin
from rlenergy_dev.devcluster import DevCluster, MissingBinaryError
from rlenergy_dev.devcluster.registry import IMAGES, Registry

from tests import factories

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rl-energy"
IMAGE_DIR = Path(os.environ.get("RLENERGY_IMAGES_DIR", ROOT / "build" / "images"))
"""``make images``' archives (as the real-node e2e test reads them)."""
TAG = rlenergy_dev.project_version()
NEXT_VERSION = "0.1.1"
"""The chart version of the upgrade (the same chart, packaged with ``--version``)."""
DAEMONSET = "rlenergy-node-agent"
pytestmark = pytest.mark.timeout(600)
"""A cold dev cluster, the pushes and a local operator on 2 loaded cores."""
FAST = {
    "RLENERGY_OPERATOR_RECONCILE_INTERVAL_S": "0.5",
    "RLENERGY_OPERATOR_RESET_DEADLINE_S": "30",
    "RLENERGY_OPERATOR_AGENT_CHECK_INTERVAL_S": "1",
}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    try:
        reg = Registry(tmp_path_factory.mktemp("registry"))
    except MissingBinaryError as exc:
        pytest.fail(f"the registry test needs the registry binaries: {exc}", pytrace=False)
    with reg:
        yield reg


@pytest.fixture(scope="module")
def published(registry: Registry) -> dict[str, Any]:
    """The images and two chart versions pushed: image name -> digest, chart URL, versions."""
    for name in IMAGES:
        if not (IMAGE_DIR / f"{name}.oci.tar").is_file():
            pytest.fail(f"{IMAGE_DIR}/{name}.oci.tar missing: run `make images`", pytrace=False)
    refs = registry.push_images(IMAGE_DIR, TAG)
    chart, version = registry.push_chart(CHART)
    chart_next, next_version = registry.push_chart(CHART, NEXT_VERSION)
    assert chart_next == chart
    assert sorted(registry.tags("charts/rl-energy")) == sorted([version, next_version])
    return {
        "digests": {n: r.split("@", 1)[1] for n, r in refs.items()},
        "chart": chart,
        "version": version,
        "next_version": next_version,
    }


def _release(c: DevCluster, ns: str, name: str) -> dict[str, Any]:
    (rel,) = json.loads(c.helm("list", "-n", ns, "-o", "json").stdout)
    assert rel["name"] == name
    return dict(rel)


def _images_in_registry(registry: Registry, published: dict[str, Any]) -> None:
    for name, digest in published["digests"].items():
        built = json.loads((IMAGE_DIR / f"{name}.json").read_text())["manifest_digest"]
        assert digest == built, (name, digest, built)  # crane pushed the archive's own manifest
        got, manifest = registry.manifest(f"rl-energy/{name}", TAG)
        assert got == digest, (name, got, digest)
        assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
        assert len(manifest["layers"]) == 2  # docs/images.md: base and application layers


def test_helm_install_and_upgrade_from_the_registry(
    dev_cluster: DevCluster,
    crds: None,
    namespace: str,
    registry: Registry,
    published: dict[str, Any],
    tmp_path: Path,
) -> None:
    c, name = dev_cluster, f"rl{namespace[-6:]}"
    operator_image = f"{registry.image_repository('rl-energy-operator')}:{TAG}"
    agent_image = f"{registry.image_repository('rl-energy-agent')}:{TAG}"
    user_values = [
        "--set", f"operator.image.repository={registry.image_repository('rl-energy-operator')}",
        "--set", f"agent.image.repository={registry.image_repository('rl-energy-agent')}",
    ]  # fmt: skip
    c.helm(
        "install", name, published["chart"], "--version", published["version"], "--plain-http",
        "-n", namespace, *user_values,
    )  # fmt: skip
    try:
        rel = _release(c, namespace, name)
        assert rel["chart"] == f"rl-energy-{published['version']}", rel
        deploy = get_json(c, "deployment", f"{name}-rl-energy-operator", "-n", namespace)
        assert deploy["spec"]["replicas"] == 2  # the chart's default
        (container,) = deploy["spec"]["template"]["spec"]["containers"]
        assert container["image"] == operator_image
        pods = wait_until(
            lambda: (
                get_json(c, "pods", "-n", namespace, "-l", "app.kubernetes.io/component=operator")[
                    "items"
                ]
                or None
            ),
            timeout=120,
            what="operator pods created",
        )
        assert {p["spec"]["containers"][0]["image"] for p in pods} == {operator_image}
        cm = get_json(c, "configmap", f"{name}-rl-energy-config", "-n", namespace)
        assert cm["data"]["RLENERGY_OPERATOR_AGENT_IMAGE"] == agent_image
        _images_in_registry(registry, published)

        # The operator (a local process with the chart's settings) renders the agent DaemonSet.
        policy = factories.sample_policy()
        lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
        with fullstack.FullStack(
            c.kubeconfig, namespace, policy["metadata"]["name"], c.nodes, tmp_path / "stack",
            lib_dir, operator_env={**cm["data"], **FAST},
        ) as stack:  # fmt: skip
            stack.start_operator()
            c.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
            ds = wait_until(
                lambda: (
                    c.kubectl("get", "daemonset", DAEMONSET, "-n", namespace, "-o", "json",
                              check=False).stdout or None
                ),
                timeout=180,
                what="the agent DaemonSet",
            )  # fmt: skip
            agent = json.loads(ds)["spec"]["template"]["spec"]["containers"][0]
            assert agent["image"] == agent_image
            c.kubectl("delete", "rlep", policy["metadata"]["name"], "-n", namespace,
                      "--timeout=90s")  # fmt: skip

        # A newer chart version from the registry; the user's values are kept.
        c.helm(
            "upgrade", name, published["chart"], "--version", published["next_version"],
            "--plain-http", "-n", namespace, "--reuse-values",
        )  # fmt: skip
        rel = _release(c, namespace, name)
        assert rel["chart"] == f"rl-energy-{published['next_version']}", rel
        assert rel["revision"] == "2", rel
        deploy = get_json(c, "deployment", f"{name}-rl-energy-operator", "-n", namespace)
        assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == operator_image
        cm = get_json(c, "configmap", f"{name}-rl-energy-config", "-n", namespace)
        assert cm["data"]["RLENERGY_OPERATOR_AGENT_IMAGE"] == agent_image
    finally:
        c.helm("uninstall", name, "-n", namespace, "--wait", check=False)
