"""``kubectl rlenergy status`` against the real control plane.

We test these aspects:
* the installed console script ``kubectl-rlenergy`` and ``kubectl rlenergy`` (the pinned kubectl
  finding the plugin on PATH) read a policy whose status was written through ``/status`` and
  its ``RLEnergyNodeReport`` objects, and the table shows per-phase clocks, saving, throughput
  ratio and per-node health with those values;
* the kubeconfig is honoured: ``--kubeconfig``, ``$KUBECONFIG``, ``--context``, and the
  context's namespace when ``-n`` is not given;
* ``-A`` lists the policy in the summary table;
* a missing policy exits 1 naming the namespace searched; an unknown context exits 1 naming
  it; an API server path that serves no rlenergy.io group (a server prefix under which the
  real API server answers 404, as for a cluster without the CRDs) exits 1 saying to install
  the chart.

No operator runs here: the status is written by the test, as the operator would write it, so
the values on screen are known exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from rlenergy_dev.devcluster import DevCluster

from rlenergy.api.v1alpha1 import status as api_status
from tests import factories

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PLUGIN = BIN / "kubectl-rlenergy"
KUBECTL = BIN / "kubectl"
NOW = "2026-11-29T18:00:00Z"
POLICY = "grpo-plugin"


def _status() -> dict[str, Any]:
    cond = [
        {"type": t, "status": s, "reason": r, "message": "", "lastTransitionTime": NOW}
        for t, s, r in (
            ("Ready", "True", "AgentsDeployed"),
            ("Progressing", "False", "ClocksLocked"),
            ("Degraded", "True", "NodeErrors"),
        )
    ]
    st = api_status.RLEnergyPolicyStatus.model_validate(
        {
            "observedGeneration": 1,
            "conditions": cond,
            "plan": {
                "step": 31,
                "enforce": True,
                "phases": [
                    {"phase": "generation", "clockMHz": 1335, "state": "locked", "sinceStep": 14},
                    {"phase": "training", "clockMHz": 1875, "state": "locked", "sinceStep": 22},
                ],
            },
            "phases": [
                {
                    "name": "generation",
                    "state": "locked",
                    "clockMHz": 1335,
                    "minThroughputRatio": 0.95,
                    "throughputRatio": 0.9567,
                    "saving": {"percent": 17.84, "joules": 61200.0},
                    "selections": 1,
                },
                {
                    "name": "training",
                    "state": "locked",
                    "clockMHz": 1875,
                    "minThroughputRatio": 0.97,
                    "throughputRatio": 0.9822,
                    "saving": {"percent": 4.41, "joules": 9100.0},
                    "selections": 1,
                },
            ],
            "totals": {
                "steps": 30,
                "throughStep": 30,
                "measuredJoules": 512000.0,
                "predictedDefaultJoules": 580000.0,
                "comparedMeasuredJoules": 509700.0,
                "savedJoules": 70300.0,
                "savingPercent": 12.12,
                "throughputRatio": 0.9693,
                "comparedSteps": 28,
            },
            "nodes": {
                "ready": 1,
                "total": 2,
                "errors": [{"node": "fake-gpu-1", "gpu": "GPU-dead", "reason": "GPULost"}],
            },
        }
    )
    return st.model_dump(by_alias=True, exclude_none=True)


@pytest.fixture
def policy(dev_cluster: DevCluster, crds: None, namespace: str) -> str:
    manifest = {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": POLICY, "namespace": namespace},
        "spec": {"selector": {"matchLabels": {"app": "verl-grpo"}}},
    }
    dev_cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    dev_cluster.kubectl(
        "patch",
        "rlep",
        POLICY,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": _status()}),
    )
    ok = [{"uuid": f"GPU-ok-{i}", "condition": "ok", "lockedClockMHz": 1335} for i in range(8)]
    dead = [{"uuid": "GPU-dead", "condition": "lost", "reason": "GPU_IS_LOST"}]
    items = [
        factories.report_object(
            POLICY, "fake-gpu-0", gpus=ok, lastStep=30, measuredJoulesTotal=256000.0
        ),
        factories.report_object(
            POLICY, "fake-gpu-1", gpus=dead, lastStep=17, measuredJoulesTotal=4200.0
        ),
    ]
    dev_cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
    )
    # the status reads back intact (nothing pruned by the schema)
    got = json.loads(
        dev_cluster.kubectl("get", "rlep", POLICY, "-n", namespace, "-o", "json").stdout
    )
    assert got["status"]["totals"]["savingPercent"] == 12.12
    return namespace


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    base.update({"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "220"})
    base.update(env or {})
    return subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=120)


def _line(text: str, start: str) -> str:
    found = [line for line in text.splitlines() if line.strip().startswith(start)]
    assert found, f"no line starting with {start!r} in:\n{text}"
    return found[0]


def _check_detail(out: str, namespace: str) -> None:
    assert f"{namespace}/{POLICY}" in out
    gen = _line(out, "generation ")
    assert "1335 MHz" in gen and "0.957" in gen and "0.950" in gen and "17.8 %" in gen
    train = _line(out, "training ")
    assert "1875 MHz" in train and "0.982" in train and "0.970" in train and "4.4 %" in train
    assert "Saving 12.1 % (70.3 kJ saved of 580 kJ predicted" in out
    assert "throughput ratio 0.969" in out
    assert "Degraded True (NodeErrors)" in out
    assert "Node agents: 1/2 ready (operator), 2 node reports" in out
    n0 = _line(out, "fake-gpu-0")
    assert " yes " in n0 and "8 ok" in n0 and "1335 MHz x8" in n0 and " 30 " in n0
    assert "256 kJ" in n0
    n1 = _line(out, "fake-gpu-1")
    assert " no " in n1 and "1 lost" in n1 and " 17 " in n1 and "GPU-dead lost: GPU_IS_LOST" in n1


def test_console_script_shows_the_policy(dev_cluster: DevCluster, policy: str):
    res = _run(
        [str(PLUGIN), "status", POLICY, "-n", policy, "--kubeconfig", str(dev_cluster.kubeconfig)]
    )
    assert res.returncode == 0, res.stderr
    _check_detail(res.stdout, policy)


def test_kubectl_finds_the_plugin_and_honours_kubeconfig_env(
    dev_cluster: DevCluster, policy: str, tmp_path: Path
):
    env = {"KUBECONFIG": str(dev_cluster.kubeconfig)}
    listed = _run([str(KUBECTL), "plugin", "list"], env)
    assert str(PLUGIN) in listed.stdout, listed.stdout + listed.stderr
    res = _run([str(KUBECTL), "rlenergy", "status", POLICY, "-n", policy], env)
    assert res.returncode == 0, res.stderr
    _check_detail(res.stdout, policy)

    # the context's namespace is the default; --context picks a context by name
    cfg = yaml.safe_load(dev_cluster.kubeconfig.read_text())
    ctx = dict(cfg["contexts"][0])
    ctx = {"name": "team", "context": {**ctx["context"], "namespace": policy}}
    cfg["contexts"].append(ctx)
    other = tmp_path / "kubeconfig"
    other.write_text(yaml.safe_dump(cfg))
    res = _run(
        [str(KUBECTL), "rlenergy", "status", POLICY, "--context", "team"],
        {"KUBECONFIG": str(other)},
    )
    assert res.returncode == 0, res.stderr
    _check_detail(res.stdout, policy)
    res = _run([str(PLUGIN), "status", POLICY, "--kubeconfig", str(other)])
    assert res.returncode == 1
    assert f'"{POLICY}" not found in namespace "default"' in res.stderr


def test_all_namespaces_summary_lists_the_policy(dev_cluster: DevCluster, policy: str):
    res = _run([str(PLUGIN), "status", "-A", "--kubeconfig", str(dev_cluster.kubeconfig)])
    assert res.returncode == 0, res.stderr
    row = _line(res.stdout, policy)
    assert POLICY in row and "generation 1335 MHz, training 1875 MHz" in row
    assert "12.1 %" in row and "0.969" in row and " 1/2 " in row
    assert "True (NodeErrors)" in row


def test_errors_name_what_was_searched(dev_cluster: DevCluster, policy: str, tmp_path: Path):
    kc = str(dev_cluster.kubeconfig)
    res = _run([str(PLUGIN), "status", "no-such-policy", "-n", policy, "--kubeconfig", kc])
    assert res.returncode == 1 and res.stdout == ""
    assert f'RLEnergyPolicy "no-such-policy" not found in namespace "{policy}"' in res.stderr
    assert "kubectl rlenergy status -A" in res.stderr

    res = _run([str(PLUGIN), "status", "--kubeconfig", kc, "--context", "nope"])
    assert res.returncode == 1 and 'context "nope" not found' in res.stderr

    res = _run([str(PLUGIN), "status", POLICY, "-A", "--kubeconfig", kc])
    assert res.returncode == 2 and "use -n NAMESPACE, not -A" in res.stderr

    # The real API server under a path prefix it does not serve: discovery of rlenergy.io
    # answers 404, exactly as on a cluster without the CRDs.
    cfg = yaml.safe_load(dev_cluster.kubeconfig.read_text())
    cfg["clusters"][0]["cluster"]["server"] += "/no-crds-here"
    bare = tmp_path / "bare-kubeconfig"
    bare.write_text(yaml.safe_dump(cfg))
    res = _run([str(PLUGIN), "status", POLICY, "-n", policy, "--kubeconfig", str(bare)])
    assert res.returncode == 1
    assert "rlenergypolicies.rlenergy.io, rlenergynodereports.rlenergy.io" in res.stderr
    assert "the rl-energy CRDs are not installed; install the chart" in res.stderr

    # an API server that is not there
    cfg["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:9"
    gone = tmp_path / "gone-kubeconfig"
    gone.write_text(yaml.safe_dump(cfg))
    res = _run([str(PLUGIN), "status", "-n", policy, "--kubeconfig", str(gone)])
    assert res.returncode == 1 and "cannot reach the API server https://127.0.0.1:9" in res.stderr
