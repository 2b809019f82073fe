"""Run a bench script as users run it (a subprocess with its worker processes), for its tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def run_bench(script: str, *args: str) -> tuple[list[dict[str, Any]], str]:
    """``python bench/<script> <args> --json``: (its rows, its stderr); stdout is the JSON alone."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(res.stdout)["rows"], res.stderr
