"""Whether a workload lets a policy resize it: no confused deputy (docs/operations.md).

The operator may patch ``statefulsets/scale``, ``leaderworkersets/scale`` and ``rayclusters``
in every namespace it serves, while a tenant who may create an ``RLEnergyPolicy`` need not be
allowed to scale anything. So the operator resizes a worker set only when the workload itself
names the policy in its annotation ``rlenergy.io/allow-scale-by`` (comma-separated policy
names of the workload's namespace). Annotations are part of the workload object: only someone
allowed to update or patch that StatefulSet / LeaderWorkerSet / RayCluster can set one, so the
opt-in carries that person's authority, checked by the API server when they set it.

Why not a SubjectAccessReview of the policy's author: the operator never sees who wrote a
policy. ``managedFields`` names field managers (``kubectl``, ``argocd``), not users; an
annotation on the policy naming its author can be written by anyone who may edit the policy;
and recording the author's groups, which RBAC bindings usually name, would need a mutating
admission step of our own. The opt-in asks the API server at the one moment that matters (the
workload's owner edits the workload) and keeps working when the policy's author leaves.

Pure: ``allows``, ``refusal``. Callers: ``rlenergy_operator.rollout.reconcile``.
"""

from __future__ import annotations

from collections.abc import Mapping

ANNOTATION = "rlenergy.io/allow-scale-by"
"""Annotation on a worker set: the policies (same namespace, comma-separated) that may resize
it between rollout steps."""

MAX_WORKERS_ANNOTATION = "rlenergy.io/max-workers"
"""Annotation on a worker set: the most workers any policy may resize it to (a positive
integer); set by the workload's owner, it lowers the policy's ``spec.rollout.maxWorkers``."""

REASON = "ScaleNotAllowed"
"""``status.rollout.scale.reason`` and the Degraded condition's reason when it does not."""


def allows(annotations: Mapping[str, str] | None, policy: str) -> bool:
    """Whether ``annotations`` (a workload's ``metadata.annotations``) opt in to ``policy``.

    Args:
        annotations: the workload's annotations (``None``: none).
        policy: the RLEnergyPolicy's name.

    Returns:
        True only when ``rlenergy.io/allow-scale-by`` lists ``policy`` (names trimmed; no
        wildcard).
    """
    value = (annotations or {}).get(ANNOTATION, "")
    return policy in {p.strip() for p in value.split(",") if p.strip()}


def ceiling(annotations: Mapping[str, str] | None, max_workers: int) -> int:
    """The most workers a resize may reach: the policy's bound, lowered by the workload's.

    Args:
        annotations: the workload's annotations (``None``: none).
        max_workers: the policy's ``spec.rollout.maxWorkers``.

    Returns:
        ``min(max_workers, rlenergy.io/max-workers)``; an annotation that is not a positive
        integer counts as 1 (the owner meant a bound; growth waits until it is fixed).
    """
    raw = (annotations or {}).get(MAX_WORKERS_ANNOTATION)
    if raw is None:
        return max_workers
    value = raw.strip()
    own = int(value) if value.isdecimal() and int(value) >= 1 else 1
    return min(max_workers, own)


def refusal(kind: str, namespace: str, name: str, policy: str) -> str:
    """The Degraded message for a workload that does not opt in: how to opt in."""
    resource = {
        "StatefulSet": "statefulset",
        "LeaderWorkerSet": "leaderworkerset",
        "RayCluster": "raycluster",
    }.get(kind, kind.lower())
    return (
        f"{kind} {namespace}/{name} does not let policy {policy} resize it; someone allowed "
        f"to edit it opts in with: kubectl annotate {resource} {name} -n {namespace} "
        f"{ANNOTATION}={policy} (comma-separate several policies)"
    )
