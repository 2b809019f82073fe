"""`make help` lists every declared target with the `##` comment written above it.

Every name in the Makefile's ``.PHONY`` lines must have a rule and a ``##`` comment (CONTRIBUTING.md
tells contributors to run ``make help`` first), and the printed description is that comment.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()


def _phony() -> list[str]:
    names: list[str] = []
    for line in re.findall(r"^\.PHONY:(.*)$", MAKEFILE, re.M):
        names += line.split()
    return names


def _help() -> dict[str, list[str]]:
    make = shutil.which("make")
    assert make, "make not found"
    out = subprocess.run(
        [make, "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
    ).stdout
    entries: dict[str, list[str]] = {}
    current = ""
    for line in out.splitlines():
        m = re.match(r"^make (\S+)\s+(.*)$", line)
        if m:
            current = m.group(1)
            entries[current] = [m.group(2)]
        else:
            entries[current].append(line.strip())
    return entries


def test_every_declared_target_is_listed_with_its_comment() -> None:
    entries = _help()
    phony = _phony()
    assert "help" in phony
    missing = [t for t in phony if t not in entries]
    assert not missing, f"targets without a `##` comment right above their rule: {missing}"
    for target in phony:
        block = re.search(
            rf"((?:^## .*\n)+)(?:(?:ifeq|else|endif).*\n)*^{re.escape(target)}:", MAKEFILE, re.M
        )
        assert block, target
        comment = [ln[3:] for ln in block.group(1).splitlines()]
        assert entries[target] == comment, target


def test_only_targets_are_listed() -> None:
    rules = set(re.findall(r"^([a-z][a-z0-9-]*):(?!=)", MAKEFILE, re.M))
    assert set(_help()) <= rules
