"""The agent's listeners, hardened: its own socket, header caps, a connection cap, a deadline.

The real ``SignalServer`` and ``OpsServer`` over the stand-in NVML, driven with raw sockets
(what a hostile caller sends is no SDK request). Memory under exhaustion is measured on the
agent process in ``tests/integration/agent/test_agent_endpoint.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_support import LOCKED_PLAN, DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import endpoint, server, service

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")


@pytest.fixture
def agent(make_driver: DriverFactory) -> service.Agent:
    drv = make_driver(2)
    return standin_agent({POD: list(drv.uuids)}, LOCKED_PLAN, lambda: drv.virtual_s)


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def _status(s: socket.socket) -> int:
    """The status code of the answer on ``s`` (0: closed without one)."""
    data = b""
    with contextlib.suppress(TimeoutError, OSError):
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ")[1]) if data.startswith(b"HTTP/") else 0


def _request(path: Path, head: bytes, body: bytes = b"") -> int:
    with _connect(path) as s:
        s.sendall(head + body)
        return _status(s)


# ----- the socket is the agent's own ---------------------------------------------------------


@pytest.mark.parametrize("what", ["directory", "file", "symlink"])
def test_a_non_socket_at_the_path_is_refused_and_left_alone(
    agent: service.Agent, short_tmp: Path, what: str
) -> None:
    path = short_tmp / "agent.sock"
    if what == "directory":
        path.mkdir()
    elif what == "file":
        path.write_text("keep me")
    else:
        path.symlink_to(short_tmp / "elsewhere")
    with pytest.raises(endpoint.SocketPathError) as err:
        server.SignalServer(path, agent, FakeReviews().authenticator(), wait_s=0.1)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "not a socket" in message
    assert os.path.lexists(path)  # never removed
    if what == "file":
        assert path.read_text() == "keep me"


def test_a_live_listener_is_not_replaced(agent: service.Agent, short_tmp: Path) -> None:
    path = short_tmp / "agent.sock"
    reviews = FakeReviews()
    first = server.SignalServer(path, agent, reviews.authenticator())
    first.start()
    try:
        with pytest.raises(endpoint.SocketPathError, match="another process listens"):
            server.SignalServer(path, agent, reviews.authenticator(), wait_s=0.5)
        assert first.intact()
        client = reviews.client(path, POD, short_tmp, strict=True)
        client.phase("generation", step=0)  # the first agent still serves
        client.close()
    finally:
        first.stop()
    assert not path.exists()  # its own socket removed at shutdown


def test_a_stale_socket_is_replaced(agent: service.Agent, short_tmp: Path) -> None:
    path = short_tmp / "agent.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # a killed agent's socket: the file stays, nobody listens
    srv = server.SignalServer(path, agent, FakeReviews().authenticator(), wait_s=0.1)
    try:
        assert srv.intact()
    finally:
        srv.stop()


def test_shutdown_removes_only_the_socket_it_bound(agent: service.Agent, short_tmp: Path) -> None:
    path = short_tmp / "agent.sock"
    old = server.SignalServer(path, agent, FakeReviews().authenticator())
    old.start()
    # a rolling update: the new agent's socket takes the path while the old one shuts down
    os.unlink(path)
    new = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    new.bind(str(path))
    new.listen(1)
    try:
        assert not old.intact()
        old.stop()
        assert path.exists() and endpoint.answers(path)  # the new agent's socket stays
    finally:
        new.close()


def test_a_renamed_socket_makes_the_agent_not_ready(agent: service.Agent, short_tmp: Path) -> None:
    path = short_tmp / "agent.sock"
    srv = server.SignalServer(path, agent, FakeReviews().authenticator())
    ops = server.OpsServer("127.0.0.1", 0, agent, health=lambda: True, ready=srv.intact)
    srv.start()
    ops.start()
    url = f"http://127.0.0.1:{ops.port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200
        os.rename(path, short_tmp / "agent.sock.old")  # a writable mount: renamed away,
        squat = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        squat.bind(str(path))  # and a relay bound in its place
        squat.listen(1)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)  # noqa: S310 - loopback
        assert err.value.code == 503
        err.value.close()
        srv.stop()
        assert path.exists()  # the squatter's socket is not the agent's to remove
        squat.close()
    finally:
        ops.stop()


# ----- header caps, deadline, connection cap --------------------------------------------------


@pytest.fixture
def signals(agent: service.Agent, short_tmp: Path) -> Iterator[tuple[Path, server.SignalServer]]:
    path = short_tmp / "agent.sock"
    srv = server.SignalServer(path, agent, FakeReviews().authenticator())
    srv.start()
    try:
        yield path, srv
    finally:
        srv.stop()


def _post(headers: list[bytes]) -> bytes:
    return (
        b"POST /v1/phase HTTP/1.1\r\nHost: x\r\n"
        + b"".join(h + b"\r\n" for h in headers)
        + b"Content-Length: 2\r\n\r\n{}"
    )


def test_header_bytes_and_lines_are_capped(signals: tuple[Path, Any]) -> None:
    path, _srv = signals
    assert _request(path, _post([])) == 401  # within the caps: the token check answers
    big = [b"X-Pad-%d: " % i + b"a" * 8000 for i in range(3)]
    assert _request(path, _post(big)) == 431
    many = [b"X-N-%d: 1" % i for i in range(endpoint.MAX_HEADERS + 5)]
    assert _request(path, _post(many)) == 431
    line = b"POST /" + b"a" * (endpoint.MAX_HEADER_BYTES + 10) + b" HTTP/1.1\r\n\r\n"
    assert _request(path, line) == 414


def test_a_trickling_caller_is_cut_at_the_deadline(
    signals: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, srv = signals
    monkeypatch.setattr(endpoint, "REQUEST_DEADLINE_S", 1.0)
    with _connect(path) as s:
        t0 = time.monotonic()
        closed = False
        for b in _post([b"X-Slow: " + b"a" * 200]):  # one byte every 50 ms: 12 s at full length
            try:
                s.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() - t0 > 4.0:
                break
        if not closed:
            s.settimeout(2)
            closed = _status(s) == 0
        assert closed and time.monotonic() - t0 < 4.0
    assert srv.server.deadlines.expired >= 1


def test_connections_past_the_cap_get_503_and_the_rest_are_served(
    agent: service.Agent, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server._UnixHTTPServer, "max_connections", 4)  # a cap of 4 here
    path = short_tmp / "agent.sock"
    srv = server.SignalServer(path, agent, FakeReviews().authenticator())
    srv.start()
    idle = [_connect(path) for _ in range(4)]
    try:
        deadline = time.monotonic() + 5
        while srv.server.active < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.server.active == 4
        with _connect(path) as extra:
            assert _status(extra) == 503
        assert srv.server.refused_connections == 1
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while srv.server.active and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert _request(path, _post([])) == 401  # slots freed: served again
    finally:
        srv.stop()


def test_the_ops_port_serves_no_plan_and_is_bounded(agent: service.Agent) -> None:
    ops = server.OpsServer("127.0.0.1", 0, agent, health=lambda: True, ready=lambda: True)
    ops.start()
    base = f"http://127.0.0.1:{ops.port}"
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/v1/plan", timeout=5)  # noqa: S310 - loopback
        assert err.value.code == 404
        err.value.close()
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'rlenergy_agent_plan_step{node="node-1",policy="pol"} 0.0' in text
        held = []
        for _ in range(server.MAX_OPS_CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", ops.port), timeout=5)
            held.append(s)
        deadline = time.monotonic() + 30
        while ops.server.active < server.MAX_OPS_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", ops.port), timeout=5) as extra:
            assert _status(extra) == 503
        for s in held:
            s.close()
        deadline = time.monotonic() + 30  # the server's threads see the closes (slow under load)
        while ops.server.active >= server.MAX_OPS_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", ops.port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 20000)
            s.sendall(b"\r\n\r\n")
            assert _status(s) == 431
    finally:
        ops.stop()


def test_concurrent_scrapes_share_one_rendering(agent: service.Agent) -> None:
    now = [0.0]
    page = server.MetricsPage(agent, lambda: True, clock=lambda: now[0])
    first = page.get()
    assert page.get() is first and page.renders == 1
    now[0] += server.METRICS_REUSE_S
    page.get()
    assert page.renders == 2
