"""NVIDIA's k8s-device-plugin over the stand-in GPUs: ``nvidia.com/gpu`` as on a GPU Operator node.

The binary is NVIDIA's own (github.com/NVIDIA/k8s-device-plugin, built by
``hack/device-plugin-bin.sh``); it runs as a host process of the real node, with
``--device-list-strategy=cdi-cri`` as NVIDIA's GPU Operator (>= v25.10, CDI on) runs it. It finds
its NVML in a stand-in driver root (:func:`build_driver_root`): the stand-in
``libnvidia-ml.so.<driver version>`` and ``libcuda.so.<driver version>``
(dev/nvml_standin), and a ``/dev/nvidia<minor>`` character node per GPU (major 195, as the
NVIDIA kernel driver registers). Through the stand-in it enumerates the GPUs, registers
``nvidia.com/gpu`` with the kubelet, checks their health by NVML events (a GPU the driver marks
lost sends Xid 79 and turns unhealthy), answers ``GetPreferredAllocation`` from their PCIe
topology, and ``Allocate`` with the CDI device names ``k8s.device-plugin.nvidia.com/gpu=<uuid>``.

At start the plugin writes a CDI spec for those names, generated from the driver root by the
container toolkit's nvcdi library, into ``/var/run/cdi``. On a real node that spec mounts the
driver and device nodes; for the stand-in it cannot bring the stand-in's state file and visible-GPU
env (``rlenergy_dev.devcluster.realnode.cdi_spec``), so the plugin runs in a mount namespace of its
own where ``/var/run/cdi`` is a folder of the node's (:attr:`NvidiaDevicePlugin.generated_spec`),
and the node's spec for the same kind (``RealNode.write_cdi_spec``) is the one containerd applies.
Test code: tests/e2e/test_real_node*.py, tests/e2e/test_runbook.py,
tests/unit/agent/test_nvidia_device_plugin.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlenergy_dev.devcluster import process

RESOURCE = "nvidia.com/gpu"
CDI_KIND = "k8s.device-plugin.nvidia.com/gpu"
"""CDI kind of the plugin's ``Allocate`` answers (its vendor ``k8s.device-plugin.nvidia.com``,
class ``gpu``: k8s-device-plugin cmd/nvidia-device-plugin/plugin-manager.go)."""
PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
"""The kubelet's device-plugin folder (the plugin's socket path is fixed under it)."""
CDI_ROOT = Path("/var/run/cdi")
"""Where the plugin writes its generated spec (k8s-device-plugin internal/cdi ``cdiRoot``)."""
CHECKPOINT = "kubelet_internal_checkpoint"
"""The kubelet device manager's record of its allocations, in the device-plugin folder."""
REGISTERED = f"Registered device plugin for '{RESOURCE}' with Kubelet"
"""The line the plugin logs on each registration (k8s-device-plugin internal/plugin/server.go)."""
NVIDIA_MAJOR = 195
"""Character-device major of the NVIDIA kernel driver's ``/dev/nvidia*`` nodes."""
NVIDIACTL_MINOR = 255
"""Minor number of ``/dev/nvidiactl``."""
LIB_DIR = Path("usr/lib/x86_64-linux-gnu")
"""The driver's library folder inside a driver root (Debian's multiarch folder)."""


def build_driver_root(
    root: Path, nvml_lib: Path, cuda_lib: Path, driver_version: str, n_gpus: int
) -> Path:
    """Lay out a driver root for the stand-in GPUs, as a driver container leaves one.

    ``root/usr/lib/x86_64-linux-gnu`` gets ``libnvidia-ml.so.<driver_version>`` and
    ``libcuda.so.<driver_version>`` (copies of the stand-ins) with their ``.so.1`` links;
    ``root/dev`` gets ``nvidia<i>`` (char 195:i) for GPU i and ``nvidiactl`` (195:255). The nodes
    exist for the toolkit's discovery only: nothing opens them (no kernel driver serves them).

    Args:
        root: The folder (created; its previous content is replaced).
        nvml_lib: The stand-in ``libnvidia-ml.so.1`` (``standin.build_library``).
        cuda_lib: The stand-in ``libcuda.so.1`` (``standin.build_cuda_library``).
        driver_version: What the stand-in's ``nvmlSystemGetDriverVersion`` answers.
        n_gpus: GPUs in the state file (their minor numbers are 0 .. n_gpus - 1).

    Returns:
        ``root``.

    Raises:
        PermissionError: Not root (``mknod`` of a character device needs CAP_MKNOD).
    """
    if root.exists():
        shutil.rmtree(root)
    lib_dir = root / LIB_DIR
    lib_dir.mkdir(parents=True)
    for src, name in ((nvml_lib, "libnvidia-ml.so"), (cuda_lib, "libcuda.so")):
        shutil.copy2(src, lib_dir / f"{name}.{driver_version}")
        (lib_dir / f"{name}.1").symlink_to(f"{name}.{driver_version}")
    dev = root / "dev"
    dev.mkdir()
    nodes = [(f"nvidia{i}", i) for i in range(n_gpus)] + [("nvidiactl", NVIDIACTL_MINOR)]
    for name, minor in nodes:
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))
    return root


def _unshare_argv(binary: Path, cdi_dir: Path, plugin_dir: Path, args: Sequence[str]) -> list[str]:
    """The plugin's command line in a private mount namespace (``unshare``).

    There ``/var/run/cdi`` is ``cdi_dir`` and, when it is not the kubelet's, the device-plugin
    folder is ``plugin_dir``.
    """
    binds = [f'mount --bind "{cdi_dir}" "{CDI_ROOT}"']
    if plugin_dir != PLUGIN_DIR:
        binds.append(f'mount --bind "{plugin_dir}" "{PLUGIN_DIR}"')
    script = " && ".join([*binds, 'exec "$0" "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script,
            str(binary), *args]  # fmt: skip


class NvidiaDevicePlugin:
    """NVIDIA's device plugin as a host process over one stand-in state file.

    :attr:`allocations` and :attr:`registrations` are what the kubelet recorded and the plugin
    logged, so a test sees the same allocations the kubelet made (its checkpoint).

    Args:
        binary: ``nvidia-device-plugin`` (``hack/device-plugin-bin.sh``).
        work: A folder of the node's for the driver root, the generated spec and the log.
        nvml_lib: The stand-in ``libnvidia-ml.so.1``.
        cuda_lib: The stand-in ``libcuda.so.1``.
        state: The stand-in's state file.
        n_gpus: GPUs in the state file.
        driver_version: The state file's driver version.
        plugin_dir: The kubelet's device-plugin folder (another one only for tests with a fake
            kubelet; it is bound over :data:`PLUGIN_DIR` in the plugin's namespace).
    """

    def __init__(
        self,
        binary: Path,
        work: Path,
        *,
        nvml_lib: Path,
        cuda_lib: Path,
        state: Path,
        n_gpus: int,
        driver_version: str,
        plugin_dir: Path = PLUGIN_DIR,
    ) -> None:
        self.binary = binary
        self.work = work
        self.nvml_lib, self.cuda_lib, self.state = nvml_lib, cuda_lib, state
        self.n_gpus, self.driver_version = n_gpus, driver_version
        self.plugin_dir = plugin_dir
        self.log = work / "nvidia-device-plugin.log"
        self.cdi_dir = work / "cdi"
        self._popen: subprocess.Popen[bytes] | None = None
        self._record: process.ProcessRecord | None = None
        self._allocations: list[tuple[str, ...]] = []
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    @property
    def driver_root(self) -> Path:
        """The stand-in driver root (:func:`build_driver_root`)."""
        return self.work / "driver-root"

    @property
    def generated_spec(self) -> dict[str, Any] | None:
        """The CDI spec the plugin generated at its last start, or None before it wrote one."""
        path = self.cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json"
        try:
            spec: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return spec

    @property
    def registrations(self) -> int:
        """How often the plugin registered with a kubelet (once per kubelet start)."""
        try:
            return self.log.read_text(errors="replace").count(REGISTERED)
        except OSError:
            return 0

    @property
    def allocations(self) -> list[tuple[str, ...]]:
        """The GPU UUIDs of each container the kubelet allocated ``nvidia.com/gpu`` to.

        In the order the kubelet's checkpoint showed them (polled every 0.1 s).
        """
        self._poll()
        with self._lock:
            return list(self._allocations)

    def _poll(self) -> None:
        try:
            data = json.loads((self.plugin_dir / CHECKPOINT).read_text())["Data"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        with self._lock:
            self._record_entries(data.get("PodDeviceEntries") or [])

    def _record_entries(self, entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            if entry.get("ResourceName") != RESOURCE:
                continue
            key = (str(entry.get("PodUID")), str(entry.get("ContainerName")))
            if key in self._seen:
                continue
            ids = entry.get("DeviceIDs") or {}
            groups = ids.values() if isinstance(ids, dict) else [ids]
            self._seen.add(key)
            self._allocations.append(tuple(u for g in groups for u in g))

    def _poll_loop(self) -> None:
        while not self._stop.wait(0.1):
            with contextlib.suppress(Exception):  # a half-written checkpoint: next round
                self._poll()

    def argv(self) -> list[str]:
        """The plugin's command line (in its own mount namespace)."""
        args = [
            "--device-list-strategy=cdi-cri",
            "--device-id-strategy=uuid",
            f"--driver-root-ctr-path={self.driver_root}",
            "--driver-root=/",
            f"--kubelet-socket={PLUGIN_DIR / 'kubelet.sock'}",
            "--fail-on-init-error=true",
        ]
        return _unshare_argv(self.binary, self.cdi_dir, self.plugin_dir, args)

    def start(self, *, register_timeout_s: float = 60.0) -> NvidiaDevicePlugin:
        """Lay out the driver root, start the plugin, wait for its first registration.

        Raises:
            FileNotFoundError: The binary is missing (run ``make bins``).
            RuntimeError: The plugin exited or did not register within ``register_timeout_s``;
                the message ends with its log.
        """
        if not self.binary.is_file():
            raise FileNotFoundError(f"{self.binary} not found: run `make bins`")
        self.work.mkdir(parents=True, exist_ok=True)
        self.cdi_dir.mkdir(exist_ok=True)
        CDI_ROOT.mkdir(parents=True, exist_ok=True)
        build_driver_root(
            self.driver_root, self.nvml_lib, self.cuda_lib, self.driver_version, self.n_gpus
        )
        # Its NVML: dlopen'd from the driver root, and found by name on the library path for
        # the plugin's own NVML check (go-nvlib's info.HasNvml), as in NVIDIA's container.
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "LD_LIBRARY_PATH": str(self.driver_root / LIB_DIR),
            "RLENERGY_NVML_STANDIN_STATE": str(self.state),
        }
        self._popen, self._record = process.spawn(
            "nvidia-device-plugin", self.argv(), self.log, env=env
        )
        self._poller = threading.Thread(target=self._poll_loop, daemon=True)
        self._poller.start()
        try:
            process.wait_ready(
                "nvidia-device-plugin", self._popen, lambda: self.registrations >= 1,
                log=self.log, timeout_s=register_timeout_s, not_ready="did not register",
            )  # fmt: skip
        except RuntimeError:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        """Whether the plugin process runs."""
        return self._popen is not None and self._popen.poll() is None

    def stop(self) -> None:
        """Stop the plugin (SIGTERM, then SIGKILL after 10 s) and the checkpoint poller."""
        self._stop.set()
        if self._record is not None and self._popen is not None:
            process.terminate([self._record], {self._popen.pid: self._popen}, grace=10.0)
        self._record = None
        if self._poller is not None:
            self._poller.join(timeout=2)

    def __enter__(self) -> NvidiaDevicePlugin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
