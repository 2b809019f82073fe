"""kopf handlers of the trainer-pod webhook and the agents' certificates: thin I/O over pure code.

* ``webhook_startup``: load (or create) the operator's CA (Secret ``ca_secret``), issue the
  webhook's serving certificate from it into a private folder, serve kopf's admission server
  on ``webhook_port`` and set the chart's MutatingWebhookConfiguration's ``caBundle`` to the
  CA; a thread keeps that ``caBundle`` set (every ``CA_BUNDLE_CHECK_S``) and renews the
  serving certificate after ``RENEW_FRACTION`` of its lifetime (kopf restarts its listener
  when the files change).
* ``pod_inject`` (mutating admission, pods, CREATE): ``injection.decide`` over the policies of
  the pod's namespace (one list call), then ``injection.inject_into`` as a kopf patch
  function, so the JSON patch is the difference and a reinvocation adds nothing.
* ``policy_ca_publish`` (policy create/resume): the CA bundle ConfigMap in the policy's
  namespace, which the injected volume reads; ``policy_ungoverned_check`` (timer): publishes
  it again when it went missing, and opted-in pods the policy selects that were admitted
  without the volume (the webhook was down) get a Warning event on the policy, once per pod.
* ``agent_csr`` (CertificateSigningRequest create/resume of signer ``rlenergy.io/agent-serving``):
  ``certs.judge``, then approve and sign, or deny.

Failures never block a pod: the webhook configuration says ``failurePolicy: Ignore``, and an
error here admits the pod unchanged (kopf answers allowed with no patch).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import kopf

from rlenergy.api import tls
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy_operator import certs, injection, kube, shards
from rlenergy_operator import settings as op_settings

CFG = op_settings.OperatorConfig()
RESOURCE = (api_policy.GROUP, api_policy.VERSION, api_policy.PLURAL)
_SERVED = shards.when_served(CFG.layout)  # each shard publishes for its own policies
_OWNED = shards.when_owned(CFG.layout)
INJECT = injection.InjectConfig(
    operator_namespace=CFG.namespace, audience=CFG.agent_token_audience, port=CFG.agent_tls_port
)
AGENT_USER = f"system:serviceaccount:{CFG.namespace}:{CFG.agent_service_account}"
CA_BUNDLE_CHECK_S = 10.0
"""Seconds between reads of the chart's MutatingWebhookConfiguration (one GET). A configuration
without the CA as ``caBundle`` (created after the operator started, or re-created without it by
a GitOps sync or ``kubectl replace``) makes the API server fail every call to the webhook and,
under ``failurePolicy: Ignore``, admit trainer pods uninjected; the thread sets it again."""
UNGOVERNED_CHECK_S = 30.0
"""Seconds between checks for opted-in pods admitted without the injection (one pod list
per policy, selected on the opt-in label)."""
log = logging.getLogger(__name__)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _new_ca() -> tuple[bytes, bytes]:
    ca = tls.make_ca(f"rlenergy-operator CA ({CFG.namespace})", _now())
    return ca.cert_pem, ca.key_pem


def webhook_names(service: str) -> tuple[str, ...]:
    """DNS names of the webhook's certificate: ``<svc>.<ns>.svc`` and its shorter forms."""
    parts = service.split(".")
    return tuple(".".join(parts[:i]) for i in range(len(parts), 0, -1) if i >= 2) or (service,)


class WebhookCertificate:
    """The webhook's serving certificate files, issued from the CA and renewed in time.

    Args:
        ca: the operator's CA.
        service: the webhook's DNS name.
        folder: where ``tls.crt`` and ``tls.key`` are written (private to the process).
    """

    def __init__(self, ca: tls.KeyPair, service: str, folder: Path) -> None:
        self.ca = ca
        self.service = service
        self.cert_file = folder / "tls.crt"
        self.key_file = folder / "tls.key"

    def renew_if_due(self, now: datetime.datetime) -> bool:
        """Issue a new key and certificate when none exists or it is due; returns whether."""
        if self.cert_file.exists() and not tls.renewal_due(self.cert_file.read_bytes(), now):
            return False
        key = tls.new_key()
        try:  # an address (a local operator the API server calls by URL) is an IP name
            request = tls.Request(self.service, (str(ipaddress.ip_address(self.service)),), ())
        except ValueError:
            request = tls.Request(self.service, (), webhook_names(self.service))
        cert = tls.issue_for_key(self.ca, key, request, now)
        for path, data in ((self.key_file, key), (self.cert_file, cert + self.ca.cert_pem)):
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return True


def _set_ca_bundle(bundle_pem: bytes, unless_trusts: bytes = b"") -> bool:
    """Set the chart's MutatingWebhookConfiguration's ``caBundle`` (``kube.set_webhook_ca_bundle``).

    Returns whether it changed.

    Raises:
        kube.ApiError: it could not be read or patched.
    """
    if not CFG.webhook_configuration:
        return False
    return kube.set_webhook_ca_bundle(
        CFG.webhook_configuration, bundle_pem, unless_trusts=unless_trusts
    )


def _keep_serving(cert: WebhookCertificate, bundle_pem: bytes, stop: threading.Event) -> None:
    """Keep the webhook servable until ``stop`` is set.

    Every ``CA_BUNDLE_CHECK_S`` the ``caBundle`` is set again unless it trusts the CA, and the
    serving certificate is renewed when due (a read of its file). Errors are logged and tried
    again at the next check.
    """
    while not stop.wait(CA_BUNDLE_CHECK_S):
        try:
            if _set_ca_bundle(bundle_pem, unless_trusts=cert.ca.cert_pem):
                log.warning(
                    "MutatingWebhookConfiguration %s did not trust this operator's CA (created or "
                    "replaced after start-up): caBundle set; pods admitted meanwhile were not "
                    "injected",
                    CFG.webhook_configuration,
                )
        except kube.ApiError as exc:
            log.error(
                "MutatingWebhookConfiguration %s: caBundle not checked: %s %s",
                CFG.webhook_configuration, exc.status, exc.reason,
            )  # fmt: skip
        try:
            if cert.renew_if_due(_now()):
                log.info("webhook serving certificate renewed")
        except OSError as exc:
            log.error("webhook serving certificate not renewed: %s", exc)


@kopf.on.startup()
def webhook_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Load the CA; with a webhook port, serve the admission webhook with a CA-signed cert.

    Raises:
        kopf.TemporaryError: the CA Secret or the webhook configuration could not be read or
            written (kopf retries the start-up handler).
    """
    memo["ca"] = None
    memo["ca_bundle"] = None
    if not (CFG.webhook_port or CFG.agent_tls_port):
        return
    try:
        data = kube.ensure_ca_secret(CFG.namespace, CFG.ca_secret, _new_ca)
    except kube.ApiError as exc:
        raise kopf.TemporaryError(f"CA Secret {CFG.ca_secret}: {exc.status} {exc.reason}") from exc
    ca = tls.KeyPair(data["tls.crt"], data["tls.key"])
    memo["ca"] = ca
    trusted = [ca.cert_pem, *([data["previous.crt"]] if "previous.crt" in data else [])]
    memo["ca_bundle"] = certs.bundle(trusted, _now())
    if not CFG.webhook_port:
        return
    service = CFG.webhook_service or f"rlenergy-webhook.{CFG.namespace}.svc"
    folder = memo.get("webhook_cert_dir") or Path(tempfile.mkdtemp(prefix="rlenergy-webhook-"))
    memo["webhook_cert_dir"] = folder  # kept when kopf retries this handler
    cert = WebhookCertificate(ca, service, folder)
    cert.renew_if_due(_now())
    stop = threading.Event()
    memo["webhook_upkeep"] = stop
    settings.admission.server = kopf.WebhookServer(
        addr="0.0.0.0",  # noqa: S104 - the API server calls it through the Service
        port=CFG.webhook_port,
        host=service,
        certfile=str(cert.cert_file),
        pkeyfile=str(cert.key_file),
        cadata=ca.cert_pem,
    )
    bundle_pem = memo["ca_bundle"].encode()
    try:
        _set_ca_bundle(bundle_pem)
    except kube.ApiError as exc:
        raise kopf.TemporaryError(
            f"MutatingWebhookConfiguration {CFG.webhook_configuration}: {exc.status} {exc.reason}"
        ) from exc
    threading.Thread(
        target=_keep_serving, args=(cert, bundle_pem, stop), name="webhook-upkeep", daemon=True
    ).start()


@kopf.on.cleanup()
def webhook_cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop renewing the webhook's serving certificate and remove its key and certificate.

    They live in a folder of this process's own (``tempfile.mkdtemp``); in a pod it goes with
    the container, but an operator run on a host (the tests, a local run) left its private key
    behind in ``/tmp`` at every exit.
    """
    stop = memo.get("webhook_upkeep")
    if stop is not None:
        stop.set()
    folder = memo.get("webhook_cert_dir")
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _selectors(namespace: str) -> list[tuple[str, Any]]:
    return [
        (str(p["metadata"]["name"]), (p.get("spec") or {}).get("selector"))
        for p in kube.live_policies([namespace])
    ]


def pod_inject(*, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    """Inject the agent's token, CA bundle and endpoint into an opted-in, selected pod."""
    namespace = body.get("metadata", {}).get("namespace") or ""
    try:
        policies = _selectors(namespace)
    except kube.ApiError as exc:
        logger.warning("pod admitted without injection: policies of %s: %s", namespace, exc)
        return
    decision = injection.decide(body, namespace, policies, INJECT)
    if not decision.inject:
        return
    patch.fns.append(_inject)


def _inject(pod: Any) -> None:
    """The patch function kopf runs on its copy of the admitted pod."""
    injection.inject_into(pod, INJECT)


def _publish_ca(namespace: str | None, bundle: str | None) -> None:
    """Write the CA bundle ConfigMap into ``namespace`` (nothing without a bundle or namespace).

    Raises:
        kopf.TemporaryError: the ConfigMap could not be written.
    """
    if not bundle or not namespace:
        return
    try:
        kube.ensure_configmap(namespace, injection.CA_CONFIGMAP, {injection.CA_KEY: bundle})
    except kube.ApiError as exc:
        raise kopf.TemporaryError(
            f"ConfigMap {namespace}/{injection.CA_CONFIGMAP}: {exc.status} {exc.reason}"
        ) from exc


@kopf.on.resume(*RESOURCE, id="policy_ca_publish", when=_SERVED)
@kopf.on.create(*RESOURCE, id="policy_ca_publish", when=_SERVED)
def policy_ca_publish(*, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Publish the CA bundle in the policy's namespace (the injected volume reads it).

    Raises:
        kopf.TemporaryError: the ConfigMap could not be written.
    """
    _publish_ca(namespace, memo.get("ca_bundle"))


@kopf.timer(
    *RESOURCE, id="policy_ungoverned_check", interval=UNGOVERNED_CHECK_S, idle=None, when=_OWNED
)
def policy_ungoverned_check(
    *, namespace: str | None, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """Keep the CA bundle published; warn once per pod about selected pods without injection."""
    if not CFG.webhook_port or not namespace or not shards.serving(memo):
        return
    try:
        _publish_ca(namespace, memo.get("ca_bundle"))  # a ConfigMap deleted since
    except kopf.TemporaryError:
        pass  # the next pass tries again
    try:
        pods = kube.pods(namespace, f"{injection.LABEL}=true")
    except kube.ApiError:
        return
    seen: set[str] = memo.setdefault("ungoverned_seen", set())
    names = injection.ungoverned(pods, spec.get("selector"))
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        kopf.warn(
            body,
            reason="PodNotInjected",
            message=(
                f"pod {namespace}/{name} opts in ({injection.LABEL}=true) but was admitted "
                "without the agent token volume (the webhook was unreachable): it runs "
                "ungoverned at default clocks; re-create it to govern it"
            ),
        )
    seen.intersection_update(names)


@kopf.on.event(
    "certificates.k8s.io",
    "v1",
    "certificatesigningrequests",
    id="agent_csr",
    field="spec.signerName",
    value=certs.SIGNER,
    when=shards.when_first(CFG.layout),  # one shard signs (every shard holds the CA)
)
def agent_csr(
    *, body: kopf.Body, name: str, type: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """Approve and sign a node agent's serving-certificate request, or deny it with a reason.

    An event handler: kopf stores nothing on the request (its status has a fixed schema); the
    work is idempotent (a request with a certificate or a denial is left alone) and every
    event of an undecided request tries again.
    """
    if type == "DELETED":
        return
    status = body.get("status") or {}
    if status.get("certificate") or any(
        c.get("type") in ("Denied", "Failed") for c in status.get("conditions") or []
    ):
        return
    ca = memo.get("ca")
    if ca is None:
        logger.warning("CSR %s left pending: the operator has no CA (agent TLS port off?)", name)
        return
    try:
        nodes = list(((body.get("spec") or {}).get("extra") or {}).get(certs.NODE_EXTRA) or [])
        node = kube.read_node(nodes[0]) if len(nodes) == 1 else None
        addresses = {nodes[0]: certs.node_ips(node)} if node is not None else {}
        verdict = certs.judge(body, AGENT_USER, addresses)
        kube.decide_csr(name, verdict.approve, verdict.reason, verdict.message)
        if verdict.approve:
            kube.sign_csr(name, certs.sign(body, ca, _now()))
            logger.info("signed %s", verdict.message)
        else:
            logger.warning("denied %s: %s", name, verdict.message)
    except (kube.ApiError, tls.CertificateError) as exc:
        logger.warning("CSR %s left pending: %s", name, exc)


if CFG.webhook_port:
    # kopf refuses to run at all when admission handlers exist without an admission server
    # ("no admission server/tunnel is configured"), so the handler exists only when the webhook
    # is served (``webhook_port``; the chart sets it, a local or webhook-less operator does not).
    kopf.on.mutate(
        "",
        "v1",
        "pods",
        id="inject-pod",
        operations=["CREATE"],
        ignore_failures=True,
        labels={injection.LABEL: "true"},
    )(pod_inject)
