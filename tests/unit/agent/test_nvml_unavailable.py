"""An agent that cannot load NVML says why and what to change, where the user looks.

We test these aspects:
* the agent process with no loadable libnvidia-ml.so.1 exits 3 with one error line that names
  the fix (the chart value agent.runtimeClassName, the RuntimeClass nvidia);
* the same line becomes the pod's termination message (the kubelet's file, when it exists);
* with the Kubernetes API, the node report of the policy that governs the node's GPU pods gets
  the line as ``nvmlError`` and lists no GPU (an existing report keeps its step records; a
  missing one is created); the configured policy when there is one; nothing without a policy;
* the operator turns it into the policy's Degraded condition, reason NVMLUnavailable, with the
  agent's line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import rlenergy_agent
from rlenergy_agent import __main__ as agent_main
from rlenergy_agent import config, kube
from rlenergy_agent.nvml import lib
from rlenergy_operator import builders

import rlenergy
from rlenergy.api import node as api_node

NODE = "gpu-node-0"
ERR = lib.NvmlUnavailableError(f"NVML Shared Library Not Found: {lib.MISSING_LIBRARY_HINT}", 12)


def test_the_agent_without_nvml_exits_with_one_line_naming_the_fix(tmp_path: Path):
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(tmp_path),  # no libnvidia-ml.so.1 anywhere the loader looks
        "RLENERGY_AGENT_KUBE": "false",
        "RLENERGY_AGENT_STATE_DIR": str(tmp_path / "state"),
        "RLENERGY_AGENT_SOCKET_PATH": str(tmp_path / "a.sock"),
        # this checkout's agent and rlenergy packages, as pytest imports them
        "PYTHONPATH": os.pathsep.join(
            str(Path(str(m.__file__)).resolve().parents[1]) for m in (rlenergy_agent, rlenergy)
        ),
    }
    done = subprocess.run(  # noqa: S603 - this interpreter, the agent module
        [sys.executable, "-m", "rlenergy_agent", "--node", NODE, "--backend", "nvml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1, done.stderr
    assert "NVML unavailable, this node's GPUs are not governed" in errors[0]
    assert "agent.runtimeClassName" in errors[0] and "nvidia" in errors[0]


def _settings(**kw: Any) -> config.AgentSettings:
    return config.AgentSettings(node_name=NODE, kube=False, **kw)


def test_the_line_is_the_pods_termination_message(tmp_path: Path):
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet creates it
    line = agent_main.nvml_unavailable(_settings(), ERR, discover=False, termination_log=log)
    assert log.read_text() == line and "agent.runtimeClassName" in line
    missing = tmp_path / "none"  # outside a pod: no file is created
    agent_main.nvml_unavailable(_settings(), ERR, discover=False, termination_log=missing)
    assert not missing.exists()


class FakeApi:
    """CustomObjectsApi double: policies per namespace, node reports by name."""

    def __init__(self, reports: dict[str, dict[str, Any]] | None = None) -> None:
        self.reports = reports or {}
        self.patches: list[tuple[str, str, dict[str, Any]]] = []
        self.creates: list[dict[str, Any]] = []

    def list_namespaced_custom_object(self, g: str, v: str, ns: str, plural: str) -> dict:
        selector = {"matchLabels": {"job": "grpo"}}
        return {"items": [{"metadata": {"name": "p"}, "spec": {"selector": selector}}]}

    def patch_namespaced_custom_object(
        self, g: str, v: str, ns: str, plural: str, name: str, body: dict
    ) -> dict:
        if name not in self.reports:
            raise kube.ApiException(status=404, reason="Not Found")
        self.patches.append((ns, name, body))
        spec = {**self.reports[name]["spec"], **body["spec"]}
        self.reports[name] = {**self.reports[name], "spec": spec}
        return self.reports[name]

    def create_namespaced_custom_object(
        self, g: str, v: str, ns: str, plural: str, body: dict
    ) -> dict:
        self.creates.append(body)
        self.reports[body["metadata"]["name"]] = body
        return body


def _pod(name: str, labels: dict[str, str], gpus: int | None, phase: str = "Running") -> dict:
    limits = {} if gpus is None else {"nvidia.com/gpu": str(gpus)}
    return {
        "metadata": {"namespace": "team", "name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
        "status": {"phase": phase},
    }


PODS = [
    _pod("trainer", {"job": "grpo"}, 2),
    _pod("sidecar", {"job": "grpo"}, None),
    _pod("done", {"job": "grpo"}, 1, phase="Succeeded"),
]


def test_the_governing_policys_report_gets_the_line_and_lists_no_gpu(tmp_path: Path):
    api = FakeApi()
    line = agent_main.nvml_unavailable(
        _settings(),
        ERR,
        discover=True,
        termination_log=tmp_path / "none",
        api=api,
        list_pods=lambda: PODS,
    )
    (body,) = api.creates
    assert body["metadata"]["name"] == kube.report_name("p", NODE)
    assert body["metadata"]["namespace"] == "team"
    spec = api_node.NodeReport.model_validate(body["spec"])
    assert spec.nvml_error == line and spec.gpus == [] and spec.node_name == NODE
    # A report that exists keeps its step records; its GPUs go (the node governs none).
    record = {"step": 3, "workload": {"samples": 1}, "phases": []}
    name = kube.report_name("p", NODE)
    old = {
        "spec": {
            "policyName": "p",
            "nodeName": NODE,
            "gpus": [{"uuid": "GPU-0"}],
            "steps": [record],
        }
    }
    api = FakeApi({name: old})
    agent_main.nvml_unavailable(
        _settings(), ERR, discover=True, termination_log=tmp_path / "none", api=api,
        list_pods=lambda: PODS,
    )  # fmt: skip
    assert api.creates == []
    ((ns, patched, patch),) = api.patches
    assert (ns, patched, patch) == ("team", name, {"spec": {"gpus": [], "nvmlError": line}})
    assert api.reports[name]["spec"]["steps"] == [record]


def test_the_configured_policy_or_none(tmp_path: Path):
    api = FakeApi()
    agent_main.nvml_unavailable(
        _settings(policy_name="mine", namespace="ops"), ERR, discover=False,
        termination_log=tmp_path / "none", api=api,
    )  # fmt: skip
    assert [(b["metadata"]["namespace"], b["spec"]["policyName"]) for b in api.creates] == [
        ("ops", "mine")
    ]
    # No pod on the node asks for a GPU: no policy governs it, nothing is written.
    api = FakeApi()
    agent_main.nvml_unavailable(
        _settings(), ERR, discover=True, termination_log=tmp_path / "none", api=api,
        list_pods=lambda: PODS[1:],
    )  # fmt: skip
    assert api.creates == [] and api.patches == []


def test_the_operator_sets_degraded_with_the_agents_line():
    line = f"NVML unavailable, this node's GPUs are not governed: {ERR}"
    reports = [
        api_node.NodeReport(policy_name="p", node_name=NODE, nvml_error=line),
        api_node.NodeReport(policy_name="p", node_name="gpu-node-1"),
    ]
    nodes = builders.node_summary(reports)
    assert [(e.node, e.reason) for e in nodes.errors] == [
        (NODE, "NVMLUnavailable"),
        ("gpu-node-1", "NoUsableGPU"),
    ]
    status, reason, message = builders.degraded_condition(nodes, True, True)
    assert (status, reason) == (True, "NVMLUnavailable")
    assert message == f"1 node agent(s) cannot load NVML, first: {NODE}: {line}"
    assert "agent.runtimeClassName" in message


@pytest.mark.parametrize("policy", ["FallbackToLogsOnError"])
def test_the_agent_container_falls_back_to_its_log(policy: str):
    from rlenergy_operator import settings

    ds = builders.agent_daemonset(settings.OperatorConfig())
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["terminationMessagePolicy"] == policy
