"""``python -m rlenergy_dev.devcluster up|down|kubeconfig|status``: the dev cluster from the shell.

``up`` starts a detached supervisor process (``_supervise``) that owns the components and
records them in ``<cache>/dev-cluster/state.json``; it returns once the nodes are Ready.
``down`` (from any shell) stops the supervisor and, as a fallback, every recorded component.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import rlenergy_dev
from rlenergy_dev.devcluster import process
from rlenergy_dev.devcluster.binaries import K8S_VERSION, cache_root, find_kubectl, resolve_binaries
from rlenergy_dev.devcluster.cluster import STATE_FILE, ClusterState, DevCluster, stop_from_state
from rlenergy_dev.devcluster.errors import DevClusterError, MissingBinaryError
from rlenergy_dev.devcluster.nodes import DEFAULT_GPU_PRODUCT

PROG = "python -m rlenergy_dev.devcluster"


def cluster_dir() -> Path:
    """Where ``up`` keeps the cluster: ``$RLENERGY_DEVCLUSTER_DIR`` or ``<cache>/dev-cluster``."""
    env = os.environ.get("RLENERGY_DEVCLUSTER_DIR")
    return Path(env) if env else cache_root() / "dev-cluster"


def supervisor_log() -> Path:
    """The supervisor's log; it lives next to the cluster dir so it survives ``down``."""
    return cluster_dir().with_name(cluster_dir().name + ".log")


def _err(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)


def _read_state() -> ClusterState | None:
    path = cluster_dir() / STATE_FILE
    if not path.is_file():
        return None
    try:
        return ClusterState.read(path)
    except (OSError, ValueError, KeyError, DevClusterError):
        return None


def _alive(state: ClusterState) -> list[process.ProcessRecord]:
    recs = list(state.processes)
    if state.supervisor is not None:
        recs.append(state.supervisor)
    return [r for r in recs if process.is_alive(r)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A real Kubernetes control plane with fake GPU nodes on 127.0.0.1 (no Docker).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("up", "start the dev cluster in the background and wait until it is ready"),
        ("_supervise", argparse.SUPPRESS),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--nodes", type=int, default=3, help="fake GPU nodes (default 3)")
        p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
        p.add_argument("--gpu-product", default=DEFAULT_GPU_PRODUCT, help="nvidia.com/gpu.product")
        p.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for readiness")
        p.add_argument(
            "--real-node",
            action="store_true",
            help="also run one real node (containerd + kubelet, hostNetwork pods; root; "
            "docs/dev-cluster.md)",
        )
        p.add_argument(
            "--registry",
            action="store_true",
            help="also run an OCI registry on 127.0.0.1 (plain HTTP; the real node pulls from "
            "it; docs/dev-cluster.md)",
        )
        if name == "up":
            p.add_argument(
                "--foreground",
                action="store_true",
                help="run in this process until Ctrl-C instead of detaching",
            )
    sub.add_parser("down", help="stop the dev cluster; no process is left behind")
    sub.add_parser("kubeconfig", help="print the path of the admin kubeconfig")
    sub.add_parser("status", help="show the components, their memory and the nodes")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of ``python -m rlenergy_dev.devcluster``.

    Args:
        argv: The arguments (e.g. ``["up", "--nodes", "3"]``).

    Returns:
        The process exit status.
    """
    args = _parser().parse_args(argv)
    try:
        if args.command == "up":
            if args.foreground:
                return _serve(args, supervisor=False)
            return _up(args)
        if args.command == "_supervise":
            return _serve(args, supervisor=True)
        if args.command == "down":
            return _down()
        if args.command == "kubeconfig":
            return _kubeconfig()
        return _status()
    except MissingBinaryError as exc:
        _err(str(exc))
        return 2
    except DevClusterError as exc:
        _err(str(exc))
        return 1


# ---------------------------------------------------------------------------- up
def _prepare_dir() -> ClusterState | None:
    """Return the running cluster's state, or clean up leftovers and return None."""
    state = _read_state()
    if state is not None and _alive(state):
        return state
    if state is not None:
        stop_from_state(cluster_dir() / STATE_FILE)
    shutil.rmtree(cluster_dir(), ignore_errors=True)
    return None


def _up(args: argparse.Namespace) -> int:
    running = _prepare_dir()
    if running is not None:
        _err(f"already up ({running.server}, {len(running.nodes)} nodes); `down` stops it")
        print(running.kubeconfig)
        return 0
    resolve_binaries()  # a missing binary fails here, with the fix, before anything starts
    cluster_dir().mkdir(parents=True, mode=0o700)
    log = supervisor_log()
    log.unlink(missing_ok=True)
    env = rlenergy_dev.source_env(os.environ)
    argv = [
        sys.executable,
        "-m",
        "rlenergy_dev.devcluster",
        "_supervise",
        f"--nodes={args.nodes}",
        f"--gpus-per-node={args.gpus_per_node}",
        f"--gpu-product={args.gpu_product}",
        f"--timeout={args.timeout}",
        *(["--real-node"] if args.real_node else []),
        *(["--registry"] if args.registry else []),
    ]
    t0 = time.monotonic()
    proc, rec = process.spawn("supervisor", argv, log, env=env, die_with_parent=False)
    deadline = t0 + args.timeout + 30
    while True:
        state = _read_state()
        if state is not None and state.ready:
            break
        if proc.poll() is not None:
            _err(f"the dev cluster failed to start; {log}:\n{process.tail(log, 40)}")
            return 1
        if time.monotonic() > deadline:
            process.terminate([rec], {proc.pid: proc}, grace=20)
            _err(f"not ready after {args.timeout:.0f} s; {log}:\n{process.tail(log, 40)}")
            return 1
        time.sleep(0.3)
    _err(
        f"up in {time.monotonic() - t0:.1f} s: {state.server}, {len(state.nodes)} nodes x "
        f"{state.gpus_per_node} {state.gpu_product}; logs in {cluster_dir() / 'logs'}"
    )
    _err(f'use: export KUBECONFIG="$({PROG} kubeconfig)"')
    print(state.kubeconfig)
    return 0


def _serve(args: argparse.Namespace, *, supervisor: bool) -> int:
    """Run the cluster in this process until SIGTERM/SIGINT/SIGHUP."""
    stop = threading.Event()
    started = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not started:
            raise SystemExit(128 + signum)  # unwinds start(), which stops what it started
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if not supervisor:
        running = _prepare_dir()
        if running is not None:
            _err(f"already up ({running.server}); `down` stops it")
            return 1
    cluster = DevCluster(cluster_dir(), startup_timeout=args.timeout)
    me = os.getpid()
    cluster.supervisor = process.ProcessRecord(
        "supervisor", me, process.start_ticks(me), list(sys.argv), str(supervisor_log())
    )
    print(f"starting dev cluster in {cluster_dir()} ({K8S_VERSION})", flush=True)
    try:
        cluster.start(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_product=args.gpu_product,
            real_node=args.real_node,
            registry=args.registry,
        )
        started = True
        timings = ", ".join(f"{k} {v:.1f}s" for k, v in cluster.timings.items())
        print(f"ready: {cluster.server} kubeconfig {cluster.kubeconfig} ({timings})", flush=True)
        if cluster.registry is not None:
            print(f"registry: {cluster.registry.host} (plain HTTP)", flush=True)
        if not supervisor:
            print(
                f'export KUBECONFIG="{cluster.kubeconfig}"  # Ctrl-C stops the cluster', flush=True
            )
        reported: set[str] = set()
        while not stop.wait(1.0):
            for rec in cluster.processes:
                if rec.name not in reported and not process.is_alive(rec):
                    reported.add(rec.name)
                    print(f"{rec.name} died; last lines of {rec.log}:", flush=True)
                    print(process.tail(rec.log), flush=True)
        print("stopping", flush=True)
    finally:
        cluster.stop()
    print("stopped", flush=True)
    return 0


# ---------------------------------------------------------------------------- down etc.
def _down() -> int:
    path = cluster_dir() / STATE_FILE
    if not path.is_file():
        existed = cluster_dir().exists()
        shutil.rmtree(cluster_dir(), ignore_errors=True)
        _err("no dev cluster running" + (" (removed a leftover dir)" if existed else ""))
        return 0
    state = ClusterState.read(path)
    stopped = stop_from_state(path)
    left = _alive(state)
    if left:
        _err(f"could not stop: {', '.join(f'{r.name} (pid {r.pid})' for r in left)}")
        return 1
    _err(f"stopped {', '.join(stopped) if stopped else 'nothing (it had already exited)'}")
    return 0


def _kubeconfig() -> int:
    state = _read_state()
    if state is None or not state.ready or not _alive(state):
        _err(f"no dev cluster running; start one with `{PROG} up`")
        return 1
    print(state.kubeconfig)
    return 0


def _status() -> int:
    state = _read_state()
    if state is None:
        print("dev cluster: not running")
        return 1
    print(f"dev cluster: {state.server} ({state.k8s_version}), ready={state.ready}")
    print(f"  kubeconfig: {state.kubeconfig}")
    healthy = True
    recs = ([state.supervisor] if state.supervisor else []) + state.processes
    total_rss = total_hwm = 0
    for rec in recs:
        alive = process.is_alive(rec)
        healthy &= alive
        rss, hwm = process.memory_kib(rec.pid) if alive else (0, 0)
        total_rss, total_hwm = total_rss + rss, total_hwm + hwm
        print(
            f"  {rec.name:<24} pid {rec.pid:<8} {'running' if alive else 'DEAD':<8}"
            f" rss {rss / 1024:7.1f} MiB  peak {hwm / 1024:7.1f} MiB"
        )
    print(
        f"  {'total':<24} {'':<21} rss {total_rss / 1024:7.1f} MiB"
        f"  peak {total_hwm / 1024:7.1f} MiB"
    )
    if healthy and state.ready:
        try:
            kubectl = find_kubectl(cluster_dir())
            res = subprocess.run(
                [
                    str(kubectl),
                    f"--kubeconfig={state.kubeconfig}",
                    "get",
                    "nodes",
                    "-L",
                    "nvidia.com/gpu.product",
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            print(res.stdout.rstrip() or res.stderr.rstrip())
        except (MissingBinaryError, subprocess.TimeoutExpired) as exc:
            print(f"  (nodes unavailable: {exc})")
    return 0 if healthy and state.ready else 1
