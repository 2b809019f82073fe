"""Pods that end, and GPUs no listing attributes: their locks and parks reset, the report told.

A mixin of ``service.Agent`` (over ``state.AgentState``); ``podlife.PodEndWatch`` and the pod
map's listing bounds call it.
"""

from __future__ import annotations

from typing import Literal

from rlenergy.api import node as api_node
from rlenergy_agent.pods import PodRef
from rlenergy_agent.state import AgentState

ENDED_PODS_KEPT = 16
"""Ended pods kept for the node report (newest last)."""
EndedHow = Literal["NotAllocated", "EndedInApi"]


class PodEnds(AgentState):
    """Pod ends of ``service.Agent``."""

    def governed_pods(self) -> set[PodRef]:
        """Pods this agent acts for: an open window, a GPU they drove last, or a park."""
        with self._lock:
            pods = set(self._open) | {p for p in self.pod_of.values() if p is not None}
            return pods | {p.pod for p in self.parked.values()}

    def pod_gone(self, pod: PodRef, how: EndedHow = "NotAllocated") -> None:
        """The pod ended: close its window, end its parks, reset its GPUs to the default.

        Its GPUs are the ones it drove last, parked, or has an open window on. The node report
        lists it (``ended_pods``: how it ended, its GPUs, whether all were parked, the newest
        step seen), so the operator can tell a rollout worker lost mid-rollout.
        """
        with self._lock:
            w = self._open.get(pod)
            parked = [u for u, p in self.parked.items() if p.pod == pod]
            gpus = [u for u, p in self.pod_of.items() if p == pod]
            gpus += [u for u in (*parked, *(w.gpus if w else ())) if u not in gpus]
            step = max((*self.steps, *(o.step for o in self._open.values())), default=-1)
            self.ended_pods.append(
                api_node.EndedPod(
                    pod=str(pod),
                    how=how,
                    gpus=sorted(gpus),
                    parked=bool(gpus) and set(gpus) <= set(parked),
                    step=step,
                )
            )
            self._end_parks(parked, self._clock())
            if w is not None and gpus:
                self._close(pod, self.meter.mark(gpus))
            for key in [k for k in self.pod_energy if k[0] == pod]:
                del self.pod_energy[key]
            self.actuator.release(gpus, f"pod {pod} ended")
            for u in gpus:
                self.phase_of[u] = "idle"
                self.pod_of[u] = None
            self.report_due = self.report_due or bool(gpus)

    def release_unattributed(self, reason: str) -> list[str]:
        """Reset every lock and park: no fresh kubelet listing attributes the GPUs any more.

        The pods stay governed (their windows open, their GPUs theirs): a signal after the
        listing works again locks anew. Returns the UUIDs whose lock was reset.
        """
        with self._lock:
            self._end_parks(list(self.parked), self._clock())
            done = self.actuator.release(list(self.actuator.gpus), reason)
            self.report_due = self.report_due or bool(done)
            return done
