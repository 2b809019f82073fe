"""The node's serving certificate: asked for when missing, due or for other IPs; kept otherwise."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from rlenergy_agent import endpoint, tlsserve

from rlenergy.api import tls

T0 = 1_767_225_600.0  # 2026-01-01 UTC
ROOT = Path(__file__).resolve().parents[3]


class Signer:
    """Plays the operator: signs every request with its CA."""

    def __init__(self) -> None:
        self.now = T0
        self.ca = tls.make_ca("ca", self._dt())
        self.names: list[str] = []
        self.deny = False

    def _dt(self) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.now, datetime.UTC)

    def __call__(self, name: str, csr_pem: bytes) -> bytes:
        self.names.append(name)
        if self.deny:
            raise RuntimeError("serving certificate request denied: NotTheNodesAddress")
        request, parsed = tls.read_csr(csr_pem)
        return tls.issue(self.ca, parsed.public_key(), request, self._dt()) + self.ca.cert_pem


def make_here(folder: Path, node: str, ips: Sequence[str]) -> bytes:
    """What the tlsgen child does, in process."""
    key = tls.new_key()
    (folder / "tls.key.new").write_bytes(key)
    return tls.make_csr(key, node, ips)


def _keeper(
    tmp_path: Path, signer: Signer, ips: tuple[str, ...] = ("10.0.0.5",)
) -> tlsserve.ServingCertKeeper:
    return tlsserve.ServingCertKeeper(
        "gpu-1", ips, tmp_path / "tls", signer, make=make_here, clock=lambda: signer.now
    )


def test_a_missing_certificate_is_requested_and_written(tmp_path: Path) -> None:
    signer = Signer()
    keeper = _keeper(tmp_path, signer)
    assert keeper.due() == "no certificate yet"
    assert keeper.ensure() is True
    assert tls.cert_ips(keeper.cert_file.read_bytes()) == ("10.0.0.5",)
    assert (keeper.key_file.stat().st_mode & 0o777) == 0o600
    assert endpoint.ServingCertificate(keeper.cert_file, keeper.key_file).context() is not None
    assert keeper.ensure() is False  # good: no second request
    assert len(signer.names) == 1


def test_renewal_comes_after_two_thirds_of_the_lifetime_with_a_new_key(tmp_path: Path) -> None:
    signer = Signer()
    keeper = _keeper(tmp_path, signer)
    keeper.ensure()
    key = keeper.key_file.read_bytes()
    signer.now = T0 + tlsserve.LIFETIME_S * 0.6
    assert keeper.due() is None
    signer.now = T0 + tlsserve.LIFETIME_S * 0.7
    assert keeper.due() == "certificate due for renewal"
    assert keeper.ensure() is True
    assert keeper.key_file.read_bytes() != key


def test_a_new_node_ip_gets_a_new_certificate(tmp_path: Path) -> None:
    signer = Signer()
    _keeper(tmp_path, signer).ensure()
    moved = _keeper(tmp_path, signer, ips=("10.0.0.9",))
    assert "10.0.0.9" in (moved.due() or "")
    moved.ensure()
    assert tls.cert_ips(moved.cert_file.read_bytes()) == ("10.0.0.9",)


def test_a_denied_request_leaves_the_old_files(tmp_path: Path) -> None:
    signer = Signer()
    keeper = _keeper(tmp_path, signer)
    keeper.ensure()
    before = keeper.cert_file.read_bytes(), keeper.key_file.read_bytes()
    signer.deny = True
    signer.now = T0 + tlsserve.LIFETIME_S * 0.9
    with pytest.raises(RuntimeError, match="denied"):
        keeper.ensure()
    assert (keeper.cert_file.read_bytes(), keeper.key_file.read_bytes()) == before


def test_the_key_is_made_in_a_child_and_the_agent_never_loads_cryptography(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("", "agent", "operator")),
    }
    csr = subprocess.run(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from rlenergy_agent import tlsserve, __main__;"
         f"out = tlsserve.make_in_child(Path({str(tmp_path)!r}), 'gpu-1', ['10.0.0.5']);"
         "assert 'cryptography' not in sys.modules, 'the agent loaded cryptography';"
         "sys.stdout.buffer.write(out)"],
        env=env, capture_output=True, check=True,
    ).stdout  # fmt: skip
    request, _ = tls.read_csr(csr)
    assert (request.common_name, request.ips) == ("gpu-1", ("10.0.0.5",))
    assert ((tmp_path / "tls.key.new").stat().st_mode & 0o777) == 0o600
