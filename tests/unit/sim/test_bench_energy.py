"""``bench/energy.py`` (``make bench-energy``): one row per seed, the summary over every row.

Run as users run it (a subprocess, its worker processes included) on short jobs: two seeds x
the first family's two GPUs, 6 steps, sync; and one seed at two run lengths, both modes.

We test these aspects:

* each seed is its own row and the summary counts every row, with the ceiling lines;
* per run length, the yardstick line: online over the LOCK_MARGIN-held oracle, its target for
  that length, the learning cost's median and parts, and the rows that kept their threshold,
  each figure the rows' own.
"""

from __future__ import annotations

import re
import statistics

import pytest
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
            rf"first family, 6 steps: ceiling, the oracle held {margin} above every threshold .*?: "
            rf"worst ([0-9.]+) .*?, below 0.95 on (\d+) of 4 rows",
            stderr,
        )
        assert line is not None, stderr
        assert float(line[1]) == round(min(ratios), 3)
        assert int(line[2]) == sum(x < 0.95 for x in ratios)


def test_each_length_has_its_yardstick_line_with_its_target() -> None:
    rows, stderr = run_bench(
        "energy.py",
        *("--traces", TRACE, "--family", "first", "--steps", "6,12"),
        *("--seeds", "0", "--jobs", "2"),
    )
    assert sorted({r["steps"] for r in rows}) == [6, 12]
    for steps in (6, 12):
        group = [r for r in rows if r["steps"] == steps]
        assert len(group) == 4  # two GPUs x sync, async
        for r in group:
            gap_pp = 100.0 * (r["held_saving"] - r["online_saving"])
            assert sum(r["learning_cost_pp"].values()) == pytest.approx(gap_pp, abs=1e-9)
            assert r["threshold_kept"] == (r["threshold_margin"] >= 0)
        line = re.search(
            rf"first family, {steps} steps: online / oracle held 0.002 above every threshold: "
            r"worst ([-0-9.]+) .*?, mean ([-0-9.]+), below 0.90 on (\d+) of 4 rows "
            r"\(target >= 0.90 on every row\); learning cost, pp of the job's energy: median "
            r"([-0-9.]+), .*?\(medians: warm-up ([-0-9.]+), .*; threshold kept over the whole "
            r"run on (\d+) of 4 rows",
            stderr,
        )
        assert line is not None, stderr
        ratios = [r["online_to_ceiling"] for r in group]
        assert float(line[1]) == round(min(ratios), 3)
        assert float(line[2]) == round(statistics.fmean(ratios), 3)
        assert int(line[3]) == sum(x < 0.90 for x in ratios)
        costs = [sum(r["learning_cost_pp"].values()) for r in group]
        assert float(line[4]) == round(statistics.median(costs), 2)
        warm = [r["learning_cost_pp"]["warm-up"] for r in group]
        assert float(line[5]) == round(statistics.median(warm), 2)
        assert int(line[6]) == sum(r["threshold_kept"] for r in group)
