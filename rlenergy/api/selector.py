"""Which ``RLEnergyPolicy`` governs a node: Kubernetes label-selector matching, pure.

One node-agent DaemonSet serves the whole cluster (one writer per GPU), so each agent finds its
policy itself: the pods holding GPUs on its node (kubelet PodResources) -> the policies in those
pods' namespaces whose ``spec.selector`` matches the pod's labels -> that policy.
``matches`` has the semantics of Kubernetes' ``metav1.LabelSelector`` (``matchLabels`` and
``matchExpressions`` ANDed; ``In``, ``NotIn``, ``Exists``, ``DoesNotExist``; ``NotIn`` and
``DoesNotExist`` match a pod without the key; a missing selector matches nothing, an empty one
everything). ``discover`` never guesses: two policies for one node is a conflict, and the agent
then governs nothing, unless it already governed one of them and that one's pods are its own
alone (``keep_current``): it keeps them, and the newcomer's pods stay ungoverned on the node.

Callers: ``rlenergy_agent.__main__`` (discovery at every plan poll).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Literal

DiscoveryReason = Literal["Matched", "NoGpuPods", "NoMatch", "Conflict"]


class InvalidSelectorError(ValueError):
    """A selector the API server would refuse (unknown operator, values where none belong)."""


def matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` satisfy the LabelSelector ``selector`` (camelCase wire form).

    Raises:
        InvalidSelectorError: an operator other than In/NotIn/Exists/DoesNotExist, In/NotIn
            without values, Exists/DoesNotExist with values.
    """
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for req in selector.get("matchExpressions") or ():
        key, op = req.get("key"), req.get("operator")
        values = list(req.get("values") or ())
        if op in ("In", "NotIn"):
            if not values:
                raise InvalidSelectorError(f"{op} on {key!r} needs values")
            present = key in labels and labels[key] in values
            if present != (op == "In"):
                return False
        elif op in ("Exists", "DoesNotExist"):
            if values:
                raise InvalidSelectorError(f"{op} on {key!r} takes no values")
            if (key in labels) != (op == "Exists"):
                return False
        else:
            raise InvalidSelectorError(f"unknown operator {op!r} on {key!r}")
    return True


@dataclasses.dataclass(frozen=True, order=True)
class PolicyRef:
    """A policy by namespace and name."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclasses.dataclass(frozen=True)
class PodLabels:
    """A GPU-holding pod of the node and its labels."""

    namespace: str
    name: str
    labels: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class PolicySelector:
    """A policy and its ``spec.selector`` (``None``: none given, selects nothing)."""

    ref: PolicyRef
    selector: Mapping[str, Any] | None


@dataclasses.dataclass(frozen=True)
class Discovery:
    """The policy that governs the node, or why none does.

    Attributes:
        policy: the governing policy; ``None`` unless ``reason`` is ``Matched``.
        reason: Matched, NoGpuPods (no pod holds a GPU here), NoMatch (no policy selects the
            GPU pods), Conflict (two or more policies would govern this node's GPUs).
        message: one line for the log and the operator (names pods and policies).
        pods: ``ns/name`` of the GPU pods the policy governs (Matched), or of the pods involved
            in the conflict.
        owners: ``ns/name`` of each selected GPU pod -> the policies selecting it, sorted.
        ungoverned: pods of other policies on the node that the governing policy leaves alone
            (``keep_current``).
    """

    policy: PolicyRef | None
    reason: DiscoveryReason
    message: str
    pods: tuple[str, ...] = ()
    owners: Mapping[str, tuple[PolicyRef, ...]] = dataclasses.field(default_factory=dict)
    ungoverned: tuple[str, ...] = ()


def discover(pods: Iterable[PodLabels], policies: Iterable[PolicySelector]) -> Discovery:
    """The one policy selecting this node's GPU pods; ``None`` on no match or a conflict.

    A policy selects only pods of its own namespace. A conflict is any of: one pod selected
    by two policies, or two pods of the node selected by different policies (the node's GPUs
    are driven by one plan at a time). A policy whose selector is invalid selects nothing and
    is named in the NoMatch/Matched message.
    """
    gpu_pods = sorted(pods, key=lambda p: (p.namespace, p.name))
    if not gpu_pods:
        return Discovery(None, "NoGpuPods", "no pod holds a GPU on this node")
    by_ns: dict[str, list[PolicySelector]] = {}
    for pol in policies:
        by_ns.setdefault(pol.ref.namespace, []).append(pol)
    invalid: set[PolicyRef] = set()
    chosen: dict[str, list[PolicyRef]] = {}
    for pod in gpu_pods:
        hits: list[PolicyRef] = []
        for pol in by_ns.get(pod.namespace, ()):
            try:
                if matches(pol.selector, pod.labels):
                    hits.append(pol.ref)
            except InvalidSelectorError:
                invalid.add(pol.ref)
        if hits:
            chosen[f"{pod.namespace}/{pod.name}"] = sorted(hits)
    note = (
        " (invalid selector, ignored: " + ", ".join(str(r) for r in sorted(invalid)) + ")"
        if invalid
        else ""
    )
    if not chosen:
        names = ", ".join(f"{p.namespace}/{p.name}" for p in gpu_pods)
        return Discovery(None, "NoMatch", f"no RLEnergyPolicy selects the GPU pods {names}{note}")
    owners = {pod: tuple(refs) for pod, refs in chosen.items()}
    multi = {pod: refs for pod, refs in chosen.items() if len(refs) > 1}
    if multi:
        first, refs = next(iter(sorted(multi.items())))
        return Discovery(
            None,
            "Conflict",
            f"pod {first} is selected by {len(refs)} policies ("
            + ", ".join(str(r) for r in refs)
            + "): governing none on this node until one selector is narrowed",
            tuple(sorted(multi)),
            owners,
        )
    distinct = sorted({refs[0] for refs in chosen.values()})
    if len(distinct) > 1:
        parts = ", ".join(f"{name} -> {hit[0]}" for name, hit in sorted(chosen.items()))
        return Discovery(
            None,
            "Conflict",
            f"GPU pods of this node belong to {len(distinct)} policies ({parts}): one agent "
            "drives one plan per node, governing none",
            tuple(sorted(chosen)),
            owners,
        )
    (ref,) = distinct
    governed = tuple(sorted(chosen))
    return Discovery(ref, "Matched", f"{ref} selects {', '.join(governed)}{note}", governed, owners)


def keep_current(found: Discovery, current: PolicyRef | None) -> Discovery:
    """The policy governing the node keeps its pods when another policy's pods arrive.

    A Conflict between policies that select different pods (a policy selects only pods of its
    own namespace, so every other tenant's policy is such a one) leaves ``current`` governing
    the pods only it selects; the other policies' pods on the node stay ungoverned here
    (``ungoverned``, named in the message) until ``current`` has no pod left on the node. Before,
    a policy selecting one co-located pod of another namespace made the node govern none and
    reset the running job's locks. A pod that ``current`` shares with another policy keeps the
    Conflict (both would drive its GPUs). Without a current policy (the agent just started, or
    the node governed none) the Conflict stands too: nothing says which job came first.

    Args:
        found: ``discover``'s outcome now.
        current: the policy the node governed until now (``None``: none).

    Returns:
        ``found``, or a Matched outcome for ``current`` over its own pods.
    """
    if found.reason != "Conflict" or current is None:
        return found
    mine = tuple(sorted(p for p, refs in found.owners.items() if current in refs))
    if not mine or any(found.owners[p] != (current,) for p in mine):
        return found
    others = tuple(sorted(p for p in found.owners if p not in mine))
    parts = ", ".join(f"{p} -> {found.owners[p][0]}" for p in others)
    return Discovery(
        current,
        "Matched",
        f"{current} keeps governing {', '.join(mine)}; the GPU pods of other policies on this "
        f"node stay ungoverned here ({parts}): one agent drives one plan per node",
        mine,
        found.owners,
        others,
    )
