"""Trainer-side phase signals as annotations of the trainer's own pod (``phaseSource: annotation``).

For a policy with ``spec.phaseSource: annotation`` the trainer needs no agent socket mounted:
it annotates its own pod, and the node agent learns the phase from its watch on the node's
pods (``rlenergy_agent.annotations``)::

    notes = PodAnnotator.in_cluster()
    notes.phase("generation", step=12)      # rlenergy.io/phase, rlenergy.io/step
    ...
    notes.phase("training", step=12)
    notes.end_step(12, samples=256, response_tokens=..., prompt_tokens=..., valid_tokens=...)

Each call is one ``PATCH`` of the pod with a JSON merge patch (``application/merge-patch+json``,
RFC 7386) of ``metadata.annotations``, on one kept-alive HTTPS connection to the API server,
authenticated by the pod's own service-account token (re-read when the kubelet rotates it).
``in_cluster`` reads what every pod has: ``KUBERNETES_SERVICE_HOST``/``_PORT``, the token and CA
under ``/var/run/secrets/kubernetes.io/serviceaccount``, and the pod's name and namespace from
the downward API (env ``RLENERGY_POD_NAME``, ``RLENERGY_POD_NAMESPACE``; the namespace falls
back to the service account's). RBAC: ``patch`` on ``pods`` in the pod's namespace (the chart's
ClusterRole ``<release>-trainer-annotations``, bound by a RoleBinding; docs/agent.md).

Latency: a patch, then the watch: tens of ms to the clocks (measured in
``tests/e2e/test_phase_annotations.py``), against about 1 ms on the socket
(``rlenergy.sdk.trainer``), and no in-phase progress: EE-RL trials whole steps for such a policy.
Best effort as the socket client: a failed patch is logged once and the trainer carries on at
default clocks; ``strict`` raises instead (tests).
Callers: trainer code.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import ssl
import urllib.parse
from typing import Any

from rlenergy import errors
from rlenergy.api import node as api_node
from rlenergy.api import signals
from rlenergy.sdk import trainer

log = logging.getLogger(__name__)

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where the kubelet mounts the pod's service-account token, CA and namespace."""
POD_NAME_ENV = "RLENERGY_POD_NAME"
"""Downward API env of the pod's name (``fieldRef: metadata.name``)."""
POD_NAMESPACE_ENV = "RLENERGY_POD_NAMESPACE"
"""Downward API env of the pod's namespace (``fieldRef: metadata.namespace``)."""
MERGE_PATCH = "application/merge-patch+json"


class PodAnnotator:
    """Writes phase and step annotations on one pod.

    Args:
        api_url: the API server, ``https://host:port``.
        namespace: the pod's namespace.
        pod: the pod's name.
        token_file: a service-account token allowed to patch the pod.
        ca_file: the API server's CA bundle (``None``: the system's).
        timeout_s: per request timeout, s.
        strict: raise instead of logging (tests).

    Raises:
        InvalidInputError: ``api_url`` is not an https URL, or the pod or namespace is empty.
    """

    def __init__(
        self,
        api_url: str,
        namespace: str,
        pod: str,
        *,
        token_file: str = f"{SA_DIR}/token",
        ca_file: str | None = f"{SA_DIR}/ca.crt",
        timeout_s: float = 5.0,
        strict: bool = False,
    ) -> None:
        url = urllib.parse.urlsplit(api_url)
        if url.scheme != "https" or not url.hostname:
            raise errors.InvalidInputError("api_url", f"{api_url!r} must be https://host:port")
        if not namespace or not pod:
            raise errors.InvalidInputError(
                "pod",
                f"need the pod's name and namespace (env {POD_NAME_ENV}, {POD_NAMESPACE_ENV})",
            )
        self.host, self.port = url.hostname, url.port or 443
        self.namespace, self.pod = namespace, pod
        self.path = f"/api/v1/namespaces/{namespace}/pods/{pod}"
        self.token = trainer.BearerToken(token_file)
        self.context = ssl.create_default_context(cafile=ca_file)
        self.timeout_s = timeout_s
        self.strict = strict
        self.patches = 0
        """Patches the API server accepted."""
        self._conn: http.client.HTTPSConnection | None = None
        self._warned = False

    @classmethod
    def in_cluster(cls, **kwargs: Any) -> PodAnnotator:
        """The annotator of the pod this process runs in (see the module docstring).

        Raises:
            InvalidInputError: not in a pod (no ``KUBERNETES_SERVICE_HOST``) or no pod name.
        """
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise errors.InvalidInputError(
                "KUBERNETES_SERVICE_HOST", "not set: PodAnnotator.in_cluster runs inside a pod"
            )
        namespace = os.environ.get(POD_NAMESPACE_ENV, "")
        if not namespace:
            try:
                with open(f"{SA_DIR}/namespace", encoding="utf-8") as f:
                    namespace = f.read().strip()
            except OSError:
                namespace = ""
        name = host if ":" not in host else f"[{host}]"
        return cls(f"https://{name}:{port}", namespace, os.environ.get(POD_NAME_ENV, ""), **kwargs)

    def phase(self, name: str, *, step: int) -> bool:
        """This pod enters phase ``name`` of RL step ``step`` (``idle``: between phases).

        Returns:
            Whether the API server took the patch.

        Raises:
            pydantic.ValidationError: the phase or step is invalid (always: a programming error).
            PermanentError, RetryableError: ``strict`` and the patch failed.
        """
        req = signals.PhaseRequest(phase=name, step=step)
        return self._patch(
            {signals.PHASE_ANNOTATION: req.phase, signals.STEP_ANNOTATION: str(req.step)}
        )

    def end_step(
        self,
        step: int,
        *,
        samples: int,
        response_tokens: float,
        prompt_tokens: float,
        valid_tokens: float,
        mean_context_tokens: float = 0.0,
    ) -> bool:
        """Close RL step ``step`` with its token workload (``rlenergy.io/workload``).

        Returns:
            Whether the API server took the patch.
        """
        req = signals.StepRequest(
            step=step,
            workload=api_node.TokenWorkloadReport(
                samples=samples,
                response_tokens=response_tokens,
                prompt_tokens=prompt_tokens,
                valid_tokens=valid_tokens,
                mean_context_tokens=mean_context_tokens,
            ),
        )
        return self._patch({signals.WORKLOAD_ANNOTATION: req.model_dump_json(by_alias=True)})

    def _patch(self, notes: dict[str, str]) -> bool:
        body = json.dumps({"metadata": {"annotations": notes}}).encode()
        try:
            status, detail = self._send(body)
        except (http.client.HTTPException, OSError) as exc:
            return self._failed(errors.RetryableError(f"PATCH {self.path}: {exc}"))
        if status == 401:  # a rotated token: read it again once
            self.token.header(reload=True)
            try:
                status, detail = self._send(body)
            except (http.client.HTTPException, OSError) as exc:
                return self._failed(errors.RetryableError(f"PATCH {self.path}: {exc}"))
        if 200 <= status < 300:
            self.patches += 1
            return True
        cls = errors.PermanentError if 400 <= status < 500 else errors.RetryableError
        hint = (
            " (bind the chart's trainer-annotations ClusterRole to the pod's service account)"
            if status == 403
            else ""
        )
        return self._failed(cls(f"PATCH {self.path}: HTTP {status}: {detail}{hint}"))

    def _send(self, body: bytes) -> tuple[int, str]:
        headers = {"Content-Type": MERGE_PATCH, "Accept": "application/json"}
        auth = self.token.header()
        if auth:
            headers["Authorization"] = auth
        for attempt in (0, 1):  # a kept-alive connection the server closed: one reconnect
            if self._conn is None:
                self._conn = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout_s, context=self.context
                )
            try:
                self._conn.request("PATCH", self.path, body=body, headers=headers)
                resp = self._conn.getresponse()
                data = resp.read()
                return resp.status, data.decode(errors="replace")[:200]
            except (http.client.HTTPException, OSError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _failed(self, exc: errors.RetryableError | errors.PermanentError) -> bool:
        if self.strict:
            raise exc
        if not self._warned:
            log.warning("phase annotation not written, clocks stay at the default: %s", exc)
            self._warned = True
        return False

    def close(self) -> None:
        """Close the connection (the next patch opens a new one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
