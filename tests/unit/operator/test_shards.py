"""Operator shards: every policy has exactly one shard, and a new layout waits for the old.

``rlenergy_operator.shards`` (pure) and its use in the handlers: the report index keeps only
this shard's policies, the watch check judges only this shard's policies, and every policy
handler waits while the pods of another shard layout are alive in their peering objects.
"""

from __future__ import annotations

import datetime
import zlib
from typing import Any

import jsonpatch
import kopf
import kopf_doubles
import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kopf._cogs.structs import references
from rlenergy_agent import kube as agent_kube
from rlenergy_operator import handlers, kube, liveness, settings, shards

from rlenergy.api import naming
from tests import factories

NOW = datetime.datetime(2026, 12, 7, 12, 0, 0, tzinfo=datetime.UTC)
BASE = "rlenergy-operator"
P, R = "rlenergypolicies", "rlenergynodereports"


def _peering(
    name: str, seen_s_ago: float | None, lifetime_s: int = 60, now: datetime.datetime = NOW
) -> dict[str, Any]:
    status = (
        {}
        if seen_s_ago is None
        else {
            "op-1@pod": {
                "priority": 100,
                "lifetime": lifetime_s,
                "lastseen": (now - datetime.timedelta(seconds=seen_s_ago)).isoformat(),
            }
        }
    )
    return {"metadata": {"name": name}, "status": status}


def _mine_and_theirs(layout: shards.Layout) -> tuple[str, str]:
    """A policy name in namespace ``ns`` that ``layout`` serves, and one it does not."""
    names = [f"p{i}" for i in range(100)]
    return (
        next(n for n in names if layout.owns("ns", n)),
        next(n for n in names if not layout.owns("ns", n)),
    )


def _selected_buckets(layout: shards.Layout) -> list[str]:
    """The bucket values ``layout``'s report selector lists (``label in (a,b,...)``)."""
    selector = layout.report_selector() or ""
    return selector.partition("(")[2].rstrip(")").split(",")


def test_shard_of_is_the_policys_bucket_modulo_the_count():
    assert naming.policy_bucket("team-a", "grpo") == zlib.crc32(b"team-a/grpo") % 64
    assert shards.shard_of("team-a", "grpo", 3) == zlib.crc32(b"team-a/grpo") % 64 % 3
    assert shards.shard_of("team-a", "grpo", 1) == 0
    for bad in (0, 65):
        with pytest.raises(ValueError, match="1..64"):
            shards.shard_of("a", "b", bad)


def test_a_shard_watches_the_reports_of_its_buckets_only():
    assert shards.Layout().report_selector() is None
    sel = shards.Layout(3, 1).report_selector()
    assert sel == "rlenergy.io/policy-bucket in (" + ",".join(str(b) for b in range(1, 64, 3)) + ")"
    s = kopf.OperatorSettings()
    settings.configure_kopf(s, settings.OperatorConfig(shards=3, shard_index=1))
    reports = references.Resource("rlenergy.io", "v1alpha1", "rlenergynodereports")
    policies = references.Resource("rlenergy.io", "v1alpha1", "rlenergypolicies")
    assert list(s.watching.label_selectors.collect(reports)) == [sel]
    assert list(s.watching.label_selectors.collect(policies)) == []  # every policy: tens
    assert s.persistence.finalizer == "rlenergy.io/reset-clocks-3-1"
    assert s.peering.name == "rlenergy-operator-3-1"
    unsharded = kopf.OperatorSettings()
    settings.configure_kopf(unsharded, settings.OperatorConfig())
    assert list(unsharded.watching.label_selectors.collect(reports)) == []
    assert unsharded.persistence.finalizer == settings.FINALIZER


def test_the_agent_labels_its_report_with_its_policys_bucket():
    writer = agent_kube.ReportWriter(None, "team-a", "grpo", "gpu-node-0")
    body = writer.body(factories.node_report("gpu-node-0", policy="grpo"))
    label = body["metadata"]["labels"][naming.POLICY_BUCKET_LABEL]
    assert label == str(naming.policy_bucket("team-a", "grpo"))
    for count in (2, 3, 4, 64):
        owner = shards.Layout(count, shards.shard_of("team-a", "grpo", count))
        selected = _selected_buckets(owner)
        assert label in selected
        others = [shards.Layout(count, k) for k in range(count) if k != owner.index]
        assert all(label not in _selected_buckets(o) for o in others)


@given(
    namespace=st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True),
    name=st.from_regex(r"[a-z][a-z0-9-]{0,30}", fullmatch=True),
    count=st.integers(1, 64),
)
def test_every_policy_has_exactly_one_shard(namespace: str, name: str, count: int):
    owners = [i for i in range(count) if shards.Layout(count, i).owns(namespace, name)]
    assert owners == [shards.shard_of(namespace, name, count)]


def test_policies_spread_over_the_shards():
    counts = [0] * 4
    for i in range(2000):
        counts[shards.shard_of(f"ns-{i % 7}", f"job-{i}", 4)] += 1
    assert min(counts) > 400, counts  # 500 each if even


def test_a_shard_index_at_or_past_the_count_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="outside 0..1 for 2 shards"):
        shards.Layout(2, 2)
    with pytest.raises(pydantic.ValidationError, match="SHARD_INDEX"):
        settings.OperatorConfig(shards=2, shard_index=2)
    assert settings.OperatorConfig(shards=3, shard_index=2).layout == shards.Layout(3, 2)


def test_each_layout_has_its_own_peering_object_name():
    assert shards.Layout().named(BASE) == BASE
    assert shards.Layout(4, 3).named(BASE) == "rlenergy-operator-4-3"
    one = shards.Layout(2, 0)
    assert one.layout_of(BASE, BASE) == 1
    assert one.layout_of(BASE, "rlenergy-operator-4-3") == 4
    for foreign in ("default", "rlenergy-operator-4", "rlenergy-operator-4-4", "x-rlenergy-operator-2-0",
                    "rlenergy-operator-a-0"):  # fmt: skip
        assert one.layout_of(BASE, foreign) is None, foreign


def test_live_peers_are_those_seen_within_their_lifetime():
    status = {
        "fresh": {"lifetime": 60, "lastseen": (NOW - datetime.timedelta(seconds=59)).isoformat()},
        "expired": {"lifetime": 60, "lastseen": (NOW - datetime.timedelta(seconds=61)).isoformat()},
        "naive": {"lifetime": 60, "lastseen": "2026-12-07T11:59:30"},
        "garbled": {"lifetime": 60, "lastseen": "yesterday"},
        "kopf": "not a peer",
    }
    assert sorted(shards.live_peers(status, NOW)) == ["fresh", "naive"]
    assert shards.live_peers(None, NOW) == []


def test_other_layouts_are_live_peering_objects_of_another_count():
    peerings = [
        _peering(BASE, 5),  # the unsharded layout, alive
        _peering("rlenergy-operator-2-1", 5),  # this layout's sibling shard
        _peering("rlenergy-operator-3-0", 120),  # another layout, its peer expired
        _peering("rlenergy-operator-3-1", None),  # another layout, no peer left
        _peering("default", 1),  # someone else's operator
    ]
    assert shards.other_layouts(shards.Layout(2, 0), BASE, peerings, NOW) == [BASE]
    assert shards.other_layouts(shards.Layout(), BASE, peerings, NOW) == ["rlenergy-operator-2-1"]


def test_the_newcomer_waits_and_the_established_layout_carries_on():
    new, old = shards.Handover(), shards.Handover()
    assert old.observe([], 0.0)  # serving before the newcomer appeared
    assert not new.observe(["rlenergy-operator"], 1.0)
    assert new.waiting_for == ("rlenergy-operator",)
    assert old.observe(["rlenergy-operator-2-0"], 2.0)  # the newcomer never pauses it
    assert not new.observe(["rlenergy-operator"], 50.0)
    assert new.observe([], 60.0) and not new.timed_out  # the old pods exited
    assert new.waiting_for == ()
    assert new.observe(["rlenergy-operator-5-1"], 70.0)  # established: later layouts wait for it


def test_two_waiting_layouts_serve_after_the_timeout():
    a, b = shards.Handover(timeout_s=120.0), shards.Handover(timeout_s=120.0)
    assert not a.observe(["rlenergy-operator-3-0"], 10.0)
    assert not b.observe(["rlenergy-operator-2-0"], 15.0)
    assert not a.observe(["rlenergy-operator-3-0"], 129.0)
    assert a.observe(["rlenergy-operator-3-0"], 130.0) and a.timed_out
    assert b.observe(["rlenergy-operator-2-0"], 135.0) and b.timed_out


def test_every_shard_has_its_own_finalizer():
    base = settings.FINALIZER
    assert shards.finalizer_of(base, shards.Layout()) == base
    assert shards.finalizer_of(base, shards.Layout(3, 2)) == f"{base}-3-2"


def _apply(finalizers: list[str], ops: list[dict[str, Any]]) -> list[str]:
    doc = {"metadata": {"finalizers": finalizers}}
    return list(jsonpatch.apply_patch(doc, ops)["metadata"]["finalizers"])


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (["other.io/x", "rlenergy.io/reset-clocks"], ["other.io/x", "rlenergy.io/reset-clocks-2-1"]),
        (["rlenergy.io/reset-clocks-3-0", "a/b", "rlenergy.io/reset-clocks"],
         ["rlenergy.io/reset-clocks-2-1", "a/b"]),
        (["rlenergy.io/reset-clocks-2-1", "rlenergy.io/reset-clocks"], ["rlenergy.io/reset-clocks-2-1"]),
        (["rlenergy.io/reset-clocks-2-1"], ["rlenergy.io/reset-clocks-2-1"]),
        (["rlenergy.io/reset-clocks-x", "other.io/x"], ["rlenergy.io/reset-clocks-x", "other.io/x"]),
        ([], []),
    ],
)  # fmt: skip
def test_adoption_hands_the_finalizer_of_a_gone_layout_to_this_shard(
    before: list[str], after: list[str]
):
    ops = shards.adoption_patch(before, settings.FINALIZER, "rlenergy.io/reset-clocks-2-1")
    assert _apply(before, ops) == after
    assert bool(ops) == (before != after)


def test_an_adoption_patch_fails_on_a_finalizer_list_changed_since_it_was_read():
    ops = shards.adoption_patch(["a/b", "rlenergy.io/reset-clocks"], settings.FINALIZER, "own/f")
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        _apply(["rlenergy.io/reset-clocks", "a/b"], ops)


def test_the_kopf_filters_pass_only_served_policies_of_this_shard():
    layout = shards.Layout(2, 1)
    served, first = shards.when_served(layout), shards.when_first(shards.Layout(2, 0))
    mine, theirs = _mine_and_theirs(layout)
    waiting, serving = shards.Handover(), shards.Handover()
    serving.observe([], 0.0)
    waiting.observe(["rlenergy-operator"], 0.0)
    assert served(namespace="ns", name=mine, memo={"handover": serving})
    assert not served(namespace="ns", name=theirs, memo={"handover": serving})
    assert not served(namespace="ns", name=mine, memo={"handover": waiting})
    assert not served(namespace="ns", name=mine, memo={})  # before the start-up handler
    assert first(memo={"handover": serving}) and not first(memo={"handover": waiting})
    assert not shards.when_first(layout)(memo={"handover": serving})
    owned = shards.when_owned(layout)  # the timers: they check ``serving`` themselves
    assert owned(namespace="ns", name=mine) and not owned(namespace="ns", name=theirs)
    assert shards.serving({"handover": serving}) and not shards.serving({"handover": waiting})


class _Api:
    """``kube``'s peering, policy and patch calls, recorded."""

    def __init__(self, peerings: list[list[dict[str, Any]]], policies: list[dict[str, Any]]):
        self.peerings = peerings
        self.policies = policies
        self.patched: list[tuple[str, str, list[dict[str, Any]]]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(kube, "peering_objects", lambda namespaces=(): self.peerings.pop(0))
        monkeypatch.setattr(kube, "live_policies", lambda namespaces=(): self.policies)
        monkeypatch.setattr(
            kube, "json_patch_policy", lambda ns, n, ops: self.patched.append((ns, n, ops))
        )


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args)

    warning = info


def test_a_new_layout_waits_then_adopts_its_policies(monkeypatch: pytest.MonkeyPatch):
    layout = shards.Layout(2, 0)
    monkeypatch.setattr(handlers, "SHARD", layout)
    mine, theirs = _mine_and_theirs(layout)
    now = datetime.datetime.now(datetime.UTC)  # the handler reads the wall clock
    old = [_peering(BASE, 1, now=now)]
    api = _Api(
        [old, old, [_peering(BASE, None)]],
        [
            {"metadata": {"namespace": "ns", "name": n, "finalizers": [settings.FINALIZER]}}
            for n in (mine, theirs)
        ],
    )
    api.install(monkeypatch)
    handover, log = shards.Handover(), _Log()
    assert not handlers._handover_read(handover, log)
    assert (
        "waiting for the pods of another shard layout to exit (live peers in " + BASE
        in log.lines[-1]
    )
    assert not handlers._handover_read(handover, log)
    assert len(log.lines) == 1  # said once
    assert api.patched == []  # nothing written while waiting
    assert handlers._handover_read(handover, log)
    assert "serving shard 0 of 2" in log.lines[-1]
    own = f"{settings.FINALIZER}-2-0"
    assert api.patched == [
        ("ns", mine, shards.adoption_patch([settings.FINALIZER], settings.FINALIZER, own))
    ]


def test_a_failed_peering_read_serves_nothing(monkeypatch: pytest.MonkeyPatch):
    def unreachable(namespaces: Any = ()) -> Any:
        raise kube.ApiError(status=0, reason="API server unreachable")

    monkeypatch.setattr(kube, "peering_objects", unreachable)
    log, handover = _Log(), shards.Handover()
    assert not handlers._handover_read(handover, log)
    assert not handover.established
    assert "peering objects unreadable: 0" in log.lines[-1]


def _memo() -> dict[str, Any]:
    return {"operator": handlers.OperatorMemo(), "handover": kopf_doubles.serving()}


def test_the_index_holds_only_this_shards_policies(monkeypatch: pytest.MonkeyPatch):
    layout = shards.Layout(2, 1)
    monkeypatch.setattr(handlers, "SHARD", layout)
    mine, theirs = _mine_and_theirs(layout)
    memo = _memo()
    kept = handlers.policy_node_reports(
        namespace="ns", name="n1", meta={"resourceVersion": "3"},
        spec={"policyName": mine, "nodeName": "n1"}, memo=memo,
    )  # fmt: skip
    assert kept is not None and list(kept) == [("ns", mine)]
    dropped = handlers.policy_node_reports(
        namespace="ns", name="n2", meta={"resourceVersion": "4"},
        spec={"policyName": theirs, "nodeName": "n2"}, memo=memo,
    )  # fmt: skip
    assert dropped is None
    lag: liveness.WatchLag = memo["operator"].watch_lag
    lag.listed({(R, "ns", "n2"): "4"}, lag.now())
    assert lag.silent() == {}  # the watch delivered it, although the index dropped it


def test_the_watch_check_judges_only_this_shards_policies(monkeypatch: pytest.MonkeyPatch):
    layout = shards.Layout(2, 0)
    monkeypatch.setattr(handlers, "SHARD", layout)
    mine, theirs = _mine_and_theirs(layout)
    listed = {(P, "ns", theirs): "7", (P, "ns", mine): "8"}
    monkeypatch.setattr(
        kube, "watched_versions", lambda namespaces=(), timeout_s=0, report_selector=None: listed
    )
    memo = _memo()
    handlers.policy_watch_check(memo=memo, logger=_Log())
    lag: liveness.WatchLag = memo["operator"].watch_lag
    assert set(lag._pending) == {(P, "ns", mine)}  # another shard's policy is never delivered here
