"""The stand-in library enumerates a container's GPUs only, as the driver does.

NVML in a container sees the GPUs whose device nodes the container has; the stand-in GPUs' CDI
devices give it ``RLENERGY_NVML_STANDIN_GPU_<n>=<uuid>`` instead
(rlenergy/devcluster/realnode.py ``cdi_spec``). Checked through the real pynvml
(``rlenergy_agent.nvml.lib``) on the stand-in."""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_support import DriverFactory
from rlenergy_agent.nvml import lib
from rlenergy_dev import podtrainer, standin
from rlenergy_dev.devcluster import realnode


def _visible() -> list[str]:
    return [lib.uuid(lib.handle_by_index(i)) for i in range(lib.device_count())]


def test_every_gpu_without_a_visibility_variable(make_driver: DriverFactory) -> None:
    drv = make_driver(4)
    lib.init()
    assert _visible() == list(drv.uuids)


def test_only_the_gpus_the_cdi_devices_name(
    make_driver: DriverFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    drv = make_driver(4)
    u = list(drv.uuids)
    # The env the CDI devices nvidia.com/gpu=<u[3]> and =<u[1]> put into the container.
    for index in (3, 1):
        monkeypatch.setenv(f"{standin.VISIBLE_ENV_PREFIX}{index}", u[index])
    lib.init()
    assert lib.device_count() == 2
    assert _visible() == [u[1], u[3]]  # NVML index order is the state file's (PCI) order
    assert lib.uuid(lib.handle_by_uuid(u[3])) == u[3]
    with pytest.raises(lib.NvmlCallError) as err:
        lib.handle_by_uuid(u[0])  # another container's GPU
    assert err.value.code == lib.ERROR_NOT_FOUND
    with pytest.raises(lib.NvmlCallError) as err:
        lib.handle_by_index(2)
    assert err.value.code == lib.ERROR_INVALID_ARGUMENT


def test_the_cdi_spec_names_the_variable_the_library_reads() -> None:
    assert realnode.STANDIN_GPU_ENV_PREFIX == standin.VISIBLE_ENV_PREFIX
    spec = realnode.cdi_spec(Path("/l"), Path("/s/state"), ["GPU-x-0", "GPU-x-1"])
    env = {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]}
    assert env["GPU-x-1"] == [f"{standin.VISIBLE_ENV_PREFIX}1=GPU-x-1"]


def test_a_trainer_finds_its_gpus_by_env_or_by_nvml(
    make_driver: DriverFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    drv = make_driver(3)
    u = list(drv.uuids)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", f"{u[2]},{u[0]}")  # envvar strategy
    assert podtrainer.visible_gpus() == [u[2], u[0]]
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "void")  # the toolkit's CDI specs set it so
    monkeypatch.setenv(f"{standin.VISIBLE_ENV_PREFIX}1", u[1])  # cdi-cri: its CDI device only
    assert podtrainer.visible_gpus() == [u[1]]
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES")
    assert podtrainer.visible_gpus() == [u[1]]
    monkeypatch.setenv(standin.STATE_ENV, "/nonexistent")  # no driver: none, no exception
    assert podtrainer.visible_gpus() == []
