"""Some GPU nodes without a node agent (``coverage``), and the operator's metrics.

Coverage: a GPU node without the GPU label, a labelled node with a taint the agents do not
tolerate or outside the nodeSelector, each named with its cause; CPU nodes are ignored. The
operator's registry passes ``promtool check metrics`` (marked e2e: promtool from ``make bins``)
and counts handler failures.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rlenergy_dev.devcluster.binaries import default_bin_dir
from rlenergy_operator import coverage, metrics

pytestmark = pytest.mark.field

LABEL = "nvidia.com/gpu.present=true"
GPU_TOL = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _node(name: str, gpus: int, labels: dict[str, str] | None = None, taints=()) -> dict:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"taints": list(taints)},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)} if gpus else {}},
    }


GPU = {"nvidia.com/gpu.present": "true"}
NODES = [
    _node("cpu-1", 0),
    _node("gpu-ok", 8, {**GPU, "pool": "a"}, [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]),
    _node("gpu-nolabel", 8),
    _node("gpu-tainted", 8, {**GPU, "pool": "a"}, [{"key": "maint", "effect": "NoExecute"}]),
    _node("gpu-pool-b", 8, {**GPU, "pool": "b"}),
]


def test_partial_coverage_names_each_node_and_cause():
    cov = coverage.check(NODES, LABEL, [GPU_TOL], {"pool": "a"})
    assert cov.gpu_nodes == 4 and cov.missing == 3
    assert cov.unlabelled == {"gpu-nolabel": "8 GPU(s), no nvidia.com/gpu.present=true label"}
    assert cov.blocked == {
        "gpu-tainted": "taint maint:NoExecute",
        "gpu-pool-b": "nodeSelector pool=a",
    }
    status, reason, message = coverage.finding(cov)  # type: ignore[misc]
    assert (status, reason) == (True, "AgentsMissing")
    assert message.startswith("3 of 4 GPU nodes have no node agent: gpu-nolabel (")
    assert "agent.gpuNodeLabel" in message and "agent.tolerations" in message


def test_full_coverage_is_no_finding():
    nodes = [NODES[0], NODES[1]]
    cov = coverage.check(nodes, LABEL, [GPU_TOL], {})
    assert (cov.gpu_nodes, cov.missing) == (1, 0)
    assert coverage.finding(cov) is None
    # a bare key: any value of the label counts
    assert coverage.check([_node("g", 0, {"gpu": "h100"})], "gpu", [], {}).missing == 0


def test_handler_failures_are_counted_and_passes_recorded():
    @metrics.counted("unit_handler")
    def handler(fail: bool, **_: object) -> str:
        if fail:
            raise RuntimeError("boom")
        return "ok"

    assert handler(fail=False) == "ok"
    for _ in range(2):
        with pytest.raises(RuntimeError):
            handler(fail=True)
    metrics.policy_pass("team-a", "grpo", reporting=3, ready=2, newest_step=12, through_step=10)
    metrics.daemonset({"desiredNumberScheduled": 3, "numberReady": 2})
    metrics.coverage(unlabelled=1, blocked=0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode())
        for s in f.samples
    }
    assert (
        samples[("rlenergy_operator_reconcile_errors_total", (("handler", "unit_handler"),))] == 2
    )
    pol = (("namespace", "team-a"), ("policy", "grpo"))
    assert samples[("rlenergy_operator_policy_agents", (*pol, ("state", "ready")))] == 2
    assert samples[("rlenergy_operator_policy_status_lag_steps", pol)] == 2
    assert samples[("rlenergy_operator_agents", (("state", "desired"),))] == 3
    assert samples[("rlenergy_operator_gpu_nodes_without_agent", (("cause", "unlabelled"),))] == 1
    metrics.policy_gone("team-a", "grpo")
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'policy="grpo"' not in text


@pytest.mark.e2e
def test_operator_metrics_pass_promtool():
    metrics.policy_pass("team-a", "grpo", reporting=1, ready=1, newest_step=0, through_step=0)
    promtool = Path(os.environ.get("PROMTOOL") or default_bin_dir() / "promtool")
    if not promtool.is_file():
        pytest.fail(f"promtool not found at {promtool}: run `make bins`", pytrace=False)
    res = subprocess.run(
        [str(promtool), "check", "metrics"],
        input=generate_latest(metrics.REGISTRY),
        capture_output=True,
        check=False,
    )
    assert res.returncode == 0, (res.stdout + res.stderr).decode()


def test_a_policy_timer_never_waits_for_another_policys_agent_check(monkeypatch):
    # One check per interval serves every policy. The bench at 250 nodes had 11-15 of the 16
    # handler threads parked on the check's lock while one policy's timer waited for a slow
    # API server; the others now take the last finding and return at once.
    import threading
    import time

    import kopf_doubles
    from rlenergy_operator import handlers

    started, release = threading.Event(), threading.Event()
    reads: list[str] = []
    blocked = (True, "AgentsUnschedulable", "taint x")

    def finding(check: handlers.AgentCheck, logger: object) -> tuple[bool, str, str]:
        reads.append("read")
        started.set()
        release.wait(5)
        return blocked

    monkeypatch.setattr(handlers, "_agents_finding", finding)

    class _Log:
        def log(self, *a: object) -> None:
            pass

        warning = log

    check = handlers.AgentCheck()
    memos = [
        {"operator": handlers.OperatorMemo(agent_check=check), "handover": kopf_doubles.serving()}
        for _ in range(3)
    ]
    first = threading.Thread(
        target=handlers.policy_agents_check, kwargs={"meta": {}, "memo": memos[0], "logger": _Log()}
    )
    first.start()
    assert started.wait(5)
    t0 = time.monotonic()
    for memo in memos[1:]:  # the other policies' timers while the read waits
        handlers.policy_agents_check(meta={}, memo=memo, logger=_Log())
        assert memo["policy"].agents_unschedulable is None  # the last finding: none yet
    assert time.monotonic() - t0 < 1.0
    release.set()
    first.join(5)
    assert memos[0]["policy"].agents_unschedulable == blocked and reads == ["read"]
    handlers.policy_agents_check(meta={}, memo=memos[1], logger=_Log())  # not due: no read
    assert memos[1]["policy"].agents_unschedulable == blocked and reads == ["read"]
