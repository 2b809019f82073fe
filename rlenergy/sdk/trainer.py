"""Trainer-side client of the node agent: phase signals, progress and token counts.

A trainer (verl, OpenRLHF, a custom loop) tells the node agent on its node when a phase starts,
how much work it did, and the step's token workload::

    client = RLEnergyClient()
    with client.phase("generation", step=12):
        ...  # rollout; client.progress_total(iterations_so_far) every few tens of ms
    client.phase("training", step=12)
    client.end_step(12, samples=256, response_tokens=..., prompt_tokens=..., valid_tokens=...)

The client reaches the node's agent one of two ways (``agent_endpoint``): a Unix socket mounted
into the pod (``RLENERGY_AGENT_SOCKET``, default ``/var/run/rlenergy/agent.sock``), used
whenever it is there; otherwise TLS to the agent's port on the node's IP
(``RLENERGY_AGENT_HOST``, the downward API's ``status.hostIP``, and ``RLENERGY_AGENT_PORT``),
verifying the agent's certificate against the CA bundle ``RLENERGY_AGENT_CA_FILE`` (default
``/var/run/secrets/rlenergy/ca.crt``). The admission webhook injects the environment, the token
and the CA bundle into pods that opt in (docs/verl.md). Each signal carries the pod's projected,
audience-bound service-account token as ``Authorization: Bearer`` (file
``RLENERGY_AGENT_TOKEN_FILE``, default ``/var/run/secrets/rlenergy/token``; re-read whenever the
kubelet rotates it, and once more after a 401); the agent checks it with a TokenReview and acts
only on that pod's own GPUs. Bodies and answers are the models of ``rlenergy.api.signals``.
Signals are best effort: when the agent is unreachable the client logs once and the trainer
carries on at default clocks (the agent never slows a job it cannot hear).
Callers: trainer code, ``rlenergy.sdk.verl``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import ssl
import stat
import threading
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from rlenergy.api import node as api_node
from rlenergy.api import signals

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/run/rlenergy/agent.sock"
SOCKET_ENV = "RLENERGY_AGENT_SOCKET"


class AgentRefusedError(Exception):
    """The agent answered with an error (4xx): the signal was not acted on.

    Args:
        status: HTTP status.
        message: the agent's reason.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"agent refused ({status}): {message}")
        self.status = status


class BearerToken:
    """The pod's projected token file, re-read when it changes (the kubelet rotates it).

    The kubelet swaps a projected volume's files atomically (a new ``..data`` folder), so a
    change of the file's inode, size or mtime is a new token; one ``stat`` per signal.

    Args:
        path: the token file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._header: str | None = None
        self._warned = False

    def header(self, *, reload: bool = False) -> str | None:
        """``Bearer <token>``, or ``None`` when no token was ever read.

        A re-read that fails (the file briefly missing while the kubelet swaps the volume, an
        I/O error, an empty read) keeps the last token read: the agent judges it, and the
        next signal reads the file again.
        """
        try:
            st = os.stat(self.path)
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            if reload or seen != self._seen:
                with open(self.path, encoding="utf-8") as f:
                    token = f.read().strip()
                if token:
                    self._header = f"Bearer {token}"
                    self._seen = seen
        except OSError as exc:
            self._seen = None  # read again at the next signal
            if self._header is not None:
                log.debug(
                    "token re-read from %s failed (%s): keeping the last token", self.path, exc
                )
            elif not self._warned:
                log.warning(
                    "no rlenergy agent token at %s (%s): mount the projected serviceAccountToken "
                    "volume (docs/verl.md); the agent will refuse the signals",
                    self.path,
                    exc,
                )
                self._warned = True
        return self._header


class Endpoint:
    """Where the agent listens for this pod: a Unix socket, or TLS on the node's IP.

    Args:
        socket_path: the Unix socket (``None``: TLS).
        host: the node's IP (TLS).
        port: the agent's TLS port.
        ca_file: the CA bundle that signs the agent's serving certificate.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        host: str = "",
        port: int = signals.DEFAULT_TLS_PORT,
        ca_file: str = signals.DEFAULT_CA_FILE,
    ) -> None:
        self.socket_path = socket_path
        self.host = host
        self.port = port
        self.ca_file = ca_file

    def __str__(self) -> str:
        if self.socket_path is not None:
            return self.socket_path
        return f"https://{self.host}:{self.port}"

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """A new connection (not yet connected).

        Raises:
            OSError: the CA bundle cannot be read (TLS).
            ssl.SSLError: the CA bundle is not PEM certificates.
        """
        if self.socket_path is not None:
            return _UnixConnection(self.socket_path, timeout_s)
        ctx = ssl.create_default_context(cafile=self.ca_file)
        return http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=ctx)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def agent_endpoint(
    socket_path: str | None = None, environ: Mapping[str, str] | None = None
) -> Endpoint:
    """Choose the agent endpoint: a mounted socket wins, then TLS on the node's IP.

    Args:
        socket_path: an explicit socket path (always used, mounted or not).
        environ: the environment (default ``os.environ``).

    Returns:
        The socket (``socket_path``, else ``RLENERGY_AGENT_SOCKET`` or the default path, when a
        socket is there or no ``RLENERGY_AGENT_HOST`` is set), else TLS to
        ``RLENERGY_AGENT_HOST:RLENERGY_AGENT_PORT`` with ``RLENERGY_AGENT_CA_FILE``.

    Raises:
        ValueError: ``RLENERGY_AGENT_PORT`` is not a port number.
    """
    env = os.environ if environ is None else environ
    if socket_path:
        return Endpoint(socket_path)
    path = env.get(SOCKET_ENV, DEFAULT_SOCKET)
    host = env.get(signals.HOST_ENV, "").strip()
    if _is_socket(path) or not host:
        return Endpoint(path)
    raw_port = env.get(signals.PORT_ENV, "").strip() or str(signals.DEFAULT_TLS_PORT)
    if not raw_port.isdecimal() or not 0 < int(raw_port) < 65536:
        raise ValueError(
            f"{signals.PORT_ENV}={raw_port!r} is not a port number (1-65535): set it to the "
            f"agent's TLS port (chart value agent.tlsPort, default {signals.DEFAULT_TLS_PORT})"
        )
    ca = env.get(signals.CA_FILE_ENV, "") or signals.DEFAULT_CA_FILE
    return Endpoint(None, host, int(raw_port), ca)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _PhaseContext:
    def __init__(self, client: RLEnergyClient, step: int) -> None:
        self._client = client
        self._step = step

    def __enter__(self) -> _PhaseContext:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self._client.phase("idle", step=self._step)


class RLEnergyClient:
    """Talks to the node agent (socket or TLS, ``agent_endpoint``); one persistent connection.

    Args:
        socket_path: the agent socket (default: ``agent_endpoint``: ``$RLENERGY_AGENT_SOCKET``
            or ``/var/run/rlenergy/agent.sock`` when a socket is there, else TLS to
            ``$RLENERGY_AGENT_HOST``).
        timeout_s: per request timeout, s (signals must not stall a trainer).
        strict: raise ``AgentRefusedError`` and ``OSError`` instead of logging (tests).
        gpus: GPU UUIDs this process drives (optional; the agent checks they are the pod's).
        token_file: the pod's projected token (default: ``$RLENERGY_AGENT_TOKEN_FILE`` or
            ``/var/run/secrets/rlenergy/token``).
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        timeout_s: float = 1.0,
        strict: bool = False,
        gpus: Sequence[str] = (),
        token_file: str | None = None,
    ) -> None:
        self.endpoint = agent_endpoint(socket_path)
        self.socket_path = self.endpoint.socket_path
        self.token = BearerToken(
            token_file or os.environ.get(signals.TOKEN_FILE_ENV, signals.DEFAULT_TOKEN_FILE)
        )
        self.timeout_s = timeout_s
        self.strict = strict
        self.gpus = list(gpus)
        self._conn: http.client.HTTPConnection | None = None
        self._post_lock = threading.Lock()
        """One request at a time on the connection (progress threads share the client)."""
        self._warned = False
        self.last_response: dict[str, Any] = {}
        self._plan_phases: tuple[str, ...] = ()

    @property
    def plan_phases(self) -> tuple[str, ...]:
        """Phase names of the agent's current plan, from the newest phase signal's answer.

        The policy's ``spec.phases`` as the agent follows them (``signals.PhaseAnswer.
        plan_phases``), in its order. Empty before the first answered phase signal, while the
        agent has no plan, or from an agent too old to say; a signal the agent did not answer
        (unreachable, refused) keeps the previous list. A trainer signals a training sub-phase
        under its own name only when it is listed here (``rlenergy.api.phases.signal_name``).
        """
        return self._plan_phases

    def _signal(self, path: str, model: type[pydantic.BaseModel], **fields: Any) -> dict[str, Any]:
        """Build the request (``rlenergy.api.signals``) and post it.

        Raises:
            pydantic.ValidationError: ``strict`` and the request is invalid (e.g. a negative
                step); otherwise it is logged and not sent.
        """
        try:
            message = model.model_validate(fields)
        except pydantic.ValidationError as exc:
            if self.strict:
                raise
            log.warning("rlenergy signal %s not sent: %s", path, exc)
            return {}
        return self._post(path, message)

    def _post(self, path: str, message: pydantic.BaseModel | dict[str, Any]) -> dict[str, Any]:
        """POST a request (a model, or a raw JSON object: tests of the agent's validation)."""
        with self._post_lock:
            return self._post_locked(path, message)

    def _post_locked(
        self, path: str, message: pydantic.BaseModel | dict[str, Any]
    ) -> dict[str, Any]:
        data = (
            message.model_dump_json(by_alias=True, exclude_none=True).encode()
            if isinstance(message, pydantic.BaseModel)
            else json.dumps(message).encode()
        )
        reload = False
        for attempt in (0, 1, 2):
            try:
                if self._conn is None:
                    self._conn = self.endpoint.connection(self.timeout_s)
                headers = {"Content-Type": "application/json"}
                auth = self.token.header(reload=reload)
                if auth is not None:
                    headers["Authorization"] = auth
                self._conn.request("POST", path, body=data, headers=headers)
                resp = self._conn.getresponse()
                payload = json.loads(resp.read() or b"{}")
                if resp.status == 401 and not reload and attempt < 2:
                    self.close()
                    reload = True  # the kubelet may have rotated the token: read it again
                    continue
                if resp.status >= 400:
                    raise AgentRefusedError(resp.status, str(payload.get("error", "")))
                self.last_response = payload
                return dict(payload)
            except AgentRefusedError:
                self.close()
                if self.strict:
                    raise
                log.warning("rlenergy agent refused %s: %s", path, payload.get("error"))
                return {}
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt == 0:
                    continue  # the agent restarted: reconnect once
                if self.strict:
                    raise
                if not self._warned:
                    log.warning(
                        "rlenergy agent at %s unreachable (%s); running at default clocks",
                        self.endpoint,
                        exc,
                    )
                    self._warned = True
                return {}
        return {}

    def phase(self, name: str, *, step: int) -> _PhaseContext:
        """Enter phase ``name`` of RL step ``step`` now (``idle`` ends the current phase).

        The agent's answer updates :attr:`plan_phases`.

        Returns:
            A context manager that signals ``idle`` on exit (optional to use).

        Raises:
            AgentRefusedError: ``strict`` and the agent refused (e.g. not your GPU).
        """
        answer = self._signal(
            "/v1/phase", signals.PhaseRequest, phase=name, step=step, gpus=self.gpus
        )
        if answer:
            self._plan_phases = tuple(str(p) for p in answer.get("planPhases") or ())
        return _PhaseContext(self, step)

    def progress(self, amount: float) -> None:
        """Report work done in the current phase since the last report (tokens)."""
        self._signal("/v1/progress", signals.ProgressRequest, amount=amount)

    def progress_total(
        self, total: float, *, in_flight: int | None = None, measured_at_s: float | None = None
    ) -> None:
        """Report the cumulative work done in the current phase so far.

        ``measured_at_s``: when ``total`` was counted (``time.monotonic()``, s; ``None``: now).
        Pass it when the count is taken some time before this call (read from an engine's
        counter, or several ranks counted in one pass): the agent puts the report at that time
        in the probe slices, and a stamp later than the count shifts progress into the wrong
        slice (a few ms on a slice of tens of ms moves its rate by tens of percent).
        ``in_flight``: requests the rollout engine has in flight now (``None``: not said).
        With it the agent watches the phase for stalls: progress frozen with requests in
        flight at low power is a ``RolloutStalled`` rollout, held at its clock and kept out
        of the savings (docs/agent.md, "Stalled rollouts").

        The unit is the phase's: decode iterations (or decoded tokens) for generation, trained
        tokens for training. During an EE-RL trial the agent runs the phase as short slices at
        different clocks and interpolates these reports at the slice boundaries, so report
        often (every few tens of ms, e.g. every decode iteration batch) and once more right
        before the phase ends. A dropped report loses nothing (the next one carries the total).
        """
        # The measurement time (CLOCK_MONOTONIC, shared by the node's processes) keeps the
        # request's transit out of the agent's slice boundaries.
        self._signal(
            "/v1/progress",
            signals.ProgressRequest,
            total=total,
            atMonotonicSeconds=time.monotonic() if measured_at_s is None else measured_at_s,
            inFlight=in_flight,
        )

    def end_step(
        self,
        step: int,
        *,
        samples: int,
        response_tokens: float,
        prompt_tokens: float,
        valid_tokens: float,
        mean_context_tokens: float = 0.0,
        generation_progress_source: str | None = None,
    ) -> dict[str, Any]:
        """Close RL step ``step`` with its token workload (valid tokens: the objective's unit).

        ``generation_progress_source``: where the step's generation progress was read (the
        engine metric naming matched, ``rlenergy.sdk.progress.VARIANTS``; ``sdk``); the agent
        keeps it with the workload in its node report.

        Returns:
            The agent's answer (``signals.StepAnswer``: ``phaseEnergyJoules``, the energy the
            agent metered on this pod's GPUs per phase of the step, J); empty when the agent
            was unreachable and not ``strict``.
        """
        workload = api_node.TokenWorkloadReport(
            samples=samples,
            response_tokens=response_tokens,
            prompt_tokens=prompt_tokens,
            valid_tokens=valid_tokens,
            mean_context_tokens=mean_context_tokens,
            generation_progress_source=generation_progress_source,
        )
        return self._signal("/v1/step", signals.StepRequest, step=step, workload=workload)

    def sleep_begin(self, step: int) -> None:
        """Say this pod's engine is about to be put to sleep (before the engine's call).

        The agent reads the pod's GPUs' memory in use and power now, to check the sleep
        against them at :meth:`sleep_end`.
        """
        self._signal("/v1/sleep", signals.SleepRequest, step=step, stage="begin")

    def sleep_end(self, step: int) -> dict[str, Any]:
        """Say this pod's engine slept (after the engine's call returned).

        Returns:
            The agent's check (``SleepCheck`` as JSON): ``result`` ``Verified`` (memory and
            power dropped on every GPU; ``savedWatts`` is the power freed), ``Mismatch`` (one
            of them did not: no saving claimed, ``reason`` says which) or ``Unknown``; empty
            when the agent was unreachable and not ``strict``.

        Raises:
            AgentRefusedError: ``strict`` and the agent refused (no ``sleep_begin`` of ``step``).
        """
        answer = self._signal("/v1/sleep", signals.SleepRequest, step=step, stage="end")
        return dict(answer.get("check") or {})

    def park(self, step: int, *, gpus: Sequence[str] = ()) -> dict[str, Any]:
        """Park this pod's GPUs (or ``gpus``, each the pod's own): a released rollout worker.

        The agent locks them at their lowest supported SM clock until this pod's next working
        phase, a signal of a later step, ``end_step(step)`` or ``unpark``; it reports the
        parked GPU-seconds. Call it on the worker's ranks once a ``ReleaseDecision`` committed
        (``rlenergy.sdk.rollout.park_if_released``).

        Args:
            step: RL step of the release.
            gpus: GPU UUIDs to park (empty: every GPU of the pod).

        Returns:
            The agent's answer: ``parked`` (UUID -> ``{"clockMHz"}``), ``already``,
            ``applied`` (read-back); empty when the agent was unreachable and not ``strict``.

        Raises:
            AgentRefusedError: ``strict`` and the agent refused (e.g. not your GPU).
        """
        return self._signal("/v1/park", signals.ParkRequest, step=step, gpus=list(gpus))

    def unpark(self, *, gpus: Sequence[str] = ()) -> float:
        """End this pod's parks (or those of ``gpus``) now; returns their GPU time, GPU-s."""
        answer = self._signal("/v1/unpark", signals.UnparkRequest, gpus=list(gpus))
        return float(answer.get("releasedGpuSeconds", 0.0))

    def publish_rollout(
        self,
        step: int,
        *,
        active_workers: int,
        released_workers: int = 0,
        next_step_workers: int | None = None,
        worker_pods: Sequence[str] = (),
        failure: api_node.RolloutFailure | None = None,
        reloaded_experts: Sequence[int] = (),
        placement_unbalanced: bool = False,
    ) -> None:
        """Publish the dispatcher's rollout state through this node's agent (node report).

        Args:
            step: RL step the counts describe.
            active_workers: workers in the EP group at the end of the step.
            released_workers: workers released during the step.
            next_step_workers: workers the next step needs; with ``releaseAction: scale`` the
                operator resizes the worker set to it between steps (never below the floor).
            worker_pods: ``namespace/name`` of each active rank's pod, rank order (the
                operator marks the policy Degraded when one ends mid-rollout).
            failure: the step's failed shrink step (``rollout.failure_of``), if any: the
                operator marks the policy Degraded with its reason and emits an Event.
            reloaded_experts: experts reloaded onto or copied to survivors in the step.
            placement_unbalanced: the survivors host unequal expert counts since.
        """
        self._signal(
            "/v1/rollout",
            api_node.RolloutDispatch,
            step=step,
            active_workers=active_workers,
            released_workers=released_workers,
            next_step_workers=next_step_workers,
            worker_pods=list(worker_pods),
            failure=failure,
            reloaded_experts=list(reloaded_experts),
            placement_unbalanced=placement_unbalanced,
        )

    def lost_workers(self) -> list[str]:
        """Rollout worker pods (``namespace/name``) the operator found lost mid-rollout.

        The operator sees a worker pod end in its node agent's report and writes it into the
        policy's ``status.rollout.failure.lostWorkers``; this node's agent relays it. The
        dispatcher feeds it to its planner (``rollout.feed_lost_ranks``). Empty when none
        (or, not ``strict``, when the agent cannot be reached).
        """
        answer = self._signal("/v1/rollout/lost", signals.LostWorkersRequest)
        return [str(p) for p in answer.get("lostWorkers") or []]

    def close(self) -> None:
        """Close the connection (reopened on the next call)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
