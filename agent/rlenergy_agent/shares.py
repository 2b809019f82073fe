"""Shared GPUs: each physical GPU's energy is booked once, split over the pods that share it.

A GPU can be shared two ways: MIG (the kubelet hands out MIG device UUIDs, several per physical
GPU) and time-slicing (the NVIDIA device plugin's replicas, device IDs ``<GPU UUID>::<n>``).
Each instance sees the whole GPU's power, so booking every pod's window with the GPU's full
energy multiplies it by the number of sharers. Here a pod's window books
``share(pod, gpu)`` of the GPU's energy:

* MIG: the pod's instances over all MIG instances of the GPU (``mig_uuids``), each weighted by
  its profile's size in GPU-instance slices (``nvmlDeviceGetAttributes``'
  ``gpuInstanceSliceCount``: 1g = 1, 2g = 2, 3g = 3, 4g = 4, 7g = 7), so a job owning a 3g and
  a 1g instance of a GPU split 3g + 2g + 1g + 1g books 4/7; an instance whose size NVML does not
  give weighs 1 slice. Instances no pod holds leave their share unbooked (it shows in the node
  report's unattributed energy). [MODEL: power splits with the compute slices a profile owns;
  NVML meters only the whole GPU];
* time-slicing: the pod's replicas over every replica of the GPU any pod holds;
* a whole GPU held by one pod: 1;
* one device ID listed under several pods (the kubelet can keep listing a finished pod with
  the devices it held, next to the running pod they were given to): the device is booked
  once. The pod that drives the GPU (``owners``: the last pod whose signal acted on it)
  takes the whole device; until one does, the listed pods split it evenly, so the shares of
  one device always sum to 1.

Pure functions; ``rlenergy_agent.service`` applies them when a window closes.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

REPLICA_SEPARATOR = "::"
"""The NVIDIA device plugin names time-sliced replicas ``<GPU UUID>::<replica index>``."""


def physical(device: str, mig_parent: Mapping[str, str]) -> str:
    """The physical GPU UUID of a kubelet device ID (MIG instance, replica, or a GPU)."""
    if device in mig_parent:
        return mig_parent[device]
    base, sep, index = device.rpartition(REPLICA_SEPARATOR)
    return base if sep and index.isdigit() else device


def sharers(gpu: str, pods: Mapping[Any, Sequence[str]], mig_parent: Mapping[str, str]) -> set[str]:
    """Every device ID of physical GPU ``gpu`` that any pod holds (MIG instances, replicas).

    A lock or a park changes the clock of the whole physical GPU, so a pod may make one only
    when it holds all of these (``rlenergy_agent.actuator.Actuator.apply``): a pod holding one
    time-slicing or MPS replica (``GPU-x::0``) must not lock the GPU under its co-tenant's
    replica (``GPU-x::1``).
    """
    return {d for devices in pods.values() for d in devices if physical(d, mig_parent) == gpu}


def shares(
    pods: Mapping[Hashable, Sequence[str]],
    mig_parent: Mapping[str, str],
    mig_instances: Mapping[str, Sequence[str]],
    mig_slices: Mapping[str, int] | None = None,
    owners: Mapping[str, Hashable] | None = None,
) -> dict[tuple[Hashable, str], float]:
    """``(pod, physical GPU) -> share`` of the GPU's energy each pod's windows book.

    Args:
        pods: every pod on the node with its kubelet device IDs.
        mig_parent: MIG instance UUID -> physical GPU UUID.
        mig_instances: physical GPU UUID -> its MIG instance UUIDs (MIG-enabled GPUs only).
        mig_slices: MIG instance UUID -> GPU-instance slices of its profile (missing: 1).
        owners: physical GPU UUID -> the pod that drives it (a key of ``pods``); it alone
            books a device listed under several pods.
    """
    slices = mig_slices or {}
    drivers = owners or {}
    holders: dict[str, list[Hashable]] = {}
    for pod, devices in pods.items():
        for d in dict.fromkeys(devices):
            holders.setdefault(d, []).append(pod)

    def weight(device: str) -> int:
        return max(int(slices.get(device, 1)), 1) if device in mig_parent else 1

    held: dict[tuple[Hashable, str], float] = {}
    replicas: dict[str, set[str]] = {}
    for pod, devices in pods.items():
        for d in dict.fromkeys(devices):
            gpu = physical(d, mig_parent)
            listed = holders[d]
            if len(listed) == 1:
                part = 1.0
            elif drivers.get(gpu) in listed:
                part = 1.0 if drivers.get(gpu) == pod else 0.0
            else:
                part = 1.0 / len(listed)
            held[(pod, gpu)] = held.get((pod, gpu), 0.0) + weight(d) * part
            replicas.setdefault(gpu, set()).add(d)
    out: dict[tuple[Hashable, str], float] = {}
    for (pod, gpu), n in held.items():
        instances = mig_instances.get(gpu, ())
        total = sum(weight(m) for m in instances) or len(replicas[gpu])
        out[(pod, gpu)] = min(n / max(total, 1), 1.0)
    return out
