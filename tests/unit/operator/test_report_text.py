"""Text from node reports is printable before it reaches conditions, Events and kubectl; report
names of different policy-node pairs never collide.

A compromised node agent writes its report's strings: a rollout failure's message, ended pods'
names, GPU reasons and errors. Terminal escape sequences in them must not reach a reader's
terminal through ``kubectl describe`` (Events) or ``kubectl rlenergy status``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from rich.console import Console
from rlenergy_kubectl import view
from rlenergy_operator import reports, rolloutfaults

from rlenergy.api import naming
from rlenergy.api.v1alpha1 import nodereport

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[1A\r\u202e"
DNS = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def _spec() -> dict[str, Any]:
    return {
        "policyName": "p",
        "nodeName": "node-1",
        "gpus": [
            {
                "uuid": "GPU-1",
                "condition": "degraded",
                "reason": f"TelemetryUnavailable{ESCAPES}",
                "pod": f"team-a/rollout-0{ESCAPES}",
            }
        ],
        "rollout": {
            "step": 3,
            "activeWorkers": 2,
            "workerPods": ["team-a/rollout-0"],
            "failure": {"reason": "ReleaseAborted", "message": f"aborted{ESCAPES}\nForged: line"},
        },
        "endedPods": [{"pod": f"team-a/rollout-0{ESCAPES}", "how": "NotAllocated", "step": 3}],
    }


def _clean(text: str) -> bool:
    return not any(c in text for c in "\x1b\x07\r\n\u202e")


def test_the_operator_reads_report_text_without_escapes() -> None:
    cache = reports.ReportCache(lambda ns, policy: {"r": "1"}, lambda ns, name: ("1", _spec()))
    (rep,) = cache.refresh("ns", "p", -1, logging.getLogger("test"))
    assert rep.rollout is not None and rep.rollout.failure is not None
    assert _clean(rep.rollout.failure.message) and "aborted" in rep.rollout.failure.message
    assert _clean(rep.gpus[0].reason) and _clean(rep.ended_pods[0].pod)
    found = rolloutfaults.assess(None, rep.rollout, [rep], "2026-01-01T00:00:00Z")
    assert found.event is not None and found.degraded is not None
    assert _clean(found.event[2]) and "aborted" in found.event[2]
    assert found.failure is not None and _clean(found.failure.message)


def test_kubectl_shows_report_text_without_escapes() -> None:
    parsed = view.parse_reports([{"metadata": {"name": "r"}, "spec": _spec()}])
    policy = view.parse_policy(
        {
            "metadata": {"namespace": "ns", "name": "p"},
            "spec": {},
            "status": {
                "conditions": [
                    {
                        "type": "Degraded",
                        "status": "True",
                        "reason": "ReleaseAborted",
                        "message": f"step 3: aborted{ESCAPES}",
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }
                ]
            },
        }
    )
    console = Console(record=True, width=250, color_system=None, force_terminal=True)
    console.print(view.render_policy(policy, parsed))
    out = console.export_text()
    assert "\x1b]0;owned" not in out and "\x1b[2J" not in out and "\u202e" not in out
    assert "TelemetryUnavailable" in out


def test_printable_keeps_text_and_tabs() -> None:
    assert naming.printable("GPU-1: NVML error\t3") == "GPU-1: NVML error\t3"
    assert naming.printable(f"a{ESCAPES}b\nc") == "a]0;owned[2J[1A b c"
    assert naming.printable_tree({"k\x1b": ["v\x1b", 1, None]}) == {"k": ["v", 1, None]}


def test_report_names_of_different_pairs_never_collide() -> None:
    a = naming.report_name("a-b", "c")
    b = naming.report_name("a", "b-c")
    assert a != b and a.startswith("a-b-c-") and b.startswith("a-b-c-")
    assert nodereport.report_name("a-b", "c") == a
    long_ = [naming.report_name("p" * 200, "n" * 200 + s) for s in ("x", "y")]
    assert long_[0] != long_[1] and all(len(n) <= 253 for n in long_)
    for name in (a, b, *long_, naming.report_name("Pol", "ip-10-0-0-1.ec2.internal")):
        assert DNS.match(name), name
    assert naming.report_name("a-b", "c") == a  # stable across agents and restarts
