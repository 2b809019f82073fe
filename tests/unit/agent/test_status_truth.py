"""The e2e's path minus Kubernetes, judged against the truth: agent core on the stand-in NVML
(8 simulated H100s, virtual time) + the operator's ``JobLoop``, replaying the full-stack e2e's
compressed verl trace (``fullstack.compressed_replay``) under the sample sync policy.

The agent meters the phase windows and probe slices exactly as in the e2e (the same
``service.Agent``, the stand-in's instant power and counters); the loop plans every step from
the agent's node report. The simulator knows each phase's time and energy under the default
governor for the same steps, so we test:

* the status's per-phase and total saving within ``SAVING_TOLERANCE_PP`` and throughput ratio
  within ``RATIO_TOLERANCE`` of the truth (trials included);
* measured phase energy equal to the GPUs' true energy (within ``ENERGY_TOLERANCE``);
* every probe block's throughput ratio, as the node report gives it to the operator, within
  ``BLOCK_TOLERANCE`` of the truth at its clock;
* each locked clock keeps its threshold on the run's steps in truth, and the whole run, trials
  included, within ``TRIAL_ALLOWANCE`` of it.

Four cases: ``exact`` switches slices at the trainer's tick boundaries; ``real-time`` lets the
agent switch inside a tick and books the tick at the clock read at its end, as the e2e's
harness does in real time (report intervals then straddle switches; measured before the
agent's slices took their rates from the reports inside them: a generation lock at 1380 MHz,
true ratio 0.946 against 0.95, reported ratio 0.961 vs 0.948 true at an 8 ms tick);
``e2e-cadence`` adds what full-stack runs on a loaded machine show: ticks of 8-25 ms at random
and a switch over the 8 GPUs that takes 5 ms, so ticks end while it runs. Measured before the
agent left the reports made during a switch out of the slices' rates: training
blocks at 1200 MHz read 0.68-0.70 against a true 0.644, at 1560 MHz 0.83-0.84 against 0.814
(in a run with 5 ms switches and the earlier progress shape, training locked 1890 MHz, true
ratio 0.961 against 0.97); after: every block within 0.01, status saving 15.95 % vs 15.62 %
true (generation) and 2.32 % vs 2.26 % (training). ``work-starts-late`` adds a 12 ms lag
between the phase signal and the GPUs' first work (``CASES``).

Virtual time makes the run reproducible and independent of machine load; the e2e runs the same
comparison in real time across processes (tests/e2e/test_full_stack.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_support import DriverFactory, standin_agent
from rlenergy_agent import service
from rlenergy_dev import fullstack, standin
from rlenergy_operator import jobloop

from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import policy
from rlenergy.gpu import models
from rlenergy.sim import job as sim_job
from rlenergy.sim import workload

ROOT = Path(__file__).resolve().parents[3]
POD = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
SKU = models.get_sku("h100-sxm")
STEPS = 40
TICK_S = 0.004
"""The trainer's progress-report period, as in the full-stack harness."""
REAL_TIME_TICK_S = 0.008
"""Trainer tick of the real-time case: the e2e's 4 ms sleep plus the work of three ranks on a
loaded machine."""
E2E_TICKS_S = (0.008, 0.012, 0.016, 0.02, 0.025)
"""Trainer ticks of the e2e-cadence case, drawn at random (seeded): what full-stack runs on a
loaded machine measured (p50 8-23 ms, p95 16-100 ms)."""
E2E_SWITCH_S = 0.005
"""How long the agent's switch over 8 GPUs takes in the e2e-cadence case, s (8 NVML writes and
read-backs through pynvml and the stand-in on a loaded machine)."""
E2E_SIGNAL_LAG_S = 0.012
"""How long after its phase signal a rank's work starts, and its end signal after its last
report, in the e2e-cadence case, s: the full-stack harness signals its three ranks one after
the other (a round trip each, 1-3 ms on a loaded machine) before any work starts; the first
slice's first power sample falls 5 ms in (a 40 ms slice, four samples)."""
SAVING_TOLERANCE_PP = 1.0
RATIO_TOLERANCE = 0.01
ENERGY_TOLERANCE = 0.01
BLOCK_TOLERANCE = 0.01
"""Largest gap between a probe block's throughput ratio and the truth at its clock (measured
0.000-0.007 here; a 5 ms switch counted into the slices read blocks up to 0.06 off)."""
TRIAL_ALLOWANCE = 0.03
"""How far a phase's whole-run true ratio may fall below its threshold: 40 steps of which 4
warm up and 8-26 probe (generation's 0.55 s phases get about half the slices a trial step
needs, so twice the trial steps), half of each probe's slices at the lever-arm clock
(``eerl.PROBE_MIN_RATIO``, 0.85)."""


def _spec() -> policy.RLEnergyPolicySpec:
    body = yaml.safe_load((ROOT / "crds" / "samples" / "sync-job.yaml").read_text())
    body["spec"]["controller"] = {"warmupSteps": 4, "trialSteps": 4}
    return policy.parse_policy(body["spec"])


def _phase(
    drv: standin.StandinDriver,
    agent: service.Agent,
    job: sim_job.Job,
    step: workload.StepWork,
    phase: str,
    ticks: Callable[[], float],
    real_time: bool,
    lags_s: tuple[float, float] = (0.0, 0.0),
) -> tuple[float, float, float]:
    """Run one phase to the end of its work.

    ``ticks()`` gives each trainer tick's length, s. ``real_time``: the agent switches slices
    when they are due, inside the trainer's tick, and the trainer books the whole tick at the
    clock it reads at the tick's end (the full-stack harness's order: sleep, read the clock,
    advance the counters, report progress stamped with the tick's end), so a report interval
    straddling a switch mixes two clocks. Otherwise slices switch at the tick's start and
    every tick runs one clock. The rest of the last tick after the work is done idles, booked
    apart (``fullstack.tail_label``) as in the full-stack harness. ``lags_s``: the
    GPUs' work starts ``lags_s[0]`` after the phase signal and the end signal follows the last
    progress report ``lags_s[1]`` later, with the prober running in between (the full-stack harness
    signals its three ranks one after the other before their work starts, and each rank's
    end signal leaves after its last report); the GPUs idle meanwhile, booked with the tail
    (the default governor's run would wait as long).

    Returns:
        (work time, s; the GPUs' energy over the agent's window, J; the idle tail's, J).
    """
    uuids = list(drv.uuids)
    pw = step.phase(phase)
    tokens = step.workload.phase_tokens(phase)
    label = f"{phase}-{step.index}"
    agent.phase(POD, phase, step.index)
    drv.set_work(uuids, "idle", fullstack.tail_label(label))
    _lag(drv, agent, lags_s[0])  # the GPUs idle at the slice's lock: no cap
    drv.set_work(uuids, pw.kind, label)
    work, start = 0.0, drv.virtual_s
    while True:
        tick_s = ticks()
        due = agent.probe_tick()
        if real_time:
            tick_start = drv.virtual_s
            while due is not None and due < tick_start + tick_s:
                drv.virtual_s = max(due, drv.virtual_s)  # the prober wakes inside the tick
                due = agent.probe_tick()
            drv.virtual_s = tick_start
        clock = min(drv.clock_mhz(u) for u in uuids)
        t_full = job.phase_truth(step, phase, clock)[0]
        left_s = (1.0 - work) * t_full
        if tick_s < left_s:
            drv.advance(tick_s)
        else:
            drv.advance(left_s)
            drv.set_work(uuids, "idle", fullstack.tail_label(label))
            drv.advance(tick_s - left_s)
        work += tick_s / t_full
        done = min(work, 1.0)
        agent.progress_total(
            POD, tokens * workload.reported_progress(done, pw.progress_shape), drv.virtual_s
        )
        if work >= 1.0:
            work_s = drv.virtual_s - start - (work - 1.0) * t_full
            break
    _lag(drv, agent, lags_s[1])  # the prober may switch after the last report
    drv.set_work(uuids, "idle", f"idle-{step.index}")
    agent.phase(POD, "idle", step.index)
    tail_j = sum(drv.truth_j(u, fullstack.tail_label(label)) for u in uuids)
    return work_s, sum(drv.truth_j(u, label) for u in uuids) + tail_j, tail_j


def _lag(drv: standin.StandinDriver, agent: service.Agent, lag_s: float) -> None:
    """Let ``lag_s`` of virtual time pass with the GPUs' counters and the prober running."""
    end = drv.virtual_s + lag_s
    due = agent.probe_tick()
    while due is not None and due < end:
        drv.advance(max(due - drv.virtual_s, 0.0))
        due = agent.probe_tick()
    drv.advance(max(end - drv.virtual_s, 0.0))


def _block_errors(
    job: sim_job.Job, step: workload.StepWork, report: api_node.NodeReport
) -> list[tuple[str, int, int, float, float]]:
    """``fullstack.probe_block_errors`` of ``step``'s record in the node report."""
    rec = next(r for r in report.steps if r.step == step.index)
    # Each slice says how many reports its rate came from (< 2: its block is dropped).
    assert all(s.rate_reports is not None for w in rec.phases for s in w.slices), rec.phases
    return fullstack.probe_block_errors(job, step, rec.phases)


def _leads(
    step: workload.StepWork, report: api_node.NodeReport
) -> list[tuple[float, float | None]]:
    """(lead s, lead energy J) of the first slice of each probed window of ``step``."""
    rec = next(r for r in report.steps if r.step == step.index)
    return [
        (w.slices[0].lead_seconds, w.slices[0].lead_energy_joules) for w in rec.phases if w.slices
    ]


def _slow_switch(agent: service.Agent, drv: standin.StandinDriver, switch_s: float) -> None:
    """Each clock write takes ``switch_s / 8`` of virtual time, so a switch over the 8 GPUs
    takes ``switch_s`` and the trainer's tick can end while it runs."""
    apply = agent.actuator.apply

    def slow(*args: Any, **kwargs: Any) -> Any:
        drv.virtual_s += switch_s / 8
        return apply(*args, **kwargs)

    agent.actuator.apply = slow  # type: ignore[method-assign]


CASES: dict[str, tuple[tuple[float, ...], bool, float, tuple[float, float]]] = {
    "exact": ((TICK_S,), False, 0.0, (0.0, 0.0)),
    "real-time": ((REAL_TIME_TICK_S,), True, 0.0, (0.0, 0.0)),
    "e2e-cadence": (E2E_TICKS_S, True, E2E_SWITCH_S, (0.0, E2E_SIGNAL_LAG_S)),
    "work-starts-late": (E2E_TICKS_S, True, E2E_SWITCH_S, (E2E_SIGNAL_LAG_S, E2E_SIGNAL_LAG_S)),
}
"""(trainer ticks to draw from, s; real-time switching; the switch's length, s; the lags of
the work's start and of the end signal, s) per case. ``work-starts-late``: the GPUs' work
starts 12 ms after the phase signal. Before the agent split that lead off the first slice
(``probes.work_start``, ``SliceReport.lead_seconds``) the status's generation saving read
17.10 % against a true 15.53 % (predicted default-governor energy 76,017 J vs 74,604 J): the
paired default credited the idle lead at the work's rate and power; after: 16.08 % vs
16.13 % (2026-12-04)."""


@pytest.mark.parametrize("case", list(CASES))
def test_status_matches_the_truth_on_the_agent_path(make_driver: DriverFactory, case: str) -> None:
    tick_choices, real_time, switch_s, lags_s = CASES[case]
    rng = random.Random(0)
    job, _ = fullstack.compressed_replay(
        fullstack.DEFAULT_TRACE, SKU, STEPS, num_gpus=8, longest_phase_s=fullstack.LONGEST_PHASE_S
    )
    drv = make_driver(8)
    spread = dict(zip(drv.uuids, job.power_spread, strict=True))
    for u, factor in spread.items():
        drv.set_power_spread(u, factor)
    agent = standin_agent({POD: list(drv.uuids)}, None, lambda: drv.virtual_s)
    if switch_s:
        _slow_switch(agent, drv, switch_s)
    spec = _spec()
    loop = jobloop.JobLoop(spec, 1)
    loop.advance([agent.report()])
    run_s = {p: 0.0 for p in fullstack.PHASES}
    block_errors: list[tuple[str, int, int, float, float]] = []
    leads: list[tuple[float, float | None]] = []
    run_j, def_s, def_j = dict(run_s), dict(run_s), dict(run_s)
    for step in job.replay.steps:
        agent.set_plan(loop.plan("t"))
        for phase in fullstack.PHASES:
            work_s, joules, tail_j = _phase(
                drv, agent, job, step, phase, lambda: rng.choice(tick_choices), real_time, lags_s
            )
            run_s[phase] += work_s
            run_j[phase] += joules
            kind = step.phase(phase).kind
            t_def = job.phase_truth(step, phase, None)[0]
            def_s[phase] += t_def
            def_j[phase] += (
                SKU.power_w(kind, SKU.effective_clock_mhz(kind, None))
                * sum(spread.values())
                * t_def
                + tail_j  # the default governor's run idles as long after the work
            )
            if phase == "generation":
                drv.advance(step.other_time_s)
        w = step.workload
        workload = api_node.TokenWorkloadReport(
            samples=w.samples,
            response_tokens=w.response_tokens,
            prompt_tokens=w.prompt_tokens,
            valid_tokens=w.valid_tokens,
            mean_context_tokens=w.mean_context_tokens,
        )
        agent.end_step(POD, step.index, workload)
        node_report = agent.report()
        block_errors.extend(_block_errors(job, step, node_report))
        leads.extend(_leads(step, node_report))
        loop.advance([node_report])
    totals = loop.totals()
    assert totals.steps == STEPS and totals.compared_steps == STEPS
    # Every probe block's throughput ratio, as the operator reads it from the node report,
    # against the truth at its clock.
    assert block_errors
    off = [b for b in block_errors if abs(b[3] - b[4]) > BLOCK_TOLERANCE]
    assert not off, (len(block_errors), off)
    # The probed windows' first slices: the lead the agent placed before the work began.
    # It is the lag before the GPUs' first work (12 ms late, else none), within 1 ms, and the
    # GPUs idled through it (the first slice's power sample 5 ms in read idle power).
    assert leads
    lead_lag_s = lags_s[0]
    assert all(lead_lag_s - 1e-6 <= s <= lead_lag_s + 1e-3 for s, _ in leads), leads
    if lead_lag_s:
        idle_w = [j / s for s, j in leads if j is not None]
        assert len(idle_w) == len(leads)
        want_w = SKU.idle_power_for(None) * sum(spread.values())
        assert all(w == pytest.approx(want_w, rel=0.05) for w in idle_w), (want_w, idle_w)

    thresholds = {p.name: p.min_throughput_ratio for p in spec.phases}
    default = sim_job.default_run(job)
    for ph in loop.phase_status():
        name = ph.name
        true_saving = 100.0 * (1.0 - run_j[name] / def_j[name])
        true_ratio = def_s[name] / run_s[name]
        assert ph.saving.percent == pytest.approx(true_saving, abs=SAVING_TOLERANCE_PP), ph
        assert ph.throughput_ratio == pytest.approx(true_ratio, abs=RATIO_TOLERANCE), ph
        assert ph.measured_joules == pytest.approx(run_j[name], rel=ENERGY_TOLERANCE)
        assert true_ratio >= thresholds[name] - TRIAL_ALLOWANCE, (name, true_ratio)
        if ph.clock_mhz is not None:
            fixed = sim_job.fixed_run(job, {name: ph.clock_mhz})
            lock_ratio = default.phase_time_s[name] / fixed.phase_time_s[name]
            assert lock_ratio >= thresholds[name], (name, ph.clock_mhz, lock_ratio)
    idle_j = totals.measured_joules - sum(run_j.values())
    e_run, e_def = sum(run_j.values()) + idle_j, sum(def_j.values()) + idle_j
    assert totals.saving_percent == pytest.approx(
        100.0 * (1.0 - e_run / e_def), abs=SAVING_TOLERANCE_PP
    )
    assert totals.throughput_ratio == pytest.approx(
        sum(def_s.values()) / sum(run_s.values()), abs=RATIO_TOLERANCE
    )
    print(
        "agent path vs truth:",
        {
            ph.name: (
                ph.saving.percent,
                round(100.0 * (1.0 - run_j[ph.name] / def_j[ph.name]), 3),
                ph.throughput_ratio,
                round(def_s[ph.name] / run_s[ph.name], 4),
                ph.clock_mhz,
            )
            for ph in loop.phase_status()
        },
    )
    gen = next(p for p in loop.phase_status() if p.name == "generation")
    assert gen.state == "locked" and gen.saving.percent is not None and gen.saving.percent > 5.0
