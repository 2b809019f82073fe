"""verl tests (``make test-verl``): the pinned verl from PyPI in ``.venv-verl``, never mocked.

They reuse the agent unit tests' stand-in NVML fixtures (a real node agent behind the real
Unix-socket server). Run in the main venv, they fail with the command that builds theirs.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "agent"))

_VERL = importlib.util.find_spec("verl")
if _VERL is None or _VERL.origin is None:  # no origin: this folder itself (a namespace package)
    pytest.exit(
        "tests/verl need the pinned verl: run them with `make test-verl` (it builds .venv-verl)",
        returncode=4,
    )

_spec = importlib.util.spec_from_file_location(
    "agent_unit_conftest", Path(__file__).resolve().parents[1] / "unit" / "agent" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_agent_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_agent_conftest)
make_driver = _agent_conftest.make_driver
short_tmp = _agent_conftest.short_tmp
standin_lib = _agent_conftest.standin_lib

__all__ = ["make_driver", "short_tmp", "standin_lib"]

# verl and Ray warn at import (optional engines missing: megatron, mindspeed...; Ray's
# deprecated state-API path) and torch on its nested tensors: third-party noise that the
# project's warnings-are-errors setting must not turn into failures of these tests.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import verl.trainer.main_ppo  # noqa: F401
    import verl.trainer.ppo.ray_trainer  # noqa: F401
    import verl.workers.engine_workers  # noqa: F401


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for category in ("UserWarning", "DeprecationWarning", "FutureWarning"):
            item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}"))
