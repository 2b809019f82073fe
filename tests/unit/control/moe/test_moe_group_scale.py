"""Resizing a KubeRay RayCluster worker group: which pods ``workersToDelete`` names.

We test these aspects:
* the group's pods are recognised by KubeRay's worker pod names (``<cluster>-<group>-worker-``
  + 5 generated characters, the prefix cut to 50), in the RayCluster's namespace only: not the
  head, not another group whose name shares a prefix, not another namespace;
* a shrink names released pods only (every reported GPU of the pod parked), in name order,
  not pods already being deleted; with fewer known than needed it is refused
  (``WorkersUnknown``, with how many were needed and known), never filled with a guess;
* the floor still refuses first (``ShrinkRejected``); a target outside
  ``minReplicas..maxReplicas`` is refused; an autoscaled group or several hosts per replica is
  ``UnsupportedWorkerSet``;
* growth only raises replicas and drops ``workersToDelete`` entries whose pods are gone;
* property: never below the floor (unless untouched), only pods of the group, only fully
  parked pods, a shrink deletes exactly the pods it removes or is refused.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rlenergy.control.moe import scale


def group(replicas: int = 3, **kw: object) -> scale.WorkerGroup:
    return scale.WorkerGroup(cluster="rc", namespace="ns", group="rollout", replicas=replicas, **kw)  # type: ignore[arg-type]


def pod(suffix: str) -> str:
    return f"rc-rollout-worker-{suffix}"


def test_group_pods_are_recognised_by_kuberay_names_in_the_namespace():
    g = group()
    assert g.pod_prefix == "rc-rollout-worker-"
    assert g.member(f"ns/{pod('ab12x')}") == pod("ab12x")
    for other in (
        f"other/{pod('ab12x')}",  # another namespace
        "ns/rc-head-ab12x",  # the head
        "ns/rc-rollout-b-worker-ab12x",  # group "rollout-b"
        f"ns/{pod('ab12')}",  # not a generated suffix
        f"ns/{pod('ab12xy')}",
        pod("ab12x"),  # no namespace
        None,
    ):
        assert g.member(other) is None, other
    long = scale.WorkerGroup(cluster="c" * 40, namespace="ns", group="g" * 20, replicas=1)
    assert long.pod_prefix == ("c" * 40 + "-" + "g" * 9)[:50] + "-worker-"
    assert long.member("ns/" + long.pod_prefix + "zz9zz") is not None


def test_shrink_names_the_released_pods_only():
    gpus = [
        (f"ns/{pod('aaaaa')}", True),
        (f"ns/{pod('aaaaa')}", True),
        (f"ns/{pod('bbbbb')}", True),
        (f"ns/{pod('bbbbb')}", False),  # half parked: still working
        (f"ns/{pod('ccccc')}", False),
        ("ns/rc-head-hhhhh", True),
        ("ns/rc-other-worker-ooooo", True),  # another group
        (None, True),
    ]
    assert scale.group_pods(group(), gpus) == {
        pod("aaaaa"): True,
        pod("bbbbb"): False,
        pod("ccccc"): False,
    }
    g = scale.decide_group_scale(group(3), 2, 2, gpus)
    assert g.decision.action is scale.ScaleAction.RESIZE
    assert (g.decision.reason, g.decision.target) == ("ShrinkBetweenSteps", 2)
    assert g.chosen == g.workers_to_delete == (pod("aaaaa"),)
    assert pod("aaaaa") in g.decision.message
    # two needed, one known: refused, never guessed
    r = scale.decide_group_scale(group(3, min_replicas=0), 1, 1, gpus)
    assert r.decision.action is scale.ScaleAction.REFUSED
    assert r.decision.reason == "WorkersUnknown"
    assert (r.needed, r.known, r.decision.target) == (2, 1, 3)
    assert "2 released worker pods needed, 1 known" in r.decision.message
    assert r.workers_to_delete == ()
    # a pod already being deleted is not counted again
    pending = scale.decide_group_scale(group(3, workers_to_delete=(pod("aaaaa"),)), 2, 2, gpus)
    assert pending.decision.reason == "WorkersUnknown"
    assert "0 known" in pending.decision.message


def test_floor_bounds_and_unsupported_groups_refuse_first():
    gpus = [(f"ns/{pod(s)}", True) for s in ("aaaaa", "bbbbb", "ccccc")]
    below = scale.decide_group_scale(group(3), 1, 2, gpus)
    assert below.decision.reason == "ShrinkRejected" and "minimum is 2" in below.decision.message
    bounds = scale.decide_group_scale(group(3, min_replicas=3), 2, 1, gpus)
    assert bounds.decision.reason == "OutsideWorkerGroupBounds"
    assert "[3, unbounded]" in bounds.decision.message
    assert scale.decide_group_scale(group(3, max_replicas=3), 4, 1, gpus).decision.reason == (
        "OutsideWorkerGroupBounds"
    )
    auto = scale.decide_group_scale(group(3, autoscaling=True), 2, 1, gpus)
    assert auto.decision.reason == "UnsupportedWorkerSet" and "autoscaler" in auto.decision.message
    hosts = scale.decide_group_scale(group(3, hosts_per_replica=2), 2, 1, gpus)
    assert (
        hosts.decision.reason == "UnsupportedWorkerSet" and "numOfHosts" in hosts.decision.message
    )
    for d in (below, bounds, auto, hosts):
        assert d.decision.action is scale.ScaleAction.REFUSED and d.decision.target == 3
    at = scale.decide_group_scale(group(3, autoscaling=True), 3, 1, gpus)
    assert at.decision.action is scale.ScaleAction.NONE


def test_growth_raises_replicas_and_drops_entries_that_are_gone():
    gpus = [(f"ns/{pod('aaaaa')}", False), (f"ns/{pod('bbbbb')}", True)]
    g = scale.decide_group_scale(
        group(2, workers_to_delete=(pod("zzzzz"), pod("bbbbb"))), 3, 2, gpus
    )
    assert (g.decision.action, g.decision.reason, g.decision.target) == (
        scale.ScaleAction.RESIZE,
        "GrowBetweenSteps",
        3,
    )
    assert g.workers_to_delete == (pod("bbbbb"),)  # still there: KubeRay still deletes it
    assert g.chosen == ()


SUFFIXES = st.text("abcdxyz2459", min_size=5, max_size=5)
POD = st.one_of(
    st.builds(lambda s: f"ns/{pod(s)}", SUFFIXES),
    st.builds(lambda s: f"other/{pod(s)}", SUFFIXES),
    st.builds(lambda s: f"ns/rc-head-{s}", SUFFIXES),
    st.builds(lambda s: f"ns/rc-rollout-x-worker-{s}", SUFFIXES),
    st.none(),
)


@given(
    current=st.integers(0, 8),
    desired=st.integers(1, 8),
    floor=st.integers(1, 6),
    gpus=st.lists(st.tuples(POD, st.booleans()), max_size=20),
    pending=st.lists(SUFFIXES.map(pod), max_size=3),
)
def test_property_never_below_floor_only_fully_parked_pods_of_the_group(
    current: int, desired: int, floor: int, gpus: list[tuple[str | None, bool]], pending: list[str]
):
    g0 = group(current, workers_to_delete=tuple(pending))
    out = scale.decide_group_scale(g0, desired, floor, gpus)
    d = out.decision
    assert d.target >= floor or d.target == current
    if d.action is not scale.ScaleAction.RESIZE:
        assert d.target == current and out.chosen == ()
        assert out.workers_to_delete == g0.workers_to_delete
        return
    fully_parked = {
        name
        for name in {g0.member(p) for p, _ in gpus} - {None}
        if all(parked for p, parked in gpus if g0.member(p) == name)
    }
    assert set(out.chosen) <= fully_parked  # only pods of the group, every GPU parked
    assert not set(out.chosen) & set(pending)
    assert set(out.workers_to_delete) <= set(pending) | set(out.chosen)
    if d.target < current:
        assert len(out.chosen) == current - d.target  # deletes exactly what it removes
    else:
        assert out.chosen == ()
    # refuse rather than guess: a shrink happens only when enough released pods are known
    known = len(fully_parked - set(pending))
    assert d.target >= current or known >= current - d.target


@given(
    current=st.integers(2, 8),
    gpus=st.lists(st.tuples(POD, st.booleans()), max_size=20),
)
def test_property_a_shrink_is_refused_exactly_when_too_few_released_pods_are_known(
    current: int, gpus: list[tuple[str | None, bool]]
):
    g0 = group(current)
    out = scale.decide_group_scale(g0, current - 1, 1, gpus)
    released = [p for p, parked in scale.group_pods(g0, gpus).items() if parked]
    if released:
        assert out.decision.action is scale.ScaleAction.RESIZE
        assert out.chosen == (min(released),)
    else:
        assert out.decision.reason == "WorkersUnknown" and out.known == 0 and out.needed == 1
