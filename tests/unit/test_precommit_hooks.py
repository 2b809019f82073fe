"""The commit hooks (.pre-commit-config.yaml) run the venv's own linters and drift checks."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import rlenergy_dev
import yaml

ROOT = Path(__file__).resolve().parents[2]
HOOKS = {"ruff", "ruff-format", "import-linter", "mypy", "crd-drift", "docs-drift"}


def _hooks() -> dict[str, dict[str, object]]:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    return {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}


def test_every_habit_has_a_hook_on_the_venvs_tools() -> None:
    hooks = _hooks()
    assert set(hooks) == HOOKS
    venv_bin = Path(sys.executable).parent
    for hook_id, hook in hooks.items():
        argv = shlex.split(str(hook["entry"]))
        tool = argv[0] if argv[0] != "bash" else shlex.split(argv[2])[0]
        assert tool.startswith(".venv/bin/"), (hook_id, tool)
        assert (venv_bin / tool.removeprefix(".venv/bin/")).exists(), (hook_id, tool)


def test_the_crd_drift_hook_catches_a_stale_chart_copy(tmp_path: Path) -> None:
    hook = _hooks()["crd-drift"]
    argv = shlex.split(str(hook["entry"]).replace(".venv/bin/python", sys.executable))
    tree = tmp_path / "tree"
    for part in ("crds", "helm/rl-energy/crds", "docs/reference"):
        (tree / part).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-r", str(ROOT / part), str(tree / part)], check=True)
    env = rlenergy_dev.source_env(os.environ)  # this checkout's rlenergy.api
    clean = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    (tree / "helm/rl-energy/crds/rlenergy.io_rlenergypolicies.yaml").write_text("stale: true\n")
    stale = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert stale.returncode == 1
    assert "helm/rl-energy/crds/rlenergy.io_rlenergypolicies.yaml differs" in stale.stdout
