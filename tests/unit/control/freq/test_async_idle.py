"""``base.async_default_idle_j``: an async step's idle energy under the default governor.

Two pools of 4 GPUs each wait for the slower at their own idle power; the default governor runs
each phase faster by its own ratio, so each pool's wait changes. Figures are written out from
the docstring's rule: extra idle = per-GPU idle power x GPUs x ((T_d - t_d) - (T - t)).
"""

from __future__ import annotations

import pytest

from rlenergy.control.freq import base


def test_a_pool_that_waits_longer_under_the_default_adds_its_idle() -> None:
    # Generation 10 s locked (8 s default) waits 2 s for training's 12 s (11 s default): under
    # the default governor it would wait 3 s, at the 100 W per GPU it measured.
    pools = {
        "generation": base.PoolIdle(energy_j=800.0, gpu_seconds=8.0, gpus=4),
        "training": base.PoolIdle(energy_j=0.0, gpu_seconds=0.0, gpus=4),
    }
    times = {"generation": (10.0, 8.0), "training": (12.0, 11.0)}
    assert base.async_default_idle_j(800.0, pools, times) == pytest.approx(800.0 + 100.0 * 4)


def test_a_pool_that_never_idled_takes_the_others_idle_power() -> None:
    # Generation 12 s locked (9 s default) is the slower pool measured; under the default
    # training (10.5 s) is: generation would wait 1.5 s (its power unknown: training's 120 W),
    # training 1 s less.
    pools = {
        "generation": base.PoolIdle(energy_j=0.0, gpu_seconds=0.0, gpus=4),
        "training": base.PoolIdle(energy_j=480.0, gpu_seconds=4.0, gpus=4),
    }
    times = {"generation": (12.0, 9.0), "training": (11.0, 10.5)}
    want = 480.0 + 120.0 * 4 * 1.5 - 120.0 * 4 * 1.0
    assert base.async_default_idle_j(480.0, pools, times) == pytest.approx(want)


def test_without_pools_powers_or_times_the_idle_is_counted_as_measured() -> None:
    pools = {"generation": base.PoolIdle(800.0, 8.0, 4), "training": base.PoolIdle(0.0, 0.0, 4)}
    times = {"generation": (10.0, 8.0), "training": (12.0, 11.0)}
    assert base.async_default_idle_j(800.0, {}, times) == 800.0  # sync mode, or not reported
    assert base.async_default_idle_j(800.0, pools, {"generation": (10.0, 8.0)}) == 800.0
    unknown = {name: base.PoolIdle(None, None, 4) for name in pools}
    assert base.async_default_idle_j(800.0, unknown, times) == 800.0
    # A default that waits less than the measured idle cannot go below zero.
    shrink = {"generation": (2.0, 8.0), "training": (12.0, 8.5)}
    assert base.async_default_idle_j(800.0, pools, shrink) == 0.0


def test_the_idle_bounds_take_every_corner_of_the_phases_default_time_bounds() -> None:
    # The first case's step (generation waits 2 s measured, 3 s under the default point:
    # +400 J). Training's default time between 10 and 12 s and generation's between 7 and
    # 9 s: the most idle is training slowest and generation fastest (wait 12 - 7 = 5 s, +1,200
    # J), the least training fastest and generation slowest (wait 10 - 9 = 1 s, -400 J). The
    # point's idle for both bounds (what the job total took before) holds neither.
    pools = {
        "generation": base.PoolIdle(energy_j=800.0, gpu_seconds=8.0, gpus=4),
        "training": base.PoolIdle(energy_j=0.0, gpu_seconds=0.0, gpus=4),
    }
    times = {"generation": (10.0, 8.0), "training": (12.0, 11.0)}
    bounds = {"generation": (7.0, 9.0), "training": (10.0, 12.0)}
    low, high = base.async_default_idle_range_j(800.0, pools, times, bounds)
    assert (low, high) == pytest.approx((800.0 - 400.0, 800.0 + 1200.0))
    point = base.async_default_idle_j(800.0, pools, times)
    assert low < point < high
    # Exact default times: both bounds are the point.
    exact = {name: (t_d, t_d) for name, (_, t_d) in times.items()}
    assert base.async_default_idle_range_j(800.0, pools, times, exact) == pytest.approx(
        (point, point)
    )
    # Sync mode (no pools): the measured idle both ways.
    assert base.async_default_idle_range_j(800.0, {}, times, bounds) == (800.0, 800.0)
