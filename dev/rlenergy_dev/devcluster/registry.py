"""A local OCI registry for the dev cluster: CNCF Distribution on 127.0.0.1, plain HTTP.

``DevCluster.start(registry=True)`` (or :class:`Registry` on its own) starts the ``registry``
binary of github.com/distribution/distribution/v3 (built by ``hack/registry-bins.sh``, ``make
bins``) listening on ``127.0.0.1:<free port>`` only, with filesystem storage in its own folder.
:meth:`Registry.push_images` pushes the OCI image archives ``make images`` writes with crane
(github.com/google/go-containerregistry ``cmd/crane``, the same build step) under
``<host>/rl-energy/<image>:<tag>``, and :meth:`Registry.push_chart` packages the chart with
``helm package`` and pushes it with ``helm push --plain-http`` to ``oci://<host>/charts``, as a
chart's publisher does. Users install it with ``helm install oci://<host>/charts/rl-energy``; the
real node's containerd pulls the images from it, under their registry name or, for the chart's
default names ``ghcr.io/rl-energy/<image>``, as the mirror of ``ghcr.io``
(:meth:`Registry.containerd_hosts`, ``RealNode(registries=...)``).

There is no TLS and no authentication: the registry is reachable only from this machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlenergy_dev.devcluster import process
from rlenergy_dev.devcluster.binaries import default_bin_dir
from rlenergy_dev.devcluster.errors import DevClusterError, MissingBinaryError

LOOPBACK = "127.0.0.1"
IMAGE_NAMESPACE = "rl-energy"
"""Repository prefix of the images in the registry (as ``ghcr.io/rl-energy``)."""
CHART_NAMESPACE = "charts"
"""Repository prefix of the charts: ``oci://<host>/charts/<chart name>``."""
IMAGES = ("rl-energy-operator", "rl-energy-agent")
"""The images ``make images`` writes (``build/images/<image>.oci.tar``)."""
MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
)
"""The media types :meth:`Registry.manifest` accepts (OCI image-spec v1.1)."""
MIRRORED = ("ghcr.io",)
"""Registries whose ``rl-energy/...`` images this one mirrors on the real node: the chart's
default image names (``ghcr.io/rl-energy/<image>``) are pulled from here."""
FIX = "make bins"
PORT_ATTEMPTS = 3
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""HTTP without any ``*_proxy`` of the environment: the registry is on the loopback."""


@dataclass(frozen=True)
class RegistryBinaries:
    """The registry and its push clients."""

    registry: Path
    crane: Path
    helm: Path


def resolve_registry_binaries(bin_dir: Path | None = None) -> RegistryBinaries:
    """Locate ``registry``, ``crane`` and ``helm`` in the bin dir (``make bins``).

    Raises:
        MissingBinaryError: One is missing; the message names the command that builds it.
    """
    bin_dir = bin_dir or default_bin_dir()
    found = {}
    for name in ("registry", "crane", "helm"):
        path = bin_dir / name
        if not (path.is_file() and os.access(path, os.X_OK)):
            script = "controlplane-bins.sh" if name == "helm" else "registry-bins.sh"
            raise MissingBinaryError(
                f"{name} not found at {path}. Build it with `{FIX}` (hack/{script}; the "
                "registry and crane come from the Go module proxy)."
            )
        found[name] = path
    return RegistryBinaries(**found)


def distribution_config(root: Path, port: int) -> dict[str, Any]:
    """The registry's configuration (Distribution v3 ``config.yml``, version 0.1).

    Listens on ``127.0.0.1:port`` only, plain HTTP; blobs under ``root``; deletes allowed (a
    test may remove a tag). Keys: docs/content/about/configuration.md of distribution v3.1.2.
    """
    return {
        "version": 0.1,
        "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": False}},
        "storage": {
            "filesystem": {"rootdirectory": str(root)},
            "delete": {"enabled": True},
            "cache": {"blobdescriptor": "inmemory"},
        },
        "http": {"addr": f"{LOOPBACK}:{port}", "draintimeout": "2s"},
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class Registry:
    """One Distribution registry process on the loopback and what it serves.

    Args:
        base: Its folder (config, storage, log, helm's config for ``helm push``).
        bin_dir: The bin dir (default: the dev cluster's, ``make bins``).
        die_with_parent: SIGKILL the registry when this process dies.
    """

    def __init__(
        self, base: Path, bin_dir: Path | None = None, *, die_with_parent: bool = True
    ) -> None:
        self.base = base
        self.bins = resolve_registry_binaries(bin_dir)
        self.die_with_parent = die_with_parent
        self.port = 0
        self.record: process.ProcessRecord | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """``127.0.0.1:<port>`` (the registry part of image references)."""
        if not self.port:
            raise DevClusterError("the registry is not started")
        return f"{LOOPBACK}:{self.port}"

    @property
    def chart_repo(self) -> str:
        """``oci://<host>/charts`` (where :meth:`push_chart` pushes)."""
        return f"oci://{self.host}/{CHART_NAMESPACE}"

    def containerd_hosts(self) -> dict[str, str]:
        """The registry namespaces it serves on a node (``RealNode(registries=...)``).

        Its own host, and :data:`MIRRORED` as a pull mirror (images are pushed under the same
        paths, ``rl-energy/<image>``).
        """
        return {self.host: self.host, **dict.fromkeys(MIRRORED, self.host)}

    def image_repository(self, image: str) -> str:
        """``<host>/rl-energy/<image>``: the chart's ``*.image.repository`` for ``image``."""
        return f"{self.host}/{IMAGE_NAMESPACE}/{image}"

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> Registry:
        """Start the registry on a free loopback port; return once ``GET /v2/`` answers 200.

        Raises:
            DevClusterError: It exited or did not answer in ``timeout_s``; the message has
                its log tail.
        """
        self.base.mkdir(parents=True, exist_ok=True)
        log = self.base / "registry.log"
        for _ in range(PORT_ATTEMPTS):
            self.port = _free_port()
            cfg = self.base / "config.yml"
            cfg.write_text(yaml.safe_dump(distribution_config(self.base / "data", self.port)))
            self._proc, self.record = process.spawn(
                "registry",
                [str(self.bins.registry), "serve", str(cfg)],
                log,
                die_with_parent=self.die_with_parent,
            )
            deadline = time.monotonic() + timeout_s
            while self._proc.poll() is None and time.monotonic() < deadline:
                if self._v2_ok():
                    return self
                time.sleep(0.2)
            if self._proc.poll() is None:
                self.stop()
                raise DevClusterError(
                    f"the registry did not answer on {self.host} in {timeout_s:.0f} s; last "
                    f"lines of {log}:\n{process.tail(log)}"
                )
            if "address already in use" not in process.tail(log):
                break  # any other exit is not a port race: report it
        raise DevClusterError(
            f"the registry exited with code {self._proc.returncode if self._proc else '?'}; "
            f"last lines of {log}:\n{process.tail(log)}"
        )

    def stop(self) -> None:
        """Stop the registry (SIGTERM, SIGKILL after 10 s). Safe to call more than once."""
        if self.record is not None and self._proc is not None:
            process.terminate([self.record], {self._proc.pid: self._proc}, grace=10.0)
        self.record = None
        self._proc = None

    def _v2_ok(self) -> bool:
        try:
            with _DIRECT.open(f"http://{self.host}/v2/", timeout=2) as res:
                return bool(res.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    # ------------------------------------------------------------------ push
    def push_image(self, archive: Path, image: str, tag: str) -> str:
        """Push an OCI image archive (``make images``) as ``<host>/rl-energy/<image>:<tag>``.

        The archive's OCI layout is unpacked into a temporary folder and pushed with ``crane
        push`` (its one manifest, blobs and config, digests unchanged).

        Returns:
            The pushed reference with its digest, ``<host>/rl-energy/<image>@sha256:...``.

        Raises:
            DevClusterError: The archive is missing or crane failed.
        """
        if not archive.is_file():
            raise DevClusterError(f"image archive {archive} not found (run `make images`)")
        ref = f"{self.image_repository(image)}:{tag}"
        with tempfile.TemporaryDirectory(dir=self.base) as tmp:
            with tarfile.open(archive) as tf:
                tf.extractall(tmp, filter="data")
            out = self._run([str(self.bins.crane), "push", "--insecure", tmp, ref])
        pushed = out.strip().splitlines()[-1] if out.strip() else ""
        if "@sha256:" not in pushed:
            raise DevClusterError(f"crane push {ref} printed no digest: {out!r}")
        return pushed

    def push_images(self, images_dir: Path, tag: str) -> dict[str, str]:
        """Push both project images from ``images_dir`` (``build/images``); name -> reference."""
        return {name: self.push_image(images_dir / f"{name}.oci.tar", name, tag) for name in IMAGES}

    def push_chart(self, chart: Path, version: str | None = None) -> tuple[str, str]:
        """``helm package`` the chart (optionally as ``version``) and ``helm push`` it.

        Returns:
            ``(oci://<host>/charts/<name>, version)``: what ``helm install`` takes.

        Raises:
            DevClusterError: helm failed.
        """
        with tempfile.TemporaryDirectory(dir=self.base) as tmp:
            args = ["package", str(chart), "--destination", tmp]
            if version:
                args += ["--version", version]
            self.helm(*args)
            (tgz,) = Path(tmp).glob("*.tgz")
            self.helm("push", str(tgz), self.chart_repo, "--plain-http")
        meta = yaml.safe_load((chart / "Chart.yaml").read_text())
        return f"{self.chart_repo}/{meta['name']}", version or str(meta["version"])

    def helm(self, *args: str) -> str:
        """Run the pinned helm with its config, cache and data folders under :attr:`base`."""
        env = dict(os.environ)
        for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            env[var] = str(self.base / "helm" / var.lower())
        return self._run([str(self.bins.helm), *args], env=env)

    def _run(self, argv: list[str], env: dict[str, str] | None = None) -> str:
        res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        if res.returncode != 0:
            raise DevClusterError(f"{' '.join(argv)} failed ({res.returncode}):\n{res.stderr}")
        return res.stdout

    # ------------------------------------------------------------------ read
    def manifest(self, repository: str, reference: str) -> tuple[str, dict[str, Any]]:
        """``GET /v2/<repository>/manifests/<reference>``: its digest and JSON body.

        Args:
            repository: The repository inside the registry (``rl-energy/rl-energy-agent``).
            reference: A tag or a digest.

        Raises:
            DevClusterError: The registry does not have it (the HTTP status and body).
        """
        req = urllib.request.Request(
            f"http://{self.host}/v2/{repository}/manifests/{reference}",
            headers={"Accept": ", ".join(MANIFEST_TYPES)},
        )
        try:
            with _DIRECT.open(req, timeout=10) as res:
                return res.headers["Docker-Content-Digest"], json.loads(res.read())
        except urllib.error.HTTPError as exc:
            raise DevClusterError(
                f"{repository}:{reference} not in the registry {self.host}: HTTP {exc.code} "
                f"{exc.read().decode(errors='replace')[:300]}"
            ) from None

    def manifest_gets(self) -> list[tuple[str, str]]:
        """The ``GET /v2/<repo>/manifests/<ref>`` requests it answered with 200.

        Returns:
            ``(path, user agent)`` per request, oldest first, read from its access log (the
            combined log format): who pulled what (containerd's agent is
            ``containerd/<version>``).
        """
        log = (self.base / "registry.log").read_text()
        pattern = r'"GET (/v2/\S+/manifests/\S+) HTTP/[0-9.]+" 200 \d+ "[^"]*" "([^"]*)"'
        return [(m[0], m[1]) for m in re.findall(pattern, log)]

    def tags(self, repository: str) -> list[str]:
        """``GET /v2/<repository>/tags/list``'s tags (``[]`` when the repository is unknown)."""
        with contextlib.suppress(urllib.error.HTTPError):
            url = f"http://{self.host}/v2/{repository}/tags/list"
            with _DIRECT.open(url, timeout=10) as res:
                return list(json.loads(res.read()).get("tags") or [])
        return []
