"""The agent as a process on the stand-in NVML, loaded by pynvml through LD_LIBRARY_PATH:
SIGKILL mid-phase then restart resets the stale lock; SIGTERM resets every lock.

The trainer is a pod object on a KWOK node of the dev cluster and signals with a token the API
server bound to it; the agent checks it by TokenReview (``rlenergy_dev.devcluster.trainers``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rlenergy_dev import standin
from rlenergy_dev.devcluster import DevCluster, trainers

from rlenergy.gpu import models
from rlenergy.sdk import trainer

pytestmark = pytest.mark.e2e  # needs the control plane (the trainer's token)

PLAN = {"step": 0, "phases": [{"phase": "generation", "clockMHz": 1100, "state": "locked"}]}


class Setup:
    def __init__(
        self,
        drv: standin.StandinDriver,
        lib_dir: Path,
        work: Path,
        cluster: DevCluster,
        pod: trainers.TrainerPod,
    ) -> None:
        self.drv, self.lib_dir, self.work, self.cluster, self.pod = drv, lib_dir, work, cluster, pod

    def client(self) -> trainer.RLEnergyClient:
        return trainer.RLEnergyClient(
            str(self.work / "a.sock"), strict=True, token_file=str(self.pod.token_file)
        )


@pytest.fixture
def setup(tmp_path_factory: pytest.TempPathFactory, dev_cluster: DevCluster) -> Iterator[Setup]:
    lib_dir = standin.build_library(tmp_path_factory.mktemp("standin-build"))
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rlea-"))  # short path for the socket
    ns = f"agent-proc-{uuid.uuid4().hex[:6]}"
    dev_cluster.kubectl("create", "namespace", ns)
    pod = trainers.create_trainer(dev_cluster.kubectl, ns, "trainer", dev_cluster.nodes[0], work)
    uuids = [f"GPU-proc-{i}" for i in range(4)]
    drv = standin.StandinDriver(work / "state", [(u, models.get_sku("h100-sxm")) for u in uuids])
    (work / "plan.json").write_text(json.dumps(PLAN))
    yield Setup(drv, lib_dir, work, dev_cluster, pod)
    drv.close()
    dev_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _start(setup: Setup) -> subprocess.Popen[str]:
    drv, lib_dir, work = setup.drv, setup.lib_dir, setup.work
    env = dict(os.environ)
    env.update(drv.env(lib_dir))
    env["RLENERGY_AGENT_STATIC_PODS"] = json.dumps({setup.pod.static_key: list(drv.uuids[:2])})
    env["RLENERGY_AGENT_KUBE"] = "true"
    env["KUBECONFIG"] = str(setup.cluster.kubeconfig)
    proc = subprocess.Popen(
        standin.agent_argv(
            setup.pod.node,
            work / "a.sock",
            work / "host",
            "--plan",
            str(work / "plan.json"),
            "--log-level",
            "WARNING",
        ),  # fmt: skip
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
    setup: Setup,
) -> None:
    drv = setup.drv
    proc = _start(setup)
    client = setup.client()
    client.phase("generation", step=0)
    client.close()
    locked = [u for u in drv.uuids if drv.gpu(u).locked]
    assert locked == list(drv.uuids[:2]) and drv.gpu(locked[0]).lock_max_mhz == 1095
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert [u for u in drv.uuids if drv.gpu(u).locked] == locked  # the lock outlives the agent
    proc = _start(setup)
    try:
        assert not any(drv.gpu(u).locked for u in drv.uuids)  # recovered at start-up
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_sigterm_resets_every_lock(setup: Setup) -> None:
    drv = setup.drv
    proc = _start(setup)
    client = setup.client()
    client.phase("generation", step=0)
    client.close()
    assert sum(drv.gpu(u).locked for u in drv.uuids) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not any(drv.gpu(u).locked for u in drv.uuids)


def test_no_permission_agent_keeps_running_measure_only(
    setup: Setup,
) -> None:
    drv = setup.drv
    for u in drv.uuids:
        drv.gpu(u).fail_clock_set = standin.NO_PERMISSION
    proc = _start(setup)
    try:
        client = setup.client()
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
