"""The pinned helm and promtool without a cluster: ``helm template``/``lint``/``dependency``
and ``promtool`` runs for chart and rule tests that need no API server.

Both come from the control-plane bin dir (``make bins``); a missing one fails with the command
that fetches it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from rlenergy_dev.devcluster.binaries import default_bin_dir

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rl-energy"
_HELM_HOME = Path(tempfile.gettempdir()) / f"rlenergy-chart-tests-{os.getuid()}"


def tool(name: str) -> Path:
    """``name`` in the control-plane bin dir; fails the test with the fix when it is missing."""
    path = default_bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"{name} not found at {path}: run `make bins` (hack/controlplane-bins.sh builds "
            "helm; hack/prometheus-bin.sh extracts prometheus and promtool from Debian's "
            "prometheus package)",
            pytrace=False,
        )
    return path


def run(name: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``name`` (helm dirs in a private temp folder, never the user's); no check."""
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(_HELM_HOME / var.lower())
    return subprocess.run(
        [str(tool(name)), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def helm(*args: str) -> str:
    """``helm <args>``' stdout; a failure fails the test with helm's stderr."""
    res = run("helm", *args)
    assert res.returncode == 0, f"helm {' '.join(args)}:\n{res.stderr}"
    return res.stdout


def template(*args: str, chart: Path = CHART) -> list[dict[str, Any]]:
    """The documents ``helm template rl <chart> -n rl-energy-system <args>`` renders."""
    out = helm("template", "rl", str(chart), "--namespace", "rl-energy-system", *args)
    return [d for d in yaml.safe_load_all(out) if d]
