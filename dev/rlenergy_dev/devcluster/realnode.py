"""One real node for the dev cluster: containerd + runc + a kubelet built from k8s source.

``DevCluster.start(real_node=True)`` (``python -m rlenergy_dev.devcluster up --real-node``)
starts, next to the KWOK nodes, a containerd 2.x (built by ``hack/node-bins.sh`` from the Go
module proxy; its own root, state and socket under the cluster's workdir) and a kubelet (built
from the same Kubernetes version as the control plane) that registers the node ``realnode``
with InternalIP 127.0.0.1. Pods there really run in containers: the operator and agent images
are imported into containerd's ``k8s.io`` namespace (:meth:`RealNode.import_image`), the pod
sandbox image is a locally built pause binary (hack/images/pause.c). With ``registries``
(``DevCluster.start(registry=True)``: the dev cluster's own registry,
:mod:`rlenergy_dev.devcluster.registry`, for its own name and as the mirror of ``ghcr.io``)
the kubelet pulls the images through containerd from that plain-HTTP loopback registry
instead (``hosts.toml`` under containerd's ``config_path``).

GPU runtime, as NVIDIA's GPU Operator (>= v25.10, CDI on) leaves a node: runc is containerd's
default runtime, containerd's CRI plugin applies CDI devices (device plugins' ``Allocate``
answers, ``cdi.k8s.io/`` annotations), and NVIDIA Container Toolkit's
``nvidia-container-runtime`` (also built by ``hack/node-bins.sh``) is the runtime handler
``nvidia`` (the RuntimeClass ``nvidia`` of ``rlenergy_dev.devcluster.nodes``) in CDI mode
(:func:`toolkit_config`). A container of that runtime class that asks for
``NVIDIA_VISIBLE_DEVICES=all`` (the agent) gets the edits of the CDI device
``nvidia.com/gpu=all``. :meth:`RealNode.write_cdi_spec` writes the stand-in GPUs' spec
(:func:`cdi_spec`), whose edits mount the stand-in ``libnvidia-ml.so.1`` and its state, so NVML
reaches a pod only through CDI. ``nvidia.com/gpu`` is advertised by NVIDIA's k8s-device-plugin
(``rlenergy_dev.devcluster.nvidiaplugin``, a host process over the stand-in NVML) with
``--device-list-strategy=cdi-cri``: its ``Allocate`` answers name the devices
``k8s.device-plugin.nvidia.com/gpu=<uuid>``, which containerd resolves through the same spec
under that kind.

Networking: by default there is no pod network. Only ``hostNetwork: true`` pods can run (their
IP is the node's, 127.0.0.1); the CNI configuration is a loopback-only network, so containerd
reports ``NetworkReady`` and a pod that asks for its own network namespace gets no address and
fails to start, as it must here (nothing may dial a pod IP in a private range). With a
:class:`PodNetwork` (``DevCluster.start(pod_network=...)``), which is only for a cluster whose
processes all run in a network namespace the caller made (:mod:`rlenergy_dev.devcluster.netns`),
the node's IP is the gateway of a Linux bridge in that namespace and pods that are not
``hostNetwork`` get an address on it from Debian's CNI ``bridge`` and ``host-local`` plugins
(:func:`bridge_cni_config`), so they reach the node's IP (the agent's TLS endpoint) and
nothing else.

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
import ipaddress
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from rlenergy_dev.devcluster import draplugin, nvidiaplugin, process
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
LOCK_WAIT_ENV = "RLENERGY_REALNODE_LOCK_WAIT_S"
"""Seconds ``acquire`` waits for another holder of ``LOCK_FILE`` (default 0: fail at once)."""
CNI_BIN_DIR = Path("/usr/lib/cni")
"""Debian's containernetworking-plugins put the CNI plugins here."""
LABELS = {
    "type": "real",
    "nvidia.com/gpu.present": "true",
}
LOOPBACK_IP = "127.0.0.1"
"""The node's IP without a pod network."""
ADDRESSES = [
    {"type": "InternalIP", "address": LOOPBACK_IP},
    {"type": "Hostname", "address": NAME},
]
"""The node's addresses without a pod network (set by the dev cluster: the kubelet refuses a
loopback node IP)."""
FIX = "make bins"
NVIDIA_HANDLER = "nvidia"
"""containerd runtime handler of NVIDIA's container toolkit (the RuntimeClass ``nvidia``)."""
CDI_KIND = "nvidia.com/gpu"
"""CDI kind of the GPUs (the toolkit's ``default-kind``; ``nvidia-ctk cdi generate`` uses it)."""
CDI_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
"""Where CDI consumers read specs (the CDI specification's default spec directories)."""
CDI_SPEC_FILE = Path("/var/run/cdi/rlenergy-standin-gpu.json")
"""The stand-in GPUs' CDI spec (a generated, run-time spec: /var/run/cdi)."""
DEVICE_PLUGIN_CDI_KIND = "k8s.device-plugin.nvidia.com/gpu"
"""CDI kind of NVIDIA's device plugin's ``Allocate`` answers (``--device-list-strategy=cdi-cri``;
``rlenergy_dev.devcluster.nvidiaplugin``)."""
DEVICE_PLUGIN_CDI_SPEC_FILE = Path("/var/run/cdi/rlenergy-standin-device-plugin-gpu.json")
"""The stand-in GPUs' spec of kind :data:`DEVICE_PLUGIN_CDI_KIND`: the same devices and edits."""
STANDIN_STATE_ENV = "RLENERGY_NVML_STANDIN_STATE"
"""The env that names the stand-in library's state file (dev/nvml_standin/standin.c)."""
STANDIN_GPU_ENV_PREFIX = "RLENERGY_NVML_STANDIN_GPU_"
"""``<prefix><n>=<uuid>`` makes GPU ``uuid`` visible to the stand-in library in a container
(standin.c: with any such variable set, only the GPUs named are enumerated)."""
CONTAINER_NVML_LIB = f"/usr/lib/{platform.machine()}-linux-gnu/libnvidia-ml.so.1"
"""Where the stand-in library appears in a container: on the dynamic loader's system search
path (Debian's multiarch library folder), so no ``LD_LIBRARY_PATH`` is needed."""
CONTAINER_STATE_DIR = "/var/run/nvml-standin"
"""Where the stand-in's state folder appears in a container."""
_CDI_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
"""A CDI device name (container-device-interface pkg/parser ValidateDeviceName)."""


@dataclass(frozen=True)
class NodeBinaries:
    """What the real node runs."""

    kubelet: Path
    containerd: Path
    runc: Path
    ctr: Path
    pause_archive: Path
    nvidia_runtime: Path
    shim: Path
    device_plugin: Path | None = None
    """NVIDIA's ``nvidia-device-plugin`` (hack/device-plugin-bin.sh)."""
    dra_driver: Path | None = None
    """Kubernetes' DRA test driver ``dra-test-driver`` (hack/dra-driver-bin.sh); only
    :meth:`RealNode.start_dra_driver` needs it."""


@dataclass(frozen=True)
class PodNetwork:
    """A pod network on a Linux bridge that the caller made in its own network namespace.

    The bridge already exists and holds ``gateway``/<prefix of ``subnet``> when the node starts
    (:func:`rlenergy_dev.devcluster.netns.add_bridge`); ``gateway`` is the node's IP.

    Attributes:
        bridge: The bridge's interface name (at most 15 characters, Linux ``IFNAMSIZ``).
        subnet: The pods' IPv4 subnet, CIDR (e.g. ``10.88.0.0/24``).
        gateway: The bridge's own address in ``subnet``: the node's InternalIP.
    """

    bridge: str
    subnet: str
    gateway: str

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.subnet)  # ValueError for a malformed subnet
        if ipaddress.ip_address(self.gateway) not in net:
            raise ValueError(f"gateway {self.gateway} is not in the pod subnet {self.subnet}")
        if not 0 < len(self.bridge) <= 15:
            raise ValueError(f"bridge name {self.bridge!r} must have 1 to 15 characters")

    @property
    def prefix_len(self) -> int:
        """The subnet's prefix length (``24`` for a /24)."""
        return ipaddress.ip_network(self.subnet).prefixlen


def node_addresses(node_ip: str) -> list[dict[str, str]]:
    """The node's ``status.addresses``: InternalIP ``node_ip`` and its host name."""
    return [{"type": "InternalIP", "address": node_ip}, {"type": "Hostname", "address": NAME}]


def bridge_cni_config(net: PodNetwork, ipam_dir: Path) -> dict[str, Any]:
    """The CNI network list (version 0.4.0) of ``net``: ``bridge`` with ``host-local``.

    Debian's plugins. Each pod gets a veth on ``net.bridge`` and an address of ``net.subnet``;
    the gateway (the node's IP) is the bridge's own address and the pod's default route
    (``isGateway``), with no masquerading (nothing is routed out of the namespace: it has no
    other interface). Keys:
    containernetworking/plugins ``plugins/main/bridge`` and ``plugins/ipam/host-local`` READMEs.

    Args:
        net: The pod network.
        ipam_dir: Where ``host-local`` records the addresses it gave (``dataDir``; the node's
            own folder, not the machine-wide ``/var/lib/cni/networks``).
    """
    return {
        "cniVersion": "0.4.0",
        "name": "rlenergy-bridge",
        "plugins": [
            {
                "type": "bridge",
                "bridge": net.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": net.subnet, "gateway": net.gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            }
        ],
    }


def resolve_node_binaries(bin_dir: Path) -> NodeBinaries:
    """Locate the node's binaries, the CNI plugins and the pause image.

    The kubelet, containerd 2.x (``containerd``, ``containerd-shim-runc-v2``, ``ctr``) and
    ``nvidia-container-runtime`` are built into ``bin_dir`` by hack/node-bins.sh; runc and the
    CNI plugins (``loopback``, ``bridge``, ``host-local``) are Debian's.

    Args:
        bin_dir: The control-plane bin dir (the node's Go binaries are built there).

    Raises:
        MissingBinaryError: Something is missing; the message names the command that fixes it.
    """
    built: dict[str, Path] = {}
    for name in ("kubelet", "containerd", "containerd-shim-runc-v2", "ctr"):
        built[name] = bin_dir / name
        if not os.access(built[name], os.X_OK):
            raise MissingBinaryError(
                f"{name} not found at {built[name]}. Build it with `{FIX}` (hack/node-bins.sh "
                "builds the kubelet and containerd from the Go module proxy)."
            )
    runc = shutil.which("runc")
    if runc is None:
        raise MissingBinaryError(
            f"runc not found on PATH. Install Debian's runc with `{FIX}` as root "
            "(hack/node-bins.sh runs apt-get install runc containernetworking-plugins)."
        )
    for plugin in ("loopback", "bridge", "host-local"):
        if not os.access(CNI_BIN_DIR / plugin, os.X_OK):
            raise MissingBinaryError(
                f"{CNI_BIN_DIR}/{plugin} not found: `{FIX}` as root installs "
                "containernetworking-plugins."
            )
    pause = bin_dir.parent / "images" / "pause.oci.tar"
    if not pause.is_file():
        raise MissingBinaryError(f"pause image {pause} not found. Build it with `{FIX}`.")
    nvidia = bin_dir / "nvidia-container-runtime"
    if not os.access(nvidia, os.X_OK):
        raise MissingBinaryError(
            f"nvidia-container-runtime not found at {nvidia}. Build it with `{FIX}` "
            "(hack/node-bins.sh builds NVIDIA Container Toolkit's runtime from the Go module "
            "proxy)."
        )
    device_plugin = bin_dir / "nvidia-device-plugin"
    if not os.access(device_plugin, os.X_OK):
        raise MissingBinaryError(
            f"nvidia-device-plugin not found at {device_plugin}. Build it with `{FIX}` "
            "(hack/device-plugin-bin.sh builds NVIDIA's k8s-device-plugin from the Go module "
            "proxy)."
        )
    dra_driver = bin_dir / "dra-test-driver"
    return NodeBinaries(
        kubelet=built["kubelet"],
        containerd=built["containerd"],
        runc=Path(runc),
        ctr=built["ctr"],
        pause_archive=pause,
        nvidia_runtime=nvidia,
        shim=built["containerd-shim-runc-v2"],
        device_plugin=device_plugin,
        dra_driver=dra_driver if os.access(dra_driver, os.X_OK) else None,
    )


def hosts_toml(namespace: str, host: str) -> str:
    """The containerd ``hosts.toml`` of the registry namespace ``namespace``, served by ``host``.

    Written to ``<config_path>/<namespace>/hosts.toml`` (containerd docs/hosts.md, "Registry
    Host Namespace"); ``host`` is a plain-HTTP registry (``127.0.0.1:<port>``). When
    ``namespace`` is ``host`` itself, images named ``<host>/...`` are pulled over HTTP from it,
    as on a node set up for a private plain-HTTP registry; otherwise ``host`` is a pull mirror
    of ``namespace`` (images named ``ghcr.io/...`` are fetched from ``host`` first, the
    upstream ``https://<namespace>`` only when the mirror lacks them), as on an air-gapped
    node.
    """
    server = f"http://{host}" if namespace == host else f"https://{namespace}"
    return "\n".join(
        [
            f'server = "{server}"',
            f'[host."http://{host}"]',
            '  capabilities = ["pull", "resolve"]',
            "",
        ]
    )


def containerd_config(base: Path, shim: Path, nvidia_runtime: Path) -> str:
    """Containerd 2.x configuration (version 4, containerd v2.4) with everything under ``base``.

    Root, state, socket and the CNI config folder are the node's own, so the node never
    touches a system containerd. runc through the v2 shim (``shim``, the one built with this
    containerd: ``runtime_path``, never another on PATH) is the default runtime, as on a node
    NVIDIA's GPU Operator (>= v25.10, CDI on) leaves; the runtime handler ``nvidia`` (the
    RuntimeClass ``nvidia``) runs the same shim with ``nvidia_runtime`` (the toolkit's
    ``nvidia-container-runtime`` in CDI mode, through :func:`nvidia_runtime_wrapper`) as its
    OCI runtime binary, over the same runc root. CDI is on (containerd >= 2.4 always has it;
    ``enable_cdi`` is gone) with the spec folders :data:`CDI_SPEC_DIRS`, so the CDI device names
    a device plugin returns from ``Allocate`` are applied to runc containers too. cgroupfs (no
    systemd), overlayfs, AppArmor off (the profile loader is not installed), the local pause
    image. Registry hosts are read from ``base/certs.d`` (``config_path``: one
    ``<host>/hosts.toml`` each, :func:`hosts_toml`), read again at every pull. Keys:
    ``containerd config default`` of containerd v2.4.2.

    Args:
        base: The node's containerd folder.
        shim: ``containerd-shim-runc-v2``.
        nvidia_runtime: The executable the ``nvidia`` handler runs in place of runc.
    """
    rt = "plugins.'io.containerd.cri.v1.runtime'"
    runtimes = []
    for handler, binary in (("runc", None), (NVIDIA_HANDLER, nvidia_runtime)):
        runtimes += [
            f"[{rt}.containerd.runtimes.{handler}]",
            "  runtime_type = 'io.containerd.runc.v2'",
            f"  runtime_path = '{shim}'",
            f"[{rt}.containerd.runtimes.{handler}.options]",
            "  SystemdCgroup = false",
            f"  Root = '{base / 'runc'}'",
        ]
        if binary is not None:
            runtimes.append(f"  BinaryName = '{binary}'")
    return "\n".join(
        [
            "version = 4",
            f"root = '{base / 'root'}'",
            f"state = '{base / 'state'}'",
            "imports = []",
            "disabled_plugins = ['io.containerd.snapshotter.v1.btrfs', "
            "'io.containerd.snapshotter.v1.zfs', 'io.containerd.snapshotter.v1.devmapper', "
            "'io.containerd.snapshotter.v1.erofs', 'io.containerd.differ.v1.erofs']",
            "[debug]",
            "  level = 'info'",
            # Version 4: the servers are plugins.
            "[plugins.'io.containerd.server.v1.grpc']",
            f"  address = '{base / 'containerd.sock'}'",
            "[plugins.'io.containerd.server.v1.ttrpc']",
            f"  address = '{base / 'containerd.sock.ttrpc'}'",
            "[plugins.'io.containerd.internal.v1.opt']",
            f"  path = '{base / 'opt'}'",
            # NRI's socket is machine-wide (/var/run/nri/nri.sock) and no NRI plugin runs here.
            "[plugins.'io.containerd.nri.v1.nri']",
            "  disable = true",
            "[plugins.'io.containerd.image-verifier.v1.bindir']",
            f"  bin_dir = '{base / 'image-verifier'}'",
            "[plugins.'io.containerd.cri.v1.images']",
            "  snapshotter = 'overlayfs'",
            "[plugins.'io.containerd.cri.v1.images'.pinned_images]",
            f"  sandbox = '{PAUSE_IMAGE}'",
            "[plugins.'io.containerd.cri.v1.images'.registry]",
            f"  config_path = '{base / 'certs.d'}'",
            f"[{rt}]",
            "  disable_apparmor = true",
            "  enable_selinux = false",
            # No pod may ask for a lower OOM score than containerd's own: this host's root lacks
            # CAP_SYS_RESOURCE, so runc's write of the sandbox's -998 fails ("failed to update
            # /proc/self/oom_score_adj: Permission denied").
            "  restrict_oom_score_adj = true",
            "  cdi_spec_dirs = [" + ", ".join(f"'{d}'" for d in CDI_SPEC_DIRS) + "]",
            f"[{rt}.containerd]",
            "  default_runtime_name = 'runc'",
            *runtimes,
            f"[{rt}.cni]",
            f"  bin_dirs = ['{CNI_BIN_DIR}']",
            f"  conf_dir = '{base / 'cni'}'",
            "[plugins.'io.containerd.grpc.v1.cri']",
            "  stream_server_address = '127.0.0.1'",
            "  stream_server_port = '0'",
            "",
        ]
    )


def toolkit_config(runc: Path, log: Path, spec_dirs: Sequence[Path] = CDI_SPEC_DIRS) -> str:
    """The ``config.toml`` of NVIDIA Container Toolkit's runtime on the node: CDI mode.

    In CDI mode ``nvidia-container-runtime`` turns a container's ``NVIDIA_VISIBLE_DEVICES``
    (``all`` or device names, the agent's env) and its ``cdi.k8s.io/`` annotations into CDI
    devices of the default kind ``nvidia.com/gpu``, applies their edits from the CDI specs in
    ``spec_dirs`` to the OCI spec and runs ``runc``; keys and defaults from the toolkit's own
    ``api/config/v1/config.go`` (NVIDIA/nvidia-container-toolkit v1.20.2).

    Args:
        runc: The OCI runtime it hands the edited spec to.
        log: Its debug log (the OCI spec it edited and the mode, per container).
        spec_dirs: Where it reads CDI specs.
    """
    dirs = ", ".join(f'"{d}"' for d in spec_dirs)
    return "\n".join(
        [
            "accept-nvidia-visible-devices-envvar-when-unprivileged = true",
            "[nvidia-container-runtime]",
            f'debug = "{log}"',
            'log-level = "info"',
            'mode = "cdi"',
            f'runtimes = ["{runc}"]',
            "[nvidia-container-runtime.modes.cdi]",
            f'default-kind = "{CDI_KIND}"',
            'annotation-prefixes = ["cdi.k8s.io/"]',
            f"spec-dirs = [{dirs}]",
            "",
        ]
    )


def nvidia_runtime_wrapper(binary: Path, config: Path) -> str:
    """A shell wrapper that runs ``binary`` with its config file ``config``.

    The toolkit reads its config from ``NVIDIA_CTK_CONFIG_FILE_PATH`` (else
    ``/etc/nvidia-container-runtime/config.toml``); containerd's runc shim passes no
    environment of its own to the runtime binary, so the GPU Operator's toolkit installs the
    same kind of wrapper as the handler's ``BinaryName``.
    """
    return f"#!/bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH='{config}' exec '{binary}' \"$@\"\n"


def cdi_spec(lib: Path, state: Path, uuids: Sequence[str], kind: str = CDI_KIND) -> dict[str, Any]:
    """The CDI spec (``cdiVersion`` 0.6.0) of the stand-in GPUs, of kind ``kind``.

    One device per GPU, named by its UUID (the IDs the device plugin advertises and
    PodResources reports), and ``all``, as ``nvidia-ctk cdi generate`` names them. The spec's
    common edits bring the driver into the container the way the toolkit's generated spec
    brings the host's: the stand-in ``libnvidia-ml.so.1`` bind-mounted read-only into the
    dynamic loader's system search path, and the stand-in's state folder (read-write: the
    library maps the state file shared) with ``RLENERGY_NVML_STANDIN_STATE`` naming the file
    in it. A GPU has no device node here (``/dev/nvidiaN`` on a real node, which decides what
    NVML in the container enumerates), so each device's own edit is the env
    ``RLENERGY_NVML_STANDIN_GPU_<index>=<uuid>``: the stand-in library then enumerates only the
    GPUs so named, as the driver enumerates only the GPUs whose device nodes it sees; ``all``
    names every GPU.

    Args:
        lib: The stand-in ``libnvidia-ml.so.1`` on the host.
        state: The stand-in's state file on the host.
        uuids: The stand-in GPUs' UUIDs, in NVML index order.
        kind: The spec's kind: :data:`CDI_KIND` (the toolkit's runtime) or
            :data:`DEVICE_PLUGIN_CDI_KIND` (NVIDIA's device plugin), with the same devices.

    Raises:
        ValueError: No UUID, a duplicate, or one CDI cannot name (letters, digits, ``_.:-``).
    """
    if not uuids:
        raise ValueError("cdi_spec needs at least one GPU UUID")
    if len(set(uuids)) != len(uuids):
        raise ValueError(f"duplicate GPU UUIDs in {list(uuids)}")
    bad = [u for u in uuids if not _CDI_NAME.fullmatch(u) or u == "all"]
    if bad:
        raise ValueError(
            f"GPU UUIDs {bad} cannot be CDI device names: use letters, digits, '_', '.', ':' "
            "and '-', starting and ending with a letter or digit ('all' is reserved)"
        )
    return {
        "cdiVersion": "0.6.0",
        "kind": kind,
        "devices": [
            *(
                {"name": u, "containerEdits": {"env": [f"{STANDIN_GPU_ENV_PREFIX}{i}={u}"]}}
                for i, u in enumerate(uuids)
            ),
            {
                "name": "all",
                "containerEdits": {
                    "env": [f"{STANDIN_GPU_ENV_PREFIX}{i}={u}" for i, u in enumerate(uuids)]
                },
            },
        ],
        "containerEdits": {
            "env": [f"{STANDIN_STATE_ENV}={CONTAINER_STATE_DIR}/{state.name}"],
            "mounts": [
                {
                    "hostPath": str(lib),
                    "containerPath": CONTAINER_NVML_LIB,
                    "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
                },
                {
                    "hostPath": str(state.parent),
                    "containerPath": CONTAINER_STATE_DIR,
                    "options": ["rw", "nosuid", "nodev", "rbind", "rprivate"],
                },
            ],
        },
    }


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
    address: str = LOOPBACK_IP,
) -> dict[str, Any]:
    """The KubeletConfiguration (v1beta1) of the real node.

    Args:
        runtime_socket: containerd's socket.
        port: The kubelet's HTTPS port, on ``address`` only.
        healthz_port: The kubelet's /healthz port (127.0.0.1 only).
        client_ca: CA of the client certificates the kubelet's API accepts (the API server's
            admin certificate, for ``kubectl logs``).
        taints: Taints the node registers with.
        address: The address the kubelet's API listens on: the node's IP, which the API server
            dials for ``kubectl logs`` (``--kubelet-preferred-address-types=InternalIP``).
    """
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": address,
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
        registries: Registry namespace (the host part of image names) -> the plain-HTTP
            registry (``127.0.0.1:<port>``) containerd pulls them from (:func:`hosts_toml`).
        pod_network: A bridge pod network (the node's IP is its gateway); ``None``: no pod
            network, node IP 127.0.0.1, loopback-only CNI.
    """

    def __init__(
        self,
        base: Path,
        bins: NodeBinaries,
        spawn: Callable[[str, Sequence[str]], process.ProcessRecord],
        popens: dict[int, subprocess.Popen[bytes]],
        registries: Mapping[str, str] | None = None,
        pod_network: PodNetwork | None = None,
    ) -> None:
        self.base = base
        self.pod_network = pod_network
        self.registries = dict(registries or {})
        self.bins = bins
        self.name = NAME
        self._spawn = spawn
        self._popens = popens
        self._lock: IO[str] | None = None
        self.containerd: process.ProcessRecord | None = None
        self.kubelet: process.ProcessRecord | None = None
        self.timings: dict[str, float] = {}
        self._cdi_specs: list[Path] = []
        self.device_plugin: nvidiaplugin.NvidiaDevicePlugin | None = None
        self.dra_driver: draplugin.DraTestDriver | None = None

    # ------------------------------------------------------------------ paths
    @property
    def node_ip(self) -> str:
        """The node's InternalIP: the pod network's gateway, else 127.0.0.1."""
        return self.pod_network.gateway if self.pod_network is not None else LOOPBACK_IP

    @property
    def addresses(self) -> list[dict[str, str]]:
        """The node's ``status.addresses`` (:func:`node_addresses`)."""
        return node_addresses(self.node_ip)

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

        Waits up to ``RLENERGY_REALNODE_LOCK_WAIT_S`` seconds (environment; default 0) for a
        holder to finish, so runs that share a machine can queue.

        Raises:
            DevClusterError: Another live process still holds it.
        """
        wait_s = float(os.environ.get(LOCK_WAIT_ENV) or 0)
        deadline = time.monotonic() + wait_s
        fh = open(LOCK_FILE, "a+")  # noqa: SIM115 - held until release()
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(2.0)
                    continue
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise DevClusterError(
                f"another real node runs on this machine (lock {LOCK_FILE} held by {holder}); "
                "the kubelet's device-plugin folder is machine-wide, so only one can. Stop it "
                "with `python -m rlenergy_dev.devcluster down` (or end that test run) and retry, "
                f"or set {LOCK_WAIT_ENV} to the seconds to wait for it."
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
        if self.pod_network is None:
            (ctd / "cni" / "10-loopback.conflist").write_text(json.dumps(CNI_CONFIG, indent=2))
        else:
            conf = bridge_cni_config(self.pod_network, ctd / "cni-ipam")
            (ctd / "cni" / "10-bridge.conflist").write_text(json.dumps(conf, indent=2))
        # The CDI spec folder exists before containerd starts, so its CDI cache watches it.
        CDI_SPEC_FILE.parent.mkdir(parents=True, exist_ok=True)
        toolkit = self.base / "toolkit"
        toolkit.mkdir(parents=True, exist_ok=True)
        (toolkit / "config.toml").write_text(
            toolkit_config(self.bins.runc, toolkit / "nvidia-container-runtime.log")
        )
        wrapper = toolkit / "nvidia-container-runtime"
        wrapper.write_text(
            nvidia_runtime_wrapper(self.bins.nvidia_runtime, toolkit / "config.toml")
        )
        wrapper.chmod(0o755)
        for namespace, host in self.registries.items():
            (ctd / "certs.d" / namespace).mkdir(parents=True, exist_ok=True)
            (ctd / "certs.d" / namespace / "hosts.toml").write_text(hosts_toml(namespace, host))
        cfg = ctd / "config.toml"
        cfg.write_text(containerd_config(ctd, self.bins.shim, wrapper))
        # containerd looks a shim up on its PATH (for `ctr run` and shim clean-up); the shim
        # built with it comes first, never another containerd's (Debian's 1.6 shim fails
        # with "type with url ...: not found"). `env` execs containerd: same pid.
        path = f"{self.bins.shim.parent}:{os.environ.get('PATH', os.defpath)}"
        self.containerd = self._spawn(
            "containerd",
            ["/usr/bin/env", f"PATH={path}", str(self.bins.containerd), "--config", str(cfg)],
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
                    address=self.node_ip,
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
                f"--node-ip={self.node_ip}",
                "--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
                "--v=1",
            ],
        )

    def restart_kubelet(self, down_s: float = 0.0, grace: float = 10.0) -> float:
        """Stop the kubelet (SIGTERM) and start it again with the same command line.

        Containers keep running (containerd and its shims are untouched), as on a node whose
        kubelet is restarted by systemd; the restarted kubelet re-creates its PodResources and
        device-plugin sockets (plugins register again) and takes its running pods back from
        its checkpoints. The caller waits for the node to be Ready again.

        Args:
            down_s: Seconds between the old kubelet's exit and the new one's start.
            grace: Seconds between SIGTERM and SIGKILL of the old kubelet.

        Returns:
            Seconds the old kubelet took to exit.

        Raises:
            DevClusterError: The kubelet was never started.
        """
        if self.kubelet is None:
            raise DevClusterError("the kubelet was never started: nothing to restart")
        t0 = time.monotonic()
        process.terminate([self.kubelet], self._popens, grace=grace)
        stopped_s = time.monotonic() - t0
        if down_s > 0:
            time.sleep(down_s)
        self.kubelet = self._spawn("kubelet", self.kubelet.argv)
        return stopped_s

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

    def write_cdi_spec(self, lib: Path, state: Path, uuids: Sequence[str]) -> Path:
        """Write the stand-in GPUs' CDI specs (:func:`cdi_spec`), one per kind.

        :data:`CDI_SPEC_FILE` (kind ``nvidia.com/gpu``) is the one the toolkit's runtime reads
        for ``NVIDIA_VISIBLE_DEVICES``; :data:`DEVICE_PLUGIN_CDI_SPEC_FILE` names the same
        devices for NVIDIA's device plugin's ``cdi-cri`` answers, which containerd resolves.
        CDI consumers read the spec folders at every container they edit, so a spec written
        after the node started applies to the next container. :meth:`stop` removes both.

        Args:
            lib: The stand-in ``libnvidia-ml.so.1`` (``standin.build_library``'s output).
            state: The stand-in's state file.
            uuids: The GPUs' UUIDs in NVML index order.

        Returns:
            :data:`CDI_SPEC_FILE`.

        Raises:
            DevClusterError: ``lib`` or ``state`` is not a file.
        """
        for path in (lib, state):
            if not path.is_file():
                raise DevClusterError(f"{path} is not a file: the CDI spec would mount nothing")
        for kind, target in (
            (CDI_KIND, CDI_SPEC_FILE),
            (DEVICE_PLUGIN_CDI_KIND, DEVICE_PLUGIN_CDI_SPEC_FILE),
        ):
            spec = cdi_spec(lib.resolve(), state.resolve(), uuids, kind)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            tmp.write_text(json.dumps(spec, indent=2))
            tmp.replace(target)  # never a half-written spec in the folder
            if target not in self._cdi_specs:
                self._cdi_specs.append(target)
        return CDI_SPEC_FILE

    def start_device_plugin(
        self, *, nvml_lib: Path, cuda_lib: Path, state: Path, n_gpus: int, driver_version: str
    ) -> nvidiaplugin.NvidiaDevicePlugin:
        """Start NVIDIA's device plugin over the stand-in GPUs of ``state`` as a host process.

        It advertises ``nvidia.com/gpu`` with ``--device-list-strategy=cdi-cri``; its driver
        root, generated CDI spec and log are under ``<node>/nvidia-device-plugin``
        (``rlenergy_dev.devcluster.nvidiaplugin``). Write the CDI specs first
        (:meth:`write_cdi_spec`): containerd resolves its answers through them. :meth:`stop`
        stops it if the caller has not.

        Args:
            nvml_lib: The stand-in ``libnvidia-ml.so.1``.
            cuda_lib: The stand-in ``libcuda.so.1`` (``standin.build_cuda_library``).
            state: The stand-in's state file.
            n_gpus: GPUs in the state file.
            driver_version: The state file's driver version.

        Returns:
            The plugin, registered with the kubelet.

        Raises:
            DevClusterError: The node has no plugin binary, or the plugin did not register.
        """
        if self.bins.device_plugin is None:
            raise DevClusterError(f"no nvidia-device-plugin binary: run `{FIX}`")
        plugin = nvidiaplugin.NvidiaDevicePlugin(
            self.bins.device_plugin,
            self.base / "nvidia-device-plugin",
            nvml_lib=nvml_lib,
            cuda_lib=cuda_lib,
            state=state,
            n_gpus=n_gpus,
            driver_version=driver_version,
        )
        try:
            plugin.start()
        except (RuntimeError, OSError) as exc:
            raise DevClusterError(str(exc)) from exc
        self.device_plugin = plugin
        return plugin

    def start_dra_driver(self, *, kubeconfig: Path, num_devices: int) -> draplugin.DraTestDriver:
        """Start Kubernetes' DRA test driver as a kubelet plugin of this node (a host process).

        It publishes ``num_devices`` devices ``device-00``.. of driver
        ``test-driver.cdi.k8s.io`` in a ResourceSlice of this node and registers with the
        kubelet under its ``--root-dir``; its log is under ``<node>/dra-test-driver``
        (``rlenergy_dev.devcluster.draplugin``). :meth:`stop` stops it if the caller has not.

        Args:
            kubeconfig: Credentials that may write ResourceSlices (the cluster's admin).
            num_devices: Devices it publishes (device-NN is the stand-in GPU of NVML index NN).

        Raises:
            DevClusterError: No ``dra-test-driver`` binary, or it did not register.
        """
        if self.bins.dra_driver is None:
            raise DevClusterError(f"no dra-test-driver binary: run `{FIX}`")
        driver = draplugin.DraTestDriver(
            self.bins.dra_driver,
            self.base / "dra-test-driver",
            node_name=self.name,
            kubelet_root=self.root_dir,
            kubeconfig=kubeconfig,
            num_devices=num_devices,
        )
        try:
            driver.start()
        except (RuntimeError, OSError) as exc:
            raise DevClusterError(str(exc)) from exc
        self.dra_driver = driver
        return driver

    def images(self) -> list[str]:
        """Names of the images in the ``k8s.io`` namespace."""
        return [
            ln
            for ln in self.ctr("images", "ls", "-q").stdout.split()
            if ":" in ln and not ln.startswith("sha256:")
        ]

    def stop(self, grace: float = 10.0) -> None:
        """Stop the kubelet, kill every container of the node, stop containerd, clean up.

        Order: NVIDIA's device plugin and the DRA test driver, the kubelet (so it restarts
        nothing), the containers' tasks (SIGKILL) and containers, containerd, any shim left,
        then the mounts under the node's folder and the kubelet's device-plugin sockets and
        checkpoint; the lock is released last.
        """
        if self.device_plugin is not None:
            self.device_plugin.stop()
            self.device_plugin = None
        if self.dra_driver is not None:
            self.dra_driver.stop()
            self.dra_driver = None
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
        for spec in self._cdi_specs:
            with contextlib.suppress(OSError):
                spec.unlink()
        self._cdi_specs = []
        for leftover in ("kubelet.sock", "kubelet_internal_checkpoint", "nvidia-gpu.sock"):
            with contextlib.suppress(OSError):
                (DEVICE_PLUGIN_DIR / leftover).unlink()
        self.release()

    def release(self) -> None:
        """Let go of the machine-wide real-node lock (``acquire``); nothing when not held."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None
