"""Certificates for the dev cluster: a throw-away PKI, made by ``rlenergy.api.tls``.

Mirrors envtest's TinyCA: ECDSA P-256 keys, one serving CA that signs the kube-apiserver's
serving certificate (SANs ``localhost`` and ``127.0.0.1``), a separate client CA that
signs the admin client certificate (``CN=admin, O=system:masters``) and a service-account
signing keypair. The certificates are built by the same code as the operator's CA and the
agents' serving certificates (``rlenergy.api.tls``), with a short lifetime.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from rlenergy.api import tls
from rlenergy.api.tls import KeyPair

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
DEFAULT_VALIDITY = dt.timedelta(days=7)


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


def _leaf(ca: KeyPair, request: tls.Request, validity: dt.timedelta, *, client: bool) -> KeyPair:
    key_pem = tls.new_key()
    now = dt.datetime.now(dt.UTC)
    lifetime_s = int(validity.total_seconds())
    return KeyPair(tls.issue_for_key(ca, key_pem, request, now, lifetime_s, client=client), key_pem)


def _hosts(hosts: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``hosts`` split into (IP addresses, DNS names)."""
    ips, dns = [], []
    for host in hosts:
        try:
            ips.append(str(ipaddress.ip_address(host)))
        except ValueError:
            dns.append(host)
    return tuple(ips), tuple(dns)


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
    now, lifetime_s = dt.datetime.now(dt.UTC), int(validity.total_seconds())
    serving_ca = tls.make_ca("rl-energy-dev-serving-ca", now, lifetime_s)
    ips, dns = _hosts(hosts)
    serving = _leaf(serving_ca, tls.Request("localhost", ips, dns), validity, client=False)
    client_ca = tls.make_ca("rl-energy-dev-client-ca", now, lifetime_s)
    admin = _leaf(client_ca, tls.Request(user, (), (), groups), validity, client=True)
    sa_key = tls.new_key()
    return Pki(serving_ca, serving, client_ca, admin, sa_key, tls.public_key_pem(sa_key))


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
    return _leaf(pki.client_ca, tls.Request(user, (), (), groups), validity, client=True)


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
