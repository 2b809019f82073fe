"""Findings in the node reports that become Kubernetes Events (pure; the loop posts them).

``cross_check_events``: a GPU whose energy counter disagreed with its integrated instant power
(``GpuStatus.energyCrossCheck``, the agent's ``rlenergy_agent.crosscheck``) gets one Warning
Event per new mismatch, carrying both numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlenergy.api import node as api_node

REASON = "EnergyCrossCheckMismatch"


def cross_check_events(
    reports: Sequence[api_node.NodeReport], seen: Mapping[tuple[str, str], int]
) -> list[tuple[tuple[str, str, int], str]]:
    """New cross-check mismatches since ``seen``.

    Args:
        reports: the policy's node reports.
        seen: ``(node, gpu) -> mismatch count`` already posted.

    Returns:
        ``((node, gpu, count), message)`` per GPU whose mismatch count grew, the last check a
        mismatch.
    """
    out = []
    for rep in sorted(reports, key=lambda r: r.node_name):
        for gpu in rep.gpus:
            chk = gpu.energy_cross_check
            if chk is None or not chk.mismatch:
                continue
            if chk.mismatches <= seen.get((rep.node_name, gpu.uuid), 0):
                continue
            diff = 100.0 * (chk.counter_joules / chk.power_joules - 1.0) if chk.power_joules else 0
            out.append(
                (
                    (rep.node_name, gpu.uuid, chk.mismatches),
                    f"{rep.node_name} GPU {gpu.uuid}: energy counter {chk.counter_joules:.0f} J "
                    f"vs integrated instant power {chk.power_joules:.0f} J over "
                    f"{chk.window_seconds:.0f} s ({diff:+.0f} %); the counter is the "
                    "energy source of this GPU's windows",
                )
            )
    return out
