"""Liveness that means it: the operator's probe fails when its policy watch stopped delivering.

kopf answers ``/healthz`` with 200 as long as its event loop runs, also with no watch running.
kopf reconnects a stream that is silent (no event, no bookmark) for 70 s
(``settings.watching.inactivity_timeout``) and relists on ``410 Gone``; what nothing checked
is that the watch then delivers again. The job loop's timer (which runs on its own schedule,
not on watch events) knows when it wrote a policy's status; the watch must bring that write back
(a new ``resourceVersion`` in the body kopf hands the timer) within ``bound_s``. ``EchoTracker``
keeps the writes not yet echoed; the ``policy_watch`` probe (``handlers``) fails while one is
older than the bound, so the kubelet restarts an operator whose watches went silent. With no
status writes there is nothing to wait for: a quiet cluster stays live.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

BOUND_S = 180.0
"""A write must come back through the watch within this long: above kopf's 70 s inactivity
reconnect plus a relist and a loop period, below the kubelet's patience of minutes."""


class EchoTracker:
    """Status writes waiting for their watch event, per object.

    Args:
        bound_s: how long a write may wait, s.
        clock: monotonic time source, s.
    """

    def __init__(self, bound_s: float = BOUND_S, clock: Callable[[], float] = time.monotonic):
        self.bound_s = bound_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[Hashable, tuple[str, float]] = {}

    def seen(self, key: Hashable, resource_version: str) -> None:
        """The timer got ``key``'s body at ``resource_version``: a write before it came back."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None and pending[0] != resource_version:
                del self._pending[key]

    def wrote(self, key: Hashable, resource_version: str) -> None:
        """``key`` was patched from a body at ``resource_version`` (its echo is awaited)."""
        with self._lock:
            self._pending.setdefault(key, (resource_version, self._clock()))

    def forget(self, key: Hashable) -> None:
        """``key`` is gone (deleted): nothing to wait for."""
        with self._lock:
            self._pending.pop(key, None)

    def overdue(self) -> dict[Hashable, float]:
        """Objects whose write has waited longer than the bound, with the wait, s."""
        now = self._clock()
        with self._lock:
            return {
                k: now - t for k, (_, t) in self._pending.items() if now - t > self.bound_s
            }
