"""Shared test configuration: every warning is an error (pyproject), seeds are fixed.

``dev_cluster``: one real control plane (etcd, kube-apiserver, KCM, scheduler, KWOK) with 3
fake nodes x 8 GPUs for the whole session, shared by the e2e tests and by the integration and
fuzz tests whose trainer pods need real tokens (the agent checks callers by TokenReview).
There are no skips: a missing binary fails with the command that builds it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from rlenergy_dev.devcluster import DevCluster, MissingBinaryError

# tests/verl run in .venv-verl, which has the pinned verl (`make test-verl`, part of `make
# test`); the main venv has no verl or torch by design.
# (A spec without an origin is the folder tests/verl itself, a namespace package, not verl.)
_VERL = importlib.util.find_spec("verl")
collect_ignore = [] if _VERL is not None and _VERL.origin is not None else ["verl"]


@pytest.fixture(scope="session")
def dev_cluster() -> Iterator[DevCluster]:
    from tests.e2e.e2e_support import GPU_PRODUCT, GPUS_PER_NODE, NODES

    cluster = DevCluster(startup_timeout=120)
    try:
        cluster.start(nodes=NODES, gpus_per_node=GPUS_PER_NODE, gpu_product=GPU_PRODUCT)
    except MissingBinaryError as exc:
        pytest.fail(f"e2e tests need the control-plane binaries: {exc}", pytrace=False)
    with cluster:
        yield cluster
