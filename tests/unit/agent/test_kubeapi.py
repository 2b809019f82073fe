"""The agent's Kubernetes API transport (``rlenergy_agent.kubeapi``) against a real HTTPS server.

The server is a local ``http.server`` on 127.0.0.1 behind TLS from a throw-away PKI (the dev
cluster's, ``rlenergy_dev.devcluster.certs``): it verifies client certificates of the client CA
when one is sent, records each request (path, query, headers, body, the client certificate's
common name) and answers scripted JSON, error statuses or a watch's chunked event stream. We
test these aspects:
* a kubeconfig as the dev cluster writes it (CA and client certificate as data): the server is
  verified, the client certificate presented, JSON bodies and content types sent as the API
  server wants them;
* a kubeconfig naming files (relative to it), a token or a token file, merged ``$KUBECONFIG``
  files, ``insecure-skip-tls-verify``, ``tls-server-name``; an unknown CA fails the request;
  ``exec`` / ``auth-provider`` plugins, a missing context or file are clear ``ConfigError``s;
* in-cluster: the service account's CA and token; a rotated token file is sent from the next
  request on;
* an error status is an ``ApiException`` with status, reason, body and headers;
* a watch's events arrive as they are sent (a line split across chunks included), bookmarks
  move ``resource_version``, an ``ERROR`` event is an ``ApiException`` of its code (410);
  ``kube.PlanWatcher`` over it lists, watches, and ``stop`` ends its thread while the server
  holds the request open;
* the agent's modules import no ``kubernetes`` (a fresh interpreter).
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
import urllib3
import yaml
from rlenergy_agent import kube, kubeapi
from rlenergy_dev.devcluster import certs
from rlenergy_dev.devcluster.kubeconfig import render_kubeconfig

ROOT = Path(__file__).resolve().parents[3]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        url = urlsplit(self.path)
        peer = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
        cn = ""
        for rdn in (peer or {}).get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    cn = value
        self.server.asked.append(
            {
                "method": self.command,
                "path": url.path,
                "query": dict(parse_qsl(url.query)),
                "headers": dict(self.headers.items()),
                "body": json.loads(body) if body else None,
                "cn": cn,
            }
        )
        answer = self.server.answers.pop(0) if self.server.answers else (200, {"ok": True})
        if answer[0] == "watch":
            self._watch(answer[1])
            return
        status, doc = answer
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Audit-Id", "a-1")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _watch(self, chunks: list[bytes | float]) -> None:
        """Chunked transfer: each bytes item one chunk; a float: hold that long, s."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for chunk in chunks:
                if isinstance(chunk, float):
                    self.server.holding.set()
                    self.server.release.wait(chunk)
                    continue
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True

    do_GET = do_POST = do_PATCH = _serve

    def log_message(self, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, ctx: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.ctx = ctx
        self.asked: list[dict[str, Any]] = []
        self.answers: list[Any] = []
        self.holding = threading.Event()
        self.release = threading.Event()

    def get_request(self) -> Any:
        sock, addr = super().get_request()
        return self.ctx.wrap_socket(sock, server_side=True), addr

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def pki() -> certs.Pki:
    return certs.generate_pki(("localhost", "127.0.0.1"))


def _server_ctx(pki: certs.Pki, serving: Any, tmp: Path) -> ssl.SSLContext:
    (tmp / "srv.pem").write_bytes(serving.cert_pem + serving.key_pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp / "srv.pem")
    ctx.load_verify_locations(cadata=pki.client_ca.cert_pem.decode())
    ctx.verify_mode = ssl.CERT_OPTIONAL  # a client certificate, when sent, must be the CA's
    return ctx


@pytest.fixture
def server(pki: certs.Pki, tmp_path: Path) -> Iterator[_Server]:
    srv = _Server(_server_ctx(pki, pki.serving, tmp_path))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def _kubeconfig(tmp: Path, doc: dict[str, Any], name: str = "config") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _doc(server: str, cluster: dict[str, Any], user: dict[str, Any], ctx: str = "c") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "k", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": ctx, "context": {"cluster": "k", "user": "u"}}],
        "current-context": ctx,
    }


def test_the_dev_clusters_kubeconfig_verifies_the_server_and_sends_its_client_cert(
    server: _Server, pki: certs.Pki, tmp_path: Path
) -> None:
    text = render_kubeconfig(
        server.url, pki.serving_ca.cert_pem, pki.admin.cert_pem, pki.admin.key_pem
    )
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    api = kube.load_api(str(path))
    server.answers = [(200, {"items": [{"a": 1}]}), (200, {"metadata": {"name": "r"}}), (201, {})]
    listing = api.list_namespaced_custom_object(
        kube.GROUP, kube.VERSION, "ns", kube.POLICY_PLURAL, field_selector="metadata.name=p"
    )
    assert listing == {"items": [{"a": 1}]}
    api.patch_namespaced_custom_object(
        kube.GROUP, kube.VERSION, "ns", kube.REPORT_PLURAL, "r", {"spec": {"x": None}}
    )
    api.create_namespaced_custom_object(kube.GROUP, kube.VERSION, "ns", "things", {"b": [1]})
    get, patch, post = server.asked
    assert {r["cn"] for r in server.asked} == {"admin"}
    assert "Authorization" not in get["headers"]
    assert get["path"] == "/apis/rlenergy.io/v1alpha1/namespaces/ns/rlenergypolicies"
    assert get["query"] == {"fieldSelector": "metadata.name=p"}
    assert get["headers"]["Accept"] == "application/json"
    assert patch["method"] == "PATCH" and patch["body"] == {"spec": {"x": None}}
    assert patch["headers"]["Content-Type"] == "application/merge-patch+json"
    assert post["method"] == "POST" and post["body"] == {"b": [1]}
    assert post["headers"]["Content-Type"] == "application/json"
    # the same pool: one TLS connection serves the calls one after another
    assert len({r["headers"].get("Host") for r in server.asked}) == 1


def test_kubeconfig_files_relative_to_it_a_token_file_and_merged_kubeconfigs(
    server: _Server, pki: certs.Pki, tmp_path: Path
) -> None:
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "ca.crt").write_bytes(pki.serving_ca.cert_pem)
    (tmp_path / "pki" / "token").write_text("from-file\n")
    first = _kubeconfig(
        tmp_path,
        _doc(server.url, {"certificate-authority": "pki/ca.crt"}, {"tokenFile": "pki/token"}),
        "first",
    )
    # a second file with the same names: the first file's entries win, as in kubectl
    second_doc = _doc("https://127.0.0.1:1", {}, {"token": "second"}, ctx="other")
    second_doc["contexts"].append({"name": "c", "context": {"cluster": "k", "user": "u"}})
    second = _kubeconfig(tmp_path, second_doc, "second")
    missing = tmp_path / "absent"
    env_paths = os.pathsep.join(map(str, (missing, first, second)))
    paths = kubeapi.kubeconfig_paths({"KUBECONFIG": env_paths})
    assert paths == [missing, first, second]
    cfg = kubeapi.from_kubeconfig(paths)
    assert cfg.host == server.url and cfg.cert_pem is None
    client = kubeapi.ApiClient(cfg)
    assert kube.call_json(client, "GET", "/api/v1/pods") == {"ok": True}
    assert server.asked[-1]["headers"]["Authorization"] == "Bearer from-file"
    assert server.asked[-1]["cn"] == ""
    # a token given inline, and a context named explicitly
    inline = _kubeconfig(
        tmp_path,
        _doc(server.url, {"certificate-authority-data": base64.b64encode(
            pki.serving_ca.cert_pem).decode()}, {"token": "inline"}),
    )  # fmt: skip
    kube.call_json(kubeapi.ApiClient(kubeapi.from_kubeconfig(inline, context="c")), "GET", "/x")
    assert server.asked[-1]["headers"]["Authorization"] == "Bearer inline"


def test_client_certificate_files_basic_auth_and_insecure_skip_tls_verify(
    server: _Server, pki: certs.Pki, tmp_path: Path
) -> None:
    (tmp_path / "a.crt").write_bytes(pki.admin.cert_pem)
    (tmp_path / "a.key").write_bytes(pki.admin.key_pem)
    files = _kubeconfig(
        tmp_path,
        _doc(
            server.url,
            {"insecure-skip-tls-verify": True},
            {"client-certificate": str(tmp_path / "a.crt"), "client-key": "a.key"},
        ),
    )
    with pytest.warns(urllib3.exceptions.InsecureRequestWarning):  # unverified, as asked
        kube.call_json(kubeapi.ApiClient(kubeapi.from_kubeconfig(files)), "GET", "/x")
    assert server.asked[-1]["cn"] == "admin"
    basic = _kubeconfig(
        tmp_path,
        _doc(server.url, {"insecure-skip-tls-verify": True}, {"username": "u", "password": "p"}),
    )
    with pytest.warns(urllib3.exceptions.InsecureRequestWarning):
        kube.call_json(kubeapi.ApiClient(kubeapi.from_kubeconfig(basic)), "GET", "/x")
    assert (
        server.asked[-1]["headers"]["Authorization"] == "Basic " + base64.b64encode(b"u:p").decode()
    )
    # without the CA (and without insecure-skip-tls-verify) the server is not trusted
    untrusted = kubeapi.ApiClient(kubeapi.Config(server.url), retries=0)
    with pytest.raises(urllib3.exceptions.MaxRetryError, match="CERTIFICATE_VERIFY_FAILED"):
        kube.call_json(untrusted, "GET", "/x")


def test_tls_server_name_verifies_a_certificate_for_another_name(
    pki: certs.Pki, tmp_path: Path
) -> None:
    named = certs._leaf(  # noqa: SLF001 - a serving certificate without 127.0.0.1
        pki.serving_ca, certs.tls.Request("api", (), ("api.internal",)), certs.DEFAULT_VALIDITY,
        client=False,
    )  # fmt: skip
    srv = _Server(_server_ctx(pki, named, tmp_path))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        ca = {"certificate-authority-data": base64.b64encode(pki.serving_ca.cert_pem).decode()}
        plain = kubeapi.from_kubeconfig(_kubeconfig(tmp_path, _doc(srv.url, ca, {})))
        with pytest.raises(urllib3.exceptions.MaxRetryError, match="127.0.0.1"):
            kube.call_json(kubeapi.ApiClient(plain, retries=0), "GET", "/x")
        named_doc = _doc(srv.url, {**ca, "tls-server-name": "api.internal"}, {})
        cfg = kubeapi.from_kubeconfig(_kubeconfig(tmp_path, named_doc, "named"))
        assert kube.call_json(kubeapi.ApiClient(cfg), "GET", "/x") == {"ok": True}
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize(
    ("user", "match"),
    [
        ({"exec": {"command": "aws"}}, "exec plugin"),
        ({"auth-provider": {"name": "gcp"}}, "auth-provider plugin"),
        ({"client-certificate-data": "QQ=="}, "needs its key"),
    ],
)
def test_unsupported_users_are_clear_config_errors(
    tmp_path: Path, user: dict[str, Any], match: str
) -> None:
    path = _kubeconfig(tmp_path, _doc("https://127.0.0.1:6443", {}, user))
    with pytest.raises(kubeapi.ConfigError, match=match):
        kubeapi.from_kubeconfig(path)


def test_missing_kubeconfig_context_cluster_or_server_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(kubeapi.ConfigError, match="no kubeconfig found"):
        kubeapi.from_kubeconfig(tmp_path / "absent")
    path = _kubeconfig(tmp_path, _doc("https://127.0.0.1:6443", {}, {}))
    with pytest.raises(kubeapi.ConfigError, match="no context 'other'"):
        kubeapi.from_kubeconfig(path, context="other")
    no_server = _kubeconfig(tmp_path, _doc("", {}, {}), "no-server")
    with pytest.raises(kubeapi.ConfigError, match="no server"):
        kubeapi.from_kubeconfig(no_server)
    bad_ca = _kubeconfig(
        tmp_path, _doc("https://127.0.0.1:6443", {"certificate-authority": "nope.crt"}, {}), "ca"
    )
    with pytest.raises(kubeapi.ConfigError, match="certificate-authority"):
        kubeapi.from_kubeconfig(bad_ca)


def test_in_cluster_sends_the_rotated_token_from_the_next_request(
    server: _Server, pki: certs.Pki, tmp_path: Path
) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "ca.crt").write_bytes(pki.serving_ca.cert_pem)

    def rotate(token: str) -> None:
        # kubelet's atomic writer: a new timestamped folder, then a symlink swap
        folder = sa / f"..{token}"
        folder.mkdir()
        (folder / "token").write_text(token)
        (sa / "..data.tmp").symlink_to(folder.name)
        os.replace(sa / "..data.tmp", sa / "..data")

    rotate("first")
    (sa / "token").symlink_to("..data/token")
    port = server.url.rsplit(":", 1)[1]
    with pytest.raises(kubeapi.ConfigError, match="not in a pod"):
        kubeapi.in_cluster({}, sa)
    with pytest.raises(kubeapi.ConfigError, match="no service account"):
        kubeapi.in_cluster({"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                            "KUBERNETES_SERVICE_PORT": port}, tmp_path)  # fmt: skip
    assert (
        kubeapi.in_cluster(
            {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}, sa
        ).host
        == "https://[fd00::1]:443"
    )
    cfg = kubeapi.in_cluster(
        {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}, sa
    )
    client = kubeapi.ApiClient(cfg)
    kube.call_json(client, "GET", "/x")
    rotate("second")
    kube.call_json(client, "GET", "/x")
    kube.call_json(client, "GET", "/x")
    assert [r["headers"]["Authorization"] for r in server.asked] == [
        "Bearer first", "Bearer second", "Bearer second"
    ]  # fmt: skip


def test_an_error_status_is_an_api_exception_with_status_reason_body_and_headers(
    server: _Server, pki: certs.Pki
) -> None:
    status = {"kind": "Status", "code": 404, "reason": "NotFound", "message": "x not found"}
    server.answers = [(404, status), (500, {"kind": "Status"})]
    client = kubeapi.ApiClient(kubeapi.Config(server.url, ca_pem=pki.serving_ca.cert_pem))
    with pytest.raises(kubeapi.ApiException) as info:
        kube.call_json(client, "GET", "/apis/g/v/namespaces/n/x/y")
    exc = info.value
    assert (exc.status, exc.reason) == (404, "Not Found")
    assert json.loads(exc.body or "") == status
    assert exc.headers is not None and exc.headers["Audit-Id"] == "a-1"
    assert "(404)" in str(exc) and "x not found" in str(exc)
    assert kube.ApiException is kubeapi.ApiException
    with pytest.raises(kubeapi.ApiException) as info:
        kube.NodePods("n", client)()
    assert info.value.status == 500


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def test_a_watch_streams_events_tracks_bookmarks_and_raises_error_events(
    server: _Server, pki: certs.Pki
) -> None:
    added = _line({"type": "ADDED", "object": {"metadata": {"name": "a", "resourceVersion": "5"}}})
    bookmark = _line({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}})
    gone = _line({"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                              "reason": "Expired", "message": "too old"}})  # fmt: skip
    server.answers = [
        ("watch", [added[:7], added[7:] + bookmark, b"\n"]),
        ("watch", [gone]),
        (410, {"kind": "Status", "code": 410}),
    ]
    client = kubeapi.ApiClient(kubeapi.Config(server.url, ca_pem=pki.serving_ca.cert_pem))
    api = kube.CustomObjects(client)
    watch = kubeapi.Watch()
    args = (kube.GROUP, kube.VERSION, "ns", kube.POLICY_PLURAL)
    events = list(watch.stream(api.list_namespaced_custom_object, *args, resource_version="3",
                               allow_watch_bookmarks=True, timeout_seconds=60))  # fmt: skip
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    assert events[0]["object"]["metadata"]["name"] == "a"
    assert watch.resource_version == "9"
    assert server.asked[0]["query"] == {
        "resourceVersion": "3", "allowWatchBookmarks": "true", "timeoutSeconds": "60",
        "watch": "true",
    }  # fmt: skip
    with pytest.raises(kubeapi.ApiException) as info:
        list(watch.stream(api.list_namespaced_custom_object, *args, resource_version="9"))
    assert (info.value.status, info.value.reason) == (410, "Expired: too old")
    with pytest.raises(kubeapi.ApiException) as info:  # the request's own error status
        list(watch.stream(api.list_namespaced_custom_object, *args))
    assert info.value.status == 410


def test_the_plan_watcher_over_https_and_stop_cuts_the_held_request(
    server: _Server, pki: certs.Pki
) -> None:
    plan = {"step": 2, "phases": [{"phase": "generation", "clockMHz": 1410, "state": "locked"}]}
    policy = {"metadata": {"name": "p", "resourceVersion": "12"}, "status": {"plan": plan}}
    server.answers = [
        (200, {"metadata": {"resourceVersion": "11"}, "items": []}),
        ("watch", [_line({"type": "ADDED", "object": policy}), 30.0]),
    ]
    client = kubeapi.ApiClient(kubeapi.Config(server.url, ca_pem=pki.serving_ca.cert_pem))
    w = kube.PlanWatcher(kube.CustomObjects(client), "ns", "p", retry_max_s=0.05)
    try:
        deadline = time.monotonic() + 10
        while (got := w.poll()[1]) is None:
            assert time.monotonic() < deadline, "the watched plan never arrived"
            time.sleep(0.02)
        assert got.step == 2
        assert server.holding.wait(5)
        assert server.asked[1]["query"]["resourceVersion"] == "11"
    finally:
        t0 = time.monotonic()
        w.stop()
        w._thread.join(5)  # noqa: SLF001 - the thread must end without the server's help
    assert not w._thread.is_alive() and time.monotonic() - t0 < 2  # noqa: SLF001


def test_the_agent_loads_no_kubernetes_package() -> None:
    """The agent's entry point and every module of it, in a fresh interpreter."""
    code = (
        "import pkgutil, importlib, sys, rlenergy_agent, rlenergy_agent.__main__\n"
        "for m in pkgutil.walk_packages(rlenergy_agent.__path__, 'rlenergy_agent.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n == 'kubernetes' or n.startswith('kubernetes.'))\n"
        "assert not bad, bad\n"
        "assert 'rlenergy_agent.kubeapi' in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(ROOT / p) for p in (".", "agent", "operator", "dev"))}  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
