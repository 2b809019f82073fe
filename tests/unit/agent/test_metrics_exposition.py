"""The agent's /metrics exposition against the Prometheus toolchain and its conventions.

``promtool check metrics`` (Debian's prometheus package, fetched by ``make bins``) lints the
exposition of an agent that metered phases, parked a GPU and ran policy discovery: every family
the agent exports appears. The signal latency is a histogram (``promtool`` rejects a gauge with a
``quantile`` label, the agent's earlier export), and every family carries ``node``; job figures
carry ``policy``. Needs the bin dir (marked ``e2e``); part of ``make test-field``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from agent_support import DriverFactory, standin_agent
from prometheus_client.parser import text_string_to_metric_families
from rlenergy_agent import histogram, metrics, service
from rlenergy_dev.devcluster.binaries import default_bin_dir

from rlenergy.api import node as api_node

pytestmark = pytest.mark.field

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
PLAN = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=None, state="locked"),
    ],
)


def find_promtool() -> Path:
    """``$PROMTOOL``, the control-plane bin dir (``make bins``), then ``PATH``."""
    candidates = [Path(p) for p in (os.environ.get("PROMTOOL"), shutil.which("promtool")) if p]
    candidates.insert(0 if not os.environ.get("PROMTOOL") else 1, default_bin_dir() / "promtool")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    pytest.fail(
        f"promtool not found (looked at {', '.join(map(str, candidates))}): run `make bins` "
        "(hack/prometheus-bin.sh extracts it from Debian's prometheus package)",
        pytrace=False,
    )


def _busy_agent(make_driver: DriverFactory) -> tuple[service.Agent, bytes]:
    drv = make_driver(3)
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s, node="gpu-a")
    for step in range(3):
        agent.phase(POD, "generation", step)
        drv.advance(4.0)
        agent.meter.sample()
        agent.phase(POD, "training", step)
        drv.advance(2.0)
        agent.meter.sample()
        agent.phase(POD, "idle", step)
    agent.park(POD, 3, gpu_uuids=[drv.uuids[2]])
    agent.saving_ratio = {"generation": 0.12, "": 0.05}
    agent.discovery = ("Matched", "team-a/pol")
    return agent, metrics.render(agent)


@pytest.mark.e2e
def test_promtool_check_metrics_passes_on_every_family(make_driver: DriverFactory) -> None:
    agent, text = _busy_agent(make_driver)
    res = subprocess.run(
        [str(find_promtool()), "check", "metrics"], input=text, capture_output=True, check=False
    )
    assert res.returncode == 0, (res.stdout + res.stderr).decode()
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for name in (
        "rlenergy_agent_gpu_phase_energy_joules",
        "rlenergy_agent_gpu_clock_locked",
        "rlenergy_agent_gpu_clock_state",
        "rlenergy_agent_gpu_clock_shortfalls_unexplained",
        "rlenergy_agent_gpu_assigned",
        "rlenergy_agent_gpu_parked",
        "rlenergy_agent_policy_discovery",
        "rlenergy_agent_saving_ratio",
        "rlenergy_agent_job_saving_ratio",
    ):
        assert families[name].samples, name
    lat = families["rlenergy_agent_phase_signal_latency_seconds"]
    assert lat.type == "histogram"
    assert agent.latency_hist.count == 9  # 3 steps x (generation, training, idle)


def test_labels_node_policy_and_histogram_samples(make_driver: DriverFactory) -> None:
    agent, text = _busy_agent(make_driver)
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    for f in families.values():
        for s in f.samples:
            assert s.labels.get("node") == "gpu-a", s
    for name in ("rlenergy_agent_gpu_phase_energy_joules", "rlenergy_agent_valid_tokens"):
        assert {s.labels["policy"] for s in families[name].samples} == {"pol"}, name
    energy = families["rlenergy_agent_gpu_phase_energy_joules"].samples
    assert {s.labels["phase"] for s in energy} == {"generation", "training", "idle"}
    assert {(s.labels["pod"], s.labels["namespace"]) for s in energy} == {("trainer-0", "team-a")}
    locked = {
        s.labels["gpu_uuid"]: s.value for s in families["rlenergy_agent_gpu_clock_locked"].samples
    }
    parked = set(agent.parked)
    assert parked and all(locked[u] == 1.0 for u in parked)  # a park locks the lowest clock
    buckets = [
        (s.labels["le"], s.value)
        for s in families["rlenergy_agent_phase_signal_latency_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1] == ("+Inf", 9.0)


def test_histogram_counts_cumulative_and_refuses_bad_bounds() -> None:
    h = histogram.Histogram((0.01, 0.1, 1.0))
    for v in (0.005, 0.01, 0.05, 0.5, 7.0):
        h.observe(v)
    # le is inclusive (Prometheus): 0.01 falls in the 0.01 bucket
    assert h.buckets() == [("0.01", 2), ("0.1", 3), ("1.0", 4), ("+Inf", 5)]
    assert h.count == 5 and h.sum == pytest.approx(7.565)
    for bad in ((), (0.1, 0.1), (1.0, 0.5), (float("inf"),)):
        with pytest.raises(ValueError, match="histogram bounds"):
            histogram.Histogram(bad)
