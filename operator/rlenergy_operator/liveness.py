"""Liveness that means it: the operator's probe fails when its watches stopped delivering.

kopf answers ``/healthz`` with 200 as long as its event loop runs, also with no watch running.
kopf reconnects a stream that is silent (no event, no bookmark) for 70 s
(``settings.watching.inactivity_timeout``), ends each watch request server-side after
``watching.server_timeout`` and client-side after ``watching.client_timeout`` (both set in
``settings.configure_kopf``), and relists on ``410 Gone``; what nothing checked is that the
watch then delivers again. Two checks, each pure here, read by the ``policy_watch`` probe
(``handlers``), which fails so the kubelet restarts an operator whose watches went silent:

* ``EchoTracker``: the job loop's timer (which runs on its own schedule, not on watch events)
  knows when it wrote a policy's status; the watch must bring that write back (a new
  ``resourceVersion`` in the body kopf hands the timer) within ``bound_s``.
* ``WatchLag``: with all watches silent nothing is written, so nothing waits for an echo. A
  periodic metadata-only read of the watched objects (the ``policy_watch_check`` timer) finds
  objects the API server has at versions the watches never delivered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping

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
            return {k: now - t for k, (_, t) in self._pending.items() if now - t > self.bound_s}


WatchKey = tuple[str, str, str]
"""(plural, namespace, name) of a watched object."""


class WatchLag:
    """What the API server has against what the watches delivered, per object.

    A status write is one way to see a silent watch (``EchoTracker``); with all watches silent
    the job loop reads its node reports from a watch-fed index, sees nothing new, writes
    nothing, and nothing waits. So a periodic read asks the API server itself: a metadata-only
    list of the watched objects (``rlenergy_operator.kube.watched_versions``, one request per
    kind and served namespace) gives each object's ``resourceVersion``. An object listed at a
    version the watch has not delivered becomes *pending* from the read's start; it stops
    pending when the watch delivers any new version of it (a lagging but live watch), when a
    later read lists the version the watch delivered, or when it is no longer listed
    (deleted). ``silent`` names the objects pending longer than ``bound_s``: the watch that
    should bring them is silent (no event, no bookmark is what kopf resumes from; a relist
    after ``410 Gone`` delivers every object again and clears them).

    Versions are compared for equality only, per object: Kubernetes makes no promise that
    ``resourceVersion`` strings are ordered.

    The API server unreachable (or answering errors) is not judged: the watches cannot
    deliver either, and a restart would not help; ``unreachable`` drops what is pending and
    the next successful read starts over. Reads that stop (no policy left, so no timer runs,
    or a standby replica that kopf's peering paused, which stops its timers and watches)
    are not judged either: after ``stale_s`` with no read, nothing is silent.

    Args:
        bound_s: how long an object may stay pending, s.
        stale_s: a read older than this is not judged; a read after such a gap starts over, s.
        clock: monotonic time source, s.
    """

    def __init__(
        self,
        bound_s: float = BOUND_S,
        stale_s: float = 3 * BOUND_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound_s = bound_s
        self.stale_s = stale_s
        self._clock = clock
        self._lock = threading.Lock()
        self._delivered: dict[WatchKey, tuple[str, float]] = {}  # version, when
        self._pending: dict[WatchKey, tuple[str | None, float]] = {}  # delivered then, since
        self._read_at: float | None = None  # the last successful read's start
        self._tried_at = float("-inf")  # the last read's start or end, successful or not
        self._reading = False  # a read started and has not ended (listed / unreachable)

    def due(self, interval_s: float) -> bool:
        """Whether a read is due (then this one is).

        Due when none is running and none started or ended in the last ``interval_s`` s.

        Every policy's timer asks; one read serves them all. A read ends with ``listed`` or
        ``unreachable``. Reads never overlap: on a slow API server (``bench/scale.py``, 250
        nodes on a loaded machine) reads that each waited out the request timeout had piled
        up four and five at a time, each holding a handler thread and each asking the API
        server for every object again.
        """
        now = self._clock()
        with self._lock:
            if self._reading or now - self._tried_at < interval_s:
                return False
            self._tried_at, self._reading = now, True
            return True

    def now(self) -> float:
        """The tracker's clock, s (take it before a read: ``listed``'s ``started_s``)."""
        return self._clock()

    def delivered(self, key: WatchKey, resource_version: str) -> None:
        """The watch brought ``key`` at ``resource_version``."""
        with self._lock:
            self._delivered[key] = (resource_version, self._clock())
            pending = self._pending.get(key)
            if pending is not None and pending[0] != resource_version:
                del self._pending[key]

    def listed(self, versions: Mapping[WatchKey, str], started_s: float) -> None:
        """A read that started at ``started_s`` (``now``) listed these objects at these versions.

        Objects delivered before the read started and not listed are gone: forgotten.
        """
        with self._lock:
            self._reading, self._tried_at = False, self._clock()
            if self._read_at is None or started_s - self._read_at > self.stale_s:
                self._pending.clear()  # no read for a while: start over
            self._read_at = started_s
            for key in [k for k in self._pending if k not in versions]:
                del self._pending[key]
            for key in [k for k, (_, t) in self._delivered.items() if t < started_s]:
                if key not in versions:
                    del self._delivered[key]
            for key, version in versions.items():
                seen = self._delivered.get(key)
                if seen is not None and seen[0] == version:
                    self._pending.pop(key, None)
                elif key not in self._pending:
                    self._pending[key] = (None if seen is None else seen[0], started_s)

    def unreachable(self) -> None:
        """A read failed (API server unreachable or erring): nothing is judged until the next."""
        with self._lock:
            self._reading, self._tried_at = False, self._clock()
            self._pending.clear()
            self._read_at = None

    def silent(self) -> dict[WatchKey, float]:
        """Objects the watch has not delivered for longer than the bound, with the wait, s.

        Empty while the last read failed or is older than ``stale_s``.
        """
        now = self._clock()
        with self._lock:
            if self._read_at is None or now - self._read_at > self.stale_s:
                return {}
            return {k: now - t for k, (_, t) in self._pending.items() if now - t > self.bound_s}
