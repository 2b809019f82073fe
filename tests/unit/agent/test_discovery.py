"""Policy discovery in the agent (no policy configured: the DaemonSet).

We test these aspects:
* ``PolicyDiscovery`` reads the labels of the node's pods and the policies of the GPU pods'
  namespaces only, and hands them to the pure matcher (match, conflict, no GPU pods);
* leaving a policy resets its clocks before anything else, writes the old policy a last report
  with every reset acknowledged, and the new policy's report starts without the old steps;
* a conflict is logged as an error once (not at every poll), an API error keeps the current
  policy; the outcome is exported as ``rlenergy_agent_policy_discovery``;
* a listing with no GPU pod (a restarted kubelet's first answers) keeps the matched policy
  and its locks while a pod it governs has not ended, and leaves it once the pod-end watch
  has reset that pod.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from agent_support import DriverFactory, standin_agent
from rlenergy_agent import __main__ as agent_main
from rlenergy_agent import kube, metrics, pods, service

from rlenergy.api import node as api_node
from rlenergy.api import selector

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
PLAN = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=None, state="locked"),
    ],
)
TOKENS = api_node.TokenWorkloadReport(
    samples=8, responseTokens=800, promptTokens=80, validTokens=700, meanContextTokens=110
)


def _pod(ns: str, name: str, labels: dict[str, str] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": ns, "name": name}
    if labels is not None:
        meta["labels"] = labels
    return {"metadata": meta}


class _Core:
    """A node's pods as the API server's JSON (``kube.NodePods``'s answer)."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.calls = 0

    def __call__(self) -> list[dict[str, Any]]:
        self.calls += 1
        return self.pods


class _Custom:
    def __init__(self, policies: dict[str, list[dict[str, Any]]], fail: bool = False) -> None:
        self.policies = policies
        self.fail = fail
        self.namespaces: list[str] = []

    def list_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str
    ) -> dict[str, Any]:
        assert (group, version, plural) == ("rlenergy.io", "v1alpha1", "rlenergypolicies")
        if self.fail:
            raise OSError("connection refused")
        self.namespaces.append(namespace)
        return {"items": self.policies.get(namespace, [])}


def _policy(name: str, selector_: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"selector": selector_}}


NODE_PODS = [
    _pod("team-a", "trainer-0", {"job": "grpo"}),
    _pod("team-a", "notebook", {"job": "grpo"}),  # no GPU: never counted
    _pod("team-c", "web", None),
]
POLICIES = {
    "team-a": [_policy("grpo", {"matchLabels": {"job": "grpo"}})],
    "team-b": [
        _policy("everything", {"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]})
    ],
}


def test_discovery_reads_the_gpu_pods_namespaces_and_matches() -> None:
    core, custom = _Core(NODE_PODS), _Custom(POLICIES)
    finder = kube.PolicyDiscovery(custom, "gpu-1", list_pods=core)
    found = finder.discover([("team-a", "trainer-0")])
    assert found.policy == selector.PolicyRef("team-a", "grpo") and found.reason == "Matched"
    assert found.pods == ("team-a/trainer-0",)
    assert core.calls == 1 and custom.namespaces == ["team-a"]
    # no GPU pod: no API call at all
    assert kube.PolicyDiscovery(_Custom(POLICIES), "gpu-1", list_pods=_Core([])).discover(
        []
    ).reason == ("NoGpuPods")
    # a second policy selecting the same pod: a conflict, nothing governs
    both = dict(POLICIES, **{"team-a": [*POLICIES["team-a"], _policy("all", {"matchLabels": {}})]})
    found = kube.PolicyDiscovery(_Custom(both), "gpu-1", list_pods=_Core(NODE_PODS)).discover(
        [("team-a", "trainer-0")]
    )
    assert found.policy is None and found.reason == "Conflict"
    assert "team-a/grpo" in found.message and "team-a/all" in found.message


def test_a_namespace_the_agent_may_not_read_has_no_policy_for_it() -> None:
    """A namespaced install grants policies of the served namespaces only: 403 = none there."""
    from rlenergy_agent.kubeapi import ApiException

    class _Namespaced(_Custom):
        def list_namespaced_custom_object(
            self, group: str, version: str, namespace: str, plural: str
        ) -> dict[str, Any]:
            if namespace == "team-c":
                raise ApiException(status=403, reason="Forbidden")
            return super().list_namespaced_custom_object(group, version, namespace, plural)

    pods = [*NODE_PODS, _pod("team-c", "trainer-9", {"job": "grpo"})]
    custom = _Namespaced(POLICIES)
    found = kube.PolicyDiscovery(custom, "gpu-1", list_pods=_Core(pods)).discover(
        [("team-a", "trainer-0"), ("team-c", "trainer-9")]
    )
    assert found.policy == selector.PolicyRef("team-a", "grpo"), found
    assert custom.namespaces == ["team-a"]

    class _Down(_Custom):
        def list_namespaced_custom_object(self, *a: Any) -> dict[str, Any]:
            raise ApiException(status=500, reason="boom")

    with pytest.raises(ApiException):  # any other error still keeps the current policy
        kube.PolicyDiscovery(_Down(POLICIES), "gpu-1", list_pods=_Core(pods)).discover(
            [("team-a", "trainer-0")]
        )


def _agent(make_driver: DriverFactory) -> tuple[Any, service.Agent]:
    drv = make_driver(2)
    agent = standin_agent(
        {POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s, node="gpu-1", policy="grpo"
    )
    return drv, agent


class _Writer:
    def __init__(self, drv: Any) -> None:
        self.drv = drv
        self.namespace, self.policy = "team-a", "grpo"
        self.reports: list[api_node.NodeReport] = []
        self.locked_at_write: list[bool] = []

    def write(self, report: api_node.NodeReport) -> None:
        self.locked_at_write.append(any(self.drv.gpu(u).locked for u in self.drv.uuids))
        self.reports.append(report)


def test_leaving_a_policy_resets_its_clocks_first_and_starts_the_next_clean(
    make_driver: DriverFactory,
) -> None:
    drv, agent = _agent(make_driver)
    agent.phase(POD, "generation", 0)
    drv.advance(1.0)
    agent.meter.sample()
    agent.phase(POD, "training", 0)
    agent.end_step(POD, 0, TOKENS)
    agent.phase(POD, "generation", 1)  # step 1 running, GPUs locked
    assert all(drv.gpu(u).locked for u in drv.uuids)
    writer = _Writer(drv)
    agent_main.leave_policy(agent, writer, "dpo")  # type: ignore[arg-type]
    assert not any(drv.gpu(u).locked for u in drv.uuids)
    (last,) = writer.reports
    assert writer.locked_at_write == [False]  # reset before the report says so
    assert last.policy_name == "grpo" and [s.step for s in last.steps] == [0]
    assert all(g.reset_acknowledged for g in last.gpus)
    assert agent.policy_name == "dpo" and agent.plan is None
    fresh = agent.report()
    assert fresh.policy_name == "dpo" and fresh.steps == [] and fresh.last_step == -1
    # without a writer (no policy before) it still resets
    agent.set_plan(PLAN)
    agent.phase(POD, "generation", 2)
    assert all(drv.gpu(u).locked for u in drv.uuids)
    agent_main.leave_policy(agent, None, "")
    assert not any(drv.gpu(u).locked for u in drv.uuids) and agent.policy_name == ""


class _Finder:
    def __init__(self, result: selector.Discovery | Exception) -> None:
        self.result = result

    def discover(self, gpu_pods: Any) -> selector.Discovery:
        assert list(gpu_pods) == [("team-a", "trainer-0")]
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_a_conflict_is_logged_once_as_an_error_and_exported(
    make_driver: DriverFactory, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    _, agent = _agent(make_driver)
    conflict = selector.Discovery(
        None, "Conflict", "pod team-a/trainer-0 is selected by 2 policies (a, b)", ("x",)
    )
    caplog.set_level(logging.INFO, logger="rlenergy_agent")
    first = agent_main.rediscover(_Finder(conflict), agent, None)  # type: ignore[arg-type]
    again = agent_main.rediscover(_Finder(conflict), agent, first)  # type: ignore[arg-type]
    assert first == again == conflict
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "selected by 2 policies" in errors[0].getMessage()
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(agent).decode())}
    (sample,) = families["rlenergy_agent_policy_discovery"].samples
    assert sample.labels == {"node": agent.node_name, "reason": "Conflict", "policy": ""}
    assert sample.value == 1.0
    # an API error keeps what we have (None: no change)
    assert agent_main.rediscover(_Finder(OSError("refused")), agent, again) is None  # type: ignore[arg-type]
    assert agent.discovery == ("Conflict", "")


def test_an_empty_listing_keeps_the_policy_while_its_pods_run(make_driver: DriverFactory) -> None:
    drv, agent = _agent(make_driver)
    matched = selector.Discovery(
        selector.PolicyRef("team-a", "grpo"), "Matched", "grpo selects team-a/trainer-0",
        ("team-a/trainer-0",),
    )  # fmt: skip
    assert agent_main.rediscover(_Finder(matched), agent, None) == matched
    agent.phase(POD, "generation", 0)  # governed, GPUs locked
    assert all(drv.gpu(u).locked for u in drv.uuids)

    class _Empty:
        def discover(self, gpu_pods: Any) -> selector.Discovery:
            return selector.discover([selector.PodLabels(ns, n, {}) for ns, n in gpu_pods], [])

    agent.podmap = pods.StaticPodMap({})  # the restarted kubelet lists no pod yet
    assert agent_main.rediscover(_Empty(), agent, matched) is None  # type: ignore[arg-type]
    assert agent.discovery == ("Matched", "team-a/grpo")
    assert agent.selected == frozenset({("team-a", "trainer-0")})
    assert all(drv.gpu(u).locked for u in drv.uuids)
    # The pod-end watch found it ended: the next empty listing leaves the policy.
    agent.pod_gone(POD, "EndedInApi")
    found = agent_main.rediscover(_Empty(), agent, matched)  # type: ignore[arg-type]
    assert found is not None and found.reason == "NoGpuPods"
    assert agent.selected == frozenset()
