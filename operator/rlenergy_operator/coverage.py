"""Do the node agents cover every GPU node? Pure checks for the partial case.

``scheduling.agents_unschedulable`` names the case where no agent can schedule at all. Here:
*some* GPU nodes have no agent. Two causes are found from the node objects alone (no pod list):

* a node with GPUs (allocatable ``nvidia.com/gpu`` > 0) that lacks the GPU node label the agent
  DaemonSet selects on (``agent_gpu_node_label``, e.g. GPU feature discovery not run there);
* a labelled GPU node whose blocking taints the agents do not tolerate, or that the configured
  ``nodeSelector`` excludes.

The result feeds the policy's Degraded condition (reason ``AgentsMissing``) when no stronger
finding stands, and the operator's metric ``rlenergy_operator_gpu_nodes_without_agent``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rlenergy_operator import builders, scheduling

REASON = "AgentsMissing"
GPU_RESOURCE = "nvidia.com/gpu"
MAX_NAMED_NODES = 5


@dataclasses.dataclass(frozen=True)
class Coverage:
    """Which GPU nodes can run a node agent.

    Attributes:
        gpu_nodes: nodes with GPUs or the GPU label.
        unlabelled: GPU nodes without the GPU node label (``node: why``).
        blocked: labelled GPU nodes the agents cannot schedule on (``node: why``).
    """

    gpu_nodes: int
    unlabelled: dict[str, str]
    blocked: dict[str, str]

    @property
    def missing(self) -> int:
        """GPU nodes without a node agent."""
        return len(self.unlabelled) + len(self.blocked)


def _gpus(node: Mapping[str, Any]) -> int:
    raw = ((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, "0")
    try:
        return int(str(raw))
    except ValueError:
        return 0


def _labelled(node: Mapping[str, Any], label: str) -> bool:
    key, eq, value = label.partition("=")
    labels = (node.get("metadata") or {}).get("labels") or {}
    return key in labels and (not eq or labels[key] == value)


def check(
    nodes: Sequence[Mapping[str, Any]],
    gpu_label: str,
    tolerations: Sequence[Mapping[str, Any]],
    node_selector: Mapping[str, str],
) -> Coverage:
    """The coverage of ``nodes`` by the agent DaemonSet.

    Args:
        nodes: every node of the cluster (or at least every GPU node): ``metadata.name`` and
            ``labels``, ``spec.taints``, ``status.allocatable``.
        gpu_label: the GPU node label, ``key=value`` or ``key``.
        tolerations: the agent pods' tolerations.
        node_selector: the agent pods' nodeSelector.
    """
    unlabelled: dict[str, str] = {}
    blocked: dict[str, str] = {}
    count = 0
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name", "?"))
        labelled = _labelled(node, gpu_label)
        if not labelled and _gpus(node) == 0:
            continue
        count += 1
        if not labelled:
            unlabelled[name] = f"{_gpus(node)} GPU(s), no {gpu_label} label"
            continue
        labels = (node.get("metadata") or {}).get("labels") or {}
        off = sorted(k for k, v in node_selector.items() if labels.get(k) != v)
        if off:
            blocked[name] = "nodeSelector " + ",".join(f"{k}={node_selector[k]}" for k in off)
            continue
        taints = scheduling.untolerated(tolerations, (node.get("spec") or {}).get("taints") or [])
        if taints:
            blocked[name] = "taint " + ",".join(
                f"{t.get('key')}{'=' + str(t['value']) if t.get('value') else ''}:{t.get('effect')}"
                for t in taints
            )
    return Coverage(count, unlabelled, blocked)


def finding(cov: Coverage) -> builders.Finding | None:
    """The Degraded condition (status, reason, message) when some GPU nodes have no agent."""
    if cov.missing == 0:
        return None
    why = {**cov.unlabelled, **cov.blocked}
    names = sorted(why)
    shown = "; ".join(f"{n} ({why[n]})" for n in names[:MAX_NAMED_NODES])
    more = f"; and {len(names) - MAX_NAMED_NODES} more" if len(names) > MAX_NAMED_NODES else ""
    hint = []
    if cov.unlabelled:
        hint.append("label the GPU nodes (GPU feature discovery) or set agent.gpuNodeLabel")
    if cov.blocked:
        hint.append("set agent.tolerations / agent.nodeSelector to cover them")
    return builders.Finding(
        True,
        REASON,
        f"{cov.missing} of {cov.gpu_nodes} GPU nodes have no node agent: {shown}{more}. "
        f"Fix: {'; '.join(hint)}",
    )
