"""The agent's two listeners: the trainer signal socket and the health/metrics port.

* Signals: HTTP over a Unix socket (``/v1/phase``, ``/v1/progress``, ``/v1/step``; FlexFloor:
  ``/v1/park``, ``/v1/unpark``, ``/v1/rollout``), mounted into trainer pods. The caller is
  authenticated by the socket's peer credentials (SO_PEERCRED: the kernel's pid, never a claim
  of the caller) mapped to its pod through the pid's cgroup (the kubelet names pod cgroups
  ``pod<uid>``); a signal is accepted only for that pod's own GPUs.
* Health and metrics: HTTP on ``127.0.0.1`` by default: ``/metrics`` (scrape-time collection),
  ``/healthz`` (NVML answers on some GPU, case #11a), ``/readyz`` (GPUs discovered, plan known).

Callers: ``rlenergy_agent.__main__``.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic

from rlenergy.api import node as api_node
from rlenergy_agent import metrics, service

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
"""Largest signal body accepted (a step's workload is a few hundred bytes); larger: 413."""
READ_TIMEOUT_S = 10.0
"""A caller that stalls mid-request is dropped after this long (its thread is freed)."""

PodResolver = Callable[[int], service.PodRef | None]
"""Maps a caller's pid to its pod (``None``: not a pod this agent knows)."""

_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)


def pod_uid_of_pid(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The pod UID in a process's cgroup path (cgroupfs ``pod<uid>`` or systemd ``pod<u_i_d>``).

    Args:
        pid: the process.
        proc: the proc filesystem (tests pass a fake tree).

    Returns:
        The UID with dashes, or ``None`` when the process is not in a pod cgroup.
    """
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    m = _POD_UID.search(text)
    return m.group(1).replace("_", "-") if m else None


def cgroup_resolver(agent: service.Agent, proc: Path = Path("/proc")) -> PodResolver:
    """A resolver that maps pid -> pod UID (cgroup) -> the pod holding GPUs with that UID."""

    def resolve(pid: int) -> service.PodRef | None:
        uid = pod_uid_of_pid(pid, proc)
        if uid is None:
            return None
        for pod in agent.podmap.pods():
            if pod.uid == uid:
                return pod
        return None

    return resolve


def same_user_resolver(pod: service.PodRef, proc: Path = Path("/proc")) -> PodResolver:
    """Development only: callers running as the agent's own Unix user are ``pod``."""
    me = os.getuid()

    def resolve(pid: int) -> service.PodRef | None:
        try:
            owner = (proc / str(pid)).stat().st_uid
        except OSError:
            return None
        return pod if owner == me else None

    return resolve


def peer_pid(sock: socket.socket) -> int:
    """The connecting process's pid from SO_PEERCRED (Linux)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "rlenergy-agent"
    timeout = READ_TIMEOUT_S
    agent: service.Agent
    resolve: PodResolver

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("signal %s", format % args)

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        received = time.monotonic()
        try:
            pid = peer_pid(self.request)
        except OSError:
            self._answer(401, {"error": "no peer credentials"})
            return
        pod = self.resolve(pid)
        if pod is None:
            self.agent.refused += 1
            self._answer(403, {"error": f"pid {pid} is not in a pod holding GPUs on this node"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self._answer(400, {"error": "bad request: Content-Length is not a number"})
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read
            self._answer(
                413 if length > 0 else 400,
                {
                    "error": f"request body too large: Content-Length {length} "
                    f"(limit {MAX_BODY_BYTES} bytes)"
                    if length > 0
                    else f"bad request: negative Content-Length {length}"
                },
            )
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            if self.path == "/v1/phase":
                res = self.agent.phase(
                    pod,
                    str(body["phase"]),
                    int(body["step"]),
                    gpu_uuids=[str(g) for g in body.get("gpus", [])],
                    received_s=received,
                )
                self._answer(
                    200,
                    {
                        "pod": str(pod),
                        "gpus": list(res.gpus),
                        "latencySeconds": res.latency_s,
                        "applied": {
                            u: {
                                "requestedMHz": r.requested_mhz,
                                "targetMHz": r.target_mhz,
                                "effectiveMHz": r.effective_mhz,
                                "skipped": r.skipped,
                                "error": r.error,
                            }
                            for u, r in res.applied.items()
                        },
                    },
                )
            elif self.path == "/v1/progress":
                # {"total": x}: cumulative progress of the current phase (preferred: probe
                # slices interpolate it); {"amount": x}: work done since the last report.
                if "total" in body:
                    at = body.get("atMonotonicSeconds")
                    self.agent.progress_total(
                        pod, float(body["total"]), None if at is None else float(at)
                    )
                else:
                    self.agent.progress(pod, float(body["amount"]))
                self._answer(200, {"pod": str(pod)})
            elif self.path == "/v1/step":
                workload = api_node.TokenWorkloadReport.model_validate(body["workload"])
                self.agent.end_step(pod, int(body["step"]), workload)
                self._answer(200, {"pod": str(pod)})
            elif self.path == "/v1/park":
                # {"step": s, "gpus": [...]}: a released rollout worker (FlexFloor).
                parked = self.agent.park(
                    pod, int(body["step"]), gpu_uuids=[str(g) for g in body.get("gpus", [])]
                )
                self._answer(
                    200,
                    {
                        "pod": str(pod),
                        "parked": {u: {"clockMHz": c} for u, c in parked.parked.items()},
                        "already": list(parked.already),
                        "applied": {
                            u: {"effectiveMHz": r.effective_mhz, "error": r.error}
                            for u, r in parked.applied.items()
                        },
                    },
                )
            elif self.path == "/v1/unpark":
                released = self.agent.unpark(pod, gpu_uuids=[str(g) for g in body.get("gpus", [])])
                self._answer(200, {"pod": str(pod), "releasedGpuSeconds": released})
            elif self.path == "/v1/rollout":
                self.agent.publish_rollout(pod, api_node.RolloutDispatch.model_validate(body))
                self._answer(200, {"pod": str(pod)})
            else:
                self._answer(404, {"error": f"no endpoint {self.path}"})
        except service.SignalRefused as exc:
            self._answer(exc.status, {"error": str(exc)})
        except (KeyError, ValueError, TypeError, pydantic.ValidationError) as exc:
            self._answer(400, {"error": f"bad request: {exc}"})


class SignalServer:
    """The Unix-socket signal listener.

    Args:
        path: socket path (its folder is created; mode 0666 so non-root trainers can connect:
            authentication is by peer credentials, not by file mode).
        agent: the agent.
        resolve: pid -> pod.
    """

    def __init__(self, path: Path, agent: service.Agent, resolve: PodResolver) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            path.unlink()
        handler = type("Handler", (_Handler,), {"agent": agent, "resolve": staticmethod(resolve)})
        self._server = _UnixHTTPServer(str(path), handler)
        os.chmod(path, 0o666)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="signals", daemon=True
        )

    def start(self) -> None:
        """Serve on a thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and remove the socket."""
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


class _OpsHandler(http.server.BaseHTTPRequestHandler):
    server_version = "rlenergy-agent"
    agent: service.Agent
    health: Callable[[], bool]
    ready: Callable[[], bool]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("ops %s", format % args)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self.path == "/metrics":
            data = metrics.render(self.agent, self.health)
            self.send_response(200)
            self.send_header("Content-Type", metrics.CONTENT_TYPE)
        elif self.path == "/v1/plan":
            plan = self.agent.plan
            data = (plan.model_dump_json(by_alias=True) if plan is not None else "null").encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        elif self.path in ("/healthz", "/readyz"):
            ok = self.health() if self.path == "/healthz" else self.ready()
            data = b"ok\n" if ok else b"not ok\n"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
        else:
            data = b"not found\n"
            self.send_response(404)
            self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class OpsServer:
    """``/metrics``, ``/healthz``, ``/readyz`` on ``host:port`` (port 0 picks a free one)."""

    def __init__(
        self,
        host: str,
        port: int,
        agent: service.Agent,
        health: Callable[[], bool],
        ready: Callable[[], bool],
    ) -> None:
        handler = type(
            "OpsHandler",
            (_OpsHandler,),
            {"agent": agent, "health": staticmethod(health), "ready": staticmethod(ready)},
        )
        self._server = http.server.ThreadingHTTPServer((host, port), handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="ops", daemon=True)

    def start(self) -> None:
        """Serve on a thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
