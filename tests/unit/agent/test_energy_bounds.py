"""Energy meter edges the phase tests leave open (found by mutation testing, docs/mutation.md).

The plausibility bound at its edge (``MAX_POWER_LIMIT_FACTOR`` x the board power limit over the
covered time, at least ``MIN_PLAUSIBILITY_WINDOW_S``), a restart's downtime energy judged
against the downtime and booked once (``restored_downtime_j``), every fault counted each time
it happens, window durations and running totals against the clock and the stand-in's truth,
a totals file with missing fields. Over the stand-in NVML, with the counter written directly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from agent_support import DriverFactory, discovered_meter, energy_sources
from rlenergy_agent import energy
from rlenergy_agent.nvml import backend
from rlenergy_dev import standin

LOGGER = "rlenergy_agent.energy"


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


class _Clocks:
    """Monotonic and wall time the test moves by hand, s."""

    def __init__(self, wall_s: float = 1_000.0) -> None:
        self.t_s = 0.0
        self.wall_s = wall_s


def _meter(clocks: _Clocks, totals: Path | None = None) -> energy.EnergyMeter:
    return discovered_meter(lambda: clocks.t_s, lambda: clocks.wall_s, totals)


def _counter_step(
    drv: standin.StandinDriver, meter: energy.EnergyMeter, clocks: _Clocks, dt_s: float, mj: int
) -> None:
    """Move time by ``dt_s``, the counter of the (only) GPU by ``mj``, then sample."""
    u = drv.uuids[0]
    clocks.t_s += dt_s
    clocks.wall_s += dt_s
    drv.gpu(u).energy_mj += mj
    meter.sample()


@pytest.mark.parametrize(("dt_s", "covered_s"), [(1.0, 2.0), (0.05, 0.2)])
def test_the_plausibility_bound_holds_exactly_at_its_edge(
    make_driver: DriverFactory, dt_s: float, covered_s: float
) -> None:
    """A counter that moves at every sample: each value covers the time since the sample
    before it was first read (two sample periods), and at least 0.2 s."""
    drv = make_driver(1)
    u = drv.uuids[0]
    clocks = _Clocks()
    meter = _meter(clocks)
    limit_w = drv.gpu(u).power_limit_mw / 1000.0
    assert meter.state[u].power_limit_w == limit_w
    bound_mj = round(energy.MAX_POWER_LIMIT_FACTOR * limit_w * covered_s * 1000.0)
    meter.sample()
    for _ in range(3):
        _counter_step(drv, meter, clocks, dt_s, 7)
    before = meter.state[u].total_mj
    _counter_step(drv, meter, clocks, dt_s, bound_mj)  # exactly the bound: plausible
    assert meter.state[u].rejected == 0
    assert meter.state[u].total_mj == before + bound_mj
    _counter_step(drv, meter, clocks, dt_s, 7)
    before = meter.state[u].total_mj
    _counter_step(drv, meter, clocks, dt_s, bound_mj + 1)  # one mJ more: rejected
    assert meter.state[u].rejected == 1 and meter.state[u].total_mj == before


@pytest.mark.parametrize(
    ("downtime_s", "jump_j", "accepted"),
    [
        (10.0, 5_000.0, True),
        (10.0, 1.5 * 700 * 10.0 + 0.001, False),  # more than the downtime allows
        (0.5, 600.0, False),  # 0.5 s allows 525 J at 700 W
        (-30.0, 200.0, True),  # wall clock stepped back: judged over 0.2 s (210 J)
    ],
)
def test_a_restart_books_its_downtime_once_judged_against_the_downtime(
    make_driver: DriverFactory, tmp_path: Path, downtime_s: float, jump_j: float, accepted: bool
) -> None:
    drv = make_driver(2)
    u, other = drv.uuids
    assert drv.gpu(u).power_limit_mw == 700_000
    totals = tmp_path / "totals.json"
    clocks = _Clocks()
    meter = _meter(clocks, totals)
    meter.sample()
    for _ in range(4):
        _counter_step(drv, meter, clocks, 1.0, 300_000)
    meter.save()
    saved_mj = meter.state[u].total_mj
    assert saved_mj == 1_200_000
    del meter
    clocks.wall_s += downtime_s  # agent down; a new process: its monotonic clock restarts
    clocks.t_s = 0.0
    drv.gpu(u).energy_mj += round(jump_j * 1000)
    drv.gpu(other).energy_mj += 1_000_000  # 1 kJ on the other GPU: plausible over 0.2 s or more
    restarted = _meter(clocks, totals)
    assert restarted.state[u].total_mj == saved_mj and restarted.restored_downtime_j == 0.0
    restarted.sample()
    st = restarted.state[u]
    other_j = 1_000.0 if downtime_s >= 1.0 else 0.0  # over 0.2 s, 1 kJ is above 210 J
    booked_j = (jump_j if accepted else 0.0) + other_j
    assert restarted.restored_downtime_j == pytest.approx(booked_j)  # summed over the GPUs
    if accepted:
        assert st.total_mj == pytest.approx(saved_mj + jump_j * 1000) and st.rejected == 0
        assert restarted.total_j(u) == pytest.approx(saved_mj / 1000 + jump_j, abs=1e-9)
    else:
        assert st.total_mj == saved_mj and st.rejected == 1
    # later samples are running time, not downtime
    _counter_step(drv, restarted, clocks, 1.0, 300_000)
    _counter_step(drv, restarted, clocks, 1.0, 300_000)
    assert restarted.restored_downtime_j == pytest.approx(booked_j)


def test_every_fault_is_counted_each_time_it_happens(make_driver: DriverFactory) -> None:
    drv = make_driver(1)
    u = drv.uuids[0]
    clocks = _Clocks()
    meter = _meter(clocks)
    meter.sample()
    good = 1
    for _ in range(2):  # two driver reloads
        _counter_step(drv, meter, clocks, 1.0, 1000)
        drv.reset_counter(u, 50)
        _counter_step(drv, meter, clocks, 1.0, 0)
        good += 2
    for _ in range(2):  # two implausible jumps
        _counter_step(drv, meter, clocks, 1.0, 10**12)
        good += 1
    start = meter.mark([u])
    good += 1
    for _ in range(3):  # three transient read failures
        drv.gpu(u).fail_once = standin.NOT_READY
        _counter_step(drv, meter, clocks, 1.0, 1000)
    st = meter.state[u]
    assert (st.resets, st.rejected, st.missing, st.samples) == (2, 2, 3, good)
    assert st.errors_seen == 5
    w = meter.window(start, meter.mark([u]))
    assert w.incomplete


def test_windows_last_as_long_as_the_clock_says_and_totals_match_the_truth(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    drv.set_work(drv.uuids, "training", "t")
    clocks = _Clocks()
    meter = _meter(clocks)
    meter.sample()
    base = {u: drv.truth_j(u) for u in drv.uuids}
    for _ in range(40):
        clocks.t_s += 0.5
        drv.advance(0.5)
        meter.sample()
    start = meter.mark(drv.uuids)
    t0 = clocks.t_s
    for _ in range(7):
        clocks.t_s += 0.5
        drv.advance(0.5)
        meter.sample()
    w = meter.window(start, meter.mark(drv.uuids))
    assert w.duration_s == clocks.t_s - t0 == 3.5
    assert meter.window(meter.mark(drv.uuids), start).duration_s == 0.0  # never negative
    for u in drv.uuids:
        total = meter.total_j(u)
        assert total == pytest.approx(drv.truth_j(u) - base[u], rel=0.01)
    assert meter.total_j("GPU-unknown") is None


def test_mean_power_of_a_window_needs_a_positive_duration() -> None:
    assert energy.power_from_counter(30_000, 2.0) == 15.0
    assert energy.power_from_counter(500, 0.5) == 1.0  # a window under a second is fine
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"^duration_s must be > 0$"):
            energy.power_from_counter(30_000, bad)
    assert energy.straggler_wait_worker_s([]) == 0.0  # no workers, no waiting


def test_a_totals_file_with_missing_fields_starts_that_gpu_from_what_it_has(
    make_driver: DriverFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    drv = make_driver(2)
    first, second = drv.uuids
    totals = tmp_path / "totals.json"
    gpus = {"GPU-that-left": {"total_mj": 9.0}, first: {}, second: {"total_mj": 5_000.0}}
    totals.write_text(json.dumps({"gpus": gpus}))
    clocks = _Clocks()
    meter = _meter(clocks, totals)
    assert meter.state[first].total_mj == 0.0 and meter.state[first].raw_mj is None
    assert meter.state[second].total_mj == 5_000.0
    assert "GPU-that-left" not in meter.state
    meter.sample()
    _counter_step(drv, meter, clocks, 1.0, 1000)
    assert meter.total_j(first) == 1.0 and meter.total_j(second) == 5.0
    assert meter.restored_downtime_j == 0.0  # no raw counter on record: no downtime booked
    totals.write_text('{"version": 1}')
    assert _meter(clocks, totals).state[first].total_mj == 0.0
    totals.write_text("{not json")
    caplog.set_level(logging.ERROR, logger=LOGGER)
    assert _meter(clocks, totals).state[second].total_mj == 0.0
    (msg,) = _messages(caplog, logging.ERROR)
    assert msg.startswith(f"energy totals file {totals} unreadable (Expecting property name")
    assert msg.endswith("); starting from 0")


def test_saved_totals_make_their_folder_and_keep_their_format(
    make_driver: DriverFactory, tmp_path: Path
) -> None:
    drv = make_driver(1)
    (u,) = drv.uuids
    totals = tmp_path / "var" / "lib" / "rlenergy" / "totals.json"
    clocks = _Clocks()
    meter = _meter(clocks, totals)
    meter.sample()
    _counter_step(drv, meter, clocks, 1.0, 2500)
    meter.save()
    # the format a later agent version reads from the hostPath
    assert json.loads(totals.read_text()) == {
        "version": 1,
        "gpus": {u: {"total_mj": 2500.0, "raw_mj": drv.gpu(u).energy_mj, "wall_s": clocks.wall_s}},
    }


def test_faults_are_logged_with_the_gpu_and_the_figures(
    make_driver: DriverFactory, caplog: pytest.LogCaptureFixture
) -> None:
    drv = make_driver(2)
    u, lost = drv.uuids
    clocks = _Clocks()
    meter = _meter(clocks)
    meter.sample()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    raw0 = drv.gpu(u).energy_mj
    drv.gpu(u).energy_mj = 50
    _counter_step(drv, meter, clocks, 1.0, 0)
    _counter_step(drv, meter, clocks, 1.0, 10**12)
    drv.gpu(u).fail_once = standin.NOT_READY
    drv.gpu(lost).fail_all = standin.GPU_IS_LOST
    _counter_step(drv, meter, clocks, 1.0, 0)
    assert _messages(caplog, logging.WARNING) == [
        f"energy counter of {u} went back ({raw0} -> 50 mJ): driver reload or GPU reset",
        f"rejected implausible energy sample on {u} (50 -> {50 + 10**12} mJ in 2.000 s)",
        f"energy sample of {u} failed (counted missing): {u}: nvmlDeviceGetTotalEnergyConsumption:"
        " System is not in ready state (NVML error 27)",
    ]
    (err,) = _messages(caplog, logging.ERROR)
    assert err.startswith(f"GPU {lost} lost; its energy stops at the last good sample: {lost}: ")
    assert err.endswith("(NVML error 15)")


def test_instant_power_is_integrated_where_there_is_no_counter(
    make_driver: DriverFactory,
) -> None:
    """Idle 5 s, then training 0.6 s: the trailing 1 s average would book idle power into
    training; integrating the instant power follows the truth."""
    drv = make_driver(1)
    (u,) = drv.uuids
    drv.gpu(u).fail_energy = standin.NOT_SUPPORTED
    clocks = _Clocks()
    meter = _meter(clocks)
    assert meter.state[u].source == "power_integration"
    drv.set_work([u], "idle", "idle")
    for _ in range(50):
        clocks.t_s += 0.1
        drv.advance(0.1)
        meter.sample()
    drv.set_work([u], "training", "train")
    start = meter.mark([u])
    for _ in range(6):
        clocks.t_s += 0.1
        drv.advance(0.1)
        meter.sample()
    w = meter.window(start, meter.mark([u]))
    assert w.sources[u] == "power_integration" and not w.low_confidence
    assert w.energy_j == pytest.approx(drv.truth_j(u, "train"), rel=0.1)


@pytest.mark.parametrize(("seconds", "low"), [(1.9, True), (2.0, False), (2.5, False)])
def test_averaged_power_is_low_confidence_below_twice_its_window(
    make_driver: DriverFactory, seconds: float, low: bool
) -> None:
    drv = make_driver(1)
    (u,) = drv.uuids
    drv.gpu(u).fail_energy = drv.gpu(u).fail_instant = standin.NOT_SUPPORTED
    clocks = _Clocks()
    meter = _meter(clocks)
    assert meter.state[u].source == "averaged_power"
    meter.sample()
    start = meter.mark([u])
    clocks.t_s += seconds
    drv.advance(seconds)
    w = meter.window(start, meter.mark([u]))
    assert w.duration_s == seconds and w.low_confidence is low


def test_gpus_without_a_source_or_a_first_sample_are_unknown_never_counted(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(3)
    late, unlisted, fine = drv.uuids
    found = backend.discover()
    sources = energy_sources({u: g.probe() for u, g in found.gpus.items()})
    del sources[unlisted]  # the probe gave no source for it
    clocks = _Clocks()
    meter = energy.EnergyMeter(
        found.gpus, sources, clock=lambda: clocks.t_s, wall=lambda: clocks.wall_s
    )
    assert meter.state[unlisted].source == "unavailable"
    drv.gpu(late).fail_once = standin.NOT_READY  # its first read fails
    start = meter.mark([late, unlisted, fine, "GPU-not-metered"])
    assert start.totals_mj[late] is None and start.totals_mj["GPU-not-metered"] is None
    assert start.errors["GPU-not-metered"] == 0 and start.errors[late] == 1
    drv.set_work(drv.uuids, "training")
    for _ in range(4):
        clocks.t_s += 0.5
        drv.advance(0.5)
        meter.sample()
    end = meter.mark([late, unlisted, fine, "GPU-not-metered"])
    assert end.totals_mj[late] is not None  # measured from its first good read on
    w = meter.window(start, end)
    assert w.per_gpu_j[late] is None  # unknown at the start: the window is unknown
    assert w.per_gpu_j[unlisted] is None and w.per_gpu_j["GPU-not-metered"] is None
    assert w.per_gpu_j[fine] is not None and w.per_gpu_j[fine] > 0 and w.energy_j is None
    assert w.sources["GPU-not-metered"] == "unavailable"
    assert w.sources[unlisted] == "unavailable" and w.sources[fine] == "counter"
    assert meter.total_j(unlisted) is None


def test_without_a_readable_power_limit_no_sample_is_judged_implausible(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    (u,) = drv.uuids
    found = backend.discover()
    sources = energy_sources({g: found.gpus[g].probe() for g in found.gpus})
    drv.gpu(u).fail_power = standin.NOT_SUPPORTED
    clocks = _Clocks()
    meter = energy.EnergyMeter(
        found.gpus, sources, clock=lambda: clocks.t_s, wall=lambda: clocks.wall_s
    )
    assert meter.state[u].power_limit_w is None and meter.state[u].source == "counter"
    meter.sample()
    # 2 kJ in 1 s: above 1.5 x 700 W (rejected with the limit known), below the 3 kW that
    # counter_delta allows any GPU
    _counter_step(drv, meter, clocks, 1.0, 2_000_000)
    assert meter.state[u].rejected == 0 and meter.total_j(u) == 2_000.0
