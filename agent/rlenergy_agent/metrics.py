"""Prometheus metrics, collected at scrape time from the agent's snapshot (kepler pattern).

The only module importing ``prometheus_client``. Names use base units: ``_joules_total``,
``_seconds_total``, ``_hertz``. Labels: ``gpu_uuid`` (never an index), ``pod``, ``namespace``,
``phase``. ``rlenergy_agent_gpu_phase_info`` exports the declared phase per GPU so idle-GPU
watchdogs can exempt intentional waits (case #27); rejected and missing energy samples are
counted (cases #10, #14); ``rlenergy_agent_nvml_up`` falls to 0 when every GPU fails (case #11).
Idle windows (between phases of a step) count under ``phase="idle"``, so the phase energies sum
to the step energy the policy status accounts. The saving ratios are the operator's (the policy
status, read with the plan): an agent cannot predict the default governor's energy.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rlenergy_agent import service
from rlenergy_agent.nvml import lib

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _pod_labels(pod: service.PodRef | None) -> tuple[str, str]:
    return (pod.name, pod.namespace) if pod is not None else ("", "")


class AgentCollector(Collector):
    """Reads an ``Agent`` at scrape time.

    Args:
        agent: the agent.
        health: callable returning whether NVML answers (``nvml_up``).
    """

    def __init__(self, agent: service.Agent, health: object = None) -> None:
        self.agent = agent
        self.health = health

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Yield every metric family from one consistent snapshot."""
        a = self.agent
        labels = ["gpu_uuid", "pod", "namespace", "phase"]
        energy = CounterMetricFamily(
            "rlenergy_agent_gpu_phase_energy_joules",
            "GPU energy per phase from counter deltas at phase boundaries, J.",
            labels=labels,
        )
        seconds = CounterMetricFamily(
            "rlenergy_agent_gpu_phase_seconds",
            "Time per phase, s.",
            labels=labels,
        )
        total = CounterMetricFamily(
            "rlenergy_agent_gpu_energy_joules",
            "GPU energy since the totals began (unknown GPUs are absent, never 0), J.",
            labels=["gpu_uuid", "energy_source"],
        )
        clock = GaugeMetricFamily(
            "rlenergy_agent_gpu_sm_clock_hertz",
            "SM clock requested by the plan and read back, Hz.",
            labels=["gpu_uuid", "kind"],
        )
        info = GaugeMetricFamily(
            "rlenergy_agent_gpu_phase_info",
            "Declared phase per GPU (1); lets idle-GPU watchdogs exempt intentional waits.",
            labels=labels,
        )
        condition = GaugeMetricFamily(
            "rlenergy_agent_gpu_condition",
            "GPU condition (1 for the current one): ok, measureOnly, degraded, lost.",
            labels=["gpu_uuid", "condition", "reason"],
        )
        rejected = CounterMetricFamily(
            "rlenergy_agent_energy_samples_rejected",
            "Energy samples rejected as implausible (counter jumps), count.",
            labels=["gpu_uuid"],
        )
        missing = CounterMetricFamily(
            "rlenergy_agent_energy_samples_missing",
            "Energy samples that failed (counted as missing coverage), count.",
            labels=["gpu_uuid"],
        )
        tokens = CounterMetricFamily(
            "rlenergy_agent_valid_tokens",
            "Valid tokens of the steps ended here (each node reports its job's tokens), count.",
        )
        saving = GaugeMetricFamily(
            "rlenergy_agent_saving_ratio",
            "Saving vs the predicted default governor per phase, from the policy status (the "
            "operator's figure; absent until computable), ratio.",
            labels=["phase"],
        )
        job_saving = GaugeMetricFamily(
            "rlenergy_agent_job_saving_ratio",
            "The job's saving vs the predicted default governor, from the policy status, ratio.",
        )
        with a._lock:  # noqa: SLF001 - one consistent snapshot
            for (u, phase), j in a.phase_energy_j.items():
                name, ns = _pod_labels(a.pod_of.get(u))
                energy.add_metric([u, name, ns, phase], j)
            for (u, phase), s in a.phase_seconds.items():
                name, ns = _pod_labels(a.pod_of.get(u))
                seconds.add_metric([u, name, ns, phase], s)
            for u, st in a.meter.state.items():
                known = a.meter.total_j(u)
                if known is not None:
                    total.add_metric([u, st.source], known)
                rejected.add_metric([u], st.rejected)
                missing.add_metric([u], st.missing)
            for u, ctl in a.actuator.controls.items():
                if ctl.requested_mhz is not None:
                    clock.add_metric([u, "requested"], ctl.requested_mhz * 1e6)
                if ctl.effective_mhz is not None:
                    clock.add_metric([u, "effective"], ctl.effective_mhz * 1e6)
                name, ns = _pod_labels(a.pod_of.get(u))
                info.add_metric([u, name, ns, a.phase_of.get(u, "idle")], 1.0)
                condition.add_metric([u, ctl.condition, ctl.reason], 1.0)
            tokens.add_metric([], a.valid_tokens_total)
            for phase, ratio in sorted(a.saving_ratio.items()):
                if phase:
                    saving.add_metric([phase], ratio)
                else:
                    job_saving.add_metric([], ratio)
            latencies = list(a.latencies_s)
        yield from (energy, seconds, total, clock, info, condition, rejected, missing, tokens)
        yield from (saving, job_saving)
        lat = GaugeMetricFamily(
            "rlenergy_agent_phase_signal_latency_seconds",
            "Phase signal received to clocks applied, s (recent signals).",
            labels=["quantile"],
        )
        if len(latencies) >= 2:
            q = statistics.quantiles(latencies, n=100, method="inclusive")
            lat.add_metric(["0.5"], q[49])
            lat.add_metric(["0.99"], q[98])
        yield lat
        calls = CounterMetricFamily(
            "rlenergy_agent_nvml_calls", "NVML calls per entry point, count.", labels=["function"]
        )
        slowest = GaugeMetricFamily(
            "rlenergy_agent_nvml_call_max_seconds",
            "Slowest NVML call per entry point, s (slow: persistence mode off, case #5).",
            labels=["function"],
        )
        for fn, stat in sorted(lib.CALL_STATS.items()):
            calls.add_metric([fn], stat.calls)
            slowest.add_metric([fn], stat.max_s)
        yield calls
        yield slowest
        up = GaugeMetricFamily("rlenergy_agent_nvml_up", "1 when NVML answers on some GPU.")
        up.add_metric([], 1.0 if not callable(self.health) or self.health() else 0.0)
        yield up
        if a.discovery is not None:  # no policy configured: the DaemonSet's discovery
            reason, policy = a.discovery
            found = GaugeMetricFamily(
                "rlenergy_agent_policy_discovery",
                "Policy discovery's outcome (1): reason Matched (policy = ns/name), NoGpuPods, "
                "NoMatch or Conflict (two policies select this node's GPU pods; none governs).",
                labels=["reason", "policy"],
            )
            found.add_metric([reason, policy], 1.0)
            yield found
        yield from self._released()

    def _released(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Released rollout workers (FlexFloor park): GPU time, parked state and clock."""
        a = self.agent
        released = CounterMetricFamily(
            "rlenergy_agent_released_gpu_seconds",
            "GPU time parked as a released rollout worker, ongoing park included, s.",
            labels=["gpu_uuid"],
        )
        parked = GaugeMetricFamily(
            "rlenergy_agent_gpu_parked",
            "1 while the GPU is parked as a released rollout worker, else 0.",
            labels=["gpu_uuid", "pod", "namespace"],
        )
        parked_clock = GaugeMetricFamily(
            "rlenergy_agent_gpu_parked_clock_hertz",
            "SM clock the park locked (the lowest supported), Hz; absent when not parked.",
            labels=["gpu_uuid"],
        )
        with a._lock:  # noqa: SLF001 - one consistent snapshot
            for u in a.actuator.controls:
                released.add_metric([u], a.released_gpu_seconds(u))
                p = a.parked.get(u)
                name, ns = _pod_labels(p.pod if p is not None else a.pod_of.get(u))
                parked.add_metric([u, name, ns], 1.0 if p is not None else 0.0)
                if p is not None and p.clock_mhz is not None:
                    parked_clock.add_metric([u], p.clock_mhz * 1e6)
        yield from (released, parked, parked_clock)


def render(agent: service.Agent, health: object = None) -> bytes:
    """The text exposition of the agent's metrics (fresh registry, scrape-time collection)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent, health))
    return generate_latest(registry)
