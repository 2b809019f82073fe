"""Load ``invalid_specs.yaml`` (shared with the e2e admission test)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

INVALID_SPECS = Path(__file__).resolve().parent / "invalid_specs.yaml"


def invalid_cases() -> list[dict[str, Any]]:
    """Each case with ``doc``: the full spec (base with the case's keys replaced)."""
    data = yaml.safe_load(INVALID_SPECS.read_text())
    out = []
    for case in data["cases"]:
        spec = copy.deepcopy(data["base"])
        for key, value in case["spec"].items():
            if value is None:
                spec.pop(key, None)
            else:
                spec[key] = value
        out.append({**case, "doc": spec})
    return out
