"""A real, Docker-free Kubernetes control plane with fake GPU nodes (tests and the demo).

Binaries come from ``make bins`` (``hack/controlplane-bins.sh``); see ``docs/dev-cluster.md``.
"""

from __future__ import annotations

from rlenergy_dev.devcluster.binaries import K8S_VERSION, KWOK_VERSION, resolve_binaries
from rlenergy_dev.devcluster.cluster import DevCluster, stop_from_state
from rlenergy_dev.devcluster.errors import DevClusterError, MissingBinaryError
from rlenergy_dev.devcluster.nodes import DEFAULT_GPU_PRODUCT, gpu_node_manifest

__all__ = [
    "DEFAULT_GPU_PRODUCT",
    "K8S_VERSION",
    "KWOK_VERSION",
    "DevCluster",
    "DevClusterError",
    "MissingBinaryError",
    "gpu_node_manifest",
    "resolve_binaries",
    "stop_from_state",
]
