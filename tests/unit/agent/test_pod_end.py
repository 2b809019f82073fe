"""Reset on pod end (``podlife.PodEndWatch``, ``kube.ended_pods``, ``Agent.pod_gone``).

We test: a governed pod the kubelet no longer lists gets its GPUs reset (a parked GPU too)
while another governed pod of the policy keeps its locks; the API check (gone, being deleted,
terminal, replaced by another UID) runs at most every ``check_s`` and survives API errors; a
pod that is still listed and running is left alone. The e2e test
``tests/e2e/test_pod_end_reset.py`` deletes a real pod object and times the reset.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pytest
from agent_support import LOCKED_PLAN as PLAN
from agent_support import POD_A, POD_B, DriverFactory, standin_agent
from rlenergy_agent import kube, podlife, service
from rlenergy_agent.kubeapi import ApiException


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_pod_the_kubelet_drops_is_reset_parked_gpu_included(make_driver: DriverFactory) -> None:
    drv = make_driver(4)
    a, b = list(drv.uuids[:2]), list(drv.uuids[2:])
    agent = standin_agent({POD_A: a, POD_B: b}, PLAN, lambda: drv.virtual_s)
    agent.phase(POD_A, "generation", 0)
    agent.park(POD_A, 0, gpu_uuids=[a[1]])  # a released rollout worker: lowest clock
    agent.phase(POD_B, "training", 0)
    assert all(drv.gpu(u).locked for u in drv.uuids) and a[1] in agent.parked
    watch = podlife.PodEndWatch(agent)
    assert watch.tick() == []  # both listed
    assert isinstance(agent.podmap, service.StaticPodMap)
    del agent.podmap.allocations[POD_A]  # the kubelet no longer lists it
    assert watch.tick() == [POD_A]
    assert not any(drv.gpu(u).locked for u in a)
    assert all(drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1755 for u in b)
    assert not agent.parked and agent.released_gpu_seconds(a[1]) >= 0
    assert POD_A not in agent.governed_pods() and agent.report_due
    rep = {g.uuid: g for g in agent.report().gpus}
    assert all(rep[u].locked_clock_mhz is None and rep[u].pod is None for u in a)
    # The report lists it (how, its GPUs, not all parked, the step): the operator tells a
    # rollout worker lost mid-rollout from it (rlenergy_operator.rolloutfaults).
    (ended,) = agent.report().ended_pods
    assert (ended.pod, ended.how, ended.gpus, ended.parked, ended.step) == (
        str(POD_A),
        "NotAllocated",
        sorted(a),
        False,
        0,
    )
    assert watch.tick() == []  # once


def test_a_pod_that_only_parked_is_reset_too(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, PLAN, lambda: drv.virtual_s)
    agent.park(POD_A, 3)
    assert all(drv.gpu(u).locked for u in drv.uuids)
    agent.pod_gone(POD_A, "EndedInApi")
    assert not any(drv.gpu(u).locked for u in drv.uuids) and not agent.parked
    (ended,) = agent.report().ended_pods
    assert ended.parked and ended.how == "EndedInApi"  # a released worker, removed as planned


def test_api_check_runs_every_check_s_and_survives_errors(make_driver: DriverFactory) -> None:
    drv = make_driver(4)
    agent = standin_agent(
        {POD_A: list(drv.uuids[:2]), POD_B: list(drv.uuids[2:])}, PLAN, lambda: drv.virtual_s
    )
    calls: list[set[service.PodRef]] = []
    answer: list[Any] = [set()]

    def ended(pods: Iterable[service.PodRef]) -> set[service.PodRef]:
        calls.append(set(pods))
        if isinstance(answer[0], Exception):
            raise answer[0]
        return set(answer[0])

    clock = Clock()
    watch = podlife.PodEndWatch(agent, ended, check_s=3.0, clock=clock)
    assert watch.tick() == [] and calls == []  # nothing governed: no API call
    agent.phase(POD_A, "generation", 0)
    agent.phase(POD_B, "generation", 0)
    watch.tick()
    assert calls == [{POD_A, POD_B}]
    clock.t = 2.9
    watch.tick()
    assert len(calls) == 1
    clock.t = 3.0
    answer[0] = OSError("connection refused")
    assert watch.tick() == [] and len(calls) == 2  # logged, retried at the next check
    clock.t = 6.0
    answer[0] = {POD_B}
    assert watch.tick() == [POD_B]
    assert not any(drv.gpu(u).locked for u in drv.uuids[2:])
    assert all(drv.gpu(u).locked for u in drv.uuids[:2])


class _Pods:
    """A node's pods as the API server's JSON (``kube.NodePods``'s answer)."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.calls = 0

    def __call__(self) -> list[dict[str, Any]]:
        self.calls += 1
        return self.pods


def _pod(ref: service.PodRef, phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase}}


def test_ended_pods_reads_gone_deleting_terminal_and_replaced() -> None:
    refs = [service.PodRef("ns", f"p{i}", f"uid-{i}") for i in range(7)]
    core = _Pods(
        [
            _pod(refs[0]),  # running: not ended
            _pod(refs[1], deleting=True),
            _pod(refs[2], "Succeeded"),
            _pod(refs[3], "Failed"),  # evicted / OOM-killed without restart
            _pod(service.PodRef("ns", "p4", "another-uid")),  # replaced
            _pod(refs[6], "Pending"),
            # refs[5]: gone from the API
        ]
    )
    ended = kube.ended_pods("node-1", core)(refs)
    assert ended == {refs[1], refs[2], refs[3], refs[4], refs[5]}
    assert core.calls == 1
    # a pod map without UIDs (the lookup has not run yet) matches by name
    assert kube.ended_pods("node-1", core)([service.PodRef("ns", "p0")]) == set()


class _ApiClient:
    """``kubeapi.ApiClient.request`` as ``kube.NodePods`` calls it, recorded."""

    def __init__(self, status: int, data: bytes) -> None:
        self.status, self.data = status, data
        self.asked: list[dict[str, Any]] = []

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        self.asked.append({"method": method, "path": path, **kwargs})
        client = self

        class _Response:
            status = client.status
            data = client.data
            reason = "Forbidden"
            headers: dict[str, str] = {}

        return _Response()


def test_node_pods_lists_one_node_as_json_without_models() -> None:
    body = json.dumps({"kind": "PodList", "items": [_pod(service.PodRef("ns", "p0", "u0"))]})
    client = _ApiClient(200, body.encode())
    assert kube.NodePods("node-1", client)() == [_pod(service.PodRef("ns", "p0", "u0"))]
    asked = client.asked[0]
    assert asked["path"] == "/api/v1/pods"
    assert list(asked["query"]) == [("fieldSelector", "spec.nodeName=node-1")]
    with pytest.raises(ApiException) as info:
        kube.NodePods("node-1", _ApiClient(403, b'{"kind": "Status"}'))()
    assert info.value.status == 403
