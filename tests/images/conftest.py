"""The image smoke tests run only when asked for: ``pytest -m images tests/images``.

``make test`` and ``make unit`` never collect this folder (the images take minutes to build and
need root): the module is ignored unless the ``-m`` expression selects the ``images`` marker.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Ignore tests/images unless ``-m`` selects ``images``."""
    expr = config.getoption("markexpr") or ""
    if re.search(r"(?<!not )\bimages\b", expr):
        return None
    return collection_path.name.startswith("test_")
