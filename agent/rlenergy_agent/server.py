"""The agent's listeners: the trainer signal socket, the TLS signal port, the health/metrics port.

* Signals: HTTP over a Unix socket (``/v1/phase``, ``/v1/progress``, ``/v1/step``, engine
  sleeps ``/v1/sleep``; FlexFloor: ``/v1/park``, ``/v1/unpark``, ``/v1/rollout``,
  ``/v1/rollout/lost``), mounted into trainer pods; bodies and answers are the models of
  ``rlenergy.api.signals``. Each request carries the pod's projected service-account token
  (``Authorization: Bearer``); ``identity.TokenAuthenticator`` checks it (TokenReview,
  cached) and ``identity.authorize`` decides, in one place, that the pod is on this node and
  names only its own GPUs; the agent then requires the pod to be one the serving policy selects
  (``state.AgentState.check_selected``). No token or a bad one: 401; another node's pod,
  another pod's GPUs or a pod the policy does not select: 403. While the agent stops or has
  not yet discovered its policy, and for a pod it governs that discovery dropped for a moment:
  503 (retry), never a 403 that a trainer takes as final.
* The same signals over TLS on a TCP port of the node's IP (``TlsSignalServer``): trainer
  pods reach it at their ``status.hostIP`` and need no hostPath (Pod Security
  ``restricted``); the serving certificate is the node's (``tlsserve``), signed by the CA the
  pod's injected volume carries. The bearer token and every check above are the same.
* Health and metrics: HTTP on ``127.0.0.1`` by default: ``/metrics`` (scrape-time collection),
  ``/healthz`` (NVML answers on some GPU), ``/readyz`` (GPUs discovered, the signal socket
  still the one bound here). The plan is not served here (it is the policy's;
  ``rlenergy_agent_plan_step`` says which step it is for).

Both listeners are bounded (``endpoint``): a connection cap, header size and count caps, an
overall request deadline. The socket is the agent's own: it starts only on a free path or a
stale socket and removes at shutdown only the inode it bound (``endpoint.claim_socket_path``,
``endpoint.SocketOwner``).

Callers: ``rlenergy_agent.__main__``.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import socketserver
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic

from rlenergy.api import node as api_node
from rlenergy.api import signals
from rlenergy_agent import endpoint, identity, metrics, service

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
"""Largest signal body accepted (a step's workload is a few hundred bytes); larger: 413."""
READ_TIMEOUT_S = endpoint.IDLE_TIMEOUT_S
"""A caller that stalls mid-request is dropped after this long (its thread is freed)."""
MAX_SIGNAL_CONNECTIONS = 64
"""Signal connections served at once [MODEL: 8 GPUs a node, a few connections per trainer
process; a thread each]; a further one is answered 503."""
MAX_OPS_CONNECTIONS = 8
"""Ops connections served at once (a scraper or two and the kubelet's probes)."""
SOCKET_WAIT_S = 30.0
"""Longest the agent waits at start-up for another listener (the agent it replaces in a
rolling update) to leave the socket path, s."""


class _UnixHTTPServer(endpoint.BoundedServer, socketserver.UnixStreamServer):
    max_connections = MAX_SIGNAL_CONNECTIONS
    name = "signals"

    def __init__(self, path: str, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self.start_bounds()
        super().__init__(path, handler)


class _TlsHTTPServer(endpoint.BoundedServer, http.server.HTTPServer):
    max_connections = MAX_SIGNAL_CONNECTIONS
    name = "signals-tls"

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[http.server.BaseHTTPRequestHandler],
        certificate: endpoint.ServingCertificate,
    ) -> None:
        self.start_bounds()
        self.certificate = certificate
        self.handshake_failures = 0
        """Connections closed before a complete TLS handshake."""
        super().__init__(address, handler)


class _OpsHTTPServer(endpoint.BoundedServer, http.server.HTTPServer):
    max_connections = MAX_OPS_CONNECTIONS
    name = "ops"

    def __init__(
        self, address: tuple[str, int], handler: type[http.server.BaseHTTPRequestHandler]
    ) -> None:
        self.start_bounds()
        super().__init__(address, handler)


def _dump(answer: pydantic.BaseModel) -> dict[str, Any]:
    return answer.model_dump(by_alias=True, mode="json")


def dispatch(
    agent: service.Agent, pod: service.PodRef, req: pydantic.BaseModel, received_s: float
) -> pydantic.BaseModel:
    """Run one authorized signal on the agent; returns its answer model.

    Raises:
        service.SignalRefused: the agent refused it (status in the exception).
    """
    who = str(pod)
    if isinstance(req, signals.PhaseRequest):
        res = agent.phase(pod, req.phase, req.step, gpu_uuids=req.gpus, received_s=received_s)
        return signals.PhaseAnswer(
            pod=who,
            gpus=list(res.gpus),
            latency_seconds=res.latency_s,
            applied={
                u: signals.AppliedClock(
                    requested_mhz=r.requested_mhz,
                    target_mhz=r.target_mhz,
                    effective_mhz=r.effective_mhz,
                    skipped=r.skipped,
                    error=r.error,
                )
                for u, r in res.applied.items()
            },
            plan_phases=list(res.plan_phases),
            boundary_monotonic_seconds=res.boundary_s,
        )
    if isinstance(req, signals.ProgressRequest):
        # total: cumulative progress of the current phase (preferred: probe slices
        # interpolate it); amount: work done since the last report.
        if req.total is not None:
            agent.progress_total(pod, req.total, req.at_monotonic_seconds, req.in_flight)
        elif req.amount is not None:
            agent.progress(pod, req.amount, req.in_flight)
        return signals.PodAnswer(pod=who)
    if isinstance(req, signals.StepRequest):
        energy = agent.end_step(pod, req.step, req.workload)
        return signals.StepAnswer(pod=who, phase_energy_joules=energy)
    if isinstance(req, signals.ParkRequest):
        parked = agent.park(pod, req.step, gpu_uuids=req.gpus)
        return signals.ParkAnswer(
            pod=who,
            parked={u: signals.ParkedGpu(clock_mhz=c) for u, c in parked.parked.items()},
            already=list(parked.already),
            applied={
                u: signals.ParkApplied(effective_mhz=r.effective_mhz, error=r.error)
                for u, r in parked.applied.items()
            },
        )
    if isinstance(req, signals.UnparkRequest):
        released = agent.unpark(pod, gpu_uuids=req.gpus)
        return signals.UnparkAnswer(pod=who, released_gpu_seconds=released)
    if isinstance(req, api_node.RolloutDispatch):
        agent.publish_rollout(pod, req)
        return signals.PodAnswer(pod=who)
    if isinstance(req, signals.SleepRequest):
        return signals.SleepAnswer(pod=who, check=agent.sleep(pod, req.step, req.stage))
    if isinstance(req, signals.LostWorkersRequest):
        return signals.LostWorkersAnswer(pod=who, lost_workers=list(agent.lost_workers))
    raise TypeError(f"no handler for {type(req).__name__}")


class _Handler(endpoint.BoundedHandler):
    server_version = "rlenergy-agent"
    agent: service.Agent
    auth: identity.TokenAuthenticator

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("signal %s", format % args)

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except ConnectionError as exc:  # the caller left (e.g. a stalled body, then closed)
            self.close_connection = True
            log.debug("signal answer %d not delivered: %s", status, exc)

    def _refuse(self, status: int, message: str) -> None:
        self._answer(status, _dump(signals.ErrorAnswer(error=message)))

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        received = time.monotonic()
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self.close_connection = True  # the body cannot be framed
            self._refuse(400, "bad request: Content-Length is not a number")
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read
            self._refuse(
                413 if length > 0 else 400,
                f"request body too large: Content-Length {length} (limit {MAX_BODY_BYTES} bytes)"
                if length > 0
                else f"bad request: negative Content-Length {length}",
            )
            return
        # Read (at most MAX_BODY_BYTES) before the token check, so a refused caller's connection
        # stays framed and its client can retry on it.
        raw = self.rfile.read(length) or b"{}"
        try:
            self.agent.check_serving()  # stopping, or no policy discovered yet: 503
        except service.SignalRefused as exc:
            self._refuse(exc.status, str(exc))
            return
        try:
            caller = self.auth.authenticate(self.headers.get("Authorization"))
        except identity.AuthError as exc:
            if exc.status != 503:
                self.agent.refused += 1
            self._refuse(exc.status, str(exc))
            return
        model = signals.REQUESTS.get(self.path)
        if model is None:
            self._refuse(404, f"no endpoint {self.path} (known: {', '.join(signals.REQUESTS)})")
            return
        try:
            req = model.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            self._refuse(400, f"bad request: {exc}")
            return
        try:
            pod = identity.authorize(self.agent, caller, signals.requested_gpus(req))
            self.agent.check_selected(pod)
            self._answer(200, _dump(dispatch(self.agent, pod, req, received)))
        except identity.AuthError as exc:
            self._refuse(exc.status, str(exc))
        except service.SignalRefused as exc:
            self._refuse(exc.status, str(exc))
        except (ValueError, TypeError) as exc:
            self._refuse(400, f"bad request: {exc}")


class SignalServer:
    """The Unix-socket signal listener.

    Args:
        path: socket path (its folder is created; mode 0666 so non-root trainers can connect:
            authentication is by the pod's token, not by file mode; trainers mount the folder
            read-only, so they can connect but not rename, remove or replace the socket).
        agent: the agent.
        auth: checks each request's bearer token.
        wait_s: longest wait for another listener to leave ``path``, s.

    Raises:
        endpoint.SocketPathError: ``path`` is not a socket (a directory, a file), or another
            listener keeps it past ``wait_s``.
    """

    def __init__(
        self,
        path: Path,
        agent: service.Agent,
        auth: identity.TokenAuthenticator,
        *,
        wait_s: float = SOCKET_WAIT_S,
    ) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        endpoint.claim_socket_path(path, wait_s)
        handler = type("Handler", (_Handler,), {"agent": agent, "auth": auth})
        self._server = _UnixHTTPServer(str(path), handler)
        self.owner = endpoint.SocketOwner.of(path)
        self._reported = False
        os.chmod(path, 0o666)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="signals", daemon=True
        )

    def start(self) -> None:
        """Serve on a thread."""
        self._thread.start()

    @property
    def server(self) -> endpoint.BoundedServer:
        """The listener (its connection counts, for tests and metrics)."""
        return self._server

    def intact(self) -> bool:
        """Whether the socket path still holds the socket bound here (``/readyz``).

        False when something renamed, removed or replaced it (a trainer whose mount of the
        socket folder is writable): trainers would reach whatever listens there now, so the
        agent reports not ready and logs an error once.
        """
        ok = self.owner.holds()
        if not ok and not self._reported:
            log.error(
                "signal socket %s is no longer the one this agent bound (renamed, removed or "
                "replaced): trainers cannot reach the agent; mount %s read-only in trainer pods",
                self.path,
                self.path.parent,
            )
        self._reported = not ok
        return ok

    def stop(self) -> None:
        """Stop serving and remove the socket, if the path still holds the one bound here."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._server.stop_bounds()
        self.owner.release()


class TlsSignalServer:
    """The TLS signal listener on ``host:port`` (the node's IP; port 0 picks a free one).

    Args:
        host: address to listen on (``0.0.0.0`` in a hostNetwork agent: the node's IPs).
        port: TCP port.
        agent: the agent.
        auth: checks each request's bearer token (as on the socket).
        certificate: the serving certificate files (re-read when they change).
    """

    def __init__(
        self,
        host: str,
        port: int,
        agent: service.Agent,
        auth: identity.TokenAuthenticator,
        certificate: endpoint.ServingCertificate,
    ) -> None:
        # HTTP/1.1: the connection stays open after an answer (every answer has a
        # Content-Length, every refusal reads its body or closes), so the SDK's one connection
        # carries all of a trainer's signals and pays one handshake; with HTTP/1.0 (the socket
        # listener's, where a connection costs no handshake) each signal paid one. TCP_NODELAY:
        # an answer's headers and body are two writes, and on a kept connection Nagle held the
        # body until the caller's delayed ACK (40 ms on Linux) of the headers.
        handler = type(
            "TlsHandler",
            (endpoint.TlsHandlerMixin, _Handler),
            {
                "agent": agent,
                "auth": auth,
                "protocol_version": "HTTP/1.1",
                "disable_nagle_algorithm": True,
            },
        )
        self._server = _TlsHTTPServer((host, port), handler, certificate)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="signals-tls", daemon=True
        )

    def start(self) -> None:
        """Serve on a thread."""
        self._thread.start()

    @property
    def server(self) -> _TlsHTTPServer:
        """The listener (its connection and handshake counts, for tests and metrics)."""
        return self._server

    def stop(self) -> None:
        """Stop serving."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._server.stop_bounds()


METRICS_REUSE_S = 1.0
"""A rendered /metrics page is served again to scrapes within this long, s: concurrent
scrapers share one rendering (scrape intervals are 15-60 s), so their CPU, which competes with
the signal threads for the interpreter, does not grow with their number."""


class MetricsPage:
    """The /metrics exposition, rendered at most once per ``METRICS_REUSE_S``.

    Args:
        agent: the agent.
        health: whether NVML answers (``nvml_up``).
        clock: monotonic time, s.
    """

    def __init__(
        self,
        agent: service.Agent,
        health: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent = agent
        self.health = health
        self._clock = clock
        self._lock = threading.Lock()
        self._at: float | None = None
        self._data = b""
        self.renders = 0
        """Renderings made (scrapes beyond them were served the newest)."""

    def get(self) -> bytes:
        """The newest rendering, rendered now if older than ``METRICS_REUSE_S``."""
        with self._lock:  # one rendering at a time; scrapes arriving meanwhile reuse it
            now = self._clock()
            if self._at is None or now - self._at >= METRICS_REUSE_S:
                self._data = metrics.render(self.agent, self.health)
                self._at = self._clock()
                self.renders += 1
            return self._data


class _OpsHandler(endpoint.BoundedHandler):
    server_version = "rlenergy-agent"
    agent: service.Agent
    health: Callable[[], bool]
    ready: Callable[[], bool]
    page: MetricsPage

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("ops %s", format % args)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self.path == "/metrics":
            data = self.page.get()
            self.send_response(200)
            self.send_header("Content-Type", metrics.CONTENT_TYPE)
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
            {
                "agent": agent,
                "health": staticmethod(health),
                "ready": staticmethod(ready),
                "page": MetricsPage(agent, health),
            },
        )
        self._server = _OpsHTTPServer((host, port), handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="ops", daemon=True)

    def start(self) -> None:
        """Serve on a thread."""
        self._thread.start()

    @property
    def server(self) -> endpoint.BoundedServer:
        """The listener (its connection counts, for tests)."""
        return self._server

    def stop(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._server.stop_bounds()
