"""NVIDIA's k8s-device-plugin binary over the stand-in NVML, against a fake kubelet.

The binary is NVIDIA's (``hack/device-plugin-bin.sh``), started by
``rlenergy_dev.devcluster.nvidiaplugin`` as the real node starts it (tests/e2e/test_real_node.py runs it with the real kubelet). The
fake kubelet's folder is bound over the kubelet's device-plugin folder in the plugin's own mount
namespace, so nothing of the host's kubelet is touched. Needs root (mknod, mount namespaces).

We test these aspects:
* the plugin registers ``nvidia.com/gpu`` with preferred allocations, and lists the stand-in
  GPUs by UUID, healthy;
* its preferred pair is two GPUs under one PCIe switch (the stand-in's topology);
* ``Allocate`` answers CDI device names of kind ``k8s.device-plugin.nvidia.com/gpu`` only
  (``cdi-cri``), and the node's spec of that kind (``realnode.cdi_spec``) names every device the
  plugin's own generated spec names;
* a GPU the driver marks lost sends Xid 79 through NVML events and the plugin marks GPUs
  unhealthy in ``ListAndWatch``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
import pytest
from rlenergy_dev import deviceplugin as dp
from rlenergy_dev import standin
from rlenergy_dev.devcluster import nvidiaplugin, realnode
from rlenergy_dev.devcluster.binaries import default_bin_dir

from rlenergy.gpu import models

BINARY = default_bin_dir() / "nvidia-device-plugin"
UUIDS = [f"GPU-nvdp-{i:02d}" for i in range(4)]

pytestmark = pytest.mark.e2e  # it needs `make bins`'s plugin binary, as the e2e tests do


@pytest.fixture(autouse=True)
def _needs() -> None:
    """What the plugin's run needs here fails the test with the fix, never skips it."""
    if os.geteuid() != 0:
        pytest.fail("needs root (mknod, mount namespaces): run the tests as root", pytrace=False)
    if not BINARY.is_file():
        pytest.fail(f"{BINARY} missing: run `make bins`", pytrace=False)
    if shutil.which("unshare") is None:
        pytest.fail("util-linux unshare missing: `apt-get install util-linux`", pytrace=False)


class FakeKubelet:
    """The kubelet's Registration service on ``dir/kubelet.sock``."""

    def __init__(self, plugin_dir: Path) -> None:
        self.requests: list[Any] = []

        def register(request: Any, context: Any) -> Any:
            self.requests.append(request)
            return dp.message_class("Empty")()

        handler = grpc.method_handlers_generic_handler(
            "v1beta1.Registration",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    register,
                    request_deserializer=dp.message_class("RegisterRequest").FromString,
                    response_serializer=lambda m: m.SerializeToString(),
                )
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{plugin_dir / 'kubelet.sock'}")
        self.server.start()


def _call(plugin_dir: Path, method: str, resp: str, *, stream: bool = False) -> Any:
    return dp.plugin_call(plugin_dir / "nvidia-gpu.sock", method, resp, stream=stream)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="nvdp-", dir="/tmp"))  # unix sockets: short paths
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_nvidia_plugin_over_the_standin(short_dir: Path) -> None:
    nvml_dir = standin.build_library(short_dir / "nvml")
    cuda = standin.build_cuda_library(short_dir / "cuda")
    state = short_dir / "state" / "nvml.state"
    state.parent.mkdir()
    driver = standin.StandinDriver(state, [(u, models.get_sku("h100-sxm")) for u in UUIDS])
    plugin_dir = short_dir / "dp"
    plugin_dir.mkdir()
    nvidiaplugin.PLUGIN_DIR.mkdir(parents=True, exist_ok=True)  # the bind mount's target
    kubelet = FakeKubelet(plugin_dir)
    plugin = nvidiaplugin.NvidiaDevicePlugin(
        BINARY,
        short_dir / "work",
        nvml_lib=nvml_dir / "libnvidia-ml.so.1",
        cuda_lib=cuda,
        state=state,
        n_gpus=len(UUIDS),
        driver_version=driver.state.driver_version.decode(),
        plugin_dir=plugin_dir,
    )
    try:
        plugin.start(register_timeout_s=60)
        (req,) = kubelet.requests
        assert (req.version, req.endpoint, req.resource_name) == (
            "v1beta1", "nvidia-gpu.sock", "nvidia.com/gpu",
        )  # fmt: skip
        assert req.options.get_preferred_allocation_available
        empty = dp.message_class("Empty")()
        watch = iter(_call(plugin_dir, "ListAndWatch", "ListAndWatchResponse", stream=True)(
            empty, timeout=60
        ))  # fmt: skip
        first = next(watch)
        assert sorted((d.ID, d.health) for d in first.devices) == [(u, "Healthy") for u in UUIDS]

        pref = dp.message_class("PreferredAllocationRequest")()
        pref.container_requests.add(available_deviceIDs=UUIDS, allocation_size=2)
        (best,) = _call(plugin_dir, "GetPreferredAllocation", "PreferredAllocationResponse")(
            pref, timeout=10
        ).container_responses
        assert sorted(best.deviceIDs) in (UUIDS[0:2], UUIDS[2:4])  # one PCIe switch

        alloc = dp.message_class("AllocateRequest")()
        alloc.container_requests.add(devices_ids=[UUIDS[2], UUIDS[0]])
        (c,) = _call(plugin_dir, "Allocate", "AllocateResponse")(
            alloc, timeout=10
        ).container_responses
        names = [d.name for d in c.cdi_devices]
        assert sorted(names) == sorted(f"{nvidiaplugin.CDI_KIND}={u}" for u in (UUIDS[0], UUIDS[2]))
        assert not (c.mounts or c.devices)

        generated = plugin.generated_spec
        assert generated is not None and generated["kind"] == nvidiaplugin.CDI_KIND
        ours = realnode.cdi_spec(Path("/l"), state, UUIDS, realnode.DEVICE_PLUGIN_CDI_KIND)
        assert ours["kind"] == realnode.DEVICE_PLUGIN_CDI_KIND == nvidiaplugin.CDI_KIND
        assert {d["name"] for d in generated["devices"]} <= {d["name"] for d in ours["devices"]}

        # A lost GPU: Xid 79 reaches the plugin's health check. The stand-in answers every call
        # on a lost GPU GPU_IS_LOST, the event's UUID too, so the plugin takes its fallback for
        # an event it cannot place (internal/rm/health.go): every GPU turns unhealthy.
        driver.lose(UUIDS[3])
        health: dict[str, str] = {}
        while set(health.values()) != {"Unhealthy"}:
            health = {d.ID: d.health for d in next(watch).devices}
        assert sorted(health) == UUIDS
        assert plugin.alive() and plugin.registrations == 1
    finally:
        plugin.stop()
        kubelet.server.stop(None)
        driver.close()
    assert not plugin.alive()
