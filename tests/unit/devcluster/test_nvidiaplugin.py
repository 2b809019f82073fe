"""How the real node starts NVIDIA's device plugin and reads what it and the kubelet did.

The plugin itself runs in tests/integration/agent/test_nvidia_device_plugin.py (fake kubelet)
and tests/e2e/test_real_node*.py (the real kubelet).

We test these aspects:
* its command line: a private mount namespace with ``/var/run/cdi`` bound to the node's folder
  (and the device-plugin folder only when it is not the kubelet's), ``cdi-cri``, the driver root;
* allocations come from the kubelet's checkpoint, once per container, in order, ``nvidia.com/gpu``
  only, whatever the NUMA grouping of the device IDs;
* registrations are counted from the plugin's log;
* the stand-in driver root: versioned libraries with their ``.so.1`` links and a character device
  195:minor per GPU plus ``nvidiactl`` (root only).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from rlenergy_dev.devcluster import nvidiaplugin


def _plugin(
    tmp_path: Path, plugin_dir: Path = nvidiaplugin.PLUGIN_DIR
) -> nvidiaplugin.NvidiaDevicePlugin:
    return nvidiaplugin.NvidiaDevicePlugin(
        Path("/bin/nvidia-device-plugin"),
        tmp_path / "work",
        nvml_lib=tmp_path / "libnvidia-ml.so.1",
        cuda_lib=tmp_path / "libcuda.so.1",
        state=tmp_path / "nvml.state",
        n_gpus=2,
        driver_version="550.54.15",
        plugin_dir=plugin_dir,
    )


def test_command_line(tmp_path: Path) -> None:
    argv = _plugin(tmp_path).argv()
    assert argv[:5] == ["unshare", "--mount", "--propagation", "private", "/bin/sh"]
    script = argv[6]
    assert f'mount --bind "{tmp_path / "work" / "cdi"}" "/var/run/cdi"' in script
    assert "/var/lib/kubelet/device-plugins" not in script  # the kubelet's own folder
    assert argv[7] == "/bin/nvidia-device-plugin"
    assert "--device-list-strategy=cdi-cri" in argv
    assert f"--driver-root-ctr-path={tmp_path / 'work' / 'driver-root'}" in argv
    assert "--kubelet-socket=/var/lib/kubelet/device-plugins/kubelet.sock" in argv
    fake = _plugin(tmp_path, tmp_path / "dp").argv()[6]
    assert f'mount --bind "{tmp_path / "dp"}" "/var/lib/kubelet/device-plugins"' in fake


def _checkpoint(plugin_dir: Path, entries: list[dict[str, object]]) -> None:
    data = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1}
    (plugin_dir / nvidiaplugin.CHECKPOINT).write_text(json.dumps(data))


def test_allocations_from_the_kubelet_checkpoint(tmp_path: Path) -> None:
    plugin = _plugin(tmp_path, tmp_path)
    assert plugin.allocations == []  # no checkpoint yet
    gpu = "nvidia.com/gpu"
    first = {
        "PodUID": "p1",
        "ContainerName": "c",
        "ResourceName": gpu,
        "DeviceIDs": {"-1": ["A", "B"]},
    }
    _checkpoint(tmp_path, [first])
    assert plugin.allocations == [("A", "B")]
    other = {
        "PodUID": "p2",
        "ContainerName": "c",
        "ResourceName": "x.com/y",
        "DeviceIDs": {"-1": ["Y"]},
    }
    numa = {
        "PodUID": "p3",
        "ContainerName": "c",
        "ResourceName": gpu,
        "DeviceIDs": {"0": ["C"], "1": ["D"]},
    }
    _checkpoint(tmp_path, [first, other, numa])
    assert plugin.allocations == [("A", "B"), ("C", "D")]
    again = {
        "PodUID": "p4",
        "ContainerName": "c",
        "ResourceName": gpu,
        "DeviceIDs": {"-1": ["A", "B"]},
    }
    _checkpoint(tmp_path, [again])  # a re-created pod with the same GPUs: a new allocation
    assert plugin.allocations == [("A", "B"), ("C", "D"), ("A", "B")]
    (tmp_path / nvidiaplugin.CHECKPOINT).write_text("{half")  # mid-write: nothing lost
    assert len(plugin.allocations) == 3


def test_registrations_from_the_log(tmp_path: Path) -> None:
    plugin = _plugin(tmp_path)
    assert plugin.registrations == 0
    plugin.log.parent.mkdir(parents=True)
    line = f"I1207 server.go:146] {nvidiaplugin.REGISTERED}\n"
    plugin.log.write_text(line + "I1207 main.go:268] Failed to start one or more plugins\n" + line)
    assert plugin.registrations == 2


def test_driver_root(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("mknod of a character device needs root: run the tests as root", pytrace=False)
    nvml, cuda = tmp_path / "libnvidia-ml.so.1", tmp_path / "libcuda.so.1"
    nvml.write_bytes(b"nvml")
    cuda.write_bytes(b"cuda")
    root = nvidiaplugin.build_driver_root(tmp_path / "root", nvml, cuda, "550.54.15", 2)
    lib = root / nvidiaplugin.LIB_DIR
    assert (lib / "libnvidia-ml.so.550.54.15").read_bytes() == b"nvml"
    assert os.readlink(lib / "libnvidia-ml.so.1") == "libnvidia-ml.so.550.54.15"
    assert os.readlink(lib / "libcuda.so.1") == "libcuda.so.550.54.15"
    for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)):
        st = (root / "dev" / name).stat()
        assert stat.S_ISCHR(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, minor)
    assert sorted(p.name for p in (root / "dev").iterdir()) == ["nvidia0", "nvidia1", "nvidiactl"]
    nvidiaplugin.build_driver_root(root, nvml, cuda, "550.54.15", 1)  # replaced, not merged
    assert sorted(p.name for p in (root / "dev").iterdir()) == ["nvidia0", "nvidiactl"]
