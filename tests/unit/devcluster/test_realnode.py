"""The real node's configuration (rlenergy_dev.devcluster.realnode) and the kubelet's certificate.

The node itself runs in tests/e2e/test_real_node.py; these check what is written for it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from cryptography.x509.oid import NameOID
from rlenergy_dev.devcluster import realnode
from rlenergy_dev.devcluster.certs import client_cert, generate_pki
from rlenergy_dev.devcluster.errors import MissingBinaryError


def test_containerd_config_keeps_everything_under_its_folder(tmp_path: Path) -> None:
    cfg = tomllib.loads(realnode.containerd_config(tmp_path))
    assert cfg["version"] == 2
    assert cfg["root"] == str(tmp_path / "root") and cfg["state"] == str(tmp_path / "state")
    assert cfg["grpc"]["address"] == str(tmp_path / "containerd.sock")
    cri = cfg["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == realnode.PAUSE_IMAGE
    assert cri["stream_server_address"] == "127.0.0.1"
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    assert cri["cni"]["conf_dir"] == str(tmp_path / "cni")
    assert cfg["plugins"]["io.containerd.internal.v1.opt"]["path"] == str(tmp_path / "opt")


def test_kubelet_config_for_this_host(tmp_path: Path) -> None:
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    cfg = realnode.kubelet_config(
        runtime_socket=tmp_path / "c.sock",
        port=1234,
        healthz_port=1235,
        client_ca=tmp_path / "ca.crt",
        taints=[taint],
    )
    assert cfg["kind"] == "KubeletConfiguration"
    assert cfg["failCgroupV1"] is False and cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["address"] == cfg["healthzBindAddress"] == "127.0.0.1"
    assert cfg["readOnlyPort"] == 0
    assert cfg["containerRuntimeEndpoint"] == f"unix://{tmp_path / 'c.sock'}"
    assert cfg["authentication"]["anonymous"]["enabled"] is False
    assert cfg["registerWithTaints"] == [taint]


def test_cni_config_is_loopback_only() -> None:
    assert [p["type"] for p in realnode.CNI_CONFIG["plugins"]] == ["loopback"]


def test_kubelet_client_certificate_names_the_node() -> None:
    pki = generate_pki()
    pair = client_cert(pki, "system:node:realnode", ("system:nodes",))
    cert = pair.cert
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == (
        "system:node:realnode"
    )
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == (
        "system:nodes"
    )
    assert cert.issuer == pki.client_ca.cert.subject


def test_missing_kubelet_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(MissingBinaryError, match="make bins"):
        realnode.resolve_node_binaries(tmp_path)


def test_unmount_under_touches_nothing_outside(tmp_path: Path) -> None:
    assert realnode.unmount_under(tmp_path) == []
