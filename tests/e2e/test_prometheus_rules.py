"""The chart's PrometheusRule: ``promtool check rules`` and ``promtool test rules`` per alert.

The rules are rendered by the real helm (``metrics.prometheusRule.enabled=true``) and the
PrometheusRule's ``spec`` is what Prometheus loads; ``promtool test rules`` replays synthetic
series through every alert: it fires after its ``for`` with the labels and annotations we
expect, and stays silent on the healthy twin of each fault. Part of ``make test-field``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import chart_support
import pytest
import yaml

pytestmark = pytest.mark.field


def _rules(*args: str) -> dict[str, Any]:
    (doc,) = chart_support.template(
        "--set", "metrics.prometheusRule.enabled=true",
        "--show-only", "templates/prometheusrule.yaml", *args,
    )  # fmt: skip
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    return dict(doc)


def _alerts(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in spec["groups"] for r in g["rules"] if "alert" in r}


def _expected(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """The alert promtool should report: the rule's labels on top, annotations templated.

    Empty label values do not exist in Prometheus: they are dropped from the expected labels.
    """

    def fill(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m[1], ""), text)

    present = {k: v for k, v in labels.items() if v}
    return {
        "exp_labels": {**present, **rule.get("labels", {})},
        "exp_annotations": {k: fill(v) for k, v in rule["annotations"].items()},
    }


def test_rendered_rules_pass_promtool_check_and_take_extra_labels(tmp_path: Path):
    doc = _rules("--set", "metrics.prometheusRule.labels.release=kps")
    assert doc["metadata"]["labels"]["release"] == "kps"
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(doc["spec"]))
    res = chart_support.run("promtool", "check", "rules", str(rules))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(_alerts(doc['spec']))} rules found" in res.stdout
    # off by default: the PrometheusRule kind exists only with the Prometheus operator
    assert "PrometheusRule" not in {d["kind"] for d in chart_support.template()}


def test_every_alert_fires_on_its_fault_and_not_on_the_healthy_twin(tmp_path: Path):
    spec = _rules()["spec"]
    alerts = _alerts(spec)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    bad = {"node": "gpu-a", "gpu_uuid": "GPU-bad"}
    good = {"node": "gpu-a", "gpu_uuid": "GPU-good"}

    def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
        body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return {"series": f"{name}{{{body}}}", "values": values}

    clock = "rlenergy_agent_gpu_sm_clock_hertz"
    cases: dict[str, tuple[list[dict[str, str]], dict[str, str], str]] = {
        # name: (input series over 30 min at 1 min, labels of the alert, minutes before it fires)
        "RLEnergyGPULeftLocked": (
            [
                series("rlenergy_agent_gpu_clock_locked", bad, "1x30"),
                series("rlenergy_agent_gpu_assigned", bad, "0x30"),
                series("rlenergy_agent_gpu_clock_locked", good, "1x30"),
                series("rlenergy_agent_gpu_assigned", good, "1x30"),
            ],
            bad,
            "10m",
        ),
        "RLEnergyLockShortfall": (
            [
                series(clock, {**bad, "kind": "requested"}, "1.4e9x30"),
                series(clock, {**bad, "kind": "effective"}, "1.2e9x30"),
                series(clock, {**good, "kind": "requested"}, "1.4e9x30"),
                series(clock, {**good, "kind": "effective"}, "1.395e9x30"),  # snapped, < 5 %
            ],
            bad,
            "15m",
        ),
        "RLEnergyLockShortfallUnexplained": (
            [
                series(
                    "rlenergy_agent_gpu_clock_state",
                    {**bad, "state": "unexplained", "limit": ""},
                    "1x30",
                ),
                series(
                    "rlenergy_agent_gpu_clock_state",
                    {**good, "state": "capped", "limit": "SwPowerCap"},
                    "1x30",
                ),
            ],
            bad,
            "5m",
        ),
        "RLEnergyEnergyCrossCheckMismatch": (
            [  # one mismatch at 5 min on the bad GPU; the good GPU's checks all agree
                series("rlenergy_agent_energy_crosscheck_mismatches_total", bad, "0x4 1x25"),
                series("rlenergy_agent_energy_crosscheck_mismatches_total", good, "0x30"),
            ],
            bad,
            "5m",
        ),
        "RLEnergyRolloutStalled": (
            [
                series(
                    "rlenergy_agent_rollout_stalled",
                    {**bad, "namespace": "a", "pod": "rollout-0", "phase": "generation"},
                    "1x30",
                ),
                series(
                    "rlenergy_agent_rollout_stalled",
                    {**good, "namespace": "a", "pod": "rollout-1", "phase": "generation"},
                    "0x30",
                ),
            ],
            {"node": "gpu-a", "namespace": "a", "pod": "rollout-0", "phase": "generation"},
            "5m",
        ),
        "RLEnergyNVMLDown": (
            [
                series("rlenergy_agent_nvml_up", {"node": "gpu-a"}, "0x30"),
                series("rlenergy_agent_nvml_up", {"node": "gpu-b"}, "1x30"),
            ],
            {"node": "gpu-a"},
            "5m",
        ),
        "RLEnergyEnergySamplesMissing": (
            [  # one sample per second fails (of ten); the good GPU loses none
                series("rlenergy_agent_energy_samples_missing_total", bad, "0+60x30"),
                series("rlenergy_agent_energy_samples_missing_total", good, "0x30"),
            ],
            bad,
            "11m",  # above 0.1/s once the 10 m range holds more than 1 min of failures, +10 m for
        ),
        "RLEnergyPolicyConflict": (
            [
                series(
                    "rlenergy_agent_policy_discovery",
                    {"node": "gpu-a", "reason": "Conflict", "policy": ""},
                    "1x30",
                ),
                series(
                    "rlenergy_agent_policy_discovery",
                    {"node": "gpu-b", "reason": "Matched", "policy": "team-a/pol"},
                    "1x30",
                ),
            ],
            {"node": "gpu-a", "policy": ""},
            "10m",
        ),
        "RLEnergyAgentsMissing": (
            [
                series(
                    "rlenergy_operator_gpu_nodes_without_agent", {"cause": "unlabelled"}, "1x30"
                ),
                series("rlenergy_operator_gpu_nodes_without_agent", {"cause": "blocked"}, "0x30"),
                series("rlenergy_operator_agents", {"state": "desired"}, "8x30"),
                series("rlenergy_operator_agents", {"state": "ready"}, "8x30"),
            ],
            {"cause": "unlabelled"},
            "10m",
        ),
        "RLEnergyStatusStale": (
            [  # the pass stamp stops at t = 0 s; the healthy policy's advances every minute
                series(
                    "rlenergy_operator_policy_last_pass_timestamp_seconds",
                    {"namespace": "a", "policy": "stuck"},
                    "0x30",
                ),
                series(
                    "rlenergy_operator_policy_last_pass_timestamp_seconds",
                    {"namespace": "a", "policy": "fine"},
                    "0+60x30",
                ),
            ],
            {"namespace": "a", "policy": "stuck"},
            "7m",  # 120 s stale at 2 m (and not before), then 5 m of for
        ),
        "RLEnergyReconcileErrors": (
            [
                series(
                    "rlenergy_operator_reconcile_errors_total", {"handler": "policy_loop"}, "0+6x30"
                ),
                series(
                    "rlenergy_operator_reconcile_errors_total", {"handler": "policy_delete"}, "0x30"
                ),
            ],
            {"handler": "policy_loop"},
            "16m",  # rate over 10 m divides by the range: above 0.05/s once 5 m of errors
        ),
    }
    assert set(cases) == set(alerts), "every alert of the chart has a case here"
    tests = []
    for name, (inputs, labels, fires) in cases.items():
        minutes = int(fires.rstrip("m"))
        tests.append(
            {
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [
                    {"eval_time": f"{minutes - 2}m", "alertname": name, "exp_alerts": []},
                    {
                        "eval_time": f"{minutes + 1}m",
                        "alertname": name,
                        "exp_alerts": [_expected(alerts[name], labels)],
                    },
                ],
            }
        )
    suite = tmp_path / "rules_test.yaml"
    suite.write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": tests}))
    res = chart_support.run("promtool", "test", "rules", str(suite), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout
