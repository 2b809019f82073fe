"""Fake GPU nodes managed by KWOK."""

from __future__ import annotations

from typing import Any

DEFAULT_GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPU_RESOURCE = "nvidia.com/gpu"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"
NODE_PREFIX = "kwok-gpu-"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}


NVIDIA_RUNTIME_CLASS = "nvidia"
"""The RuntimeClass NVIDIA's GPU Operator (container toolkit) creates, handler ``nvidia``."""


def nvidia_runtime_class_manifest() -> dict[str, Any]:
    """The RuntimeClass ``nvidia`` of a GPU Operator cluster (the chart's default agent runtime).

    The RuntimeClass admission plugin refuses a pod whose runtime class does not exist, so a
    cluster without it would never run the agent pods the chart's defaults render. KWOK's fake
    nodes run no container, so the handler is a name only there; the real node's containerd
    runs it with NVIDIA Container Toolkit's runtime in CDI mode
    (``rlenergy_dev.devcluster.realnode.containerd_config``).
    """
    return {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": NVIDIA_RUNTIME_CLASS},
        "handler": NVIDIA_RUNTIME_CLASS,
    }


def node_name(index: int) -> str:
    """Name of the ``index``-th fake node."""
    return f"{NODE_PREFIX}{index}"


def gpu_node_manifest(
    name: str,
    *,
    gpus: int = 8,
    gpu_product: str = DEFAULT_GPU_PRODUCT,
    cpu: str = "64",
    memory: str = "512Gi",
    pods: str = "110",
) -> dict[str, Any]:
    """A ``v1.Node`` that KWOK manages and that looks like a GPU node to the scheduler.

    The node carries the labels of NVIDIA's GPU feature discovery, advertises ``G`` GPUs as
    an extended resource, is tainted ``nvidia.com/gpu=present:NoSchedule`` and reports the
    InternalIP 127.0.0.1 (nothing may dial a private address).

    Args:
        name: Node name.
        gpus: GPUs per node (capacity and allocatable ``nvidia.com/gpu``).
        gpu_product: Value of the ``nvidia.com/gpu.product`` label.
        cpu: CPU capacity.
        memory: Memory capacity.
        pods: Pod capacity.

    Returns:
        The manifest as a dict (ready for ``kubectl create -f -`` as JSON).
    """
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    resources = {"cpu": cpu, "memory": memory, "pods": pods, GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE,
                "node.alpha.kubernetes.io/ttl": "0",
            },
            "labels": {
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/role": "agent",
                "node-role.kubernetes.io/agent": "",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": gpu_product,
                "nvidia.com/gpu.count": str(gpus),
            },
        },
        "spec": {"taints": [dict(GPU_TAINT)]},
        "status": {
            "allocatable": dict(resources),
            "capacity": dict(resources),
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
            "phase": "Running",
        },
    }
