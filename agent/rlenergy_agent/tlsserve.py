"""The node's serving certificate for the TLS signal port: made on the node, signed by the operator.

``ServingCertKeeper`` keeps ``tls.crt`` and ``tls.key`` in the agent's state folder valid for
the node's IP: at start-up and then hourly it checks the certificate and, when it is missing,
past ``RENEW_FRACTION`` of its lifetime or for other IP addresses, makes a new key and request
(``make``: by default a short-lived child process, ``rlenergy_agent.tlsgen``, so the agent never
loads ``cryptography``), asks the operator to sign it (``request``: a
``CertificateSigningRequest``, ``rlenergy_agent.kube.CertificateRequester``) and replaces the
files atomically, with ``tls.json`` recording when and for which IPs. The TLS listener re-reads
the files when they change (``endpoint.ServingCertificate``). The key never leaves the node.
While no certificate was ever issued the TLS port closes every connection; trainers with a
mounted socket are unaffected.

Callers: ``rlenergy_agent.__main__``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

LIFETIME_S = 30 * 86400
"""Lifetime asked for (``spec.expirationSeconds``; the operator's ``rlenergy.api.tls``
``LEAF_LIFETIME_S``), s."""
RENEW_FRACTION = 2 / 3
"""Renewed once this fraction of the lifetime has passed (``rlenergy.api.tls``)."""
CHECK_INTERVAL_S = 3600.0
"""Seconds between checks that the certificate is still good."""
RETRY_S = 15.0
"""Seconds before a failed request is tried again."""
CHILD_TIMEOUT_S = 30.0
"""Longest the key-making child may take, s."""


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def make_in_child(folder: Path, node: str, ips: Sequence[str]) -> bytes:
    """Run ``rlenergy_agent.tlsgen``: the new key lands in ``folder/tls.key.new``; the request.

    Raises:
        RuntimeError: the child failed (its error output).
    """
    # the child imports the same code as this process (its module search path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run(  # noqa: S603 - our own module, arguments from the settings
        [sys.executable, "-m", "rlenergy_agent.tlsgen", str(folder), node, *ips],
        env=env,
        capture_output=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(f"key generation failed: {res.stderr.decode(errors='replace')[-500:]}")
    return res.stdout


class ServingCertKeeper:
    """Keeps the node's serving certificate files current.

    Args:
        node: the node's name (the certificate's common name).
        ips: the node's IPs the certificate names (``status.hostIP``).
        folder: where ``tls.crt``, ``tls.key`` and ``tls.json`` live (created, mode 0700).
        request: submits a PEM request under a name and returns the issued PEM chain.
        make: writes a new key to ``folder/tls.key.new`` and returns its PEM request.
        clock: wall-clock time, s since the epoch.
    """

    def __init__(
        self,
        node: str,
        ips: Sequence[str],
        folder: Path,
        request: Callable[[str, bytes], bytes],
        make: Callable[[Path, str, Sequence[str]], bytes] = make_in_child,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.ips = tuple(ips)
        self.folder = folder
        self.cert_file = folder / "tls.crt"
        self.key_file = folder / "tls.key"
        self.meta_file = folder / "tls.json"
        self._request = request
        self._make = make
        self._clock = clock
        self._stop = threading.Event()
        self.issued = 0
        """Certificates obtained by this process."""

    def due(self) -> str | None:
        """Why a new certificate is needed now, or None when the current one is good."""
        try:
            meta = json.loads(self.meta_file.read_text())
            self.cert_file.stat()
            self.key_file.stat()
            issued_at, lifetime = float(meta["issuedAt"]), float(meta["lifetimeSeconds"])
            ips = sorted(str(i) for i in meta["ips"])
        except (OSError, ValueError, KeyError, TypeError):
            return "no certificate yet"
        if self._clock() >= issued_at + lifetime * RENEW_FRACTION:
            return "certificate due for renewal"
        if ips != sorted(self.ips):
            return f"certificate names {ips}, the node has {sorted(self.ips)}"
        return None

    def ensure(self) -> bool:
        """Obtain a new certificate when ``due``; returns whether it did.

        Raises:
            Exception: whatever ``make`` or ``request`` raises (the caller retries).
        """
        why = self.due()
        if why is None:
            return False
        log.info("requesting a serving certificate for %s %s: %s", self.node, self.ips, why)
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        csr = self._make(self.folder, self.node, self.ips)
        started = self._clock()
        name = f"rlenergy-agent-{self.node}-{int(started)}"[:253]
        chain = self._request(name, csr)
        if b"-----BEGIN CERTIFICATE-----" not in chain:
            raise RuntimeError(f"request {name}: the answer is not a PEM certificate")
        new_key = self.folder / "tls.key.new"
        os.chmod(new_key, 0o600)
        os.replace(new_key, self.key_file)
        _write(self.cert_file, chain, 0o644)
        meta = {"issuedAt": started, "lifetimeSeconds": LIFETIME_S, "ips": list(self.ips)}
        _write(self.meta_file, json.dumps(meta).encode(), 0o644)
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
