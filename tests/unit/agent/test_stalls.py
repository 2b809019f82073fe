"""Stalled rollouts through the real agent over the stand-in NVML.

The stand-in's ``freeze`` plays a hung engine: the GPUs busy-wait at 1.2 x idle power with
utilisation 100 % while the trainer keeps reporting the same progress with requests in flight.
The agent (sampling loop ``observe``, prober ``probe_tick``, signals ``progress_total``) must
declare the stall after the configured time, hold the probe's clock through it, report the
stalled seconds and their energy, flag the slices, and the operator side must keep that time
out of the phase figures (aggregate, job loop) and raise ``RolloutStalled``.
"""

from __future__ import annotations

import pytest
from agent_support import DriverFactory, probe_plan, standin_agent
from prometheus_client.parser import text_string_to_metric_families
from rlenergy_agent import metrics, service, stalls
from rlenergy_dev import standin
from rlenergy_operator import builders, conditions, jobloop, loopstatus

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import aggregate, base, probe
from rlenergy.gpu import models

pytestmark = pytest.mark.field

POD = service.PodRef("team-a", "rollout-0", "11111111-2222-3333-4444-555555555555")
CANDIDATE_MHZ = 1395
PROBE_PLAN = probe_plan(probe.block_schedule([CANDIDATE_MHZ]), 1.0)
STALL_AFTER_S = 10.0
DT_S = 0.25


class Trainer:
    """The trainer side in virtual time: progress reports every ``DT_S``, sampling every 1 s."""

    def __init__(self, drv: standin.StandinDriver, agent: service.Agent) -> None:
        self.drv, self.agent = drv, agent
        self.progress = 0.0
        self.ticks = 0

    def run(self, seconds: float, *, rate: float, in_flight: int | None) -> None:
        for _ in range(round(seconds / DT_S)):
            self.drv.advance(DT_S)
            self.ticks += 1
            self.agent.probe_tick()
            self.progress += rate * DT_S
            self.agent.progress_total(POD, self.progress, in_flight=in_flight)
            if self.ticks % round(1.0 / DT_S) == 0:
                self.agent.meter.sample()
                self.agent.observe()


def _metric(agent: service.Agent, name: str) -> list[tuple[dict[str, str], float]]:
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render(agent).decode())}
    return [(dict(s.labels), s.value) for s in fams[name].samples if s.name.startswith(name)]


def _stalled_gauge(agent: service.Agent) -> set[float]:
    return {v for _, v in _metric(agent, "rlenergy_agent_rollout_stalled")}


def _writes(drv: standin.StandinDriver) -> int:
    return sum(int(drv.gpu(u).clock_writes) for u in drv.uuids)


def test_a_frozen_engine_is_a_stall_held_at_its_clock_and_kept_out_of_evidence(
    make_driver: DriverFactory,
):
    drv = make_driver(2)
    agent = standin_agent({POD: list(drv.uuids)}, PROBE_PLAN, lambda: drv.virtual_s)
    agent.stall_after_s = STALL_AFTER_S
    tr = Trainer(drv, agent)
    drv.set_work(drv.uuids, "generation")
    agent.phase(POD, "generation", 0)
    # Two Thue-Morse blocks of working decode and three slices of the third: the freeze comes
    # mid-block, where a block's candidate and default slices would see different work.
    tr.run(19.0, rate=100.0, in_flight=8)
    assert _stalled_gauge(agent) == {0.0}
    before = _writes(drv)
    assert before > 0  # the probe switched clocks while the engine worked

    drv.set_work(drv.uuids, "generation", label="frozen")
    drv.freeze(drv.uuids)  # hung engine: requests in flight, progress frozen, near-idle power
    tr.run(STALL_AFTER_S + 2.0, rate=0.0, in_flight=8)
    gpus = {g.uuid: g for g in agent.report().gpus}
    assert all(gpus[u].stalled_seconds is not None for u in drv.uuids)
    assert _stalled_gauge(agent) == {1.0}
    status, reason, message = builders.stall_condition([agent.report()])
    assert (status, reason) == (True, "ProgressFrozen")
    assert "team-a/rollout-0" in message and drv.uuids[0] in message
    held = _writes(drv)
    tr.run(30.0 - STALL_AFTER_S - 2.0, rate=0.0, in_flight=8)
    assert _writes(drv) == held  # no clock change while stalled (the prober holds the slice)

    drv.freeze(drv.uuids, frozen=False)  # the engine recovers
    drv.set_work(drv.uuids, "generation")
    tr.run(24.0, rate=100.0, in_flight=8)
    assert _writes(drv) > held  # the probe resumes
    assert _stalled_gauge(agent) == {0.0}
    assert not builders.stall_condition([agent.report()])[0]

    agent.end_step(
        POD,
        0,
        api_node.TokenWorkloadReport(
            samples=8,
            response_tokens=3200,
            prompt_tokens=800,
            valid_tokens=3200,
            mean_context_tokens=500,
        ),
    )
    (rec,) = agent.report().steps
    (win,) = rec.phases
    # From the first frozen sample (1 s after the freeze) to the last (30 s after it): 29 s.
    assert 28.0 <= win.stalled_seconds <= 30.0, win.stalled_seconds
    frozen_truth_j = sum(drv.truth_j(u, "frozen") for u in drv.uuids)  # 30 s of frozen power
    assert win.stalled_energy_joules == pytest.approx(
        frozen_truth_j * win.stalled_seconds / 30.0, rel=0.05
    )
    [(_, stalled_total)] = _metric(agent, "rlenergy_agent_stalled_seconds")
    assert stalled_total == pytest.approx(win.stalled_seconds)

    # Slices that overlap the stall are flagged; the probe's blocks drop them, so every block
    # left compares working slices (a stalled block's throughput ratio would be 0 or huge).
    flagged = [s for s in win.slices if s.stalled]
    assert len(flagged) >= 29
    assert sum(s.progress for s in flagged) <= 2 * 100.0 + 1  # only the two edge slices work
    slices = aggregate.job_step(0, [agent.report()]).observation.phases["generation"].slices
    blocks, _ = probe.blocks_from_slices(slices)
    assert len(blocks) >= 3  # two before the stall, at least one after
    assert all(0.8 < thr < 1.05 for _, thr, _ in blocks), blocks
    unflagged = [dataclasses_replace_stalled(s) for s in slices]
    assert len(probe.blocks_from_slices(unflagged)[0]) < len(blocks) or any(
        not 0.8 < thr < 1.05 for _, thr, _ in probe.blocks_from_slices(unflagged)[0]
    ), "without the flags a stalled block would count as evidence"

    # The fold takes the stall out of the phase's duration and energy (savings, trials).
    ph = aggregate.job_step(0, [agent.report()]).observation.phases["generation"]
    assert ph.duration_s == pytest.approx(win.duration_seconds - win.stalled_seconds)
    assert win.energy_joules is not None and win.stalled_energy_joules is not None
    assert ph.energy_j == pytest.approx(win.energy_joules - win.stalled_energy_joules)
    assert ph.stalled_s == win.stalled_seconds


def dataclasses_replace_stalled(s: base.ProbeSlice) -> base.ProbeSlice:
    """The slice as it would read without the stall flag."""
    return base.ProbeSlice(s.clock_mhz, s.duration_s, s.progress, s.energy_j)


@pytest.mark.parametrize(
    ("in_flight", "frozen", "why"),
    [
        (8, False, "progress frozen at working power (a long prefill) is no stall"),
        (0, True, "nothing in flight: an engine waiting for work is no stall"),
        (None, True, "a caller that never says what is in flight is never judged"),
    ],
)
def test_no_stall_without_every_sign(make_driver: DriverFactory, in_flight, frozen, why):
    drv = make_driver(1)
    plan = api_node.ClockPlan(
        step=0,
        phases=[api_node.PhasePlan(phase="generation", clockMHz=CANDIDATE_MHZ, state="locked")],
    )
    agent = standin_agent({POD: list(drv.uuids)}, plan, lambda: drv.virtual_s)
    agent.stall_after_s = STALL_AFTER_S
    tr = Trainer(drv, agent)
    drv.set_work(drv.uuids, "generation")
    agent.phase(POD, "generation", 0)
    tr.run(3.0, rate=100.0, in_flight=in_flight)
    if frozen:
        drv.freeze(drv.uuids)
    tr.run(3 * STALL_AFTER_S, rate=0.0, in_flight=in_flight)
    assert _stalled_gauge(agent) == {0.0}, why
    assert all(g.stalled_seconds is None for g in agent.report().gpus), why


def test_stall_band_per_sku():
    h100 = models.get_sku("h100-sxm")
    working = h100.power_w("generation", h100.min_sm_clock_mhz)
    assert stalls.band_w(h100.nvml_name, 700.0) == pytest.approx(
        h100.idle_power_w + 0.5 * (working - h100.idle_power_w)
    )
    assert 120.0 < stalls.band_w(h100.nvml_name, None) < 160.0  # type: ignore[operator]
    b200 = models.get_sku("b200")
    assert stalls.band_w(b200.nvml_name, None) > stalls.band_w(h100.nvml_name, None)  # type: ignore[operator]
    assert stalls.band_w("Some Future GPU", 1000.0) == pytest.approx(200.0)
    assert stalls.band_w("Some Future GPU", None) is None


def test_stall_watch_counts_only_observed_frozen_time():
    w = stalls.StallWatch(after_s=5.0, band_w=100.0, in_flight=3)
    out = [w.sample(float(t), 10.0 if t < 3 else 10.0 + (t >= 12) * t, 50.0, t) for t in range(20)]
    # frozen from t=1 (first repeat) to t=11 (last repeat before progress at 12)
    assert out.index("started") == 6 and out.index("ended") == 12
    assert w.stalls[0].start_s == 1.0 and w.stalls[0].end_s == 11.0
    assert (w.stalls[0].start_mark, w.stalls[0].end_mark) == (1, 11)
    assert w.stalled_s() == 10.0
    assert w.overlaps(10.5, 12.0) and not w.overlaps(11.5, 12.0)


def _report(stalled_s: float, stalled_j: float | None, step: int) -> api_node.StepRecord:
    return api_node.StepRecord(
        step=step,
        workload=api_node.TokenWorkloadReport(
            samples=8,
            response_tokens=1000,
            prompt_tokens=100,
            valid_tokens=1000,
            mean_context_tokens=500,
        ),
        phases=[
            api_node.PhaseWindowReport(
                phase="generation",
                duration_seconds=100.0 + stalled_s,
                energy_joules=40_000.0 + (stalled_j or 0.0),
                stalled_seconds=stalled_s,
                stalled_energy_joules=stalled_j,
            ),
            api_node.PhaseWindowReport(
                phase="training", duration_seconds=50.0, energy_joules=30_000.0
            ),
        ],
        idle_energy_joules=0.0,
    )


def test_the_job_loop_keeps_stalled_time_out_of_compared_figures():
    spec = api_policy.RLEnergyPolicySpec.model_validate(
        {"selector": {"matchLabels": {"app": "x"}}, "controller": {"warmupSteps": 4}}
    )
    clean = [
        api_node.NodeReport(
            policy_name="pol",
            node_name="gpu-a",
            gpus=[api_node.GpuStatus(uuid="GPU-1", supported_clocks_mhz=[1980, 1500, 1005])],
            steps=[_report(0.0, 0.0, s) for s in range(3)],
            last_step=2,
        )
    ]
    stalled = [
        clean[0].model_copy(
            update={
                "steps": [_report(0.0, 0.0, 0), _report(300.0, 30_000.0, 1), _report(0.0, 0.0, 2)]
            }
        )
    ]
    a, b = jobloop.JobLoop(spec, 1), jobloop.JobLoop(spec, 1)
    a.advance(clean)
    b.advance(stalled)
    ta, tb = a.totals(), b.totals()
    assert (tb.stalled_seconds, tb.stalled_joules) == (300.0, 30_000.0)
    assert tb.measured_joules == ta.measured_joules + 30_000.0  # measured, all of it
    for field in ("compared_measured_joules", "predicted_default_joules", "measured_seconds"):
        assert getattr(tb, field) == getattr(ta, field), field  # never compared
    assert tb.saving_percent == ta.saving_percent
    # an unknown stalled energy makes the step's energy unknown, never 0
    unknown = [clean[0].model_copy(update={"steps": [_report(300.0, None, 0)], "last_step": 0})]
    c = jobloop.JobLoop(spec, 1)
    c.advance(unknown)
    assert c.totals().unknown_energy_steps == 1

    # the pass raises RolloutStalled while a GPU reports a stall, and clears it after
    gpu = (
        clean[0]
        .gpus[0]
        .model_copy(
            update={"stalled_seconds": 75.0, "pod": "team-a/rollout-0", "phase": "generation"}
        )
    )
    now = "2026-01-01T00:00:00Z"
    conds = conditions.PassConditions(None, generation=1, now=now)
    out = loopstatus.assemble(b, [stalled[0].model_copy(update={"gpus": [gpu]})], None, conds, None)
    (cond,) = [c for c in out.fields["conditions"] if c["type"] == "RolloutStalled"]
    assert (cond["status"], cond["reason"]) == ("True", "ProgressFrozen")
    assert "75 s" in cond["message"] and "team-a/rollout-0 (generation)" in cond["message"]
    conds = conditions.PassConditions(out.fields["conditions"], generation=1, now=now)
    out = loopstatus.assemble(b, stalled, None, conds, None)
    (cond,) = [c for c in out.fields["conditions"] if c["type"] == "RolloutStalled"]
    assert cond["status"] == "False"


def _spiky(t: int, every: int) -> float:
    """Power per GPU of a hung engine whose power jumps for one sample every ``every`` s."""
    return 250.0 if every and t % every == every - 1 else 60.0


def test_one_spike_neither_resets_the_run_nor_ends_the_stall():
    """A hung engine sampled every second for 120 s, power above the band for one sample in
    five (a clock switch wakes the busy-wait): stalled once 60 s of the window are judged,
    from its first frozen sample; the spikes during the stall do not end it."""
    w = stalls.StallWatch(after_s=60.0, band_w=143.0, in_flight=8)
    out = [w.sample(float(t), 100.0, _spiky(t, 5), t) for t in range(121)]
    assert out.count("started") == 1 and "ended" not in out
    assert out.index("started") == 61  # 60 s after the first quiet sample (t=1)
    assert w.stalls[0].start_s == 1.0  # the window's first frozen sample
    assert w.stalled and w.stalled_s(120.0) == 119.0
    assert w.sample(121.0, 101.0, 60.0, 121) == "ended"  # progress grows: over
    assert w.stalls[0].end_s == 120.0


def test_power_above_the_band_for_much_of_the_window_is_no_stall():
    """Progress that lags at working power (one sample in two above the band) is no stall,
    and a stall whose power comes back up for good ends once the window says so."""
    w = stalls.StallWatch(after_s=60.0, band_w=143.0, in_flight=8)
    out = [w.sample(float(t), 100.0, _spiky(t, 2), t) for t in range(200)]
    assert "started" not in out and not w.stalls
    w = stalls.StallWatch(after_s=10.0, band_w=143.0, in_flight=8)
    out = [w.sample(float(t), 5.0, 60.0 if t < 30 else 250.0, t) for t in range(60)]
    assert out.index("started") == 11 and out.index("ended") == 33
    assert 0.5 < stalls.IN_BAND_FRACTION <= 0.75


def test_a_hung_engine_with_a_power_spike_after_each_switch_is_declared_stalled(
    make_driver: DriverFactory,
):
    """Through the agent: frozen progress with requests in flight, the GPUs at near-idle power
    except one working second in every five."""
    drv = make_driver(1)
    plan = api_node.ClockPlan(
        step=0,
        phases=[api_node.PhasePlan(phase="generation", clockMHz=CANDIDATE_MHZ, state="locked")],
    )
    agent = standin_agent({POD: list(drv.uuids)}, plan, lambda: drv.virtual_s)
    agent.stall_after_s = STALL_AFTER_S
    tr = Trainer(drv, agent)
    drv.set_work(drv.uuids, "generation")
    agent.phase(POD, "generation", 0)
    tr.run(3.0, rate=100.0, in_flight=8)
    for second in range(3 * int(STALL_AFTER_S)):
        drv.freeze(drv.uuids, frozen=second % 5 != 4)  # one working second in five
        tr.run(1.0, rate=0.0, in_flight=8)
    assert _stalled_gauge(agent) == {1.0}
    assert all(g.stalled_seconds is not None for g in agent.report().gpus)
