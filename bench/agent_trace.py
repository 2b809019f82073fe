"""Run ``rlenergy-agent`` with each signal's time taken apart (``bench/agent.py --trace``).

For every request on the signal socket it records the wall time of the handler, the thread's
CPU time, its run-queue wait (``/proc/thread-self/schedstat``, field 2: time runnable but not
running, i.e. the machine's other processes), the wait for the agent's lock, and the garbage
collections that ran meanwhile. What is left (wall - CPU - run-queue wait) is time the thread
slept: on the GIL, a lock, or I/O. So a tail can be put on the machine's load or on the agent's
own threads without an idle machine. At exit it writes the records as JSON to the file named by
``RLENERGY_AGENT_TRACE``.

    RLENERGY_AGENT_TRACE=/tmp/t.json python bench/agent_trace.py <rlenergy-agent arguments>
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import time
from typing import Any

from rlenergy_agent import __main__ as agent_main
from rlenergy_agent import server, service

_local = threading.local()
_gcs: list[int] = [0]


def _schedstat() -> tuple[int, int]:
    """(CPU ns, run-queue wait ns) of the calling thread."""
    with open("/proc/thread-self/schedstat") as f:
        cpu, wait, _slices = f.read().split()
    return int(cpu), int(wait)


class _TimedLock:
    """The agent's lock, timing the outermost acquire of each thread."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        depth = getattr(_local, "depth", 0)
        t0 = time.perf_counter()
        ok = bool(self.inner.acquire(blocking, timeout))
        if depth == 0:
            _local.lock_wait_s = getattr(_local, "lock_wait_s", 0.0) + time.perf_counter() - t0
        _local.depth = depth + 1
        return ok

    def release(self) -> None:
        _local.depth -= 1
        self.inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def main() -> int:
    """Install the timers, then run the agent with this process's arguments."""
    records: list[dict[str, Any]] = []
    init = service.Agent.__init__

    def agent_init(self: service.Agent, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._lock = _TimedLock(self._lock)  # type: ignore[assignment]

    service.Agent.__init__ = agent_init  # type: ignore[method-assign]
    gc.callbacks.append(lambda phase, info: _gcs.__setitem__(0, _gcs[0] + (phase == "stop")))
    post = server._Handler.do_POST

    def do_post(self: server._Handler) -> None:
        _local.lock_wait_s = 0.0
        g0 = _gcs[0]
        cpu0, rq0 = _schedstat()
        w0 = time.perf_counter()
        post(self)
        wall = time.perf_counter() - w0
        cpu1, rq1 = _schedstat()
        records.append(
            {
                "path": self.path,
                "wall_s": wall,
                "cpu_s": (cpu1 - cpu0) / 1e9,
                "runqueue_s": (rq1 - rq0) / 1e9,
                "lock_wait_s": _local.lock_wait_s,
                "gcs": _gcs[0] - g0,
            }
        )

    server._Handler.do_POST = do_post  # type: ignore[method-assign]

    def dump() -> None:
        with open(os.environ["RLENERGY_AGENT_TRACE"], "w") as f:
            json.dump(records, f)

    atexit.register(dump)
    return agent_main.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
