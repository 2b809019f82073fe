"""The trainer SDK ships in the package's core install: the wheel of ``pip wheel .`` installs
with pydantic and pyyaml only, and the SDK's modules import with nothing else loaded: what a
verl image gets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ALLOWED = {
    "rl_energy_operator",
    "pydantic",
    "pydantic_core",
    "typing_extensions",
    "annotated_types",
    "typing_inspection",
    "pyyaml",
}
# prometheus_client: imported only once an engine's metrics are read (it is in every engine image).
FORBIDDEN = {
    "numpy",
    "matplotlib",
    "rich",
    "cryptography",
    "kubernetes",
    "yaml",
    "torch",
    "verl",
    "prometheus_client",
}

PROBE = """
import json, sys
import rlenergy.sdk.trainer, rlenergy.sdk.verl, rlenergy.sdk.verl_hook
import rlenergy.sdk.progress, rlenergy.sdk.pod_engines  # the hook's progress sources
import rlenergy.sdk.annotate  # phaseSource annotation
hook = rlenergy.sdk.verl_hook
w = hook.TrainedBatch(samples=2, aborted_samples=1, valid_tokens=7.0, response_tokens=9.0,
                      prompt_tokens=4.0)
hook.install()  # no verl here: logs and returns
print(json.dumps({"modules": sorted({m.split(".")[0] for m in sys.modules}),
                  "metrics": w.metrics()}))
"""


@pytest.mark.slow
def test_core_install_carries_the_sdk_and_imports_only_pydantic(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(wheels)],
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("rl_energy_operator-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=600,
    )
    dists = {p.name.split("-")[0].lower() for p in target.glob("*.dist-info")}
    assert dists <= ALLOWED, f"the core install pulled {sorted(dists - ALLOWED)}"
    # -S: no site-packages of this venv; -I: no PYTHONPATH, no cwd. Only the stdlib + target.
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(target)!r})\n{PROBE}",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not FORBIDDEN & set(result["modules"]), sorted(FORBIDDEN & set(result["modules"]))
    assert result["metrics"]["rlenergy/valid_tokens"] == 7.0
    assert result["metrics"]["rlenergy/aborted_samples"] == 1.0
