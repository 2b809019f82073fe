"""Step records and the node report: closed windows counted, trimmed, reported."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from rlenergy.api import node as api_node
from rlenergy_agent import energy, pods, shares
from rlenergy_agent.state import (
    IDLE,
    MAX_PHASE_SERIES,
    MAX_STEPS_KEPT,
    OTHER_PHASE,
    AgentState,
)

log = logging.getLogger("rlenergy_agent.service")


class StepRecords(AgentState):
    """StepRecords of ``service.Agent`` (a mixin over ``state.AgentState``)."""

    def _count(self, win: energy.Window, phase: str = IDLE) -> None:
        """Add a closed window to the per-GPU phase counters of /metrics.

        At most ``MAX_PHASE_SERIES`` phase names get series of their own; windows of further
        names count under ``OTHER_PHASE``.
        """
        if phase not in self.phase_names:
            if len(self.phase_names) >= MAX_PHASE_SERIES:
                phase = OTHER_PHASE
            self.phase_names.add(phase)
        for u, j in win.per_gpu_j.items():
            key = (u, phase)
            if j is not None:
                self.phase_energy_j[key] = self.phase_energy_j.get(key, 0.0) + j
            self.phase_seconds[key] = self.phase_seconds.get(key, 0.0) + win.duration_s

    def _trim(self) -> None:
        """Keep the newest ``MAX_STEPS_KEPT`` steps.

        Every per-step and per-(pod, step) entry of a dropped step goes with it, so a pod that
        never ends its steps grows nothing.
        """
        trimmed = False
        while len(self.steps) > MAX_STEPS_KEPT:
            oldest = min(self.steps)
            del self.steps[oldest]
            self.workloads.pop(oldest, None)
            self.step_released_gpu_s.pop(oldest, None)
            self.idle_j.pop(oldest, None)
            self.idle_gpu_s.pop(oldest, None)
            trimmed = True
        if trimmed:
            first = min(self.steps)
            for key in [k for k in self.pod_energy if k[1] < first]:
                del self.pod_energy[key]
            for per_step in (
                self.workloads,
                self.step_released_gpu_s,
                self.idle_j,
                self.idle_gpu_s,
            ):
                for step in [s for s in per_step if s < first]:
                    del per_step[step]

    def _finished(self, steps: Iterable[int]) -> set[int]:
        newest = max(self.steps, default=-1)
        return {s for s in steps if s in self.steps and (s in self.workloads or s < newest)}

    def finished_dirty_steps(self) -> set[int]:
        """Changed steps that are finished (a report written now carries them for good).

        A step's record changes until the trainer closes it, so the writer clears only these
        after a write; a step still running stays dirty for the write after it ends.
        """
        with self._lock:
            self.dirty_steps.intersection_update(self.steps)
            return self._finished(self.dirty_steps)

    def step_record(self, step: int) -> api_node.StepRecord:
        """The node's record of ``step``: one window per phase (summed over pods).

        Built again only when what it is built from changed: a step's window lists only grow
        (closed windows are frozen and appended), so their lengths and last windows, the
        step's workload, idle energy and time and released GPU time say whether the record
        built before still holds. A finished step is built once instead of at every report (32
        steps kept; the report is built under the agent's lock, which phase signals wait for).
        """
        with self._lock:
            by_phase = self.steps.get(step, {})
            key = (
                tuple((ph, len(ws), ws[-1] if ws else None) for ph, ws in sorted(by_phase.items())),
                self.workloads.get(step),
                self.idle_j.get(step, 0.0),
                self.idle_gpu_s.get(step, 0.0),
                self.step_released_gpu_s.get(step, 0.0),
            )
            hit = self.record_cache.get(step)
            if hit is not None and hit[0] == key:
                return hit[1]
            record = self._build_record(step)
            self.record_cache[step] = (key, record)
            return record

    def _build_record(self, step: int) -> api_node.StepRecord:
        with self._lock:
            phases: list[api_node.PhaseWindowReport] = []
            for _phase, windows in sorted(self.steps.get(step, {}).items()):
                energies = [w.energy_joules for w in windows]
                per_gpu: dict[str, float | None] = {}
                for w in windows:
                    per_gpu.update(w.gpu_energy_joules)
                applied = [w.applied_clock_mhz for w in windows if w.applied_clock_mhz]
                phases.append(
                    windows[0].model_copy(
                        update={
                            "duration_seconds": max(w.duration_seconds for w in windows),
                            "energy_joules": None
                            if any(e is None for e in energies)
                            else sum(e for e in energies if e is not None),
                            "applied_clock_mhz": min(applied) if applied else None,
                            "slowdown": any(w.slowdown for w in windows),
                            "incomplete": any(w.incomplete for w in windows),
                            "gpu_energy_joules": per_gpu,
                            "progress": sum(w.progress for w in windows),
                            "progress_mean_gap_seconds": _slowest(
                                [w.progress_mean_gap_seconds for w in windows]
                            ),
                            "progress_max_gap_seconds": _slowest(
                                [w.progress_max_gap_seconds for w in windows]
                            ),
                            "slices": [s for w in windows for s in w.slices],
                            "gpu_seconds": sum(w.gpu_seconds for w in windows),
                            "released_gpu_seconds": sum(w.released_gpu_seconds for w in windows),
                            "stalled_seconds": max(w.stalled_seconds for w in windows),
                            "stalled_energy_joules": None
                            if any(w.stalled_energy_joules is None for w in windows)
                            else sum(w.stalled_energy_joules or 0.0 for w in windows),
                        }
                    )
                )
            workload = self.workloads.get(step) or api_node.TokenWorkloadReport(
                samples=0, response_tokens=0, prompt_tokens=0, valid_tokens=0, mean_context_tokens=0
            )
            return api_node.StepRecord(
                step=step,
                workload=workload,
                phases=phases,
                idle_energy_joules=self.idle_j.get(step, 0.0),
                idle_gpu_seconds=self.idle_gpu_s.get(step, 0.0),
                released_gpu_seconds=self.step_released_gpu_s.get(step, 0.0),
            )

    def _cross_check(self, uuid: str) -> api_node.EnergyCrossCheck | None:
        chk = self.crosscheck.gpus.get(uuid)
        if chk is None or chk.last is None:
            return None
        last = chk.last
        return api_node.EnergyCrossCheck(
            counter_joules=last.counter_j,
            power_joules=last.power_j,
            window_seconds=last.window_s,
            mismatch=last.mismatch,
            mismatches=chk.mismatches,
        )

    def report(self) -> api_node.NodeReport:
        """The spec of this node's ``RLEnergyNodeReport``."""
        with self._lock:
            gpus = []
            total = 0.0
            unattributed = 0.0
            attributed = {u for u, p in self.pod_of.items() if p is not None}
            for pod_devices in self.podmap.pods().values():
                attributed.update(shares.physical(d, self.mig_parent) for d in pod_devices)
            for u, ctl in self.actuator.controls.items():
                j = self.meter.total_j(u)
                st = self.meter.state[u]
                cap = self.actuator.caps.get(u)
                condition = ctl.condition
                reason = ctl.reason
                if st.lost_at is not None:
                    condition, reason = "lost", reason or "GPULost"
                elif st.source == "unavailable" and condition == "ok":
                    condition, reason = "degraded", "TelemetryUnavailable"
                gpus.append(
                    api_node.GpuStatus(
                        uuid=u,
                        name=getattr(self.actuator.gpus[u], "name", ""),
                        condition=condition,
                        reason=reason,
                        locked_clock_mhz=ctl.applied_mhz,
                        # Acknowledged once nothing is locked under a plan that locks
                        # nothing: the operator's reset plan on deletion (enforce false) or
                        # no plan at all (the policy is gone).
                        reset_acknowledged=(self.plan is None or not self.plan.enforce)
                        and ctl.applied_mhz is None,
                        energy_joules_total=j or 0.0,
                        energy_source=st.source,
                        energy_known=j is not None,
                        phase=self.phase_of.get(u, "idle"),
                        pod=str(self.pod_of[u]) if self.pod_of.get(u) else None,
                        supported_clocks_mhz=list(ctl.supported_mhz),
                        parked=u in self.parked,
                        requested_clock_mhz=ctl.requested_mhz,
                        effective_clock_mhz=cap.effective_mhz if cap.lock_mhz else None,
                        clock_state=cap.state,
                        clock_limit=cap.limit,
                        energy_cross_check=self._cross_check(u),
                        stalled_seconds=self.stalled_since_s(u),
                    )
                )
                if j is not None:
                    total += j
                    if u not in attributed:
                        unattributed += j
            # Only finished steps: the trainer closed them (end_step) or moved past them. The
            # operator folds a step as soon as every node reported it, so a step still running
            # (its generation window closed, training under way) must not appear yet. Records
            # the policy's status has folded for good leave the report.
            done = sorted(self._finished(self.steps))
            kept, folded = api_node.unfolded_steps(done, self.folded_through_step)
            steps = [self.step_record(s) for s in kept]
            for s in [s for s in self.record_cache if s not in self.steps]:
                del self.record_cache[s]  # trimmed
            return api_node.NodeReport(
                policy_name=self.policy_name,
                node_name=self.node_name,
                gpus=gpus,
                steps=steps,
                last_step=max(done, default=-1),
                folded_through_step=folded,
                measured_joules_total=total,
                unattributed_joules_total=unattributed,
                released_gpu_seconds_total=sum(
                    self.released_gpu_seconds(u) for u in self.actuator.controls
                ),
                rollout=self.dispatch,
                ended_pods=list(self.ended_pods),
                expired_leases=list(self.expired_leases),
                sleep_checks=list(self.sleep_checks),
                conditions=self.node_conditions(),
            )

    def node_conditions(self) -> list[api_node.NodeCondition]:
        """The agent's conditions: the kubelet listing (a listed pod map) and the GPUs."""
        out: list[api_node.NodeCondition] = []
        if isinstance(self.podmap, pods.ListedPodMap):
            st = self.podmap.state()
            age = "never listed" if st.age_s is None else f"listed {st.age_s:.0f} s ago"
            message = age + (f"; newest error {st.error}: {st.message}" if st.error else "")
            out.append(
                api_node.NodeCondition(
                    type="PodResourcesListed",
                    status="True" if st.status == "Fresh" else "False",
                    reason=condition_reason(st.error) if st.error else st.status,
                    message=message[:1024],
                )
            )
        out.extend(self.gpu_conditions())
        return out

    def gpu_conditions(self) -> list[api_node.NodeCondition]:
        """The ``GpusSettled`` condition (``actuator.Actuator.lifecycle``)."""
        unsettled = sorted(self.actuator.unsettled.items())
        if not unsettled:
            return [api_node.NodeCondition(type="GpusSettled", status="True", reason="Settled")]
        now = self._clock()
        parts = [
            f"{u}: {e.reason} {max(now - since, 0.0):.0f} s ago ({e.message})"
            for u, (e, since) in unsettled
        ]
        reasons = sorted({e.reason for _, (e, _) in unsettled})
        return [
            api_node.NodeCondition(
                type="GpusSettled",
                status="False",
                reason=reasons[0] if len(reasons) == 1 else "Several",
                message="; ".join(parts)[:1024],
            )
        ]


def condition_reason(code: str) -> str:
    """A condition reason from a gRPC status code name.

    ``RESOURCE_EXHAUSTED`` -> ``ResourceExhausted``; ``SocketMissing`` stays.
    """
    if "_" not in code and not code.isupper():
        return code
    return "".join(w.capitalize() for w in code.split("_"))


def _slowest(gaps: list[float | None]) -> float | None:
    """The pods' worst progress cadence, s (``None``: a pod sent no progress at all)."""
    if any(g is None for g in gaps):
        return None
    return max(g for g in gaps if g is not None)
