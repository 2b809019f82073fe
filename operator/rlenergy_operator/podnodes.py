"""Which nodes may report for a policy: the nodes that host its pods.

RBAC and the node-report admission policy let an agent write only its own node's report, but
for any policy: a compromised agent can write a report for a policy that has no pod on its
node (energy, tokens, a rollout dispatch the operator would act on, a conflict). The job loop
therefore reads only the reports of nodes that host one of the policy's pods (the pods its
``spec.selector`` matches in its namespace, ``spec.nodeName`` set, whatever their phase), or
hosted one within ``HOSTED_GRACE_S`` (the last records of a job whose pods were deleted).

``hosting_nodes`` and ``from_hosting_nodes`` are pure; ``PodNodes`` caches one policy's
listing (the operator's ``pods list``, the same grant the webhook's check uses) and lists again
every ``REFRESH_S``, or sooner (at most every ``MIN_REFRESH_S``) when a report names a node it
has not seen. Callers: ``handlers._fold``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlenergy.api import node as api_node
from rlenergy.api import selector as api_selector
from rlenergy.api.v1alpha1 import policy as api_policy

REFRESH_S = 30.0
"""A policy's pod listing is read again after this long, s [MODEL: a pod scheduled on a new
node gets its reports read within one listing; ``MIN_REFRESH_S`` makes that sooner]."""
MIN_REFRESH_S = 5.0
"""A report from a node not in the listing lists again, but not more often than this, s (a
node that hosts none of the policy's pods keeps naming itself)."""
HOSTED_GRACE_S = 600.0
"""A node that hosted one of the policy's pods stays a reporter this long after the last listing
that showed one, s [MODEL: the job loop folds a report's steps within a pass or two (2 s each);
ten minutes covers an operator that was down a while when the pods were deleted]."""


def hosting_nodes(
    pods: Iterable[Mapping[str, Any]], selector: Mapping[str, Any] | None
) -> set[str]:
    """The nodes (``spec.nodeName``) of the pods ``selector`` matches.

    Args:
        pods: pods of the policy's namespace as the API returns them (plain dicts).
        selector: the policy's ``spec.selector`` (a LabelSelector).

    Raises:
        rlenergy.api.selector.InvalidSelectorError: ``selector`` is malformed.
    """
    nodes: set[str] = set()
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if node and api_selector.matches(selector, labels):
            nodes.add(str(node))
    return nodes


def from_hosting_nodes(
    reports: Iterable[api_node.NodeReport], nodes: set[str]
) -> tuple[list[api_node.NodeReport], list[str]]:
    """(the reports of ``nodes``, the other reports' node names, sorted)."""
    kept: list[api_node.NodeReport] = []
    ignored: set[str] = set()
    for report in reports:
        if report.node_name in nodes:
            kept.append(report)
        else:
            ignored.add(report.node_name)
    return kept, sorted(ignored)


@dataclasses.dataclass
class PodNodes:
    """One policy's hosting nodes, from a cached pod listing.

    Args:
        list_pods: ``(namespace, label_selector) -> pods`` (``kube.pods``); its errors pass
            through, and the nodes known so far stay.
        clock: monotonic time, s.
    """

    list_pods: Callable[[str, str], list[dict[str, Any]]]
    clock: Callable[[], float]
    seen: dict[str, float] = dataclasses.field(default_factory=dict)
    """Node -> monotonic s of the newest listing that showed one of the policy's pods there."""
    listed_at: float | None = None

    def nodes(
        self, namespace: str, selector: api_policy.LabelSelector, reporting: Iterable[str]
    ) -> set[str]:
        """The nodes whose reports the job loop reads now.

        Args:
            namespace: the policy's namespace.
            selector: its ``spec.selector`` (the listing asks the API server for
                ``selector.to_query()``; ``hosting_nodes`` checks it again).
            reporting: the nodes whose reports the policy has (a new one lists sooner).

        Raises:
            kube.ApiError: the listing failed (the caller retries the pass).
            rlenergy.api.selector.InvalidSelectorError: ``selector`` is malformed.
        """
        now = self.clock()
        age = None if self.listed_at is None else now - self.listed_at
        unknown = set(reporting) - set(self.seen)
        if age is None or age >= REFRESH_S or (unknown and age >= MIN_REFRESH_S):
            pods = self.list_pods(namespace, selector.to_query())
            wire = selector.model_dump(by_alias=True, exclude_none=True)
            for node in hosting_nodes(pods, wire):
                self.seen[node] = now
            self.listed_at = now
        for node, at in list(self.seen.items()):
            if now - at > HOSTED_GRACE_S:
                del self.seen[node]
        return set(self.seen)
