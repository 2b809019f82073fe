"""Reset on pod end: a governed pod that ended gets its GPUs back to the default governor.

A pod is *governed* once the agent acted on one of its signals (``Agent.governed_pods``). It
has ended when the kubelet's allocation no longer lists it (PodResources drops a pod once it
is no longer active) or, checked every ``check_s`` seconds through the API
(``rlenergy_agent.kube.ended_pods``), when it is gone, being deleted, terminal
(``Succeeded``/``Failed``: completed, evicted, OOM-killed) or replaced by a pod of the same
name with another UID. Then ``Agent.pod_gone`` closes its window, ends its parks and resets
its GPUs, whatever other pods of the policy still run on the node. The node loop calls
``PodEndWatch.tick`` every sample (``sample_interval_s``, 1 s), so the reset lands within
``check_s`` (or ``CONFIRM_S`` of absence from the listing) + one sample + one API round trip
(<= 10 s with the defaults; the e2e test ``tests/e2e/test_pod_end_reset.py`` measures it).
A single listing never resets a pod, and an empty or failed one resets none
(``PodEndWatch``).

Callers: ``rlenergy_agent.__main__`` (node loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from rlenergy_agent import pods, service

log = logging.getLogger(__name__)

CONFIRM_S = 2.0
"""A governed pod missing from the kubelet's listing this long (two listings at least) has
ended, s: a pass of the node loop is 1 s, so a reset still lands within the 10 s the pod-end
test allows; one listing that drops a pod by mistake resets nothing [MODEL]."""
EndedInApi = Callable[[Iterable[service.PodRef]], set[service.PodRef]]
"""``pods -> those that ended`` per the API server (raises on API errors)."""


def _listed(pod: service.PodRef, listing: Iterable[service.PodRef]) -> bool:
    """The kubelet lists ``pod`` (same namespace and name; same UID where both know it)."""
    return any(pods.same_pod(p, pod) for p in listing)


class PodEndWatch:
    """Finds governed pods that ended and resets their GPUs.

    With a listed pod map (the kubelet's PodResources) one listing is never enough to reset:

    * a pod missing from the listing is reset once it stayed missing over at least two
      listings ``confirm_s`` apart, or at once when the API says it ended;
    * while the listing names no pod with GPUs at all (a kubelet that restarts can answer an
      empty list), only the API's word, or an absence longer than the map's ``reset_after_s``,
      resets a pod: never a mass reset on an empty reply;
    * a listing that is not ``Fresh`` (the kubelet does not answer) resets nothing by absence;
      once it is ``Expired`` the GPUs of the governed pods can no longer be attributed and
      are reset (``Agent.release_unattributed``), their pods kept (they signal again once the
      kubelet answers).

    Args:
        agent: the node's agent.
        ended_in_api: the API check (``None``: kubelet listing only, e.g. without the API).
        check_s: period of the API check, s.
        confirm_s: how long a single pod must stay unlisted before it is reset, s.
        clock: monotonic time, s.
        on_end: called with each pod that ended, after its reset (the token cache forgets it).
    """

    def __init__(
        self,
        agent: service.Agent,
        ended_in_api: EndedInApi | None = None,
        *,
        check_s: float = 3.0,
        confirm_s: float = CONFIRM_S,
        clock: Callable[[], float] = time.monotonic,
        on_end: Callable[[service.PodRef], None] | None = None,
    ) -> None:
        self.agent = agent
        self.ended_in_api = ended_in_api
        self.check_s = check_s
        self.confirm_s = confirm_s
        self._clock = clock
        self._last_check = -1e18
        self.on_end = on_end
        self._missing: dict[service.PodRef, tuple[float, int]] = {}
        """Governed pods missing from the listing: (first missed at, listings then)."""
        self._released = False

    def _absent(self, governed: set[service.PodRef], now: float) -> set[service.PodRef]:
        """Governed pods the kubelet's listing has dropped for long enough (class docstring)."""
        podmap = self.agent.podmap
        listing = list(podmap.pods())
        unlisted = {p for p in governed if not _listed(p, listing)}
        if not isinstance(podmap, pods.ListedPodMap):
            return unlisted
        state = podmap.state()
        listings = int(getattr(podmap, "listings", 0))
        for p in list(self._missing):
            if p not in unlisted:
                del self._missing[p]
        if state.status != "Fresh":
            return set()
        for p in unlisted:
            self._missing.setdefault(p, (now, listings))
        empty = not listing  # no pod holds a GPU: a restarting kubelet can answer so
        long_s = float(getattr(podmap, "reset_after_s", 0.0))
        out = set()
        for p in unlisted:
            since, at = self._missing[p]
            if empty:
                if now - since >= long_s:
                    out.add(p)
            elif now - since >= self.confirm_s and listings > at:
                out.add(p)
        return out

    def _expired(self) -> None:
        """Reset the GPUs no fresh listing attributes any more (``Expired`` listing)."""
        podmap = self.agent.podmap
        if not isinstance(podmap, pods.ListedPodMap):
            return
        state = podmap.state()
        if state.status == "Expired" and not self._released:
            self._released = True
            self.agent.release_unattributed(
                f"kubelet PodResources listing {state.age_s or 0.0:.0f} s old "
                f"({state.error or 'no answer'})"
            )
        elif state.status == "Fresh":
            self._released = False

    def tick(self) -> list[service.PodRef]:
        """Reset the GPUs of governed pods that ended; returns those pods."""
        self._expired()
        governed = self.agent.governed_pods()
        if not governed:
            self._missing.clear()
            return []
        now = self._clock()
        unlisted = self._absent(governed, now)
        in_api: set[service.PodRef] = set()
        if self.ended_in_api is not None and now - self._last_check >= self.check_s:
            rest = (governed - unlisted) | set(self._missing)
            if rest:
                self._last_check = now
                try:
                    in_api = self.ended_in_api(rest)
                except Exception as exc:  # noqa: BLE001 - retried at the next check
                    log.warning("pod end check through the API failed: %s", exc)
        gone = sorted(unlisted | in_api, key=str)
        for pod in gone:
            self._missing.pop(pod, None)
            log.info("pod %s ended: resetting its GPUs to the default governor", pod)
            self.agent.pod_gone(pod, "NotAllocated" if pod in unlisted else "EndedInApi")
            if self.on_end is not None:
                self.on_end(pod)
        return gone
