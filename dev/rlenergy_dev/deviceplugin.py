"""A kubelet device plugin for the stand-in GPUs: ``nvidia.com/gpu`` the kubelet really allocates.

Speaks the kubelet device-plugin API v1beta1 (``k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/
api.proto``) over gRPC (grpcio): it serves ``DevicePlugin`` on a Unix socket in the kubelet's
device-plugin folder and registers ``nvidia.com/gpu`` with the kubelet's ``Registration``
service. The devices are the stand-in GPUs of a state file (``standin.StandinDriver``): their
IDs are the GPUs' UUIDs, so the kubelet's PodResources API reports a pod's GPUs by the same IDs
that NVML gives the agent (as NVIDIA's device plugin does with real GPUs).

``Allocate`` answers like NVIDIA's plugin, in one of two ways. With ``cdi_kind`` (NVIDIA's
``--device-list-strategy=cdi-cri``): only the CDI device names ``<kind>=<uuid>`` of the
allocated GPUs, which the container runtime (containerd >= 1.7) resolves through the CDI spec
of the stand-in GPUs (``rlenergy_dev.devcluster.realnode.cdi_spec``) into the library and state
mounts. Without (the ``envvar`` strategy with the toolkit's part done by the plugin): the env
``NVIDIA_VISIBLE_DEVICES`` lists the allocated UUIDs and the stand-in ``libnvidia-ml.so.1``
(read-only) and its state folder are mounted into the container (``LD_LIBRARY_PATH`` and
``RLENERGY_NVML_STANDIN_STATE`` point at them). Either way a trainer sees its GPUs through the
real pynvml.

The message and service descriptors are built at run time with protobuf's descriptor API, as
``rlenergy_agent.podmap`` does for PodResources: no generated code. The plugin re-registers when
the kubelet's socket is re-created (a kubelet restart). Test code: the real-node end-to-end
test (tests/e2e/test_real_node.py) and ``python -m rlenergy_dev.deviceplugin``.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)
from rlenergy_agent import podmap

log = logging.getLogger(__name__)

VERSION = "v1beta1"
RESOURCE = "nvidia.com/gpu"
PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
"""The kubelet's device-plugin folder (fixed in the kubelet: DevicePluginPath)."""
KUBELET_SOCKET = "kubelet.sock"
SOCKET_NAME = "rlenergy-standin-gpu.sock"
HEALTHY = "Healthy"
CONTAINER_LIB_DIR = "/usr/local/rlenergy-standin/lib"
"""Where the stand-in library appears in an allocated container (the toolkit's role)."""
CONTAINER_STATE_DIR = "/usr/local/rlenergy-standin/state"

_T = descriptor_pb2.FieldDescriptorProto


def _file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(
        name="rlenergy/deviceplugin_v1beta1.proto", package=VERSION
    )
    f.syntax = "proto3"
    opt, rep = _T.LABEL_OPTIONAL, _T.LABEL_REPEATED
    S, B, I32, I64, M = _T.TYPE_STRING, _T.TYPE_BOOL, _T.TYPE_INT32, _T.TYPE_INT64, _T.TYPE_MESSAGE

    def msg(name: str, *fields: tuple[str, int, int, int, str]) -> descriptor_pb2.DescriptorProto:
        return podmap.add_message(f, name, *fields)

    def string_map(m: descriptor_pb2.DescriptorProto, fname: str, number: int) -> None:
        entry = fname.capitalize() + "Entry"
        e = m.nested_type.add(name=entry)
        e.options.map_entry = True
        e.field.add(name="key", number=1, type=S, label=opt)
        e.field.add(name="value", number=2, type=S, label=opt)
        m.field.add(
            name=fname, number=number, type=M, label=rep, type_name=f".{VERSION}.{m.name}.{entry}"
        )

    p = f".{VERSION}."
    msg(
        "DevicePluginOptions",
        ("pre_start_required", 1, B, opt, ""),
        ("get_preferred_allocation_available", 2, B, opt, ""),
    )
    msg(
        "RegisterRequest",
        ("version", 1, S, opt, ""),
        ("endpoint", 2, S, opt, ""),
        ("resource_name", 3, S, opt, ""),
        ("options", 4, M, opt, p + "DevicePluginOptions"),
    )
    msg("Empty")
    msg("ListAndWatchResponse", ("devices", 1, M, rep, p + "Device"))
    msg("TopologyInfo", ("nodes", 1, M, rep, p + "NUMANode"))
    msg("NUMANode", ("ID", 1, I64, opt, ""))
    msg(
        "Device",
        ("ID", 1, S, opt, ""),
        ("health", 2, S, opt, ""),
        ("topology", 3, M, opt, p + "TopologyInfo"),
    )
    msg("PreStartContainerRequest", ("devices_ids", 1, S, rep, ""))
    msg("PreStartContainerResponse")
    msg(
        "PreferredAllocationRequest",
        ("container_requests", 1, M, rep, p + "ContainerPreferredAllocationRequest"),
    )
    msg(
        "ContainerPreferredAllocationRequest",
        ("available_deviceIDs", 1, S, rep, ""),
        ("must_include_deviceIDs", 2, S, rep, ""),
        ("allocation_size", 3, I32, opt, ""),
    )
    msg(
        "PreferredAllocationResponse",
        ("container_responses", 1, M, rep, p + "ContainerPreferredAllocationResponse"),
    )
    msg("ContainerPreferredAllocationResponse", ("deviceIDs", 1, S, rep, ""))
    msg("AllocateRequest", ("container_requests", 1, M, rep, p + "ContainerAllocateRequest"))
    msg("ContainerAllocateRequest", ("devices_ids", 1, S, rep, ""))
    msg("CDIDevice", ("name", 1, S, opt, ""))
    msg("AllocateResponse", ("container_responses", 1, M, rep, p + "ContainerAllocateResponse"))
    car = msg(
        "ContainerAllocateResponse",
        ("mounts", 2, M, rep, p + "Mount"),
        ("devices", 3, M, rep, p + "DeviceSpec"),
        ("cdi_devices", 5, M, rep, p + "CDIDevice"),
    )
    string_map(car, "envs", 1)
    string_map(car, "annotations", 4)
    msg(
        "Mount",
        ("container_path", 1, S, opt, ""),
        ("host_path", 2, S, opt, ""),
        ("read_only", 3, B, opt, ""),
    )
    msg(
        "DeviceSpec",
        ("container_path", 1, S, opt, ""),
        ("host_path", 2, S, opt, ""),
        ("permissions", 3, S, opt, ""),
    )
    reg = f.service.add(name="Registration")
    reg.method.add(name="Register", input_type=p + "RegisterRequest", output_type=p + "Empty")
    dp = f.service.add(name="DevicePlugin")
    for name, inp, out, stream in (
        ("GetDevicePluginOptions", "Empty", "DevicePluginOptions", False),
        ("ListAndWatch", "Empty", "ListAndWatchResponse", True),
        (
            "GetPreferredAllocation",
            "PreferredAllocationRequest",
            "PreferredAllocationResponse",
            False,
        ),
        ("Allocate", "AllocateRequest", "AllocateResponse", False),
        ("PreStartContainer", "PreStartContainerRequest", "PreStartContainerResponse", False),
    ):
        dp.method.add(name=name, input_type=p + inp, output_type=p + out, server_streaming=stream)
    return f


_pool = descriptor_pool.DescriptorPool()
_pool.Add(_file())


def message_class(name: str) -> Any:
    """The runtime message class ``v1beta1.<name>``."""
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{VERSION}.{name}"))


def plugin_call(socket: Path, method: str, resp: str, *, stream: bool = False) -> Any:
    """A client callable of ``v1beta1.DevicePlugin/<method>`` on the plugin socket ``socket``.

    It answers ``v1beta1.<resp>`` messages (a stream of them with ``stream``), as the kubelet
    calls a device plugin.
    """
    channel = grpc.insecure_channel(f"unix://{socket}")
    kind = channel.unary_stream if stream else channel.unary_unary
    return kind(
        f"/{VERSION}.DevicePlugin/{method}",
        request_serializer=_ser,
        response_deserializer=message_class(resp).FromString,
    )


def _ser(m: Any) -> bytes:
    return bytes(m.SerializeToString())


class StandinDevicePlugin:
    """Serves the stand-in GPUs as ``nvidia.com/gpu`` and keeps them registered.

    Args:
        uuids: Device IDs to advertise (the stand-in GPUs' UUIDs).
        lib_dir: Host folder of the stand-in ``libnvidia-ml.so.1`` (mounted into allocated
            containers); None: no mounts, only ``NVIDIA_VISIBLE_DEVICES``.
        state_file: Host path of the stand-in's state file (its folder is mounted).
        plugin_dir: The kubelet's device-plugin folder.
        cdi_kind: CDI kind of the devices (``nvidia.com/gpu``): ``Allocate`` answers with CDI
            device names only (no env, no mounts), as NVIDIA's plugin does with
            ``--device-list-strategy=cdi-cri``.

    Raises:
        ValueError: No device, or ``cdi_kind`` together with ``lib_dir``/``state_file``.
    """

    def __init__(
        self,
        uuids: Sequence[str],
        *,
        lib_dir: Path | None = None,
        state_file: Path | None = None,
        plugin_dir: Path = PLUGIN_DIR,
        cdi_kind: str | None = None,
    ) -> None:
        if not uuids:
            raise ValueError("a device plugin needs at least one device")
        if cdi_kind is not None and (lib_dir is not None or state_file is not None):
            raise ValueError(
                "cdi_kind answers with CDI device names only: the CDI spec mounts the library "
                "and state; pass either cdi_kind or lib_dir/state_file"
            )
        self.cdi_kind = cdi_kind
        self.uuids = tuple(uuids)
        self.lib_dir = lib_dir
        self.state_file = state_file
        self.plugin_dir = plugin_dir
        self.socket = plugin_dir / SOCKET_NAME
        self.allocations: list[tuple[str, ...]] = []
        """Device IDs of every Allocate call, in order (tests read it)."""
        self.registrations = 0
        self._stop = threading.Event()
        self._server: Any = None
        self._watcher: threading.Thread | None = None
        self._m = {
            n: message_class(n)
            for n in (
                "Empty",
                "DevicePluginOptions",
                "RegisterRequest",
                "ListAndWatchResponse",
                "PreferredAllocationRequest",
                "PreferredAllocationResponse",
                "AllocateRequest",
                "AllocateResponse",
                "PreStartContainerRequest",
                "PreStartContainerResponse",
            )
        }

    # ------------------------------------------------------------------ DevicePlugin service
    def _options(self, request: Any, context: Any) -> Any:
        return self._m["DevicePluginOptions"](
            pre_start_required=False, get_preferred_allocation_available=False
        )

    def _list_and_watch(self, request: Any, context: Any) -> Iterator[Any]:
        resp = self._m["ListAndWatchResponse"]()
        for uuid in self.uuids:
            resp.devices.add(ID=uuid, health=HEALTHY)
        yield resp
        while not self._stop.wait(1.0) and context.is_active():
            pass  # the devices never change; the stream stays open until the kubelet leaves

    def _preferred(self, request: Any, context: Any) -> Any:
        resp = self._m["PreferredAllocationResponse"]()
        for req in request.container_requests:
            ids = list(req.must_include_deviceIDs)
            ids += [d for d in req.available_deviceIDs if d not in ids]
            resp.container_responses.add(deviceIDs=ids[: req.allocation_size])
        return resp

    def _allocate(self, request: Any, context: Any) -> Any:
        resp = self._m["AllocateResponse"]()
        for req in request.container_requests:
            ids = tuple(str(d) for d in req.devices_ids)
            unknown = [d for d in ids if d not in self.uuids]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown devices {unknown}")
            self.allocations.append(ids)
            c = resp.container_responses.add()
            if self.cdi_kind is not None:
                for d in ids:
                    c.cdi_devices.add(name=f"{self.cdi_kind}={d}")
                log.info("allocated %s (CDI)", ",".join(ids))
                continue
            c.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
            if self.lib_dir is not None and self.state_file is not None:
                c.mounts.add(
                    container_path=CONTAINER_LIB_DIR, host_path=str(self.lib_dir), read_only=True
                )
                # Read-write: the stand-in maps its state file shared (the driver's state).
                c.mounts.add(
                    container_path=CONTAINER_STATE_DIR,
                    host_path=str(self.state_file.parent),
                    read_only=False,
                )
                c.envs["LD_LIBRARY_PATH"] = CONTAINER_LIB_DIR
                c.envs["RLENERGY_NVML_STANDIN_STATE"] = (
                    f"{CONTAINER_STATE_DIR}/{self.state_file.name}"
                )
            log.info("allocated %s", ",".join(ids))
        return resp

    def _prestart(self, request: Any, context: Any) -> Any:
        return self._m["PreStartContainerResponse"]()

    # ------------------------------------------------------------------ lifecycle
    def _serve(self) -> None:
        m = self._m

        def unary(fn: Any, req: str) -> Any:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=m[req].FromString, response_serializer=_ser
            )

        handler = grpc.method_handlers_generic_handler(
            f"{VERSION}.DevicePlugin",
            {
                "GetDevicePluginOptions": unary(self._options, "Empty"),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self._list_and_watch,
                    request_deserializer=m["Empty"].FromString,
                    response_serializer=_ser,
                ),
                "GetPreferredAllocation": unary(self._preferred, "PreferredAllocationRequest"),
                "Allocate": unary(self._allocate, "AllocateRequest"),
                "PreStartContainer": unary(self._prestart, "PreStartContainerRequest"),
            },
        )
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def start(self, *, register_timeout_s: float = 60.0) -> StandinDevicePlugin:
        """Serve on ``plugin_dir/rlenergy-standin-gpu.sock`` and register with the kubelet.

        Raises:
            TimeoutError: The kubelet's registration socket did not accept the plugin in time.
        """
        self._serve()
        deadline = time.monotonic() + register_timeout_s
        while True:
            try:
                self._register()
                break
            except grpc.RpcError as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(
                        f"the kubelet did not accept the device plugin at "
                        f"{self.plugin_dir / KUBELET_SOCKET} in {register_timeout_s:.0f} s: {exc}"
                    ) from exc
                time.sleep(0.5)
        self._watcher = threading.Thread(target=self._watch, name="deviceplugin-watch", daemon=True)
        self._watcher.start()
        return self

    def _register(self) -> None:
        kubelet = self.plugin_dir / KUBELET_SOCKET
        with grpc.insecure_channel(f"unix://{kubelet}") as channel:
            register = channel.unary_unary(
                f"/{VERSION}.Registration/Register",
                request_serializer=_ser,
                response_deserializer=self._m["Empty"].FromString,
            )
            register(
                self._m["RegisterRequest"](
                    version=VERSION,
                    endpoint=SOCKET_NAME,
                    resource_name=RESOURCE,
                    options=self._m["DevicePluginOptions"](),
                ),
                timeout=5,
            )
        self.registrations += 1
        log.info("registered %s (%d devices) with %s", RESOURCE, len(self.uuids), kubelet)

    def _kubelet_socket_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.plugin_dir / KUBELET_SOCKET)
        except OSError:
            return None
        return (st.st_ino, st.st_ctime_ns)

    def _watch(self) -> None:
        """Serve and register again after a kubelet restart.

        A starting kubelet re-creates its socket and removes the plugins' sockets.
        """
        seen = self._kubelet_socket_id()
        while not self._stop.wait(1.0):
            now = self._kubelet_socket_id()
            if now is None or now == seen:
                continue
            try:
                if not self.socket.exists():
                    if self._server is not None:
                        self._server.stop(None)
                    self._serve()
                self._register()
                seen = now
            except grpc.RpcError as exc:
                log.warning("re-registration failed, retrying: %s", exc)

    def stop(self) -> None:
        """Stop serving and remove the socket."""
        self._stop.set()
        if self._server is not None:
            self._server.stop(None)
            self._server = None
        self.socket.unlink(missing_ok=True)

    def __enter__(self) -> StandinDevicePlugin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlenergy_dev.deviceplugin --state F [--lib-dir D | --cdi-kind K]``."""
    from rlenergy_dev import standin  # noqa: PLC0415 - only the CLI needs it

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--state", type=Path, required=True, help="stand-in state file")
    parser.add_argument("--lib-dir", type=Path, help="folder of the stand-in libnvidia-ml.so.1")
    parser.add_argument("--plugin-dir", type=Path, default=PLUGIN_DIR)
    parser.add_argument(
        "--cdi-kind",
        help="answer Allocate with CDI device names of this kind only (e.g. nvidia.com/gpu)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    uuids = standin.read_uuids(args.state)
    if args.cdi_kind:
        plugin = StandinDevicePlugin(
            uuids, plugin_dir=args.plugin_dir, cdi_kind=args.cdi_kind
        ).start()
    else:
        plugin = StandinDevicePlugin(
            uuids, lib_dir=args.lib_dir, state_file=args.state, plugin_dir=args.plugin_dir
        ).start()
    print(f"serving {len(uuids)} x {RESOURCE} on {plugin.socket}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        plugin.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
