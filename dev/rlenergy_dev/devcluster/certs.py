"""Certificates for the dev cluster: a throw-away PKI made with ``cryptography``.

Mirrors envtest's TinyCA: ECDSA P-256 keys, one serving CA that signs the kube-apiserver's
serving certificate (SANs ``localhost`` and ``127.0.0.1``), a separate client CA that
signs the admin client certificate (``CN=admin, O=system:masters``) and a service-account
signing keypair.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
DEFAULT_VALIDITY = dt.timedelta(days=7)


@dataclass(frozen=True)
class KeyPair:
    """A PEM-encoded certificate and its PEM-encoded (PKCS#8, unencrypted) private key."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        """The parsed certificate."""
        return x509.load_pem_x509_certificate(self.cert_pem)


@dataclass(frozen=True)
class Pki:
    """Everything the control plane needs, in memory."""

    serving_ca: KeyPair
    serving: KeyPair
    client_ca: KeyPair
    admin: KeyPair
    sa_key_pem: bytes
    sa_pub_pem: bytes


@dataclass(frozen=True)
class PkiPaths:
    """Where :func:`write_pki` put the files."""

    serving_ca_cert: Path
    serving_cert: Path
    serving_key: Path
    client_ca_cert: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name(attrs)


def _window(validity: dt.timedelta) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC)
    # Back-date a little so a slightly skewed clock does not reject a fresh certificate.
    return now - dt.timedelta(minutes=5), now + validity


def _make_ca(cn: str, validity: dt.timedelta) -> tuple[KeyPair, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    not_before, not_after = _window(validity)
    name = _name(cn, ("rl-energy-dev",))
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)), key


def _make_leaf(
    ca: KeyPair,
    ca_key: ec.EllipticCurvePrivateKey,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    validity: dt.timedelta,
    hosts: tuple[str, ...] = (),
) -> KeyPair:
    key = _new_key()
    not_before, not_after = _window(validity)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if hosts:
        sans: list[x509.GeneralName] = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def generate_pki(
    hosts: tuple[str, ...] = DEFAULT_HOSTS,
    *,
    user: str = "admin",
    groups: tuple[str, ...] = ("system:masters",),
    validity: dt.timedelta = DEFAULT_VALIDITY,
) -> Pki:
    """Create a fresh PKI for one dev cluster.

    Args:
        hosts: DNS names and IP addresses the serving certificate is valid for.
        user: Common name of the client certificate (the Kubernetes user name).
        groups: Organisations of the client certificate (the Kubernetes groups).
        validity: How long every certificate stays valid.

    Returns:
        The CAs, the serving and client keypairs and the service-account signing keypair.
    """
    serving_ca, serving_ca_key = _make_ca("rl-energy-dev-serving-ca", validity)
    serving = _make_leaf(
        serving_ca,
        serving_ca_key,
        _name("localhost"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        validity,
        hosts,
    )
    client_ca, client_ca_key = _make_ca("rl-energy-dev-client-ca", validity)
    admin = _make_leaf(
        client_ca, client_ca_key, _name(user, groups), ExtendedKeyUsageOID.CLIENT_AUTH, validity
    )
    sa_key = _new_key()
    sa_pub = sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return Pki(serving_ca, serving, client_ca, admin, _key_pem(sa_key), sa_pub)


def client_cert(
    pki: Pki, user: str, groups: tuple[str, ...] = (), validity: dt.timedelta = DEFAULT_VALIDITY
) -> KeyPair:
    """One more client certificate signed by the PKI's client CA.

    Args:
        pki: The PKI from :func:`generate_pki` (its client CA signs).
        user: Common name (the Kubernetes user name, e.g. ``system:node:<name>``).
        groups: Organisations (the Kubernetes groups, e.g. ``system:nodes``).
        validity: How long the certificate stays valid.

    Returns:
        The certificate and its key.
    """
    ca_key = serialization.load_pem_private_key(pki.client_ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("the client CA key is not an EC key")
    return _make_leaf(
        pki.client_ca, ca_key, _name(user, groups), ExtendedKeyUsageOID.CLIENT_AUTH, validity
    )


def write_pki(pki: Pki, directory: Path) -> PkiPaths:
    """Write the PKI to ``directory`` (created with mode 0700; keys get mode 0600).

    Args:
        pki: The PKI from :func:`generate_pki`.
        directory: Target directory.

    Returns:
        The paths of the written files.
    """
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = PkiPaths(
        serving_ca_cert=directory / "serving-ca.crt",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        client_ca_cert=directory / "client-ca.crt",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_key=directory / "sa-signer.key",
        sa_pub=directory / "sa-signer.pub",
    )
    files = {
        paths.serving_ca_cert: pki.serving_ca.cert_pem,
        paths.serving_cert: pki.serving.cert_pem,
        paths.serving_key: pki.serving.key_pem,
        paths.client_ca_cert: pki.client_ca.cert_pem,
        paths.admin_cert: pki.admin.cert_pem,
        paths.admin_key: pki.admin.key_pem,
        paths.sa_key: pki.sa_key_pem,
        paths.sa_pub: pki.sa_pub_pem,
    }
    for path, data in files.items():
        path.write_bytes(data)
        path.chmod(0o600 if path.suffix == ".key" else 0o644)
    return paths
