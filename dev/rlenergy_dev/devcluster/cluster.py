"""A real, Docker-free Kubernetes control plane with fake GPU nodes, for tests and the demo.

``DevCluster`` starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK
as local processes that listen on 127.0.0.1 only, creates fake GPU nodes that KWOK keeps
Ready, and stops everything again (SIGTERM, then SIGKILL of every process group) when the
context manager exits, on :meth:`DevCluster.stop`, at interpreter exit, on SIGTERM/SIGHUP,
and - through ``PR_SET_PDEATHSIG`` - even when the owning Python process is killed.

Example:
    >>> with DevCluster() as cluster:  # doctest: +SKIP
    ...     cluster.start(nodes=3, gpus_per_node=8)
    ...     cluster.kubectl("get", "nodes")
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from rlenergy_dev.devcluster import process, realnode
from rlenergy_dev.devcluster.binaries import (
    K8S_VERSION,
    Binaries,
    default_bin_dir,
    resolve_binaries,
)
from rlenergy_dev.devcluster.certs import Pki, PkiPaths, client_cert, generate_pki, write_pki
from rlenergy_dev.devcluster.errors import DevClusterError
from rlenergy_dev.devcluster.kubeconfig import render_kubeconfig, write_kubeconfig
from rlenergy_dev.devcluster.nodes import (
    DEFAULT_GPU_PRODUCT,
    GPU_TAINT,
    gpu_node_manifest,
    node_name,
    nvidia_runtime_class_manifest,
)
from rlenergy_dev.devcluster.registry import Registry, resolve_registry_binaries

LOOPBACK = "127.0.0.1"
SERVICE_CIDR = "10.0.0.0/24"  # a config value only: nothing dials a Service IP
POD_CIDR = "10.244.0.0/16"  # KWOK hands out fake pod IPs from here; nothing dials them
STATE_FILE = "state.json"
OWNER_FILE = "owner.json"
TMP_PREFIX = "rlenergy-devcluster-"
#: What a cluster writes into its workdir (removed by stop() when the dir is not its own).
WORKDIR_ENTRIES = (
    "pki", "etcd", "logs", "helm", "node", "registry", "kubeconfig", STATE_FILE, OWNER_FILE,
)  # fmt: skip
STATE_VERSION = 1
PORT_ATTEMPTS = 3

#: Controllers KCM runs: what Deployments, DaemonSets, Jobs, namespaces and SAs need.
KCM_CONTROLLERS = (
    "daemonset-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "job-controller",
    "cronjob-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "node-lifecycle-controller",
    "root-ca-certificate-publisher-controller",
    "endpointslice-controller",
    "ttl-after-finished-controller",
    "pod-garbage-collector-controller",
    # DRA: releases a ResourceClaim's reservation when its pods end and removes its finalizer,
    # so a claim's devices can be allocated again and the claim deleted.
    "resourceclaim-controller",
)

POD_NETWORK_CONTROLLERS = (
    "endpoints-controller",
    "persistentvolume-binder-controller",
)
"""Controllers a cluster with a pod network adds: a Service's Endpoints (the API server dials a
webhook's pod there, ``--enable-aggregator-routing``) and the binding of claims to volumes that
an administrator made (pods under Pod Security ``restricted`` mount host folders only so)."""

#: KWOK stages (relative to sigs.k8s.io/kwok/kustomize/stage) as kwokctl's "fast" profile.
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _component_env() -> dict[str, str]:
    env = dict(os.environ)
    no_proxy = [p for p in env.get("NO_PROXY", env.get("no_proxy", "")).split(",") if p]
    for host in ("127.0.0.1", "localhost"):
        if host not in no_proxy:
            no_proxy.append(host)
    env["NO_PROXY"] = env["no_proxy"] = ",".join(no_proxy)
    return env


@dataclass
class ClusterState:
    """What a state file records, so another process (``dev-cluster down``) can find it."""

    workdir: str
    kubeconfig: str
    server: str
    k8s_version: str
    owner_pid: int
    ready: bool
    nodes: list[str]
    gpus_per_node: int
    gpu_product: str
    processes: list[process.ProcessRecord]
    supervisor: process.ProcessRecord | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return {
            "version": STATE_VERSION,
            "workdir": self.workdir,
            "kubeconfig": self.kubeconfig,
            "server": self.server,
            "k8s_version": self.k8s_version,
            "owner_pid": self.owner_pid,
            "ready": self.ready,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "gpu_product": self.gpu_product,
            "processes": [p.to_json() for p in self.processes],
            "supervisor": self.supervisor.to_json() if self.supervisor else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterState:
        """Inverse of :meth:`to_json`."""
        if data.get("version") != STATE_VERSION:
            raise DevClusterError(f"unsupported dev-cluster state version {data.get('version')}")
        sup = data.get("supervisor")
        return cls(
            workdir=str(data["workdir"]),
            kubeconfig=str(data["kubeconfig"]),
            server=str(data["server"]),
            k8s_version=str(data["k8s_version"]),
            owner_pid=int(data["owner_pid"]),
            ready=bool(data["ready"]),
            nodes=[str(n) for n in data["nodes"]],
            gpus_per_node=int(data["gpus_per_node"]),
            gpu_product=str(data["gpu_product"]),
            processes=[process.ProcessRecord.from_json(p) for p in data["processes"]],
            supervisor=process.ProcessRecord.from_json(sup) if sup else None,
        )

    def write(self, path: Path) -> None:
        """Atomically write the state file."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> ClusterState:
        """Read a state file."""
        return cls.from_json(json.loads(path.read_text()))


# ----------------------------------------------------------------- process-wide cleanup
_LIVE: list[DevCluster] = []
_LIVE_LOCK = threading.Lock()
_HANDLERS_INSTALLED = False


def _stop_all() -> None:
    with _LIVE_LOCK:
        clusters = list(_LIVE)
    for cluster in clusters:
        with contextlib.suppress(Exception):
            cluster.stop()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_cleanup_hooks() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_stop_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _on_signal)


class DevCluster:
    """etcd + kube-apiserver + KCM + scheduler + KWOK fake GPU nodes on 127.0.0.1.

    Args:
        workdir: Where certificates, data, logs, the kubeconfig and the state file go.
            Default: a fresh temporary directory, removed again by :meth:`stop`.
        bin_dir: Override of the binaries dir (default: the ``make bins`` cache).
        startup_timeout: Seconds to wait for each readiness step (2-core machines need ~60).
        keep_workdir: Keep ``workdir`` after :meth:`stop` (logs for debugging); also
            enabled by ``RLENERGY_DEVCLUSTER_KEEP=1``.
        die_with_parent: Components are SIGKILLed by the kernel when this process dies.
    """

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        bin_dir: Path | None = None,
        startup_timeout: float = 90.0,
        keep_workdir: bool = False,
        die_with_parent: bool = True,
        node_monitor_grace_s: int | None = None,
    ) -> None:
        self._workdir_arg = workdir
        self.node_monitor_grace_s = node_monitor_grace_s
        """The node lifecycle controller's ``--node-monitor-grace-period``, s (None: its
        default). A KWOK node's lease is renewed by the one KWOK process; on a small shared
        machine it falls behind at 1,000 nodes, and the controller then taints and evicts
        nodes whose real kubelet would have renewed on time (``bench/scale.py`` sets it)."""
        self._bin_dir = bin_dir
        self.startup_timeout = startup_timeout
        self.keep_workdir = keep_workdir or os.environ.get("RLENERGY_DEVCLUSTER_KEEP") == "1"
        self.die_with_parent = die_with_parent
        self.workdir: Path | None = None
        self._owns_workdir = False
        self._bins: Binaries | None = None
        self._pki: PkiPaths | None = None
        self._pki_mem: Pki | None = None
        self._real: realnode.RealNode | None = None
        self._registry: Registry | None = None
        self._pod_network: realnode.PodNetwork | None = None
        self._popens: dict[int, subprocess.Popen[bytes]] = {}
        self._records: list[process.ProcessRecord] = []
        self._nodes: list[str] = []
        self._gpus_per_node = 0
        self._gpu_product = DEFAULT_GPU_PRODUCT
        self._server = ""
        self._kubeconfig: Path | None = None
        self._stopped = False
        self.timings: dict[str, float] = {}
        #: Set by ``dev-cluster up``: the detached process that owns the components.
        self.supervisor: process.ProcessRecord | None = None

    # ------------------------------------------------------------------ properties
    @property
    def kubeconfig(self) -> Path:
        """Path of the admin kubeconfig (``CN=admin, O=system:masters``)."""
        if self._kubeconfig is None:
            raise DevClusterError("the dev cluster is not started")
        return self._kubeconfig

    @property
    def server(self) -> str:
        """API server URL, ``https://127.0.0.1:<port>``."""
        return self._server

    @property
    def nodes(self) -> list[str]:
        """Names of the fake GPU nodes."""
        return list(self._nodes)

    @property
    def real_node(self) -> realnode.RealNode | None:
        """The real node (containerd + kubelet) when started with ``real_node=True``."""
        return self._real

    @property
    def registry(self) -> Registry | None:
        """The OCI registry (:mod:`rlenergy_dev.devcluster.registry`) of ``registry=True``."""
        return self._registry

    @property
    def binaries(self) -> Binaries:
        """The resolved binaries."""
        if self._bins is None:
            self._bins = resolve_binaries(self._bin_dir)
        return self._bins

    @property
    def processes(self) -> list[process.ProcessRecord]:
        """The running component processes, in start order."""
        return list(self._records)

    @property
    def state_file(self) -> Path:
        """Path of the state file."""
        if self.workdir is None:
            raise DevClusterError("the dev cluster is not started")
        return self.workdir / STATE_FILE

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> DevCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(
        self,
        nodes: int = 3,
        gpus_per_node: int = 8,
        gpu_product: str = DEFAULT_GPU_PRODUCT,
        *,
        real_node: bool = False,
        registry: bool = False,
        pod_network: realnode.PodNetwork | None = None,
    ) -> DevCluster:
        """Start the control plane and create ``nodes`` Ready fake GPU nodes.

        The cluster gets the RuntimeClass ``nvidia`` a GPU Operator cluster has
        (``nodes.nvidia_runtime_class_manifest``), the chart's default agent runtime class.

        Args:
            nodes: Number of fake GPU nodes.
            gpus_per_node: ``nvidia.com/gpu`` capacity of each node.
            gpu_product: ``nvidia.com/gpu.product`` label of each node.
            real_node: Also start the real node ``realnode`` (containerd + kubelet, see
                :mod:`rlenergy_dev.devcluster.realnode`); its GPUs come from a device plugin.
            registry: Also start an OCI registry on 127.0.0.1 (:attr:`registry`); the real
                node's containerd pulls images named ``<registry host>/...`` from it and uses
                it as the mirror of ``ghcr.io`` (the chart's default image names).
            pod_network: With ``real_node``: the real node's pod network (its IP is the
                bridge's gateway, pods that are not ``hostNetwork`` get addresses on the
                bridge), and the API server dials a Service's endpoints, not its cluster IP
                (``--enable-aggregator-routing``: there is no kube-proxy), so it reaches a
                webhook served by a pod. Only for a cluster started in a network namespace the
                caller made, whose bridge exists (:func:`rlenergy_dev.devcluster.netns.
                private_network`).

        Returns:
            ``self``, ready to use.

        Raises:
            MissingBinaryError: A binary is missing (the message says ``make bins``).
            DevClusterError: A component failed to start; the message has its log tail.
        """
        if self._records:
            raise DevClusterError("the dev cluster is already started")
        if nodes < 0:
            raise ValueError(f"nodes must be >= 0, got {nodes}")
        if pod_network is not None and not real_node:
            raise ValueError("pod_network needs real_node=True: only the real node runs pods")
        self._pod_network = pod_network
        bins = self.binaries  # fail fast, before anything is started
        node_bins = None
        if real_node:
            node_bins = realnode.resolve_node_binaries(self._bin_dir or default_bin_dir())
        registry_bins = resolve_registry_binaries(self._bin_dir) if registry else None
        t_start = time.monotonic()
        self._stopped = False
        self._setup_workdir()
        with _LIVE_LOCK:
            _LIVE.append(self)
        _install_cleanup_hooks()
        try:
            self._start_control_plane(bins)
            self.kubectl(
                "apply", "--server-side", "-f", "-",
                input=json.dumps(nvidia_runtime_class_manifest()),
            )  # fmt: skip
            self._gpus_per_node, self._gpu_product = gpus_per_node, gpu_product
            self._write_state(ready=False)
            t0 = time.monotonic()
            self.add_nodes(nodes)
            if registry_bins is not None:
                self._start_registry()
            if node_bins is not None:
                self._start_real_node(node_bins, gpu_product)
            self._wait_default_service_account()
            self.timings["nodes_ready"] = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - t_start
        self._write_state(ready=True)
        return self

    def stop(self) -> None:
        """Stop every component (SIGTERM, SIGKILL after 10 s) and remove the temp dir.

        Safe to call more than once and from signal handlers.
        """
        if self._stopped:
            return
        self._stopped = True
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.remove(self)
        if self._real is not None:
            real, self._real = self._real, None
            with contextlib.suppress(Exception):
                real.stop()
            self._records = [r for r in self._records if r not in real.processes]
        if self._registry is not None:
            reg, self._registry = self._registry, None
            self._records = [r for r in self._records if r is not reg.record]
            with contextlib.suppress(Exception):
                reg.stop()
        if self._records:
            terminate_in_order(self._records, self._popens)
        self._records.clear()
        self._popens.clear()
        if self.workdir is None:
            return
        if self.keep_workdir:
            with contextlib.suppress(OSError):
                (self.workdir / STATE_FILE).unlink()
        elif self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            for entry in WORKDIR_ENTRIES:
                path = self.workdir / entry
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ nodes
    def add_nodes(
        self,
        count: int,
        *,
        gpus_per_node: int | None = None,
        gpu_product: str | None = None,
        timeout: float | None = None,
    ) -> list[str]:
        """Create ``count`` more fake GPU nodes and wait until KWOK reports them Ready.

        Args:
            count: How many nodes to add.
            gpus_per_node: GPUs per new node (default: as at :meth:`start`).
            gpu_product: GPU product label (default: as at :meth:`start`).
            timeout: Seconds to wait for Ready (default ``startup_timeout``).

        Returns:
            Names of the new nodes.
        """
        if count <= 0:
            return []
        gpus = self._gpus_per_node if gpus_per_node is None else gpus_per_node
        product = gpu_product or self._gpu_product
        first = len(self._nodes)
        names = [node_name(i) for i in range(first, first + count)]
        manifests = [gpu_node_manifest(n, gpus=gpus, gpu_product=product) for n in names]
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests})
        self.kubectl("create", "-f", "-", input=body)
        self._nodes += names
        wait = timeout if timeout is not None else self.startup_timeout
        self.kubectl(
            "wait",
            "--for=condition=Ready",
            f"--timeout={int(wait)}s",
            *(f"node/{n}" for n in names),
            timeout=wait + 30,
        )
        if self.workdir is not None and (self.workdir / STATE_FILE).exists():
            self._write_state(ready=True)
        return names

    # ------------------------------------------------------------------ clients
    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster.

        Args:
            *args: kubectl arguments (``--kubeconfig`` is added).
            input: Text for stdin.
            check: Raise :class:`DevClusterError` on a non-zero exit.
            timeout: Seconds before the call is abandoned.

        Returns:
            The completed process (text stdout/stderr).
        """
        return self._run(self.binaries.kubectl, args, input=input, check=check, timeout=timeout)

    def helm(
        self, *args: str, check: bool = True, timeout: float = 180.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned helm (v3) against this cluster, with its dirs under the workdir.

        Args:
            *args: helm arguments (``--kubeconfig`` is added).
            check: Raise :class:`DevClusterError` on a non-zero exit.
            timeout: Seconds before the call is abandoned.

        Returns:
            The completed process.
        """
        return self._run(self.binaries.helm, args, check=check, timeout=timeout)

    def wait_crds_established(self, *names: str, timeout_s: float = 60.0) -> None:
        """Wait until every CRD in ``names`` is Established and its resource is served.

        Polls the CRD's ``Established`` condition, then a listing of its resource
        (``kubectl get <plural>.<group> -A``: discovery can lag behind Established), rather
        than ``kubectl wait --for=condition=Established``, which on a CRD applied a moment ago
        can fail at once with a ``.status.conditions`` accessor error (no conditions yet)
        instead of waiting.

        Args:
            *names: CRD names (``<plural>.<group>``).
            timeout_s: deadline for all of them, s.

        Raises:
            DevClusterError: a CRD is not Established and served within ``timeout_s``; the
                message names it and kubectl's last answer.
        """
        deadline = time.monotonic() + timeout_s
        for name in names:
            last = ""
            while True:
                got = self.kubectl(
                    "get", f"crd/{name}", "-o",
                    'jsonpath={.status.conditions[?(@.type=="Established")].status}',
                    check=False,
                )  # fmt: skip
                if got.returncode == 0 and got.stdout.strip() == "True":
                    served = self.kubectl("get", name, "-A", check=False)
                    if served.returncode == 0:
                        break
                    got = served
                last = (got.stderr or got.stdout).strip()
                if time.monotonic() > deadline:
                    raise DevClusterError(
                        f"CRD {name} not Established and served within {timeout_s:.0f} s "
                        f"(kubectl: {last or 'no answer'}); see `kubectl describe crd/{name}`"
                    )
                time.sleep(0.2)

    def server_version(self) -> str:
        """``gitVersion`` the API server reports on ``/version``."""
        data = json.loads(self._get("/version"))
        return str(data["gitVersion"])

    def memory(self) -> dict[str, tuple[int, int]]:
        """``{component: (RSS KiB, peak RSS KiB)}`` of the running components."""
        return {r.name: process.memory_kib(r.pid) for r in self._records if process.is_alive(r)}

    # ------------------------------------------------------------------ internals
    def _setup_workdir(self) -> None:
        if self._workdir_arg is None:
            sweep_stale_workdirs()
            self.workdir = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
            self._owns_workdir = True
        else:
            self.workdir = self._workdir_arg
            # A directory that existed before is not ours to delete: only our entries are.
            self._owns_workdir = not self.workdir.exists()
            self.workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for sub in ("logs", "etcd", "helm"):
            (self.workdir / sub).mkdir(exist_ok=True)
        me = os.getpid()
        owner = process.ProcessRecord("owner", me, process.start_ticks(me), [], "")
        (self.workdir / OWNER_FILE).write_text(json.dumps(owner.to_json()))

    def _spawn(self, name: str, argv: Sequence[str]) -> process.ProcessRecord:
        assert self.workdir is not None
        proc, rec = process.spawn(
            name,
            argv,
            self.workdir / "logs" / f"{name}.log",
            env=_component_env(),
            die_with_parent=self.die_with_parent,
        )
        self._popens[proc.pid] = proc
        self._records.append(rec)
        return rec

    def _kcm_controllers(self) -> tuple[str, ...]:
        """``KCM_CONTROLLERS``, and with a pod network ``POD_NETWORK_CONTROLLERS``."""
        return KCM_CONTROLLERS + (POD_NETWORK_CONTROLLERS if self._pod_network else ())

    def _start_control_plane(self, bins: Binaries) -> None:
        assert self.workdir is not None
        t0 = time.monotonic()
        self._pki_mem = generate_pki()
        pki = self._pki = write_pki(self._pki_mem, self.workdir / "pki")
        self.timings["pki"] = time.monotonic() - t0

        # etcd --------------------------------------------------------------
        t0 = time.monotonic()
        workdir = self.workdir
        client = ""

        def etcd_argv() -> list[str]:
            nonlocal client
            peer = f"http://{LOOPBACK}:{free_port()}"
            client = f"http://{LOOPBACK}:{free_port()}"
            return [
                str(bins.etcd),
                "--name=dev",
                f"--data-dir={workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=dev={peer}",
                "--unsafe-no-fsync=true",
                "--auto-compaction-retention=1",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ]

        self._start_on_free_ports(
            "etcd",
            etcd_argv,
            lambda: json.loads(self._http(f"{client}/health"))["health"] == "true",
        )
        self.timings["etcd"] = time.monotonic() - t0

        # kube-apiserver ------------------------------------------------------
        t0 = time.monotonic()

        def apiserver_argv() -> list[str]:
            api_port = free_port()
            self._server = f"https://{LOOPBACK}:{api_port}"
            return [
                str(bins.kube_apiserver),
                f"--etcd-servers={client}",
                f"--bind-address={LOOPBACK}",
                f"--advertise-address={LOOPBACK}",
                f"--secure-port={api_port}",
                f"--cert-dir={workdir / 'pki'}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.client_ca_cert}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Node: the real node's kubelet (system:node:realnode) gets what it needs for
                # its own pods only; everyone else is authorized by RBAC.
                "--authorization-mode=Node,RBAC",
                # On by default; named so that the chart's node-scoped report policy
                # (helm/rl-energy/templates/admission.yaml) never silently stops applying.
                "--enable-admission-plugins=ValidatingAdmissionPolicy",
                # `kubectl logs` dials the real node's kubelet at its InternalIP (127.0.0.1),
                # never its host name (that would be a DNS lookup off this machine).
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-client-certificate={pki.admin_cert}",
                f"--kubelet-client-key={pki.admin_key}",
                "--allow-privileged=true",
                f"--service-account-issuer={self._server}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--endpoint-reconciler-type=none",
                "--enable-priority-and-fairness=false",
                "--max-requests-inflight=0",
                "--max-mutating-requests-inflight=0",
                "--profiling=false",
                "--v=1",
                # A pod network without kube-proxy: Services are reached at their endpoints.
                *(["--enable-aggregator-routing=true"] if self._pod_network else []),
            ]

        self._start_on_free_ports(
            "kube-apiserver", apiserver_argv, lambda: self._get("/readyz") == "ok"
        )
        self.timings["kube-apiserver"] = time.monotonic() - t0

        kubeconfig = render_kubeconfig(
            self._server,
            pki.serving_ca_cert.read_bytes(),
            pki.admin_cert.read_bytes(),
            pki.admin_key.read_bytes(),
        )
        self._kubeconfig = write_kubeconfig(self.workdir / "kubeconfig", kubeconfig)

        # KCM, scheduler, KWOK ------------------------------------------------
        self._spawn(
            "kube-controller-manager",
            [
                str(bins.kube_controller_manager),
                f"--kubeconfig={self._kubeconfig}",
                "--leader-elect=false",
                f"--bind-address={LOOPBACK}",
                "--secure-port=0",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.serving_ca_cert}",
                "--use-service-account-credentials=false",
                f"--controllers={','.join(self._kcm_controllers())}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                *(
                    [f"--node-monitor-grace-period={self.node_monitor_grace_s}s"]
                    if self.node_monitor_grace_s is not None
                    else []
                ),
                "--kube-api-qps=100",
                "--kube-api-burst=200",
                "--v=1",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(bins.kube_scheduler),
                f"--kubeconfig={self._kubeconfig}",
                "--leader-elect=false",
                f"--bind-address={LOOPBACK}",
                "--secure-port=0",
                "--kube-api-qps=100",
                "--kube-api-burst=200",
                "--v=1",
            ],
        )
        self._spawn(
            "kwok",
            [
                str(bins.kwok),
                f"--kubeconfig={self._kubeconfig}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                f"--node-ip={LOOPBACK}",
                f"--cidr={POD_CIDR}",
                "--node-lease-duration-seconds=40",
                *(f"--config={bins.kwok_stages / s}" for s in KWOK_STAGES),
            ],
        )

    def _start_registry(self) -> None:
        """The OCI registry on a free loopback port (its process is in the state file)."""
        assert self.workdir is not None
        t0 = time.monotonic()
        reg = Registry(
            self.workdir / "registry", self._bin_dir, die_with_parent=self.die_with_parent
        )
        self._registry = reg.start(self.startup_timeout)
        assert reg.record is not None
        self._records.append(reg.record)
        self.timings["registry"] = time.monotonic() - t0

    def _start_real_node(self, bins: realnode.NodeBinaries, gpu_product: str) -> None:
        """Containerd + kubelet of ``realnode``; waits until the node is Ready."""
        assert self.workdir is not None and self._pki is not None and self._pki_mem is not None
        t0 = time.monotonic()
        node = realnode.RealNode(
            self.workdir / "node",
            bins,
            self._spawn,
            self._popens,
            registries=self._registry.containerd_hosts() if self._registry is not None else {},
            pod_network=self._pod_network,
        )
        node.acquire()
        self._real = node
        node.start_containerd(self.startup_timeout)
        cert = client_cert(self._pki_mem, f"system:node:{node.name}", ("system:nodes",))
        kubeconfig = write_kubeconfig(
            node.base / "kubelet.kubeconfig",
            render_kubeconfig(
                self._server,
                self._pki.serving_ca_cert.read_bytes(),
                cert.cert_pem,
                cert.key_pem,
                user=f"system:node:{node.name}",
            ),
        )
        node.start_kubelet(
            kubeconfig=kubeconfig,
            client_ca=self._pki.client_ca_cert,
            port=free_port(),
            healthz_port=free_port(),
            labels={**realnode.LABELS, "nvidia.com/gpu.product": gpu_product},
            taints=[GPU_TAINT],
        )
        self._write_state(ready=False)
        deadline = time.monotonic() + max(self.startup_timeout, 120.0)
        status = ""
        stable = 0
        while True:
            node.check_alive()
            res = self.kubectl("get", "node", node.name, "-o", "json", check=False)
            if res.returncode == 0:
                st = json.loads(res.stdout).get("status", {})
                ready: dict[str, Any] = next(
                    (c for c in st.get("conditions", []) if c.get("type") == "Ready"), {}
                )
                status = f"{ready.get('status')} {ready.get('message', '')}"
                if {"type": "InternalIP", "address": node.node_ip} not in st.get("addresses", []):
                    # The kubelet refuses a loopback --node-ip ("nodeIP can't be loopback
                    # address") and then leaves the addresses alone; early after registration
                    # it may still write its own empty list. Set InternalIP 127.0.0.1 (as for
                    # the KWOK nodes) until it stays, so hostNetwork pods get 127.0.0.1 and
                    # probes and `kubectl logs` dial 127.0.0.1, never the VM's own address.
                    self.kubectl(
                        "patch", "node", node.name, "--subresource=status", "--type=merge",
                        "-p", json.dumps({"status": {"addresses": node.addresses}}),
                        check=False,
                    )  # fmt: skip
                    stable = 0
                elif ready.get("status") == "True":
                    stable += 1
                    if stable >= 3:  # Ready with its address over three checks (1.5 s)
                        break
            if time.monotonic() > deadline:
                assert node.kubelet is not None
                raise DevClusterError(
                    f"node {node.name} not Ready with InternalIP {node.node_ip} after "
                    f"{deadline - t0:.0f} s ({status}); last lines of {node.kubelet.log}:\n"
                    f"{process.tail(node.kubelet.log, 40)}"
                )
            time.sleep(0.5)
        self.timings["real_node"] = time.monotonic() - t0

    def _start_on_free_ports(
        self, name: str, argv: Callable[[], list[str]], probe: Callable[[], bool]
    ) -> process.ProcessRecord:
        """Spawn and wait; if another process grabbed a chosen port meanwhile, pick new ones."""
        for _ in range(PORT_ATTEMPTS):
            rec = self._spawn(name, argv())
            proc = self._popens[rec.pid]
            try:
                self._wait(rec, probe)
                return rec
            except DevClusterError:
                if proc.poll() is None or "address already in use" not in process.tail(rec.log):
                    raise
            self._records.remove(rec)
            del self._popens[rec.pid]
        raise DevClusterError(
            f"{name}: every free port chosen was taken before {name} could bind it "
            f"({PORT_ATTEMPTS} attempts); last lines of {rec.log}:\n{process.tail(rec.log)}"
        )

    def _check_alive(self) -> None:
        for rec in self._records:
            proc = self._popens.get(rec.pid)
            if proc is not None and proc.poll() is not None:
                raise DevClusterError(
                    f"{rec.name} exited with code {proc.returncode} while the dev cluster "
                    f"started; last lines of {rec.log}:\n{process.tail(rec.log)}"
                )

    def _wait(self, rec: process.ProcessRecord, probe: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last: str = ""
        while True:
            self._check_alive()
            try:
                if probe():
                    return
            except (OSError, ValueError, KeyError, urllib.error.URLError) as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise DevClusterError(
                    f"{rec.name} not ready after {self.startup_timeout:.0f} s (last probe error: "
                    f"{last or 'not ready'}); last lines of {rec.log}:\n{process.tail(rec.log)}"
                )
            time.sleep(0.25)

    def _wait_default_service_account(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            self._check_alive()
            res = self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False)
            if res.returncode == 0:
                return
            if time.monotonic() > deadline:
                kcm = next(r for r in self._records if r.name == "kube-controller-manager")
                raise DevClusterError(
                    "kube-controller-manager did not create serviceaccount/default in "
                    f"{self.startup_timeout:.0f} s; last lines of {kcm.log}:\n"
                    f"{process.tail(kcm.log)}"
                )
            time.sleep(0.5)

    def _http(self, url: str) -> str:
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if url.startswith("https://"):
            assert self._pki is not None
            ctx = ssl.create_default_context(cafile=str(self._pki.serving_ca_cert))
            ctx.load_cert_chain(str(self._pki.admin_cert), str(self._pki.admin_key))
            handlers.append(urllib.request.HTTPSHandler(context=ctx))
        opener = urllib.request.build_opener(*handlers)
        with opener.open(url, timeout=5) as resp:
            return str(resp.read().decode())

    def _get(self, path: str) -> str:
        return self._http(self._server + path)

    def _run(
        self,
        exe: Path,
        args: Sequence[str],
        *,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        env = _component_env()
        env["KUBECONFIG"] = str(self.kubeconfig)
        if self.workdir is not None:
            helm_home = self.workdir / "helm"
            env.setdefault("HELM_CACHE_HOME", str(helm_home / "cache"))
            env.setdefault("HELM_CONFIG_HOME", str(helm_home / "config"))
            env.setdefault("HELM_DATA_HOME", str(helm_home / "data"))
        argv = [str(exe), f"--kubeconfig={self.kubeconfig}", *args]
        try:
            res = subprocess.run(
                argv, input=input, capture_output=True, text=True, env=env, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            raise DevClusterError(f"{' '.join(argv)} timed out after {timeout} s") from exc
        if check and res.returncode != 0:
            raise DevClusterError(
                f"{exe.name} {' '.join(args)} failed ({res.returncode}):\n{res.stderr}{res.stdout}"
            )
        return res

    def _write_state(self, *, ready: bool) -> None:
        assert self.workdir is not None
        ClusterState(
            workdir=str(self.workdir),
            kubeconfig=str(self._kubeconfig or ""),
            server=self._server,
            k8s_version=K8S_VERSION,
            owner_pid=os.getpid(),
            ready=ready,
            nodes=list(self._nodes),
            gpus_per_node=self._gpus_per_node,
            gpu_product=self._gpu_product,
            processes=list(self._records),
            supervisor=self.supervisor,
        ).write(self.workdir / STATE_FILE)


def sweep_stale_workdirs(tmp: Path | None = None) -> list[Path]:
    """Remove temp workdirs whose owning process died without cleaning up (e.g. SIGKILL).

    Components of such a cluster were already killed by ``PR_SET_PDEATHSIG``; any that
    survived anyway are stopped here. Dirs of live owners are left alone.

    Args:
        tmp: Where to look (default: the system temp dir).

    Returns:
        The removed directories.
    """
    removed: list[Path] = []
    for path in (tmp or Path(tempfile.gettempdir())).glob(TMP_PREFIX + "*"):
        try:
            owner = process.ProcessRecord.from_json(json.loads((path / OWNER_FILE).read_text()))
        except (OSError, ValueError, KeyError):
            continue  # not ours, or still being created
        if process.is_alive(owner):
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, DevClusterError):
            state = ClusterState.read(path / STATE_FILE)
            terminate_in_order([p for p in state.processes if process.is_alive(p)])
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def terminate_in_order(
    records: Sequence[process.ProcessRecord],
    popens: dict[int, subprocess.Popen[bytes]] | None = None,
    *,
    grace: float = 10.0,
) -> list[str]:
    """Stop the etcd clients first and etcd last: an API server without etcd hangs on exit.

    Args:
        records: Component processes.
        popens: Popen handles of own children (reaped).
        grace: Seconds between SIGTERM and SIGKILL per phase.

    Returns:
        Names of the components that needed SIGKILL.
    """
    clients = [r for r in records if r.name != "etcd"]
    storage = [r for r in records if r.name == "etcd"]
    killed = process.terminate(clients, popens, grace=grace) if clients else []
    if storage:
        killed += process.terminate(storage, popens, grace=grace)
    return killed


def stop_from_state(state_file: Path, *, grace: float = 10.0) -> list[str]:
    """Stop a cluster started by another process, from its state file; remove its workdir.

    The supervisor (if any) is asked first (SIGTERM) so it stops its components itself;
    whatever is still alive afterwards is SIGTERMed and then SIGKILLed here.

    Args:
        state_file: The cluster's ``state.json``.
        grace: Seconds between SIGTERM and SIGKILL.

    Returns:
        Names of the processes that were still running and got stopped here.
    """
    state = ClusterState.read(state_file)
    stopped: list[str] = []
    if state.supervisor is not None and process.is_alive(state.supervisor):
        stopped.append(state.supervisor.name)
        process.terminate([state.supervisor], grace=grace + 5)
    alive = [p for p in state.processes if process.is_alive(p)]
    if alive:
        stopped += [p.name for p in alive]
        terminate_in_order(alive, grace=grace)
    shutil.rmtree(state.workdir, ignore_errors=True)
    return stopped
