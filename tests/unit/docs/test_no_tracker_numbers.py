"""Code, docs and test names say what is true now: no tracker or field-case-list numbers.

A reference made of the word issue or case and a number points at a list a reader of the
repository does not have; the history those numbers stand for lives in CHANGELOG.md, the one
file allowed to hold them. Citations of other projects (``NVIDIA/dcgm-exporter#509``,
``verl-project/verl #658``, ``vllm-project/vllm PR #52702``) stay: they name the project they
point into. The examples below are assembled from parts so that this file passes its own scan.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ALLOWED = {"CHANGELOG.md"}
"""Files allowed to hold tracker numbers: the history."""

SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ".ini", ".tpl", ""}
"""File kinds scanned (``""``: Makefile, Dockerfile); data files (csv, json) hold quotations."""

ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.I)
"""The word issue (or issues), an optional ``#`` and a number."""

CASE = re.compile(r"\b(?:cases?(?:\.md)?\s*#\s*\d+|field\s+cases?\s+#?\d+)", re.I)
"""The word case (or cases, or the case list's file name) with ``#`` and a number, or field case
and a number: always the project's own case list, never another project's."""

UPSTREAM = re.compile(r"(?<![\w./-])[A-Za-z0-9_-][A-Za-z0-9_.-]*/[A-Za-z0-9_-][A-Za-z0-9_.-]*\s+$")
"""An ``owner/repo`` right before a match: the issue is another project's."""

FILE_PATH = re.compile(r"\.(?:md|py|ya?ml|toml|txt|sh|json|csv)\s+$")
"""A file path right before a match is not a project name (``docs/x.md`` then the number)."""

ISS, CAS = "iss" + "ue", "ca" + "se"
"""The two words, split so that the examples below hold no reference themselves."""


def references(text: str) -> list[str]:
    """The tracker or case-list references in ``text``, upstream issue citations left out."""
    found = [m.group(0) for m in CASE.finditer(text)]
    for match in ISSUE.finditer(text):
        before = text[max(0, match.start() - 100) : match.start()].split("\n")[-1]
        if not UPSTREAM.search(before) or FILE_PATH.search(before):
            found.append(match.group(0))
    return sorted(found, key=text.index)


def tracked_files() -> list[Path]:
    """The files git tracks in this checkout, scanned kinds only, CHANGELOG.md left out."""
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    paths = [ROOT / p for p in out.split("\0") if p]
    return [p for p in paths if p.suffix in SUFFIXES and p.is_file() and p.name not in ALLOWED]


def test_the_pattern_finds_tracker_numbers() -> None:
    text = f"see {ISS} 19 and {ISS} #16, {ISS}s 20; field {CAS} #9, {CAS}s #8, #13"
    assert references(text) == [
        f"{ISS} 19",
        f"{ISS} #16",
        f"{ISS}s 20",
        f"field {CAS} #9",
        f"{CAS}s #8",
    ]
    assert references(f"{CAS.title()} #29 in docs; {CAS.upper()}S.md #26") == [
        f"{CAS.title()} #29",
        f"{CAS.upper()}S.md #26",
    ]
    assert references(f"docs/troubleshooting.md {CAS} #4") == [f"{CAS} #4"]
    assert references(f"docs/troubleshooting.md {ISS} 4") == [f"{ISS} 4"]


def test_the_pattern_spares_upstream_citations() -> None:
    assert references("NVIDIA/dcgm-exporter#509; vllm-project/vllm PR #52702") == []
    assert references(f"verl-project/verl {ISS} #3727; kubernetes/kubernetes #119423") == []


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
