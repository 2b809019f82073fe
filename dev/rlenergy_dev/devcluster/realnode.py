"""One real node for the dev cluster: containerd + runc + a kubelet built from k8s source.

``DevCluster.start(real_node=True)`` (``python -m rlenergy_dev.devcluster up --real-node``)
starts, next to the KWOK nodes, a containerd (Debian's package, its own root, state and socket
under the cluster's workdir) and a kubelet (built by ``hack/node-bins.sh`` from the same Kubernetes
version as the control plane) that registers the node ``realnode`` with InternalIP 127.0.0.1.
Pods there really run in containers: the operator and agent images are imported into
containerd's ``k8s.io`` namespace (:meth:`RealNode.import_image`), the pod sandbox image is a
locally built pause binary (hack/images/pause.c), and no registry is ever contacted.

Networking: there is no pod network. Only ``hostNetwork: true`` pods can run (their IP is the
node's, 127.0.0.1); the CNI configuration is a loopback-only network, so containerd reports
``NetworkReady`` and a pod that asks for its own network namespace gets no address and fails
to start, as it must here (nothing may dial a pod IP in a private range).

Settings chosen (docs/dev-cluster.md "Real node" says why): cgroup driver ``cgroupfs`` (this
host has no systemd), ``failCgroupV1: false`` (the host mounts cgroup v1 controllers with a v2
hierarchy beside it), no swap check, authentication by client certificates only, the Node
authorizer for the kubelet's own identity (``system:node:realnode``). The kubelet's
device-plugin folder is fixed by the kubelet (``/var/lib/kubelet/device-plugins``), so only one
real node can run per machine: a lock file says which process holds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from rlenergy_dev.devcluster import process
from rlenergy_dev.devcluster.errors import DevClusterError, MissingBinaryError

NAME = "realnode"
"""Name of the real node (``kubernetes.io/hostname``)."""
NAMESPACE = "k8s.io"
"""containerd namespace the CRI plugin uses (images must be imported there)."""
PAUSE_IMAGE = "rlenergy.local/pause:1"
"""Sandbox image; built by hack/node-bins.sh (hack/images/pause.py names it so)."""
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
"""Fixed by the kubelet (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 DevicePluginPath)."""
LOCK_FILE = Path("/run/rlenergy-realnode.lock")
CNI_BIN_DIR = Path("/usr/lib/cni")
"""Debian's containernetworking-plugins put the CNI plugins here."""
LABELS = {
    "type": "real",
    "nvidia.com/gpu.present": "true",
}
ADDRESSES = [
    {"type": "InternalIP", "address": "127.0.0.1"},
    {"type": "Hostname", "address": NAME},
]
"""The node's addresses (set by the dev cluster: the kubelet refuses a loopback node IP)."""
FIX = "make bins"


@dataclass(frozen=True)
class NodeBinaries:
    """What the real node runs."""

    kubelet: Path
    containerd: Path
    runc: Path
    ctr: Path
    pause_archive: Path


def resolve_node_binaries(bin_dir: Path) -> NodeBinaries:
    """Locate the kubelet, containerd, runc, ctr, the CNI loopback plugin and the pause image.

    Args:
        bin_dir: The control-plane bin dir (the kubelet is built there).

    Raises:
        MissingBinaryError: Something is missing; the message names the command that fixes it.
    """
    kubelet = bin_dir / "kubelet"
    if not os.access(kubelet, os.X_OK):
        raise MissingBinaryError(
            f"kubelet not found at {kubelet}. Build it with `{FIX}` (hack/node-bins.sh)."
        )
    found: dict[str, Path] = {}
    for name in ("containerd", "runc", "ctr"):
        path = shutil.which(name)
        if path is None:
            raise MissingBinaryError(
                f"{name} not found on PATH. Install Debian's containerd and runc with `{FIX}` "
                "as root (hack/node-bins.sh runs apt-get install containerd runc "
                "containernetworking-plugins)."
            )
        found[name] = Path(path)
    if not os.access(CNI_BIN_DIR / "loopback", os.X_OK):
        raise MissingBinaryError(
            f"{CNI_BIN_DIR}/loopback not found: `{FIX}` as root installs "
            "containernetworking-plugins."
        )
    pause = bin_dir.parent / "images" / "pause.oci.tar"
    if not pause.is_file():
        raise MissingBinaryError(f"pause image {pause} not found. Build it with `{FIX}`.")
    return NodeBinaries(kubelet, found["containerd"], found["runc"], found["ctr"], pause)


def containerd_config(base: Path) -> str:
    """Containerd 1.6 configuration (version 2) with everything under ``base``.

    Root, state, socket and the CNI config folder are the node's own, so the node never
    touches a system containerd. runc through the v2 shim, cgroupfs (no systemd), overlayfs,
    AppArmor off (the profile loader is not installed), the local pause image.
    """
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join(
        [
            "version = 2",
            f'root = "{base / "root"}"',
            f'state = "{base / "state"}"',
            'disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", '
            '"io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", '
            '"io.containerd.snapshotter.v1.devmapper"]',
            "[grpc]",
            f'  address = "{base / "containerd.sock"}"',
            "[ttrpc]",
            f'  address = "{base / "containerd.sock.ttrpc"}"',
            "[debug]",
            '  level = "info"',
            '[plugins."io.containerd.internal.v1.opt"]',
            f'  path = "{base / "opt"}"',
            f"[{cri}]",
            f'  sandbox_image = "{PAUSE_IMAGE}"',
            "  disable_apparmor = true",
            "  enable_selinux = false",
            # No pod may ask for a lower OOM score than containerd's own: this host's root lacks
            # CAP_SYS_RESOURCE, so runc's write of the sandbox's -998 fails ("failed to update
            # /proc/self/oom_score_adj: Permission denied").
            "  restrict_oom_score_adj = true",
            '  stream_server_address = "127.0.0.1"',
            '  stream_server_port = "0"',
            f"[{cri}.containerd]",
            '  snapshotter = "overlayfs"',
            '  default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]",
            '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.containerd.runtimes.runc.options]",
            "  SystemdCgroup = false",
            f'  Root = "{base / "runc"}"',
            f"[{cri}.cni]",
            f'  bin_dir = "{CNI_BIN_DIR}"',
            f'  conf_dir = "{base / "cni"}"',
            "",
        ]
    )


CNI_CONFIG = {
    "cniVersion": "0.4.0",
    "name": "rlenergy-loopback-only",
    "plugins": [{"type": "loopback"}],
}
"""The only network: loopback. containerd needs one valid network for NetworkReady; hostNetwork
pods never use it, other pods get no address (and so cannot start)."""


def kubelet_config(
    *,
    runtime_socket: Path,
    port: int,
    healthz_port: int,
    client_ca: Path,
    taints: Sequence[dict[str, str]] = (),
) -> dict[str, Any]:
    """The KubeletConfiguration (v1beta1) of the real node.

    Args:
        runtime_socket: containerd's socket.
        port: The kubelet's HTTPS port (127.0.0.1 only).
        healthz_port: The kubelet's /healthz port (127.0.0.1 only).
        client_ca: CA of the client certificates the kubelet's API accepts (the API server's
            admin certificate, for ``kubectl logs``).
        taints: Taints the node registers with.
    """
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "containerRuntimeEndpoint": f"unix://{runtime_socket}",
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(client_ca)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "registerWithTaints": [dict(t) for t in taints],
        # A shared development disk: evict only when it is really full.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "2%",
            "imagefs.available": "2%",
        },
        "imageGCHighThresholdPercent": 99,
        "imageGCLowThresholdPercent": 98,
        "serializeImagePulls": False,
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "nodeStatusUpdateFrequency": "5s",
        "shutdownGracePeriod": "0s",
        "resolvConf": "/etc/resolv.conf",
        "logging": {"format": "text"},
    }


def _mount_points() -> list[str]:
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if len(fields) > 4:
                points.append(fields[4].replace("\\040", " "))
    return points


_MNT_DETACH = 2


def unmount_under(base: Path) -> list[str]:
    """Lazily unmount every mount point below ``base`` (deepest first); returns them."""
    prefix = str(base.resolve()) + "/"
    libc = ctypes.CDLL(None, use_errno=True)
    done = []
    for point in sorted(
        (p for p in _mount_points() if p.startswith(prefix)), key=len, reverse=True
    ):
        if libc.umount2(point.encode(), _MNT_DETACH) == 0:
            done.append(point)
    return done


def _shims_of(socket: Path) -> list[int]:
    """Pids of containerd shims started by the containerd listening on ``socket``."""
    pids = []
    needle = str(socket).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and needle in argv:
            pids.append(int(entry.name))
    return pids


class RealNode:
    """The containerd and kubelet processes of the real node and what they leave behind.

    Created and started by :class:`rlenergy_dev.devcluster.cluster.DevCluster`; ``spawn`` starts a
    component the way the cluster starts its own (own session, log, die-with-parent).

    Args:
        base: Folder of the node (containerd root/state/socket, kubelet root dir, configs).
        bins: The node binaries.
        spawn: ``(name, argv) -> ProcessRecord``.
        popens: The cluster's Popen handles by pid (to reap).
    """

    def __init__(
        self,
        base: Path,
        bins: NodeBinaries,
        spawn: Callable[[str, Sequence[str]], process.ProcessRecord],
        popens: dict[int, subprocess.Popen[bytes]],
    ) -> None:
        self.base = base
        self.bins = bins
        self.name = NAME
        self._spawn = spawn
        self._popens = popens
        self._lock: IO[str] | None = None
        self.containerd: process.ProcessRecord | None = None
        self.kubelet: process.ProcessRecord | None = None
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------ paths
    @property
    def runtime_socket(self) -> Path:
        """Containerd's socket."""
        return self.base / "containerd" / "containerd.sock"

    @property
    def root_dir(self) -> Path:
        """The kubelet's ``--root-dir``."""
        return self.base / "kubelet"

    @property
    def pod_resources_dir(self) -> Path:
        """Folder of the kubelet's PodResources socket ``kubelet.sock``."""
        return self.root_dir / "pod-resources"

    @property
    def processes(self) -> list[process.ProcessRecord]:
        """Containerd and kubelet records (those started)."""
        return [r for r in (self.containerd, self.kubelet) if r is not None]

    # ------------------------------------------------------------------ lifecycle
    def acquire(self) -> None:
        """Take the machine-wide real-node lock.

        Raises:
            DevClusterError: Another live process holds it.
        """
        fh = open(LOCK_FILE, "a+")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise DevClusterError(
                f"another real node runs on this machine (lock {LOCK_FILE} held by {holder}); "
                "the kubelet's device-plugin folder is machine-wide, so only one can. Stop it "
                "with `python -m rlenergy_dev.devcluster down` (or end that test run) and retry."
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} workdir {self.base}\n")
        fh.flush()
        self._lock = fh

    def start_containerd(self, timeout_s: float) -> None:
        """Write containerd's config, start it, wait for its socket; import the pause image."""
        t0 = time.monotonic()
        ctd = self.base / "containerd"
        (ctd / "cni").mkdir(parents=True, exist_ok=True)
        (ctd / "cni" / "10-loopback.conflist").write_text(json.dumps(CNI_CONFIG, indent=2))
        cfg = ctd / "config.toml"
        cfg.write_text(containerd_config(ctd))
        self.containerd = self._spawn(
            "containerd", [str(self.bins.containerd), "--config", str(cfg)]
        )
        deadline = time.monotonic() + timeout_s
        while self.ctr("version", check=False).returncode != 0:
            self._check(self.containerd)
            if time.monotonic() > deadline:
                raise DevClusterError(
                    f"containerd did not answer on {self.runtime_socket} in {timeout_s:.0f} s; "
                    f"last lines of {self.containerd.log}:\n{process.tail(self.containerd.log)}"
                )
            time.sleep(0.2)
        self.import_image(self.bins.pause_archive)
        self.timings["containerd"] = time.monotonic() - t0

    def start_kubelet(
        self,
        *,
        kubeconfig: Path,
        client_ca: Path,
        port: int,
        healthz_port: int,
        labels: dict[str, str],
        taints: Sequence[dict[str, str]],
    ) -> None:
        """Write the kubelet's config and start it (registration is awaited by the caller)."""
        self.root_dir.mkdir(parents=True, exist_ok=True)
        DEVICE_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
        cfg = self.base / "kubelet-config.yaml"
        cfg.write_text(
            yaml.safe_dump(
                kubelet_config(
                    runtime_socket=self.runtime_socket,
                    port=port,
                    healthz_port=healthz_port,
                    client_ca=client_ca,
                    taints=taints,
                ),
                sort_keys=False,
            )
        )
        self.kubelet = self._spawn(
            "kubelet",
            [
                str(self.bins.kubelet),
                f"--config={cfg}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.root_dir}",
                f"--cert-dir={self.root_dir / 'pki'}",
                f"--hostname-override={self.name}",
                "--node-ip=127.0.0.1",
                "--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
                "--v=1",
            ],
        )

    def check_alive(self) -> None:
        """Raise if containerd or the kubelet exited."""
        for rec in self.processes:
            self._check(rec)

    def _check(self, rec: process.ProcessRecord) -> None:
        proc = self._popens.get(rec.pid)
        if proc is not None and proc.poll() is not None:
            raise DevClusterError(
                f"{rec.name} exited with code {proc.returncode}; last lines of {rec.log}:\n"
                f"{process.tail(rec.log, 40)}"
            )

    def ctr(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``ctr`` against this node's containerd, namespace ``k8s.io``."""
        argv = [
            str(self.bins.ctr),
            "--address",
            str(self.runtime_socket),
            "--namespace",
            NAMESPACE,
            *args,
        ]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and res.returncode != 0:
            raise DevClusterError(
                f"{' '.join(argv)} failed ({res.returncode}):\n{res.stderr}{res.stdout}"
            )
        return res

    def import_image(self, archive: Path) -> list[str]:
        """Import an OCI or Docker image archive into containerd's ``k8s.io`` namespace.

        The image keeps the name its index gives it (``io.containerd.image.name``, as
        ``make images`` and hack/images/pause.py write it). Returns the image names listed
        after the import.
        """
        if not archive.is_file():
            raise DevClusterError(f"image archive {archive} not found (run `make images`)")
        self.ctr("images", "import", str(archive), timeout=300)
        return self.images()

    def images(self) -> list[str]:
        """Names of the images in the ``k8s.io`` namespace."""
        return [
            ln
            for ln in self.ctr("images", "ls", "-q").stdout.split()
            if ":" in ln and not ln.startswith("sha256:")
        ]

    def stop(self, grace: float = 10.0) -> None:
        """Stop the kubelet, kill every container of the node, stop containerd, clean up.

        Order: kubelet (so it restarts nothing), the containers' tasks (SIGKILL) and containers,
        containerd, any shim left, then the mounts under the node's folder and the kubelet's
        device-plugin sockets and checkpoint; the lock is released last.
        """
        if self.kubelet is not None:
            process.terminate([self.kubelet], self._popens, grace=grace)
        if self.containerd is not None and process.is_alive(self.containerd):
            with contextlib.suppress(DevClusterError, subprocess.TimeoutExpired):
                ids = self.ctr("containers", "ls", "-q", timeout=30).stdout.split()
                for cid in ids:
                    self.ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False, timeout=30)
                for cid in ids:
                    self.ctr("tasks", "delete", "-f", cid, check=False, timeout=30)
                    self.ctr("containers", "delete", cid, check=False, timeout=30)
            process.terminate([self.containerd], self._popens, grace=grace)
        for pid in _shims_of(self.runtime_socket):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        unmount_under(self.base)
        for leftover in ("kubelet.sock", "kubelet_internal_checkpoint"):
            with contextlib.suppress(OSError):
                (DEVICE_PLUGIN_DIR / leftover).unlink()
        if self._lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None
