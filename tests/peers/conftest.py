"""Tests of the real Zeus peer run only when asked for: ``pytest -m peers tests/peers``.

Zeus (the ``peers`` extra) pulls pandas and scikit-learn, so ``make test`` does not install it
and never collects this folder; ``make test-peers`` installs the extra and runs it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Ignore tests/peers unless ``-m`` selects ``peers``."""
    expr = config.getoption("markexpr") or ""
    if re.search(r"(?<!not )\bpeers\b", expr):
        return None
    return collection_path.name.startswith("test_")
