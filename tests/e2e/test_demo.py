"""``make demo`` as a user runs it, shortened to 6 steps: the verl ranks, the agents, the truth.

``rlenergy_dev.demo.main``: its own dev cluster, ``helm install``, the operator and 3
node agents on the stand-in NVML, 3 verl ranks (``.venv-verl``: verl 0.9.1's real methods
and its default v1 trainer, real TransferQueue on a local Ray per rank, through
``rlenergy.sdk.verl_hook.install``). What the user reads must hold: every step in the
policy status (the demo waits for it), each phase window's measured energy within 1 % of the
simulator's truth, the ``rlenergy/*`` keys in verl's metrics dict, the plot written, no GPU
left locked once the policy is deleted.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rlenergy_dev import demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 6


def test_demo_runs_verl_ranks_and_measures_the_truth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "demo.png"
    assert demo.main(["--steps", str(STEPS), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    error = re.search(r"(\d+) phase windows: max \|error\| ([\d.]+) %", out)
    assert error, out[-3000:]
    assert int(error.group(1)) == 3 * 2 * STEPS, out[-3000:]  # 3 nodes x 2 phases x steps
    assert float(error.group(2)) < 1.0, out[-3000:]
    metrics = re.search(r"verl's metrics dict, last step of a rank: (.*)", out)
    assert metrics, out[-3000:]
    values = dict(kv.split("=") for kv in metrics.group(1).split(", "))
    for key in (
        "rlenergy/valid_tokens",
        "rlenergy/generated_tokens",
        "rlenergy/energy/generation_j",
        "rlenergy/energy/training_j",
        "rlenergy/energy_per_valid_token_j",
    ):
        assert float(values[key]) > 0, (key, values)
    assert values["rlenergy/aborted_samples"] == "1", values
    assert "GPUs still locked: 0" in out, out[-3000:]
    assert plot.stat().st_size > 0
