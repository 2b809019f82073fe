"""Bounded HTTP serving for the agent's listeners: what one caller can make the agent hold.

The signal socket is mounted into every trainer pod of the node and the ops port answers
whoever reaches it, so neither may let a caller grow the agent's memory or threads without
bound (an OOM kill would skip the clock reset on exit). Each listener built on
``BoundedServer`` and ``BoundedHandler`` has:

* a **connection cap** (``max_connections``): one thread per connection, at most that many at
  once; a further connection is answered ``503`` at once and closed (``refused_connections``
  counts them);
* **header caps**: the request line and headers together at most ``MAX_HEADER_BYTES``, at most
  ``MAX_HEADERS`` header lines (``431`` beyond either; the standard library alone allows 100
  lines of 64 KiB each, 6.4 MB per connection);
* an **overall request deadline** (``REQUEST_DEADLINE_S``): a connection whose request is not
  answered that long after the agent began waiting for it is shut down, however slowly the
  caller trickles bytes (the socket timeout alone restarts with every byte);
* an idle timeout between requests on a kept-alive connection (``IDLE_TIMEOUT_S``).

A TLS listener (``TlsHandlerMixin`` before the handler, ``ServingCertificate`` on the server)
does the handshake on the connection's own thread, under the same request deadline, so a
caller that stalls its handshake holds one slot for at most ``REQUEST_DEADLINE_S`` and never
the accept loop. Its certificate is re-read when the files change (renewal needs no restart).

``claim_socket_path`` and ``SocketOwner`` keep the signal socket the agent's own: the agent
starts only on a free path, a stale socket (no listener answers) or nothing; it never deletes a
directory or file someone put there, never takes a socket another listener serves, and at
shutdown removes the socket only when the path still holds the inode it bound (a rolling update's
new agent may have replaced it).

Callers: ``rlenergy_agent.server``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import logging
import os
import socket
import socketserver
import ssl
import stat
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
"""Request line and headers of one request, bytes (a signal sends about 1.2 KB: the bearer
token is most of it)."""
MAX_HEADERS = 32
"""Header lines of one request (a signal sends 5)."""
REQUEST_DEADLINE_S = 15.0
"""Longest a connection may take from the agent waiting for a request to the answer, s."""
IDLE_TIMEOUT_S = 10.0
"""Longest a kept-alive connection may stay silent before its next request, s (also the
socket timeout of every read and write)."""
DEADLINE_TICK_S = 0.25
"""How often the deadline watch looks for connections past their deadline, s."""


class SocketPathError(RuntimeError):
    """The signal socket path cannot be the agent's (not a socket, or another listener's)."""


class _Budgeted:
    """The handler's read file, with a byte and line budget while the header section is read.

    ``readline`` past the budget raises ``http.client.LineTooLong`` or ``HTTPException``,
    which ``BaseHTTPRequestHandler.parse_request`` answers with 431.
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._left = -1
        self._lines = 0
        self._max_lines = 0

    def arm(self, max_bytes: int, max_lines: int) -> None:
        """Start a header budget of ``max_bytes`` bytes and ``max_lines`` lines."""
        self._left, self._lines, self._max_lines = max_bytes, 0, max_lines

    def disarm(self) -> None:
        """The header section is read: reads are the body's (framed by Content-Length)."""
        self._left = -1

    def readline(self, limit: int = -1) -> bytes:
        """One line, counted against the budget while armed."""
        if self._left < 0:
            return bytes(self._raw.readline(limit))
        cap = self._left + 1 if limit < 0 else min(limit, self._left + 1)
        line = bytes(self._raw.readline(cap))
        self._left -= len(line)
        self._lines += 1
        if self._left < 0:
            self._left = 0
            raise http.client.LineTooLong(f"request line and headers over {MAX_HEADER_BYTES} bytes")
        if self._lines > self._max_lines + 2:  # the request line, the headers, the blank line
            raise http.client.HTTPException(f"more than {self._max_lines} header lines")
        return line

    def read(self, n: int = -1) -> bytes:
        """Read the body."""
        return bytes(self._raw.read(n))

    def close(self) -> None:
        """Close the underlying file."""
        self._raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _Deadlines:
    """Shuts down connections past their deadline, on one thread per listener."""

    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._due: dict[socket.socket, float] = {}
        self._stop = threading.Event()
        self.expired = 0
        """Connections shut down at their deadline."""
        self._thread = threading.Thread(target=self._run, name=f"{name}-deadlines", daemon=True)
        self._thread.start()

    def arm(self, conn: socket.socket, seconds: float) -> None:
        with self._lock:
            self._due[conn] = time.monotonic() + seconds

    def disarm(self, conn: socket.socket) -> None:
        with self._lock:
            self._due.pop(conn, None)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(DEADLINE_TICK_S):
            now = time.monotonic()
            with self._lock:
                late = [c for c, t in self._due.items() if t <= now]
                for c in late:
                    del self._due[c]
            for c in late:
                self.expired += 1
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns


_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)


class BoundedServer(socketserver.ThreadingMixIn):
    """A threading server with a connection cap and a deadline watch (mix in before a server).

    Subclasses set ``max_connections``; ``start_bounds`` must run in ``__init__``.
    """

    daemon_threads = True
    block_on_close = False
    max_connections = 64
    name = "http"

    if TYPE_CHECKING:

        def shutdown_request(self, request: Any) -> None:
            """``socketserver.BaseServer.shutdown_request`` (the server this is mixed into)."""

    def start_bounds(self) -> None:
        """Create the connection slots and start the deadline watch."""
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.deadlines = _Deadlines(self.name)
        self.refused_connections = 0
        """Connections answered 503 because every slot was taken."""
        self._count_lock = threading.Lock()
        self.active = 0
        """Connections being served now."""

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve ``request`` on a thread of its own, or answer 503 when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            body = (
                b'{"error": "agent busy: %d connections open (the limit); retry"}'
                % self.max_connections
            )
            with contextlib.suppress(OSError):
                request.settimeout(0.5)
                request.sendall(_BUSY % (len(body), body))
            self.shutdown_request(request)
            return
        with self._count_lock:
            self.active += 1
        t = threading.Thread(
            target=self._serve_one, args=(request, client_address), name=f"{self.name}-conn"
        )
        t.daemon = True
        t.start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            self.deadlines.disarm(request)
            with self._count_lock:
                self.active -= 1
            self._slots.release()

    def stop_bounds(self) -> None:
        """Stop the deadline watch."""
        self.deadlines.stop()


class BoundedHandler(http.server.BaseHTTPRequestHandler):
    """``BaseHTTPRequestHandler`` with the header caps and the request deadline of its server."""

    timeout = IDLE_TIMEOUT_S
    server: Any
    rfile: Any

    def setup(self) -> None:
        """Wrap the read file in the header budget."""
        super().setup()
        self.rfile = _Budgeted(self.rfile)

    def handle_one_request(self) -> None:
        """Read, parse and answer one request within the caps and the deadline."""
        self.server.deadlines.arm(self.connection, REQUEST_DEADLINE_S)
        self.rfile.arm(MAX_HEADER_BYTES, MAX_HEADERS)
        try:
            try:
                self.raw_requestline = self.rfile.readline(MAX_HEADER_BYTES + 1)
            except http.client.HTTPException as exc:
                self.requestline, self.request_version, self.command = "", "HTTP/1.0", ""
                self.close_connection = True
                self.send_error(414, "request line too long", str(exc))
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():  # 431 on the header caps (sent by parse_request)
                self.close_connection = True
                return
            self.rfile.disarm()
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.send_error(501, f"unsupported method {self.command!r}")
                return
            method()
            self.wfile.flush()
        except (TimeoutError, OSError, ValueError) as exc:
            # a timeout, the deadline's shutdown, or a caller that left
            self.close_connection = True
            log.debug("connection dropped: %s", exc)
        finally:
            self.server.deadlines.disarm(self.connection)


class ServingCertificate:
    """A TLS server context from a certificate and key file, rebuilt when either changes.

    One ``stat`` of each file per connection; a file pair that does not load (half written,
    mismatched) keeps the previous context and is logged once per change.

    Args:
        cert_file: PEM certificate chain (the leaf first).
        key_file: PEM private key.
    """

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._lock = threading.Lock()
        self._seen: tuple[tuple[int, int, int], ...] | None = None
        self._context: ssl.SSLContext | None = None
        self.loads = 0
        """Contexts built (the first, then one per renewal)."""

    def _stamp(self) -> tuple[tuple[int, int, int], ...] | None:
        try:
            return tuple(
                (st.st_ino, st.st_size, st.st_mtime_ns)
                for st in (os.stat(self.cert_file), os.stat(self.key_file))
            )
        except OSError:
            return None

    def context(self) -> ssl.SSLContext | None:
        """The newest loadable context; ``None`` while there has never been a certificate."""
        stamp = self._stamp()
        with self._lock:
            if stamp is not None and stamp != self._seen:
                self._seen = stamp
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                try:
                    ctx.load_cert_chain(self.cert_file, self.key_file)
                except (ssl.SSLError, OSError) as exc:
                    log.error(
                        "serving certificate %s / %s does not load (%s): keeping the previous one",
                        self.cert_file,
                        self.key_file,
                        exc,
                    )
                else:
                    self._context = ctx
                    self.loads += 1
            return self._context


class TlsHandlerMixin:
    """TLS for a ``BoundedHandler``: the handshake on the connection's thread, under the deadline.

    The server has ``certificate`` (a ``ServingCertificate``); ``handshake_failures`` on it
    counts connections that never completed a handshake (a wrong CA on the caller's side, a
    plaintext caller, a deadline).
    """

    request: Any
    server: Any
    _tls_ok = False

    def setup(self) -> None:
        """Wrap the connection in TLS and complete the handshake, then set up the files."""
        ctx = self.server.certificate.context()
        raw = self.request
        raw.settimeout(IDLE_TIMEOUT_S)
        if ctx is None:
            self.server.handshake_failures += 1
            log.warning("TLS connection closed: no serving certificate yet")
        else:
            tls = ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            self.request = tls
            self.server.deadlines.arm(tls, REQUEST_DEADLINE_S)
            try:
                tls.do_handshake()
                self._tls_ok = True
            except (ssl.SSLError, OSError) as exc:
                self.server.handshake_failures += 1
                log.debug("TLS handshake failed: %s", exc)
            finally:
                self.server.deadlines.disarm(tls)
        super().setup()  # type: ignore[misc]

    def handle(self) -> None:
        """Serve the connection's requests only after a complete handshake."""
        if self._tls_ok:
            super().handle()  # type: ignore[misc]

    def finish(self) -> None:
        """Flush, then close the TLS socket (the server closes only the raw one it accepted)."""
        try:
            super().finish()  # type: ignore[misc]
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self.request.close()


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "not a socket"


def answers(path: Path, timeout_s: float = 0.5) -> bool:
    """Whether a listener accepts connections on the Unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False  # a stale socket (its agent is gone), or none any more
    except OSError:
        return True  # cannot tell (permissions, a full backlog): not ours to take
    finally:
        s.close()


def claim_socket_path(path: Path, wait_s: float) -> None:
    """Make ``path`` free for the agent's socket, or say why it cannot be.

    Nothing there: nothing to do. A socket no listener answers on (an agent that was killed):
    removed. A socket a listener answers on (the agent being replaced in a rolling update):
    waited for up to ``wait_s`` seconds, then refused. Anything else (a directory, a file, a
    symbolic link): refused, never removed.

    Raises:
        SocketPathError: one line naming the path, what is there and what to do.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketPathError(
                f"signal socket path {path} is {_kind(st.st_mode)}, not a socket: remove it or "
                "set RLENERGY_AGENT_SOCKET_PATH to a free path (the agent replaces only a socket "
                "no listener answers on)"
            )
        if not answers(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        if time.monotonic() >= deadline:
            raise SocketPathError(
                f"another process listens on signal socket {path} (an agent still running?): "
                f"waited {wait_s:.0f} s; stop it or set RLENERGY_AGENT_SOCKET_PATH to a free path"
            )
        time.sleep(0.2)


@dataclasses.dataclass(frozen=True)
class SocketOwner:
    """The inode the agent bound at its socket path: what it may remove at shutdown."""

    path: Path
    device: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> SocketOwner:
        """The socket just bound at ``path``."""
        st = os.lstat(path)
        return cls(path, st.st_dev, st.st_ino)

    def holds(self) -> bool:
        """Whether ``path`` is still this socket (not renamed away, not replaced)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (self.device, self.inode)

    def release(self) -> bool:
        """Remove the socket if the path still holds it; returns whether it did."""
        if not self.holds():
            log.info("signal socket %s is no longer this agent's: left in place", self.path)
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        return True
