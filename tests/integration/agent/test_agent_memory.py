"""The agent's memory request covers what the agent process uses on eight GPUs.

The agent process runs on the stand-in NVML (eight H100s, loaded by pynvml through
LD_LIBRARY_PATH) with the Kubernetes client loaded and the PodResources client made, as in its
pod (the API server and kubelet it is given answer nothing, so no listing adds to it). Its
resident set after start-up and 20 s of sampling stays under the chart's memory request, and
the limit leaves at least as much again for a real driver library and listings. The process maps
no ``grpcio`` C core (the PodResources client is ``grpclib``) and no ``cryptography`` library
(the serving key is made in a child process).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from rlenergy_dev import standin

from rlenergy.gpu import models

pytestmark = pytest.mark.slow

VALUES = Path(__file__).resolve().parents[3] / "helm" / "rl-energy" / "values.yaml"
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: none}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
"""


def _mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0}
    return float(quantity[:-2]) * units[quantity[-2:]]


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) / 1024


def test_the_agents_resident_set_fits_the_charts_request(
    tmp_path_factory: pytest.TempPathFactory,
):
    resources = yaml.safe_load(VALUES.read_text())["agent"]["resources"]
    request_mib = _mib(resources["requests"]["memory"])
    limit_mib = _mib(resources["limits"]["memory"])
    lib_dir = standin.build_library(tmp_path_factory.mktemp("standin-build"))
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rlem-"))  # short path for the socket
    uuids = [f"GPU-mem-{i}" for i in range(8)]
    drv = standin.StandinDriver(work / "state", [(u, models.get_sku("h100-sxm")) for u in uuids])
    (work / "kubeconfig").write_text(KUBECONFIG)
    (work / "kubelet.sock").write_text("")  # PodResources client made; nothing answers
    plan = {"step": 0, "phases": [{"phase": "generation", "clockMHz": 1100, "state": "locked"}]}
    (work / "plan.json").write_text(json.dumps(plan))
    env = {
        **os.environ,
        **drv.env(lib_dir),
        "RLENERGY_AGENT_KUBE": "true",
        "KUBECONFIG": str(work / "kubeconfig"),
        "RLENERGY_AGENT_PODRESOURCES_SOCKET": str(work / "kubelet.sock"),
    }
    argv = standin.agent_argv(
        "mem-node", work / "a.sock", work / "host", "--plan", str(work / "plan.json"),
        "--log-level", "CRITICAL",
    )  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)  # noqa: S603
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        proc.stdout.close()  # the agent prints one line; its logs go to stderr
        assert ready["ready"] is True
        rss = []
        for _ in range(20):
            time.sleep(1)
            rss.append(_rss_mib(proc.pid))
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
    finally:
        proc.terminate()
        proc.wait(30)
        drv.close()
    print(f"agent VmRSS on 8 stand-in GPUs: {min(rss):.1f}-{max(rss):.1f} MiB")
    libraries = {ln.split()[-1] for ln in maps.splitlines() if ".so" in ln}
    assert not [p for p in libraries if "/grpc/" in p or "/cryptography/" in p], libraries
    assert any("libnvidia-ml" in p for p in libraries), libraries  # the maps were read right
    assert max(rss) < request_mib, (rss, request_mib)
    assert limit_mib >= 2 * max(rss), (rss, limit_mib)
