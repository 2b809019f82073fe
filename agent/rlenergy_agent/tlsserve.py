"""The node's serving certificate for the TLS signal port: made on the node, signed by the operator.

``ServingCertKeeper`` keeps ``tls.crt`` and ``tls.key`` in the agent's state folder valid for
the node's IP: at start-up and then hourly it checks the certificate and, when it is missing,
past ``rlenergy.api.tls.RENEW_FRACTION`` of its lifetime or for other IP addresses, makes a new
key, asks the operator to sign a request for it (``request``: a ``CertificateSigningRequest``,
``rlenergy_agent.kube.CertificateRequester``) and replaces both files atomically. The TLS
listener re-reads them when they change (``endpoint.ServingCertificate``). The key never leaves
the node. While no certificate was ever issued the TLS port closes every connection; trainers
with a mounted socket are unaffected.

Callers: ``rlenergy_agent.__main__``.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rlenergy.api import tls

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 3600.0
"""Seconds between checks that the certificate is still good (it lives 30 days)."""
RETRY_S = 15.0
"""Seconds before a failed request is tried again."""


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class ServingCertKeeper:
    """Keeps the node's serving certificate files current.

    Args:
        node: the node's name (the certificate's common name).
        ips: the node's IPs the certificate names (``status.hostIP``).
        folder: where ``tls.crt`` and ``tls.key`` live (created, mode 0700).
        request: submits a PEM request under a name and returns the issued PEM chain.
        clock: wall-clock time.
    """

    def __init__(
        self,
        node: str,
        ips: Sequence[str],
        folder: Path,
        request: Callable[[str, bytes], bytes],
        clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        self.node = node
        self.ips = tuple(ips)
        self.folder = folder
        self.cert_file = folder / "tls.crt"
        self.key_file = folder / "tls.key"
        self._request = request
        self._clock = clock
        self._stop = threading.Event()
        self.issued = 0
        """Certificates obtained by this process."""

    def due(self) -> str | None:
        """Why a new certificate is needed now, or None when the current one is good."""
        try:
            pem = self.cert_file.read_bytes()
            self.key_file.stat()
        except OSError:
            return "no certificate yet"
        if tls.renewal_due(pem, self._clock()):
            return "certificate due for renewal"
        if set(tls.cert_ips(pem)) != set(self.ips):
            return f"certificate names {sorted(tls.cert_ips(pem))}, the node has {sorted(self.ips)}"
        return None

    def ensure(self) -> bool:
        """Obtain a new certificate when ``due``; returns whether it did.

        Raises:
            Exception: whatever ``request`` raises (the caller retries).
        """
        why = self.due()
        if why is None:
            return False
        log.info("requesting a serving certificate for %s %s: %s", self.node, self.ips, why)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = tls.new_key()
        csr = tls.make_csr(key, self.node, self.ips)
        name = f"rlenergy-agent-{self.node}-{int(self._clock().timestamp())}"
        chain = self._request(name[:253], csr)
        tls.load_cert(chain)  # a PEM certificate, or CertificateError
        _write(self.key_file, key, 0o600)
        _write(self.cert_file, chain, 0o644)
        self.issued += 1
        return True

    def run(self) -> None:
        """Ensure now and then every ``CHECK_INTERVAL_S`` until ``stop`` (retrying failures)."""
        wait = 0.0
        while not self._stop.wait(wait):
            try:
                self.ensure()
                wait = CHECK_INTERVAL_S
            except Exception as exc:  # noqa: BLE001 - API, denial, timeout: retry later
                log.error("no serving certificate for the TLS signal port: %s", exc)
                wait = RETRY_S

    def start(self) -> None:
        """Run on a daemon thread."""
        threading.Thread(target=self.run, name="serving-cert", daemon=True).start()

    def stop(self) -> None:
        """Stop the thread at its next wake-up."""
        self._stop.set()


def wait_for(keeper: ServingCertKeeper, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a certificate file (tests and start-up logs)."""
    deadline = time.monotonic() + timeout_s
    while keeper.due() == "no certificate yet" and time.monotonic() < deadline:
        time.sleep(0.05)
    return keeper.due() != "no certificate yet"
