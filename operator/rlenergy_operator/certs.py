"""The operator's CA: which node-agent certificate requests it signs, pure.

Each node agent asks for its serving certificate with a Kubernetes
``CertificateSigningRequest`` of signer ``rlenergy.io/agent-serving`` (``SIGNER``), generating
its key on the node. The operator approves and signs a request only when:

* it was made by the agents' service account (``spec.username``) with a token bound to a pod
  on node N (``spec.extra["authentication.kubernetes.io/node-name"] == [N]``, the same
  pod-bound token fact the chart's node-report policy relies on);
* its common name is N and it asks only for IP addresses node N has (``status.addresses``),
  no DNS name;
* its usages are server authentication (with digital signature / key encipherment).

Anything else is denied with a reason that says what is wrong. So an agent cannot obtain a
certificate for another node's address, and nobody but the agents' service account can obtain
one at all. Why a CSR and not a chart-made certificate: the key never leaves its node, each
agent renews its own certificate before it expires, and helm's ``genCA``/``genSignedCert`` make
new keys at every render (a GitOps sync would rotate them at random, and the chart does not
know the nodes' addresses).

Callers: ``rlenergy_operator.webhook`` (the CSR handler).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from rlenergy.api import tls

SIGNER = "rlenergy.io/agent-serving"
"""signerName of the node agents' serving-certificate requests."""
NODE_EXTRA = "authentication.kubernetes.io/node-name"
"""The user-info extra the API server adds for a token bound to a pod (the pod's node)."""
MIN_LIFETIME_S = 600
"""Shortest ``spec.expirationSeconds`` the API server accepts, s."""
ALLOWED_USAGES = frozenset({"server auth", "digital signature", "key encipherment"})
"""Usages an agent's request may ask for; ``server auth`` is required."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether to sign a request, why, and for which node."""

    approve: bool
    reason: str
    message: str
    node: str = ""


def _deny(reason: str, message: str, node: str = "") -> Verdict:
    return Verdict(False, reason, message, node)


def node_ips(node: Mapping[str, Any]) -> set[str]:
    """The ``InternalIP`` and ``ExternalIP`` addresses of a Node object."""
    return {
        str(a.get("address"))
        for a in (node.get("status") or {}).get("addresses") or []
        if a.get("type") in ("InternalIP", "ExternalIP")
    }


def judge(
    csr: Mapping[str, Any],
    agent_user: str,
    node_addresses: Mapping[str, set[str]],
) -> Verdict:
    """Whether the operator signs ``csr`` (a CertificateSigningRequest object).

    Args:
        csr: the request as the API server returns it (``spec.request`` base64 PEM).
        agent_user: the agents' service-account user name
            (``system:serviceaccount:<namespace>:<name>``).
        node_addresses: node name -> its IP addresses, for the node the request names (other
            entries are ignored; a missing node is denied).

    Returns:
        ``approve`` and the condition's ``reason``/``message``.
    """
    spec = csr.get("spec") or {}
    if spec.get("signerName") != SIGNER:
        return _deny("NotOurSigner", f"signerName is {spec.get('signerName')!r}, not {SIGNER}")
    if spec.get("username") != agent_user:
        return _deny(
            "NotTheNodeAgent",
            f"requested by {spec.get('username')!r}; only {agent_user} may ask for an agent "
            "serving certificate",
        )
    nodes = list((spec.get("extra") or {}).get(NODE_EXTRA) or [])
    if len(nodes) != 1:
        return _deny(
            "NoNode",
            "the requester's token names no node: the agent must use its pod-bound "
            "service-account token (Kubernetes 1.30+)",
        )
    node = str(nodes[0])
    usages = set(spec.get("usages") or [])
    if "server auth" not in usages or not usages <= ALLOWED_USAGES:
        return _deny(
            "BadUsages",
            f"usages {sorted(usages)}: ask for 'server auth' (and 'digital signature')",
            node,
        )
    try:
        request, _ = tls.read_csr(base64.b64decode(spec.get("request") or ""))
    except (tls.CertificateError, ValueError) as exc:
        return _deny("BadRequest", str(exc), node)
    if request.common_name != tls.common_name_of(node):
        return _deny(
            "WrongNode",
            f"common name {request.common_name!r} is not the requester's node {node!r}",
            node,
        )
    if request.dns:
        return _deny("DnsNamesNotAllowed", f"DNS names {list(request.dns)}: ask for IPs only", node)
    if not request.ips:
        return _deny("NoAddress", "the request names no IP address", node)
    own = node_addresses.get(node)
    if own is None:
        return _deny("UnknownNode", f"node {node!r} does not exist", node)
    foreign = sorted(set(request.ips) - own)
    if foreign:
        return _deny(
            "NotTheNodesAddress",
            f"{foreign} are not addresses of node {node} ({sorted(own)})",
            node,
        )
    return Verdict(True, "AgentServingCertificate", f"serving certificate of node {node}", node)


def sign(csr: Mapping[str, Any], ca: tls.KeyPair, now: datetime.datetime) -> str:
    """The signed certificate for an approved ``csr``, base64 PEM (``status.certificate``).

    Valid ``rlenergy.api.tls.LEAF_LIFETIME_S``, or the request's ``spec.expirationSeconds``
    when shorter (at least ``MIN_LIFETIME_S``, as the API server requires).

    Raises:
        rlenergy.api.tls.CertificateError: the request does not parse.
    """
    spec = csr.get("spec") or {}
    request, parsed = tls.read_csr(base64.b64decode(spec.get("request") or ""))
    asked = spec.get("expirationSeconds")
    lifetime = tls.LEAF_LIFETIME_S
    if isinstance(asked, int) and asked >= MIN_LIFETIME_S:
        lifetime = min(lifetime, asked)
    pem = tls.issue(ca, parsed.public_key(), request, now, lifetime)
    return base64.b64encode(pem + ca.cert_pem).decode()


def bundle(certificates: Sequence[bytes], now: datetime.datetime) -> str:
    """The CA bundle trainers trust, PEM text: each CA certificate not yet expired.

    ``certificates``: the current CA first, then a replaced one (``previous.crt`` of the CA
    Secret) that still signs serving certificates in use until their holders renew them.
    Unreadable entries are left out.
    """
    out: list[str] = []
    for pem in certificates:
        try:
            cert = tls.load_cert(pem)
        except tls.CertificateError:
            continue
        if cert.not_valid_after_utc > now:
            out.append(pem.decode())
    return "".join(out)
