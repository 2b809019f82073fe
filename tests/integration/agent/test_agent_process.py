"""The agent as a process on the stand-in NVML, loaded by pynvml through LD_LIBRARY_PATH:
SIGKILL mid-phase then restart resets the stale lock; SIGTERM resets every lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from rlenergy_agent.testing import standin

from rlenergy.sdk import trainer
from rlenergy.sim import models

PLAN = {"step": 0, "phases": [{"phase": "generation", "clockMHz": 1100, "state": "locked"}]}


@pytest.fixture
def setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[standin.StandinDriver, Path, Path]]:
    lib_dir = standin.build_library(tmp_path_factory.mktemp("standin-build"))
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rlea-"))  # short path for the socket
    uuids = [f"GPU-proc-{i}" for i in range(4)]
    drv = standin.StandinDriver(work / "state", [(u, models.get_sku("h100-sxm")) for u in uuids])
    (work / "plan.json").write_text(json.dumps(PLAN))
    yield drv, lib_dir, work
    drv.close()


def _start(drv: standin.StandinDriver, lib_dir: Path, work: Path) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.update(drv.env(lib_dir))
    env["RLENERGY_AGENT_STATIC_PODS"] = json.dumps({"ns/trainer": list(drv.uuids[:2])})
    env["RLENERGY_AGENT_DEV_CALLER_POD"] = "ns/trainer"
    env["RLENERGY_AGENT_KUBE"] = "false"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlenergy_agent",
            "--node",
            "n1",
            "--backend",
            "nvml",
            "--socket",
            str(work / "a.sock"),
            "--state-dir",
            str(work / "host"),
            "--metrics-port",
            "0",
            "--plan",
            str(work / "plan.json"),
            "--log-level",
            "WARNING",
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()  # the agent prints one line; logs go to stderr
    assert json.loads(line)["ready"]
    return proc


def test_sigkill_mid_phase_then_restart_resets_clocks(
    setup: tuple[standin.StandinDriver, Path, Path],
) -> None:
    drv, lib_dir, work = setup
    proc = _start(drv, lib_dir, work)
    client = trainer.RLEnergyClient(str(work / "a.sock"), strict=True)
    client.phase("generation", step=0)
    client.close()
    locked = [u for u in drv.uuids if drv.gpu(u).locked]
    assert locked == list(drv.uuids[:2]) and drv.gpu(locked[0]).lock_max_mhz == 1095
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert [u for u in drv.uuids if drv.gpu(u).locked] == locked  # the lock outlives the agent
    proc = _start(drv, lib_dir, work)
    try:
        assert not any(drv.gpu(u).locked for u in drv.uuids)  # recovered at start-up
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_sigterm_resets_every_lock(setup: tuple[standin.StandinDriver, Path, Path]) -> None:
    drv, lib_dir, work = setup
    proc = _start(drv, lib_dir, work)
    client = trainer.RLEnergyClient(str(work / "a.sock"), strict=True)
    client.phase("generation", step=0)
    client.close()
    assert sum(drv.gpu(u).locked for u in drv.uuids) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not any(drv.gpu(u).locked for u in drv.uuids)


def test_no_permission_agent_keeps_running_measure_only(
    setup: tuple[standin.StandinDriver, Path, Path],
) -> None:
    drv, lib_dir, work = setup
    for u in drv.uuids:
        drv.gpu(u).fail_clock_set = standin.NO_PERMISSION
    proc = _start(drv, lib_dir, work)
    try:
        client = trainer.RLEnergyClient(str(work / "a.sock"), strict=True)
        client.phase("generation", step=0)
        applied = client.last_response["applied"]
        client.close()
        assert all(
            a["skipped"] == "NoPermission (agent needs CAP_SYS_ADMIN)" for a in applied.values()
        )
        assert not any(drv.gpu(u).locked for u in drv.uuids)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
