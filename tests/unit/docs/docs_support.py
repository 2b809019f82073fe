"""Shared helpers of the docs tests: the pages, the generator and the chart rendered by helm.

The chart is rendered with the pinned helm from the control-plane bin dir (``make bins``) through
``tests/e2e/chart_support.py``; ``NOTES.txt``, which ``helm template`` does not print, is rendered
from a copy of the chart with one extra template that includes it into a ConfigMap.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from tests.e2e.chart_support import CHART, helm

ROOT = Path(__file__).resolve().parents[3]
RELEASE = "rl-energy"
NAMESPACE = "rl-energy-system"
KUBE = "1.36.3"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [*DOCS, ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
"""Every Markdown page a user reads: the docs site, the README and CONTRIBUTING."""


def load_docgen() -> ModuleType:
    """``hack/docgen.py`` as a module (it is a script, not a package)."""
    name = "rlenergy_hack_docgen"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "hack" / "docgen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def render(*args: str, release: str = RELEASE, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """The documents ``helm template`` renders for ``release`` in ``namespace``."""
    out = helm(
        "template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE, *args
    )
    return [d for d in yaml.safe_load_all(out) if d]


_NOTES_TEMPLATE = """apiVersion: v1
kind: ConfigMap
metadata: {name: rendered-notes}
data:
  notes: {{ include "rl-energy/templates/NOTES.txt" . | toJson }}
"""


def render_notes(*args: str, release: str = RELEASE, namespace: str = NAMESPACE) -> str:
    """The text ``helm install`` prints from ``NOTES.txt`` for these values."""
    with tempfile.TemporaryDirectory(prefix="rlenergy-notes-") as tmp:
        chart = Path(tmp) / "rl-energy"
        shutil.copytree(CHART, chart)
        (chart / "templates" / "zz-rendered-notes.yaml").write_text(_NOTES_TEMPLATE)
        out = helm(
            "template", release, str(chart), "--namespace", namespace, "--kube-version", KUBE,
            "--show-only", "templates/zz-rendered-notes.yaml", *args,
        )  # fmt: skip
    return str(yaml.safe_load(out)["data"]["notes"])


def shell_blocks(text: str) -> list[str]:
    """The fenced ``sh`` blocks of a page, each with its continuation lines joined."""
    blocks = re.findall(r"^```(?:sh|bash|shell)\n(.*?)^```", text, flags=re.M | re.S)
    return [b.replace("\\\n", " ") for b in blocks]


def commands(text: str) -> list[str]:
    """Every command of a page's or NOTES' text: shell blocks, indented lines, inline code."""
    lines: list[str] = []
    for block in shell_blocks(text):
        lines += block.splitlines()
    joined = text.replace("\\\n", " ")
    lines += [
        ln for ln in joined.splitlines()
        if ln.startswith("  ") and ln.strip().split(" ")[0] in ("kubectl", "helm")
    ]  # fmt: skip
    lines += [
        m for m in re.findall(r"`([^`]+)`", text.replace("\n", " "))
        if m.split(" ")[0] in ("kubectl", "helm")
    ]  # fmt: skip
    return [re.sub(r"\s+#.*$", "", ln).strip() for ln in lines if ln.strip()]
