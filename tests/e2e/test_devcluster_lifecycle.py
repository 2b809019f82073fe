"""Starting and stopping: the CLI (up/status/kubeconfig/down), add_nodes, SIGTERM cleanup.

Each test starts its own small cluster next to the session one (different ports).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import rlenergy_dev
from e2e_support import wait_until
from rlenergy_dev.devcluster import process
from rlenergy_dev.devcluster.binaries import find_kubectl
from rlenergy_dev.devcluster.cluster import ClusterState


def _env(tmp_path: Path) -> dict[str, str]:
    env = rlenergy_dev.source_env(os.environ)
    env["RLENERGY_DEVCLUSTER_DIR"] = str(tmp_path / "dev-cluster")
    return env


def _cli(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlenergy_dev.devcluster", *args],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        cwd=tmp_path,
        timeout=timeout,
    )


def _ready_nodes(kubeconfig: str) -> list[str]:
    kubectl = find_kubectl(Path("/nonexistent"))
    out = subprocess.run(
        [str(kubectl), f"--kubeconfig={kubeconfig}", "get", "nodes", "-o", "json"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [
        n["metadata"]["name"]
        for n in json.loads(out.stdout)["items"]
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
    ]


@pytest.mark.timeout(420)
def test_cli_up_kubeconfig_status_down(tmp_path: Path):
    state_file = tmp_path / "dev-cluster" / "state.json"
    try:
        up = _cli(tmp_path, "up", "--nodes", "3", "--gpus-per-node", "4")
        assert up.returncode == 0, up.stderr
        kubeconfig = up.stdout.strip()
        assert Path(kubeconfig).is_file()

        again = _cli(tmp_path, "up")  # idempotent: reports the running cluster
        assert again.returncode == 0 and again.stdout.strip() == kubeconfig
        assert "already up" in again.stderr

        kc = _cli(tmp_path, "kubeconfig")
        assert kc.returncode == 0 and kc.stdout.strip() == kubeconfig
        assert sorted(_ready_nodes(kubeconfig)) == ["kwok-gpu-0", "kwok-gpu-1", "kwok-gpu-2"]

        status = _cli(tmp_path, "status")
        assert status.returncode == 0, status.stdout
        for name in ("supervisor", "etcd", "kube-apiserver", "kube-scheduler", "kwok"):
            assert name in status.stdout
        assert "DEAD" not in status.stdout

        state = ClusterState.read(state_file)
        assert state.supervisor is not None
        records = [state.supervisor, *state.processes]
        assert all(process.is_alive(r) for r in records)
    finally:
        down = _cli(tmp_path, "down")
    assert down.returncode == 0, down.stderr
    assert not any(process.is_alive(r) for r in records), "a process survived `down`"
    assert not (tmp_path / "dev-cluster").exists()
    assert _cli(tmp_path, "kubeconfig").returncode == 1
    assert _cli(tmp_path, "down").returncode == 0  # nothing to do is fine


_SCRIPT = """
import json, sys, time
from rlenergy_dev.devcluster import DevCluster
cluster = DevCluster(startup_timeout=120)
cluster.start(nodes=1, gpus_per_node=4, gpu_product="NVIDIA-A100-SXM4-80GB")
added = cluster.add_nodes(1, gpus_per_node=2)
print(json.dumps({"workdir": str(cluster.workdir), "kubeconfig": str(cluster.kubeconfig),
                  "added": added, "pids": [[r.pid, r.start_ticks] for r in cluster.processes]}),
      flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(300)
def test_add_nodes_and_cleanup_on_sigterm(tmp_path: Path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "no output"
        info = json.loads(line)
        records = [process.ProcessRecord("c", pid, ticks, [], "") for pid, ticks in info["pids"]]
        assert len(records) == 5 and all(process.is_alive(r) for r in records)
        assert info["added"] == ["kwok-gpu-1"]
        assert sorted(_ready_nodes(info["kubeconfig"])) == ["kwok-gpu-0", "kwok-gpu-1"]
        kubectl = find_kubectl(Path("/nonexistent"))
        gpus = subprocess.run(
            [str(kubectl), f"--kubeconfig={info['kubeconfig']}", "get", "nodes", "-o",
             "jsonpath={.items[*].status.allocatable.nvidia\\.com/gpu}"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert sorted(gpus.stdout.split()) == ["2", "4"]

        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert proc.returncode == -signal.SIGTERM
    wait_until(
        lambda: not any(process.is_alive(r) for r in records), timeout=15, what="all stopped"
    )
    assert not Path(info["workdir"]).exists(), "temp dir left behind"


@pytest.mark.timeout(180)
def test_port_taken_between_choice_and_bind_is_retried(monkeypatch):
    from rlenergy_dev.devcluster import DevCluster
    from rlenergy_dev.devcluster import cluster as cluster_mod

    squatter = socket.create_server(("127.0.0.1", 0))
    taken = squatter.getsockname()[1]
    real = cluster_mod.free_port
    calls = {"n": 0}

    def racy_free_port() -> int:
        calls["n"] += 1
        return taken if calls["n"] <= 2 else real()  # etcd's first peer + client ports

    monkeypatch.setattr(cluster_mod, "free_port", racy_free_port)
    try:
        with DevCluster(startup_timeout=120) as cluster:
            cluster.start(nodes=1, gpus_per_node=1)
            etcd = next(r for r in cluster.processes if r.name == "etcd")
            assert "address already in use" in Path(etcd.log).read_text()
            assert f":{taken}" not in " ".join(etcd.argv)
            assert cluster.server_version() == "v1.36.3"
    finally:
        squatter.close()


@pytest.mark.timeout(120)
def test_failed_start_reports_the_log_and_leaves_nothing(tmp_path: Path, monkeypatch):
    from rlenergy_dev.devcluster import DevCluster, DevClusterError, resolve_binaries

    real = resolve_binaries()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("etcd", "kube-controller-manager", "kube-scheduler", "kwok", "helm"):
        (bin_dir / name).symlink_to(real.etcd.parent / name)
    broken = bin_dir / "kube-apiserver"
    broken.write_text("#!/bin/sh\necho 'boom: cannot start' >&2\nexit 3\n")
    broken.chmod(0o755)
    cluster = DevCluster(bin_dir=bin_dir, startup_timeout=60)
    with pytest.raises(DevClusterError, match=r"(?s)kube-apiserver exited with code 3.*boom"):
        cluster.start(nodes=1)
    assert cluster.workdir is not None and not cluster.workdir.exists()
    assert cluster.processes == []
    # etcd had started before the API server failed: it must be gone too.
    leftovers = []
    for proc_dir in Path("/proc").iterdir():
        try:
            cmdline = (proc_dir / "cmdline").read_bytes()
        except OSError:
            continue
        if str(cluster.workdir).encode() in cmdline:
            leftovers.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    assert leftovers == []


@pytest.mark.timeout(180)
def test_an_existing_workdir_keeps_foreign_files(tmp_path: Path):
    from rlenergy_dev.devcluster import DevCluster

    workdir = tmp_path / "mine"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("keep me")
    with DevCluster(workdir, startup_timeout=120) as cluster:
        cluster.start(nodes=1)
        assert (workdir / "kubeconfig").is_file() and (workdir / "state.json").is_file()
    assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]
