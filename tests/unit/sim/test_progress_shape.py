"""The simulator's reported-progress model (``workload.reported_progress``)."""

from __future__ import annotations

import pytest

from rlenergy.sim import workload


@pytest.mark.parametrize("k", [1.0, 1.2, 1.48, 2.0])
def test_progress_runs_from_0_to_1_and_its_rate_rises_to_k_times_its_start(k: float) -> None:
    f = workload.reported_progress
    assert f(0.0, k) == 0.0 and f(1.0, k) == pytest.approx(1.0)
    assert f(-0.5, k) == 0.0 and f(1.5, k) == pytest.approx(1.0)
    h = 1e-6
    start, end = f(h, k) / h, (f(1.0, k) - f(1.0 - h, k)) / h
    assert end / start == pytest.approx(k, rel=1e-4)  # bounded at the end, never a halt
    xs = [i / 100 for i in range(101)]
    rates = [(f(b, k) - f(a, k)) / (b - a) for a, b in zip(xs, xs[1:], strict=False)]
    assert all(r2 >= r1 - 1e-12 for r1, r2 in zip(rates, rates[1:], strict=False))
