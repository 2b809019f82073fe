"""Phase leases: a phase the trainer stopped signalling returns its GPUs to the default governor.

A lock lives as long as the trainer keeps talking: every phase signal and every progress report
renews it. A trainer that dies between signals (a crashed hook, a hung process, a job whose
step never ends) would otherwise leave its GPUs at the phase's clock for as long as its pod
lives, since only the pod's end resets them (``podlife``). Past the lease, the window ends as an
``idle`` signal would end it (its energy is booked to its step as measured), the GPUs go back to
the default governor, and the node report lists the expiry (``NodeReport.expiredLeases``).

The lease is tied to how long that phase has run on this node: ``LEASE_FACTOR`` times the
longest window of the phase closed here, never below ``LEASE_MIN_S``; before the phase has
closed once, ``LEASE_FIRST_S``.
"""

from __future__ import annotations

import collections
import logging

from rlenergy.api import node as api_node
from rlenergy_agent.pods import PodRef
from rlenergy_agent.state import IDLE, AgentState, SignalRefused

log = logging.getLogger("rlenergy_agent.service")

LEASE_FACTOR = 3.0
"""Lease / longest closed window of the phase [MODEL]: a phase that runs three times its
longest observed length with no signal at all (no progress report either) is taken as
abandoned. verl's step-to-step phase times vary by 2-11 % (README, "How EE-RL decides here"),
far inside this margin."""
LEASE_MIN_S = 120.0
"""Shortest lease, s [MODEL]: short phases (seconds) keep two minutes of silence, longer than
any pause between a phase's signals that a healthy trainer shows (the SDK's progress reports
come every few tens of ms)."""
LEASE_FIRST_S = 1800.0
"""Lease of a phase before any window of it closed on this node, s [MODEL]: a first long-CoT
generation phase may run for tens of minutes without progress reports when the engine serves
no metrics."""
EXPIRED_KEPT = 64
"""Expired leases kept for the node report (newest last; ``NodeReport.expired_leases``)."""


class Leases(AgentState):
    """Phase leases of ``service.Agent`` (a mixin over ``state.AgentState``)."""

    def _init_leases(self) -> None:
        self.phase_longest_s = {}
        """Per phase, the longest window closed on this node, s."""
        self.expired_leases = collections.deque(maxlen=EXPIRED_KEPT)
        self.leases_expired_total = 0

    def lease_s(self, phase: str) -> float:
        """The silence after which an open ``phase`` window is abandoned, s."""
        longest = self.phase_longest_s.get(phase)
        if longest is None:
            return LEASE_FIRST_S
        return max(LEASE_MIN_S, LEASE_FACTOR * longest)

    def _window_closed(self, phase: str, duration_s: float) -> None:
        """Learn ``phase``'s length from a closed window of it (``duration_s``, s)."""
        if phase != IDLE and duration_s > self.phase_longest_s.get(phase, 0.0):
            self.phase_longest_s[phase] = duration_s

    def expire_leases(self, now_s: float) -> list[api_node.ExpiredLease]:
        """End every working phase window silent for longer than its lease.

        Args:
            now_s: this agent's monotonic time, s.

        Returns:
            The leases that expired in this pass (also in :attr:`expired_leases`).
        """
        expired: list[api_node.ExpiredLease] = []
        with self._lock:
            for pod, w in list(self._open.items()):
                if w.phase == IDLE:
                    continue
                last_s = max(w.started_s, w.last_signal_s)
                lease = self.lease_s(w.phase)
                if now_s - last_s <= lease:
                    continue
                record = api_node.ExpiredLease(
                    pod=f"{pod.namespace}/{pod.name}",
                    phase=w.phase,
                    step=w.step,
                    silent_seconds=round(now_s - last_s, 3),
                    lease_seconds=round(lease, 3),
                    gpus=sorted(w.gpus),
                )
                self._release(pod, w.step)
                log.warning(
                    "lease of phase %s (step %d) of pod %s expired after %.0f s without a signal "
                    "(lease %.0f s): its GPUs are back at the default governor",
                    w.phase,
                    w.step,
                    record.pod,
                    record.silent_seconds,
                    lease,
                )
                self.expired_leases.append(record)
                self.leases_expired_total += 1
                self.report_due = True
                expired.append(record)
        return expired

    def _release(self, pod: PodRef, step: int) -> None:
        """End ``pod``'s window as its ``idle`` signal would (default clocks, idle window)."""
        try:
            self.phase(pod, "idle", step)
        except SignalRefused:
            # The pod no longer holds GPUs here: its end resets them (``podlife``); drop the
            # window so that no lock is kept on its account.
            self._open.pop(pod, None)

    def phase(self, pod: PodRef, phase: str, step: int) -> object:
        """``service.Agent.phase``."""
        raise NotImplementedError
