"""Rendering of the admin kubeconfig for the dev cluster."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

CONTEXT_NAME = "rl-energy-dev"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def render_kubeconfig(
    server: str,
    ca_pem: bytes,
    client_cert_pem: bytes,
    client_key_pem: bytes,
    *,
    name: str = CONTEXT_NAME,
    user: str = "admin",
) -> str:
    """Render a self-contained kubeconfig (certificates embedded as base64 PEM).

    Args:
        server: API server URL, e.g. ``https://127.0.0.1:6443``.
        ca_pem: The CA that signed the API server's serving certificate.
        client_cert_pem: The client certificate.
        client_key_pem: The client certificate's private key.
        name: Name of the cluster and the context.
        user: Name of the user entry.

    Returns:
        The kubeconfig as YAML text.
    """
    if not server.startswith("https://"):
        raise ValueError(f"the dev cluster only serves HTTPS, got server={server!r}")
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client_cert_pem),
                    "client-key-data": _b64(client_key_pem),
                },
            }
        ],
        "contexts": [{"name": name, "context": {"cluster": name, "user": user}}],
        "current-context": name,
        "preferences": {},
    }
    return yaml.safe_dump(doc, sort_keys=False)


def write_kubeconfig(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable only by the owner (it holds a private key).

    Args:
        path: Destination.
        text: Kubeconfig YAML from :func:`render_kubeconfig`.

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    tmp.replace(path)
    return path
