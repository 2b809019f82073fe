"""Prometheus metrics, collected at scrape time from the agent's snapshot (kepler pattern).

The only module importing ``prometheus_client``. Names use base units: ``_joules_total``,
``_seconds_total``, ``_hertz``. Labels: ``gpu_uuid`` (never an index), ``node``
(every family: joins and alerts need no relabelling), ``policy`` (the policy's name, on job
figures), ``pod``, ``namespace`` (the trainer pod holding the GPU, not the agent's: the chart's
ServiceMonitor/PodMonitor set ``honorLabels: true`` so the Prometheus Operator's target labels
of the same names do not rename them to ``exported_pod``/``exported_namespace``), ``phase``.
``rlenergy_agent_gpu_phase_info`` exports the declared phase per GPU so idle-GPU watchdogs can
exempt intentional waits (case #27); rejected and missing energy samples are
counted (cases #10, #14); ``rlenergy_agent_nvml_up`` falls to 0 when every GPU fails (case #11).
Idle windows (between phases of a step) count under ``phase="idle"``, so the phase energies sum
to the step energy the policy status accounts. The saving ratios are the operator's (the policy
status, read with the plan): an agent cannot predict the default governor's energy. The
signal latency is a histogram (``_bucket``/``_sum``/``_count``: quantiles aggregate in
Prometheus). ``promtool check metrics`` passes on the exposition (tests/e2e/test_promtool.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from rlenergy_agent import pods, service
from rlenergy_agent.nvml import lib

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _pod_labels(pod: service.PodRef | None) -> tuple[str, str]:
    return (pod.name, pod.namespace) if pod is not None else ("", "")


GPU_PHASE_LABELS = ["gpu_uuid", "node", "policy", "pod", "namespace", "phase"]
"""Labels of the per-GPU, per-phase families."""

Family = CounterMetricFamily | GaugeMetricFamily
Samples = Iterator[tuple[list[str], float]]


@dataclasses.dataclass(frozen=True)
class _Scrape:
    """What every family's samples read: the agent (its lock held), its node and policy."""

    agent: service.Agent
    node: str
    policy: str

    def pod_labels(self, uuid: str) -> tuple[str, str]:
        """(pod, namespace) holding the GPU (empty: none)."""
        return _pod_labels(self.agent.pod_of.get(uuid))

    def phase(self, uuid: str) -> str:
        """The GPU's declared phase (``idle``: none)."""
        return self.agent.phase_of.get(uuid, "idle")


def _phase_energy(s: _Scrape) -> Samples:
    for (u, phase), j in s.agent.phase_energy_j.items():
        yield [u, s.node, s.policy, *s.pod_labels(u), phase], j


def _phase_seconds(s: _Scrape) -> Samples:
    for (u, phase), secs in s.agent.phase_seconds.items():
        yield [u, s.node, s.policy, *s.pod_labels(u), phase], secs


def _energy_total(s: _Scrape) -> Samples:
    for u, st in s.agent.meter.state.items():
        known = s.agent.meter.total_j(u)
        if known is not None:
            yield [u, s.node, st.source], known


def _sm_clock(s: _Scrape) -> Samples:
    for u, ctl in s.agent.actuator.controls.items():
        if ctl.requested_mhz is not None:
            yield [u, s.node, "requested"], ctl.requested_mhz * 1e6
        if ctl.effective_mhz is not None:
            yield [u, s.node, "effective"], ctl.effective_mhz * 1e6


def _clock_locked(s: _Scrape) -> Samples:
    for u, ctl in s.agent.actuator.controls.items():
        yield [u, s.node], 0.0 if ctl.applied_mhz is None else 1.0


def _clock_state(s: _Scrape) -> Samples:
    for u in s.agent.actuator.controls:
        cap = s.agent.actuator.caps.get(u)
        yield [u, s.node, cap.state, cap.limit], 1.0


def _shortfalls(s: _Scrape) -> Samples:
    for u in s.agent.actuator.controls:
        yield [u, s.node], s.agent.actuator.caps.get(u).shortfalls


def _crosscheck_ratio(s: _Scrape) -> Samples:
    for u in s.agent.actuator.controls:
        chk = s.agent.crosscheck.gpus.get(u)
        if chk is not None and chk.last is not None:
            yield [u, s.node], chk.last.ratio


def _crosscheck_mismatches(s: _Scrape) -> Samples:
    for u in s.agent.actuator.controls:
        chk = s.agent.crosscheck.gpus.get(u)
        if chk is not None:
            yield [u, s.node], chk.mismatches


def _stalled(s: _Scrape) -> Samples:
    for u in s.agent.actuator.controls:
        labels = [u, s.node, s.policy, *s.pod_labels(u), s.phase(u)]
        yield labels, 0.0 if s.agent.stalled_since_s(u) is None else 1.0


def _stalled_seconds(s: _Scrape) -> Samples:
    yield [s.node, s.policy], s.agent.stalled_s_total


def _leases_expired(s: _Scrape) -> Samples:
    yield [s.node, s.policy], s.agent.leases_expired_total


def _assigned(s: _Scrape) -> Samples:
    for u in s.agent.actuator.controls:
        yield [u, s.node], 0.0 if s.agent.pod_of.get(u) is None else 1.0


def _phase_info(s: _Scrape) -> Samples:
    for u in s.agent.actuator.controls:
        yield [u, s.node, s.policy, *s.pod_labels(u), s.phase(u)], 1.0


def _condition(s: _Scrape) -> Samples:
    for u, ctl in s.agent.actuator.controls.items():
        yield [u, s.node, ctl.condition, ctl.reason], 1.0


def _samples_rejected(s: _Scrape) -> Samples:
    for u, st in s.agent.meter.state.items():
        yield [u, s.node], st.rejected


def _samples_missing(s: _Scrape) -> Samples:
    for u, st in s.agent.meter.state.items():
        yield [u, s.node], st.missing


def _valid_tokens(s: _Scrape) -> Samples:
    yield [s.node, s.policy], s.agent.valid_tokens_total


def _phase_saving(s: _Scrape) -> Samples:
    for phase, ratio in sorted(s.agent.saving_ratio.items()):
        if phase:
            yield [s.node, s.policy, phase], ratio


def _job_saving(s: _Scrape) -> Samples:
    for phase, ratio in sorted(s.agent.saving_ratio.items()):
        if not phase:
            yield [s.node, s.policy], ratio


_SNAPSHOT_FAMILIES: tuple[tuple[Callable[[], Family], Callable[[_Scrape], Samples]], ...] = (
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_gpu_phase_energy_joules",
            "GPU energy per phase from counter deltas at phase boundaries, J.",
            labels=GPU_PHASE_LABELS,
        ),
        _phase_energy,
    ),
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_gpu_phase_seconds",
            "Time per phase, s.",
            labels=GPU_PHASE_LABELS,
        ),
        _phase_seconds,
    ),
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_gpu_energy_joules",
            "GPU energy since the totals began (unknown GPUs are absent, never 0), J.",
            labels=["gpu_uuid", "node", "energy_source"],
        ),
        _energy_total,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_gpu_sm_clock_hertz",
            "SM clock requested by the plan and read back, Hz.",
            labels=["gpu_uuid", "node", "kind"],
        ),
        _sm_clock,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_gpu_clock_locked",
            "1 while the agent holds an SM clock lock on the GPU (a plan clock or a park), else 0.",
            labels=["gpu_uuid", "node"],
        ),
        _clock_locked,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_gpu_clock_state",
            "The lock against the clock the GPU runs (1 for the current state): unlocked, "
            "settling, asRequested, capped (limit = the clock-event reasons), unexplained "
            "(below the lock with no reason), idle.",
            labels=["gpu_uuid", "node", "state", "limit"],
        ),
        _clock_state,
    ),
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_gpu_clock_shortfalls_unexplained",
            "Re-reads of a locked GPU that found it below the lock with no clock-event reason.",
            labels=["gpu_uuid", "node"],
        ),
        _shortfalls,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_gpu_assigned",
            "1 while a pod holds the GPU (kubelet pod-resources), else 0.",
            labels=["gpu_uuid", "node"],
        ),
        _assigned,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_gpu_phase_info",
            "Declared phase per GPU (1); lets idle-GPU watchdogs exempt intentional waits.",
            labels=GPU_PHASE_LABELS,
        ),
        _phase_info,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_gpu_condition",
            "GPU condition (1 for the current one): ok, measureOnly, degraded, lost.",
            labels=["gpu_uuid", "node", "condition", "reason"],
        ),
        _condition,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_energy_crosscheck_ratio",
            "Energy counter over integrated instant power in the last cross-check (30 s every "
            "5 min; counter-metered GPUs), ratio.",
            labels=["gpu_uuid", "node"],
        ),
        _crosscheck_ratio,
    ),
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_energy_crosscheck_mismatches",
            "Cross-checks where counter and integrated power disagreed by more than 15 %.",
            labels=["gpu_uuid", "node"],
        ),
        _crosscheck_mismatches,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_rollout_stalled",
            "1 while the pod's phase on the GPU is stalled: progress frozen with requests in "
            "flight at power below the SKU's stall band (clocks held, time kept out of savings).",
            labels=GPU_PHASE_LABELS,
        ),
        _stalled,
    ),
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_stalled_seconds",
            "Stalled time of closed phase windows, s (excluded from savings and trials).",
            labels=["node", "policy"],
        ),
        _stalled_seconds,
    ),
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_leases_expired",
            "Phases whose trainer went silent past the lease; their GPUs went back to the "
            "default governor (node report: expiredLeases).",
            labels=["node", "policy"],
        ),
        _leases_expired,
    ),
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_energy_samples_rejected",
            "Energy samples rejected as implausible (counter jumps), count.",
            labels=["gpu_uuid", "node"],
        ),
        _samples_rejected,
    ),
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_energy_samples_missing",
            "Energy samples that failed (counted as missing coverage), count.",
            labels=["gpu_uuid", "node"],
        ),
        _samples_missing,
    ),
    (
        lambda: CounterMetricFamily(
            "rlenergy_agent_valid_tokens",
            "Valid tokens of the steps ended here (each node reports its job's tokens), count.",
            labels=["node", "policy"],
        ),
        _valid_tokens,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_saving_ratio",
            "Saving vs the predicted default governor per phase, from the policy status (the "
            "operator's figure; absent until computable), ratio.",
            labels=["node", "policy", "phase"],
        ),
        _phase_saving,
    ),
    (
        lambda: GaugeMetricFamily(
            "rlenergy_agent_job_saving_ratio",
            "The job's saving vs the predicted default governor, from the policy status, ratio.",
            labels=["node", "policy"],
        ),
        _job_saving,
    ),
)
"""The families read from the agent's snapshot, in exposition order: each row is the family
(name, help, labels) and the function that yields its samples (labels, value)."""


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
        a = self.agent
        node = a.node_name
        lat = HistogramMetricFamily(
            "rlenergy_agent_phase_signal_latency_seconds",
            "Phase signal received to clocks applied, s.",
            labels=["node"],
        )
        families: list[Family] = []
        with a._lock:  # noqa: SLF001 - one consistent snapshot
            scrape = _Scrape(a, node, a.policy_name)
            for make, samples in _SNAPSHOT_FAMILIES:
                family = make()
                for labels, value in samples(scrape):
                    family.add_metric(labels, value)
                families.append(family)
            hist = a.latency_hist
            lat.add_metric([node], hist.buckets(), sum_value=hist.sum)
        yield from families
        yield lat
        yield from self._nvml_calls()
        up = GaugeMetricFamily(
            "rlenergy_agent_nvml_up", "1 when NVML answers on some GPU.", labels=["node"]
        )
        up.add_metric([node], 1.0 if not callable(self.health) or self.health() else 0.0)
        yield up
        yield from self._discovery()
        yield from self._lifecycle()
        yield from self._podresources()
        yield from self._released()

    def _nvml_calls(self) -> Iterator[Metric]:
        """NVML calls and the slowest call per entry point."""
        node = self.agent.node_name
        calls = CounterMetricFamily(
            "rlenergy_agent_nvml_calls",
            "NVML calls per entry point, count.",
            labels=["node", "function"],
        )
        slowest = GaugeMetricFamily(
            "rlenergy_agent_nvml_call_max_seconds",
            "Slowest NVML call per entry point, s (slow: persistence mode off, case #5).",
            labels=["node", "function"],
        )
        for fn, stat in sorted(lib.CALL_STATS.items()):
            calls.add_metric([node, fn], stat.calls)
            slowest.add_metric([node, fn], stat.max_s)
        yield calls
        yield slowest

    def _discovery(self) -> Iterator[Metric]:
        """Policy discovery's outcome, where no policy is configured (the DaemonSet's agent)."""
        a = self.agent
        if a.discovery is None:
            return
        reason, found_policy = a.discovery
        found = GaugeMetricFamily(
            "rlenergy_agent_policy_discovery",
            "Policy discovery's outcome (1): reason Matched (policy = ns/name), NoGpuPods, "
            "NoMatch or Conflict (two policies select this node's GPU pods; none governs).",
            labels=["node", "reason", "policy"],
        )
        found.add_metric([a.node_name, reason, found_policy], 1.0)
        yield found

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
        with a._lock:  # noqa: SLF001 - one consistent snapshot
            for u in a.actuator.controls:
                released.add_metric([u, node], a.released_gpu_seconds(u))
                p = a.parked.get(u)
                name, ns = _pod_labels(p.pod if p is not None else a.pod_of.get(u))
                parked.add_metric([u, node, name, ns], 1.0 if p is not None else 0.0)
                if p is not None and p.clock_mhz is not None:
                    parked_clock.add_metric([u, node], p.clock_mhz * 1e6)
        yield from (released, parked, parked_clock)


def render(agent: service.Agent, health: object = None) -> bytes:
    """The text exposition of the agent's metrics (fresh registry, scrape-time collection)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent, health))
    return generate_latest(registry)
