"""Trainer pods for agents run as local processes: a pod object and its real bound token.

The node agent authenticates every signal by the caller pod's projected service-account token
(TokenReview, ``rlenergy_agent.identity``). A test, benchmark or demo whose agents and trainer
run as local processes next to KWOK nodes does what the kubelet does for a real pod: it
creates the trainer pod object on the node (KWOK runs it), asks the API server for a token
bound to that pod with the agent's audience (TokenRequest, ``kubectl create token
--bound-object-kind Pod``), writes it to a file and gives the SDK that file
(``RLENERGY_AGENT_TOKEN_FILE``). The agent then checks it against the same API server: no
shortcut.

Callers: ``rlenergy_dev.fullstack``, ``tests/chaos``, ``tests/e2e``,
``tests/fuzz``, ``bench/agent.py``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rlenergy.api import signals
from rlenergy_dev.devcluster.binaries import resolve_binaries
from rlenergy_dev.devcluster.errors import DevClusterError

TOKEN_SECONDS = 3600
"""Lifetime of a harness token, s (the API server's minimum is 600)."""


class Kubectl(Protocol):
    """Runs kubectl against the dev cluster (``DevCluster.kubectl`` has this shape)."""

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl args``; raise ``DevClusterError`` on failure when ``check``."""
        ...


def kubectl_for(kubeconfig: Path) -> Kubectl:
    """A ``Kubectl`` on the pinned kubectl (``make bins``) and ``kubeconfig``."""
    exe = str(resolve_binaries().kubectl)

    def run(
        *args: str, input: str | None = None, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        argv = [exe, f"--kubeconfig={kubeconfig}", *args]
        res = subprocess.run(  # noqa: S603 - our own pinned binary
            argv, input=input, capture_output=True, text=True, timeout=timeout
        )
        if check and res.returncode != 0:
            raise DevClusterError(f"kubectl {' '.join(args)} failed: {res.stderr}{res.stdout}")
        return res

    return run


@dataclasses.dataclass(frozen=True)
class TrainerPod:
    """A trainer pod object and the file holding its bound token.

    Attributes:
        namespace: its namespace.
        name: its name.
        uid: its UID.
        node: the node it is bound to.
        token_file: the token (``RLENERGY_AGENT_TOKEN_FILE`` of the trainer).
    """

    namespace: str
    name: str
    uid: str
    node: str
    token_file: Path

    @property
    def static_key(self) -> str:
        """``ns/name/uid``: its key in ``RLENERGY_AGENT_STATIC_PODS``."""
        return f"{self.namespace}/{self.name}/{self.uid}"


def pod_manifest(
    name: str,
    node: str | None,
    *,
    labels: Mapping[str, str] | None = None,
    gpus: int = 0,
    service_account: str = "default",
) -> dict[str, Any]:
    """A trainer pod bound to ``node`` (KWOK runs it; the image is never pulled)."""
    container: dict[str, Any] = {"name": "trainer", "image": "registry.invalid/trainer:1"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec: dict[str, Any] = {
        "serviceAccountName": service_account,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "containers": [container],
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": spec,
    }


def bound_token(
    kubectl: Kubectl,
    namespace: str,
    pod: str,
    uid: str,
    *,
    audience: str = signals.TOKEN_AUDIENCE,
    service_account: str = "default",
    seconds: int = TOKEN_SECONDS,
) -> str:
    """A token for ``service_account`` bound to the pod (TokenRequest), valid for ``audience``.

    Raises:
        DevClusterError: the API server refused (pod missing, other service account, ...).
    """
    res = kubectl(
        "create", "token", service_account, "-n", namespace,
        f"--audience={audience}", "--bound-object-kind=Pod", f"--bound-object-name={pod}",
        f"--bound-object-uid={uid}", f"--duration={seconds}s",
    )  # fmt: skip
    return res.stdout.strip()


def write_token(path: Path, token: str) -> Path:
    """Write a token file the way the kubelet does (owner-only, replaced atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(token)
    tmp.chmod(0o600)
    tmp.replace(path)
    return path


def create_trainer(
    kubectl: Kubectl,
    namespace: str,
    name: str,
    node: str | None,
    token_dir: Path,
    *,
    labels: Mapping[str, str] | None = None,
    gpus: int = 0,
    audience: str = signals.TOKEN_AUDIENCE,
    wait_s: float = 60.0,
) -> TrainerPod:
    """Create the trainer pod on ``node`` (or reuse it) and write its bound token to a file.

    Waits for the namespace's ``default`` service account (made by the controller manager).
    A pod of that name that exists already is reused (several stacks of one test share it).

    Raises:
        DevClusterError: the pod or the token could not be made.
    """
    deadline = time.monotonic() + wait_s
    while kubectl("get", "sa", "default", "-n", namespace, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise DevClusterError(f"no serviceaccount/default in {namespace} after {wait_s} s")
        time.sleep(0.2)
    got = kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    if got.returncode != 0:
        manifest = pod_manifest(name, node, labels=labels, gpus=gpus)
        got = kubectl(
            "create", "-n", namespace, "-o", "json", "-f", "-", input=json.dumps(manifest)
        )
    uid = str(json.loads(got.stdout)["metadata"]["uid"])
    token = bound_token(kubectl, namespace, name, uid, audience=audience)
    path = write_token(token_dir / f"{namespace}-{name}.token", token)
    return TrainerPod(namespace, name, uid, node or "", path)
