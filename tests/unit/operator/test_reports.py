"""Reading node reports pass after pass (rlenergy_operator.reports).

We test these aspects:
* trimming keeps exactly what the loop needs: for every step after the checkpoint, a trimmed
  report gives the same step state and the same job-level step as the full report;
* the cache fetches a report only when its resourceVersion changed, refetches everything for a
  restore, forgets deleted reports and skips a malformed one without failing the pass;
* fed by the watch's index, a pass sends no request and sees what the API server would give;
  a restore, and an indexed copy trimmed past the checkpoint, still read from the API server;
* a rebuild, and a pass whose index dropped a report, list the reports' metadata: a report a
  refilling index lacks (a replica resumed by peering) or holds at an older version is read
  from the API server, so no step is folded over fewer nodes than reported it.
"""

from __future__ import annotations

import json
import logging

from hypothesis import given, settings
from hypothesis import strategies as st
from rlenergy_operator import reports

from rlenergy.api import node as api_node
from rlenergy.control.freq import aggregate

LOG = logging.getLogger("test")


def _record(step: int) -> dict:
    return {
        "step": step,
        "workload": {
            "samples": 1,
            "responseTokens": 10.0,
            "promptTokens": 1.0,
            "validTokens": 10.0,
            "meanContextTokens": 5.0,
        },
        "phases": [{"phase": "generation", "durationSeconds": 1.0, "energyJoules": 2.0 + step}],
        "idleEnergyJoules": 0.0,
    }


def _spec(node: str, steps: list[int], last: int | None = None) -> dict:
    return {
        "policyName": "p",
        "nodeName": node,
        "gpus": [{"uuid": f"GPU-{node}", "supportedClocksMHz": [1980, 990]}],
        "steps": [_record(s) for s in steps],
        "lastStep": max(steps, default=-1) if last is None else last,
    }


node_steps = st.lists(st.integers(0, 30), max_size=12, unique=True).map(sorted)


@settings(max_examples=200, deadline=None)
@given(nodes=st.lists(node_steps, min_size=1, max_size=4), after=st.integers(-1, 30))
def test_trimmed_reports_decide_every_later_step_like_the_full_ones(nodes, after):
    full = [api_node.NodeReport.model_validate(_spec(f"n{i}", s)) for i, s in enumerate(nodes)]
    trimmed = [
        api_node.NodeReport.model_validate(reports.trim_steps(_spec(f"n{i}", s), after))
        for i, s in enumerate(nodes)
    ]
    for step in range(after + 1, 33):
        state = aggregate.step_state(step, full)
        assert aggregate.step_state(step, trimmed) is state, step
        if state is aggregate.StepState.COMPLETE:
            assert aggregate.job_step(step, trimmed) == aggregate.job_step(step, full)


def test_trim_keeps_the_oldest_record_and_everything_after_the_checkpoint():
    spec = _spec("a", [3, 4, 5, 6, 7])
    assert [r["step"] for r in reports.trim_steps(spec, 5)["steps"]] == [3, 6, 7]
    assert reports.trim_steps(spec, -1) == spec
    assert [r["step"] for r in spec["steps"]] == [3, 4, 5, 6, 7]  # the input is not changed
    # A folded oldest record keeps only its step (and workload): its windows are not needed.
    trimmed = reports.trim_steps(spec, 5)["steps"]
    assert trimmed[0]["phases"] == [] and trimmed[1]["phases"] == spec["steps"][3]["phases"]
    assert spec["steps"][0]["phases"]  # not changed in place
    assert reports.trim_steps(spec, 2)["steps"][0]["phases"] == spec["steps"][0]["phases"]


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[str, tuple[str, dict]] = {}
        self.gets: list[str] = []

    def put(self, name: str, spec: dict) -> None:
        rv = str(int(self.objects.get(name, ("0", {}))[0]) + 1)
        self.objects[name] = (rv, spec)

    def versions(self, namespace: str, policy: str) -> dict[str, str]:
        return {n: rv for n, (rv, _) in self.objects.items()}

    def get(self, namespace: str, name: str):
        self.gets.append(name)
        return self.objects.get(name)


def test_the_cache_fetches_only_changed_reports():
    api = FakeApi()
    api.put("p.a", _spec("a", [0, 1]))
    api.put("p.b", _spec("b", [0, 1]))
    cache = reports.ReportCache(api.versions, api.get)
    got = cache.refresh("ns", "p", -1, LOG)
    assert [r.node_name for r in got] == ["a", "b"] and api.gets == ["p.a", "p.b"]
    assert [r.step for r in got[0].steps] == [0, 1]
    api.gets.clear()
    assert len(cache.refresh("ns", "p", 1, LOG)) == 2 and api.gets == []  # nothing changed
    api.put("p.a", _spec("a", [0, 1, 2]))
    got = cache.refresh("ns", "p", 1, LOG)
    assert api.gets == ["p.a"]
    assert [r.step for r in got[0].steps] == [0, 2]  # oldest + after the checkpoint
    assert [r.step for r in got[1].steps] == [0]  # cached, re-trimmed: step 1 is folded
    api.gets.clear()
    got = cache.refresh("ns", "p", -1, LOG)  # a restore needs every record again
    assert sorted(api.gets) == ["p.a", "p.b"] and [r.step for r in got[0].steps] == [0, 1, 2]


def test_the_cache_forgets_deleted_reports_and_skips_malformed_ones(caplog):
    api = FakeApi()
    api.put("p.a", _spec("a", [0]))
    api.put("p.b", {"policyName": "p"})  # no nodeName
    cache = reports.ReportCache(api.versions, api.get)
    with caplog.at_level(logging.WARNING):
        got = cache.refresh("ns", "p", -1, LOG)
    assert [r.node_name for r in got] == ["a"]
    assert "skipping malformed node report p.b" in caplog.text
    api.gets.clear()
    cache.refresh("ns", "p", -1, LOG)
    assert api.gets == []  # the malformed version is not fetched again
    del api.objects["p.a"]
    assert [r.node_name for r in cache.refresh("ns", "p", -1, LOG)] == []

    def vanishing(namespace: str, name: str):
        return None  # deleted between the listing and the GET

    api.put("p.c", _spec("c", [0]))
    gone = reports.ReportCache(api.versions, vanishing)
    assert gone.refresh("ns", "p", -1, LOG) == []


@settings(max_examples=100, deadline=None)
@given(steps=node_steps, indexed_after=st.integers(-1, 30), extra=st.integers(0, 5))
def test_an_indexed_report_gives_what_the_api_server_gives(steps, indexed_after, extra):
    after = indexed_after + extra  # the checkpoint only moves forward after indexing
    spec = _spec("a", steps)
    entry = reports.IndexedReport.from_spec("p.a", "7", spec, indexed_after)
    assert entry.spec() == reports.trim_steps(spec, indexed_after)

    def no_get(*_args):
        raise AssertionError("a pass fed by the index must not read a report it holds")

    def listed(namespace: str, policy: str) -> dict[str, str]:
        return {"p.a": "7"}

    from_index = reports.ReportCache(listed, no_get).refresh("ns", "p", after, LOG, [entry])
    api = FakeApi()
    api.put("p.a", spec)
    from_api = reports.ReportCache(api.versions, api.get).refresh("ns", "p", after, LOG)
    assert from_index == from_api


def test_index_fed_passes_fall_back_to_the_api_server_where_the_index_cannot_answer():
    api = FakeApi()
    api.put("p.a", _spec("a", [0, 1, 2, 3]))
    trimmed = reports.IndexedReport.from_spec("p.a", "1", _spec("a", [0, 1, 2, 3]), 2)
    cache = reports.ReportCache(api.versions, api.get)
    # A restore needs every record: the trimmed index copy is not used.
    got = cache.refresh("ns", "p", -1, LOG, [trimmed])
    assert api.gets == ["p.a"] and [r.step for r in got[0].steps] == [0, 1, 2, 3]
    # An untrimmed copy (indexed before any checkpoint: a restart) serves a restore as it is.
    whole = reports.IndexedReport.from_spec("p.b", "1", _spec("b", [0, 1]), -1)
    other = FakeApi()
    other.put("p.b", _spec("b", [0, 1]))
    got = reports.ReportCache(other.versions, other.get).refresh("ns", "p", -1, LOG, [whole])
    assert other.gets == [] and [r.step for r in got[0].steps] == [0, 1]
    # An index copy trimmed past the checkpoint lacks records the loop needs: GET it.
    api.gets.clear()
    api.put("p.a", _spec("a", [0, 1, 2, 3, 4]))
    newer = reports.IndexedReport.from_spec("p.a", "2", _spec("a", [0, 1, 2, 3, 4]), 2)
    got = cache.refresh("ns", "p", 1, LOG, [newer])
    assert api.gets == ["p.a"] and [r.step for r in got[0].steps] == [0, 2, 3, 4]
    # A report the index no longer holds is checked with the API server's list: deleted
    # there too, the cache forgets it.
    del api.objects["p.a"]
    assert cache.refresh("ns", "p", 1, LOG, []) == []


def _counting(api: FakeApi) -> tuple[list[str], object]:
    lists: list[str] = []

    def versions(namespace: str, policy: str) -> dict[str, str]:
        lists.append(policy)
        return api.versions(namespace, policy)

    return lists, versions


def test_a_rebuild_reads_the_reports_a_refilling_index_lacks_and_keeps_them():
    # A replica resumed by peering lists the reports again; its first passes run while only
    # some are indexed. A step complete over the indexed reports alone would book only their
    # energy: the rebuild lists the reports' metadata and reads the missing one, and later
    # passes keep it until the index holds it.
    api = FakeApi()
    api.put("p.a", _spec("a", [0, 1, 2]))
    api.put("p.b", _spec("b", [0, 1, 2]))
    only_a = [reports.IndexedReport.from_spec("p.a", "1", _spec("a", [0, 1, 2]), -1)]
    lists, versions = _counting(api)
    cache = reports.ReportCache(versions, api.get)  # type: ignore[arg-type]
    got = cache.refresh("ns", "p", -1, LOG, only_a)
    assert [r.node_name for r in got] == ["a", "b"] and api.gets == ["p.b"]
    assert cache.completed == 1 and len(lists) == 1
    assert aggregate.job_step(2, got).energy_j == 2 * (2.0 + 2)  # both nodes' windows
    api.gets.clear()
    got = cache.refresh("ns", "p", 2, LOG, only_a)  # the index still lacks p.b
    assert [r.node_name for r in got] == ["a", "b"] and api.gets == [] and len(lists) == 2
    # Once the index holds every report the cache holds, a pass reads nothing at all.
    both = [*only_a, reports.IndexedReport.from_spec("p.b", "1", _spec("b", [0, 1, 2]), 2)]
    got = cache.refresh("ns", "p", 2, LOG, both)
    assert [r.node_name for r in got] == ["a", "b"] and api.gets == [] and len(lists) == 2


def test_a_rebuild_reads_a_report_the_index_holds_at_an_older_version():
    api = FakeApi()
    api.put("p.a", _spec("a", [0]))
    stale = [reports.IndexedReport.from_spec("p.a", "1", _spec("a", [0]), -1)]
    api.put("p.a", _spec("a", [0, 1]))  # version 2, not delivered by the watch yet
    got = reports.ReportCache(api.versions, api.get).refresh("ns", "p", -1, LOG, stale)
    assert api.gets == ["p.a"] and [r.step for r in got[0].steps] == [0, 1]


def test_a_full_report_is_indexed_compressed():
    spec = _spec("a", list(range(32)))
    entry = reports.IndexedReport.from_spec("p.a", "1", spec, -1)
    assert len(entry.blob) * 4 < len(json.dumps(spec, separators=(",", ":")))


@settings(max_examples=100, deadline=None)
@given(steps=node_steps, first=st.integers(-1, 30), more=st.integers(0, 5))
def test_a_cached_report_is_retrimmed_like_a_fresh_parse_when_the_checkpoint_moves(
    steps, first, more
):
    api = FakeApi()
    api.put("p.a", _spec("a", steps))
    cache = reports.ReportCache(api.versions, api.get)
    cache.refresh("ns", "p", first, LOG)
    api.gets.clear()
    later = cache.refresh("ns", "p", first + more, LOG)
    assert api.gets == []  # nothing changed on the server: no read
    fresh = reports.ReportCache(api.versions, api.get).refresh("ns", "p", first + more, LOG)
    assert later == fresh


def test_a_new_job_lists_the_reports_once_not_every_pass_before_its_first_fold():
    # A job's checkpoint stays -1 until its first step is folded; at 1,000 nodes a metadata
    # list per pass of every policy held the first step's accounting back for tens of seconds.
    api = FakeApi()
    api.put("p.a", _spec("a", [0]))
    lists, versions = _counting(api)
    cache = reports.ReportCache(versions, api.get)  # type: ignore[arg-type]
    indexed = [reports.IndexedReport.from_spec("p.a", "1", _spec("a", [0]), -1)]
    for _ in range(3):
        got = cache.refresh("ns", "p", -1, LOG, indexed)
        assert [r.node_name for r in got] == ["a"]
    assert len(lists) == 1 and api.gets == []
    # A report created later reaches the passes through the index, as in any pass.
    api.put("p.b", _spec("b", [0]))
    indexed.append(reports.IndexedReport.from_spec("p.b", "1", _spec("b", [0]), -1))
    got = cache.refresh("ns", "p", -1, LOG, indexed)
    assert [r.node_name for r in got] == ["a", "b"] and len(lists) == 1 and api.gets == []
