"""End-to-end fixtures: one real control plane (etcd, kube-apiserver, KCM, scheduler, KWOK)
with 3 fake nodes x 8 GPUs for the whole session, and a fresh namespace per test.

There are no skips: a missing binary fails the tests with the command that builds it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import wait_until
from rlenergy_dev.devcluster import DevCluster

E2E_DIR = Path(__file__).resolve().parent
DEFAULT_TIMEOUT = 300  # seconds per test, including a cold cluster start on 2 cores


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT))


# ``dev_cluster`` (session) is in tests/conftest.py: the fuzz and integration tests use the same
# control plane for their trainer pods' tokens.


@pytest.fixture
def namespace(dev_cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    base = request.node.name.lower().replace("_", "-")[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    dev_cluster.kubectl("create", "namespace", name)
    # Pods need the namespace's default ServiceAccount (ServiceAccount admission is on).
    wait_until(
        lambda: (
            dev_cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0
        ),
        timeout=60,
        what=f"serviceaccount/default in {name}",
    )
    yield name
    dev_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def crds(dev_cluster: DevCluster) -> None:
    """The project's CRDs (``crds/``) applied once, established and served."""
    dev_cluster.kubectl("apply", "--server-side", "-f", str(E2E_DIR.parents[1] / "crds"))
    dev_cluster.wait_crds_established(
        "rlenergypolicies.rlenergy.io", "rlenergynodereports.rlenergy.io"
    )
