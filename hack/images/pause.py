#!/usr/bin/env python3
"""Pack a static pause binary into a one-layer OCI image archive (``oci-archive``) for containerd.

The dev cluster's real node has no registry to pull ``registry.k8s.io/pause`` from, so
hack/node-bins.sh compiles hack/images/pause.c and this script packs it: layer = ``/pause``
(mode 0755, owner 0:0, mtime 0), config = entry point ``/pause``, user 65535, linux/amd64; the
``index.json`` names it ``rlenergy.local/pause:1`` (``io.containerd.image.name``), which is the
``sandbox_image`` of the containerd config that ``rlenergy_dev.devcluster.realnode`` writes.
Reproducible: fixed times and owners, sorted entries, so the same binary gives the same digest.

Usage: ``python3 hack/images/pause.py PAUSE_BINARY OUT.oci.tar``
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

IMAGE_NAME = "rlenergy.local/pause:1"
"""Keep in sync with dev/rlenergy_dev/devcluster/realnode.py (PAUSE_IMAGE)."""


def _tar(entries: list[tuple[str, bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in sorted(entries):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def build(pause: Path, out: Path) -> str:
    """Write the archive; returns the manifest digest."""
    layer_tar = _tar([("pause", pause.read_bytes(), 0o755)])
    layer_gz = gzip.compress(layer_tar, compresslevel=9, mtime=0)
    diff_id = "sha256:" + hashlib.sha256(layer_tar).hexdigest()
    layer_digest, _ = _blob(layer_gz)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "hack/images/pause.py", "created": "1970-01-01T00:00:00Z"}],
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    config_digest, _ = _blob(config_bytes)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": layer_digest,
                "size": len(layer_gz),
            }
        ],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest_digest, _ = _blob(manifest_bytes)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": IMAGE_NAME,
                    "org.opencontainers.image.ref.name": IMAGE_NAME.rsplit(":", 1)[1],
                },
            }
        ],
    }
    files = [
        ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode(), 0o644),
        ("index.json", json.dumps(index, sort_keys=True).encode(), 0o644),
    ]
    for blob in (layer_gz, config_bytes, manifest_bytes):
        d, data = _blob(blob)
        files.append((f"blobs/sha256/{d.split(':', 1)[1]}", data, 0o644))
    out.write_bytes(_tar(files))
    return manifest_digest


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(build(Path(sys.argv[1]), Path(sys.argv[2])))
