"""``bench/energy.py`` (``make bench-energy``): one row per seed, the summary over every row.

Run as users run it (a subprocess, its worker processes included) on a short job: two seeds x
the first family's two GPUs, 6 steps, sync.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TRACE = "tinyzero-ppo-qwen25-05b-countdown-rtx4090"


def test_each_seed_is_a_row_and_the_summary_counts_every_row() -> None:
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "energy.py"),
            "--traces",
            TRACE,
            "--family",
            "first",
            "--modes",
            "sync",
            "--steps",
            "6",
            "--seeds",
            "0,1",
            "--jobs",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = json.loads(res.stdout)["rows"]  # stdout is the JSON alone
    assert sorted((r["gpu"], r["seed"]) for r in rows) == [
        ("b200", 0),
        ("b200", 1),
        ("h100-sxm", 0),
        ("h100-sxm", 1),
    ]
    by_seed = {(r["gpu"], r["seed"]): r for r in rows}
    # Each seed is its own noise draw: the same job measures differently.
    assert by_seed[("b200", 0)]["online_saving"] != by_seed[("b200", 1)]["online_saving"]
    for r in rows:
        assert r["threshold_margin"] == r["phase_throughput_margin"]  # sync: the lowest phase
    kept = sum(r["threshold_margin"] >= 0 for r in rows)
    line = re.search(r"threshold kept \(.*?\) on (\d+) of (\d+) rows", res.stderr)
    assert line is not None, res.stderr
    assert (int(line[1]), int(line[2])) == (kept, 4)
    assert "seed" in res.stderr.splitlines()[-1]  # the worst row names its seed
