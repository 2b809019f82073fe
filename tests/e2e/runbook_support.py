"""docs/install.md's runbook as data: the commands of each numbered step and of the uninstall.

``runbook(text)`` reads the page the way a person copying it would: the section "On a GPU
cluster (Helm)", its steps ``**N.**`` in order, each step's fenced ``sh`` blocks (continuation
lines joined, comment lines and trailing comments dropped; where a block offers alternatives
after a ``# or ...`` comment line, only the first is taken) and the ``text`` block that follows
a command as its expected output; then the ``sh`` blocks of the section "Uninstall".

Used by ``tests/e2e/test_runbook.py`` (runs them) and ``tests/unit/docs/test_runbook_page.py``
(reads them).
"""

from __future__ import annotations

import dataclasses
import re

INSTALL_SECTION = "## On a GPU cluster (Helm)"
UNINSTALL_SECTION = "## Uninstall"


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the runbook.

    Attributes:
        name: ``"1"``... for the numbered steps, ``"uninstall"``.
        commands: the shell commands, in order, each one line.
        expected: command -> the ``text`` block the page shows as its output.
    """

    name: str
    commands: tuple[str, ...]
    expected: dict[str, str]


def section(text: str, heading: str) -> str:
    """The text of ``heading``'s section (up to the next ``## `` heading).

    Raises:
        ValueError: the page has no such heading.
    """
    start = text.index(heading + "\n") + len(heading) + 1
    nxt = text.find("\n## ", start)
    return text[start : nxt if nxt >= 0 else len(text)]


def block_commands(block: str) -> list[str]:
    """The commands of one ``sh`` block: continuations joined, comments dropped, first
    alternative only."""
    out: list[str] = []
    for raw in block.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if line.startswith("# or"):
            break
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(re.sub(r"\s+", " ", line))
    return out


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.M | re.S)


def _step(name: str, body: str) -> Step:
    commands: list[str] = []
    expected: dict[str, str] = {}
    for m in _FENCE.finditer(body):
        lang, content = m.group(1), m.group(2)
        if lang in ("sh", "bash", "shell"):
            commands += block_commands(content)
        elif lang == "text" and commands:
            expected[commands[-1]] = content.rstrip("\n")
    return Step(name, tuple(commands), expected)


def runbook(text: str) -> list[Step]:
    """The numbered steps of the install section, then the uninstall, as a person runs them."""
    install = section(text, INSTALL_SECTION)
    parts = re.split(r"^\*\*(\d+)\.\*\*", install, flags=re.M)
    steps = [_step(parts[i], parts[i + 1]) for i in range(1, len(parts) - 1, 2)]
    steps.append(_step("uninstall", section(text, UNINSTALL_SECTION)))
    return steps


def shape(output: str) -> list[list[str]]:
    """What of a smoke output must match the page's: per line its first two words (the first
    line: five), which say ``ok``/``MISSING`` and what; the numbers after them vary."""
    lines = [ln.split() for ln in output.strip().splitlines() if ln.strip()]
    return [words[: 5 if i == 0 else 2] for i, words in enumerate(lines)]
