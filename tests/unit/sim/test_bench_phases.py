"""``bench/phases.py`` (``make bench-phases``): what naming verl's sub-phases adds, run as users do.

A subprocess with its worker processes, on a short job: one trace that logs three training
sub-phases, the first family's two GPUs, 8 steps.
"""

from __future__ import annotations

import re

from benchrun import run_bench

TRACE = "verl-grpo-deepseek7b-mi300-8gpu"


def test_each_row_runs_three_ways_and_the_summary_counts_them() -> None:
    rows, stderr = run_bench(
        "phases.py",
        *("--traces", f"{TRACE},tinyzero-ppo-qwen25-05b-countdown-rtx4090", "--family", "first"),
        *("--steps", "8", "--jobs", "2"),
    )
    # TinyZero's sub-phases last well under the 1.2 s a full trial step probes: no row.
    assert sorted(r["gpu"] for r in rows) == ["b200", "h100-sxm"]
    assert "tinyzero-ppo-qwen25-05b-countdown-rtx4090 b200: no sub-phase" in stderr
    for r in rows:
        assert r["subphases"] == ["old-log-prob", "ref", "update-actor"]
        assert set(r["two"]["clocks"]) == {"generation", "training"}
        assert set(r["fine"]["clocks"]) == {"generation", *r["subphases"]}
        assert r["fine_minus_two_pp"] == 100.0 * (
            r["fine"]["online_saving"] - r["two"]["online_saving"]
        )
    # The first family draws the same idle power locked or not: the idle lock changes nothing.
    assert all(r["idle_minus_fine_pp"] == 0.0 for r in rows)
    line = re.search(
        r"first family \((\d+) rows\): every phase's threshold kept on two (\d+)", stderr
    )
    assert line is not None, stderr
    assert int(line[1]) == 2
    assert int(line[2]) == sum(r["two"]["phase_margin"] >= 0 for r in rows)
