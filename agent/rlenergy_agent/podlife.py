"""Reset on pod end: a governed pod that ended gets its GPUs back to the default governor.

A pod is *governed* once the agent acted on one of its signals (``Agent.governed_pods``). It
has ended when the kubelet's allocation no longer lists it (PodResources drops a pod once it
is no longer active) or, checked every ``check_s`` seconds through the API
(``rlenergy_agent.kube.ended_pods``), when it is gone, being deleted, terminal
(``Succeeded``/``Failed``: completed, evicted, OOM-killed) or replaced by a pod of the same
name with another UID. Then ``Agent.pod_gone`` closes its window, ends its parks and resets
its GPUs, whatever other pods of the policy still run on the node. The node loop calls
``PodEndWatch.tick`` every sample (``sample_interval_s``, 1 s), so the reset lands within
``check_s`` + one sample + one API round trip (<= 10 s with the defaults; the e2e test
``tests/e2e/test_pod_end_reset.py`` measures it).

Callers: ``rlenergy_agent.__main__`` (node loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from rlenergy_agent import service

log = logging.getLogger(__name__)

EndedInApi = Callable[[Iterable[service.PodRef]], set[service.PodRef]]
"""``pods -> those that ended`` per the API server (raises on API errors)."""


def _listed(pod: service.PodRef, listing: Iterable[service.PodRef]) -> bool:
    """The kubelet lists ``pod`` (same namespace and name; same UID where both know it)."""
    return any(
        (p.namespace, p.name) == (pod.namespace, pod.name)
        and (not p.uid or not pod.uid or p.uid == pod.uid)
        for p in listing
    )


class PodEndWatch:
    """Finds governed pods that ended and resets their GPUs.

    Args:
        agent: the node's agent.
        ended_in_api: the API check (``None``: kubelet listing only, e.g. without the API).
        check_s: period of the API check, s.
        clock: monotonic time, s.
    """

    def __init__(
        self,
        agent: service.Agent,
        ended_in_api: EndedInApi | None = None,
        *,
        check_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent = agent
        self.ended_in_api = ended_in_api
        self.check_s = check_s
        self._clock = clock
        self._last_check = -1e18

    def tick(self) -> list[service.PodRef]:
        """Reset the GPUs of governed pods that ended; returns those pods."""
        governed = self.agent.governed_pods()
        if not governed:
            return []
        listing = list(self.agent.podmap.pods())
        unlisted = {p for p in governed if not _listed(p, listing)}
        in_api: set[service.PodRef] = set()
        now = self._clock()
        rest = governed - unlisted
        if self.ended_in_api is not None and rest and now - self._last_check >= self.check_s:
            self._last_check = now
            try:
                in_api = self.ended_in_api(rest)
            except Exception as exc:  # noqa: BLE001 - retried at the next check
                log.warning("pod end check through the API failed: %s", exc)
        gone = sorted(unlisted | in_api, key=str)
        for pod in gone:
            log.info("pod %s ended: resetting its GPUs to the default governor", pod)
            self.agent.pod_gone(pod, "NotAllocated" if pod in unlisted else "EndedInApi")
        return gone
