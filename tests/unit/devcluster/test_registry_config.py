"""What the dev cluster writes for its OCI registry and for the real node's pulls from it.

The registry itself runs in tests/e2e/test_registry_install.py and the real-node e2e test.
We test these aspects:

* Distribution's config listens on 127.0.0.1 only and keeps its blobs in its folder;
* containerd's ``hosts.toml``: plain HTTP for the registry's own name, a pull mirror (upstream
  kept as the fallback) for ``ghcr.io``; containerd's config reads them from its folder;
* a missing registry binary names the command that builds it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from rlenergy_dev.devcluster import realnode, registry
from rlenergy_dev.devcluster.errors import MissingBinaryError


def test_distribution_listens_on_loopback_only_and_stores_in_its_folder(tmp_path: Path) -> None:
    cfg = registry.distribution_config(tmp_path / "data", 5123)
    assert cfg["http"]["addr"] == "127.0.0.1:5123"
    assert "tls" not in cfg["http"] and "auth" not in cfg
    assert cfg["storage"]["filesystem"]["rootdirectory"] == str(tmp_path / "data")


def test_hosts_toml_of_the_registry_itself_is_plain_http() -> None:
    cfg = tomllib.loads(realnode.hosts_toml("127.0.0.1:5123", "127.0.0.1:5123"))
    assert cfg["server"] == "http://127.0.0.1:5123"
    assert cfg["host"]["http://127.0.0.1:5123"]["capabilities"] == ["pull", "resolve"]


def test_hosts_toml_of_a_mirrored_registry_keeps_the_upstream() -> None:
    cfg = tomllib.loads(realnode.hosts_toml("ghcr.io", "127.0.0.1:5123"))
    assert cfg["server"] == "https://ghcr.io"
    assert list(cfg["host"]) == ["http://127.0.0.1:5123"]
    assert cfg["host"]["http://127.0.0.1:5123"]["capabilities"] == ["pull", "resolve"]


def test_containerd_reads_registry_hosts_from_its_folder(tmp_path: Path) -> None:
    cfg = tomllib.loads(realnode.containerd_config(tmp_path, tmp_path / "shim", tmp_path / "w"))
    images = cfg["plugins"]["io.containerd.cri.v1.images"]
    assert images["registry"]["config_path"] == str(tmp_path / "certs.d")


def test_registry_hosts_of_a_registry_name_it_and_mirror_ghcr(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    bins.mkdir()
    for name in ("registry", "crane", "helm"):
        (bins / name).write_text("#!/bin/sh\n")
        (bins / name).chmod(0o755)
    reg = registry.Registry(tmp_path / "reg", bins)
    reg.port = 5123
    assert reg.containerd_hosts() == {
        "127.0.0.1:5123": "127.0.0.1:5123",
        "ghcr.io": "127.0.0.1:5123",
    }
    assert reg.image_repository("rl-energy-agent") == "127.0.0.1:5123/rl-energy/rl-energy-agent"
    assert reg.chart_repo == "oci://127.0.0.1:5123/charts"


@pytest.mark.parametrize("missing", ["registry", "crane", "helm"])
def test_missing_registry_binary_names_the_fix(tmp_path: Path, missing: str) -> None:
    for name in {"registry", "crane", "helm"} - {missing}:
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    with pytest.raises(MissingBinaryError, match=f"{missing} not found.*make bins"):
        registry.resolve_registry_binaries(tmp_path)
