"""Every pod spec we show users mounts the agent's socket folder read-only.

The chart's ``socket-read-only`` ValidatingAdmissionPolicy refuses a pod outside the release
namespace that mounts the socket folder (``agent.socketDir``, default ``/var/run/rlenergy``)
writable (tests/e2e/test_privilege.py checks it on the API server). A copied example must
therefore already carry ``readOnly: true``.

We test these aspects:

* every YAML block of the docs pages, every file of ``docs/examples`` and ``deploy/``: each pod
  spec (a mapping with ``containers`` and ``volumes``, at any depth: a Pod, a Deployment's
  template, a RayJob's head and worker groups) that has a hostPath volume on the socket folder
  or inside it mounts that volume read-only in every container, init containers included;
* the pages that show the hand-made mount (docs/verl.md, docs/operations.md) are among those
  checked, so the test cannot pass on zero specs;
* the checker itself refuses a writable mount, under another spelling of the path too.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
SOCKET_DIR = "/var/run/rlenergy"
"""The chart's default ``agent.socketDir`` (helm/rl-energy/values.yaml)."""


def _blocks() -> Iterator[tuple[str, Any]]:
    """(where, parsed YAML document) of every block and file users copy from."""
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for i, block in enumerate(re.findall(r"```ya?ml\n(.*?)```", page.read_text(), re.S)):
            try:
                docs = list(yaml.safe_load_all(block))
            except yaml.YAMLError:
                continue  # a block with placeholders: no pod spec to copy as is
            for doc in docs:
                yield f"{page.relative_to(ROOT)} block {i}", doc
    for folder in (ROOT / "docs" / "examples", ROOT / "deploy"):
        for path in sorted([*folder.rglob("*.yaml"), *folder.rglob("*.yml")]):
            for doc in yaml.safe_load_all(path.read_text()):
                yield str(path.relative_to(ROOT)), doc


def _pod_specs(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list) and isinstance(node.get("volumes"), list):
            yield node
        for value in node.values():
            yield from _pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _pod_specs(value)


def _in_socket_dir(path: str) -> bool:
    clean = posixpath.normpath("/" + path.lstrip("/"))
    return clean == SOCKET_DIR or clean.startswith(SOCKET_DIR + "/")


def writable_socket_mounts(spec: dict[str, Any]) -> list[str]:
    """``container/volume`` of each writable mount of a socket-folder hostPath in ``spec``."""
    socket_volumes = {
        v.get("name")
        for v in spec["volumes"]
        if isinstance(v, dict)
        and _in_socket_dir(str((v.get("hostPath") or {}).get("path", "")))
        and "hostPath" in v
    }
    bad = []
    for c in [*spec["containers"], *(spec.get("initContainers") or [])]:
        for m in c.get("volumeMounts") or []:
            if m.get("name") in socket_volumes and m.get("readOnly") is not True:
                bad.append(f"{c.get('name')}/{m.get('name')}")
    return bad


def test_every_shown_pod_spec_mounts_the_socket_folder_read_only() -> None:
    checked: set[str] = set()
    for where, doc in _blocks():
        for spec in _pod_specs(doc):
            if not any(
                _in_socket_dir(str((v.get("hostPath") or {}).get("path", "")))
                for v in spec["volumes"]
                if isinstance(v, dict) and "hostPath" in v
            ):
                continue
            checked.add(where.split(" block ")[0])
            assert writable_socket_mounts(spec) == [], f"{where}: mount it with readOnly: true"
    assert {"docs/verl.md", "docs/operations.md"} <= checked, checked


@pytest.mark.parametrize("path", [SOCKET_DIR, "/var/run//rlenergy/", f"{SOCKET_DIR}/agent.sock"])
def test_the_checker_sees_a_writable_mount(path: str) -> None:
    spec = {
        "containers": [{"name": "t", "volumeMounts": [{"name": "s", "mountPath": "/x"}]}],
        "initContainers": [
            {"name": "i", "volumeMounts": [{"name": "s", "mountPath": "/x", "readOnly": True}]}
        ],
        "volumes": [{"name": "s", "hostPath": {"path": path}}],
    }
    assert writable_socket_mounts(spec) == ["t/s"]
    spec["containers"][0]["volumeMounts"][0]["readOnly"] = True
    assert writable_socket_mounts(spec) == []
    spec["volumes"][0]["hostPath"]["path"] = "/var/run/rlenergy-engines"
    spec["containers"][0]["volumeMounts"][0]["readOnly"] = False
    assert writable_socket_mounts(spec) == []
