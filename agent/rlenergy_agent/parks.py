"""Parked GPUs of released rollout workers (FlexFloor): park, unpark, released GPU time.

Released GPU time counts from the first power sample below the GPU's power band after the
park (``Parks.observe_parks``), not from the park signal: a parked GPU still drawing working
power has released nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence

from rlenergy.api import node as api_node
from rlenergy.gpu import errors
from rlenergy_agent import actuator as act
from rlenergy_agent import shares
from rlenergy_agent.pods import PodRef
from rlenergy_agent.state import (
    AgentState,
    SignalRefused,
    _Park,
)

log = logging.getLogger("rlenergy_agent.service")


@dataclasses.dataclass(frozen=True)
class ParkResult:
    """What one park signal did.

    Attributes:
        parked: GPUs parked by this signal, UUID -> lock made, MHz (``None``: none written).
        already: GPUs that were parked before (idempotent: untouched).
        applied: per UUID the actuator's result (read-back included) where a clock was set.
    """

    parked: Mapping[str, int | None]
    already: tuple[str, ...]
    applied: Mapping[str, act.ApplyResult]


class Parks(AgentState):
    """Parks of ``service.Agent`` (a mixin over ``state.AgentState``)."""

    def park(self, pod: PodRef, step: int, *, gpu_uuids: Sequence[str] = ()) -> ParkResult:
        """Park ``pod``'s GPUs at their lowest supported SM clock: a released rollout worker.

        The park lasts until the pod's next working phase signal or a signal of a later step
        (the plan's clock is applied then), the end of ``step`` (``end_step``: default
        governor), ``unpark``, the pod's end, or the plan's removal (every lock reset). Parking
        a parked GPU does nothing (idempotent). Under an observe plan (or none) no clock is
        written, but the released time is still accounted.

        Args:
            pod: the authenticated caller.
            step: RL step of the release.
            gpu_uuids: GPUs to park, each the pod's own (empty: every GPU of the pod).

        Returns:
            What was parked, with the actuator's read-back.

        Raises:
            SignalRefused: the pod holds no GPU here (404), names a GPU it does not hold
                (403), or a negative step (400).
        """
        gpus, devices, targets = self.signal_gpus(pod, gpu_uuids, step)
        with self._lock:
            enforce = self.plan is not None and self.plan.enforce
            now = self._clock()
            parked: dict[str, int | None] = {}
            applied: dict[str, act.ApplyResult] = {}
            already = tuple(u for u in targets if u in self.parked)
            for u in targets:
                if u in self.parked:
                    continue
                others = sorted(self.sharers_of(u) - set(devices))
                if others:  # a shared GPU (replicas, MPS, MIG): never parked under a co-tenant
                    applied[u] = act.ApplyResult(
                        u,
                        None,
                        None,
                        None,
                        False,
                        skipped="SharedGPU",
                        error=f"not parked: GPU {u} is shared with device(s) "
                        f"{', '.join(others)} of other pods",
                    )
                    continue
                ctl = self.actuator.controls[u]
                clock: int | None = None
                if enforce and ctl.supported_mhz:
                    r = applied[u] = self.actuator.apply(
                        u, min(ctl.supported_mhz), owner_uuids=devices
                    )
                    clock = r.target_mhz if r.error is None and r.skipped is None else None
                dropped = now if self._power_dropped(u) else None
                self.parked[u] = _Park(pod, step, now, clock, dropped)
                parked[u] = clock
            self.steps.setdefault(step, {})
            self.report_due = self.report_due or bool(parked)
            if parked:
                log.info("parked %s for pod %s at step %d", ", ".join(parked), pod, step)
            return ParkResult(parked, already, applied)

    def unpark(self, pod: PodRef, *, gpu_uuids: Sequence[str] = ()) -> float:
        """End ``pod``'s parks (all, or ``gpu_uuids``) and apply the plan's current clock.

        Returns:
            The GPU time of the parks ended, GPU-s.
        """
        with self._lock:
            wanted = {shares.physical(g, self.mig_parent) for g in gpu_uuids}
            ended = [
                u for u, p in self.parked.items() if p.pod == pod and (not wanted or u in wanted)
            ]
            released = self._end_parks(ended, self._clock())
            w = self._open.get(pod)
            entry = self._entry_for(w.phase) if w is not None else None
            clock = w.probe.clock_mhz if w is not None and w.probe is not None else None
            if w is not None and w.probe is None and entry is not None:
                clock = entry.clock_mhz
            _gpus, devices = self.gpus_of(pod)
            for u in ended:
                self.actuator.apply(u, clock, owner_uuids=devices)
            return released

    def sharers_of(self, gpu: str) -> set[str]:
        """Every device ID of ``gpu`` that any pod holds (``service.Agent.sharers_of``)."""
        raise NotImplementedError

    def _end_parks_before(self, step: int, writer: PodRef | None = None) -> None:
        """End the parks of steps before ``step``, whoever parked them: the step ended.

        Their GPUs return to the default governor (the next phase signal applies the plan),
        except those of ``writer``, whose signal writes their clock next (no extra write on
        the signal's latency path).
        """
        with self._lock:
            stale = [(u, p) for u, p in self.parked.items() if p.step < step]
            if not stale:
                return
            self._end_parks([u for u, _ in stale], self._clock())
            for u, p in stale:
                if p.pod != writer:
                    self.actuator.apply(u, None, owner_uuids=self.gpus_of(p.pod)[1])
            log.info("step %d began: %d park(s) of earlier steps ended", step, len(stale))

    def _end_parks(self, uuids: Iterable[str], now_s: float) -> float:
        """Account and forget the parks of ``uuids`` (clocks are the caller's business)."""
        total = 0.0
        for u in list(uuids):
            p = self.parked.pop(u, None)
            if p is None:
                continue
            dt = p.released_s(now_s)
            total += dt
            self.released_gpu_s[u] = self.released_gpu_s.get(u, 0.0) + dt
            self.step_released_gpu_s[p.step] = self.step_released_gpu_s.get(p.step, 0.0) + dt
            self.dirty_steps.add(p.step)
            w = self._open.get(p.pod)
            if w is not None and u in w.gpus:
                w.released_gpu_s += p.released_s(now_s, w.started_s)
            self.report_due = True
        return total

    def released_gpu_seconds(self, uuid: str) -> float:
        """Parked time of ``uuid`` so far, ongoing park included, GPU-s (a counter)."""
        with self._lock:
            p = self.parked.get(uuid)
            ongoing = p.released_s(self._clock()) if p is not None else 0.0
            return self.released_gpu_s.get(uuid, 0.0) + ongoing

    def observe_parks(self) -> None:
        """Start the released time of each parked GPU whose power has dropped (sampling loop).

        A park is a request: the engine may still decode on the GPU (a release not yet
        applied, a rank the engine kept) and the GPU then draws working power at its lowest
        clock. Released GPU time counts only from the first sample below the GPU's power band
        (``stalls.band_w``: halfway between its idle power and a decode at its lowest clock),
        so it is credited only after the power has dropped. A GPU with no basis for a band
        (unknown SKU, unreadable power limit) or unreadable power is never credited.
        """
        with self._lock:
            now = self._clock()
            for u, p in list(self.parked.items()):
                if p.dropped_s is None and self._power_dropped(u):
                    self.parked[u] = dataclasses.replace(p, dropped_s=now)
                    self.report_due = True

    def _power_dropped(self, uuid: str) -> bool:
        """Whether ``uuid``'s instant power reads below its power band now."""
        band = self._power_band_w(uuid)
        if band is None:
            return False
        try:
            return self.actuator.gpus[uuid].instant_power_mw() / 1000.0 < band
        except errors.GpuError:
            return False

    def publish_rollout(self, pod: PodRef, dispatch: api_node.RolloutDispatch) -> None:
        """Keep the rollout dispatcher's publication for the node report (newest step wins).

        Raises:
            SignalRefused: the pod holds no GPU on this node (404), or the step is older
                than the one already published (409).
        """
        gpus, _ = self.gpus_of(pod)
        if not gpus:
            self.refused += 1
            raise SignalRefused(f"pod {pod} holds no GPU on node {self.node_name}", 404)
        self.check_step(dispatch.step)
        with self._lock:
            if self.dispatch is not None and dispatch.step < self.dispatch.step:
                raise SignalRefused(
                    f"step {dispatch.step} is older than the published step {self.dispatch.step}",
                    409,
                )
            if dispatch != self.dispatch:
                self.dispatch = dispatch
                self.report_due = True
