"""docs/install.md's runbook, run as written on a fresh dev cluster with its real node.

The dev cluster starts with its real node only (``DevCluster.start(nodes=0, real_node=True)``:
kubelet + containerd, NVIDIA Container Toolkit's runtime as handler ``nvidia``, as
``tests/e2e/test_real_node.py`` describes). What a GPU node brings before the runbook starts is
set up as there: the images ``make images`` builds imported into containerd under the names the
docs give (``ghcr.io/rl-energy/rl-energy-{operator,agent}:<version>``, the chart's defaults, so
no image value is substituted), eight stand-in GPUs with a CDI spec, advertised by the device
plugin. The stand-in GPUs run a steady memory-bound load the whole time (the work of a node in
use: the smoke pod itself runs no GPU kernel), so the locked clock shows as a positive saving.

Then the commands of install.md's steps 1 to 6 and of its uninstall section
(``runbook_support.runbook``), each run by ``bash -c`` from the checkout's root, exactly as the
page writes them, with ``kubectl`` (the pinned kubectl), ``helm`` and ``kubectl-rlenergy`` (the
single file ``hack/kubectl-plugin.py`` builds, run by ``python3`` with the plugin's dependencies)
on ``PATH`` and the cluster's kubeconfig in ``KUBECONFIG``. The one addition is the one step 2
names: ``helm install`` gets ``-f <values file>`` with this cluster's needs (no pod network:
``hostNetwork`` and the API server's address; the kubelet's folders; free host ports, one
operator replica on the one node). We test these aspects:

* every command of the runbook exits 0, in order, on a fresh cluster;
* the smoke test (step 3, ``kubectl rlenergy smoke``) prints what the page shows after it, line
  for line (``ok`` report, lock, saving, ``PASS``), and the saving is positive on the loaded GPUs;
* after step 6 the observe policy is in enforce mode (``kubectl rlenergy status -o json``);
* after the uninstall steps: no GPU clock locked, no policy or finalizer left, no pod in the
  release namespace, this chart's CRDs gone and kopf's shared peering CRDs
  (``clusterkopfpeerings.kopf.dev``, ``kopfpeerings.kopf.dev``) still there.

Figures (wall time per step, the smoke output) are printed and written to
``build/runbook-e2e.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    IMAGE_REPO,
    IMAGES,
    ROOT,
    SYSTEM_NS,
    TAG,
    get_json,
    real_node_cluster,
    real_node_values,
    start_nvidia_device_plugin,
    wait_until,
)
from rlenergy_dev import standin
from rlenergy_dev.devcluster import DevCluster
from rlenergy_dev.devcluster.cluster import free_port
from rlenergy_dev.devcluster.realnode import RealNode
from runbook_support import runbook, shape

from rlenergy.gpu import models

INSTALL_MD = ROOT / "docs" / "install.md"
GPUS = 8
KOPF_CRDS = ("clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")
OWN_CRDS = ("rlenergypolicies.rlenergy.io", "rlenergynodereports.rlenergy.io")
COMMAND_TIMEOUT_S = 420
"""Longest a runbook command may run, s (the smoke test waits up to 300 s by default)."""
RESULTS = ROOT / "build" / "runbook-e2e.json"

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[DevCluster]:
    with real_node_cluster("the runbook e2e test") as c:
        yield c


def _plugin_dir(out: Path) -> Path:
    """Build the single-file plugin (hack/kubectl-plugin.py) into ``out``; returns ``out``."""
    spec = importlib.util.spec_from_file_location(
        "rlenergy_hack_plugin", ROOT / "hack" / "kubectl-plugin.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build_plugin(out)
    return out


def _env(c: DevCluster, tools: Path, work: Path) -> dict[str, str]:
    """A user's shell: kubectl, helm and the plugin on PATH, the cluster's kubeconfig."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_dir = tools / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").symlink_to(c.binaries.kubectl)
    (bin_dir / "helm").symlink_to(c.binaries.helm)
    # python3 with the plugin's dependencies (the venv's), after the single-file plugin.
    venv_bin = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}:{tools / 'plugin'}:{venv_bin}:{env.get('PATH', os.defpath)}"
    env["KUBECONFIG"] = str(c.kubeconfig)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(work / "helm" / var.lower())
    env["COLUMNS"] = "200"
    return env


def _run(cmd: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        ["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=COMMAND_TIMEOUT_S,
    )  # fmt: skip
    assert res.returncode == 0, f"`{cmd}` exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res


def test_install_runbook_as_written(cluster: DevCluster, tmp_path: Path) -> None:
    t_start = time.monotonic()
    figures: dict[str, Any] = {"cluster_start_s": cluster.timings, "steps_s": {}}
    node = cluster.real_node
    assert node is not None
    work = tmp_path / "work"
    work.mkdir()
    for name in ("rl-energy-operator", "rl-energy-agent"):
        archive = IMAGES / f"{name}.oci.tar"
        if not archive.is_file():
            pytest.fail(f"{archive} missing: build the images with `make images`", pytrace=False)
        node.import_image(archive)
    assert {f"{IMAGE_REPO}/rl-energy-operator:{TAG}", f"{IMAGE_REPO}/rl-energy-agent:{TAG}"} <= set(
        node.images()
    ), node.images()

    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    state = work / "nvml" / "nvml.state"
    state.parent.mkdir()
    uuids = [f"GPU-runbook-{i:02d}" for i in range(GPUS)]
    driver = standin.StandinDriver(state, [(u, models.get_sku("h100-sxm")) for u in uuids])
    node.write_cdi_spec(lib_dir / "libnvidia-ml.so.1", state, uuids)
    plugin = start_nvidia_device_plugin(node, driver, lib_dir)
    driver.set_work(uuids, "generation")  # a steady memory-bound load on every GPU
    driver.start()
    try:
        wait_until(
            lambda: (
                get_json(cluster, "node", node.name)["status"]["allocatable"].get("nvidia.com/gpu")
                == str(GPUS)
            ),
            timeout=60,
            what="nvidia.com/gpu allocatable on the real node",
        )
        _runbook(cluster, node, driver, work, figures)
    finally:
        figures["wall_s"] = round(time.monotonic() - t_start, 1)
        plugin.stop()
        driver.stop()
        driver.close()
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(figures, indent=2, default=str))
        print(json.dumps(figures, indent=2, default=str))


def _runbook(
    c: DevCluster,
    node: RealNode,
    driver: standin.StandinDriver,
    work: Path,
    figures: dict[str, Any],
) -> None:
    tools = work / "tools"
    tools.mkdir()
    _plugin_dir(tools / "plugin")
    env = _env(c, tools, work)
    values = work / "my-values.yaml"
    chart = real_node_values(c, node, work)  # install.md step 2: ``-f my-values.yaml``
    chart["webhook"] = {"port": free_port()}
    chart["agent"]["tlsPort"] = free_port()
    values.write_text(json.dumps(chart))  # JSON is YAML
    steps = runbook(INSTALL_MD.read_text())
    assert [s.name for s in steps] == ["1", "2", "3", "4", "5", "6", "uninstall"], steps
    smoke_seen = False
    for step in steps:
        t0 = time.monotonic()
        for cmd in step.commands:
            # The one addition step 2 names: this cluster's values file.
            run = f"{cmd} -f {values}" if cmd.startswith("helm install ") else cmd
            res = _run(run, env)
            if cmd in step.expected:
                figures["smoke_output"] = res.stdout
                _check_smoke(step.expected[cmd], res.stdout)
                smoke_seen = True
        figures["steps_s"][step.name] = round(time.monotonic() - t0, 1)
        if step.name == "6":
            _check_enforcing(env)
        if step.name == "uninstall":
            _check_uninstalled(c, driver)
    assert smoke_seen, "install.md shows no smoke-test output after a command"


def _check_smoke(expected: str, got: str) -> None:
    """The smoke output has the page's lines (``ok`` report, lock, saving, PASS)."""
    assert shape(got) == shape(expected), (got, expected)
    saving_line = next(ln for ln in got.splitlines() if ln.split()[1:2] == ["saving"])
    percent = float(saving_line.split()[2])
    assert percent > 0, saving_line  # the stand-in GPUs are loaded: the lower clock saves
    assert "MHz" in next(ln for ln in got.splitlines() if ln.split()[1:2] == ["lock"])


def _check_enforcing(env: dict[str, str]) -> None:
    out = json.loads(_run("kubectl rlenergy status -n team-a -o json", env).stdout)
    policies = {i["policy"]["metadata"]["name"]: i["policy"] for i in out["items"]}
    assert policies["observe-grpo-baseline"]["spec"]["controller"]["mode"] == "enforce", out


def _check_uninstalled(c: DevCluster, driver: standin.StandinDriver) -> None:
    wait_until(
        lambda: not get_json(c, "pods", "-n", SYSTEM_NS)["items"],
        timeout=120,
        what="no pod left in the release namespace",
    )
    assert {u: driver.gpu(u).locked for u in driver.uuids if driver.gpu(u).locked} == {}
    crds = {d["metadata"]["name"] for d in get_json(c, "crd")["items"]}
    assert set(KOPF_CRDS) <= crds, crds
    assert not set(OWN_CRDS) & crds, crds
