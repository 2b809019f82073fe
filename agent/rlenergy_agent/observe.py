"""The sampling loop's look at open phase windows: clock read-backs and stall samples.

``WindowObservations`` is a mixin of ``service.Agent`` over ``state.AgentState``: the node loop
calls ``observe`` every sample (``nodeloop``), under the agent lock. A busy GPU's SM clock and
clock-event reasons go into its window (the lowest clock a GPU held over two consecutive
read-backs wins; a slowdown reason on two flags it: ``caps.held_clock_mhz``),
and each window with a ``stalls.StallWatch`` gets one sample: its cumulative progress, the
requests in flight its caller reported, and the mean power per GPU since the previous sample
(meter marks). Due lock read-backs (``actuator.watch_caps``) and the energy cross-check tick
(``crosscheck``) ride the same loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rlenergy.gpu import base, errors
from rlenergy_agent.pods import PodRef
from rlenergy_agent.state import AgentState

log = logging.getLogger("rlenergy_agent.service")


class WindowObservations(AgentState):
    """Clock read-backs and stall samples of ``service.Agent``'s open windows (a mixin)."""

    def _observe_clocks(self, pod: PodRef, gpus: Sequence[str]) -> None:
        """Read back the SM clock of a pod's busy GPUs into its open window.

        The window reports the lowest clock a GPU held over two consecutive reads and a
        slowdown reason seen on two (``caps.held_clock_mhz``, ``caps.held_flag``).
        """
        w = self._open.get(pod)
        if w is None:
            return
        for u in gpus:
            ctl = self.actuator.controls.get(u)
            if ctl is None or ctl.condition == "lost" or u in self.parked:
                continue
            gpu = self.actuator.gpus[u]
            try:
                reasons = gpu.clock_event_reasons()
                if base.ClockEventReason.GPU_IDLE in reasons:
                    continue
                w.applied.setdefault(u, []).append(gpu.sm_clock_mhz())
                w.slow_reads.setdefault(u, []).append(bool(reasons & base.SLOWDOWN_REASONS))
            except errors.GpuError as exc:
                log.debug("clock read-back on %s failed: %s", u, exc)

    def _observe_stall(self, pod: PodRef) -> None:
        """One stall sample of the pod's window (``stalls``): progress, in flight, power."""
        w = self._open.get(pod)
        if w is None or w.stall is None or not w.gpus:
            return
        watch = w.stall
        mark = self.meter.mark(w.gpus)
        prev = watch._last_mark  # noqa: SLF001 - the previous sample's mark, for power
        power: float | None = None
        if prev is not None:
            win = self.meter.window(prev, mark)
            if win.energy_j is not None and win.duration_s > 0:
                power = win.energy_j / win.duration_s / len(w.gpus)
        change = watch.sample(mark.t_s, w.progress, power, mark)
        if change is not None:
            self.report_due = True
            log.warning(
                "pod %s %s step %d: stall %s (progress %.0f, stalled %.0f s, %s in flight, "
                "%.0f W per GPU, band %.0f W)",
                pod,
                w.phase,
                w.step,
                change,
                w.progress,
                watch.stalled_s(mark.t_s),
                watch.in_flight,
                power or 0.0,
                watch.band_w,
            )

    def _lifecycle(self) -> None:
        """GPU resets, lost GPUs and driver changes (``actuator.Actuator.lifecycle``).

        A GPU with an event puts an error on every open window that runs on it, so the
        operator keeps that window out of savings and trial evidence (a window with an error
        is no evidence); a GPU that answers again is metered from a fresh baseline.
        """
        events = self.actuator.lifecycle(self.meter.lost())
        for u in self.actuator.returned:
            self.meter.readmit(u)
        self.actuator.returned.clear()
        if not events:
            return
        self.report_due = True
        for e in events:
            for w in self._open.values():
                note = f"{e.uuid}: {e.reason}"
                if e.uuid in w.gpus and note not in w.errors:
                    w.errors.append(note)

    def stalled_since_s(self, uuid: str) -> float | None:
        """How long the window on ``uuid`` is stalled, s (``None``: not stalled)."""
        pod = self.pod_of.get(uuid)
        w = self._open.get(pod) if pod is not None else None
        if w is None or w.stall is None or not w.stall.stalled:
            return None
        return max(self._clock() - w.stall.stalls[-1].start_s, 0.0)

    def observe(self) -> None:
        """Read back clocks of every open window and of due locks (the sampling loop)."""
        with self._lock:
            for pod in list(self._open):
                self._observe_clocks(pod, self.gpus_of(pod)[0])
                self._observe_stall(pod)
            self.expire_leases(self._clock())
            self._lifecycle()
            if self.actuator.watch_caps():
                self.report_due = True  # an unexplained shortfall: report it now
            if self.crosscheck.tick():
                self.report_due = True  # counter and power disagree: report both numbers
