"""The node report write carries what changed: JSON Patch of the changes, whole report as the
fallback, the stored object always the whole report; the request body measured per write; the
report holds only the records the operator has not folded (object size measured)."""

from __future__ import annotations

import copy
import json
import statistics
from typing import Any

import jsonpatch
import pytest
from agent_support import POD_A, DriverFactory, probe_plan, standin_agent
from hypothesis import given, settings
from hypothesis import strategies as st
from rlenergy_agent import kube, kubeapi, service
from rlenergy_agent.kubeapi import ApiException

from rlenergy.api import node as api_node
from rlenergy.control.freq import probe
from tests import factories

GPUS = 8
WRITE_TARGET_BYTES = 8_000
"""A report write of a node of 8 GPUs, p50 (the design target in docs/scale-and-chaos.md)."""
SCHEMA = factories.report_schema()


def _stored_form(spec: Any) -> Any:
    """What the API server keeps of a spec (``factories.crd_stored``)."""
    return factories.crd_stored(spec, SCHEMA)


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what the API server does with ``merge-patch+json``)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


class _ApiServer:
    """One custom object store with the API server's patch semantics for CRDs.

    ``merge-patch+json`` (a dict body) and ``json-patch+json`` (a list body, applied by the
    ``jsonpatch`` library; a failed ``test`` answers 422 as the API server does); every write
    prunes nulls and fills in the CRD's defaults (structural schema defaulting), bumps
    ``metadata.resourceVersion`` and answers the stored object. ``sent`` holds each request
    body's size as the agent's client puts it on the wire (``kubeapi.encode``).
    """

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.sent: list[tuple[str, int]] = []

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        if "spec" in obj:
            obj["spec"] = _stored_form(obj["spec"])
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        return copy.deepcopy(obj)

    def patch_namespaced_custom_object(
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        name: str,
        body: Any,
        _content_type: str | None = None,
    ) -> dict[str, Any]:
        if name not in self.objects:
            raise ApiException(status=404)
        kind = "json" if isinstance(body, list) else "merge"
        assert (_content_type == kube.JSON_PATCH) == (kind == "json")
        self.sent.append((kind, len(kubeapi.encode(body))))
        if kind == "json":
            try:
                obj = jsonpatch.apply_patch(self.objects[name], body)
            except jsonpatch.JsonPatchTestFailed:
                raise ApiException(status=422) from None
        else:
            obj = _merge(self.objects[name], body)
        self.objects[name] = obj
        return self._bump(obj)

    def create_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        self.sent.append(("create", len(kubeapi.encode(body))))
        obj = copy.deepcopy(body)
        self.objects[body["metadata"]["name"]] = obj
        return self._bump(obj)


def _same(stored: dict[str, Any], spec: dict[str, Any]) -> bool:
    """The stored spec is the report as the API server keeps it."""
    return bool(stored == _stored_form(spec))


def _run_step(drv: Any, agent: service.Agent, step: int) -> None:
    """One RL step on 8 GPUs: probed generation (slices), training, idle, end of step."""
    agent.phase(POD_A, "generation", step)
    for _ in range(12):
        drv.advance(0.05)
        agent.probe_tick()
        agent.meter.sample()
    agent.phase(POD_A, "training", step)
    drv.advance(1.0)
    agent.meter.sample()
    agent.phase(POD_A, "idle", step)
    drv.advance(0.25)
    agent.end_step(
        POD_A,
        step,
        api_node.TokenWorkloadReport(
            samples=64,
            responseTokens=64_000 + step,
            promptTokens=8_000,
            validTokens=60_000 + step,
            meanContextTokens=1_100,
        ),
    )


def test_a_write_carries_the_new_step_not_the_kept_history(make_driver: DriverFactory) -> None:
    """Past the kept window the report holds ``MAX_STEPS_KEPT`` records of 8 GPUs, and each
    write sends the new record and the changed fields only: <= 8 kB at p50, several times less
    than the whole report, while the stored object equals the whole report after every write."""
    drv = make_driver(GPUS)
    plan = probe_plan(probe.block_schedule([1395, 1200]), 0.1, training_locked=True)
    agent = standin_agent({POD_A: list(drv.uuids)}, plan, lambda: drv.virtual_s)
    server = _ApiServer()
    writer = kube.ReportWriter(server, "team-a", "pol", "node-1")
    whole: list[int] = []
    steps = service.MAX_STEPS_KEPT + 12
    for step in range(steps):
        _run_step(drv, agent, step)
        report = agent.report()
        writer.write(report)
        spec = writer.body(report)["spec"]
        whole.append(len(kubeapi.encode({"spec": spec})))
        assert _same(server.objects[writer.name]["spec"], spec)
        assert writer.last_body_bytes == server.sent[-1][1]
    assert len(agent.report().steps) == service.MAX_STEPS_KEPT
    assert any(p.slices for r in agent.report().steps for p in r.phases)
    # The first write creates; every later one is a JSON Patch (no fallback was needed).
    kinds = [k for k, _ in server.sent]
    assert kinds == ["create"] + ["json"] * (steps - 1) and writer.patched == steps - 1
    full = whole[service.MAX_STEPS_KEPT :]
    sent = [n for k, n in server.sent[service.MAX_STEPS_KEPT + 1 :] if k == "json"]
    print(
        f"report writes, 8 GPUs, {service.MAX_STEPS_KEPT} steps kept: whole report p50 "
        f"{statistics.median(full) / 1e3:.1f} kB, patch p50 {statistics.median(sent) / 1e3:.2f} "
        f"kB (max {max(sent) / 1e3:.2f} kB)"
    )
    assert statistics.median(sent) <= WRITE_TARGET_BYTES
    # Writes grow with steps, not with the history kept: a write with the window full is no
    # larger than one of the first steps' writes plus a record's share of slack.
    early = statistics.median(n for _, n in server.sent[1:5])
    assert max(sent) <= 1.5 * early
    assert statistics.median(full) >= 4 * statistics.median(sent)


def test_the_report_holds_only_what_the_operator_has_not_folded(
    make_driver: DriverFactory,
) -> None:
    """Once the plan watch delivers ``totals.throughStep`` the report leaves the folded records
    out: the stored object holds the unfolded step (plus those a late watch hides) instead of
    ``MAX_STEPS_KEPT`` records, every write stays a JSON Patch, and no record is left out
    before the status that folded it was read."""
    drv = make_driver(GPUS)
    plan = probe_plan(probe.block_schedule([1395, 1200]), 0.1, training_locked=True)
    agent = standin_agent({POD_A: list(drv.uuids)}, plan, lambda: drv.virtual_s)
    server = _ApiServer()
    writer = kube.ReportWriter(server, "team-a", "pol", "node-1")
    whole: list[int] = []
    pruned: list[int] = []
    steps = service.MAX_STEPS_KEPT + 12
    for step in range(steps):
        _run_step(drv, agent, step)
        agent.folded_through_step = step - 2  # the operator folded the step before
        report = agent.report()
        assert [r.step for r in report.steps] == [step - 1, step][-(step + 1) :]
        assert report.folded_through_step == (step - 2 if step >= 2 else -1)
        writer.write(report)
        stored = server.objects[writer.name]
        assert _same(stored["spec"], writer.body(report)["spec"])
        pruned.append(len(json.dumps(stored, separators=(",", ":"))))
        agent.folded_through_step = -1
        body = writer.body(agent.report())
        body["spec"] = _stored_form(body["spec"])  # as the API server would keep it
        whole.append(len(json.dumps(body, separators=(",", ":"))))
    kinds = [k for k, _ in server.sent]
    assert kinds == ["create"] + ["json"] * (steps - 1)
    full, now = whole[service.MAX_STEPS_KEPT :], pruned[service.MAX_STEPS_KEPT :]
    sent = [n for _, n in server.sent[service.MAX_STEPS_KEPT + 1 :]]
    print(
        f"report object, 8 GPUs: {service.MAX_STEPS_KEPT} records kept "
        f"{statistics.median(full) / 1e3:.1f} kB p50, unfolded only "
        f"{statistics.median(now) / 1e3:.2f} kB p50 (max {max(now) / 1e3:.2f} kB); "
        f"write p50 {statistics.median(sent) / 1e3:.2f} kB"
    )
    # Both as the API server keeps them (defaults filled in).
    assert statistics.median(now) * 6 <= statistics.median(full)
    assert statistics.median(sent) <= WRITE_TARGET_BYTES


def test_a_stale_stored_report_gets_the_whole_report(make_driver: DriverFactory) -> None:
    """Someone else changed the stored object (or the answer to a write was lost): the patch's
    ``resourceVersion`` test fails (422) and the writer writes the whole report instead."""
    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, None, lambda: drv.virtual_s)
    server = _ApiServer()
    writer = kube.ReportWriter(server, "team-a", "pol", "node-1")
    for step in range(3):
        _run_step(drv, agent, step)
        writer.write(agent.report())
    assert [k for k, _ in server.sent] == ["create", "json", "json"]
    stored = server.objects[writer.name]
    stored["spec"]["lastStep"] = -7
    server._bump(stored)
    _run_step(drv, agent, 3)
    writer.write(agent.report())
    assert [k for k, _ in server.sent[-2:]] == ["json", "merge"]
    assert stored is not server.objects[writer.name]
    assert _same(server.objects[writer.name]["spec"], writer.body(agent.report())["spec"])
    _run_step(drv, agent, 4)
    writer.write(agent.report())  # the base is known again: a patch
    assert server.sent[-1][0] == "json"
    assert _same(server.objects[writer.name]["spec"], writer.body(agent.report())["spec"])


def test_an_error_mid_write_forgets_the_base_and_retries_whole(
    make_driver: DriverFactory,
) -> None:
    """A 503 whose outcome is unknown: the retry sends the whole report (no patch against a
    stored object that may have changed)."""
    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, None, lambda: drv.virtual_s)
    server = _ApiServer()
    sleeps: list[float] = []
    writer = kube.ReportWriter(server, "team-a", "pol", "node-1", sleep=sleeps.append)
    _run_step(drv, agent, 0)
    writer.write(agent.report())
    real = server.patch_namespaced_custom_object
    failures = [503]

    def flaky(*args: Any, **kw: Any) -> dict[str, Any]:
        if failures:
            failures.pop()
            raise ApiException(status=503)
        return real(*args, **kw)

    server.patch_namespaced_custom_object = flaky  # type: ignore[method-assign]
    _run_step(drv, agent, 1)
    writer.write(agent.report())
    assert sleeps == [0.5] and server.sent[-1][0] == "merge"
    assert _same(server.objects[writer.name]["spec"], writer.body(agent.report())["spec"])


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-4, 4, allow_nan=False)
    | st.text("ab/~", max_size=3),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text("ab/~", max_size=3), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(old=_JSON, new=_JSON)
def test_json_patch_turns_old_into_new(old: Any, new: Any) -> None:
    """Applied by an independent RFC 6902 implementation, the operations give ``new``."""
    doc = {"spec": old}
    got = jsonpatch.apply_patch(doc, kube.json_patch(old, new, "/spec"))
    assert got == {"spec": new}  # 5 and 5.0 compare equal: a patch need not rewrite either


@given(
    window=st.lists(st.dictionaries(st.sampled_from("xyz"), st.integers(0, 3)), max_size=6),
    dropped=st.integers(0, 6),
    added=st.lists(st.dictionaries(st.sampled_from("xyz"), st.integers(4, 6)), max_size=3),
)
def test_a_moved_window_is_removes_at_the_front_and_adds_at_the_end(
    window: list[dict[str, int]], dropped: int, added: list[dict[str, int]]
) -> None:
    dropped = min(dropped, max(len(window) - 1, 0))
    new = window[dropped:] + added
    ops = kube.json_patch(window, new, "/steps")
    if window:
        assert all(op["op"] in ("remove", "add") for op in ops)
        assert len(ops) <= dropped + len(added)
    assert jsonpatch.apply_patch({"steps": window}, ops) == {"steps": new}


@pytest.mark.parametrize("key", ["a/b", "a~b", "~1"])
def test_json_patch_escapes_keys(key: str) -> None:
    ops = kube.json_patch({key: 1}, {key: 2}, "/spec")
    assert jsonpatch.apply_patch({"spec": {key: 1}}, ops) == {"spec": {key: 2}}


class _Response:
    def __init__(self, status: int, body: Any) -> None:
        self.status, self.reason = status, "x"
        self.data = json.dumps(body).encode()
        self.headers: dict[str, str] = {}


class _ApiClient:
    """``kubeapi.ApiClient.request``, recorded."""

    def __init__(self, status: int = 200, body: Any = None) -> None:
        self.status, self.body = status, {"ok": True} if body is None else body
        self.calls: list[dict[str, Any]] = []

    def request(self, method: str, path: str, **kw: Any) -> _Response:
        self.calls.append({"method": method, "path": path, **kw})
        return _Response(self.status, self.body)


def test_custom_objects_sends_the_calls_the_generated_api_sends() -> None:
    client = _ApiClient()
    api = kube.CustomObjects(client)
    base = "/apis/rlenergy.io/v1alpha1/namespaces/team-a/rlenergynodereports"
    assert api.patch_namespaced_custom_object(
        kube.GROUP, kube.VERSION, "team-a", kube.REPORT_PLURAL, "r", {"spec": {}}
    ) == {"ok": True}
    api.patch_namespaced_custom_object(
        kube.GROUP, kube.VERSION, "team-a", kube.REPORT_PLURAL, "r", [{"op": "test"}],
        _content_type=kube.JSON_PATCH,
    )  # fmt: skip
    api.create_namespaced_custom_object(kube.GROUP, kube.VERSION, "team-a", "x", {"a": 1})
    api.get_namespaced_custom_object(kube.GROUP, kube.VERSION, "team-a", "x", "n")
    raw = api.list_namespaced_custom_object(
        kube.GROUP, kube.VERSION, "team-a", kube.POLICY_PLURAL,
        field_selector="metadata.name=p", resource_version="7", allow_watch_bookmarks=True,
        timeout_seconds=300, watch=True, _preload_content=False, _request_timeout=(10.0, 330.0),
    )  # fmt: skip
    merge, jpatch, create, get, watch = client.calls
    assert (merge["method"], merge["path"]) == ("PATCH", f"{base}/r")
    assert merge["content_type"] is None  # kubeapi: JSON merge patch for PATCH
    assert jpatch["content_type"] == "application/json-patch+json"
    assert jpatch["body"] == [{"op": "test"}]
    assert (create["method"], create["path"]) == (
        "POST", "/apis/rlenergy.io/v1alpha1/namespaces/team-a/x"
    )  # fmt: skip
    assert (get["method"], get["body"]) == ("GET", None)
    assert [c["preload"] for c in client.calls] == [True, True, True, True, False]
    assert list(watch["query"]) == [
        ("fieldSelector", "metadata.name=p"),
        ("resourceVersion", "7"),
        ("allowWatchBookmarks", "true"),
        ("timeoutSeconds", "300"),
        ("watch", "true"),
    ]
    assert watch["timeout"] == (10.0, 330.0) and isinstance(raw, _Response)
    # An error status is the client's ApiException, its status kept.
    failing = kube.CustomObjects(_ApiClient(status=404, body={"reason": "NotFound"}))
    with pytest.raises(ApiException) as info:
        failing.get_namespaced_custom_object(kube.GROUP, kube.VERSION, "team-a", "x", "n")
    assert info.value.status == 404
