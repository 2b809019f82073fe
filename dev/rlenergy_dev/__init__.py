"""Development-only tooling: the dev cluster, the stand-in NVML and the test harnesses.

Lives in the repository's ``dev/`` folder, outside the shipped wheel: ``pip install -e .``
puts ``dev/`` on the path (``dev-mode-dirs`` in ``pyproject.toml``) and pytest's
``pythonpath`` does the same for the tests. Nothing the product ships imports it (the
import-linter contracts in ``pyproject.toml``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
"""The repository checkout this package runs from (``dev/rlenergy_dev`` -> the root)."""
SOURCE_DIRS = (CHECKOUT / "dev", CHECKOUT, CHECKOUT / "agent", CHECKOUT / "operator")
"""The folders that hold ``rlenergy_dev``, ``rlenergy``, ``rlenergy_agent`` and the operator's
packages in a checkout: the editable install's ``dev-mode-dirs``, in the same order."""


def project_version() -> str:
    """``project.version`` of the checkout's ``pyproject.toml``: the one version source.

    The chart's version, appVersion and image tags, the image build's tag
    (``hack/images/build.py``) and the installed ``rlenergy.__version__`` are checked against it
    (``tests/unit/test_version.py``).
    """
    with (CHECKOUT / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def source_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this checkout's source folders first on ``PYTHONPATH``.

    A child Python (the dev cluster's supervisor, a verl rank) then imports the same code as
    the process that starts it, whichever install its interpreter has.
    """
    paths = [str(p) for p in SOURCE_DIRS]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}
