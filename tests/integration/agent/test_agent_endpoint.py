"""The agent process: start-up on a squatted socket path; header and connection exhaustion.

The agent runs as a process on the stand-in NVML (no API server: ``RLENERGY_AGENT_KUBE=false``,
so signals with a token answer 503, and one without answers 401 before any review). Its
resident memory is read from ``/proc/<pid>/status`` while the attack's connections are held.
The chart's agent memory limit is ``AGENT_MEMORY_LIMIT_MIB``; an OOM kill would skip the clock
reset on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rlenergy_dev import standin

from rlenergy.gpu import models

AGENT_MEMORY_LIMIT_MIB = 96
"""The agent container's memory limit in the chart (helm/rl-energy/values.yaml)."""
ROOT = Path(__file__).resolve().parents[3]
"""The checkout under test: the agent process runs its code, not an installed copy."""
PLAN = {"step": 0, "phases": [{"phase": "generation", "clockMHz": 1100, "state": "locked"}]}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Agent:
    def __init__(self, proc: subprocess.Popen[str], sock: Path) -> None:
        self.proc, self.sock = proc, sock

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(self.sock))
        return s

    def unauthenticated_status(self) -> int:
        """Status of a signal without a token (401 when the agent serves)."""
        with self.connect() as s:
            s.sendall(b"POST /v1/phase HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            data = s.recv(4096)
        return int(data.split(b" ")[1]) if data.startswith(b"HTTP/") else 0

    def rss_mib(self) -> float:
        return _rss_mib(self.proc.pid)


def _setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[standin.StandinDriver, Path, list[str], dict[str, str]]:
    lib_dir = standin.build_library(tmp_path_factory.mktemp("standin-build"))
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rlex-"))
    uuids = [f"GPU-exh-{i}" for i in range(2)]
    drv = standin.StandinDriver(work / "state", [(u, models.get_sku("h100-sxm")) for u in uuids])
    (work / "plan.json").write_text(json.dumps(PLAN))
    argv = standin.agent_argv(
        "node-1", work / "a.sock", work / "host",
        "--plan", str(work / "plan.json"), "--log-level", "WARNING",
    )  # fmt: skip
    env = dict(os.environ)
    env.update(drv.env(lib_dir))
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / p) for p in (".", "agent", "operator"))
    env["RLENERGY_AGENT_KUBE"] = "false"
    env["RLENERGY_AGENT_STATIC_PODS"] = json.dumps({"team-a/trainer-0/uid-1": uuids})
    return drv, work, argv, env


def test_a_directory_at_the_socket_path_stops_start_up_with_one_line(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    drv, work, argv, env = _setup(tmp_path_factory)
    (work / "a.sock").mkdir()  # what a tenant with a writable mount can leave there
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert not any(drv.gpu(u).locked for u in drv.uuids)
    finally:
        drv.close()
    errors = [ln for ln in done.stderr.splitlines() if " ERROR " in ln]
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and "is a directory, not a socket" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert (work / "a.sock").is_dir()


@pytest.fixture
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    drv, work, argv, env = _setup(tmp_path_factory)
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["ready"]
        proc.stdout.close()
        yield Agent(proc, work / "a.sock")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        drv.close()


def test_large_headers_on_20_connections_stay_under_the_limit(agent: Agent) -> None:
    before = agent.rss_mib()
    held: list[socket.socket] = []
    line = b"X-Pad: " + b"a" * 64_000 + b"\r\n"
    try:
        for _ in range(20):
            s = agent.connect()
            held.append(s)
            with contextlib.suppress(OSError):
                s.sendall(b"POST /v1/phase HTTP/1.1\r\nHost: x\r\n")
                for _ in range(98):  # 99 lines of 64 kB, unfinished: all the stdlib allows
                    s.sendall(line)
        time.sleep(1.0)
        during = agent.rss_mib()
    finally:
        for s in held:
            s.close()
    print(f"agent RSS: {before:.1f} MiB before, {during:.1f} MiB with 20 large-header connections")
    assert during < AGENT_MEMORY_LIMIT_MIB
    assert during - before < 16
    assert agent.unauthenticated_status() == 401


def test_3500_idle_connections_stay_under_the_limit(agent: Agent) -> None:
    before = agent.rss_mib()
    held: list[socket.socket] = []
    try:
        for _ in range(3500):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(agent.sock))  # blocking: waits for room in the listen backlog
            except OSError:
                s.close()
                continue
            held.append(s)
        assert len(held) >= 3000
        time.sleep(2.0)
        during = agent.rss_mib()
        threads = len(os.listdir(f"/proc/{agent.proc.pid}/task"))
    finally:
        for s in held:
            s.close()
    print(
        f"agent RSS: {before:.1f} MiB before, {during:.1f} MiB with {len(held)} idle "
        f"connections ({threads} threads)"
    )
    assert during < AGENT_MEMORY_LIMIT_MIB
    assert threads < 100
    deadline = time.monotonic() + 15
    while agent.unauthenticated_status() != 401:  # served again once the flood is gone
        assert time.monotonic() < deadline
        time.sleep(0.2)
