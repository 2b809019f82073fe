"""Liveness that means it.

* the probe fails while a status write has not come back through the policy watch
  (``liveness.EchoTracker``);
* the probe fails when the API server lists objects at versions the watches never delivered
  for longer than the bound (``liveness.WatchLag``, read by the ``policy_watch_check`` timer),
  not while the API server is unreachable, not while reads stopped;
* kopf's watch timeouts stay set; kopf itself relists after ``410 Gone``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import kopf
import kopf_doubles
import pytest
from kopf._cogs.clients import fetching, watching
from kopf._cogs.structs import references
from rlenergy_operator import handlers, kube, liveness, settings

pytestmark = pytest.mark.field

P, R = "rlenergypolicies", "rlenergynodereports"


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _memo(clock: _Clock, bound_s: float = 60.0) -> dict[str, Any]:
    shared = handlers.OperatorMemo(
        echoes=liveness.EchoTracker(bound_s=bound_s, clock=clock),
        watch_lag=liveness.WatchLag(bound_s=bound_s, stale_s=100.0, clock=clock),
    )
    return {"operator": shared, "handover": kopf_doubles.serving()}


def test_a_write_the_watch_never_brings_back_fails_the_probe():
    clock = _Clock()
    memo = _memo(clock)
    echoes: liveness.EchoTracker = memo["operator"].echoes
    assert handlers.policy_watch_probe(memo=memo) == "ok"  # nothing written: a quiet cluster
    echoes.wrote(("team-a", "grpo"), "100")
    clock.t += 30
    echoes.seen(("team-a", "grpo"), "100")  # the next pass still sees the old body
    echoes.wrote(("team-a", "grpo"), "100")  # and writes again: the first write's age counts
    assert handlers.policy_watch_probe(memo=memo) == "ok"
    clock.t += 31
    with pytest.raises(kopf.PermanentError, match=r"team-a/grpo 61 s ago never came back"):
        handlers.policy_watch_probe(memo=memo)
    echoes.seen(("team-a", "grpo"), "101")  # the watch delivers again
    assert handlers.policy_watch_probe(memo=memo) == "ok"
    echoes.wrote(("team-b", "x"), "7")
    clock.t += 120
    echoes.forget(("team-b", "x"))  # deleted: nothing to wait for
    assert echoes.overdue() == {}


def test_all_watches_silent_fails_the_probe_within_the_bound():
    clock = _Clock()
    memo = _memo(clock)
    lag: liveness.WatchLag = memo["operator"].watch_lag
    rep, pol = (R, "ns", "node-1"), (P, "ns", "grpo")
    lag.delivered(rep, "10")
    lag.delivered(pol, "11")
    lag.listed({rep: "10", pol: "11"}, lag.now())  # the watch has what the server has
    assert lag.silent() == {}
    # The watches go silent; the agent keeps writing its report.
    clock.t += 20
    lag.listed({rep: "15", pol: "11"}, lag.now())  # pending from here
    clock.t += 20
    lag.listed({rep: "18", pol: "11"}, lag.now())  # still pending since the first read
    clock.t += 20
    assert handlers.policy_watch_probe(memo=memo) == "ok"  # 40 s < 60 s
    clock.t += 21
    with pytest.raises(kopf.PermanentError, match=r"rlenergynodereports ns/node-1 for 61 s"):
        handlers.policy_watch_probe(memo=memo)
    assert set(lag.silent()) == {rep}
    lag.delivered(rep, "18")  # the watch delivers again (e.g. kopf's relist after 410 Gone)
    assert handlers.policy_watch_probe(memo=memo) == "ok"


def test_a_lagging_but_live_watch_stays_live():
    clock = _Clock()
    lag = liveness.WatchLag(bound_s=60.0, stale_s=100.0, clock=clock)
    rep = (R, "ns", "node-1")
    lag.delivered(rep, "1")
    for v in range(2, 40):  # the object changes between every read; the watch is a bit behind
        lag.listed({rep: str(v)}, lag.now())
        clock.t += 10
        lag.delivered(rep, str(v))  # ... but delivers every version
    assert lag.silent() == {}


def test_new_and_deleted_objects():
    clock = _Clock()
    lag = liveness.WatchLag(bound_s=60.0, stale_s=100.0, clock=clock)
    old, new = (R, "ns", "gone"), (R, "ns", "new")
    lag.delivered(old, "3")
    clock.t += 1
    started = lag.now()
    clock.t += 1
    lag.delivered(new, "7")  # created after the list's snapshot, delivered before it returned
    lag.listed({}, started)  # neither listed: the old one is gone, the new one is kept
    clock.t += 10
    lag.listed({new: "7"}, lag.now())
    clock.t += 100
    assert lag.silent() == {}  # the new one was delivered at the listed version
    never = (P, "ns", "never")
    lag.listed({new: "7", never: "9"}, lag.now())  # listed, never delivered
    clock.t += 61
    assert set(lag.silent()) == {never}
    lag.listed({new: "7"}, lag.now())  # deleted before the watch brought it: nothing waits
    assert lag.silent() == {}


def test_unreachable_api_server_and_stopped_reads_are_not_judged():
    clock = _Clock()
    lag = liveness.WatchLag(bound_s=60.0, stale_s=100.0, clock=clock)
    rep = (R, "ns", "node-1")
    lag.listed({rep: "5"}, lag.now())  # pending: never delivered
    clock.t += 50
    lag.unreachable()  # the API server went away: the watch cannot deliver either
    clock.t += 50
    assert lag.silent() == {}
    lag.listed({rep: "5"}, lag.now())  # back: starts over
    clock.t += 59
    assert lag.silent() == {}
    clock.t += 2
    assert set(lag.silent()) == {rep}
    clock.t += 40  # no read for 101 s > stale_s (a paused standby replica, no policy left)
    assert lag.silent() == {}
    lag.listed({rep: "5"}, lag.now())  # reads resume: pending starts over
    clock.t += 30
    assert lag.silent() == {}


def test_one_read_per_interval_serves_every_policy_and_reads_never_overlap():
    clock = _Clock()
    lag = liveness.WatchLag(clock=clock)
    assert lag.due(27.0)
    assert not lag.due(27.0)  # the second policy's timer in the same interval
    clock.t += 90  # the read is still waiting for the API server
    assert not lag.due(27.0)
    lag.listed({}, 0.0)
    assert not lag.due(27.0)  # the interval counts from the end of the last read
    clock.t += 27
    assert lag.due(27.0)
    lag.unreachable()  # a failed read ends it too
    clock.t += 27
    assert lag.due(27.0)


def test_the_check_timer_reads_the_server_and_a_failed_read_judges_nothing(
    monkeypatch: pytest.MonkeyPatch,
):
    clock = _Clock()
    memo = _memo(clock)
    answers: list[Any] = [{(R, "ns", "n"): "4"}, kube.ApiError(status=0, reason="unreachable")]

    def watched_versions(
        namespaces: Any = (), timeout_s: float = 0, report_selector: Any = None
    ) -> Any:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(kube, "watched_versions", watched_versions)
    log = _Log()
    handlers.policy_watch_check(memo=memo, logger=log)
    handlers.policy_watch_check(memo=memo, logger=log)  # not due: no second request
    assert len(answers) == 1
    clock.t += 61
    with pytest.raises(kopf.PermanentError, match="never delivered"):
        handlers.policy_watch_probe(memo=memo)
    clock.t += handlers.CFG.watch_check_interval_s
    handlers.policy_watch_check(memo=memo, logger=log)  # the API server is unreachable
    assert handlers.policy_watch_probe(memo=memo) == "ok"
    assert "read failed: 0 unreachable" in log.lines[-1]


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args)


def test_the_index_and_the_job_loop_record_what_the_watch_delivered():
    clock = _Clock()
    memo = _memo(clock)
    handlers.policy_node_reports(
        namespace="ns", name="n1", meta={"resourceVersion": "8"}, spec={}, memo=memo
    )

    class _Patch(dict[str, Any]):
        status: dict[str, Any] = {}

    handlers.policy_loop(
        spec={},
        meta={"deletionTimestamp": "2026-01-01T00:00:00Z", "resourceVersion": "9"},
        status={},
        patch=_Patch(),
        memo=memo,
        body={},
        namespace="ns",
        name="p",
        logger=None,
    )
    lag: liveness.WatchLag = memo["operator"].watch_lag
    lag.listed({(R, "ns", "n1"): "8", (P, "ns", "p"): "9"}, lag.now())
    clock.t += 90
    lag.listed({(R, "ns", "n1"): "8", (P, "ns", "p"): "9"}, lag.now())
    clock.t += 61
    assert lag.silent() == {}


def test_watched_versions_lists_metadata_only_per_namespace(monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[Any, ...]] = []

    class _Api:
        def __init__(self, client: Any) -> None:
            pass

        def list_namespaced_custom_object(self, g: str, v: str, ns: str, plural: str, **kw: Any):
            calls.append((ns, plural, kw["_headers"]["Accept"]))
            assert kw["_request_timeout"] == 5.0
            assert kw["resource_version"] == "0"  # from the watch cache, not etcd
            if plural == R:
                return {"items": None}  # an empty metadata list says null
            meta = {"name": "p", "namespace": ns, "resourceVersion": "3"}
            return {"items": [{"metadata": meta}]}

    monkeypatch.setattr(kube, "_api", lambda: None)
    monkeypatch.setattr(kube.kubernetes.client, "CustomObjectsApi", _Api)
    assert kube.watched_versions(("a", "b"), 5.0) == {(P, "a", "p"): "3", (P, "b", "p"): "3"}
    assert {(ns, plural) for ns, plural, _ in calls} == {(n, k) for n in "ab" for k in (P, R)}
    assert all("PartialObjectMetadataList" in accept for *_, accept in calls)


@pytest.fixture
def no_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up handler's shard hand-over lists the policies (none here)."""
    monkeypatch.setattr(kube, "live_policies", lambda namespaces=(): [])


@pytest.mark.usefixtures("no_policies")
def test_watch_timeouts_stay_set_and_the_bound_is_above_kopfs_own_reconnect():
    cfg = settings.OperatorConfig()
    s = kopf.OperatorSettings()
    settings.configure_kopf(s, cfg)
    assert s.watching.server_timeout == cfg.watch_server_timeout_s > 0
    assert s.watching.client_timeout is not None
    assert s.watching.client_timeout > s.watching.server_timeout
    assert s.watching.connect_timeout is not None
    assert s.watching.inactivity_timeout is not None  # kopf reconnects a silent stream
    assert cfg.watch_echo_bound_s > s.watching.inactivity_timeout + cfg.reconcile_interval_s
    assert cfg.watch_echo_bound_s > 2 * cfg.watch_check_interval_s
    memo: dict[str, Any] = {}
    handlers.operator_startup(settings=kopf.OperatorSettings(), memo=memo)
    assert (
        memo["operator"].echoes.bound_s
        == memo["operator"].watch_lag.bound_s
        == cfg.watch_echo_bound_s
    )
    assert memo["operator"].watch_lag.stale_s > cfg.watch_check_interval_s


@pytest.mark.usefixtures("no_policies")
def test_each_policy_memo_copy_shares_the_operator_state_and_keeps_its_own():
    memo: dict[str, Any] = {}
    handlers.operator_startup(settings=kopf.OperatorSettings(), memo=memo)
    first, second = copy.copy(memo), copy.copy(memo)  # kopf's per-object memo copies
    assert handlers._shared(first) is handlers._shared(second) is memo["operator"]
    handlers._policy(first).lagging = (3, 10.0)
    assert handlers._policy(first) is handlers._policy(first)  # made once, then kept
    assert handlers._policy(second).lagging is None
    assert "policy" not in memo  # never in the operator-wide memo
    assert first["handover"] is memo["handover"] and memo["handover"].established


def test_kopf_relists_after_410_gone(monkeypatch: pytest.MonkeyPatch):
    """kopf/_cogs/clients/watching.py ``continuous_watch``: 410 ends the stream, and
    ``infinite_watch`` lists again before it watches from the new list's version."""
    fetched: list[str] = []
    watched: list[str | None] = []
    lists = [("5", {"metadata": {"name": "a", "resourceVersion": "5"}}), ("9", None)]

    async def fetch_objs(**_: Any) -> AsyncIterator[tuple[list[Any], str]]:
        version, obj = lists.pop(0)
        fetched.append(version)
        yield ([obj] if obj else []), version

    async def watch_objs(*, since: str | None, **_: Any) -> AsyncIterator[Any]:
        watched.append(since)
        if since == "5":
            yield {"type": "ERROR", "object": {"code": 410, "reason": "Gone"}}
        else:
            yield {"type": "ADDED", "object": {"metadata": {"name": "b", "resourceVersion": "10"}}}

    monkeypatch.setattr(fetching, "fetch_objs", fetch_objs)
    monkeypatch.setattr(watching, "watch_objs", watch_objs)
    s = kopf.OperatorSettings()
    s.watching.reconnect_backoff = 0

    async def collect() -> list[Any]:
        resource = references.Resource("rlenergy.io", "v1alpha1", P, namespaced=True)
        out = []
        async for e in watching.infinite_watch(
            settings=s, resource=resource, namespace=None, _iterations=2
        ):
            out.append(e)
            if isinstance(e, dict) and e.get("type") == "ADDED":
                break
        return out

    events = asyncio.run(collect())
    assert fetched == ["5", "9"]  # listed again after the 410, not a loop on the old version
    assert watched == ["5", "9"]
    assert events[-1]["object"]["metadata"]["name"] == "b"
