"""Certificates of the agents' TLS signal endpoint and the operator's webhook, pure.

One CA, held by the operator (a Secret in its namespace), signs two kinds of serving
certificates: the mutating webhook's (a DNS name of the operator's Service) and each node
agent's (the node's IP addresses, asked for with a ``CertificateSigningRequest`` whose key
never leaves the node). Trainer pods trust the CA through the injected CA bundle. Keys are
ECDSA P-256; leaf certificates live ``LEAF_LIFETIME_S`` and their holder renews them after
``RENEW_FRACTION`` of it, so a CA change reaches every leaf within that time.

Everything here takes and returns PEM bytes and explicit times; nothing reads a clock, a file
or the network. Callers: ``rlenergy_operator.certs`` (CA, webhook, signing),
``rlenergy_agent.tlsserve`` (its key, request and renewal).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import ipaddress
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_LIFETIME_S = 10 * 365 * 86400
"""Lifetime of the CA certificate, s (10 years: replacing it means re-issuing every leaf)."""
LEAF_LIFETIME_S = 30 * 86400
"""Lifetime of a serving certificate, s (30 days)."""
RENEW_FRACTION = 2 / 3
"""A serving certificate is renewed once this fraction of its lifetime has passed (the
kubelet renews its own serving certificate at 70-90 %)."""
CLOCK_SKEW_S = 300
"""A certificate is valid from this long before its issue time, s (nodes' clocks differ)."""


class CertificateError(ValueError):
    """A certificate, key or request that cannot be used (the message says which and why)."""


@dataclasses.dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, PEM."""

    cert_pem: bytes
    key_pem: bytes


@dataclasses.dataclass(frozen=True)
class Request:
    """What a certificate asks for: its common name, IP/DNS subject names and organizations.

    ``organizations`` are the subject's O attributes (Kubernetes reads them as a client
    certificate's groups); ``read_csr`` never fills them, so a signed request cannot ask for a
    group.
    """

    common_name: str
    ips: tuple[str, ...]
    dns: tuple[str, ...]
    organizations: tuple[str, ...] = ()


def new_key() -> bytes:
    """A new ECDSA P-256 private key, PEM (PKCS#8, unencrypted)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _key(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise CertificateError(f"not a PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError("the private key is not an EC key (P-256 expected)")
    return key


def load_cert(cert_pem: bytes) -> x509.Certificate:
    """The first certificate of ``cert_pem``.

    Raises:
        CertificateError: not a PEM certificate.
    """
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise CertificateError(f"not a PEM certificate: {exc}") from None


COMMON_NAME_MAX = 64
"""Longest commonName X.509 allows (RFC 5280, ub-common-name), characters."""


def common_name_of(text: str) -> str:
    """``text`` as a commonName, at most ``COMMON_NAME_MAX`` characters.

    Unchanged when short enough, else cut and ended with 8 hex digits of its SHA-256, so that
    two long names (a 63-character namespace in the CA's name, a 253-character node name) stay
    distinct and within the limit.
    """
    if len(text) <= COMMON_NAME_MAX:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{text[: COMMON_NAME_MAX - 9]}-{digest}"


def public_key_pem(key_pem: bytes) -> bytes:
    """The public half of a PEM private key, PEM (SubjectPublicKeyInfo)."""
    return (
        _key(key_pem)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name_of(common_name))]
    attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    return x509.Name(attrs)


def make_ca(common_name: str, now: datetime.datetime, lifetime_s: int = CA_LIFETIME_S) -> KeyPair:
    """A new self-signed CA valid ``lifetime_s`` from ``now`` (less ``CLOCK_SKEW_S``)."""
    key_pem = new_key()
    key = _key(key_pem)
    name = _name(common_name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(seconds=CLOCK_SKEW_S))
        .not_valid_after(now + datetime.timedelta(seconds=lifetime_s))
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
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def _sans(ips: Sequence[str], dns: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    for ip in ips:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(ip)))
        except ValueError:
            raise CertificateError(f"{ip!r} is not an IP address") from None
    return names


def make_csr(
    key_pem: bytes, common_name: str, ips: Sequence[str] = (), dns: Sequence[str] = ()
) -> bytes:
    """A PKCS#10 request for a serving certificate of ``ips``/``dns``, signed by the key, PEM."""
    key = _key(key_pem)
    builder = x509.CertificateSigningRequestBuilder().subject_name(_name(common_name))
    names = _sans(ips, dns)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    csr = builder.sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM)


def read_csr(csr_pem: bytes) -> tuple[Request, x509.CertificateSigningRequest]:
    """What ``csr_pem`` asks for, after checking its signature.

    Raises:
        CertificateError: not a PEM request, or its signature does not verify.
    """
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise CertificateError(f"not a PEM certificate request: {exc}") from None
    if not csr.is_signature_valid:
        raise CertificateError("the certificate request's signature does not verify")
    cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = str(cns[0].value) if cns else ""
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return Request(cn, (), ()), csr
    ips = tuple(str(i) for i in san.get_values_for_type(x509.IPAddress))
    dns = tuple(san.get_values_for_type(x509.DNSName))
    return Request(cn, ips, dns), csr


def issue(
    ca: KeyPair,
    public_key: ec.EllipticCurvePublicKey | object,
    request: Request,
    now: datetime.datetime,
    lifetime_s: int = LEAF_LIFETIME_S,
    *,
    client: bool = False,
) -> bytes:
    """A certificate for ``request`` and ``public_key``, signed by ``ca``, PEM.

    Valid from ``now`` less ``CLOCK_SKEW_S`` for ``lifetime_s`` (never past the CA's end);
    extended key usage: server authentication (client authentication with ``client``); subject
    alternative names only when ``request`` names some.

    Raises:
        CertificateError: ``ca`` unusable, or an IP subject name that is not an IP address.
    """
    ca_cert = load_cert(ca.cert_pem)
    ca_key = _key(ca.key_pem)
    end = min(now + datetime.timedelta(seconds=lifetime_s), ca_cert.not_valid_after_utc)
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(request.common_name, request.organizations))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(seconds=CLOCK_SKEW_S))
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    names = _sans(request.ips, request.dns)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def issue_for_key(
    ca: KeyPair,
    key_pem: bytes,
    request: Request,
    now: datetime.datetime,
    lifetime_s: int = LEAF_LIFETIME_S,
    *,
    client: bool = False,
) -> bytes:
    """``issue`` for the public half of ``key_pem`` (a key the signer holds itself)."""
    return issue(ca, _key(key_pem).public_key(), request, now, lifetime_s, client=client)


def renewal_due(cert_pem: bytes, now: datetime.datetime) -> bool:
    """Whether ``cert_pem`` is past ``RENEW_FRACTION`` of its lifetime (or unreadable)."""
    try:
        cert = load_cert(cert_pem)
    except CertificateError:
        return True
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return now >= start + (end - start) * RENEW_FRACTION


def cert_ips(cert_pem: bytes) -> tuple[str, ...]:
    """The IP subject names of a certificate."""
    cert = load_cert(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(str(i) for i in san.get_values_for_type(x509.IPAddress))
