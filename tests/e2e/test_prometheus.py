"""Prometheus end to end: Debian's prometheus scrapes the node agents of a full-stack run.

The full stack of ``test_full_stack.py`` (operator and 3 agents as local processes on the
stand-in NVML, a trainer replaying a verl trace through the SDK) runs for more steps than an
agent keeps in its report (``MAX_STEPS_KEPT``), with a ``prometheus`` server (``make bins``
fetches it with ``apt-get download``) scraping the agents' ``/metrics`` on 127.0.0.1 every
second (static targets). Through the HTTP API (``/api/v1/query``) we check against the policy
status:

* energy per valid token, per phase and for the job: the agents' own phase energy counters
  (``rlenergy_agent_gpu_phase_energy_joules_total``, idle windows under ``phase="idle"``) over
  the job's valid tokens (``rlenergy_agent_valid_tokens_total``; every node counts its job's
  tokens, hence ``max``), against ``phases[].measuredJoules`` and ``totals.measuredJoules`` over
  ``totals.validTokens``. Both sides add the same float64 window energies in a different
  order: they agree to ~1e-13 relative; ``REL_TOLERANCE`` leaves room for nothing else;
* the saving ratio, through the Grafana dashboard's own expressions (read from
  ``helm/rl-energy/files/dashboard.json``), against ``phases[].saving.percent`` and
  ``totals.savingPercent``: the agents republish the operator's figure (an agent cannot predict
  the default governor's energy), so this checks the path from the status through every agent,
  the scrape and the query, not the saving's computation;
* every dashboard query, with the template variables a user picks (the trainer's namespace, the
  policy), answers without error: energy per valid token and phase power one series per phase,
  the SM clock panel per phase and kind (the energy-per-token panel summed without
  ``by (phase)``).

Prometheus scrapes the agents as the chart's ServiceMonitor makes the Prometheus Operator scrape
them: with the target labels it adds (``namespace``, ``pod``, ... of the agent pod) and the
chart's ``honorLabels``, so the trainer pod's ``pod``/``namespace`` labels the agents export
survive (no ``exported_namespace``) and the dashboard's namespace filter finds them.

The comparison uses a status that did not change while Prometheus scraped every agent after it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import chart_support
import pytest
from e2e_support import wait_until
from prometheus_support import PrometheusServer
from rlenergy_agent import server, service
from rlenergy_dev import fullstack, standin
from rlenergy_dev.devcluster import DevCluster

from tests import factories

pytestmark = pytest.mark.field

ROOT = Path(__file__).resolve().parents[2]
STEPS = service.MAX_STEPS_KEPT + 4
"""More steps than an agent's report keeps: counters must not follow the trimmed records."""
REL_TOLERANCE = 1e-9
DASHBOARD = ROOT / "helm" / "rl-energy" / "files" / "dashboard.json"
OPERATOR_TARGET_LABELS = {
    "namespace": "rl-energy-system",
    "pod": "rlenergy-node-agent-x7k2p",
    "container": "agent",
    "endpoint": "metrics",
    "service": "rl-rl-energy-agent-metrics",
}
"""Target labels the Prometheus Operator sets on a ServiceMonitor's targets (the agent pod's)."""


def _dashboard_queries(namespace: str, policy: str) -> dict[tuple[int, str], str]:
    """(panel id, refId) -> the panel's expression with the user's variable choices."""
    board = json.loads(DASHBOARD.read_text())
    subst = {"$namespace": namespace, "$policy": policy, "$__rate_interval": "10m"}
    out = {}
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"]
            for var, value in subst.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unknown dashboard variable in {t['expr']}"
            out[(panel["id"], t["refId"])] = expr
    return out


def _honor_labels() -> bool:
    docs = chart_support.template("--set", "metrics.serviceMonitor.enabled=true")
    (monitor,) = [
        d
        for d in docs
        if d["kind"] == "ServiceMonitor" and d["metadata"]["name"].endswith("-agent")
    ]
    return bool(monitor["spec"]["endpoints"][0]["honorLabels"])


def _settled(stack: fullstack.FullStack) -> dict[str, Any] | None:
    s = stack.policy_status()
    return s if s.get("totals", {}).get("throughStep") == STEPS - 1 else None


def _figures(status: dict[str, Any]) -> Any:
    return status.get("totals"), status.get("phases")


@pytest.mark.timeout(600)
def test_prometheus_scrapes_agents_matching_the_policy_status(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path
):
    t0 = time.monotonic()
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    policy = factories.sample_policy(warmupSteps=4, trialSteps=4)
    name = policy["metadata"]["name"]
    stack = fullstack.FullStack(
        dev_cluster.kubeconfig, namespace, name, dev_cluster.nodes, tmp_path / "stack", lib_dir
    )
    with stack:
        stack.start_operator()
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
        stack.start_agents()
        targets = [f"127.0.0.1:{a.metrics_port}" for a in stack.agents]
        honor = _honor_labels()
        assert honor, "the chart's ServiceMonitor keeps the agents' pod/namespace labels"
        with PrometheusServer(
            targets, tmp_path / "prometheus", target_labels=OPERATOR_TARGET_LABELS,
            honor_labels=honor,
        ) as prom:  # fmt: skip
            assert prom.value("count(up == 1)") == len(stack.agents)
            job, _factor = fullstack.compressed_replay(
                fullstack.DEFAULT_TRACE, stack.sku, STEPS, num_gpus=24,
                longest_phase_s=fullstack.LONGEST_PHASE_S,
            )  # fmt: skip
            stack.run_trainer(job)
            wait_until(lambda: _settled(stack), timeout=60, what="every step accounted")
            board = _dashboard_queries(namespace, name)

            # A status that stays the same while Prometheus scrapes every agent after it.
            deadline = time.monotonic() + 90
            while True:
                before = _settled(stack)
                assert before is not None
                # The agents poll the policy every 0.1 s, and serve one /metrics rendering to
                # every scrape within server.METRICS_REUSE_S: a scrape after ``since`` reads a
                # page rendered after they saw this status.
                since = time.time() + 0.5 + server.METRICS_REUSE_S
                wait_until(lambda: prom.scraped_since(since), timeout=30, what="fresh scrapes")  # noqa: B023
                results = {
                    "phase_energy": prom.query(
                        "sum by (phase) (rlenergy_agent_gpu_phase_energy_joules_total)"
                    ),
                    "job_energy": prom.value("sum(rlenergy_agent_gpu_phase_energy_joules_total)"),
                    "tokens_max": prom.value("max(rlenergy_agent_valid_tokens_total)"),
                    "tokens_min": prom.value("min(rlenergy_agent_valid_tokens_total)"),
                    "per_token": prom.query(
                        "sum by (phase) (rlenergy_agent_gpu_phase_energy_joules_total)"
                        " / scalar(max(rlenergy_agent_valid_tokens_total))"
                    ),
                    "job_per_token": prom.value(
                        "sum(rlenergy_agent_gpu_phase_energy_joules_total)"
                        " / scalar(max(rlenergy_agent_valid_tokens_total))"
                    ),
                    "saving": prom.query(board[(2, "A")]),
                    "job_saving": prom.query(board[(2, "B")]),
                    "namespaces": prom.query(
                        "count by (namespace, exported_namespace)"
                        " (rlenergy_agent_gpu_phase_energy_joules_total)"
                    ),
                    "board": {k: prom.query(e) for k, e in board.items()},
                }
                after = _settled(stack)
                if after is not None and _figures(after) == _figures(before):
                    break
                assert time.monotonic() < deadline, "the policy status never settled"
            scrape_targets = prom.api("targets")["activeTargets"]
        # Leave no finalizer behind: the policy goes while the operator and the agents run.
        dev_cluster.kubectl("delete", "rlep", name, "-n", namespace, "--timeout=60s")
    status = after
    totals = status["totals"]
    phases = {p["name"]: p for p in status["phases"]}
    print(json.dumps({k: str(v) for k, v in results.items()}, indent=1))

    assert {t["health"] for t in scrape_targets} == {"up"}
    assert totals["steps"] == STEPS and totals["missedSteps"] == 0
    assert totals["unknownEnergySteps"] == 0
    # Valid tokens: every node counted every step, also past the report's kept records.
    tokens = totals["validTokens"]
    assert results["tokens_max"] == results["tokens_min"] == pytest.approx(tokens, rel=1e-12)
    # Energy: per phase (idle windows under "idle"), and the job's, per valid token.
    by_phase = {dict(k)["phase"]: v for k, v in results["phase_energy"].items()}
    assert set(by_phase) == {*fullstack.PHASES, "idle"}, by_phase
    per_token = {dict(k)["phase"]: v for k, v in results["per_token"].items()}
    for ph in fullstack.PHASES:
        assert by_phase[ph] == pytest.approx(phases[ph]["measuredJoules"], rel=REL_TOLERANCE)
        assert per_token[ph] == pytest.approx(
            phases[ph]["measuredJoules"] / tokens, rel=REL_TOLERANCE
        )
    assert results["job_energy"] == pytest.approx(totals["measuredJoules"], rel=REL_TOLERANCE)
    assert results["job_per_token"] == pytest.approx(
        totals["measuredJoules"] / tokens, rel=REL_TOLERANCE
    )
    # Saving ratio, through the dashboard's expressions.
    saving = {dict(k)["phase"]: v for k, v in results["saving"].items()}
    want = {
        ph: p["saving"]["percent"] for ph, p in phases.items() if "percent" in p.get("saving", {})
    }
    assert "generation" in want, phases  # generation locked below max with a saving
    assert saving == pytest.approx(want, abs=1e-9)
    assert results["job_saving"] == pytest.approx(
        {(("policy", name),): totals["savingPercent"]}, abs=1e-9
    )
    # The trainer's namespace survives the Prometheus Operator's target labels (honorLabels).
    assert set(results["namespaces"]) == {(("namespace", namespace),)}, results["namespaces"]
    # Every dashboard panel answers; energy per token and power come one series per phase.
    panels = results["board"]
    phase_sets = {
        k: {dict(labels).get("phase") for labels in panels[k]} for k in ((1, "A"), (5, "A"))
    }
    assert phase_sets == {k: {*fullstack.PHASES, "idle"} for k in phase_sets}, panels
    for labels, value in panels[(1, "A")].items():
        assert dict(labels)["policy"] == name and 0 < value < float("inf"), (labels, value)
    # the clock panel is instantaneous: after the run every GPU is idle at its read-back clock
    clock_panel = {(dict(k)["phase"], dict(k)["kind"]) for k in panels[(3, "A")]}
    assert clock_panel and all(kind in ("requested", "effective") for _, kind in clock_panel)
    print(
        f"prometheus e2e: {STEPS} steps, {totals['measuredJoules'] / tokens:.6g} J per valid "
        f"token, saving {totals['savingPercent']:.3f} %, took {time.monotonic() - t0:.1f} s"
    )
