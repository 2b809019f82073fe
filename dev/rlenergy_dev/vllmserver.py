"""vLLM's ``/metrics`` as verl's rollout server exposes it, with no model: a stand-in engine.

:class:`VllmServer` plays verl's ``vLLMHttpServer`` actor (``launch_server``, ``_server_address``
/ ``_server_port``) with vLLM 0.33.0's metric names in a prometheus-client registry on
127.0.0.1 (prometheus-client is what vLLM serves them with). No torch: the agent tests in the
main venv use it as the verl rank (``rlenergy_dev.verlrank``) and the trainer pod do.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import prometheus_client


class VllmServer:
    """The ``vLLMHttpServer`` actor of verl, played: vLLM's real metric names, no model.

    ``launch_server`` starts an HTTP server on 127.0.0.1 with vLLM 0.33.0's metric names on
    ``/metrics`` (``vllm:generation_tokens``, ``vllm:num_requests_running`` / ``_waiting``, labels
    ``model_name``, ``engine``) and leaves ``_server_address`` / ``_server_port`` as verl's does.

    Decoding is either free-running (:meth:`serve`: ``tokens_per_s`` while it holds requests,
    on its own thread) or driven (:meth:`decode`: the caller adds the tokens its simulated work
    produced).

    Args:
        tokens_per_s: free-running decode rate.
        max_running: requests the engine runs at once (``None``: every request it holds).
    """

    def __init__(self, tokens_per_s: float = 20_000.0, *, max_running: int | None = None) -> None:
        self._server_address = "127.0.0.1"
        self._server_port: int | None = None
        self.tokens_per_s = tokens_per_s
        self.max_running = max_running
        reg = prometheus_client.CollectorRegistry()
        labels = ["model_name", "engine"]
        self.tokens = prometheus_client.Counter(
            "vllm:generation_tokens", "Generated.", labels, registry=reg
        ).labels("m", "0")
        self.running = prometheus_client.Gauge(
            "vllm:num_requests_running", "Running.", labels, registry=reg
        ).labels("m", "0")
        self.waiting = prometheus_client.Gauge(
            "vllm:num_requests_waiting", "Waiting.", labels, registry=reg
        ).labels("m", "0")
        self.registry = reg
        self.decoded = 0.0
        self.busy = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._free_run, daemon=True)
        self.http: Any = None

    async def launch_server(self) -> None:
        """Serve ``/metrics`` on 127.0.0.1 (an ephemeral port, ``_server_port``)."""
        self.http, _ = prometheus_client.start_http_server(
            0, addr="127.0.0.1", registry=self.registry
        )
        self._server_port = self.http.server_port

    @property
    def url(self) -> str:
        """Where ``/metrics`` is served (after ``launch_server``)."""
        return f"http://{self._server_address}:{self._server_port}/metrics"

    def decode(self, tokens: float) -> None:
        """Count ``tokens`` decoded now."""
        with self._lock:
            self.tokens.inc(tokens)
            self.decoded += tokens

    def _free_run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.002):
            now = time.monotonic()
            if self.busy.is_set():
                self.decode(self.tokens_per_s * (now - last))
            last = now

    def hold(self, requests: int) -> None:
        """The engine holds ``requests`` requests (0: none); ``max_running`` of them run."""
        running = requests if self.max_running is None else min(requests, self.max_running)
        self.running.set(running)
        self.waiting.set(requests - running)

    def serve(self, requests: int) -> None:
        """Hold ``requests`` and decode free-running at ``tokens_per_s`` while > 0."""
        if self._thread.ident is None and not self._stop.is_set():
            self._thread.start()
        self.hold(requests)
        (self.busy.set if requests else self.busy.clear)()

    def close(self) -> None:
        """Stop decoding and serving."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
