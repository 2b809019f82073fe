"""The inference engines of this pod: where verl's rollout servers serve their metrics.

verl 0.9.1 runs each rollout replica's engine in its own Ray actor process,
``vLLMHttpServer`` (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``) or
``SGLangHttpServer`` (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``), next to
the GPU workers of the same node; ``launch_server`` ends with the engine's OpenAI-compatible
HTTP server listening on ``(self._server_address, self._server_port)`` (verl's ``run_uvicorn``),
and that server serves the engine's Prometheus exposition on ``/metrics`` (vLLM:
``vllm/entrypoints/serve/instrumentator/metrics.py`` ``attach_router``; SGLang with
``enable_metrics``, which verl sets when ``rollout.prometheus.enable`` or the engine kwargs
ask for it). The process that signals the pod's phases (``LOCAL_RANK`` 0 of a GPU worker) is a
different process, so the servers publish where they listen (:func:`publish`, called by the
hook's wrapper of ``launch_server``) in a folder every process of the pod shares
(``RLENERGY_ENGINE_DIR``, default ``/tmp/rlenergy-engines``, one JSON file per server), and the
signalling process reads them all (:class:`PodEngines`): the pod's decoded tokens are the sum
over its engines, as the agent governs every GPU of the calling pod.

A file whose writer's process is gone (a crashed or earlier run; pid and start time) is
skipped. Standard library
only; the metrics are parsed by ``rlenergy.sdk.progress`` (prometheus-client, in every engine
image). Callers: ``rlenergy.sdk.verl_hook``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from rlenergy.sdk import progress

ENGINE_DIR_ENV = "RLENERGY_ENGINE_DIR"
DEFAULT_ENGINE_DIR = "/tmp/rlenergy-engines"  # noqa: S108 - the pod's own /tmp, shared by its processes


def engine_dir() -> Path:
    """The pod's engine folder (``RLENERGY_ENGINE_DIR``, default ``/tmp/rlenergy-engines``)."""
    return Path(os.environ.get(ENGINE_DIR_ENV) or DEFAULT_ENGINE_DIR)


def metrics_url(host: str, port: int) -> str:
    """``http://host:port/metrics`` (an IPv6 host in brackets)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{int(port)}/metrics"


def publish(engine: str, url: str, *, directory: Path | None = None) -> Path:
    """Record that an ``engine`` server of this process serves its metrics at ``url``.

    Written atomically (rename) as ``<pid>-<n>.json`` with ``{"engine", "url", "pid",
    "started"}`` (the process's start time: a later process that reuses the pid is not it).

    Raises:
        ValueError: an engine without a pinned token counter (``progress.ENGINES``).
    """
    progress.engine_counter(engine)
    folder = directory or engine_dir()
    folder.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    n = len(list(folder.glob(f"{pid}-*.json")))
    path = folder / f"{pid}-{n}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".publish-")
    with os.fdopen(fd, "w") as f:
        json.dump({"engine": engine, "url": url, "pid": pid, "started": _started(pid)}, f)
    Path(tmp).replace(path)
    return path


def _started(pid: int) -> str | None:
    """The process's start time, or ``None`` without ``/proc``.

    ``/proc/<pid>/stat`` field 22 (clock ticks since boot, ``proc(5)``): with the pid it names
    one process, never a later one that reused the pid.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return started is None or _started(pid) in (None, started)


def published(directory: Path | None = None) -> list[progress.HttpExposition]:
    """The engines published in the folder whose processes still run (sorted by file name)."""
    folder = directory or engine_dir()
    out: list[progress.HttpExposition] = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
            pid, engine, url = int(entry["pid"]), str(entry["engine"]), str(entry["url"])
            started = entry.get("started")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if _alive(pid, None if started is None else str(started)):
            out.append(progress.HttpExposition(url, engine))
    return out


class PodEngines:
    """Decoded tokens and held requests summed over the pod's published engines.

    The folder is read on every call (a server that starts later is picked up at once; its
    tokens count from its first read on). Each engine keeps its own per-series tracking
    (``progress.HttpExposition``), and an engine whose process is gone (its entry no longer
    listed) keeps its last total counted: the pod's total never falls when an engine or one of
    its ranks goes away. The read that finds an engine gone raises ``progress.EngineLost``
    once (the verl hook aborts the generation window on it); later reads go on without it.

    Args:
        directory: the engine folder (default :func:`engine_dir`).

    Raises (from ``total`` / ``activity``):
        progress.ProgressUnavailable: no engine published, or one that is listed cannot be
            read (a partial sum would miss that engine's progress).
        progress.MetricsUnavailable: an engine serves none of its counter's known names.
        progress.EngineLost: an engine read before is no longer listed (once per engine).
    """

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self._engines_by_url: dict[tuple[str, str], progress.HttpExposition] = {}
        self._gone = 0.0

    def _engines(self) -> list[progress.HttpExposition]:
        listed = {(e.engine, e.url): e for e in published(self.directory)}
        lost = [k for k in self._engines_by_url if k not in listed]
        for key in lost:
            self._gone += self._engines_by_url.pop(key).last_total or 0.0
        if lost:
            raise progress.EngineLost(
                ", ".join(f"{engine} at {url}" for engine, url in lost)
                + " stopped (its process ended)"
            )
        for key, fresh in listed.items():
            self._engines_by_url.setdefault(key, fresh)
        if not listed:
            raise progress.ProgressUnavailable(
                f"no inference engine published in {self.directory or engine_dir()} (the "
                "rollout servers publish there from rlenergy.sdk.verl_hook.install)"
            )
        return [self._engines_by_url[k] for k in listed]

    @property
    def variant(self) -> str | None:
        """The metric variants the engines matched (``progress.VARIANTS``), comma-joined."""
        names = sorted({e.variant for e in self._engines_by_url.values() if e.variant})
        return ",".join(names) or None

    def total(self) -> float:
        """Tokens the pod's engines decoded so far."""
        engines = self._engines()  # first: it books the engines that went away
        return self._gone + sum(e.total() for e in engines)

    def activity(self) -> tuple[float, float]:
        """(requests the pod's engines hold now, tokens they decoded so far)."""
        engines = self._engines()
        held, tokens = 0.0, self._gone
        for e in engines:
            h, t = e.activity()
            held, tokens = held + h, tokens + t
        return held, tokens


__all__ = [
    "DEFAULT_ENGINE_DIR",
    "ENGINE_DIR_ENV",
    "PodEngines",
    "engine_dir",
    "metrics_url",
    "publish",
    "published",
]
