"""Pod to GPU map from the kubelet PodResources v1 API (gRPC over the kubelet's Unix socket).

Attribution comes only from the kubelet's allocation by device ID (GPU or MIG UUID), never from
what a pod can see or its environment (case #22). The message and service descriptors of
``proto/podresources_v1.proto`` are built at run time with protobuf's descriptor API, so there
is no generated code. The only module of the agent importing ``grpc``. Callers:
``rlenergy_agent.__main__``; tests run a fake kubelet (``serve_fake_kubelet``) on a temp socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import grpc  # type: ignore[import-untyped]
from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)

from rlenergy_agent import pods as pod_types

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
RECHECK_S = 0.5
"""Callers missing from the listing have it made again at most this often, s (unknown callers
in a loop cost at most two kubelet calls a second)."""
GPU_RESOURCES = ("nvidia.com/gpu",)
"""Resource names whose device IDs are GPUs (MIG strategies add ``nvidia.com/mig-*``)."""

_T = descriptor_pb2.FieldDescriptorProto


def add_message(
    f: descriptor_pb2.FileDescriptorProto, name: str, *fields: tuple[str, int, int, int, str]
) -> descriptor_pb2.DescriptorProto:
    """Add message ``name`` to ``f``; each field is ``(name, number, type, label, type_name)``.

    ``type``/``label`` are ``FieldDescriptorProto`` enums; ``type_name`` is the fully qualified
    message type (``.pkg.Msg``) of a message field, ``""`` otherwise. Shared with the stand-in
    device plugin (``rlenergy_agent.testing.deviceplugin``), which builds its API the same way.
    """
    m = f.message_type.add(name=name)
    for fname, number, ftype, label, type_name in fields:
        fd = m.field.add(name=fname, number=number, type=ftype, label=label)
        if type_name:
            fd.type_name = type_name
    return m


def _file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name="rlenergy/podresources_v1.proto", package="v1")
    f.syntax = "proto3"

    def msg(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        add_message(f, name, *fields)

    opt, rep = _T.LABEL_OPTIONAL, _T.LABEL_REPEATED
    msg("ListPodResourcesRequest")
    msg("ListPodResourcesResponse", ("pod_resources", 1, _T.TYPE_MESSAGE, rep, ".v1.PodResources"))
    msg(
        "PodResources",
        ("name", 1, _T.TYPE_STRING, opt, ""),
        ("namespace", 2, _T.TYPE_STRING, opt, ""),
        ("containers", 3, _T.TYPE_MESSAGE, rep, ".v1.ContainerResources"),
    )
    msg(
        "ContainerResources",
        ("name", 1, _T.TYPE_STRING, opt, ""),
        ("devices", 2, _T.TYPE_MESSAGE, rep, ".v1.ContainerDevices"),
        ("cpu_ids", 3, _T.TYPE_INT64, rep, ""),
    )
    msg(
        "ContainerDevices",
        ("resource_name", 1, _T.TYPE_STRING, opt, ""),
        ("device_ids", 2, _T.TYPE_STRING, rep, ""),
        ("topology", 3, _T.TYPE_MESSAGE, opt, ".v1.TopologyInfo"),
    )
    msg("TopologyInfo", ("nodes", 1, _T.TYPE_MESSAGE, rep, ".v1.NUMANode"))
    msg("NUMANode", ("ID", 1, _T.TYPE_INT64, opt, ""))
    svc = f.service.add(name="PodResourcesLister")
    svc.method.add(
        name="List",
        input_type=".v1.ListPodResourcesRequest",
        output_type=".v1.ListPodResourcesResponse",
    )
    return f


_pool = descriptor_pool.DescriptorPool()
_pool.Add(_file())


def message_class(name: str) -> Any:
    """The runtime message class ``v1.<name>``."""
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"v1.{name}"))


ListRequest = message_class("ListPodResourcesRequest")
ListResponse = message_class("ListPodResourcesResponse")


class PodResourcesClient:
    """Lists GPU allocations from the kubelet; satisfies ``pod_types.PodMap`` (cached).

    Args:
        socket_path: the kubelet pod-resources socket.
        uid_of: optional ``(namespace, name) -> uid`` (PodResources carries no UID; the pod
            UID links a caller's cgroup to its pod).
        resources: resource names counted as GPUs.
        max_age_s: how long a listing is reused, s.
        timeout_s: per call deadline, s.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        uid_of: Callable[[str, str], str] | None = None,
        resources: Sequence[str] = GPU_RESOURCES,
        max_age_s: float = 2.0,
        timeout_s: float = 5.0,
    ) -> None:
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._list = self._channel.unary_unary(
            LIST_METHOD,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=ListResponse.FromString,
        )
        self._uid_of = uid_of
        self._resources = tuple(resources)
        self._max_age_s = max_age_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._cache: dict[pod_types.PodRef, tuple[str, ...]] = {}
        self._at = -1e18
        self._rechecked_at = -1e18

    def refresh(self) -> dict[pod_types.PodRef, tuple[str, ...]]:
        """List allocations now.

        Raises:
            grpc.RpcError: the kubelet did not answer.
        """
        resp = self._list(ListRequest(), timeout=self._timeout_s)
        out: dict[pod_types.PodRef, tuple[str, ...]] = {}
        for pod in resp.pod_resources:
            devices: list[str] = []
            for c in pod.containers:
                for d in c.devices:
                    if d.resource_name in self._resources or d.resource_name.startswith(
                        "nvidia.com/mig-"
                    ):
                        devices.extend(str(x) for x in d.device_ids)
            if devices:
                uid = self._uid_of(pod.namespace, pod.name) if self._uid_of else ""
                out[pod_types.PodRef(str(pod.namespace), str(pod.name), uid)] = tuple(devices)
        with self._lock:
            self._cache = out
            self._at = time.monotonic()
        return out

    def pods(self) -> Mapping[pod_types.PodRef, tuple[str, ...]]:
        """Allocations, listed again when older than ``max_age_s`` (stale on kubelet errors).

        The node loop keeps the listing younger than that (``keep_fresh``), so a signal's
        thread normally only reads the cache.
        """
        if time.monotonic() - self._at > self._max_age_s:
            self._try_refresh()
        with self._lock:
            return dict(self._cache)

    def _try_refresh(self) -> None:
        try:
            self.refresh()
        except grpc.RpcError as exc:
            log.warning("kubelet pod-resources unavailable, using the last listing: %s", exc)

    def keep_fresh(self) -> None:
        """List now: the node loop, every pass (``pods.ListedPodMap``)."""
        self._try_refresh()

    def recheck(self) -> None:
        """List now for a caller the listing does not know (at most every ``RECHECK_S``)."""
        now = time.monotonic()
        if now - self._rechecked_at >= RECHECK_S:
            self._rechecked_at = now
            self._try_refresh()

    def devices_of(self, pod: pod_types.PodRef) -> tuple[str, ...]:
        """Device IDs of ``pod`` (matched by namespace and name)."""
        for p, devices in self.pods().items():
            if (p.namespace, p.name) == (pod.namespace, pod.name):
                return devices
        return ()

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


def serve_fake_kubelet(
    socket_path: str,
    allocations: Callable[[], Mapping[tuple[str, str], Mapping[str, Sequence[str]]]],
) -> grpc.Server:
    """A kubelet PodResources server speaking the real protocol (tests, local runs).

    Args:
        socket_path: Unix socket to listen on.
        allocations: returns ``{(namespace, name): {resource_name: [device IDs]}}`` per call.

    Returns:
        The started server (``stop(None)`` to end it).
    """
    pod_cls = message_class("PodResources")

    def list_pods(request: Any, context: Any) -> Any:
        resp = ListResponse()
        for (ns, name), resources in allocations().items():
            pod = pod_cls(name=name, namespace=ns)
            c = pod.containers.add(name="main")
            for resource, ids in resources.items():
                c.devices.add(resource_name=resource, device_ids=list(ids))
            resp.pod_resources.append(pod)
        return resp

    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister",
        {
            "List": grpc.unary_unary_rpc_method_handler(
                list_pods,
                request_deserializer=ListRequest.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server
