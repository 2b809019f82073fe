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
* the saving ratio, through the Grafana dashboard's own expressions (``100 * avg by (phase)
  (rlenergy_agent_saving_ratio)``, ``100 * avg(rlenergy_agent_job_saving_ratio)``), against
  ``phases[].saving.percent`` and ``totals.savingPercent``: the agents republish the operator's
  figure (an agent cannot predict the default governor's energy), so this checks the path from
  the status through every agent, the scrape and the query, not the saving's computation.

The comparison uses a status that did not change while Prometheus scraped every agent after it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import wait_until
from prometheus_support import PrometheusServer
from rlenergy_agent import service
from rlenergy_agent.testing import fullstack, standin

from rlenergy.devcluster import DevCluster

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
STEPS = service.MAX_STEPS_KEPT + 4
"""More steps than an agent's report keeps: counters must not follow the trimmed records."""
REL_TOLERANCE = 1e-9


def _policy() -> dict[str, Any]:
    body = yaml.safe_load((CRDS / "samples" / "sync-job.yaml").read_text())
    body["spec"]["controller"] = {"warmupSteps": 4, "trialSteps": 4}
    return dict(body)


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
    policy = _policy()
    name = policy["metadata"]["name"]
    stack = fullstack.FullStack(
        dev_cluster.kubeconfig, namespace, name, dev_cluster.nodes, tmp_path / "stack", lib_dir
    )
    with stack:
        stack.start_operator()
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
        stack.start_agents()
        targets = [f"127.0.0.1:{a.metrics_port}" for a in stack.agents]
        with PrometheusServer(targets, tmp_path / "prometheus") as prom:
            assert prom.value("count(up == 1)") == len(stack.agents)
            job, _factor = fullstack.compressed_replay(
                fullstack.DEFAULT_TRACE, stack.sku, STEPS, num_gpus=24,
                longest_phase_s=fullstack.LONGEST_PHASE_S,
            )  # fmt: skip
            stack.run_trainer(job)
            wait_until(lambda: _settled(stack), timeout=60, what="every step accounted")

            # A status that stays the same while Prometheus scrapes every agent after it.
            deadline = time.monotonic() + 90
            while True:
                before = _settled(stack)
                assert before is not None
                since = time.time() + 0.5  # the agents poll the policy every 0.1 s
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
                    "saving": prom.query("100 * avg by (phase) (rlenergy_agent_saving_ratio)"),
                    "job_saving": prom.query("100 * avg(rlenergy_agent_job_saving_ratio)"),
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
    assert results["job_saving"] == pytest.approx({(): totals["savingPercent"]}, abs=1e-9)
    print(
        f"prometheus e2e: {STEPS} steps, {totals['measuredJoules'] / tokens:.6g} J per valid "
        f"token, saving {totals['savingPercent']:.3f} %, took {time.monotonic() - t0:.1f} s"
    )
