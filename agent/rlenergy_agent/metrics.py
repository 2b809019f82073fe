"""Prometheus metrics, collected at scrape time from the agent's snapshot (kepler pattern).

The only module importing ``prometheus_client``. Names use base units: ``_joules_total``,
``_seconds_total``, ``_hertz``. Labels: ``gpu_uuid`` (never an index), ``node``
(every family: joins and alerts need no relabelling), ``policy`` (the policy's name, on job
figures), ``pod``, ``namespace`` (the trainer pod holding the GPU, not the agent's: the chart's
ServiceMonitor/PodMonitor set ``honorLabels: true`` so the Prometheus Operator's target labels
of the same names do not rename them to ``exported_pod``/``exported_namespace``), ``phase``.
``rlenergy_agent_gpu_phase_info`` exports the declared phase per GPU so idle-GPU watchdogs can
exempt intentional waits; rejected and missing energy samples are
counted; ``rlenergy_agent_nvml_up`` falls to 0 when every GPU fails.
Idle windows (between phases of a step) count under ``phase="idle"``, so the phase energies sum
to the step energy the policy status accounts. The saving ratios are the operator's (the policy
status, read with the plan): an agent cannot predict the default governor's energy. The
signal latency is a histogram (``_bucket``/``_sum``/``_count``: quantiles aggregate in
Prometheus). ``promtool check metrics`` passes on the exposition (tests/e2e/test_promtool.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from rlenergy_agent import pods, service
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

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family from one consistent snapshot."""
        # Built from the snapshot, outside the agent's lock: a scrape never holds a signal up.
        snap = _snapshot(self.agent)
        yield from self._phase_families(snap)
        yield from self._gpu_families(snap)
        yield from self._job_families(snap)
        yield from self._rest()

    def _phase_families(self, snap: _Snapshot) -> Iterator[Metric]:
        """Energy and time per GPU and phase."""
        node, policy = self.agent.node_name, snap.policy
        labels = ["gpu_uuid", "node", "policy", "pod", "namespace", "phase"]
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
        for (u, phase), j in snap.phase_energy_j:
            name, ns = _pod_labels(snap.pod_of.get(u))
            energy.add_metric([u, node, policy, name, ns, phase], j)
        for (u, phase), s in snap.phase_seconds:
            name, ns = _pod_labels(snap.pod_of.get(u))
            seconds.add_metric([u, node, policy, name, ns, phase], s)
        yield from (energy, seconds)

    def _gpu_families(self, snap: _Snapshot) -> Iterator[Metric]:
        """The per-GPU families: NVML-side state, read without the agent's lock."""
        a = self.agent
        node, policy = a.node_name, snap.policy
        labels = ["gpu_uuid", "node", "policy", "pod", "namespace", "phase"]
        total = CounterMetricFamily(
            "rlenergy_agent_gpu_energy_joules",
            "GPU energy since the totals began (unknown GPUs are absent, never 0), J.",
            labels=["gpu_uuid", "node", "energy_source"],
        )
        clock = GaugeMetricFamily(
            "rlenergy_agent_gpu_sm_clock_hertz",
            "SM clock requested by the plan and read back, Hz.",
            labels=["gpu_uuid", "node", "kind"],
        )
        locked = GaugeMetricFamily(
            "rlenergy_agent_gpu_clock_locked",
            "1 while the agent holds an SM clock lock on the GPU (a plan clock or a park), else 0.",
            labels=["gpu_uuid", "node"],
        )
        cap_state = GaugeMetricFamily(
            "rlenergy_agent_gpu_clock_state",
            "The lock against the clock the GPU runs (1 for the current state): unlocked, "
            "settling, asRequested, capped (limit = the clock-event reasons), unexplained "
            "(below the lock with no reason), idle.",
            labels=["gpu_uuid", "node", "state", "limit"],
        )
        unexplained = CounterMetricFamily(
            "rlenergy_agent_gpu_clock_shortfalls_unexplained",
            "Re-reads of a locked GPU that found it below the lock with no clock-event reason.",
            labels=["gpu_uuid", "node"],
        )
        xratio = GaugeMetricFamily(
            "rlenergy_agent_energy_crosscheck_ratio",
            "Energy counter over integrated instant power in the last cross-check (30 s every "
            "5 min; counter-metered GPUs), ratio.",
            labels=["gpu_uuid", "node"],
        )
        xmismatch = CounterMetricFamily(
            "rlenergy_agent_energy_crosscheck_mismatches",
            "Cross-checks where counter and integrated power disagreed by more than 15 %.",
            labels=["gpu_uuid", "node"],
        )
        stalled = GaugeMetricFamily(
            "rlenergy_agent_rollout_stalled",
            "1 while the pod's phase on the GPU is stalled: progress frozen with requests in "
            "flight at power below the SKU's stall band (clocks held, time kept out of savings).",
            labels=labels,
        )
        assigned = GaugeMetricFamily(
            "rlenergy_agent_gpu_assigned",
            "1 while a pod holds the GPU (kubelet pod-resources), else 0.",
            labels=["gpu_uuid", "node"],
        )
        info = GaugeMetricFamily(
            "rlenergy_agent_gpu_phase_info",
            "Declared phase per GPU (1); lets idle-GPU watchdogs exempt intentional waits.",
            labels=labels,
        )
        condition = GaugeMetricFamily(
            "rlenergy_agent_gpu_condition",
            "GPU condition (1 for the current one): ok, measureOnly, degraded, lost.",
            labels=["gpu_uuid", "node", "condition", "reason"],
        )
        rejected = CounterMetricFamily(
            "rlenergy_agent_energy_samples_rejected",
            "Energy samples rejected as implausible (counter jumps), count.",
            labels=["gpu_uuid", "node"],
        )
        missing = CounterMetricFamily(
            "rlenergy_agent_energy_samples_missing",
            "Energy samples that failed (counted as missing coverage), count.",
            labels=["gpu_uuid", "node"],
        )
        for u, st in a.meter.state.items():
            known = a.meter.total_j(u)
            if known is not None:
                total.add_metric([u, node, st.source], known)
            rejected.add_metric([u, node], st.rejected)
            missing.add_metric([u, node], st.missing)
        for u, ctl in a.actuator.controls.items():
            if ctl.requested_mhz is not None:
                clock.add_metric([u, node, "requested"], ctl.requested_mhz * 1e6)
            if ctl.effective_mhz is not None:
                clock.add_metric([u, node, "effective"], ctl.effective_mhz * 1e6)
            locked.add_metric([u, node], 0.0 if ctl.applied_mhz is None else 1.0)
            cap = a.actuator.caps.get(u)
            cap_state.add_metric([u, node, cap.state, cap.limit], 1.0)
            unexplained.add_metric([u, node], cap.shortfalls)
            chk = a.crosscheck.gpus.get(u)
            if chk is not None:
                xmismatch.add_metric([u, node], chk.mismatches)
                if chk.last is not None:
                    xratio.add_metric([u, node], chk.last.ratio)
            pod = snap.pod_of.get(u)
            assigned.add_metric([u, node], 0.0 if pod is None else 1.0)
            name, ns = _pod_labels(pod)
            info.add_metric([u, node, policy, name, ns, snap.phase_of.get(u, "idle")], 1.0)
            stalled.add_metric(
                [u, node, policy, name, ns, snap.phase_of.get(u, "idle")],
                0.0 if u not in snap.stalled else 1.0,
            )
            condition.add_metric([u, node, ctl.condition, ctl.reason], 1.0)
        yield from (total, clock, locked, cap_state, unexplained, assigned)
        yield from (info, condition, xratio, xmismatch, stalled, rejected, missing)

    def _job_families(self, snap: _Snapshot) -> Iterator[Metric]:
        """The node's job-level families: tokens, stalls, leases, savings, signal latency."""
        a = self.agent
        node, policy = a.node_name, snap.policy
        stalled_s = CounterMetricFamily(
            "rlenergy_agent_stalled_seconds",
            "Stalled time of closed phase windows, s (excluded from savings and trials).",
            labels=["node", "policy"],
        )
        leases = CounterMetricFamily(
            "rlenergy_agent_leases_expired",
            "Phases whose trainer went silent past the lease; their GPUs went back to the "
            "default governor (node report: expiredLeases).",
            labels=["node", "policy"],
        )
        sleeps = CounterMetricFamily(
            "rlenergy_agent_sleep_checks",
            "Engine sleeps checked against the GPUs' memory and power, by result: Verified "
            "(saving claimed), Mismatch (signalled, memory or power did not drop), Unknown "
            "(node report: sleepChecks).",
            labels=["node", "policy", "result"],
        )
        tokens = CounterMetricFamily(
            "rlenergy_agent_valid_tokens",
            "Valid tokens of the steps ended here (each node reports its job's tokens), count.",
            labels=["node", "policy"],
        )
        saving = GaugeMetricFamily(
            "rlenergy_agent_saving_ratio",
            "Saving vs the predicted default governor per phase, from the policy status (the "
            "operator's figure; absent until computable), ratio.",
            labels=["node", "policy", "phase"],
        )
        job_saving = GaugeMetricFamily(
            "rlenergy_agent_job_saving_ratio",
            "The job's saving vs the predicted default governor, from the policy status, ratio.",
            labels=["node", "policy"],
        )
        lat = HistogramMetricFamily(
            "rlenergy_agent_phase_signal_latency_seconds",
            "Phase signal received to clocks applied, s.",
            labels=["node"],
        )
        plan_step = GaugeMetricFamily(
            "rlenergy_agent_plan_step",
            "First RL step of the plan the agent holds (absent: no plan).",
            labels=["node", "policy"],
        )
        if snap.plan_step is not None:
            plan_step.add_metric([node, policy], snap.plan_step)
        tokens.add_metric([node, policy], snap.valid_tokens_total)
        stalled_s.add_metric([node, policy], snap.stalled_s_total)
        leases.add_metric([node, policy], snap.leases_expired_total)
        for result, n in sorted(snap.sleep_results.items()):
            sleeps.add_metric([node, policy, result], n)
        for phase, ratio in sorted(snap.saving_ratio.items()):
            if phase:
                saving.add_metric([node, policy, phase], ratio)
            else:
                job_saving.add_metric([node, policy], ratio)
        hist = a.latency_hist
        lat.add_metric([node], hist.buckets(), sum_value=hist.sum)
        yield from (stalled_s, leases, sleeps, tokens, saving, job_saving, lat, plan_step)

    def _rest(self) -> Iterator[Metric]:
        """NVML calls and health, discovery, releases, the pod map and the GPU lifecycle."""
        a = self.agent
        node = a.node_name
        calls = CounterMetricFamily(
            "rlenergy_agent_nvml_calls",
            "NVML calls per entry point, count.",
            labels=["node", "function"],
        )
        slowest = GaugeMetricFamily(
            "rlenergy_agent_nvml_call_max_seconds",
            "Slowest NVML call per entry point, s (slow: persistence mode off).",
            labels=["node", "function"],
        )
        for fn, stat in sorted(lib.CALL_STATS.items()):
            calls.add_metric([node, fn], stat.calls)
            slowest.add_metric([node, fn], stat.max_s)
        yield calls
        yield slowest
        up = GaugeMetricFamily(
            "rlenergy_agent_nvml_up", "1 when NVML answers on some GPU.", labels=["node"]
        )
        up.add_metric([node], 1.0 if not callable(self.health) or self.health() else 0.0)
        yield up
        if a.discovery is not None:  # no policy configured: the DaemonSet's discovery
            reason, found_policy = a.discovery
            found = GaugeMetricFamily(
                "rlenergy_agent_policy_discovery",
                "Policy discovery's outcome (1): reason Matched (policy = ns/name), NoGpuPods, "
                "NoMatch or Conflict (two policies select this node's GPU pods; none governs).",
                labels=["node", "reason", "policy"],
            )
            found.add_metric([node, reason, found_policy], 1.0)
            yield found
        yield from self._lifecycle()
        yield from self._podresources()
        yield from self._released()

    def _lifecycle(self) -> Iterator[Metric]:
        """GPU resets, lost GPUs and driver changes: events, and which GPUs are unsettled."""
        a = self.agent
        node = a.node_name
        events = CounterMetricFamily(
            "rlenergy_agent_gpu_lifecycle_events",
            "Events that made a GPU's state unknown: GpuLost (lost or an invalid handle), "
            "LockLost (off its lock with no clock-event reason: a GPU reset), DriverChanged.",
            labels=["gpu_uuid", "node", "reason"],
        )
        settled = GaugeMetricFamily(
            "rlenergy_agent_gpu_settled",
            "0 from a lifecycle event until a pass finds the GPU answering with its lock, "
            "else 1 (windows on an unsettled GPU are kept out of savings).",
            labels=["gpu_uuid", "node"],
        )
        with a._lock:  # noqa: SLF001 - one consistent snapshot
            act = a.actuator
            for (u, reason), n in sorted(act.life_events.items()):
                events.add_metric([u, node, reason], n)
            for u in act.controls:
                settled.add_metric([u, node], 0.0 if u in act.unsettled else 1.0)
            reinits = getattr(act.library, "reinits", None)
        yield from (events, settled)
        if reinits is not None:
            count = CounterMetricFamily(
                "rlenergy_agent_nvml_reinits",
                "NVML re-initialisations (after a lost GPU or a changed driver version).",
                labels=["node"],
            )
            count.add_metric([node], reinits)
            yield count

    def _podresources(self) -> Iterator[Metric]:
        """The kubelet PodResources listing: its state, age and failed calls by code."""
        a = self.agent
        podmap = a.podmap
        if not isinstance(podmap, pods.ListedPodMap):
            return
        node = a.node_name
        st = podmap.state()
        state = GaugeMetricFamily(
            "rlenergy_agent_podresources_listing_state",
            "The kubelet PodResources listing (1 for the current state): Fresh (attributes "
            "GPUs), Stale (locks held, nothing new attributed), Expired (locks reset), Waiting "
            "(never listed); error = the newest failed call's code.",
            labels=["node", "state", "error"],
        )
        state.add_metric([node, st.status, st.error], 1.0)
        age = GaugeMetricFamily(
            "rlenergy_agent_podresources_listing_age_seconds",
            "Time since the last successful PodResources List, s (absent: never listed).",
            labels=["node"],
        )
        if st.age_s is not None:
            age.add_metric([node], st.age_s)
        failed = CounterMetricFamily(
            "rlenergy_agent_podresources_errors",
            "Failed PodResources List calls by gRPC code (RESOURCE_EXHAUSTED: a reply over the "
            "receive limit; UNAVAILABLE: the kubelet does not answer; SocketMissing: no socket).",
            labels=["node", "code"],
        )
        for code, n in sorted(dict(getattr(podmap, "errors", {})).items()):
            failed.add_metric([node, code], n)
        yield from (state, age, failed)

    def _released(self) -> Iterator[Metric]:
        """Released rollout workers (FlexFloor park): GPU time, parked state and clock."""
        a = self.agent
        node = a.node_name
        released = CounterMetricFamily(
            "rlenergy_agent_released_gpu_seconds",
            "GPU time parked as a released rollout worker, ongoing park included, s.",
            labels=["gpu_uuid", "node"],
        )
        parked = GaugeMetricFamily(
            "rlenergy_agent_gpu_parked",
            "1 while the GPU is parked as a released rollout worker, else 0.",
            labels=["gpu_uuid", "node", "pod", "namespace"],
        )
        parked_clock = GaugeMetricFamily(
            "rlenergy_agent_gpu_parked_clock_hertz",
            "SM clock the park locked (the lowest supported), Hz; absent when not parked.",
            labels=["gpu_uuid", "node"],
        )
        with a._lock:  # noqa: SLF001 - a short copy; the families are built after
            gpus = list(a.actuator.controls)
            seconds = {u: a.released_gpu_seconds(u) for u in gpus}
            parks = dict(a.parked)
            pod_of = dict(a.pod_of)
        for u in gpus:
            released.add_metric([u, node], seconds[u])
            p = parks.get(u)
            name, ns = _pod_labels(p.pod if p is not None else pod_of.get(u))
            parked.add_metric([u, node, name, ns], 1.0 if p is not None else 0.0)
            if p is not None and p.clock_mhz is not None:
                parked_clock.add_metric([u, node], p.clock_mhz * 1e6)
        yield from (released, parked, parked_clock)


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """The agent fields a scrape reads, copied under the agent's lock in one short hold."""

    policy: str
    plan_step: int | None
    phase_energy_j: list[tuple[tuple[str, str], float]]
    phase_seconds: list[tuple[tuple[str, str], float]]
    pod_of: dict[str, service.PodRef | None]
    phase_of: dict[str, str]
    stalled: frozenset[str]
    valid_tokens_total: float
    stalled_s_total: float
    leases_expired_total: int
    sleep_results: dict[str, int]
    saving_ratio: dict[str, float]


def _snapshot(a: service.Agent) -> _Snapshot:
    """Copy what a scrape needs (a few dict copies: microseconds, whatever the series count)."""
    with a._lock:  # noqa: SLF001 - one consistent snapshot, held only for the copy
        return _Snapshot(
            policy=a.policy_name,
            plan_step=a.plan.step if a.plan is not None else None,
            phase_energy_j=list(a.phase_energy_j.items()),
            phase_seconds=list(a.phase_seconds.items()),
            pod_of=dict(a.pod_of),
            phase_of=dict(a.phase_of),
            stalled=frozenset(u for u in a.pod_of if a.stalled_since_s(u) is not None),
            valid_tokens_total=a.valid_tokens_total,
            stalled_s_total=a.stalled_s_total,
            leases_expired_total=a.leases_expired_total,
            sleep_results=dict(a.sleep_results),
            saving_ratio=dict(a.saving_ratio),
        )


def render(agent: service.Agent, health: object = None) -> bytes:
    """The text exposition of the agent's metrics (fresh registry, scrape-time collection)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent, health))
    return generate_latest(registry)
