"""The admission handler through kopf's own patch, and the agents' certificate requests."""

from __future__ import annotations

import base64
import copy
import datetime
import logging
import time
from pathlib import Path
from typing import Any

import jsonpatch  # type: ignore[import-untyped]
import kopf
import pytest
from rlenergy_operator import certs, injection, webhook

from rlenergy.api import tls

NOW = datetime.datetime.now(datetime.UTC)
AGENT = "system:serviceaccount:rl-energy-system:rlenergy-node-agent"
LOG = logging.getLogger("test")


def _pod(namespace: str = "team-a", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "trainer-",
            "namespace": namespace,
            "labels": {"app": "trainer", injection.LABEL: "true", **labels},
        },
        "spec": {"containers": [{"name": "trainer", "image": "verl"}]},
    }


def _admit(pod: dict[str, Any], policies: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """The JSON patch kopf would answer the API server with for ``pod``."""
    body = kopf.Body(pod)
    patch = kopf.Patch(body=body)
    webhook.pod_inject(body=body, patch=patch, logger=LOG)
    return list(patch.as_json_patch())


@pytest.fixture
def policies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = [("job", {"matchLabels": {"app": "trainer"}})]
    monkeypatch.setattr(webhook, "_selectors", lambda namespace: list(found))
    return found


def test_the_answer_injects_and_a_reinvocation_adds_nothing(
    policies: list[tuple[str, Any]],
) -> None:
    pod = _pod()
    ops = _admit(pod, policies)
    assert ops, "an opted-in, selected pod is patched"
    admitted = jsonpatch.apply_patch(copy.deepcopy(pod), ops)
    assert injection.is_injected(admitted)
    assert admitted == injection.injected(pod, webhook.INJECT)
    assert _admit(admitted, policies) == []  # reinvocationPolicy: IfNeeded


def test_no_patch_for_pods_it_must_not_touch(policies: list[tuple[str, Any]]) -> None:
    assert _admit(_pod(app="other"), policies) == []
    assert _admit(_pod(namespace=webhook.CFG.namespace), policies) == []
    policies.clear()
    assert _admit(_pod(), policies) == []


def test_an_api_error_admits_the_pod_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(namespace: str) -> list[tuple[str, Any]]:
        raise webhook.kube.ApiError(status=0, reason="API server unreachable")

    monkeypatch.setattr(webhook, "_selectors", fail)
    assert _admit(_pod(), []) == []


def test_the_webhook_certificate_is_renewed_only_when_due(tmp_path: Path) -> None:
    ca = tls.make_ca("ca", NOW)
    cert = webhook.WebhookCertificate(ca, "rlenergy-webhook.rl-energy-system.svc", tmp_path)
    assert cert.renew_if_due(NOW) is True
    first = cert.cert_file.read_bytes()
    assert cert.renew_if_due(NOW + datetime.timedelta(days=1)) is False
    late = NOW + datetime.timedelta(seconds=tls.LEAF_LIFETIME_S * 0.7)
    assert cert.renew_if_due(late) is True
    assert cert.cert_file.read_bytes() != first
    assert (cert.key_file.stat().st_mode & 0o777) == 0o600
    leaf = tls.load_cert(cert.cert_file.read_bytes())
    names = leaf.extensions.get_extension_for_class(
        tls.x509.SubjectAlternativeName
    ).value.get_values_for_type(tls.x509.DNSName)
    assert names == ["rlenergy-webhook.rl-energy-system.svc", "rlenergy-webhook.rl-energy-system"]


# ----- the agents' certificate requests --------------------------------------------------------


def _csr(
    node: str = "gpu-1",
    ips: tuple[str, ...] = ("10.0.0.5",),
    *,
    cn: str | None = None,
    user: str = AGENT,
    extra_node: list[str] | None = None,
    usages: tuple[str, ...] = ("digital signature", "server auth"),
    dns: tuple[str, ...] = (),
    signer: str = certs.SIGNER,
) -> dict[str, Any]:
    key = tls.new_key()
    pem = tls.make_csr(key, node if cn is None else cn, ips, dns)
    return {
        "metadata": {"name": "agent-gpu-1"},
        "spec": {
            "signerName": signer,
            "username": user,
            "extra": {certs.NODE_EXTRA: [node] if extra_node is None else extra_node},
            "usages": list(usages),
            "request": base64.b64encode(pem).decode(),
        },
    }


ADDRESSES = {"gpu-1": {"10.0.0.5", "192.168.1.5"}}


def test_an_agents_request_for_its_own_node_is_signed_by_the_ca() -> None:
    csr = _csr(ips=("10.0.0.5", "192.168.1.5"))
    verdict = certs.judge(csr, AGENT, ADDRESSES)
    assert verdict.approve and verdict.node == "gpu-1"
    ca = tls.make_ca("ca", NOW)
    chain = base64.b64decode(certs.sign(csr, ca, NOW))
    leaf = tls.load_cert(chain)
    assert set(tls.cert_ips(chain)) == {"10.0.0.5", "192.168.1.5"}
    leaf.verify_directly_issued_by(tls.load_cert(ca.cert_pem))


@pytest.mark.parametrize(
    ("csr", "reason"),
    [
        (_csr(ips=("10.0.0.6",)), "NotTheNodesAddress"),
        (_csr(cn="gpu-2"), "WrongNode"),
        (_csr(user="system:serviceaccount:team-a:default"), "NotTheNodeAgent"),
        (_csr(extra_node=[]), "NoNode"),
        (_csr(usages=("client auth",)), "BadUsages"),
        (_csr(dns=("evil.example",)), "DnsNamesNotAllowed"),
        (_csr(ips=()), "NoAddress"),
        (_csr(node="gpu-9"), "UnknownNode"),
        (_csr(signer="kubernetes.io/kubelet-serving"), "NotOurSigner"),
    ],
)
def test_requests_the_operator_denies(csr: dict[str, Any], reason: str) -> None:
    verdict = certs.judge(csr, AGENT, ADDRESSES)
    assert (verdict.approve, verdict.reason) == (False, reason)
    assert verdict.message


def test_a_request_whose_signature_does_not_verify_is_denied() -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    csr = _csr()
    parsed = x509.load_pem_x509_csr(base64.b64decode(csr["spec"]["request"]))
    der = bytearray(parsed.public_bytes(serialization.Encoding.DER))
    der[-3] ^= 0x01  # a bit of the signature
    pem = b"-----BEGIN CERTIFICATE REQUEST-----\n" + base64.encodebytes(bytes(der))
    csr["spec"]["request"] = base64.b64encode(pem + b"-----END CERTIFICATE REQUEST-----\n").decode()
    verdict = certs.judge(csr, AGENT, ADDRESSES)
    assert (verdict.approve, verdict.reason) == (False, "BadRequest")


def test_node_ips_reads_internal_and_external_addresses() -> None:
    node = {
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": "10.0.0.5"},
                {"type": "ExternalIP", "address": "1.2.3.4"},
                {"type": "Hostname", "address": "gpu-1"},
            ]
        }
    }
    assert certs.node_ips(node) == {"10.0.0.5", "1.2.3.4"}


def test_the_bundle_keeps_a_replaced_ca_until_it_expires() -> None:
    old = tls.make_ca("old", NOW - datetime.timedelta(days=3000))
    new = tls.make_ca("new", NOW)
    text = certs.bundle([new.cert_pem, old.cert_pem], NOW)
    assert text == new.cert_pem.decode() + old.cert_pem.decode()
    after = NOW + datetime.timedelta(seconds=tls.CA_LIFETIME_S - 3000 * 86400 + 86400)
    assert certs.bundle([new.cert_pem, old.cert_pem], after) == new.cert_pem.decode()
    assert certs.bundle([b"not a certificate", new.cert_pem], NOW) == new.cert_pem.decode()


def test_names_past_x509s_64_characters_make_a_ca_and_a_signed_leaf() -> None:
    """A 63-character namespace in the CA's name and a 253-character node name (both valid
    Kubernetes names) exceed X.509's 64-character commonName: the operator failed to start."""
    namespace = "n" * 63
    ca = tls.make_ca(f"rlenergy-operator CA ({namespace})", NOW)
    node = ("gpu-" + "x" * 249)[:253]
    csr = _csr(node=node)
    verdict = certs.judge(csr, AGENT, {node: {"10.0.0.5"}})
    assert verdict.approve, verdict.message
    leaf = tls.load_cert(base64.b64decode(certs.sign(csr, ca, NOW)))
    leaf.verify_directly_issued_by(tls.load_cert(ca.cert_pem))
    assert tls.common_name_of(node) != tls.common_name_of(node[:-1] + "y")
    assert len(tls.common_name_of(node)) == tls.COMMON_NAME_MAX


@pytest.mark.parametrize(("port", "handlers"), [("0", 0), ("9443", 1)])
def test_the_admission_handler_exists_only_with_the_webhook_port(port: str, handlers: int) -> None:
    """kopf stops the whole operator when admission handlers exist but no admission server is
    configured: an operator without a webhook port (a local run, a chart with the webhook off)
    must register none."""
    import os
    import subprocess
    import sys

    code = (
        "import kopf, rlenergy_operator.webhook as w; "
        "print(len(kopf.get_default_registry()._webhooks.get_all_handlers()))"
    )
    env = {
        **os.environ,
        "RLENERGY_OPERATOR_WEBHOOK_PORT": port,
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip().splitlines()[-1]) == handlers


def _start_webhook(monkeypatch: pytest.MonkeyPatch, **cfg: Any) -> kopf.Memo:
    """Run the start-up handler with the webhook served (``cfg``: more operator settings) and a
    CA made in memory (no Secret); returns its memo."""
    update = {"webhook_port": 9443, **cfg}
    monkeypatch.setattr(webhook, "CFG", webhook.CFG.model_copy(update=update))
    monkeypatch.setattr(
        webhook.kube,
        "ensure_ca_secret",
        lambda namespace, name, make: dict(zip(("tls.crt", "tls.key"), make(), strict=True)),
    )
    memo = kopf.Memo()
    webhook.webhook_startup(settings=kopf.OperatorSettings(), memo=memo)
    return memo


def test_the_serving_key_is_removed_at_cleanup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up writes the webhook's key and certificate to a folder of its own; kopf's cleanup
    stops their renewal and removes the folder, key included."""
    memo = _start_webhook(monkeypatch)
    folder = memo["webhook_cert_dir"]
    assert (folder / "tls.key").is_file() and (folder / "tls.crt").is_file()
    webhook.webhook_cleanup(memo=memo)
    assert memo["webhook_upkeep"].is_set()
    assert not folder.exists()


def test_the_ca_bundle_is_set_again_until_cleanup(monkeypatch: pytest.MonkeyPatch) -> None:
    """A webhook configuration created or replaced after start-up gets the CA back at the next
    check, an API error does not end the checks, and kopf's cleanup does."""
    monkeypatch.setattr(webhook, "CA_BUNDLE_CHECK_S", 0.01)
    answers: list[bool | Exception] = [False, True, webhook.kube.ApiError(503, "busy"), True]
    calls: list[tuple[str, bytes, bytes]] = []

    def set_bundle(name: str, bundle_pem: bytes, *, unless_trusts: bytes = b"") -> bool:
        calls.append((name, bundle_pem, unless_trusts))
        answer = answers.pop(0) if answers else False
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(webhook.kube, "set_webhook_ca_bundle", set_bundle)
    memo = _start_webhook(monkeypatch, webhook_configuration="rl-pods")
    deadline = time.monotonic() + 10
    while answers and time.monotonic() < deadline:
        time.sleep(0.01)
    webhook.webhook_cleanup(memo=memo)
    assert not answers, "the checks stopped before the configuration was set again"
    seen = len(calls)
    time.sleep(0.1)
    assert len(calls) <= seen + 1  # at most the check that was under way at cleanup
    ca_pem = memo["ca"].cert_pem
    assert {name for name, _, _ in calls} == {"rl-pods"}
    assert all(pem == memo["ca_bundle"].encode() for _, pem, _ in calls)
    assert calls[0][2] == b"" and all(trusts == ca_pem for _, _, trusts in calls[1:])
