"""In-phase probe slices: the agent follows ``probeClocksMHz`` slice by slice on the stand-in,
meters each slice (instant power, counter fallback), interpolates the trainer's cumulative
progress at the boundaries, and the operator's aggregation feeds the slices to EE-RL."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
from agent_support import DriverFactory, FakeReviews, probe_plan, standin_agent
from rlenergy_agent import probes, server, service
from rlenergy_dev import standin

from rlenergy.api import node as api_node
from rlenergy.control.freq import aggregate, probe
from rlenergy.gpu import models
from rlenergy.sdk import trainer
from tests import factories

POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
H100 = models.get_sku("h100-sxm")
SLICE_S = 0.05
SCHEDULE = probe.block_schedule([1395, 1200])
CONTEXT = 2000.0


def _plan(
    schedule: tuple[int | None, ...] = SCHEDULE, slice_s: float = SLICE_S
) -> api_node.ClockPlan:
    return probe_plan(schedule, slice_s, training_locked=True)


def _agent(drv: standin.StandinDriver, *, virtual: bool = True) -> service.Agent:
    clock = (lambda: drv.virtual_s) if virtual else time.monotonic
    return standin_agent({POD: list(drv.uuids)}, _plan(), clock)


def _rate(clock_mhz: float) -> float:
    """Decode iterations per second at an effective clock (the simulator's time model)."""
    return 1000.0 / H100.time_factor("generation", clock_mhz, CONTEXT)


def _locked(drv: standin.StandinDriver) -> int | None:
    locks = {int(drv.gpu(u).lock_max_mhz) if drv.gpu(u).locked else None for u in drv.uuids}
    assert len(locks) == 1, locks
    return locks.pop()


def _run_probed_phase(
    drv: standin.StandinDriver, agent: service.Agent, client: trainer.RLEnergyClient, seconds: float
) -> tuple[dict[int, float], list[int | None]]:
    """Run generation for ``seconds`` of virtual time; progress follows the locked clock.

    Returns:
        (true energy per slice index, the lock seen during each slice index).
    """
    dt = 0.002
    done = 0.0
    truth: dict[int, float] = {}
    locks: dict[int, int | None] = {}
    while drv.virtual_s < seconds - 1e-9:
        k = agent.probe_switches
        locks.setdefault(k, _locked(drv))
        assert _locked(drv) == locks[k], "the lock changed inside a slice"
        before = sum(drv.truth_j(u) for u in drv.uuids)
        clock = drv.clock_mhz(drv.uuids[0])
        drv.advance(dt)
        truth[k] = truth.get(k, 0.0) + sum(drv.truth_j(u) for u in drv.uuids) - before
        done += _rate(clock) * dt
        agent.probe_tick()
        client.progress_total(done)
    return truth, [locks[k] for k in sorted(locks)]


def test_probe_plan_runs_the_phase_as_metered_slices(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    drv = make_driver(2)
    agent = _agent(drv)
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        client = reviews.client(sock, POD, short_tmp, strict=True)
        client.phase("generation", step=0)
        assert _locked(drv) == SCHEDULE[0]  # the first slice's clock comes with the signal
        drv.set_work(drv.uuids, "generation", "gen")
        length = len(SCHEDULE) * SLICE_S + 0.021  # two blocks and a partial slice
        truth, locks = _run_probed_phase(drv, agent, client, length)
        drv.set_work(drv.uuids, "training", "train")
        client.phase("training", step=0)
        assert _locked(drv) is None
        assert agent.probe_tick() is None  # nothing is probed any more
        client.end_step(0, samples=1, response_tokens=1, prompt_tokens=1, valid_tokens=1)
        client.close()
    finally:
        srv.stop()

    assert locks == [*SCHEDULE, SCHEDULE[0]]  # the locks followed the schedule
    rec = agent.report().steps[0]
    gen = next(p for p in rec.phases if p.phase == "generation")
    train = next(p for p in rec.phases if p.phase == "training")
    assert train.slices == []
    slices = gen.slices
    assert [s.clock_mhz for s in slices] == [*SCHEDULE, SCHEDULE[0]]
    for s in slices[:-1]:
        assert s.duration_seconds == pytest.approx(SLICE_S, abs=0.0025)
    assert slices[-1].duration_seconds == pytest.approx(0.021, abs=0.0025)  # partial, reported
    assert sum(s.duration_seconds for s in slices) == pytest.approx(gen.duration_seconds, rel=1e-9)
    # Progress: cumulative reports interpolated at the boundaries add up, and each slice's rate
    # is the rate of its clock.
    assert sum(s.progress for s in slices) == pytest.approx(gen.progress, rel=1e-9)
    for s in slices[:-1]:
        f = H100.effective_clock_mhz("generation", s.clock_mhz)
        assert s.progress / s.duration_seconds == pytest.approx(_rate(f), rel=0.02)
    # Energy: instant-power samples per slice match the truth of the slice.
    for k, s in enumerate(slices[:-1]):
        assert s.energy_joules == pytest.approx(truth[k], rel=0.03), k
    assert gen.energy_joules is not None
    total = sum(s.energy_joules or 0.0 for s in slices)
    assert total == pytest.approx(gen.energy_joules, rel=0.02)
    # The controller reads two blocks with the paired throughput and power ratios.
    blocks, _ = probe.blocks_from_slices(
        [
            base_slice
            for base_slice in aggregate.job_step(0, [agent.report()])
            .observation.phases["generation"]
            .slices
        ]
    )
    assert [b[0] for b in blocks] == [1395, 1200]
    f_default = H100.effective_clock_mhz("generation", None)
    for clock, thr, power in blocks:
        want = _rate(H100.effective_clock_mhz("generation", clock)) / _rate(f_default)
        assert thr == pytest.approx(want, rel=0.01)
        assert power is not None and power < 1.0
    assert blocks[1][1] < blocks[0][1] < 1.0


def test_instant_power_failure_falls_back_to_counter_deltas(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    drv = make_driver(2)
    agent = _agent(drv)
    for u in drv.uuids:
        drv.gpu(u).fail_instant = standin.NOT_SUPPORTED
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        client = reviews.client(sock, POD, short_tmp, strict=True)
        client.phase("generation", step=0)
        drv.set_work(drv.uuids, "generation", "gen")
        truth, _ = _run_probed_phase(drv, agent, client, 8 * SLICE_S)
        drv.set_work(drv.uuids, "idle", "idle")
        client.phase("idle", step=0)
        client.close()
    finally:
        srv.stop()
    slices = agent.steps[0]["generation"][0].slices
    assert len(slices) >= 8
    for k, s in enumerate(slices[:8]):
        assert s.energy_joules == pytest.approx(truth[k], rel=0.03), k
    assert {s.energy_source for s in slices} == {"counter"}  # the fallback says so


def test_policy_removal_mid_probe_stops_switching(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    agent = _agent(drv)
    agent.phase(POD, "generation", 0)
    drv.set_work(drv.uuids, "generation", "gen")
    for _ in range(30):
        drv.advance(0.005)
        agent.probe_tick()
    assert agent.probe_switches >= 2
    agent.set_plan(None)
    assert _locked(drv) is None
    for _ in range(60):
        drv.advance(0.005)
        agent.probe_tick()
    assert _locked(drv) is None, "a probe locked again after the policy went"
    agent.phase(POD, "idle", 0)
    assert agent.steps[0]["generation"][0].slices == []


def test_prober_thread_switches_on_time(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    agent = _agent(drv, virtual=False)
    slice_s = 0.02
    agent.set_plan(_plan(probe.block_schedule([1395]), slice_s))
    agent.start_prober()
    try:
        res = agent.phase(POD, "generation", 0)
        assert res.latency_s < 0.05
        time.sleep(16 * slice_s + 0.01)
        agent.phase(POD, "idle", 0)
    finally:
        agent.stop_prober()
    slices = agent.steps[0]["generation"][0].slices
    assert 15 <= len(slices) <= 18, [s.duration_seconds for s in slices]
    assert statistics.median(s.duration_seconds for s in slices[:-1]) == pytest.approx(
        slice_s, abs=0.004
    )
    assert [s.clock_mhz for s in slices[:8]] == list(probe.block_schedule([1395]))


def _window(node_slices: list[tuple[int | None, float, float]]) -> api_node.PhaseWindowReport:
    return api_node.PhaseWindowReport(
        phase="generation",
        durationSeconds=sum(d for _, d, _ in node_slices),
        energyJoules=100.0,
        slices=[
            api_node.SliceReport(clockMHz=c, durationSeconds=d, progress=p, energyJoules=d * 500)
            for c, d, p in node_slices
        ],
    )


def _report(node: str, window: api_node.PhaseWindowReport) -> api_node.NodeReport:
    workload = api_node.TokenWorkloadReport(
        samples=1, responseTokens=1, promptTokens=1, validTokens=1, meanContextTokens=1
    )
    return factories.node_report(
        node, [api_node.StepRecord(step=0, workload=workload, phases=[window])]
    )


def test_aggregation_keeps_blocks_within_one_node() -> None:
    # Node a: one block at 1395 MHz (candidate rate 0.9), then six slices of the next block
    # (the phase ended there). Node b: two blocks at 1395 MHz (candidate rate 0.8) and differs
    # in length, so slices cannot be aligned by index. A block made of a's six trailing slices
    # and b's first two would match the Thue-Morse pattern; it must not be formed.
    sched = probe.block_schedule([1395])

    def slices(rate: float, n: int) -> list[tuple[int | None, float, float]]:
        return [(c, 0.05, 0.05 * (rate if c is not None else 1.0)) for c in (sched * 3)[:n]]

    reports = [
        _report("b", _window(slices(0.8, 16))),
        _report("a", _window(slices(0.9, 14))),
    ]
    obs = aggregate.job_step(0, reports).observation.phases["generation"]
    blocks, _ = probe.blocks_from_slices(obs.slices)
    assert [round(thr, 6) for _, thr, _ in blocks] == [0.9, 0.8, 0.8]
    # A node without slices does not hide the others' slices.
    reports.append(_report("c", _window([])))
    obs = aggregate.job_step(0, reports).observation.phases["generation"]
    assert len(probe.blocks_from_slices(obs.slices)[0]) == 3


def test_progress_timestamps_keep_transit_out_of_slices(make_driver: DriverFactory) -> None:
    drv = make_driver(1)
    agent = _agent(drv)
    agent.set_plan(_plan(probe.block_schedule([1395]), 0.1))
    agent.phase(POD, "generation", 0)
    for _ in range(4):
        drv.advance(0.05)
        agent.probe_tick()
    # Both reports arrive at t = 0.2; the first was measured at the boundary t = 0.1, the
    # second carries a timestamp from another clock (ignored: arrival time).
    agent.progress_total(POD, 100.0, at_s=0.1)
    agent.progress_total(POD, 100.0, at_s=1e6)
    agent.phase(POD, "idle", 0)
    slices = agent.steps[0]["generation"][0].slices
    assert [s.duration_seconds for s in slices] == pytest.approx([0.1, 0.1, 0.0], abs=1e-9)
    assert slices[0].progress == pytest.approx(100.0)
    assert slices[1].progress == pytest.approx(0.0, abs=1e-9)


def test_slice_rates_come_from_the_reports_inside_each_slice() -> None:
    """A report interval straddling a switch mixes two clocks; the slices' rates must not."""
    switch_s, rates = 0.05, (100.0, 50.0)

    def truth(t: float) -> float:
        return rates[0] * min(t, switch_s) + rates[1] * max(t - switch_s, 0.0)

    ts = [0.003 + 0.008 * k for k in range(13)]  # every 8 ms, never on the switch
    values = [truth(t) for t in ts]
    spans = [(0.0, switch_s), (switch_s, 0.1)]
    got = probes.slice_progress(ts, values, spans)
    assert got[1] / got[0] == pytest.approx(rates[1] / rates[0], rel=1e-9)
    whole = probes._interpolate(ts, values, 0.1) - probes._interpolate(ts, values, 0.0)
    assert sum(got) == pytest.approx(whole, rel=1e-12)
    # Interpolating at the boundaries instead blurs the ratio toward 1.
    at = [probes._interpolate(ts, values, t) for t in (0.0, switch_s, 0.1)]
    assert (at[2] - at[1]) / (at[1] - at[0]) > rates[1] / rates[0] + 0.02
    # A slice with fewer than two reports inside keeps the interpolated rate.
    few = probes.slice_progress(ts, values, [(0.0, 0.006), (0.006, 0.1)])
    assert few[0] > 0 and sum(few) == pytest.approx(whole, rel=1e-12)
    assert probes.slice_progress(ts, values, []) == []


def test_the_last_report_is_no_slice_rate_after_a_switch(make_driver: DriverFactory) -> None:
    """The work ends inside the last report's interval; the prober then switches to the next
    slice before the phase's end signal. That interval (a partly idle one) must not count in
    the rate of the slice it fell in, nor the end signal's."""
    drv = make_driver(1)
    agent = _agent(drv)
    agent.set_plan(_plan(probe.block_schedule([1395]), 0.1))
    agent.phase(POD, "generation", 0)
    rate, done_s = 1000.0, 0.195
    for k in range(1, 21):  # a report every 10 ms; the work ends at 0.195 s
        drv.advance(0.01)
        agent.progress_total(POD, rate * min(k * 0.01, done_s))
        agent.probe_tick()  # at 0.1 and 0.2: the boundary, after the report
    drv.advance(0.01)
    agent.probe_tick()
    agent.phase(POD, "idle", 0)  # the end signal, 10 ms after the last report
    slices = agent.steps[0]["generation"][0].slices
    assert [s.clock_mhz for s in slices] == [1395, None, None]
    first, second = slices[0], slices[1]
    # Both slices ran at the same rate; the last report's interval read 0.944 of it.
    assert second.progress / second.duration_seconds == pytest.approx(
        first.progress / first.duration_seconds, rel=1e-9
    )
    assert second.rate_reports == 8  # 0.11-0.19 s: the last report (0.2 s) left out


def test_work_start_is_placed_before_the_first_report_at_the_following_rate() -> None:
    """The GPUs' work began 12 ms after the window opened: the lead is no slice's rate."""
    lead_s, rate = 0.012, 100.0
    ts = [0.0, *(lead_s + 0.003 + 0.008 * k for k in range(12))]  # opened at 0, then ticks
    values = [0.0, *(rate * (t - lead_s) for t in ts[1:])]
    assert probes.work_start(ts, values) == pytest.approx(lead_s, abs=1e-12)
    # A report before any progress bounds the start from below.
    assert probes.work_start([0.0, 0.02, 0.03, 0.04], [0.0, 0.0, 1.0, 2.0]) == 0.02
    # Work from the opening on: no lead; nothing advanced or nothing logged: none known.
    assert probes.work_start([0.0, 0.004, 0.008], [0.0, 0.4, 0.8]) == pytest.approx(0.0)
    assert probes.work_start([0.0, 0.004], [0.0, 0.0]) == -float("inf")
    assert probes.work_start([], []) == -float("inf")
    # The first slice's progress is its rate over its work, not over the lead before it.
    spans = [(0.0, 0.05), (0.05, 0.1)]
    got = probes.slice_progress(ts, values, spans, began=lead_s)
    assert got[0] / got[1] == pytest.approx((0.05 - lead_s) / 0.05, rel=1e-9)
    assert probes.slice_progress(ts, values, spans)[0] > got[0]  # the lead counted as work


def test_a_lead_is_its_own_answer_in_the_paired_default() -> None:
    """A candidate slice whose first 12 ms idled: the default waits as long, at the lead's power.

    Through the node report's fields (``leadSeconds``, ``leadEnergyJoules``) and the operator's
    conversion (``aggregate.probe_slice``).
    """
    d, lead_s, idle_w, work_w, rate = 0.04, 0.012, 640.0, 4000.0, 100.0  # candidate: x0.9, x0.8
    reports = []
    for c in probe.block_schedule([1410]):
        if c is None:
            reports.append(
                api_node.SliceReport(
                    duration_seconds=d, progress=rate * d, energy_joules=work_w * d
                )
            )
            continue
        lead = lead_s if not reports else 0.0
        work_j = 0.8 * work_w * (d - lead)
        reports.append(
            api_node.SliceReport(
                clock_mhz=c,
                duration_seconds=d,
                progress=0.9 * rate * (d - lead),
                energy_joules=work_j + idle_w * lead,
                lead_seconds=lead,
                lead_energy_joules=idle_w * lead if lead else None,
            )
        )
    slices = [aggregate.probe_slice(r) for r in reports]
    [(clock, thr, power)] = probe.blocks_from_slices(slices)[0]
    assert (clock, thr, power) == (1410, pytest.approx(0.9), pytest.approx(0.8))
    t, e = probe.paired_default(slices, None) or (0.0, 0.0)
    work_a = 4 * d - lead_s  # the candidates' work at 0.9 of the default's rate
    assert t == pytest.approx(4 * d + 0.9 * work_a + lead_s)
    assert e == pytest.approx(work_w * (4 * d + 0.9 * work_a) + idle_w * lead_s)
