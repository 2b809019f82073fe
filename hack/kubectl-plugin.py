"""Build the kubectl plugin as users install plugins: one file, and a krew archive and manifest.

``python hack/kubectl-plugin.py [OUT_DIR]`` (default ``build/kubectl-plugin``) writes:

* ``kubectl-rlenergy``: a Python zip application (PEP 441, ``#!/usr/bin/env python3``) of the
  packages ``rlenergy_kubectl`` and ``rlenergy`` (the ``.py`` files and ``py.typed``). Copied
  anywhere on ``PATH`` it is ``kubectl rlenergy``; it needs Python >= 3.11 with the plugin's
  dependencies (``pip install 'kubernetes>=37.0.2,<38' 'rich>=13' 'pydantic>=2.7,<3' pyyaml``:
  the ``kubectl`` extra and the core's, pyproject.toml), which are not bundled because pydantic's
  core is a compiled extension a zip application cannot load.
* ``kubectl-rlenergy.tar.gz``: that file and ``LICENSE``, reproducible (sorted entries, mtime 0,
  owner 0), the archive krew downloads.
* ``rlenergy.yaml``: the krew plugin manifest (``krew.googlecontainertools.github.com/
  v1alpha2``, ``kind: Plugin``, as krew's plugin manifest reference specifies) for linux and
  darwin on amd64 and arm64, pointing at ``RELEASE_URL`` for this version with the archive's
  sha256; ``kubectl krew install --manifest=rlenergy.yaml --archive=kubectl-rlenergy.tar.gz``
  installs it from the two files.

The version is ``project.version`` of pyproject.toml. Checked by
``tests/unit/kubectl/test_plugin_package.py``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import sys
import tarfile
import tomllib
import zipapp
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "operator" / "rlenergy_kubectl", ROOT / "rlenergy")
"""The packages in the zip application (the plugin imports ``rlenergy.api``)."""
RELEASE_URL = (
    "https://github.com/rl-energy/rl-energy-operator/releases/download/v{version}/"
    "kubectl-rlenergy.tar.gz"
)
"""Where a release publishes the archive (the chart's ``home``)."""
PLATFORMS = [(os, arch) for os in ("linux", "darwin") for arch in ("amd64", "arm64")]
MAIN = "import sys\n\nfrom rlenergy_kubectl import cli\n\nsys.exit(cli.main())\n"


def version() -> str:
    """``project.version`` of pyproject.toml."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def _zip_bytes() -> bytes:
    """The zip application's archive (without the shebang), entries sorted, fixed times."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        files = sorted(
            (p.relative_to(pkg.parent), p)
            for pkg in PACKAGES
            for p in pkg.rglob("*")
            if p.is_file() and p.suffix in (".py", ".typed") and "__pycache__" not in p.parts
        )
        entries = [("__main__.py", MAIN.encode())]
        entries += [(rel.as_posix(), path.read_bytes()) for rel, path in files]
        for name, data in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return buf.getvalue()


def build_plugin(out: Path) -> Path:
    """Write the single-file plugin ``out/kubectl-rlenergy`` (mode 0755); returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / "kubectl-rlenergy"
    raw = out / "kubectl-rlenergy.zip"
    raw.write_bytes(_zip_bytes())
    zipapp.create_archive(raw, target, interpreter="/usr/bin/env python3")
    raw.unlink()
    target.chmod(0o755)
    return target


def build_archive(plugin: Path, out: Path) -> Path:
    """``out/kubectl-rlenergy.tar.gz`` with the plugin and LICENSE, byte-reproducible."""
    target = out / "kubectl-rlenergy.tar.gz"
    tar_buf = io.BytesIO()
    with tarfile.open(fileobj=tar_buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path, mode in ((ROOT / "LICENSE", 0o644), (plugin, 0o755)):
            info = tarfile.TarInfo(path.name)
            data = path.read_bytes()
            info.size, info.mode, info.mtime = len(data), mode, 0
            tf.addfile(info, io.BytesIO(data))
    with target.open("wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(tar_buf.getvalue())
    return target


def manifest(archive: Path, ver: str) -> str:
    """The krew manifest for ``archive`` (YAML text)."""
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    lines = [
        "apiVersion: krew.googlecontainertools.github.com/v1alpha2",
        "kind: Plugin",
        "metadata:",
        "  name: rlenergy",
        "spec:",
        f"  version: v{ver}",
        "  homepage: https://github.com/rl-energy/rl-energy-operator",
        "  shortDescription: Show and smoke-test the rl-energy operator's GPU clock savings",
        "  description: |",
        "    Shows what the rl-energy operator chose and measured for RL post-training jobs",
        "    (per-phase GPU clocks, savings, throughput ratio, per-node health) and runs a smoke",
        "    test that signals RL phases from a one-GPU pod. Needs python3 (>= 3.11) with",
        "    kubernetes, rich, pydantic and pyyaml installed.",
        "  caveats: |",
        "    The plugin is a Python zip application: install its dependencies with",
        "    pip install 'kubernetes>=37.0.2,<38' 'rich>=13' 'pydantic>=2.7,<3' pyyaml",
        "  platforms:",
    ]
    for os_name, arch in PLATFORMS:
        lines += [
            "  - selector:",
            "      matchLabels:",
            f"        os: {os_name}",
            f"        arch: {arch}",
            f"    uri: {RELEASE_URL.format(version=ver)}",
            f"    sha256: {sha}",
            "    bin: kubectl-rlenergy",
            "    files:",
            "    - from: kubectl-rlenergy",
            "      to: .",
            "    - from: LICENSE",
            "      to: .",
        ]
    return "\n".join(lines) + "\n"


def build(out: Path) -> dict[str, Path]:
    """Build all three into ``out``; returns them by name."""
    plugin = build_plugin(out)
    archive = build_archive(plugin, out)
    krew = out / "rlenergy.yaml"
    krew.write_text(manifest(archive, version()))
    return {"plugin": plugin, "archive": archive, "manifest": krew}


if __name__ == "__main__":
    built = build(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "kubectl-plugin")
    for name, path in built.items():
        print(f"{name}: {path}")
