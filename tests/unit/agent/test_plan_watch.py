"""The agent's plan watch (``kube.PlanWatcher``) over the real ``kubeapi.Watch``.

The API is faked at the transport: ``list_namespaced_custom_object`` returns a listing, or,
with ``watch=True``, a response whose stream carries watch events as JSON lines, as the API
server sends them. We test these aspects:
* the first poll has the listed plan; a MODIFIED event's plan replaces it with no request;
* a DELETED event reads as "policy gone" (the agent resets clocks);
* ``status.totals.throughStep`` is delivered as the folded step (-1 once the policy is gone),
  no later than ``status.rollout.throughStep``; the node loop hands it to the report;
* a watch resumes from the newest resourceVersion seen (bookmarks included); 410 Gone lists
  again; an error before the first listing is raised by ``poll`` (the caller keeps its plan);
* stop ends the thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from agent_support import POD_A, DriverFactory, WatchStream, standin_agent
from rlenergy_agent import config, kube, nodeloop, podlife
from rlenergy_agent.kubeapi import ApiException

from rlenergy.api import node as api_node

_WORKLOAD = api_node.TokenWorkloadReport(
    samples=1, responseTokens=10, promptTokens=1, validTokens=10, meanContextTokens=1
)


def _policy(step: int, rv: str) -> dict[str, Any]:
    plan = {"step": step, "phases": [{"phase": "generation", "clockMHz": 1410, "state": "locked"}]}
    return {
        "metadata": {"name": "p", "namespace": "ns", "resourceVersion": rv},
        "status": {"plan": plan, "totals": {"savingPercent": 5.0}},
    }


_Resp = WatchStream


class _Api:
    """``CustomObjectsApi`` stand-in: scripted listings and watch streams."""

    def __init__(self, listings: list[Any], watches: list[list[dict[str, Any]]]) -> None:
        self.listings, self.watches = listings, watches
        self.calls: list[dict[str, Any]] = []
        self.hold = threading.Event()

    def list_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        """Fake.

        :return: object
        """
        self.calls.append(kwargs)
        if kwargs.get("watch"):
            events = self.watches.pop(0) if self.watches else []
            return _Resp(events, None if self.watches else self.hold)
        item = self.listings.pop(0) if len(self.listings) > 1 else self.listings[0]
        if isinstance(item, Exception):
            raise item
        return item


def _listing(rv: str, *items: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": rv}, "items": list(items)}


def _until(cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_listed_plan_then_watched_changes_without_requests():
    api = _Api(
        [_listing("10", _policy(0, "9"))],
        [
            [
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "11"}}},
                {"type": "MODIFIED", "object": _policy(1, "12")},
            ]
        ],
    )
    w = kube.PlanWatcher(api, "ns", "p", retry_max_s=0.05)
    try:
        exists, plan = w.poll()
        assert exists and plan is not None and plan.step in (0, 1)
        _until(lambda: (p := w.poll()[1]) is not None and p.step == 1)
        assert w.saving_ratio == {"": 0.05}
        watch_calls = [c for c in api.calls if c.get("watch")]
        assert watch_calls[0]["resource_version"] == "10"
        assert watch_calls[0]["field_selector"] == "metadata.name=p"
        assert watch_calls[0]["allow_watch_bookmarks"] is True
        calls = len(api.calls)
        for _ in range(20):
            w.poll()
        assert len(api.calls) == calls  # poll reads the watch's state: no request
    finally:
        w.stop()
        api.hold.set()


def test_deleted_policy_reads_as_gone_and_410_lists_again():
    gone = {"type": "ERROR", "object": {"code": 410, "reason": "Gone", "message": "too old"}}
    api = _Api(
        [_listing("5", _policy(3, "5")), _listing("20", _policy(4, "20"))],
        [[{"type": "DELETED", "object": _policy(3, "6")}, gone], []],
    )
    w = kube.PlanWatcher(api, "ns", "p", retry_max_s=0.05)
    try:
        _until(lambda: (p := w.poll()[1]) is not None and p.step == 4)  # relisted after 410
        _until(lambda: len([c for c in api.calls if c.get("watch")]) == 2)
        time.sleep(0.2)
        # One relist, then a watch from the new list's version: no loop on the stale "6".
        assert sum(1 for c in api.calls if not c.get("watch")) == 2
        assert [c["resource_version"] for c in api.calls if c.get("watch")] == ["5", "20"]
    finally:
        w.stop()
        api.hold.set()


def test_the_folded_step_comes_with_the_status_and_goes_with_the_policy():
    """``totals.throughStep`` as delivered (the report leaves out the records up to it); a
    policy without totals or a deleted one folds nothing."""
    folded = _policy(8, "7")
    folded["status"]["totals"]["throughStep"] = 7
    api = _Api(
        [_listing("5", _policy(3, "5"))],
        [[{"type": "MODIFIED", "object": folded}, {"type": "DELETED", "object": folded}]],
    )
    w = kube.PlanWatcher(api, "ns", "p", retry_max_s=0.05)
    try:
        seen: list[int] = []
        _until(lambda: seen.append(w.folded_through_step) or w.poll() == (False, None))
        assert w.folded_through_step == -1 and set(seen) <= {-1, 7}
    finally:
        w.stop()
        api.hold.set()
    api = _Api([_listing("5", folded)], [])
    w = kube.PlanWatcher(api, "ns", "p", retry_max_s=0.05)
    try:
        w.poll()
        assert w.folded_through_step == 7
    finally:
        w.stop()
        api.hold.set()


def test_the_node_loop_hands_the_folded_step_to_the_report(make_driver: DriverFactory) -> None:
    """The node loop's poll gives the agent the folded step; the report leaves out the records
    up to it and says so."""
    drv = make_driver(1)
    agent = standin_agent({POD_A: list(drv.uuids)}, None, lambda: drv.virtual_s)
    for step in range(3):
        agent.phase(POD_A, "generation", step)
        drv.advance(0.5)
        agent.meter.sample()
        agent.phase(POD_A, "idle", step)
        agent.end_step(POD_A, step, _WORKLOAD)
    settings = config.AgentSettings(node_name="node-1", kube=False, plan_poll_s=60.0)
    loop = nodeloop.NodeLoop(settings, agent, podlife.PodEndWatch(agent), None, discover=False)

    class _Watcher:
        saving_ratio: dict[str, float] = {}
        lost_workers: list[str] = []
        phase_source = "socket"
        folded_through_step = 1

        def poll(self) -> tuple[bool, None]:
            return True, None

    loop._poll(_Watcher())  # type: ignore[arg-type]  # noqa: SLF001 - one poll, as tick makes it
    report = agent.report()
    assert agent.folded_through_step == 1
    assert [r.step for r in report.steps] == [2] and report.folded_through_step == 1
    assert report.last_step == 2


def test_the_folded_step_is_the_older_of_totals_and_rollout():
    assert kube.folded_through_step({"totals": {"throughStep": 7}}) == 7
    assert kube.folded_through_step({"totals": {"throughStep": 7}, "rollout": {}}) == -1
    both = {"totals": {"throughStep": 7}, "rollout": {"throughStep": 5}}
    assert kube.folded_through_step(both) == 5
    assert kube.folded_through_step({}) == -1
    assert kube.folded_through_step({"totals": {"throughStep": True}}) == -1


def test_deleted_event_resets():
    api = _Api([_listing("5", _policy(3, "5"))], [[{"type": "DELETED", "object": _policy(3, "6")}]])
    w = kube.PlanWatcher(api, "ns", "p", retry_max_s=0.05)
    try:
        _until(lambda: w.poll() == (False, None))
        assert w.saving_ratio == {}
    finally:
        w.stop()
        api.hold.set()


def test_first_listing_error_is_raised_by_poll():
    api = _Api([ApiException(status=403, reason="Forbidden")], [])
    w = kube.PlanWatcher(api, "ns", "p", retry_max_s=0.05)
    try:
        with pytest.raises(ApiException):
            w.poll()
    finally:
        w.stop()
        api.hold.set()
    w._thread.join(timeout=5)
    assert not w._thread.is_alive()


def test_lost_rollout_workers_are_relayed_to_the_dispatcher(make_driver):
    # The operator names lost rollout worker pods in status.rollout.failure; the watch keeps
    # them and the agent answers /v1/rollout/lost with them (the dispatcher has no API access).
    from agent_support import standin_agent
    from rlenergy_agent import server, service

    from rlenergy.api import signals

    lost = _policy(3, "9")
    lost["status"]["rollout"] = {
        "failure": {"reason": "RolloutWorkerLost", "step": 3, "lostWorkers": ["ns/worker-1"]}
    }
    api = _Api([_listing("10", lost)], [[{"type": "MODIFIED", "object": _policy(4, "12")}]])
    w = kube.PlanWatcher(api, "ns", "p", retry_max_s=0.05)
    try:
        w.poll()
        assert w.lost_workers in (["ns/worker-1"], [])  # the MODIFIED event may be in already
        _until(lambda: (p := w.poll()[1]) is not None and p.step == 4)
        assert w.lost_workers == []  # the failure was cleared
    finally:
        w.stop()
        api.hold.set()
    pod = service.PodRef("ns", "dispatcher", "")
    drv = make_driver(1)
    agent = standin_agent({pod: list(drv.uuids)}, None, lambda: drv.virtual_s)
    agent.lost_workers = ["ns/worker-1"]
    answer = server.dispatch(agent, pod, signals.LostWorkersRequest(), 0.0)
    assert isinstance(answer, signals.LostWorkersAnswer)
    assert answer.lost_workers == ["ns/worker-1"] and answer.pod == str(pod)


class _CutResp(_Resp):
    """A watch response whose connection breaks once ``cut`` is set (the API server exits)."""

    def __init__(self, cut: threading.Event) -> None:
        super().__init__([], None)
        self.cut = cut

    def stream(self, amt: Any = None, decode_content: bool = False) -> Any:
        self.cut.wait(5)
        raise ConnectionResetError("Response ended prematurely")
        yield b""  # a generator, like urllib3's


class _CutApi(_Api):
    """Each watch request holds until the test cuts its connection (``cuts[i].set()``)."""

    def __init__(self) -> None:
        super().__init__([_listing("10", _policy(0, "9"))], [])
        self.cuts = [threading.Event() for _ in range(3)]

    def list_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        """Fake.

        :return: object
        """
        if kwargs.get("watch"):
            self.calls.append(kwargs)
            return _CutResp(self.cuts[len([c for c in self.calls if c.get("watch")]) - 1])
        return super().list_namespaced_custom_object(*args, **kwargs)


def _watches(api: _Api) -> int:
    return len([c for c in api.calls if c.get("watch")])


def test_a_connection_cut_after_stop_ends_quietly_and_one_before_lists_again(caplog):
    # The scale bench saw one "Response ended prematurely" per watcher when its cluster stopped
    # under watchers it had not stopped: a stopped watcher says nothing and ends; a live one
    # warns and lists again.
    api = _CutApi()
    w = kube.PlanWatcher(api, "ns", "p", retry_max_s=0.05)
    with caplog.at_level("WARNING", logger=kube.log.name):
        w.poll()
        _until(lambda: _watches(api) == 1)
        api.cuts[0].set()  # a live watcher's connection breaks
        _until(lambda: _watches(api) == 2)  # warned, listed again, watches again
        assert "ended prematurely" in caplog.text
        assert sum(1 for c in api.calls if not c.get("watch")) == 2
        caplog.clear()
        w.stop()
        api.cuts[1].set()  # the connection of a stopped watcher breaks
        w._thread.join(timeout=5)
    assert not w._thread.is_alive()
    assert "ended prematurely" not in caplog.text
    assert _watches(api) == 2
