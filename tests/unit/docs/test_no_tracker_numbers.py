"""Code, docs and test names say what is true now: no tracker or field-case-list numbers.

A reference such as ``issue 19``, ``issue #16``, ``issues 20`` or ``case #14`` points at a list a
reader of the repository does not have; the history those numbers stand for lives in
CHANGELOG.md, the one file allowed to hold them. Citations of other projects
(``NVIDIA/dcgm-exporter#509``, ``verl-project/verl #658``, ``vllm-project/vllm PR #52702``) stay:
they name the project they point into.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ALLOWED = {"CHANGELOG.md", "tests/unit/docs/test_no_tracker_numbers.py"}
"""Files allowed to hold tracker numbers: the history, and this test's own examples."""

SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ".ini", ".tpl", ""}
"""File kinds scanned (``""``: Makefile, Dockerfile); data files (csv, json) hold quotations."""

REFERENCE = re.compile(
    r"\b(?:issues?\s*#?\s*\d+|cases?(?:\.md)?\s*#\s*\d+|field\s+cases?\s+#?\d+)", re.I
)
"""``issue 19``, ``issue #16``, ``issues 20``, ``case #14``, ``cases #8``, ``CASES.md #29``,
``field case 16``."""

UPSTREAM = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+\s+$")
"""Text right before a match that names another project (``owner/repo issue #3727``)."""


def references(text: str) -> list[str]:
    """The tracker or case-list references in ``text``, upstream citations left out."""
    found = []
    for match in REFERENCE.finditer(text):
        before = text[max(0, match.start() - 100) : match.start()].split("\n")[-1]
        if not UPSTREAM.search(before):
            found.append(match.group(0))
    return found


def tracked_files() -> list[Path]:
    """The files git tracks in this checkout, scanned kinds only."""
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    paths = [ROOT / p for p in out.split("\0") if p]
    return [
        p
        for p in paths
        if p.suffix in SUFFIXES and p.is_file() and str(p.relative_to(ROOT)) not in ALLOWED
    ]


def test_the_pattern_finds_tracker_numbers_and_spares_upstream_citations() -> None:
    assert references("see issue 19 and issue #16, issues 20; field case #9, cases #8, #13") == [
        "issue 19",
        "issue #16",
        "issues 20",
        "field case #9",
        "cases #8",
    ]
    assert references("Case #29 in docs; CASES.md #26") == ["Case #29", "CASES.md #26"]
    assert references("NVIDIA/dcgm-exporter#509; vllm-project/vllm PR #52702") == []
    assert references("verl-project/verl issue #3727; kubernetes/kubernetes #119423") == []


def test_no_tracker_or_case_numbers_outside_the_changelog() -> None:
    hits = []
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            hits += [f"{path.relative_to(ROOT)}:{number}: {ref}" for ref in references(line)]
    assert hits == [], "say what is true now and why instead:\n" + "\n".join(hits)
