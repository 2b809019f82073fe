"""Phase signals from pod annotations (``phaseSource: annotation``; ``rlenergy_agent.annotations``).

The agent is real (stand-in NVML under the real pynvml); the API is faked at the transport as
in ``test_plan_watch.py``: ``list_pod_for_all_namespaces`` returns a listing (raw JSON, as with
``_preload_content=False``) or, with ``watch=True``, a response streaming watch events as JSON
lines through the agent's real ``kubeapi.Watch``. We test these aspects:
* an annotated pod's phase locks its own GPUs at the plan's clock, through the same
  ``Agent.phase`` path as the socket (latency histogram, windows), and the next phase closes
  the window; the workload annotation ends the step before the new phase opens;
* only a change of the annotated values is a signal: the same annotations again (a relist, a
  status update) do nothing;
* the same authorization as the socket: a pod of another node, a pod holding no GPU here, or a
  pod whose UID differs from the kubelet's is refused and clocks nothing; another pod's GPUs
  are never touched; a bad value (one annotation of the pair, a non-numeric step, a bad
  workload JSON) is refused, logged once, and the watch goes on;
* the watch: field selector ``spec.nodeName=<node>``, resumes from the list's resourceVersion
  with bookmarks, tracks the newest resourceVersion (bookmarks included), lists again after
  410 Gone without signalling twice, and after a lost connection (a pause first); a deleted
  pod is forgotten;
* the same watch with ``identity.PodEndTokens`` as its handler: a pod whose deletion starts has
  its token refused at its next use;
* the plan watch reads ``spec.phaseSource`` (the node loop starts the annotation watch from it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import pytest
from agent_support import LOCKED_PLAN as PLAN
from agent_support import POD_A, POD_B, DriverFactory, FakeReviews, WatchStream, standin_agent
from rlenergy_agent import annotations, identity, kube, service

from rlenergy.api import signals

pytestmark = pytest.mark.field
NODE = "node-1"
WORKLOAD = {
    "samples": 8,
    "responseTokens": 800,
    "promptTokens": 100,
    "validTokens": 800,
    "meanContextTokens": 450,
}


def _pod(
    ref: service.PodRef,
    notes: dict[str, str] | None = None,
    *,
    node: str = NODE,
    rv: str = "1",
    uid: str | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": ref.namespace,
            "name": ref.name,
            "uid": ref.uid if uid is None else uid,
            "resourceVersion": rv,
            "annotations": dict(notes or {}),
        },
        "spec": {"nodeName": node, "serviceAccountName": "trainer"},
    }


def _phase(phase: str, step: int) -> dict[str, str]:
    return {signals.PHASE_ANNOTATION: phase, signals.STEP_ANNOTATION: str(step)}


def _event(ref: service.PodRef, notes: dict[str, str] | None = None, **kw: Any):
    return annotations.PodEvent.of(_pod(ref, notes, **kw))


def _locked(drv: Any, uuids: list[str]) -> list[int | None]:
    return [drv.gpu(u).lock_max_mhz if drv.gpu(u).locked else None for u in uuids]


def test_an_annotated_phase_drives_the_pods_own_gpus_like_a_socket_signal(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(4)
    a, b = list(drv.uuids[:2]), list(drv.uuids[2:])
    agent = standin_agent({POD_A: a, POD_B: b}, PLAN, lambda: drv.virtual_s, node=NODE)
    notes = annotations.PodAnnotations(agent, clock=lambda: drv.virtual_s)
    assert notes.handle(_event(POD_A, _phase("generation", 0))) == ["phase generation 0"]
    assert _locked(drv, a) == [1395, 1395] and _locked(drv, b) == [None, None]
    assert agent.latency_hist.count == 1  # the socket's histogram: same path
    assert {agent.phase_of[u] for u in a} == {"generation"} and agent.pod_of[a[0]] == POD_A
    # The same values again (a relist, a status update of the pod): no signal.
    assert notes.handle(_event(POD_A, _phase("generation", 0), rv="2")) == []
    assert agent.latency_hist.count == 1
    drv.advance(2.0)
    step_end = {signals.WORKLOAD_ANNOTATION: json.dumps({"step": 0, "workload": WORKLOAD})}
    assert notes.handle(_event(POD_A, {**_phase("training", 1), **step_end}, rv="3")) == [
        "step 0",
        "phase training 1",
    ]
    assert _locked(drv, a) == [1755, 1755]
    assert agent.workloads[0].valid_tokens == 800  # the step's workload, filed before step 1
    gen = agent.steps[0]["generation"][0]
    assert gen.duration_seconds == pytest.approx(2.0) and gen.requested_clock_mhz == 1395
    rec = agent.report()
    assert [s.step for s in rec.steps] == [0] and rec.steps[0].workload.samples == 8
    assert notes.signals == 3 and notes.refused == 0
    notes.handle(_event(POD_A, _phase("idle", 1), rv="4"))
    assert {agent.phase_of[u] for u in a} == {"idle"}


def test_pods_of_other_nodes_without_gpus_or_with_bad_values_are_refused(
    make_driver: DriverFactory, caplog: pytest.LogCaptureFixture
) -> None:
    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, PLAN, lambda: drv.virtual_s, node=NODE)
    notes = annotations.PodAnnotations(agent)
    stranger = service.PodRef("team-a", "no-gpus", "99999999-0000-0000-0000-000000000000")
    caplog.set_level(logging.WARNING, logger="rlenergy_agent.annotations")
    refused = [
        _event(POD_A, _phase("generation", 0), node="node-2"),  # another node's pod
        _event(stranger, _phase("generation", 0)),  # holds no GPU here
        _event(POD_A, _phase("generation", 0), uid="00000000-0000-0000-0000-000000000000"),
        _event(POD_A, {signals.PHASE_ANNOTATION: "generation"}),  # the step is missing
        _event(POD_A, {**_phase("generation", 0), signals.STEP_ANNOTATION: "two"}),
        _event(POD_A, {signals.WORKLOAD_ANNOTATION: '{"step": 0}'}),  # no workload
    ]
    for ev in refused:
        assert notes.handle(ev) == []
    assert _locked(drv, list(drv.uuids)) == [None, None]
    assert notes.refused == len(refused) and notes.signals == 0
    text = caplog.text
    for why in (
        "this agent serves node node-1",
        "holds no GPU on node node-1",
        "has UID 00000000",
        "annotation rlenergy.io/step is missing",
        "rlenergy.io/step='two' must be an integer",
        "annotation rlenergy.io/workload: workload",
    ):
        assert why in text, text
    # One warning per reason, not one per event of the pod.
    caplog.clear()
    bad = _event(POD_A, {**_phase("generation", 0), signals.STEP_ANNOTATION: "two"})
    notes.handle(bad)
    notes.handle(bad)
    assert caplog.text.count("must be an integer") == 1
    # Fixed: the pod's next patch is acted on.
    assert notes.handle(_event(POD_A, _phase("generation", 0))) == ["phase generation 0"]
    assert _locked(drv, list(drv.uuids)) == [1395, 1395]


_Resp = WatchStream


class _Listing:
    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()


class _Core:
    """``CoreV1Api`` stand-in: scripted pod listings and watch streams."""

    def __init__(self, listings: list[Any], watches: list[list[dict[str, Any]]]):
        self.listings, self.watches = listings, watches
        self.calls: list[dict[str, Any]] = []
        self.hold = threading.Event()

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> Any:
        """Fake.

        :return: V1PodList
        """
        self.calls.append(kwargs)
        if kwargs.get("watch"):
            events = self.watches.pop(0) if self.watches else []
            return _Resp(events, None if self.watches else self.hold)
        assert kwargs.get("_preload_content") is False  # raw JSON: no V1Pod per pod
        body = self.listings.pop(0) if len(self.listings) > 1 else self.listings[0]
        if isinstance(body, Exception):
            raise body
        return _Listing(body)


def _until(cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def _listing(rv: str, *items: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": rv}, "items": list(items)}


def test_the_watch_lists_resumes_with_bookmarks_and_relists_after_410(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, PLAN, lambda: drv.virtual_s, node=NODE)
    gone = {"type": "ERROR", "object": {"code": 410, "reason": "Gone", "message": "too old"}}
    core = _Core(
        [
            _listing("10", _pod(POD_A, _phase("generation", 0), rv="9")),
            # after 410: the pod as it is now; already acted on, so no second signal
            _listing("30", _pod(POD_A, _phase("training", 0), rv="21")),
        ],
        [
            [
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}},
                {"type": "MODIFIED", "object": _pod(POD_A, _phase("training", 0), rv="21")},
                gone,
            ],
            [{"type": "MODIFIED", "object": _pod(POD_A, _phase("generation", 1), rv="31")}],
        ],
    )
    watch = annotations.PodPhaseWatch(agent, NODE, core, retry_max_s=0.05)
    watch.start()
    try:
        _until(lambda: watch.handler.signals == 3)
        assert _locked(drv, list(drv.uuids)) == [1395, 1395]  # generation of step 1
        lists = [c for c in core.calls if not c.get("watch")]
        watches = [c for c in core.calls if c.get("watch")]
        assert len(lists) == 2 and all(
            c["field_selector"] == f"spec.nodeName={NODE}" for c in lists
        )
        assert [c["resource_version"] for c in watches] == ["10", "30"]
        assert all(c["allow_watch_bookmarks"] is True for c in watches)
        assert all(c["field_selector"] == f"spec.nodeName={NODE}" for c in watches)
        assert watch.version == "31" and watch.lists == 2
        assert agent.latency_hist.count == 3  # list (gen 0), event (train 0), event (gen 1)
    finally:
        watch.stop()
        core.hold.set()
        watch.join(5)
    assert not watch._thread.is_alive()


def test_a_lost_connection_lists_again_after_a_pause(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, PLAN, lambda: drv.virtual_s, node=NODE)
    core = _Core(
        [
            ConnectionRefusedError("API server restarting"),  # the first listing fails
            _listing("7", _pod(POD_A, _phase("generation", 0), rv="7")),
        ],
        [[]],
    )
    watch = annotations.PodPhaseWatch(agent, NODE, core, retry_max_s=0.05)
    watch.start()
    try:
        _until(lambda: watch.handler.signals == 1)
        assert _locked(drv, list(drv.uuids)) == [1395, 1395]
        assert watch.lists == 1  # the failed attempt made no listing
        _until(lambda: any(c.get("watch") for c in core.calls))
        assert [c["resource_version"] for c in core.calls if c.get("watch")] == ["7"]
    finally:
        watch.stop()
        core.hold.set()
        watch.join(5)


def test_a_deleted_pod_is_forgotten_and_a_relist_drops_pods_gone_meanwhile(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, PLAN, lambda: drv.virtual_s, node=NODE)
    notes = annotations.PodAnnotations(agent)
    notes.handle(_event(POD_A, _phase("generation", 0)))
    notes.forget(POD_A.uid)
    # A pod of the same UID seen again (the watch relisted after its delete): a new signal.
    assert notes.handle(_event(POD_A, _phase("generation", 0))) == ["phase generation 0"]
    notes.keep(set())
    assert notes.handle(_event(POD_A, _phase("generation", 0))) == ["phase generation 0"]


def test_a_pod_end_watch_refuses_a_deleted_pods_token_from_its_next_use(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, PLAN, lambda: drv.virtual_s, node=NODE)
    reviews = FakeReviews(NODE)
    auth = reviews.authenticator()
    token = reviews.issue(POD_A)
    assert identity.authorize(agent, auth.authenticate(f"Bearer {token}")) == POD_A
    deleting = _pod(POD_A, rv="12")
    deleting["metadata"]["deletionTimestamp"] = "2026-12-06T21:00:00Z"
    core = _Core(
        [_listing("10", _pod(POD_A, rv="9"))], [[{"type": "MODIFIED", "object": deleting}]]
    )
    ends = identity.PodEndTokens(auth)
    watch = annotations.PodPhaseWatch(
        agent, NODE, core, retry_max_s=0.05, handler=ends, name="pod end watch"
    )
    watch.start()
    try:
        _until(lambda: ends.ended == 1)
        with pytest.raises(identity.AuthError, match="has ended") as info:
            auth.authenticate(f"Bearer {token}")
        assert info.value.status == 403
        assert watch._thread.name == f"pod-end-watch-{NODE}"
    finally:
        watch.stop()
        core.hold.set()
        watch.join(5)


def _policy_watch_api(
    listed: dict[str, Any], changed: dict[str, Any], go: threading.Event, hold: threading.Event
) -> Any:
    """A fake ``CustomObjectsApi`` for a ``PlanWatcher``: the listing holds ``listed``; the first
    watch delivers ``changed`` once ``go`` is set, later watches hold until ``hold`` is."""

    class _Later(WatchStream):
        def stream(self, amt: Any = None, decode_content: bool = False) -> Any:
            go.wait(5)  # the listing is read first; the change comes when the test says so
            yield from super().stream(amt, decode_content)

    class _Api:
        watches = 0

        def list_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
            """Fake.

            :return: object
            """
            if kwargs.get("watch"):
                self.watches += 1
                if self.watches > 1:
                    return WatchStream([], hold)
                return _Later([{"type": "MODIFIED", "object": changed}], None)
            return _listing("2", listed)

    return _Api()


def test_the_plan_watch_reads_the_policys_phase_source() -> None:
    def policy(source: str | None, rv: str) -> dict[str, Any]:
        spec: dict[str, Any] = {"selector": {"matchLabels": {"app": "x"}}}
        if source is not None:
            spec["phaseSource"] = source
        return {"metadata": {"name": "p", "namespace": "ns", "resourceVersion": rv}, "spec": spec}

    go, hold = threading.Event(), threading.Event()
    api = _policy_watch_api(policy("annotation", "2"), policy(None, "3"), go, hold)
    w = kube.PlanWatcher(api, "ns", "p", retry_max_s=0.05)
    try:
        w.poll()
        assert w.phase_source == "annotation"
        go.set()
        _until(lambda: (w.poll(), w.phase_source)[1] == "socket")  # default when left out
    finally:
        w.stop()
        hold.set()


def test_the_node_loop_watches_annotations_only_while_the_policy_says_so(
    make_driver: DriverFactory,
) -> None:
    from rlenergy_agent import config, nodeloop, podlife

    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, None, lambda: drv.virtual_s, node=NODE)
    plan = PLAN.model_dump(by_alias=True, mode="json", exclude_none=True)

    def policy(source: str, rv: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "p", "namespace": "ns", "resourceVersion": rv},
            "spec": {"selector": {"matchLabels": {"app": "x"}}, "phaseSource": source},
            "status": {"plan": plan},
        }

    go, hold = threading.Event(), threading.Event()
    api = _policy_watch_api(policy("annotation", "2"), policy("socket", "3"), go, hold)

    core = _Core([_listing("10", _pod(POD_A, _phase("training", 0)))], [[]])
    settings = config.AgentSettings(node_name=NODE, policy_name="p", namespace="ns", kube=False)
    loop = nodeloop.NodeLoop(
        settings, agent, podlife.PodEndWatch(agent), api, discover=False, pods_api=core
    )
    assert loop.writer is not None
    loop.writer.write = lambda report: None  # type: ignore[method-assign]
    try:
        loop.tick(1e9)
        assert loop.phase_watch is not None and agent.plan == PLAN
        _until(lambda: _locked(drv, list(drv.uuids)) == [1755, 1755])  # the pod's annotation
        assert core.calls[0]["field_selector"] == f"spec.nodeName={NODE}"
        watch = loop.phase_watch
        go.set()  # phaseSource back to socket: the next poll stops the pod watch
        _until(lambda: (loop.tick(2e9 + time.monotonic()), loop.phase_watch is None)[1])
        core.hold.set()  # the fake stream cannot be cut like a socket: end it
        watch.join(5)
        assert not watch._thread.is_alive()
    finally:
        loop.close()
        hold.set()
        core.hold.set()
