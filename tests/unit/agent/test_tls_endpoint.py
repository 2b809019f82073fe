"""The agent's TLS signal port: a real handshake on 127.0.0.1, the CA checked, the token too.

The real ``TlsSignalServer`` over the stand-in NVML, with a CA and a serving certificate made
in the test (``rlenergy.api.tls``), driven by the SDK's own client (``RLEnergyClient`` over
``agent_endpoint``) and by raw sockets.
"""

from __future__ import annotations

import datetime
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_support import LOCKED_PLAN, DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import endpoint, server, service

from rlenergy.api import signals, tls
from rlenergy.sdk import trainer

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
NOW = datetime.datetime.now(datetime.UTC)


def _pki(folder: Path, ips: tuple[str, ...] = ("127.0.0.1",)) -> tuple[Path, Path, Path]:
    """(CA bundle, serving certificate, serving key) files of a new CA."""
    ca = tls.make_ca("test-ca", NOW)
    key = tls.new_key()
    cert = tls.issue_for_key(ca, key, tls.Request("node-1", ips, ()), NOW)
    paths = folder / "ca.crt", folder / "tls.crt", folder / "tls.key"
    for path, data in zip(paths, (ca.cert_pem, cert, key), strict=True):
        path.write_bytes(data)
    return paths


@pytest.fixture
def agent(make_driver: DriverFactory) -> service.Agent:
    drv = make_driver(2)
    return standin_agent({POD: list(drv.uuids)}, LOCKED_PLAN, lambda: drv.virtual_s)


@pytest.fixture
def reviews() -> FakeReviews:
    return FakeReviews()


@pytest.fixture
def pki(tmp_path: Path) -> tuple[Path, Path, Path]:
    return _pki(tmp_path)


@pytest.fixture
def tls_server(
    agent: service.Agent, reviews: FakeReviews, pki: tuple[Path, Path, Path]
) -> Iterator[server.TlsSignalServer]:
    _, cert, key = pki
    srv = server.TlsSignalServer(
        "127.0.0.1", 0, agent, reviews.authenticator(), endpoint.ServingCertificate(cert, key)
    )
    srv.start()
    yield srv
    srv.stop()


def _client(
    port: int, ca: Path, token: str | None, tmp_path: Path, **kw: object
) -> trainer.RLEnergyClient:
    token_file = tmp_path / "token"
    if token is not None:
        token_file.write_text(token)
    env = {
        signals.HOST_ENV: "127.0.0.1",
        signals.PORT_ENV: str(port),
        signals.CA_FILE_ENV: str(ca),
        trainer.SOCKET_ENV: str(tmp_path / "no-such.sock"),
    }
    client = trainer.RLEnergyClient(token_file=str(token_file), strict=True, **kw)  # type: ignore[arg-type]
    client.endpoint = trainer.agent_endpoint(environ=env)
    return client


def test_a_signal_over_tls_is_accepted_and_acts_on_the_pods_gpus(
    tls_server: server.TlsSignalServer,
    reviews: FakeReviews,
    pki: tuple[Path, Path, Path],
    tmp_path: Path,
    agent: service.Agent,
) -> None:
    client = _client(tls_server.port, pki[0], reviews.issue(POD), tmp_path)
    answer = client._signal("/v1/phase", signals.PhaseRequest, phase="generation", step=1)
    assert answer["pod"] == str(POD)
    assert sorted(answer["gpus"]) == sorted(agent.gpus_of(POD)[0])
    assert tls_server.server.handshake_failures == 0
    client.close()


def test_a_caller_trusting_another_ca_refuses_the_agent(
    tls_server: server.TlsSignalServer, reviews: FakeReviews, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    wrong_ca, _, _ = _pki(other)
    client = _client(tls_server.port, wrong_ca, reviews.issue(POD), tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        client.phase("generation", step=1)
    deadline = time.monotonic() + 5
    while tls_server.server.handshake_failures == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tls_server.server.handshake_failures >= 1


def test_a_certificate_for_another_ip_is_refused_by_the_caller(
    agent: service.Agent, reviews: FakeReviews, tmp_path: Path
) -> None:
    ca, cert, key = _pki(tmp_path, ips=("10.0.0.7",))
    srv = server.TlsSignalServer(
        "127.0.0.1", 0, agent, reviews.authenticator(), endpoint.ServingCertificate(cert, key)
    )
    srv.start()
    try:
        client = _client(srv.port, ca, reviews.issue(POD), tmp_path)
        with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
            client.phase("generation", step=1)
    finally:
        srv.stop()


@pytest.mark.parametrize("token", ["none", "forged", "other-node"])
def test_the_token_is_still_checked_over_tls(
    tls_server: server.TlsSignalServer,
    reviews: FakeReviews,
    pki: tuple[Path, Path, Path],
    tmp_path: Path,
    token: str,
) -> None:
    value = {
        "none": None,
        "forged": "eyJhbGciOiJSUzI1NiJ9.e30.c2ln",
        "other-node": reviews.issue(POD, node="node-2"),
    }[token]
    client = _client(tls_server.port, pki[0], value, tmp_path)
    with pytest.raises(trainer.AgentRefusedError) as err:
        client.phase("generation", step=1)
    assert err.value.status == (403 if token == "other-node" else 401)


def test_a_plaintext_caller_gets_no_answer_and_frees_its_slot(
    tls_server: server.TlsSignalServer,
) -> None:
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=5) as s:
        s.sendall(b"POST /v1/phase HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            data = b""
    assert not data.startswith(b"HTTP/")
    deadline = time.monotonic() + 5
    while tls_server.server.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tls_server.server.active == 0
    assert tls_server.server.handshake_failures >= 1


def test_a_stalled_handshake_is_cut_at_the_request_deadline(
    tls_server: server.TlsSignalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(endpoint, "REQUEST_DEADLINE_S", 0.5)
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, then nothing
        start = time.monotonic()
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            data = b""
        waited = time.monotonic() - start
    assert data == b""
    assert waited < 3.0  # the deadline (0.5 s, checked every 0.25 s), not the 10 s idle timeout


def test_a_renewed_certificate_is_served_without_a_restart(
    tls_server: server.TlsSignalServer,
    reviews: FakeReviews,
    pki: tuple[Path, Path, Path],
    tmp_path: Path,
) -> None:
    ca_file, cert, key = pki
    first = ssl.get_server_certificate(("127.0.0.1", tls_server.port), ca_certs=str(ca_file))
    renewed = tmp_path / "renewed"
    renewed.mkdir()
    new_ca, new_cert, new_key = _pki(renewed)
    cert.write_bytes(new_cert.read_bytes())
    key.write_bytes(new_key.read_bytes())
    second = ssl.get_server_certificate(("127.0.0.1", tls_server.port), ca_certs=str(new_ca))
    assert first != second
    client = _client(tls_server.port, new_ca, reviews.issue(POD), tmp_path)
    answer = client._signal("/v1/phase", signals.PhaseRequest, phase="idle", step=1)
    assert answer["pod"] == str(POD)
    client.close()  # the connection stays open after an answer


def test_signals_share_one_kept_alive_connection(
    tls_server: server.TlsSignalServer,
    reviews: FakeReviews,
    pki: tuple[Path, Path, Path],
    tmp_path: Path,
) -> None:
    """The SDK keeps its connection for the next signal, so a trainer pays one TLS handshake,
    not one per signal: the agent answers HTTP/1.1 and leaves the connection open."""
    client = _client(tls_server.port, pki[0], reviews.issue(POD), tmp_path)
    client.phase("generation", step=1)
    assert client._conn is not None
    first = client._conn.sock
    assert first is not None, "the agent closed the connection after its answer"
    took_s = []
    for step in range(2, 9):
        t0 = time.perf_counter()
        client.phase("training" if step % 2 else "generation", step=step)
        took_s.append(time.perf_counter() - t0)
    assert client._conn is not None and client._conn.sock is first
    assert tls_server.server.handshake_failures == 0
    # No answer waits for the caller's delayed ACK (40 ms on Linux): the agent's socket has
    # TCP_NODELAY, so the answer's body follows its headers at once on the kept connection.
    assert sorted(took_s)[len(took_s) // 2] < 0.030, took_s
    client.close()
