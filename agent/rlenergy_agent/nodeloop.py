"""The agent's node loop: policy discovery, plan updates, report writes and sampling.

``NodeLoop.run`` wakes every ``sample_interval_s`` until ``stop``: it resets the clocks of
pods that ended (``podlife``), finds the policy that governs the node's GPU pods when none is
configured (``kube.PolicyDiscovery``, every ``plan_poll_s``), adopts the policy's plan
(``kube.PlanWatcher``), writes the node report (the first at once, then whenever the plan's
enforcement or a park changes, and for finished steps at most every ``report_interval_s``
unless several wait), and samples energy. ``rlenergy_agent.__main__`` composes it with the
signal and ops servers (as kepler composes its services in ``cmd/kepler/main.go``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlenergy.api import selector
from rlenergy_agent import config, podlife, pods, service

if TYPE_CHECKING:
    from rlenergy_agent import annotations as annotations_t
    from rlenergy_agent import kube as kube_t

log = logging.getLogger("rlenergy_agent")


def rediscover(
    finder: kube_t.PolicyDiscovery, agent: service.Agent, last: selector.Discovery | None
) -> selector.Discovery | None:
    """The policy governing the node's GPU pods now; ``None`` when the current one stays.

    ``None`` (the caller keeps its current policy) when the API failed, or when the kubelet's
    listing names no GPU pod while pods the matched policy governs have not ended: a restarted
    kubelet lists no pod until its pod manager has synced (about 1 s in the real-node
    kubelet-restart e2e, ``tests/e2e/test_real_node_day_two.py``), and leaving the policy then
    reset every lock of the running job there. Whether a governed pod ended is the pod-end
    watch's call (``podlife``: the API's word, or an absence past the listing's
    ``reset_after_s``); once it has reset them, an empty listing leaves the policy. A changed
    outcome is logged: a conflict as an error (the node governs nothing until one selector is
    narrowed), another policy's pods left ungoverned as a warning, else at info. The policy the
    node governs keeps its own pods when another policy's pods arrive
    (``selector.keep_current``): another tenant cannot reset a running job's locks by
    selecting a co-located pod of its own.
    """
    try:
        found = finder.discover((p.namespace, p.name) for p in agent.podmap.pods())
    except Exception as exc:  # noqa: BLE001 - keep the current policy on API errors
        log.warning("policy discovery failed, keeping the current policy: %s", exc)
        return None
    current = last.policy if last is not None and last.reason == "Matched" else None
    found = selector.keep_current(found, current)  # another tenant's pods arrived
    if found.reason == "NoGpuPods" and last is not None and last.reason == "Matched":
        governed = agent.governed_pods()
        if governed:
            log.info(
                "policy discovery: the kubelet lists no GPU pod, but %s of policy %s have not "
                "ended: keeping the policy",
                ", ".join(sorted(str(p) for p in governed)),
                last.policy,
            )
            return None
    if last is None or (found.reason, found.policy, found.message) != (
        last.reason,
        last.policy,
        last.message,
    ):
        level = (
            logging.ERROR
            if found.reason == "Conflict"
            else logging.WARNING
            if found.ungoverned
            else logging.INFO
        )
        log.log(level, "policy discovery: %s: %s", found.reason, found.message)
    agent.discovery = (found.reason, "" if found.policy is None else str(found.policy))
    agent.discovery_pending = False  # signals are judged from here on (check_serving)
    # Only the pods the policy selects may signal (Matched); none while no policy governs.
    agent.selected = frozenset(
        (ns, name)
        for ns, _, name in (p.partition("/") for p in found.pods)
        if found.reason == "Matched"
    )
    agent.discovered()  # a refused pod's miss is final once one began after it
    return found


def leave_policy(agent: service.Agent, writer: kube_t.ReportWriter | None, new: str) -> None:
    """Reset every clock of the current policy, then serve ``new`` (``""``: none).

    The old policy's operator gets a last report with the resets acknowledged; the new one
    starts from a clean slate.
    """
    agent.set_plan(None)
    if writer is not None:
        try:
            writer.write(agent.report())
        except Exception as exc:  # noqa: BLE001 - the clocks are reset either way
            log.warning("last report for %s failed: %s", writer.policy, exc)
        log.info("left policy %s/%s: clocks reset", writer.namespace, writer.policy)
    agent.switch_policy(new)


def write_report(path: Path, agent: service.Agent) -> None:
    """Write the node report as JSON (atomic replace; local runs and benchmarks)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(agent.report().model_dump_json(by_alias=True))
    tmp.replace(path)


class NodeLoop:
    """The node loop of one agent.

    Args:
        settings: the agent's settings (intervals, namespace, policy, report file).
        agent: the agent core.
        pod_ends: the pod-end watch (``tick`` each pass).
        api: a ``CustomObjectsApi``, or None (no cluster, or a plan file: no policy plan is
            followed and no report object written).
        discover: find the governing policy (no policy configured) instead of following
            ``settings.policy_name``.
        stop: the event that ends ``run`` (a new one when None).
        pods_api: what the annotation watch lists and watches pods with (None:
            ``annotations.NodePodStream`` on the process-wide configuration).
    """

    def __init__(
        self,
        settings: config.AgentSettings,
        agent: service.Agent,
        pod_ends: podlife.PodEndWatch,
        api: Any,
        *,
        discover: bool,
        stop: threading.Event | None = None,
        pods_api: Any = None,
    ) -> None:
        self.settings = settings
        self.pods_api = pods_api
        self.agent = agent
        self.pod_ends = pod_ends
        self.api = api
        self.writer: kube_t.ReportWriter | None = None
        self.watcher: kube_t.PlanWatcher | None = None
        self.finder: kube_t.PolicyDiscovery | None = None
        self.phase_watch: annotations_t.PodPhaseWatch | None = None
        """Watch of the node's pod annotations while the policy says ``phaseSource:
        annotation`` (``rlenergy_agent.annotations``)."""
        if api is not None:
            from rlenergy_agent import kube

            if discover:
                self.finder = kube.PolicyDiscovery(api, settings.node_name)
            else:
                self.writer = kube.ReportWriter(
                    api, settings.namespace, settings.policy_name, settings.node_name
                )
                self.watcher = kube.PlanWatcher(api, settings.namespace, settings.policy_name)
        self.last_poll = self.last_write = 0.0
        self.discovered: selector.Discovery | None = None
        # The first report goes out at once (the operator needs the GPUs' clock tables before
        # the first step), and again whenever the plan changes (reset acknowledgements on
        # deletion).
        self.state_changed = True
        self._stop = stop if stop is not None else threading.Event()

    def run(self) -> None:
        """Pass every ``sample_interval_s`` until ``stop``.

        A selection miss (``agent.loop_wake``) starts the next pass at once.
        """
        wake = self.agent.loop_wake
        while not self._stop.is_set():
            wake.wait(self.settings.sample_interval_s)
            wake.clear()
            if self._stop.is_set():
                break
            self.tick(time.monotonic())

    def stop(self) -> None:
        """End ``run`` after the current pass."""
        self._stop.set()
        self.agent.loop_wake.set()

    def close(self) -> None:
        """End the plan watch and the annotation watch (the policy is left, or the agent stops)."""
        if self.watcher is not None:
            self.watcher.stop()
        self._follow_annotations(False)

    def _follow_annotations(self, on: bool) -> None:
        """Start or stop the watch of the node's pod annotations."""
        if on and self.phase_watch is None:
            from rlenergy_agent import annotations

            self.phase_watch = annotations.PodPhaseWatch(
                self.agent, self.settings.node_name, self.pods_api
            )
            self.phase_watch.start()
            log.info("phaseSource annotation: watching the pods of %s", self.settings.node_name)
        elif not on and self.phase_watch is not None:
            self.phase_watch.stop()
            self.phase_watch = None

    def tick(self, now: float) -> None:
        """One pass at monotonic time ``now``, s."""
        if isinstance(self.agent.podmap, pods.ListedPodMap):
            self.agent.podmap.keep_fresh()  # the kubelet listing, off the signals' threads
        self.pod_ends.tick()  # reset on pod end, before this pass's report
        due = self.agent.discovery_due  # an unselected pod signalled: it may have just started
        if self.finder is not None and (due or now - self.last_poll >= self.settings.plan_poll_s):
            self.agent.discovery_due = False
            self._discover(now, self.finder)
        if self.watcher is not None and now - self.last_poll >= self.settings.plan_poll_s:
            self.last_poll = now
            self._poll(self.watcher)
        self._report(now)
        agent = self.agent
        agent.meter.sample()
        agent.observe()
        agent.observe_parks()
        agent.meter.save()
        if self.settings.report_file is not None and agent.dirty_steps:
            if self.writer is None:
                agent.dirty_steps.clear()
            write_report(self.settings.report_file, agent)

    def _discover(self, now: float, finder: kube_t.PolicyDiscovery) -> None:
        from rlenergy_agent import kube

        found = rediscover(finder, self.agent, self.discovered)
        if found is not None:
            self.discovered = found
            watcher = self.watcher
            current = None if watcher is None else (watcher.namespace, watcher.policy)
            ref = found.policy
            if (None if ref is None else (ref.namespace, ref.name)) != current:
                leave_policy(self.agent, self.writer, "" if ref is None else ref.name)
                self.close()
                self.writer = self.watcher = None
                if ref is not None:
                    self.writer = kube.ReportWriter(
                        self.api, ref.namespace, ref.name, self.agent.node_name
                    )
                    self.watcher = kube.PlanWatcher(self.api, ref.namespace, ref.name)
                self.state_changed = True
        if self.watcher is None:  # nothing to poll: next discovery in plan_poll_s
            self.last_poll = now

    def _poll(self, watcher: kube_t.PlanWatcher) -> None:
        agent = self.agent
        try:
            exists, plan = watcher.poll()
            agent.saving_ratio = watcher.saving_ratio
            agent.lost_workers = watcher.lost_workers
            agent.folded_through_step = watcher.folded_through_step
            if not exists or plan != agent.plan:
                enforced = agent.plan is not None and agent.plan.enforce
                agent.set_plan(plan)
                self.state_changed = self.state_changed or enforced != bool(plan and plan.enforce)
            # After the plan: the watch's first listing signals the pods' current phases.
            self._follow_annotations(exists and watcher.phase_source == "annotation")
        except Exception as exc:  # noqa: BLE001 - keep the last plan on API errors
            log.warning("plan poll failed: %s", exc)

    def _report(self, now: float) -> None:
        agent, writer = self.agent, self.writer
        # Only finished steps count (a running step's record still changes); the set is taken
        # before the report is built, so a step that finishes during the write stays dirty for
        # the next one.
        pending = agent.finished_dirty_steps() if writer is not None else set()
        if agent.report_due:  # a park or a dispatcher publication (FlexFloor)
            agent.report_due = False
            self.state_changed = True
        due = now - self.last_write >= self.settings.report_interval_s or len(pending) > 1
        if writer is not None and (self.state_changed or (pending and due)):
            self.last_write = now
            try:
                writer.write(agent.report())
                agent.dirty_steps.difference_update(pending)
                self.state_changed = False
            except Exception as exc:  # noqa: BLE001 - retried at the next step
                log.warning("report write failed: %s", exc)
