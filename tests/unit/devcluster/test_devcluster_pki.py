"""PKI and kubeconfig of the dev cluster: no binaries needed."""

from __future__ import annotations

import base64
import ipaddress
import socket
import ssl
import threading
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from rlenergy_dev.devcluster.certs import generate_pki, write_pki
from rlenergy_dev.devcluster.kubeconfig import render_kubeconfig, write_kubeconfig

from rlenergy.api import tls


@pytest.fixture(scope="module")
def pki():
    return generate_pki()


def _verify_signed_by(cert: x509.Certificate, ca: x509.Certificate) -> None:
    pub = ca.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    assert cert.signature_hash_algorithm is not None
    pub.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
    assert cert.issuer == ca.subject


def test_serving_cert_has_loopback_sans_and_server_auth(pki):
    cert = tls.load_cert(pki.serving.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    _verify_signed_by(cert, tls.load_cert(pki.serving_ca.cert_pem))


def test_admin_client_cert_is_system_masters_and_from_the_client_ca(pki):
    cert = tls.load_cert(pki.admin.cert_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "admin"
    orgs = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert orgs == ["system:masters"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    _verify_signed_by(cert, tls.load_cert(pki.client_ca.cert_pem))
    # Separate CAs: the serving CA must not vouch for client certificates.
    assert (
        tls.load_cert(pki.client_ca.cert_pem).subject
        != tls.load_cert(pki.serving_ca.cert_pem).subject
    )
    with pytest.raises(Exception):  # noqa: B017 - InvalidSignature
        _verify_signed_by(cert, tls.load_cert(pki.serving_ca.cert_pem))


def test_cas_are_cas_and_leaves_are_not(pki):
    for ca in (tls.load_cert(pki.serving_ca.cert_pem), tls.load_cert(pki.client_ca.cert_pem)):
        assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (tls.load_cert(pki.serving.cert_pem), tls.load_cert(pki.admin.cert_pem)):
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_sa_signing_keypair_matches(pki):
    key = serialization.load_pem_private_key(pki.sa_key_pem, password=None)
    pub = serialization.load_pem_public_key(pki.sa_pub_pem)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    sig = key.sign(b"token", ec.ECDSA(hashes.SHA256()))
    pub.verify(sig, b"token", ec.ECDSA(hashes.SHA256()))


def test_each_pki_is_fresh():
    a, b = generate_pki(), generate_pki()
    assert a.serving_ca.cert_pem != b.serving_ca.cert_pem
    assert a.sa_key_pem != b.sa_key_pem


def test_write_pki_permissions(pki, tmp_path: Path):
    paths = write_pki(pki, tmp_path / "pki")
    assert paths.serving_key.stat().st_mode & 0o777 == 0o600
    assert paths.admin_key.stat().st_mode & 0o777 == 0o600
    assert paths.sa_key.stat().st_mode & 0o777 == 0o600
    assert paths.serving_ca_cert.read_bytes() == pki.serving_ca.cert_pem


def test_mutual_tls_handshake_on_loopback(pki, tmp_path: Path):
    """The certificates work for real TLS: server verified by IP SAN, client by the client CA."""
    paths = write_pki(pki, tmp_path / "pki")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(paths.serving_cert, paths.serving_key)
    server_ctx.load_verify_locations(paths.client_ca_cert)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.create_default_context(cafile=str(paths.serving_ca_cert))
    client_ctx.load_cert_chain(paths.admin_cert, paths.admin_key)

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen: dict[str, object] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            seen["peer"] = tls.getpeercert()
            tls.sendall(b"ok")

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                assert tls.recv(2) == b"ok"
    finally:
        thread.join(10)
        listener.close()
    subject = dict(x[0] for x in seen["peer"]["subject"])  # type: ignore[index]
    assert subject == {"commonName": "admin", "organizationName": "system:masters"}


def test_client_without_the_serving_ca_rejects_the_server(pki, tmp_path: Path):
    paths = write_pki(pki, tmp_path / "pki")
    other = write_pki(generate_pki(), tmp_path / "other")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(paths.serving_cert, paths.serving_key)
    client_ctx = ssl.create_default_context(cafile=str(other.serving_ca_cert))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            server_ctx.wrap_socket(conn, server_side=True).close()
        except (ssl.SSLError, OSError):
            conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with pytest.raises(ssl.SSLCertVerificationError):
                client_ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    finally:
        thread.join(10)
        listener.close()


def test_render_kubeconfig_roundtrip(pki, tmp_path: Path):
    text = render_kubeconfig(
        "https://127.0.0.1:6443", pki.serving_ca.cert_pem, pki.admin.cert_pem, pki.admin.key_pem
    )
    doc = yaml.safe_load(text)
    assert doc["kind"] == "Config"
    assert doc["current-context"] == "rl-energy-dev"
    (ctx,) = doc["contexts"]
    (cluster,) = doc["clusters"]
    (user,) = doc["users"]
    assert ctx["context"] == {"cluster": cluster["name"], "user": user["name"]}
    assert cluster["cluster"]["server"] == "https://127.0.0.1:6443"
    assert base64.b64decode(cluster["cluster"]["certificate-authority-data"]) == (
        pki.serving_ca.cert_pem
    )
    assert base64.b64decode(user["user"]["client-certificate-data"]) == pki.admin.cert_pem
    assert base64.b64decode(user["user"]["client-key-data"]) == pki.admin.key_pem
    path = write_kubeconfig(tmp_path / "kc" / "kubeconfig", text)
    assert path.read_text() == text
    assert path.stat().st_mode & 0o777 == 0o600


def test_render_kubeconfig_refuses_plain_http(pki):
    with pytest.raises(ValueError, match="HTTPS"):
        render_kubeconfig(
            "http://127.0.0.1:8080", pki.serving_ca.cert_pem, pki.admin.cert_pem, pki.admin.key_pem
        )
