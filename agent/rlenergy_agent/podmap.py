"""Pod to GPU map from the kubelet PodResources v1 API (gRPC over the kubelet's Unix socket).

Attribution comes only from the kubelet's allocation, never from what a pod can see or its
environment: device-plugin devices by device ID (GPU or MIG UUID), devices of a pod's
ResourceClaims (DRA, the listing's ``dynamic_resources``) by driver, pool and device name, which
``rlenergy_agent.dra`` maps to a GPU or MIG UUID. A pod holding GPUs both ways has the union.
The message and service descriptors of ``proto/podresources_v1.proto`` are built at run time
with protobuf's descriptor API, so there is no generated code. The client is ``grpclib`` (gRPC
in Python over the ``h2`` HTTP/2 library) on an asyncio loop of its own thread: the agent's
resident set holds 2 MiB of it where ``grpcio``'s C core took 8 MiB loaded and about 4 MiB more
once its channel worked (its 17 MB shared library's pages and six threads of its own; measured
on 8 stand-in GPUs, docs/agent.md). The only module of the agent importing a gRPC library.
Callers: ``rlenergy_agent.__main__``; tests run a fake kubelet (``serve_fake_kubelet``:
``grpcio``'s server, another gRPC implementation than the client's, as the kubelet's grpc-go is)
on a temp socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)
from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError, StreamTerminatedError

from rlenergy_agent import dra
from rlenergy_agent import pods as pod_types

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
RECHECK_S = 0.5
"""Callers missing from the listing have it made again at most this often, s (unknown callers
in a loop cost at most two kubelet calls a second)."""
MAX_RECEIVE_BYTES = 16 * 1024 * 1024
"""Largest ``List`` reply taken, bytes: the kubelet's own PodResources server limit (16 MiB,
``DefaultMaxMsgSize`` of the kubelet's podresources package). A larger reply fails the call
with RESOURCE_EXHAUSTED (``grpcio``'s client default of 4 MiB failed every call on a node with
many pods)."""
HOLD_AFTER_S = 10.0
"""A listing older than this attributes nothing new, s: ten passes of the node loop failed
(a kubelet restart); the locks the agent holds stay [MODEL]."""
RESET_AFTER_S = 120.0
"""A listing older than this no longer attributes the locks held either, s: they are reset
(the kubelet has been down longer than a restart takes: the 30 s outage the kubelet restart
test makes, four times over) [MODEL]."""
GPU_RESOURCES = ("nvidia.com/gpu",)
"""Resource names whose device IDs are GPUs (MIG strategies add ``nvidia.com/mig-*``)."""
DYNAMIC = "<dynamic>"
"""``serve_fake_kubelet``: the resource key whose IDs are DRA devices ``driver/pool/device``."""

_T = descriptor_pb2.FieldDescriptorProto


def add_message(
    f: descriptor_pb2.FileDescriptorProto, name: str, *fields: tuple[str, int, int, int, str]
) -> descriptor_pb2.DescriptorProto:
    """Add message ``name`` to ``f``; each field is ``(name, number, type, label, type_name)``.

    ``type``/``label`` are ``FieldDescriptorProto`` enums; ``type_name`` is the fully qualified
    message type (``.pkg.Msg``) of a message field, ``""`` otherwise. Shared with the stand-in
    device plugin (``rlenergy_dev.deviceplugin``), which builds its API the same way.
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
        ("dynamic_resources", 5, _T.TYPE_MESSAGE, rep, ".v1.DynamicResource"),
    )
    msg(
        "DynamicResource",
        ("claim_name", 2, _T.TYPE_STRING, opt, ""),
        ("claim_namespace", 3, _T.TYPE_STRING, opt, ""),
        ("claim_resources", 4, _T.TYPE_MESSAGE, rep, ".v1.ClaimResource"),
    )
    msg(
        "ClaimResource",
        ("cdi_devices", 1, _T.TYPE_MESSAGE, rep, ".v1.CDIDevice"),
        ("driver_name", 2, _T.TYPE_STRING, opt, ""),
        ("pool_name", 3, _T.TYPE_STRING, opt, ""),
        ("device_name", 4, _T.TYPE_STRING, opt, ""),
    )
    msg("CDIDevice", ("name", 1, _T.TYPE_STRING, opt, ""))
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


class ListError(Exception):
    """A ``List`` call that failed.

    Args:
        code: the gRPC status code's name (``UNAVAILABLE``, ``RESOURCE_EXHAUSTED``,
            ``DEADLINE_EXCEEDED``, ...; a connection refused or lost is ``UNAVAILABLE``).
        details: what the server or the connection said.
    """

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class _LimitedCodec(ProtoCodec):
    """Protobuf messages, replies over ``max_bytes`` refused (RESOURCE_EXHAUSTED)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self.max_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"reply of {len(data)} bytes, larger than the {self.max_bytes} taken",
            )
        return super().decode(data, message_type)


async def _closed(channel: Channel) -> None:
    """Close ``channel`` and let its transport close its socket (the loop's next turns)."""
    channel.close()
    for _ in range(2):
        await asyncio.sleep(0)


class _LoopThread:
    """An asyncio event loop run by a daemon thread.

    The client's calls go to it from any thread (the node loop, a signal's thread) and wait
    for their result.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="rlenergy-podresources", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """The coroutine's result, run on the loop.

        Raises:
            whatever the coroutine raises; TimeoutError: no result in ``timeout_s``.
        """
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()


class PodResourcesClient:
    """Lists GPU allocations from the kubelet; satisfies ``pod_types.PodMap`` (cached).

    What a real kubelet needs (docs/agent.md, "Pod map"):

    * replies up to ``MAX_RECEIVE_BYTES`` (a 4 MiB limit, ``grpcio``'s client default, fails
      every ``List`` on a node with many pods, RESOURCE_EXHAUSTED);
    * one channel, made again after a failed call and whenever the socket file was replaced
      (another inode: the kubelet restarted), so a restarted kubelet answers at the next pass
      instead of after a reconnect backoff;
    * a missing socket is waited for (listed again every pass), never taken as "no pods";
    * a listing's age decides what it may do (``state``): younger than ``hold_after_s`` it
      attributes GPUs; older, the agent holds the locks it has and attributes nothing new;
      older than ``reset_after_s`` it resets the locks it can no longer attribute.

    PodResources names pods without their UID; the caller's UID is checked against the API's
    current pod of that name when its token is reviewed (``identity``), so the listing's
    ``PodRef`` carries no UID.

    Devices of a pod's ResourceClaims (``dynamic_resources``) count when ``dra_resolver`` maps
    them to a GPU or MIG UUID (``rlenergy_agent.dra``); without one they are ignored.

    Args:
        socket_path: the kubelet pod-resources socket.
        resources: resource names counted as GPUs.
        max_age_s: how long a listing is reused, s.
        timeout_s: per call deadline, s.
        hold_after_s: listing age past which nothing new is attributed, s.
        reset_after_s: listing age past which locks that cannot be attributed are reset, s.
        max_receive_bytes: largest reply taken, bytes.
        clock: monotonic time, s.
        dra_resolver: maps DRA devices to GPU or MIG UUIDs (None: DRA devices are not counted).
    """

    def __init__(
        self,
        socket_path: str,
        *,
        resources: Sequence[str] = GPU_RESOURCES,
        dra_resolver: dra.DraResolver | None = None,
        max_age_s: float = 2.0,
        timeout_s: float = 5.0,
        hold_after_s: float = HOLD_AFTER_S,
        reset_after_s: float = RESET_AFTER_S,
        max_receive_bytes: int = MAX_RECEIVE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path
        self.max_receive_bytes = max_receive_bytes
        self._resources = tuple(resources)
        self.dra = dra_resolver
        self._max_age_s = max_age_s
        self._timeout_s = timeout_s
        self.hold_after_s = hold_after_s
        self.reset_after_s = max(reset_after_s, hold_after_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._call_lock = threading.Lock()
        self._loop: _LoopThread | None = None
        self._channel: Channel | None = None
        self._list: UnaryUnaryMethod[Any, Any] | None = None
        self._inode: int | None = None
        self._cache: dict[pod_types.PodRef, tuple[str, ...]] = {}
        self._at: float | None = None
        self._tried_at = -1e18
        self._rechecked_at = -1e18
        self.listings = 0
        """Successful ``List`` calls (each a new listing)."""
        self.channels = 0
        """Channels made (the first, then one after each error or socket replacement)."""
        self.errors: dict[str, int] = {}
        """Failed ``List`` calls by gRPC status code name (``SocketMissing``: no socket file;
        ``UNAVAILABLE``: also a connection refused or lost)."""
        self.last_error = ""
        """The newest failure's code name, ``""`` once a listing succeeded after it."""
        self.last_error_message = ""

    # ----- the channel ------------------------------------------------------------------------
    def _inode_now(self) -> int | None:
        try:
            st = os.stat(self.socket_path)
        except OSError:
            return None
        return st.st_ino if stat.S_ISSOCK(st.st_mode) else None

    def _drop_channel(self) -> None:
        if self._channel is not None and self._loop is not None:
            try:
                self._loop.run(_closed(self._channel), self._timeout_s)
            except (TimeoutError, OSError) as exc:  # the connection is dropped all the same
                log.debug("closing the pod-resources channel: %s", exc)
        self._channel = self._list = None
        self._inode = None

    async def _open(self) -> Channel:
        return Channel(path=self.socket_path, codec=_LimitedCodec(self.max_receive_bytes))

    def _connect(self, inode: int) -> UnaryUnaryMethod[Any, Any]:
        """The ``List`` method on the channel to the socket with ``inode`` (made when new)."""
        if self._channel is not None and self._inode != inode:
            log.info("kubelet pod-resources socket %s was replaced: new channel", self.socket_path)
            self._drop_channel()
        if self._loop is None:
            self._loop = _LoopThread()
        if self._channel is None or self._list is None:
            self._channel = self._loop.run(self._open(), self._timeout_s)
            self._list = UnaryUnaryMethod(self._channel, LIST_METHOD, ListRequest, ListResponse)
            self._inode = inode
            self.channels += 1
        return self._list

    def _call(self, method: UnaryUnaryMethod[Any, Any]) -> Any:
        """One ``List`` call, its failures as ``ListError``."""
        assert self._loop is not None
        try:
            call = method(ListRequest(), timeout=self._timeout_s)
            return self._loop.run(call, self._timeout_s + 1)
        except GRPCError as exc:
            raise ListError(exc.status.name, str(exc.message or "")) from exc
        except TimeoutError as exc:
            raise ListError("DEADLINE_EXCEEDED", f"no answer in {self._timeout_s} s") from exc
        except (StreamTerminatedError, OSError) as exc:
            raise ListError("UNAVAILABLE", str(exc) or type(exc).__name__) from exc

    def _failed(self, code: str, message: str) -> None:
        with self._lock:
            self.errors[code] = self.errors.get(code, 0) + 1
            if code != self.last_error:
                log.warning(
                    "kubelet pod-resources List failed (%s): %s; holding the last listing",
                    code,
                    message,
                )
            self.last_error, self.last_error_message = code, message

    # ----- listing ----------------------------------------------------------------------------
    def refresh(self) -> dict[pod_types.PodRef, tuple[str, ...]]:
        """List allocations now.

        A pod listed twice under one name (the kubelet lists a finished pod next to its
        successor) keeps the devices of both entries.

        Raises:
            ListError: the kubelet did not answer (the channel is made again next time).
            FileNotFoundError: the socket does not exist (yet).
        """
        with self._call_lock:
            self._tried_at = self._clock()
            inode = self._inode_now()
            if inode is None:
                self._drop_channel()
                self._failed("SocketMissing", f"no socket at {self.socket_path}")
                raise FileNotFoundError(f"no kubelet pod-resources socket at {self.socket_path}")
            try:
                resp = self._call(self._connect(inode))
            except ListError as exc:
                self._drop_channel()  # a fresh channel next time: no reconnect backoff
                self._failed(exc.code, exc.details)
                raise
        out = self._allocations(resp)
        with self._lock:
            self._cache = out
            self._at = self._clock()
            self.listings += 1
            if self.last_error:
                log.info("kubelet pod-resources listing works again (was %s)", self.last_error)
            self.last_error = self.last_error_message = ""
        return out

    def _allocations(self, resp: Any) -> dict[pod_types.PodRef, tuple[str, ...]]:
        """``{pod: device IDs}`` of a ``List`` reply: device-plugin IDs, then mapped DRA ones."""
        listed: list[tuple[pod_types.PodRef, list[str], list[dra.DraDevice]]] = []
        for pod in resp.pod_resources:
            devices: list[str] = []
            claimed: list[dra.DraDevice] = []
            for c in pod.containers:
                for d in c.devices:
                    if d.resource_name in self._resources or d.resource_name.startswith(
                        "nvidia.com/mig-"
                    ):
                        devices.extend(str(x) for x in d.device_ids)
                for dr in c.dynamic_resources:
                    claimed.extend(
                        dra.DraDevice(str(r.driver_name), str(r.pool_name), str(r.device_name))
                        for r in dr.claim_resources
                    )
            listed.append((pod_types.PodRef(str(pod.namespace), str(pod.name)), devices, claimed))
        every_claimed = list(dict.fromkeys(d for _, _, cl in listed for d in cl))
        mapped = self.dra.resolve(every_claimed) if self.dra is not None and every_claimed else {}
        out: dict[pod_types.PodRef, tuple[str, ...]] = {}
        for ref, devices, claimed in listed:
            devices.extend(mapped[d] for d in claimed if d in mapped)
            if devices:
                out[ref] = tuple(dict.fromkeys((*out.get(ref, ()), *devices)))
        return out

    def state(self) -> pod_types.ListingState:
        """What the current listing may be used for (its age against the two bounds)."""
        with self._lock:
            age = None if self._at is None else max(self._clock() - self._at, 0.0)
            error, message = self.last_error, self.last_error_message
        if age is None:
            status = "Waiting"
        elif age <= self.hold_after_s:
            status = "Fresh"
        elif age <= self.reset_after_s:
            status = "Stale"
        else:
            status = "Expired"
        return pod_types.ListingState(status, age, error, message)  # type: ignore[arg-type]

    def pods(self) -> Mapping[pod_types.PodRef, tuple[str, ...]]:
        """Allocations, listed again when older than ``max_age_s`` (held on kubelet errors).

        The node loop keeps the listing younger than that (``keep_fresh``), so a signal's
        thread normally only reads the cache; a failed call is not repeated before
        ``max_age_s``.
        """
        if self._clock() - self._tried_at > self._max_age_s:
            self._try_refresh()
        with self._lock:
            return dict(self._cache)

    def _try_refresh(self) -> None:
        try:
            self.refresh()
        except (ListError, FileNotFoundError):
            pass  # counted and logged in ``_failed``

    def keep_fresh(self) -> None:
        """List now: the node loop, every pass (``pods.ListedPodMap``)."""
        self._try_refresh()

    def recheck(self) -> None:
        """List now for a caller the listing does not know (at most every ``RECHECK_S``)."""
        now = self._clock()
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
        """Close the channel and stop its loop's thread."""
        with self._call_lock:
            self._drop_channel()
            if self._loop is not None:
                self._loop.stop()
                self._loop = None


Listing = Callable[[], Mapping[tuple[str, str], Mapping[str, Sequence[str]]]]
"""``{(namespace, name): {resource_name: [device IDs]}}`` per call; a list of such pairs
instead of a mapping lists a name twice (the kubelet lists a finished pod next to its
successor)."""


def serve_fake_kubelet(
    socket_path: str,
    allocations: Callable[[], Any],
    *,
    fail: Callable[[], tuple[Any, str] | None] | None = None,
) -> Any:
    """A kubelet PodResources server speaking the real protocol (tests, local runs).

    It is ``grpcio``'s server (a development dependency; the agent process never imports it).

    Args:
        socket_path: Unix socket to listen on.
        allocations: returns ``{(namespace, name): {resource_name: [device IDs]}}`` per call,
            or a sequence of ``((namespace, name), {resource_name: [device IDs]})`` pairs; the
            resource :data:`DYNAMIC` lists DRA devices ``driver/pool/device`` (one claim each).
        fail: per call, ``(grpc.StatusCode, details)`` to answer with instead of a listing
            (a kubelet under load answers UNAVAILABLE), or ``None``.

    Returns:
        The started server (``stop(None)`` to end it).
    """
    from concurrent import futures

    import grpc  # type: ignore[import-untyped]

    pod_cls = message_class("PodResources")

    def list_pods(request: Any, context: Any) -> Any:
        failure = fail() if fail is not None else None
        if failure is not None:
            context.abort(failure[0], failure[1])
        resp = ListResponse()
        listed = allocations()
        pairs = listed.items() if isinstance(listed, Mapping) else listed
        for (ns, name), resources in pairs:
            pod = pod_cls(name=name, namespace=ns)
            c = pod.containers.add(name="main")
            for resource, ids in resources.items():
                if resource != DYNAMIC:
                    c.devices.add(resource_name=resource, device_ids=list(ids))
                    continue
                for i, triple in enumerate(ids):
                    driver, pool, device = str(triple).split("/", 2)
                    claim = c.dynamic_resources.add(claim_name=f"claim-{i}", claim_namespace=ns)
                    r = claim.claim_resources.add(
                        driver_name=driver, pool_name=pool, device_name=device
                    )
                    r.cdi_devices.add(name=f"{driver}/test={device}")
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
