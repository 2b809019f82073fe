"""Kubernetes' DRA test driver as a kubelet plugin of the real node: GPUs by ResourceClaim.

The binary is Kubernetes' own (``k8s.io/kubernetes/test/e2e/dra/test-driver``, built by
``hack/dra-driver-bin.sh`` from the module the kubelet is built from). Its ``kubelet-plugin``
subcommand runs as a host process next to the kubelet, as a DRA driver's DaemonSet pod runs on
a real node: it publishes one ResourceSlice (``resource.k8s.io/v1``) of driver
:data:`DRIVER` with the pool named after the node and ``--num-devices`` devices ``device-00``,
``device-01``... (no attributes), registers with the kubelet through the kubelet's plugin
registry (``<root-dir>/plugins_registry``, its socket under ``<root-dir>/plugins/<driver>``),
and, when the kubelet prepares a claim, writes a CDI spec for the claim's devices to
``--cdi-dir`` (:data:`CDI_ROOT`, one of containerd's spec folders) that containerd applies to
the pod's containers. The kubelet's PodResources then lists the devices under the container's
``dynamic_resources``.

The devices are the stand-in GPUs by NVML index (``device-<NN>`` is the GPU of index NN), the
mapping the agent makes with ``agent.draIndexDrivers: [test-driver.cdi.k8s.io]``: the test
driver publishes no ``uuid`` attribute. The same GPUs are also advertised by NVIDIA's device
plugin; the scheduler does not know they are the same, so a test that uses both keeps them
apart. Test code: tests/e2e/test_real_node_day_two.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from rlenergy_dev.devcluster import process

DRIVER = "test-driver.cdi.k8s.io"
"""The test driver's default ``--drivername`` (test/e2e/dra/test-driver/app/server.go)."""
CDI_ROOT = Path("/var/run/cdi")
"""Where it writes a prepared claim's CDI spec (its ``--cdi-dir`` default; containerd reads it)."""


def device_name(index: int) -> str:
    """The test driver's name of device ``index`` (``device-%02d``: app/server.go)."""
    return f"device-{index:02d}"


class DraTestDriver:
    """The DRA test driver's kubelet plugin as a host process of the real node.

    Args:
        binary: ``dra-test-driver`` (``hack/dra-driver-bin.sh``).
        work: A folder for its log.
        node_name: The node (its pool's name and the slice's ``nodeName``).
        kubelet_root: The kubelet's ``--root-dir`` (plugin registry and plugin sockets).
        kubeconfig: Credentials that may write ResourceSlices and read ResourceClaims.
        num_devices: Devices it publishes.
        cdi_dir: Where it writes CDI specs (one of containerd's ``cdi_spec_dirs``).
    """

    def __init__(
        self,
        binary: Path,
        work: Path,
        *,
        node_name: str,
        kubelet_root: Path,
        kubeconfig: Path,
        num_devices: int,
        cdi_dir: Path = CDI_ROOT,
    ) -> None:
        self.binary = binary
        self.work = work
        self.node_name = node_name
        self.kubelet_root = kubelet_root
        self.kubeconfig = kubeconfig
        self.num_devices = num_devices
        self.cdi_dir = cdi_dir
        self.log = work / "dra-test-driver.log"
        self._popen: subprocess.Popen[bytes] | None = None
        self._record: process.ProcessRecord | None = None

    @property
    def registration_socket(self) -> Path:
        """The socket the kubelet's plugin watcher finds (kubeletplugin: ``<driver>-reg.sock``)."""
        return self.kubelet_root / "plugins_registry" / f"{DRIVER}-reg.sock"

    def argv(self) -> list[str]:
        """Its command line."""
        return [
            str(self.binary),
            f"--kubeconfig={self.kubeconfig}",
            "kubelet-plugin",
            f"--node-name={self.node_name}",
            f"--num-devices={self.num_devices}",
            f"--cdi-dir={self.cdi_dir}",
            f"--plugin-registration-path={self.kubelet_root / 'plugins_registry'}",
            f"--datadir={self.kubelet_root / 'plugins'}",
        ]

    def start(self, *, timeout_s: float = 60.0) -> DraTestDriver:
        """Start it and wait for its registration socket.

        Raises:
            FileNotFoundError: The binary is missing (run ``make bins``).
            RuntimeError: It exited or made no registration socket within ``timeout_s``; the
                message ends with its log.
        """
        if not self.binary.is_file():
            raise FileNotFoundError(f"{self.binary} not found: run `make bins`")
        self.work.mkdir(parents=True, exist_ok=True)
        (self.kubelet_root / "plugins_registry").mkdir(parents=True, exist_ok=True)
        # Its socket folder: the driver makes only the folder above it (a DaemonSet mounts it).
        (self.kubelet_root / "plugins" / DRIVER).mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", os.defpath)}
        self._popen, self._record = process.spawn("dra-test-driver", self.argv(), self.log, env=env)
        try:
            process.wait_ready(
                "dra-test-driver", self._popen, self.registration_socket.exists,
                log=self.log, timeout_s=timeout_s, not_ready="made no registration socket",
            )  # fmt: skip
        except RuntimeError:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        """Whether the driver process runs."""
        return self._popen is not None and self._popen.poll() is None

    def stop(self) -> None:
        """Stop it (SIGTERM: it removes its sockets; SIGKILL after 10 s), remove its CDI specs."""
        if self._record is not None and self._popen is not None:
            process.terminate([self._record], {self._popen.pid: self._popen}, grace=10.0)
        self._record = None
        for spec in self.cdi_dir.glob(f"{DRIVER}-*.json"):
            with contextlib.suppress(OSError):
                spec.unlink()

    def __enter__(self) -> DraTestDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
