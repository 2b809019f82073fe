"""A policy no change handler reconciled is reconciled by its job loop (``policy_loop``).

Two replicas starting together (the chart's ``operator.replicas: 2``) could leave a policy
created in that second with no ``policy_reconcile`` run in the active replica; its job loop
then waited for an ``observedGeneration`` that never came (tests/chaos). The loop now waits
``reconcile_catchup_s`` (a change handler at work), then reconciles the policy itself.
"""

from __future__ import annotations

from typing import Any

import kopf_doubles
import pytest
from kopf_doubles import StatusPatch, WarningLog
from rlenergy_operator import handlers, kube, liveness

SPEC = {"selector": {"matchLabels": {"job": "grpo"}}}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [500.0]
    monkeypatch.setattr(handlers.time, "monotonic", lambda: now[0])
    return now


@pytest.fixture
def daemonsets(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    ensured: list[Any] = []

    def ensure(ds: Any) -> str:
        ensured.append(ds)
        return "created"

    monkeypatch.setattr(kube, "ensure_daemonset", ensure)
    return ensured


def _pass(
    memo: dict[str, Any], status: dict[str, Any], log: WarningLog, generation: int = 1
) -> StatusPatch:
    patch = StatusPatch()
    handlers.policy_loop(
        spec=SPEC,
        meta={"generation": generation, "resourceVersion": "7"},
        status=status,
        patch=patch,
        memo=memo,
        body={},
        namespace="ns",
        name="p",
        logger=log,
    )
    return patch


def _memo() -> dict[str, Any]:
    shared = handlers.OperatorMemo(watch_lag=liveness.WatchLag(), echoes=liveness.EchoTracker())
    return {"operator": shared, "handover": kopf_doubles.serving()}


def test_the_loop_reconciles_a_generation_no_change_handler_recorded(clock, daemonsets):
    memo, log = _memo(), WarningLog()
    wait_s = handlers.CFG.reconcile_catchup_s
    interval_s = handlers.CFG.reconcile_interval_s
    start_s = clock[0]
    for _ in range(int(3 * wait_s / interval_s)):  # no change handler writes status
        patch = _pass(memo, {}, log)
        if patch.status:
            break
        assert daemonsets == [], "reconciled while a change handler may still be at work"
        clock[0] += interval_s
    else:
        pytest.fail(f"not reconciled {3 * wait_s:.0f} s after the loop first saw it")
    assert wait_s <= clock[0] - start_s < wait_s + 2 * interval_s
    assert patch.status["observedGeneration"] == 1
    assert patch.status["plan"]["policyGeneration"] == 1
    assert [c["type"] for c in patch.status["conditions"] if c["status"] == "True"]
    assert len(daemonsets) == 1
    assert "generation 1 not reconciled" in log.warnings[-1]


def test_a_change_handler_in_time_leaves_the_loop_to_its_work(clock, daemonsets):
    memo, log = _memo(), WarningLog()
    assert not _pass(memo, {}, log).status  # the change handler is running
    clock[0] += handlers.CFG.reconcile_catchup_s - 1
    handlers.policy_reconcile(
        spec=SPEC, status={}, meta={"generation": 1}, patch=(p := StatusPatch()), memo=memo,
        body={}, logger=log,
    )  # fmt: skip
    recorded = p.status
    assert recorded["observedGeneration"] == 1
    daemonsets.clear()
    # A new generation restarts the wait: the lag of generation 1 does not count for 2.
    clock[0] += 100
    assert not _pass(memo, {"observedGeneration": 1}, log, generation=2).status
    clock[0] += handlers.CFG.reconcile_catchup_s / 2
    assert not _pass(memo, {"observedGeneration": 1}, log, generation=2).status
    assert daemonsets == [] and log.warnings == []
