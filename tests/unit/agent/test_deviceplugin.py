"""The stand-in device plugin against a fake kubelet Registration service (the real kubelet:
tests/e2e/test_real_node.py): registration, ListAndWatch, Allocate, re-registration."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
import pytest
from rlenergy_dev import deviceplugin as dp
from rlenergy_dev import standin

from rlenergy.gpu import models

UUIDS = ("GPU-a-00", "GPU-a-01", "GPU-a-02")


class FakeKubelet:
    """The kubelet's Registration service on ``dir/kubelet.sock``."""

    def __init__(self, plugin_dir: Path) -> None:
        self.requests: list[Any] = []
        self.got = threading.Event()
        req_cls = dp.message_class("RegisterRequest")

        def register(request: Any, context: Any) -> Any:
            self.requests.append(request)
            self.got.set()
            return dp.message_class("Empty")()

        handler = grpc.method_handlers_generic_handler(
            "v1beta1.Registration",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    register,
                    request_deserializer=req_cls.FromString,
                    response_serializer=lambda m: m.SerializeToString(),
                )
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{plugin_dir / dp.KUBELET_SOCKET}")
        self.server.start()


def _stub(plugin: dp.StandinDevicePlugin, method: str, resp: str, *, stream: bool = False) -> Any:
    return dp.plugin_call(Path(plugin.socket), method, resp, stream=stream)


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    d = tmp_path / "dp"
    d.mkdir()
    return d


def test_registers_lists_and_allocates(plugin_dir: Path, tmp_path: Path) -> None:
    kubelet = FakeKubelet(plugin_dir)
    state = tmp_path / "state" / "nvml.state"
    with dp.StandinDevicePlugin(
        UUIDS, lib_dir=tmp_path / "lib", state_file=state, plugin_dir=plugin_dir
    ).start() as plugin:
        (req,) = kubelet.requests
        assert (req.version, req.endpoint, req.resource_name) == (
            "v1beta1",
            dp.SOCKET_NAME,
            "nvidia.com/gpu",
        )
        first = next(
            iter(
                _stub(plugin, "ListAndWatch", "ListAndWatchResponse", stream=True)(
                    dp.message_class("Empty")(), timeout=5
                )
            )
        )
        assert [(d.ID, d.health) for d in first.devices] == [(u, "Healthy") for u in UUIDS]
        alloc = dp.message_class("AllocateRequest")()
        alloc.container_requests.add(devices_ids=["GPU-a-02", "GPU-a-00"])
        resp = _stub(plugin, "Allocate", "AllocateResponse")(alloc, timeout=5)
        (c,) = resp.container_responses
        assert c.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-a-02,GPU-a-00"
        assert c.envs["LD_LIBRARY_PATH"] == dp.CONTAINER_LIB_DIR
        assert c.envs[standin.STATE_ENV] == f"{dp.CONTAINER_STATE_DIR}/nvml.state"
        assert {(m.container_path, m.host_path) for m in c.mounts} == {
            (dp.CONTAINER_LIB_DIR, str(tmp_path / "lib")),
            (dp.CONTAINER_STATE_DIR, str(state.parent)),
        }
        assert plugin.allocations == [("GPU-a-02", "GPU-a-00")]
        bad = dp.message_class("AllocateRequest")()
        bad.container_requests.add(devices_ids=["GPU-other"])
        with pytest.raises(grpc.RpcError) as err:
            _stub(plugin, "Allocate", "AllocateResponse")(bad, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not plugin.socket.exists()
    kubelet.server.stop(None)


def test_allocates_cdi_device_names_only_with_a_cdi_kind(plugin_dir: Path) -> None:
    FakeKubelet(plugin_dir)
    with dp.StandinDevicePlugin(
        UUIDS, plugin_dir=plugin_dir, cdi_kind="nvidia.com/gpu"
    ).start() as plugin:
        alloc = dp.message_class("AllocateRequest")()
        alloc.container_requests.add(devices_ids=["GPU-a-01"])
        alloc.container_requests.add(devices_ids=["GPU-a-02", "GPU-a-00"])
        resp = _stub(plugin, "Allocate", "AllocateResponse")(alloc, timeout=5)
        one, two = resp.container_responses
        assert [d.name for d in one.cdi_devices] == ["nvidia.com/gpu=GPU-a-01"]
        assert [d.name for d in two.cdi_devices] == [
            "nvidia.com/gpu=GPU-a-02",
            "nvidia.com/gpu=GPU-a-00",
        ]
        # As NVIDIA's plugin with only CDI strategies: the runtime does the rest.
        assert not (one.envs or one.mounts or one.devices or two.envs or two.mounts)
        assert plugin.allocations == [("GPU-a-01",), ("GPU-a-02", "GPU-a-00")]


def test_cdi_kind_excludes_mounts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="either cdi_kind or lib_dir"):
        dp.StandinDevicePlugin(UUIDS, lib_dir=tmp_path, cdi_kind="nvidia.com/gpu")


def test_serves_again_after_a_kubelet_restart(plugin_dir: Path) -> None:
    kubelet = FakeKubelet(plugin_dir)
    with dp.StandinDevicePlugin(UUIDS, plugin_dir=plugin_dir).start() as plugin:
        assert plugin.registrations == 1
        # A restarting kubelet removes the plugin sockets and re-creates its own.
        kubelet.server.stop(None)
        (plugin_dir / dp.KUBELET_SOCKET).unlink(missing_ok=True)
        plugin.socket.unlink()
        kubelet = FakeKubelet(plugin_dir)
        assert kubelet.got.wait(10), "the plugin did not register again"
        assert plugin.socket.exists()
        opts = _stub(plugin, "GetDevicePluginOptions", "DevicePluginOptions")(
            dp.message_class("Empty")(), timeout=5
        )
        assert not opts.pre_start_required
    kubelet.server.stop(None)


def test_read_uuids_of_a_state_file(tmp_path: Path) -> None:
    sku = models.get_sku("h100-sxm")
    with standin.StandinDriver(tmp_path / "s", [(u, sku) for u in UUIDS]):
        assert standin.read_uuids(tmp_path / "s") == UUIDS
    (tmp_path / "junk").write_bytes(b"\0" * 100_000)
    with pytest.raises(ValueError, match="not a stand-in state file"):
        standin.read_uuids(tmp_path / "junk")
