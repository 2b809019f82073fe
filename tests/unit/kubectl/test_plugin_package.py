"""The kubectl plugin as users install it: one file, and krew's archive and manifest.

``hack/kubectl-plugin.py`` is built into a temporary folder. We test these aspects:
* ``kubectl-rlenergy`` is one executable file (a Python zip application) that runs with a
  ``python3`` that has the plugin's dependencies and imports the plugin and ``rlenergy`` from
  itself, not from the checkout: ``--help``, ``smoke --help`` (with ``-o``), and ``status``
  against a missing kubeconfig, which fails with its one-line error and exit code 1;
* the archive holds exactly the plugin (mode 0755) and LICENSE, and two builds are identical;
* the krew manifest is a ``krew.googlecontainertools.github.com/v1alpha2`` ``Plugin`` named
  ``rlenergy`` at the project's version, each platform pointing at the release URL with the
  archive's sha256, ``bin: kubectl-rlenergy`` and the files the archive has.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "rlenergy_hack_plugin", ROOT / "hack" / "kubectl-plugin.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out: dict[str, Path] = _builder().build(tmp_path_factory.mktemp("plugin"))
    return out


def _run(plugin: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KUBECONFIG")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', os.defpath)}"
    env["HOME"] = str(plugin.parent)  # no ~/.kube/config
    return subprocess.run(
        [str(plugin), *args], capture_output=True, text=True, env=env, cwd=plugin.parent,
        timeout=120,
    )  # fmt: skip


def test_single_file_runs_from_itself(built: dict[str, Path]) -> None:
    plugin = built["plugin"]
    assert plugin.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    assert os.access(plugin, os.X_OK)
    res = _run(plugin, "--help")
    assert res.returncode == 0 and "status" in res.stdout and "smoke" in res.stdout, res
    res = _run(plugin, "smoke", "--help")
    assert res.returncode == 0 and "-o {table,json}" in res.stdout, res
    res = _run(plugin, "status", "-o", "json", "--kubeconfig", str(plugin.parent / "none"))
    assert res.returncode == 1 and res.stderr.startswith("error: kubeconfig "), res
    where = subprocess.run(
        [sys.executable, "-c", "import rlenergy_kubectl.cli, rlenergy.api.naming as n; "
         "print(rlenergy_kubectl.cli.__file__); print(n.__file__)"],
        capture_output=True, text=True, check=True, cwd=plugin.parent,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
             "PYTHONPATH": str(plugin)},
    ).stdout.split()  # fmt: skip
    assert all(w.startswith(f"{plugin}/") for w in where), where


def test_archive_is_the_plugin_and_license_and_reproducible(
    built: dict[str, Path], tmp_path: Path
) -> None:
    with tarfile.open(built["archive"]) as tf:
        members = {m.name: m for m in tf.getmembers()}
        assert set(members) == {"kubectl-rlenergy", "LICENSE"}
        assert members["kubectl-rlenergy"].mode == 0o755
        data = tf.extractfile("kubectl-rlenergy")
        assert data is not None and data.read() == built["plugin"].read_bytes()
    again = _builder().build(tmp_path)
    assert again["archive"].read_bytes() == built["archive"].read_bytes()


def test_krew_manifest(built: dict[str, Path]) -> None:
    doc = yaml.safe_load(built["manifest"].read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert doc["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2"
    assert doc["kind"] == "Plugin" and doc["metadata"]["name"] == "rlenergy"
    assert doc["spec"]["version"] == f"v{version}"
    sha = hashlib.sha256(built["archive"].read_bytes()).hexdigest()
    platforms = doc["spec"]["platforms"]
    assert {(p["selector"]["matchLabels"]["os"], p["selector"]["matchLabels"]["arch"])
            for p in platforms} >= {("linux", "amd64"), ("linux", "arm64")}  # fmt: skip
    for p in platforms:
        assert p["sha256"] == sha
        assert p["uri"].endswith(f"/v{version}/kubectl-rlenergy.tar.gz")
        assert p["bin"] == "kubectl-rlenergy"
        assert {f["from"] for f in p["files"]} == {"kubectl-rlenergy", "LICENSE"}
