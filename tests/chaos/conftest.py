"""Chaos fixtures: one dev cluster (3 fake GPU nodes) for the chaos session, the CRDs (with
kopf's peering CRDs and the operator's ClusterKopfPeering), the stand-in NVML library, and a
fresh namespace per test. No skips: a missing binary or compiler fails with what to run."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_support import CRDS, Restarts, wait_until  # noqa: E402
from rlenergy_dev import standin  # noqa: E402
from rlenergy_dev.devcluster import DevCluster, MissingBinaryError  # noqa: E402

CHAOS_DIR = Path(__file__).resolve().parent
DEFAULT_TIMEOUT = 300


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The chaos suite runs in its own pytest session (`-m chaos`: the second half of
    # `make test`, or `make test-chaos` alone), so its dev cluster never overlaps the e2e one.
    wanted = "chaos" in (config.getoption("markexpr") or "")
    keep, drop = [], []
    for item in items:
        in_suite = CHAOS_DIR in Path(str(item.fspath)).resolve().parents
        if in_suite or item.get_closest_marker("chaos") is not None:
            item.add_marker(pytest.mark.chaos)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT))
            if not wanted:
                drop.append(item)
                continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def chaos_cluster() -> Iterator[DevCluster]:
    cluster = DevCluster(startup_timeout=120)
    try:
        cluster.start(nodes=3, gpus_per_node=8)
    except MissingBinaryError as exc:
        pytest.fail(f"chaos tests need the control-plane binaries: {exc}", pytrace=False)
    with cluster:
        cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
        cluster.wait_crds_established(
            "rlenergypolicies.rlenergy.io",
            "rlenergynodereports.rlenergy.io",
            "clusterkopfpeerings.kopf.dev",
        )
        cluster.kubectl(
            "apply",
            "-f",
            "-",
            input='{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", '
            '"metadata": {"name": "rlenergy-operator"}}',
        )
        yield cluster


@pytest.fixture(scope="session")
def restarts(chaos_cluster: DevCluster) -> Iterator[Restarts]:
    # Session scope: a restarted component serves the rest of the session (stopped before the
    # cluster is).
    r = Restarts(chaos_cluster)
    yield r
    r.stop()


@pytest.fixture(scope="session")
def standin_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return standin.build_library(tmp_path_factory.mktemp("standin-build"))


@pytest.fixture
def namespace(chaos_cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    base = request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")
    name = f"{base[:40].strip('-')}-{uuid.uuid4().hex[:6]}"
    chaos_cluster.kubectl("create", "namespace", name)
    wait_until(
        lambda: (
            chaos_cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0
        ),
        timeout=60,
        what=f"serviceaccount/default in {name}",
    )
    yield name
    chaos_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    wait_until(
        lambda: chaos_cluster.kubectl("get", "namespace", name, check=False).returncode != 0,
        timeout=120,
        interval=1,
        what=f"namespace {name} gone (nothing stuck)",
    )
