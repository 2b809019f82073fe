"""The agent's Kubernetes API transport: configuration, authenticated JSON requests, watches.

What the agent needs of a Kubernetes client, on urllib3 alone: the ``kubernetes`` package's
``config``, ``ApiClient`` and ``watch`` held 10.7-12 MiB of the agent's resident set (its import
alone: ``import urllib3`` 23.2 MB against ``import kubernetes.client`` 43.9 MB), more than a
sixth of its 60 MB target, for a thin part of them (``docs/agent.md``, "Footprint"). The agent
sends its requests as JSON and reads the answers as dicts (``rlenergy_agent.kube``,
``rlenergy_agent.annotations``); it uses no model class.

* Configuration (``in_cluster``, ``from_kubeconfig``, ``load``): in a pod, the service
  account's (``KUBERNETES_SERVICE_HOST``/``_PORT``, its ``ca.crt`` and its token, read again
  whenever the token file changes: kubelet rotates bound tokens in place); else a kubeconfig's
  current context (``$KUBECONFIG``, its files merged as kubectl does, or ``~/.kube/config``):
  ``server``, ``certificate-authority(-data)``, ``insecure-skip-tls-verify``,
  ``tls-server-name``, ``client-certificate(-data)`` / ``client-key(-data)``, ``token``,
  ``tokenFile``, ``username``/``password``. ``exec`` and ``auth-provider`` plugins are refused
  with a ``ConfigError`` that says so.
* ``ApiClient.request``: one request (JSON body, bearer token, timeouts), the urllib3 response.
* ``ApiException``: an error status, with ``status``, ``reason``, ``body`` and ``headers`` (the
  attributes of the ``kubernetes`` client's exception of the same name).
* ``Watch``: one watch request's events (line-delimited JSON), an ``ERROR`` event raised as an
  ``ApiException`` of its code (410 Gone: the caller lists again).

Callers: ``rlenergy_agent.kube`` (``load_api``, ``call_json``, the watchers),
``rlenergy_agent.annotations``.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where kubelet mounts a pod's service account token, CA and namespace."""
USER_AGENT = "rlenergy-agent"
DEFAULT_POOL_MAXSIZE = 8
"""Connections kept per API server: the agent's watches (policy, pods, pod ends) each hold one
for their request's length, report writes, token reviews and listings share the rest."""


def encode(body: Any) -> bytes:
    """A request body as sent: compact JSON (no spaces after ``,`` and ``:``), UTF-8.

    The API server reads any JSON; the spaces ``json.dumps`` puts in by default were about a
    tenth of a node report's patch.
    """
    return json.dumps(body, separators=(",", ":")).encode()


class ConfigError(Exception):
    """No usable configuration: not in a pod, no kubeconfig, or one this transport cannot use."""


class ApiException(Exception):
    """The API server answered an error status (or a watch sent an ``ERROR`` event).

    Attributes:
        status: the HTTP status (or the ``ERROR`` event's ``code``); None when unknown.
        reason: the HTTP reason phrase (a watch error: ``"<reason>: <message>"``).
        body: the answer's body as text (usually a ``Status`` object as JSON), or None.
        headers: the answer's headers, or None.
    """

    def __init__(
        self,
        status: int | None = None,
        reason: str | None = None,
        *,
        body: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.body = body
        self.headers = dict(headers) if headers is not None else None
        super().__init__(status, reason)

    @classmethod
    def of(cls, resp: Any) -> ApiException:
        """From a response with an error status (read in full here).

        Args:
            resp: a urllib3 response (``status``, ``reason``, ``data``, ``headers``).
        """
        data = resp.data
        body = data.decode("utf-8", "replace") if isinstance(data, bytes | bytearray) else data
        headers = getattr(resp, "headers", None)
        return cls(
            int(resp.status),
            str(getattr(resp, "reason", "") or ""),
            body=body,
            headers=dict(headers.items()) if headers is not None else None,
        )

    def __str__(self) -> str:
        text = f"({self.status})\nReason: {self.reason}\n"
        if self.headers:
            text += f"HTTP response headers: {self.headers}\n"
        if self.body:
            text += f"HTTP response body: {self.body}\n"
        return text


class TokenFile:
    """A bearer token read from a file, read again whenever the file changes.

    Kubelet rewrites a projected service account token (an atomic symlink swap) well before it
    expires; a ``stat`` per request (a few microseconds) sees the swap, so the request after it
    carries the new token.

    Args:
        path: the token file.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._key: tuple[int, int, int, int] | None = None
        self._token = ""

    def __call__(self) -> str:
        """The token now (stripped).

        Raises:
            OSError: the file cannot be read.
        """
        st = os.stat(self.path)
        key = (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_size)
        with self._lock:
            if key != self._key:
                self._token = self.path.read_text().strip()
                self._key = key
            return self._token


@dataclass
class Config:
    """Where the API server is and how to talk to it.

    Attributes:
        host: the server's URL (``https://host:port``, maybe a path prefix).
        ca_pem: the CA bundle that verifies the server, PEM (None: the system's).
        verify: False skips the server's verification (``insecure-skip-tls-verify``).
        server_name: the name to verify the server's certificate for (``tls-server-name``).
        cert_pem: the client certificate chain, PEM (None: no client certificate).
        key_pem: its private key, PEM.
        token: the bearer token, a callable returning it (``TokenFile``), or None.
        basic_auth: ``user:password`` for basic authentication, or None.
        source: where it came from (logs and errors).
    """

    host: str
    ca_pem: bytes | None = None
    verify: bool = True
    server_name: str | None = None
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    token: str | Callable[[], str] | None = None
    basic_auth: str | None = None
    source: str = ""

    def bearer(self) -> str | None:
        """The token for the next request (a file's is read again when it changed)."""
        if self.token is None:
            return None
        return self.token() if callable(self.token) else self.token


def in_cluster(env: Mapping[str, str] | None = None, sa_dir: Path = SA_DIR) -> Config:
    """The pod's service account configuration.

    Args:
        env: the environment (default: ``os.environ``).
        sa_dir: the service account's mount.

    Raises:
        ConfigError: not in a pod (no ``KUBERNETES_SERVICE_HOST``/``_PORT``) or no token/CA.
    """
    env = os.environ if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ConfigError("not in a pod: KUBERNETES_SERVICE_HOST/PORT unset")
    token, ca = sa_dir / "token", sa_dir / "ca.crt"
    if not token.is_file() or not ca.is_file():
        raise ConfigError(f"no service account token and CA in {sa_dir}")
    if ":" in host:  # IPv6
        host = f"[{host}]"
    tokens = TokenFile(token)
    tokens()  # a token that cannot be read fails here, not at the first request
    return Config(
        f"https://{host}:{port}", ca_pem=ca.read_bytes(), token=tokens, source="in-cluster"
    )


def kubeconfig_paths(env: Mapping[str, str] | None = None) -> list[Path]:
    """The kubeconfig files in use: ``$KUBECONFIG``'s (``:``-separated), else ``~/.kube/config``."""
    env = os.environ if env is None else env
    listed = [Path(p).expanduser() for p in (env.get("KUBECONFIG") or "").split(os.pathsep) if p]
    return listed or [Path("~/.kube/config").expanduser()]


def _merge(docs: Sequence[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    """Kubectl's merge of several kubeconfigs: the first file's value of a key or name wins."""
    out: dict[str, Any] = {"clusters": {}, "users": {}, "contexts": {}, "current-context": ""}
    for path, doc in docs:
        if not out["current-context"] and doc.get("current-context"):
            out["current-context"] = str(doc["current-context"])
        for kind, key in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            for entry in doc.get(kind) or ():
                if isinstance(entry, dict) and entry.get("name") is not None:
                    out[kind].setdefault(str(entry["name"]), (path, entry.get(key) or {}))
    return out


def from_kubeconfig(
    paths: Path | str | Sequence[Path | str] | None = None, *, context: str | None = None
) -> Config:
    """The configuration of a kubeconfig's context.

    Args:
        paths: the kubeconfig file(s) (default: ``kubeconfig_paths()``); files that do not exist
            are skipped as kubectl does, unless none exists.
        context: the context (default: ``current-context``).

    Raises:
        ConfigError: no kubeconfig, no such context, cluster or user, no server, or an
            authentication this transport does not support (``exec``, ``auth-provider``).
    """
    if paths is None:
        files = kubeconfig_paths()
    elif isinstance(paths, str | Path):
        files = [Path(paths).expanduser()]
    else:
        files = [Path(p).expanduser() for p in paths]
    docs = _read(files)
    merged = _merge(docs)
    name = context or merged["current-context"]
    if not name:
        raise ConfigError(f"kubeconfig {files[0]}: no current-context")
    if name not in merged["contexts"]:
        raise ConfigError(f"kubeconfig {files[0]}: no context {name!r}")
    _, ctx = merged["contexts"][name]
    cluster_name, user_name = ctx.get("cluster"), ctx.get("user")
    if cluster_name not in merged["clusters"]:
        raise ConfigError(f"kubeconfig context {name!r}: no cluster {cluster_name!r}")
    cpath, cluster = merged["clusters"][cluster_name]
    upath, user = merged["users"].get(user_name, (cpath, {})) if user_name else (cpath, {})
    server = str(cluster.get("server") or "")
    if not server:
        raise ConfigError(f"kubeconfig cluster {cluster_name!r}: no server")
    if "exec" in user or "auth-provider" in user:
        plugin = "exec" if "exec" in user else "auth-provider"
        raise ConfigError(
            f"kubeconfig user {user_name!r} authenticates with an {plugin} plugin, which the "
            "agent does not run: use a client certificate or a token (tokenFile) instead"
        )
    cfg = Config(
        server.rstrip("/"),
        ca_pem=_pem(cluster, "certificate-authority", cpath),
        verify=not cluster.get("insecure-skip-tls-verify", False),
        server_name=cluster.get("tls-server-name") or None,
        cert_pem=_pem(user, "client-certificate", upath),
        key_pem=_pem(user, "client-key", upath),
        source=f"kubeconfig {files[0]} context {name}",
    )
    if (cfg.cert_pem is None) != (cfg.key_pem is None):
        raise ConfigError(f"kubeconfig user {user_name!r}: a client certificate needs its key")
    if user.get("token"):
        cfg.token = str(user["token"])
    elif user.get("tokenFile"):
        cfg.token = TokenFile(_relative(str(user["tokenFile"]), upath))
    elif user.get("username") and user.get("password") is not None:
        cfg.basic_auth = f"{user['username']}:{user['password']}"
    return cfg


def _read(files: Sequence[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """The kubeconfigs of ``files`` that exist, parsed.

    Raises:
        ConfigError: none exists, or one cannot be read or parsed.
    """
    import yaml  # only outside a pod: in-cluster configuration needs no YAML

    docs = []
    for path in files:
        try:
            doc = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"kubeconfig {path}: {exc}") from None
        if isinstance(doc, dict):
            docs.append((path, doc))
    if not docs:
        raise ConfigError(f"no kubeconfig found (looked at {', '.join(map(str, files))})")
    return docs


def _relative(name: str, kubeconfig: Path) -> Path:
    """A file a kubeconfig names: relative names are relative to the kubeconfig's folder."""
    path = Path(name).expanduser()
    return path if path.is_absolute() else kubeconfig.parent / path


def _pem(entry: Mapping[str, Any], key: str, kubeconfig: Path) -> bytes | None:
    """``<key>-data`` (base64 PEM) or the file ``<key>`` names; None when neither is set.

    Raises:
        ConfigError: the data is not base64 or the file cannot be read.
    """
    data = entry.get(f"{key}-data")
    if data:
        try:
            return base64.b64decode(str(data), validate=False)
        except ValueError as exc:
            raise ConfigError(f"kubeconfig {key}-data: {exc}") from None
    name = entry.get(key)
    if not name:
        return None
    try:
        return _relative(str(name), kubeconfig).read_bytes()
    except OSError as exc:
        raise ConfigError(f"kubeconfig {key}: {exc}") from None


def load(kubeconfig: Path | str | None = None) -> Config:
    """The configuration: ``kubeconfig`` when given; else in-cluster, else the kubeconfig.

    Raises:
        ConfigError: neither is usable (the kubeconfig's error).
    """
    if kubeconfig is not None:
        return from_kubeconfig(kubeconfig)
    try:
        return in_cluster()
    except ConfigError:
        return from_kubeconfig()


def ssl_context(cfg: Config) -> ssl.SSLContext:
    """The TLS context of ``cfg``: its CA (or the system's), its client certificate.

    A client certificate given as PEM is loaded through a private temporary file, removed at
    once (``ssl`` loads certificates from files only).

    Raises:
        ConfigError: the CA or the client certificate cannot be loaded.
    """
    try:
        if not cfg.verify:  # no CA store loaded: nothing is verified
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif cfg.ca_pem is not None:
            ctx = ssl.create_default_context(cadata=cfg.ca_pem.decode("ascii", "replace"))
        else:
            ctx = ssl.create_default_context()
        if cfg.cert_pem is not None and cfg.key_pem is not None:
            import tempfile  # only for a client certificate given as data

            fd, name = tempfile.mkstemp(prefix="rlenergy-kube-", suffix=".pem")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(cfg.cert_pem.rstrip(b"\n") + b"\n" + cfg.key_pem)
                ctx.load_cert_chain(name)
            finally:
                os.unlink(name)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{cfg.source or cfg.host}: TLS material: {exc}") from None
    return ctx


def _timeout(value: Any) -> urllib3.Timeout | None:
    """urllib3's timeout of a number of seconds or a ``(connect, read)`` pair (None: none)."""
    if value is None:
        return None
    if isinstance(value, tuple | list):
        connect, read = value
        return urllib3.Timeout(connect=connect, read=read)
    return urllib3.Timeout(total=float(value))


class ApiClient:
    """Requests to one API server: a urllib3 pool with the configuration's TLS and auth.

    Safe to share between threads (urllib3's pool is).

    Args:
        config: the configuration (default: ``load()``).
        pool_maxsize: connections kept open to the server.
        retries: urllib3's retries of a connection that failed before an answer (the same
            default as the ``kubernetes`` client: urllib3's, 3); no redirects are followed.
        headers: headers sent with every request (tests: ``Impersonate-User``).

    Raises:
        ConfigError: no configuration, a server that is not an http(s) URL, or TLS material
            that cannot be loaded.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        pool_maxsize: int = DEFAULT_POOL_MAXSIZE,
        retries: int = 3,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config if config is not None else load()
        self.headers = {"Accept": "application/json", "User-Agent": USER_AGENT, **(headers or {})}
        parts = urlsplit(self.config.host)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{self.config.source}: server {self.config.host!r} is not a URL")
        kw: dict[str, Any] = {
            "maxsize": pool_maxsize,
            "retries": urllib3.Retry(retries, redirect=False),
        }
        if parts.scheme == "https":
            kw["ssl_context"] = ssl_context(self.config)
            if self.config.verify:
                kw["cert_reqs"] = "CERT_REQUIRED"
                if self.config.server_name:
                    kw["server_hostname"] = self.config.server_name
            else:
                kw["cert_reqs"] = "CERT_NONE"
                kw["assert_hostname"] = False
        self.pool = urllib3.PoolManager(num_pools=1, **kw)
        self.host = self.config.host.rstrip("/")

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, Any]] = (),
        body: Any = None,
        content_type: str | None = None,
        timeout: Any = None,
        preload: bool = True,
    ) -> Any:
        """One request; the urllib3 response, whatever its status.

        Args:
            method: the HTTP method.
            path: the resource path (``/api/v1/...``, ``/apis/...``).
            query: query parameters (booleans as ``true``/``false``).
            body: a JSON body (dict or list), or None.
            content_type: the body's type (default: JSON merge patch for PATCH, else JSON).
            timeout: seconds, or a ``(connect, read)`` pair, s; None: none.
            preload: False leaves the body unread (a watch's stream).

        Raises:
            OSError, urllib3.exceptions.HTTPError: the server could not be reached (after
                the pool's retries).
        """
        headers = dict(self.headers)
        token = self.config.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        elif self.config.basic_auth:
            raw = base64.b64encode(self.config.basic_auth.encode()).decode()
            headers["Authorization"] = f"Basic {raw}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type or (
                "application/merge-patch+json" if method == "PATCH" else "application/json"
            )
            data = encode(body)
        url = self.host + path
        if query:
            pairs = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in query]
            url += "?" + urlencode(pairs)
        return self.pool.request(
            method, url, body=data, headers=headers, timeout=_timeout(timeout),
            preload_content=preload, redirect=False,
        )  # fmt: skip

    def close(self) -> None:
        """Close the pool's connections."""
        self.pool.clear()


_default: ApiClient | None = None
_default_lock = threading.Lock()


def set_default(client: ApiClient | None) -> None:
    """Make ``client`` the process-wide client (``default_client``); None forgets it."""
    global _default
    with _default_lock:
        _default = client


def default_client() -> ApiClient:
    """The process-wide client, made from ``load()`` at the first call.

    Raises:
        ConfigError: no configuration.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = ApiClient()
        return _default


def iter_lines(resp: Any) -> Iterator[bytes]:
    """The non-empty lines of a streamed response, as they arrive (a line may span chunks)."""
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=True):
        buffer += chunk if isinstance(chunk, bytes) else chunk.encode()
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


class Watch:
    """The events of one watch request, as dicts (``{"type": ..., "object": {...}}``).

    ``stream`` calls ``func(*args, watch=True, _preload_content=False, **kwargs)``, which must
    return the unread response of a watch (``kube.CustomObjects.list_namespaced_custom_object``
    and ``annotations.NodePodStream.list_pod_for_all_namespaces`` do), and yields its events
    until the server ends the request (its ``timeoutSeconds``) or ``stop``. One request: the
    caller resumes from ``resource_version``, the newest it saw (bookmarks included).
    """

    def __init__(self) -> None:
        self.resource_version: str | None = None
        self._resp: Any = None
        self._stopped = False

    def stop(self) -> None:
        """End the stream: its socket is shut down, so a thread blocked reading it returns."""
        self._stopped = True
        resp = self._resp
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            import socket

            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stream(
        self, func: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Iterator[dict[str, Any]]:
        """The events (``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK``) of one watch request.

        Raises:
            ApiException: the request's error status, or an ``ERROR`` event (its ``code``:
                410 Gone when ``resource_version`` is too old; ``reason`` is
                ``"<reason>: <message>"``).
            ValueError: a line that is not a JSON event.
            OSError, urllib3.exceptions.HTTPError: the connection failed.
        """
        self._stopped = False
        if kwargs.get("resource_version"):
            self.resource_version = str(kwargs["resource_version"])
        resp = self._resp = func(*args, **kwargs, watch=True, _preload_content=False)
        try:
            status = getattr(resp, "status", 200)
            if not 200 <= status <= 299:
                resp.read()
                raise ApiException.of(resp)
            for line in iter_lines(resp):
                event = json.loads(line)
                if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
                    raise ValueError(f"not a watch event: {line[:200]!r}")
                obj = event["object"]
                if event.get("type") == "ERROR":
                    raise ApiException(
                        int(obj.get("code") or 500),
                        f"{obj.get('reason', '')}: {obj.get('message', '')}",
                        body=json.dumps(obj),
                    )
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if version:
                    self.resource_version = str(version)
                yield event
                if self._stopped:
                    break
        finally:
            self._resp = None
            resp.close()
            resp.release_conn()
