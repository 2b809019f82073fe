"""Node reports are read only from the nodes that host the policy's pods.

We test these aspects:
* ``hosting_nodes``: the nodes of the pods the whole selector matches (``matchExpressions``
  too), scheduled pods only, whatever their phase;
* ``from_hosting_nodes`` keeps the reports of those nodes and names the others;
* ``PodNodes`` lists once, lists again after ``REFRESH_S``, or after ``MIN_REFRESH_S`` when a
  report names a node it has not seen (not sooner, however often that node reports), keeps a
  node ``HOSTED_GRACE_S`` after its last pod left, and keeps what it knew when a listing fails;
* the job loop (``handlers.policy_loop``) over a spoofed report of a node that hosts none of the
  policy's pods: the totals are those of the two real nodes' reports alone, and the operator
  logs the ignored node once over two passes.
"""

from __future__ import annotations

from typing import Any

import pytest
from hand_reports import STEPS, report
from kopf_doubles import StatusPatch, WarningLog, serving
from rlenergy_operator import handlers, jobloop, kube, podnodes
from rlenergy_operator import reports as node_reports

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy as api_policy

SPEC = {"selector": {"matchLabels": {"job": "grpo"}}}
SELECTOR = api_policy.LabelSelector.model_validate(SPEC["selector"])
NODES = ("gpu-node-0", "gpu-node-1")
SPOOFER = "gpu-node-9"


def _pod(node: str | None, labels: dict[str, str], phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"labels": labels},
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase},
    }


def test_hosting_nodes_are_those_of_the_selected_scheduled_pods() -> None:
    selector = {
        "matchLabels": {"job": "grpo"},
        "matchExpressions": [{"key": "role", "operator": "In", "values": ["actor", "rollout"]}],
    }
    pods = [
        _pod("n0", {"job": "grpo", "role": "actor"}),
        _pod("n1", {"job": "grpo", "role": "rollout"}, phase="Succeeded"),  # ran there
        _pod("n2", {"job": "grpo", "role": "critic"}),  # not selected
        _pod("n3", {"job": "other", "role": "actor"}),
        _pod(None, {"job": "grpo", "role": "actor"}),  # pending, no node yet
    ]
    assert podnodes.hosting_nodes(pods, selector) == {"n0", "n1"}


def test_reports_of_other_nodes_are_set_apart() -> None:
    reports = [report({0: STEPS[0]}, node=n) for n in (*NODES, SPOOFER, SPOOFER)]
    kept, ignored = podnodes.from_hosting_nodes(reports, set(NODES))
    assert [r.node_name for r in kept] == list(NODES)
    assert ignored == [SPOOFER]


class _Listing:
    def __init__(self) -> None:
        self.now = 100.0
        self.calls: list[str] = []
        self.pods = [_pod(n, {"job": "grpo"}) for n in NODES]
        self.fail = False

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.calls.append(selector)
        if self.fail:
            raise kube.ApiError(status=0, reason="API server unreachable")
        return self.pods


def test_the_listing_is_cached_and_refreshed_for_new_nodes() -> None:
    api = _Listing()
    cache = podnodes.PodNodes(api.list_pods, lambda: api.now)
    assert cache.nodes("ns", SELECTOR, NODES) == set(NODES)
    assert api.calls == ["job=grpo"]
    api.now += podnodes.MIN_REFRESH_S - 1
    assert cache.nodes("ns", SELECTOR, NODES) == set(NODES) and len(api.calls) == 1
    # a node the listing has not seen reports: listed again once MIN_REFRESH_S passed ...
    assert cache.nodes("ns", SELECTOR, [*NODES, SPOOFER]) == set(NODES) and len(api.calls) == 1
    api.now += 1
    assert cache.nodes("ns", SELECTOR, [*NODES, SPOOFER]) == set(NODES) and len(api.calls) == 2
    # ... and not on every pass while it keeps reporting
    api.now += 1
    assert cache.nodes("ns", SELECTOR, [*NODES, SPOOFER]) == set(NODES) and len(api.calls) == 2
    # a pod scheduled on a new node: its reports are read after the next listing
    api.pods.append(_pod("gpu-node-2", {"job": "grpo"}))
    api.now += podnodes.MIN_REFRESH_S
    assert "gpu-node-2" in cache.nodes("ns", SELECTOR, [*NODES, "gpu-node-2"])


def test_a_node_stays_a_reporter_for_a_while_after_its_pods_left() -> None:
    api = _Listing()
    cache = podnodes.PodNodes(api.list_pods, lambda: api.now)
    assert cache.nodes("ns", SELECTOR, NODES) == set(NODES)
    api.pods = api.pods[:1]  # gpu-node-1's pod deleted
    api.now += podnodes.REFRESH_S
    assert cache.nodes("ns", SELECTOR, NODES) == set(NODES)  # its last records still count
    api.now += podnodes.HOSTED_GRACE_S
    assert cache.nodes("ns", SELECTOR, NODES) == {NODES[0]}
    # a failed listing raises; what was known stays for the next pass
    api.fail, api.now = True, api.now + podnodes.REFRESH_S
    with pytest.raises(kube.ApiError):
        cache.nodes("ns", SELECTOR, NODES)
    api.fail = False
    assert cache.nodes("ns", SELECTOR, NODES) == {NODES[0]}


def _wire(rep: api_node.NodeReport) -> dict[str, Any]:
    return rep.model_dump(by_alias=True, exclude_none=True, mode="json")


def test_the_job_loop_ignores_a_report_from_a_node_without_the_policys_pods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps = {s: STEPS[s % 2] for s in range(4)}
    own = [report(steps, node=n) for n in NODES]
    spoof = report(steps, node=SPOOFER)
    api = {f"p.{r.node_name}": ("9", _wire(r)) for r in [*own, spoof]}
    monkeypatch.setattr(
        kube, "node_report_versions", lambda ns, p: {n: v for n, (v, _) in api.items()}
    )
    monkeypatch.setattr(kube, "node_report", lambda ns, name: api.get(name))
    pods = [_pod(n, {"job": "grpo"}) for n in NODES]
    monkeypatch.setattr(kube, "pods", lambda ns, selector: pods if selector == "job=grpo" else [])
    indexed = {
        ("ns", "p"): [
            node_reports.IndexedReport.from_spec(name, version, body, -1)
            for name, (version, body) in api.items()
        ]
    }
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(handlers.kopf, "event", lambda body, **kw: events.append(kw))
    memo: dict[str, Any] = {"operator": handlers.OperatorMemo(), "handover": serving()}
    log = WarningLog()
    status: dict[str, Any] = {"observedGeneration": 1}
    for _ in range(2):
        patch = StatusPatch()
        handlers.policy_loop(
            spec=SPEC, meta={"generation": 1, "resourceVersion": "7"}, status=status,
            patch=patch, memo=memo, body={}, namespace="ns", name="p", logger=log,
            policy_node_reports=indexed,
        )  # fmt: skip
        status = {**status, **patch.status}
    expected = jobloop.JobLoop(handlers._parse(SPEC), 1)
    expected.advance(own)
    assert status["totals"] == _wire_totals(expected)
    ignored = [w for w in log.warnings if SPOOFER in w]
    assert len(ignored) == 1 and "no pod of this policy runs there" in ignored[0], log.warnings


def _wire_totals(loop: jobloop.JobLoop) -> dict[str, Any]:
    return loop.totals().model_dump(by_alias=True, exclude_none=True, mode="json")
