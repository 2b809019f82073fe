"""Can the node agents schedule? Pure checks of the agent DaemonSet against the GPU nodes' taints.

No kopf, no Kubernetes client: the handler reads the DaemonSet and the GPU nodes
(``rlenergy_operator.kube``) and passes plain dicts; the result feeds the policy's Degraded
condition (and its Warning event). The case it names: the chart installed with
``agent.tolerateGpuTaint=false`` on GPU nodes tainted ``nvidia.com/gpu:NoSchedule``, where the
DaemonSet controller schedules no agent at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlenergy_operator import builders

REASON = "AgentsUnschedulable"
GPU_TAINT_KEY = "nvidia.com/gpu"
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
FIX_GPU_TAINT = (
    "helm upgrade <release> <chart> --reuse-values --set agent.tolerateGpuTaint=true "
    "(operator setting RLENERGY_OPERATOR_AGENT_TOLERATE_GPU_TAINT=true)"
)
MAX_NAMED_NODES = 5


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Whether ``toleration`` tolerates ``taint`` (Kubernetes' ``Toleration.ToleratesTaint``).

    An empty effect matches every effect; an empty key with ``Exists`` matches every key;
    ``Exists`` ignores the value, ``Equal`` (the default operator) compares it.
    """
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    op = toleration.get("operator") or "Equal"
    if key and key != taint.get("key"):
        return False
    if op == "Exists":
        return True
    if not key:  # Equal needs a key
        return False
    return (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated(
    tolerations: Sequence[Mapping[str, Any]], taints: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The scheduling-blocking taints (NoSchedule, NoExecute) no toleration tolerates."""
    return [
        t
        for t in taints
        if t.get("effect") in BLOCKING_EFFECTS and not any(tolerates(tol, t) for tol in tolerations)
    ]


def _taint_str(taint: Mapping[str, Any]) -> str:
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + value if value else ''}:{taint.get('effect')}"


def agents_unschedulable(
    daemonset: Mapping[str, Any] | None,
    tolerations: Sequence[Mapping[str, Any]],
    gpu_nodes: Sequence[Mapping[str, Any]],
) -> builders.Finding | None:
    """The Degraded condition (status, reason, message) when no node agent can schedule.

    Args:
        daemonset: the agent DaemonSet as the API server returns it (``metadata``, ``status``);
            None when it does not exist (yet).
        tolerations: the tolerations of the agent pod template the operator renders.
        gpu_nodes: the nodes labelled ``nvidia.com/gpu.present=true`` (``metadata.name``,
            ``spec.taints``).

    Returns:
        ``(True, "AgentsUnschedulable", message)`` when the DaemonSet controller has observed
        the current template, schedules no agent, and every GPU node carries a blocking taint
        the agents do not tolerate; the message names the taint and, for the GPU taint, the
        fix. None otherwise (no DaemonSet or stale status, agents scheduled, no GPU node, or
        another cause).
    """
    if daemonset is None:
        return None
    status = daemonset.get("status") or {}
    generation = (daemonset.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    if observed is None or (generation is not None and observed < generation):
        return None  # the controller has not looked at this template yet
    if int(status.get("desiredNumberScheduled") or 0) > 0 or not gpu_nodes:
        return None
    blocked: dict[str, list[str]] = {}
    for node in gpu_nodes:
        taints = untolerated(tolerations, (node.get("spec") or {}).get("taints") or [])
        if not taints:
            return None  # a GPU node the agents could run on: not a taint problem
        blocked[(node.get("metadata") or {}).get("name", "?")] = [_taint_str(t) for t in taints]
    names = sorted(blocked)
    shown = ", ".join(names[:MAX_NAMED_NODES]) + (
        f" and {len(names) - MAX_NAMED_NODES} more" if len(names) > MAX_NAMED_NODES else ""
    )
    named = sorted({t for ts in blocked.values() for t in ts})
    message = (
        f"no node agent can schedule: the agent pods do not tolerate the taint"
        f"{'s' if len(named) > 1 else ''} {', '.join(named)} of the {len(names)} GPU "
        f"node{'s' if len(names) > 1 else ''} ({shown})"
    )
    if any(t.split(":")[0].split("=")[0] == GPU_TAINT_KEY for t in named):
        message += (
            f"; the {GPU_TAINT_KEY} toleration is missing (agent.tolerateGpuTaint=false). "
            f"Fix: {FIX_GPU_TAINT}"
        )
    else:
        message += "; untaint the GPU nodes or let the agents tolerate these taints"
    return builders.Finding(True, REASON, message)


def last_finding(conditions: Sequence[Mapping[str, Any]]) -> builders.Finding | None:
    """The ``AgentsUnschedulable`` Degraded condition among ``conditions``, as a finding.

    After an operator restart the in-memory finding is gone until the first check: the policy
    keeps the published one meanwhile instead of flapping to False (and back, with a second
    Warning event).
    """
    deg = next((c for c in conditions if c.get("type") == "Degraded"), None)
    if deg is not None and deg.get("status") == "True" and deg.get("reason") == REASON:
        return builders.Finding(True, REASON, str(deg.get("message") or ""))
    return None
