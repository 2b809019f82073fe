"""Job-level view of per-node step records: complete RL steps, one observation each.

One ``StepObservation`` per step feeds the EE-RL controller.

Each node agent writes its own ``RLEnergyNodeReport`` (spec: ``api.node.NodeReport``) with a
bounded window of ``StepRecord``s. The operator runs one controller per job, so it folds the
nodes' records of a step into one observation:

* energy of a phase = sum over nodes (unknown if any node's is unknown: never 0);
* duration of a phase = the slowest node (the step waits for it);
* applied clock = lowest over nodes; slowdown and errors if any node saw one;
* probe slices are concatenated node by node (a probe block never mixes nodes; see ``_slices``);
* stalled time (a hung rollout: progress frozen with requests in flight at low power, the
  agent's ``rlenergy_agent.stalls``) is taken out of each node's window before the fold: the
  duration is the slowest node's unstalled time, the energy the nodes' energy minus their
  stalled energy (same source), so savings and trial evidence see only working time;
* the token workload is job-level (the trainer SDK reports it); the first node's is used.

A step is *complete* when every ready node that is expected to report it did: a node is
expected to report step ``s`` when ``first_step <= s <= last_step`` of its window would
include it, or when it has not reached ``s`` yet (then the step waits). A step that a ready
node skipped although it moved past it is *lost* (the operator counts it as missed).

Pure functions, no I/O; callers: ``rlenergy_operator.jobloop`` and tests.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

from rlenergy.api import node as api_node
from rlenergy.api import workload as api_workload
from rlenergy.control.freq import base, probe

USABLE = frozenset({"ok", "measureOnly", "degraded"})
"""GPU conditions that still measure energy."""


def node_ready(report: api_node.NodeReport) -> bool:
    """A node counts when it lists at least one GPU that still measures energy."""
    return any(g.condition in USABLE for g in report.gpus)


class StepState(enum.Enum):
    """Whether a step can be folded."""

    COMPLETE = "complete"
    """Every ready node that should report it did."""
    PENDING = "pending"
    """A ready node has not reached it yet."""
    LOST = "lost"
    """A ready node moved past it without a record (its window dropped it or it skipped)."""


def _window(report: api_node.NodeReport) -> tuple[int, int] | None:
    """The steps ``report`` answers for, (first, last); None before its first record.

    From its oldest record, or from the step after ``foldedThroughStep`` when the agent left
    folded records out (``api_node.unfolded_steps``): a step in the window without a record
    was skipped, as when the records were still there.
    """
    if not report.steps:
        return None
    steps = [r.step for r in report.steps]
    first = min(steps)
    if report.folded_through_step >= 0:
        first = min(first, report.folded_through_step + 1)
    return first, max(max(steps), report.last_step)


def step_state(step: int, reports: Sequence[api_node.NodeReport]) -> StepState:
    """Whether ``step`` is complete over the ready nodes of ``reports``."""
    seen = False
    for rep in reports:
        if not node_ready(rep):
            continue
        window = _window(rep)
        if window is None or window[1] < step:
            return StepState.PENDING
        if any(r.step == step for r in rep.steps):
            seen = True
        elif window[0] <= step:
            return StepState.LOST
    return StepState.COMPLETE if seen else StepState.PENDING


def known_steps(reports: Sequence[api_node.NodeReport]) -> list[int]:
    """Every step some node reported, ascending."""
    return sorted({r.step for rep in reports for r in rep.steps})


def records(step: int, reports: Sequence[api_node.NodeReport]) -> list[api_node.StepRecord]:
    """The records of ``step`` from ready nodes, ordered by node name."""
    out = []
    for rep in sorted(reports, key=lambda r: r.node_name):
        if not node_ready(rep):
            continue
        out += [r for r in rep.steps if r.step == step]
    return out


@dataclasses.dataclass(frozen=True)
class JobStep:
    """One RL step over all nodes.

    Attributes:
        observation: what the controller observes.
        idle_energy_j: energy outside phase windows summed over nodes, J (None: unknown).
        nodes: how many nodes contributed.
    """

    observation: base.StepObservation
    idle_energy_j: float | None
    nodes: int

    @property
    def energy_j(self) -> float | None:
        """All measured energy of the step, J (None when any part is unknown)."""
        parts = [p.energy_j for p in self.observation.phases.values()]
        parts.append(self.idle_energy_j)
        if any(p is None for p in parts):
            return None
        return sum(p for p in parts if p is not None)


def _sum(values: Sequence[float | None]) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None)


def _slices(windows: Sequence[api_node.PhaseWindowReport]) -> tuple[base.ProbeSlice, ...]:
    """Every node's probe slices, one node after the other (node order).

    Each node switches clocks on its own timer, so slices of different nodes neither start nor
    end together and a node may run more or fewer of them: slices are never merged across
    nodes, and a Thue-Morse block (8 consecutive slices) must come from one node. Every node
    but the last that has slices is cut to whole blocks (its schedule starts a block at slice
    0, so a trailing partial block can never complete), so no block spans two nodes.
    """
    lists = [list(w.slices) for w in windows if w.slices]
    out: list[base.ProbeSlice] = []
    for n, parts in enumerate(lists):
        if n < len(lists) - 1:
            parts = parts[: len(parts) - len(parts) % probe.BLOCK]
        out += [probe_slice(p) for p in parts]
    return tuple(out)


def probe_slice(p: api_node.SliceReport) -> base.ProbeSlice:
    """The controller's ``base.ProbeSlice`` of one reported slice."""
    return base.ProbeSlice(
        clock_mhz=p.clock_mhz,
        duration_s=p.duration_seconds,
        progress=p.progress,
        energy_j=p.energy_joules,
        stalled=p.stalled,
        effective_clock_mhz=p.effective_clock_mhz,
        energy_source=p.energy_source,
        rate_reports=p.rate_reports,
        lead_s=p.lead_seconds,
        lead_energy_j=p.lead_energy_joules,
    )


def _phase(
    name: str, nodes: Sequence[tuple[str, api_node.PhaseWindowReport | None]]
) -> base.PhaseObservation:
    missing = [n for n, w in nodes if w is None]
    windows = [w for _, w in nodes if w is not None]
    errors = [f"{n}: {w.error}" for n, w in nodes if w is not None and w.error]
    if missing:
        errors.append(f"no {name} window from {', '.join(missing)}")
    applied = [w.applied_clock_mhz for w in windows if w.applied_clock_mhz is not None]
    stalled_j = _sum([w.stalled_energy_joules for w in windows]) if windows else 0.0
    sources = {w.energy_source for w in windows if w.energy_source}
    energy = None if missing else _sum([w.energy_joules for w in windows])
    return base.PhaseObservation(
        phase=name,
        duration_s=max((w.duration_seconds - w.stalled_seconds for w in windows), default=0.0),
        energy_j=None if energy is None or stalled_j is None else max(energy - stalled_j, 0.0),
        requested_clock_mhz=windows[0].requested_clock_mhz if windows else None,
        applied_clock_mhz=min(applied) if applied else None,
        slowdown=any(w.slowdown for w in windows),
        slices=_slices(windows) if windows and not missing else (),
        error="; ".join(errors) or None,
        stalled_s=max((w.stalled_seconds for w in windows), default=0.0),
        stalled_energy_j=stalled_j,
        progress_gap_s=max(
            (
                math.inf if w.progress_mean_gap_seconds is None else w.progress_mean_gap_seconds
                for w in windows
            ),
            default=math.inf,
        ),
        energy_source=(sources.pop() if len(sources) == 1 else "mixed") if sources else None,
    )


def job_step(step: int, reports: Sequence[api_node.NodeReport], *, pools: bool = False) -> JobStep:
    """Fold the ready nodes' records of ``step`` into one job-level step.

    Args:
        step: the RL step.
        reports: the nodes' reports.
        pools: async mode (``spec.mode: async``): each phase runs on its own GPU pool, so a node
            whose record has windows of other phases but none of a phase is not in that
            phase's pool (not a lost window). A node with no window at all still counts as
            missing for every phase.

    Raises:
        ValueError: no ready node reported ``step``.
    """
    recs: list[tuple[str, api_node.StepRecord]] = []
    for rep in sorted(reports, key=lambda r: r.node_name):
        if node_ready(rep):
            recs += [(rep.node_name, r) for r in rep.steps if r.step == step]
    if not recs:
        raise ValueError(f"no ready node reported step {step}")
    names: list[str] = []
    for _, rec in recs:
        names += [p.phase for p in rec.phases if p.phase not in names]
    phases = {
        name: _phase(
            name,
            [
                (n, next((p for p in r.phases if p.phase == name), None))
                for n, r in recs
                if not pools or not r.phases or any(p.phase == name for p in r.phases)
            ],
        )
        for name in names
    }
    # The step's workload comes from the trainer's end_step; in async mode only the trainer
    # pool's nodes hear it, so the first record that carries one is taken.
    w = next((r.workload for _, r in recs if r.workload.samples > 0), recs[0][1].workload)
    workload = api_workload.TokenWorkload(
        samples=w.samples,
        response_tokens=w.response_tokens,
        prompt_tokens=w.prompt_tokens,
        valid_tokens=w.valid_tokens,
        mean_context_tokens=w.mean_context_tokens,
    )
    return JobStep(
        observation=base.StepObservation(step, workload, phases, _pool_idle(recs) if pools else {}),
        idle_energy_j=_sum([r.idle_energy_joules for _, r in recs]),
        nodes=len(recs),
    )


def _pool_idle(recs: Sequence[tuple[str, api_node.StepRecord]]) -> dict[str, base.PoolIdle]:
    """Per phase, its pool's idle time and energy (async mode; ``base.PoolIdle``).

    A node is in the pool of the one phase it has windows of, its GPUs those the windows
    metered; a node with windows of two phases (or none) puts pools out of reach: ``{}``.
    """
    out: dict[str, base.PoolIdle] = {}
    for _, rec in recs:
        names = {p.phase for p in rec.phases}
        if len(names) != 1:
            return {}
        name = names.pop()
        gpus = len({u for p in rec.phases for u in p.gpu_energy_joules})
        prev = out.get(name, base.PoolIdle(0.0, 0.0, 0))
        out[name] = base.PoolIdle(
            _sum([prev.energy_j, rec.idle_energy_joules]),
            _sum([prev.gpu_seconds, rec.idle_gpu_seconds]),
            prev.gpus + gpus,
        )
    return out


def supported_clocks(reports: Sequence[api_node.NodeReport]) -> tuple[int, ...]:
    """SM clocks every reporting GPU supports (intersection), descending; () when unknown."""
    tables = [
        frozenset(g.supported_clocks_mhz)
        for rep in reports
        for g in rep.gpus
        if g.supported_clocks_mhz and g.condition in USABLE
    ]
    if not tables:
        return ()
    return tuple(sorted(frozenset.intersection(*tables), reverse=True))


def plan_decisions(plan: api_node.ClockPlan) -> base.Plan:
    """An agent's reading of a published ``ClockPlan``: observe mode never sets a clock.

    Callers: the simulated node agents of the operator tests and of ``bench/scale.py``.
    """
    phases = {}
    for p in plan.phases:
        clock = p.clock_mhz if plan.enforce else None
        probe_clocks = tuple(p.probe_clocks_mhz) if plan.enforce else ()
        phases[p.phase] = base.PhaseDecision(
            clock, base.PhaseState(p.state), probe_clocks, p.probe_slice_seconds, p.reason
        )
    return base.Plan(plan.step, phases)
