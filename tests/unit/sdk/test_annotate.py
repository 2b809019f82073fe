"""The trainer's pod annotator (``rlenergy.sdk.annotate``) against a local HTTPS server.

The server (stdlib ``http.server`` over TLS with a dev-cluster PKI, on 127.0.0.1) records what
the real API server would get; ``tests/e2e/test_phase_annotations.py`` runs the same client
against the real kube-apiserver. We test these aspects:
* a phase is one ``PATCH`` of the pod's own path, a JSON merge patch of the two annotations,
  with the pod's bearer token, over the server's CA; the connection is kept alive;
* ``end_step`` writes the workload annotation the agent parses (``signals.annotated_workload``);
* a 401 re-reads the (rotated) token once; a 403 names the ClusterRole to bind; not strict, a
  failure returns False and is logged once; an unreachable server is a RetryableError;
* ``in_cluster`` reads the in-cluster env, the downward-API env and the namespace fallback.
"""

from __future__ import annotations

import http.server
import json
import logging
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rlenergy_dev.devcluster import certs

from rlenergy import errors
from rlenergy.api import signals
from rlenergy.sdk import annotate

pytestmark = pytest.mark.field


class _Server:
    """An HTTPS server that records PATCH requests and answers ``status`` (a list, in turn)."""

    def __init__(self, tmp: Path) -> None:
        paths = certs.write_pki(certs.generate_pki(), tmp / "pki")
        self.ca = str(paths.serving_ca_cert)
        self.requests: list[dict[str, Any]] = []
        self.status: list[int] = []
        self.peers: set[int] = set()
        self.clients: list[annotate.PodAnnotator] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_PATCH(self) -> None:  # noqa: N802 - stdlib name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.peers.add(self.client_address[1])
                outer.requests.append(
                    {
                        "path": self.path,
                        "type": self.headers["Content-Type"],
                        "auth": self.headers.get("Authorization"),
                        "body": json.loads(body),
                    }
                )
                status = outer.status.pop(0) if outer.status else 200
                data = json.dumps({"kind": "Pod"} if status == 200 else {"message": "no"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(paths.serving_cert), str(paths.serving_key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    s = _Server(tmp_path)
    yield s
    s.stop()
    for c in s.clients:
        c.close()


def _annotator(server: _Server, tmp_path: Path, **kw: Any) -> annotate.PodAnnotator:
    token = tmp_path / "token"
    if not token.exists():
        token.write_text("tok-1")
    notes = annotate.PodAnnotator(
        server.url, "team-a", "trainer-0", token_file=str(token), ca_file=server.ca, **kw
    )
    server.clients.append(notes)
    return notes


def test_a_phase_is_one_merge_patch_of_the_pods_own_annotations(
    server: _Server, tmp_path: Path
) -> None:
    notes = _annotator(server, tmp_path, strict=True)
    assert notes.phase("generation", step=3) is True
    assert notes.phase("training", step=3) is True
    assert notes.end_step(3, samples=8, response_tokens=800, prompt_tokens=100, valid_tokens=800)
    first, _, last = server.requests
    assert first["path"] == "/api/v1/namespaces/team-a/pods/trainer-0"
    assert first["type"] == "application/merge-patch+json"
    assert first["auth"] == "Bearer tok-1"
    assert first["body"] == {
        "metadata": {
            "annotations": {signals.PHASE_ANNOTATION: "generation", signals.STEP_ANNOTATION: "3"}
        }
    }
    # the agent reads back exactly what was written
    assert signals.annotated_phase(first["body"]["metadata"]["annotations"]) == (
        signals.PhaseRequest(phase="generation", step=3)
    )
    step = signals.annotated_workload(last["body"]["metadata"]["annotations"])
    assert step is not None and step.step == 3 and step.workload.valid_tokens == 800
    assert len(server.peers) == 1  # one kept-alive connection
    assert notes.patches == 3
    with pytest.raises(ValueError):
        notes.phase("generation", step=-1)  # a negative step is a programming error


def test_a_rotated_token_is_read_again_and_refusals_say_what_to_bind(
    server: _Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notes = _annotator(server, tmp_path, strict=True)
    assert notes.phase("generation", step=0)
    (tmp_path / "token").write_text("tok-2")  # rotated (a 401 makes it re-read even unchanged)
    server.status = [401, 200]
    assert notes.phase("training", step=0)
    assert [r["auth"] for r in server.requests[-2:]][-1] == "Bearer tok-2"
    server.status = [403]
    with pytest.raises(errors.PermanentError, match="trainer-annotations ClusterRole"):
        notes.phase("generation", step=1)
    lenient = _annotator(server, tmp_path)
    caplog.set_level(logging.WARNING, logger="rlenergy.sdk.annotate")
    server.status = [500, 500]
    assert lenient.phase("generation", step=1) is False
    assert lenient.phase("generation", step=1) is False
    assert caplog.text.count("phase annotation not written") == 1


def test_an_unreachable_api_server_is_retryable(server: _Server, tmp_path: Path) -> None:
    notes = _annotator(server, tmp_path, strict=True, timeout_s=2.0)
    server.stop()
    with pytest.raises(errors.RetryableError, match="PATCH /api/v1/namespaces/team-a"):
        notes.phase("generation", step=0)


def test_in_cluster_reads_the_pods_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(errors.InvalidInputError, match="inside a pod"):
        annotate.PodAnnotator.in_cluster()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setenv(annotate.POD_NAME_ENV, "trainer-0")
    monkeypatch.setenv(annotate.POD_NAMESPACE_ENV, "team-a")
    notes = annotate.PodAnnotator.in_cluster(ca_file=None)
    assert (notes.host, notes.port, notes.path) == (
        "127.0.0.1",
        6443,
        "/api/v1/namespaces/team-a/pods/trainer-0",
    )
    monkeypatch.setenv(annotate.POD_NAME_ENV, "")
    with pytest.raises(errors.InvalidInputError, match=annotate.POD_NAME_ENV):
        annotate.PodAnnotator.in_cluster(ca_file=None)
    with pytest.raises(errors.InvalidInputError, match="https"):
        annotate.PodAnnotator("http://127.0.0.1:6443", "a", "b", ca_file=None)
