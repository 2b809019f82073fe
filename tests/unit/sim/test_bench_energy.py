"""``bench/energy.py`` (``make bench-energy``): one row per seed, the summary over every row.

Run as users run it (a subprocess, its worker processes included) on a short job: two seeds x
the first family's two GPUs, 6 steps, sync.
"""

from __future__ import annotations

import re

from benchrun import run_bench

TRACE = "tinyzero-ppo-qwen25-05b-countdown-rtx4090"


def test_each_seed_is_a_row_and_the_summary_counts_every_row() -> None:
    rows, stderr = run_bench(
        "energy.py",
        *("--traces", TRACE, "--family", "first", "--modes", "sync", "--steps", "6"),
        *("--seeds", "0,1", "--jobs", "2"),
    )
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
    line = re.search(r"threshold kept \(.*?\) on (\d+) of (\d+) rows", stderr)
    assert line is not None, stderr
    assert (int(line[1]), int(line[2])) == (kept, 4)
    assert "seed" in stderr.splitlines()[-1]  # the worst row names its seed
    # The ceiling lines: per margin, the worst row's ratio and the rows below 0.95.
    for margin in ("0.002", "0.005"):
        ratios = [r["ceiling"][margin] for r in rows]
        assert all(0.0 <= x <= 1.0 + 1e-9 for x in ratios), ratios
        line = re.search(
            rf"first family: ceiling, the oracle held {margin} above every threshold .*?: "
            rf"worst ([0-9.]+) .*?, below 0.95 on (\d+) of 4 rows",
            stderr,
        )
        assert line is not None, stderr
        assert float(line[1]) == round(min(ratios), 3)
        assert int(line[2]) == sum(x < 0.95 for x in ratios)
