"""The SDK's choice of agent endpoint: a mounted socket wins, then TLS on the node's IP."""

from __future__ import annotations

import http.client
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlenergy.api import signals
from rlenergy.sdk import trainer


@pytest.fixture
def sock_path() -> Iterator[Path]:
    """A bound Unix socket in a short folder (socket paths are limited to about 100 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        path = Path(folder) / "agent.sock"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        try:
            yield path
        finally:
            s.close()


def _tls_env(**extra: str) -> dict[str, str]:
    return {signals.HOST_ENV: "10.1.2.3", **extra}


def test_a_mounted_socket_wins_over_the_node_ip(sock_path: Path) -> None:
    ep = trainer.agent_endpoint(environ=_tls_env(**{trainer.SOCKET_ENV: str(sock_path)}))
    assert ep.socket_path == str(sock_path)
    assert isinstance(ep.connection(1.0), trainer._UnixConnection)


def test_without_a_socket_the_node_ip_is_used_over_tls(tmp_path: Path) -> None:
    env = _tls_env(
        **{
            trainer.SOCKET_ENV: str(tmp_path / "absent.sock"),
            signals.PORT_ENV: "9555",
            signals.CA_FILE_ENV: "/x/ca.crt",
        }
    )
    ep = trainer.agent_endpoint(environ=env)
    assert (ep.socket_path, ep.host, ep.port, ep.ca_file) == (None, "10.1.2.3", 9555, "/x/ca.crt")
    assert str(ep) == "https://10.1.2.3:9555"


def test_the_defaults_of_the_tls_endpoint(tmp_path: Path) -> None:
    ep = trainer.agent_endpoint(environ=_tls_env(**{trainer.SOCKET_ENV: str(tmp_path / "n")}))
    assert (ep.port, ep.ca_file) == (signals.DEFAULT_TLS_PORT, signals.DEFAULT_CA_FILE)


def test_a_file_that_is_not_a_socket_does_not_count_as_mounted(tmp_path: Path) -> None:
    plain = tmp_path / "agent.sock"
    plain.write_text("")
    ep = trainer.agent_endpoint(environ=_tls_env(**{trainer.SOCKET_ENV: str(plain)}))
    assert ep.socket_path is None and ep.host == "10.1.2.3"


def test_without_a_host_the_socket_path_is_kept_even_when_absent(tmp_path: Path) -> None:
    ep = trainer.agent_endpoint(environ={trainer.SOCKET_ENV: str(tmp_path / "later.sock")})
    assert ep.socket_path == str(tmp_path / "later.sock")  # the agent may start after the pod


def test_an_explicit_socket_path_is_always_used(tmp_path: Path) -> None:
    ep = trainer.agent_endpoint(str(tmp_path / "x.sock"), environ=_tls_env())
    assert ep.socket_path == str(tmp_path / "x.sock")


@pytest.mark.parametrize("port", ["0", "70000", "https", "-1"])
def test_a_bad_port_says_what_to_set(tmp_path: Path, port: str) -> None:
    env = _tls_env(**{trainer.SOCKET_ENV: str(tmp_path / "n"), signals.PORT_ENV: port})
    with pytest.raises(ValueError, match="RLENERGY_AGENT_PORT.*agent.tlsPort"):
        trainer.agent_endpoint(environ=env)


def test_the_tls_connection_verifies_the_ca_bundle(tmp_path: Path) -> None:
    ep = trainer.Endpoint(None, "10.1.2.3", 9403, str(tmp_path / "missing-ca.crt"))
    with pytest.raises(OSError):
        ep.connection(1.0)  # no CA bundle: no connection that would trust anything
    import datetime

    from rlenergy.api import tls

    (tmp_path / "ca.crt").write_bytes(
        tls.make_ca("ca", datetime.datetime.now(datetime.UTC)).cert_pem
    )
    conn = trainer.Endpoint(None, "10.1.2.3", 9403, str(tmp_path / "ca.crt")).connection(1.0)
    assert isinstance(conn, http.client.HTTPSConnection)
