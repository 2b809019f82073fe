"""Policy discovery (rlenergy.api.selector): Kubernetes LabelSelector semantics and the choice
of the one policy that governs a node.

We test these aspects:
* the operators as Kubernetes evaluates them (table): In, NotIn (a pod without the key
  matches), Exists, DoesNotExist, matchLabels, the AND of everything, missing vs empty selector;
* the same laws on generated labels and selectors (hypothesis): matchLabels equals In with one
  value, NotIn and DoesNotExist are the negations of In and Exists, parts AND together;
* invalid selectors raise (and select nothing in discovery, named in the message);
* discovery: one match, no GPU pods, no match, other namespaces ignored, a pod selected by two
  policies and two pods of different policies are conflicts (no policy, every name in the
  message);
* ``keep_current``: the policy the node governs keeps the pods only it selects when another
  policy's pods arrive (those named ungoverned); without a current policy, or when one of its
  pods is another policy's too, the conflict stands.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlenergy.api import selector as sel
from rlenergy.api.v1alpha1 import policy as api_policy

JOB = {"app": "verl", "job": "grpo-7b", "role": "trainer"}


@pytest.mark.parametrize(
    "selector,labels,expected",
    [
        (None, JOB, False),  # no selector: nothing
        ({}, JOB, True),  # empty selector: everything (Kubernetes; our CRD refuses it)
        ({"matchLabels": {"app": "verl"}}, JOB, True),
        ({"matchLabels": {"app": "verl", "job": "other"}}, JOB, False),
        ({"matchLabels": {"team": "a"}}, JOB, False),
        (
            {"matchExpressions": [{"key": "app", "operator": "In", "values": ["x", "verl"]}]},
            JOB,
            True,
        ),
        ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["x"]}]}, JOB, False),
        ({"matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]}, JOB, False),
        (
            {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["verl"]}]},
            JOB,
            False,
        ),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["x"]}]}, JOB, True),
        ({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["a"]}]}, JOB, True),
        ({"matchExpressions": [{"key": "role", "operator": "Exists"}]}, JOB, True),
        ({"matchExpressions": [{"key": "team", "operator": "Exists"}]}, JOB, False),
        ({"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]}, JOB, True),
        ({"matchExpressions": [{"key": "role", "operator": "DoesNotExist"}]}, JOB, False),
        ({"matchExpressions": [{"key": "role", "operator": "Exists"}]}, {"role": ""}, True),
        (
            {
                "matchLabels": {"app": "verl"},
                "matchExpressions": [
                    {"key": "job", "operator": "In", "values": ["grpo-7b"]},
                    {"key": "team", "operator": "DoesNotExist"},
                ],
            },
            JOB,
            True,
        ),
        (
            {
                "matchLabels": {"app": "verl"},
                "matchExpressions": [{"key": "role", "operator": "NotIn", "values": ["trainer"]}],
            },
            JOB,
            False,
        ),
    ],
)
def test_operators_as_kubernetes_evaluates_them(
    selector: dict[str, Any] | None, labels: dict[str, str], expected: bool
) -> None:
    assert sel.matches(selector, labels) is expected


@pytest.mark.parametrize(
    "req",
    [
        {"key": "a", "operator": "In", "values": []},
        {"key": "a", "operator": "NotIn"},
        {"key": "a", "operator": "Exists", "values": ["x"]},
        {"key": "a", "operator": "Gt", "values": ["1"]},
    ],
)
def test_invalid_requirements_raise(req: dict[str, Any]) -> None:
    with pytest.raises(sel.InvalidSelectorError):
        sel.matches({"matchExpressions": [req]}, {"a": "x"})


KEYS = st.sampled_from(["app", "job", "role", "example.com/team"])
VALUES = st.sampled_from(["", "a", "b", "verl"])
LABELS = st.dictionaries(KEYS, VALUES, max_size=4)
VALUE_SETS = st.lists(VALUES, min_size=1, max_size=3)


@st.composite
def requirements(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]))
    req: dict[str, Any] = {"key": draw(KEYS), "operator": op}
    if op in ("In", "NotIn"):
        req["values"] = draw(VALUE_SETS)
    return req


SELECTORS = st.fixed_dictionaries(
    {},
    optional={
        "matchLabels": st.dictionaries(KEYS, VALUES, max_size=3),
        "matchExpressions": st.lists(requirements(), max_size=3),
    },
)


@given(LABELS, KEYS, VALUES)
def test_match_labels_is_in_with_one_value(labels: dict[str, str], key: str, value: str) -> None:
    assert sel.matches({"matchLabels": {key: value}}, labels) == sel.matches(
        {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}, labels
    )
    assert sel.matches({"matchLabels": {key: value}}, labels) == (labels.get(key) == value)


@given(LABELS, KEYS, VALUE_SETS)
def test_notin_and_doesnotexist_negate_in_and_exists(
    labels: dict[str, str], key: str, values: list[str]
) -> None:
    def one(op: str, vals: list[str] | None = None) -> bool:
        req: dict[str, Any] = {"key": key, "operator": op}
        if vals is not None:
            req["values"] = vals
        return sel.matches({"matchExpressions": [req]}, labels)

    assert one("NotIn", values) is not one("In", values)
    assert one("DoesNotExist") is not one("Exists")
    assert one("In", values) == (key in labels and labels[key] in values)
    assert one("Exists") == (key in labels)


@given(LABELS, SELECTORS, SELECTORS)
def test_parts_and_together(labels: dict[str, str], a: dict[str, Any], b: dict[str, Any]) -> None:
    exprs = list(a.get("matchExpressions") or []) + list(b.get("matchExpressions") or [])
    both = {"matchExpressions": exprs}
    assert sel.matches(both, labels) == (
        sel.matches({"matchExpressions": a.get("matchExpressions") or []}, labels)
        and sel.matches({"matchExpressions": b.get("matchExpressions") or []}, labels)
    )
    # matchLabels is one more requirement per key, ANDed with the expressions
    ml = a.get("matchLabels") or {}
    full = {"matchLabels": ml, "matchExpressions": exprs}
    assert sel.matches(full, labels) == (
        all(labels.get(k) == v for k, v in ml.items()) and sel.matches(both, labels)
    )


@given(LABELS, st.dictionaries(st.sampled_from(["x", "y"]), VALUES, max_size=2))
def test_a_pods_own_labels_select_it_whatever_else_it_carries(
    labels: dict[str, str], extra: dict[str, str]
) -> None:
    assert sel.matches({"matchLabels": labels}, {**labels, **extra})


def test_the_policy_model_round_trips_into_the_matcher() -> None:
    """A selector as the CRD model dumps it (camelCase, no nulls) is what the matcher reads."""
    model = api_policy.LabelSelector.model_validate(
        {
            "matchLabels": {"app": "verl"},
            "matchExpressions": [{"key": "team", "operator": "DoesNotExist"}],
        }
    )
    wire = model.model_dump(by_alias=True, exclude_none=True)
    assert sel.matches(wire, JOB) and not sel.matches(wire, {**JOB, "team": "a"})


def _pod(ns: str, name: str, **labels: str) -> sel.PodLabels:
    return sel.PodLabels(ns, name, labels)


def _pol(ns: str, name: str, selector: dict[str, Any] | None) -> sel.PolicySelector:
    return sel.PolicySelector(sel.PolicyRef(ns, name), selector)


GRPO = _pol("team-a", "grpo", {"matchLabels": {"job": "grpo-7b"}})


def test_one_policy_selects_the_gpu_pods() -> None:
    d = sel.discover(
        [_pod("team-a", "w-1", job="grpo-7b"), _pod("team-a", "w-0", job="grpo-7b")],
        [GRPO, _pol("team-a", "other", {"matchLabels": {"job": "dpo"}})],
    )
    assert d.policy == sel.PolicyRef("team-a", "grpo") and d.reason == "Matched"
    assert d.pods == ("team-a/w-0", "team-a/w-1")


def test_no_gpu_pods_and_no_match_govern_nothing() -> None:
    assert sel.discover([], [GRPO]) == sel.Discovery(
        None, "NoGpuPods", "no pod holds a GPU on this node"
    )
    d = sel.discover([_pod("team-a", "w-0", job="dpo")], [GRPO])
    assert d.policy is None and d.reason == "NoMatch" and "team-a/w-0" in d.message
    # a policy selects only pods of its own namespace
    d = sel.discover([_pod("team-b", "w-0", job="grpo-7b")], [GRPO])
    assert d.policy is None and d.reason == "NoMatch"
    # no selector selects nothing
    d = sel.discover([_pod("team-a", "w-0", job="grpo-7b")], [_pol("team-a", "bare", None)])
    assert d.reason == "NoMatch"


def test_a_pod_selected_by_two_policies_is_a_conflict() -> None:
    wide = _pol("team-a", "all-verl", {"matchExpressions": [{"key": "job", "operator": "Exists"}]})
    d = sel.discover([_pod("team-a", "w-0", job="grpo-7b")], [GRPO, wide])
    assert d.policy is None and d.reason == "Conflict"
    assert "team-a/w-0" in d.message and "team-a/grpo" in d.message
    assert "team-a/all-verl" in d.message and d.pods == ("team-a/w-0",)


def test_two_pods_of_different_policies_on_one_node_are_a_conflict() -> None:
    dpo = _pol("team-b", "dpo", {"matchLabels": {"job": "dpo"}})
    d = sel.discover(
        [_pod("team-a", "w-0", job="grpo-7b"), _pod("team-b", "d-0", job="dpo")], [GRPO, dpo]
    )
    assert d.policy is None and d.reason == "Conflict"
    assert "team-a/grpo" in d.message and "team-b/dpo" in d.message
    # an unselected GPU pod next to a selected one does not stop the match
    d = sel.discover(
        [_pod("team-a", "w-0", job="grpo-7b"), _pod("team-b", "notebook", app="jupyter")],
        [GRPO, dpo],
    )
    assert d.policy == sel.PolicyRef("team-a", "grpo") and d.pods == ("team-a/w-0",)


def test_an_invalid_selector_selects_nothing_and_is_named() -> None:
    bad = _pol("team-a", "bad", {"matchExpressions": [{"key": "job", "operator": "In"}]})
    d = sel.discover([_pod("team-a", "w-0", job="grpo-7b")], [GRPO, bad])
    assert d.policy == sel.PolicyRef("team-a", "grpo")
    assert "invalid selector" in d.message and "team-a/bad" in d.message


DPO = _pol("team-b", "dpo", {"matchLabels": {"job": "dpo"}})
GRPO_REF, DPO_REF = sel.PolicyRef("team-a", "grpo"), sel.PolicyRef("team-b", "dpo")


def test_the_governing_policy_keeps_its_pods_when_another_tenants_arrive() -> None:
    pods = [
        _pod("team-a", "w-0", job="grpo-7b"),
        _pod("team-a", "w-1", job="grpo-7b"),
        _pod("team-b", "spoiler", job="dpo"),
    ]
    found = sel.discover(pods, [GRPO, DPO])
    assert found.reason == "Conflict"
    assert found.owners == {
        "team-a/w-0": (GRPO_REF,),
        "team-a/w-1": (GRPO_REF,),
        "team-b/spoiler": (DPO_REF,),
    }
    kept = sel.keep_current(found, GRPO_REF)
    assert (kept.policy, kept.reason) == (GRPO_REF, "Matched")
    assert kept.pods == ("team-a/w-0", "team-a/w-1")
    assert kept.ungoverned == ("team-b/spoiler",)
    assert "team-b/spoiler -> team-b/dpo" in kept.message and "keeps governing" in kept.message
    # seen from the other side: the node governed team-b's job first, team-a's pods wait
    kept = sel.keep_current(found, DPO_REF)
    assert (kept.policy, kept.pods, kept.ungoverned) == (
        DPO_REF,
        ("team-b/spoiler",),
        ("team-a/w-0", "team-a/w-1"),
    )


def test_a_conflict_without_a_current_policy_or_over_its_own_pod_stands() -> None:
    pods = [_pod("team-a", "w-0", job="grpo-7b"), _pod("team-b", "d-0", job="dpo")]
    found = sel.discover(pods, [GRPO, DPO])
    assert sel.keep_current(found, None) == found  # nothing says which job came first
    assert sel.keep_current(found, sel.PolicyRef("team-c", "gone")) == found  # none of its pods
    # a pod of the current policy that another policy selects too: both would drive its GPUs
    wide = _pol("team-a", "all", {"matchExpressions": [{"key": "job", "operator": "Exists"}]})
    shared = sel.discover([_pod("team-a", "w-0", job="grpo-7b")], [GRPO, wide])
    assert sel.keep_current(shared, GRPO_REF) == shared
    # no conflict: unchanged
    matched = sel.discover([_pod("team-a", "w-0", job="grpo-7b")], [GRPO])
    assert sel.keep_current(matched, GRPO_REF) == matched
