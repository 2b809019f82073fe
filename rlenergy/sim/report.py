"""The main job: replay a trace through the simulator and EE-RL, beside its baselines.

``simulate`` runs the online controller (``rlenergy.control.freq``) on ``SimulatedGpu``s and
evaluates, on the same steps and noise, the default governor and the oracle (best fixed clock
per phase in hindsight meeting the threshold). Savings compare energy per valid token; trial
steps count in every figure. Callers: ``rlenergy.cli`` (``rlenergy simulate``) and
``bench/energy.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlenergy import errors
from rlenergy.api import phases as api_phases
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import config, eerl
from rlenergy.gpu import models
from rlenergy.sim import job as sim_job
from rlenergy.sim import status as sim_status
from rlenergy.sim import traces, workload


@dataclasses.dataclass(frozen=True)
class PhaseReport:
    """One phase of a simulation.

    Attributes:
        name: phase name.
        final_clock_mhz: the clock locked at the end (None: default governor).
        oracle_clock_mhz: the oracle's fixed clock (None: default governor).
        throughput_ratio: phase throughput vs default over the run, trials included.
        saving: phase energy saved vs default (fraction of the phase's default energy).
        min_throughput_ratio: the policy's threshold for the phase.
        timeline: (first step, clock or None, state) each time the decision changed.
        selections: how many times a clock was selected.
        retrials: why selection restarted, in order.
    """

    name: str
    final_clock_mhz: int | None
    oracle_clock_mhz: int | None
    throughput_ratio: float
    saving: float
    min_throughput_ratio: float
    timeline: tuple[tuple[int, int | None, str], ...]
    selections: int
    retrials: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SimulationReport:
    """Result of ``simulate`` (see ``to_json`` for the machine-readable form)."""

    trace: str
    gpu: str
    mode: str
    steps: int
    num_gpus: int
    notes: tuple[str, ...]
    online: sim_job.Totals
    default: sim_job.Totals
    oracle: sim_job.Totals
    measured_energy_j: float | None
    trial_steps: int
    phases: tuple[PhaseReport, ...]
    results: tuple[sim_job.StepResult, ...]
    default_steps: tuple[tuple[float, float], ...]
    reported: dict[str, tuple[float | None, float | None]] = dataclasses.field(default_factory=dict)
    """What the operator's status would report (``sim.status``): per phase and ``total``,
    (saving as a fraction, throughput ratio)."""
    reported_range: dict[str, tuple[tuple[float, float] | None, tuple[float, float] | None]] = (
        dataclasses.field(default_factory=dict)
    )
    """The bounds the status's evidence allows (``sim.status.Sums.saving_range``): per phase
    and ``total``, ((saving low, high), (throughput ratio low, high))."""
    truth: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """The same figures in truth: per phase and ``total``, (saving, throughput ratio) vs the
    default governor on the same steps (``total``: phase time only, as the status counts)."""
    margin_oracle_saving: dict[float, float] = dataclasses.field(default_factory=dict)
    """Per margin of ``simulate(oracle_margins=...)``: the saving (fraction of default energy
    per valid token) of the oracle held that far above every threshold, with no learning
    cost: what any controller that keeps a verified margin can reach at most."""
    learning_cost_pp: dict[float, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Per margin of ``simulate(oracle_margins=...)``: the online run's energy above that held
    oracle's, in percentage points of the job's default-governor energy, by what each phase
    window ran (``learning_cost``); the parts sum to the held oracle's saving less the online
    saving, x 100."""

    @property
    def status_errors(self) -> tuple[float | None, float | None]:
        """Largest status error over the phases and the job total.

        Returns:
            (|reported - true| saving in percentage points, |reported - true| throughput
            ratio); (None, None) where the status has no figure.
        """
        sav: list[float] = []
        thr: list[float] = []
        for key, (saving, ratio) in self.reported.items():
            true_saving, true_ratio = self.truth[key]
            if saving is None or ratio is None:
                return None, None
            sav.append(100.0 * abs(saving - true_saving))
            thr.append(abs(ratio - true_ratio))
        return (max(sav), max(thr)) if sav else (None, None)

    def status_misses(
        self, saving_pp: float = 1.0, ratio: float = 0.01
    ) -> tuple[int, int, float, float]:
        """Status figures off the truth, and whether their bounds hold the truth.

        Args:
            saving_pp: tolerance of a saving figure, percentage points.
            ratio: tolerance of a throughput ratio figure.

        Returns:
            (figures over their tolerance, of them those whose bounds miss the truth as well,
            widest saving range in pp, widest throughput ratio range) over the phases and the
            job total; a figure without bounds counts as missed.
        """
        off = unresolved = 0
        wide_pp = wide_ratio = 0.0
        for key, (sav, thr) in self.reported.items():
            true_sav, true_thr = self.truth[key]
            sav_range, thr_range = self.reported_range.get(key, (None, None))
            for point, truth, rng, tol, scale in (
                (sav, true_sav, sav_range, saving_pp, 100.0),
                (thr, true_thr, thr_range, ratio, 1.0),
            ):
                if rng is not None:
                    width = scale * (rng[1] - rng[0])
                    if scale == 1.0:
                        wide_ratio = max(wide_ratio, width)
                    else:
                        wide_pp = max(wide_pp, width)
                if point is not None and scale * abs(point - truth) <= tol:
                    continue
                off += 1
                if rng is None or not rng[0] - 1e-12 <= truth <= rng[1] + 1e-12:
                    unresolved += 1
        return off, unresolved, wide_pp, wide_ratio

    @property
    def online_saving(self) -> float:
        """Fraction of default energy per valid token saved online, trials included."""
        return _saving(self.online, self.default)

    @property
    def oracle_saving(self) -> float:
        """Fraction saved by the best fixed clocks in hindsight."""
        return _saving(self.oracle, self.default)

    @property
    def online_to_oracle(self) -> float:
        """online_saving / oracle_saving (1.0 when the oracle saves nothing and neither do we)."""
        return self._to_oracle(self.online_saving)

    @property
    def margin_oracle_to_oracle(self) -> dict[float, float]:
        """Per margin of ``margin_oracle_saving``: its saving / oracle_saving.

        As ``online_to_oracle``: the ceiling of online/oracle under that margin.
        """
        return {m: self._to_oracle(s) for m, s in self.margin_oracle_saving.items()}

    def online_to_held(self, margin: float) -> float:
        """Online saving / the saving of the oracle held ``margin`` above every threshold.

        The yardstick for a controller that verifies its threshold with that margin (1.0 when
        the held oracle saves nothing and neither does the run; 0.0 when only the run loses).

        Raises:
            KeyError: ``margin`` was not among ``simulate``'s ``oracle_margins``.
        """
        held = self.margin_oracle_saving[margin]
        if held <= 1e-9:
            return 1.0 if self.online_saving >= -1e-9 else 0.0
        return self.online_saving / held

    def _to_oracle(self, saving: float) -> float:
        if self.oracle_saving <= 1e-9:
            return 1.0 if saving >= -1e-9 else 0.0
        return saving / self.oracle_saving

    @property
    def throughput_ratio(self) -> float:
        """Whole-run throughput vs default (default time / online time), trials included."""
        return self.default.time_s / self.online.time_s

    @property
    def min_throughput_ratio(self) -> float:
        """The lowest phase threshold of the policy."""
        return min(p.min_throughput_ratio for p in self.phases)

    @property
    def measured_energy_error(self) -> float | None:
        """Measured (counter deltas) vs true energy of the online run, relative."""
        if self.measured_energy_j is None:
            return None
        return self.measured_energy_j / self.online.energy_j - 1.0

    def to_json(self) -> dict[str, Any]:
        """One JSON object: the per-phase keys of ``rlenergy simulate`` plus totals and notes."""
        return {
            "trace": self.trace,
            "gpu": self.gpu,
            "mode": self.mode,
            "steps": self.steps,
            "num_gpus": self.num_gpus,
            "online_saving": round(self.online_saving, 6),
            "oracle_saving": round(self.oracle_saving, 6),
            "online_to_oracle": round(self.online_to_oracle, 6),
            "throughput_ratio": round(self.throughput_ratio, 6),
            "min_throughput_ratio": self.min_throughput_ratio,
            "trial_steps": self.trial_steps,
            "measured_energy_error": None
            if self.measured_energy_error is None
            else round(self.measured_energy_error, 6),
            "energy_per_valid_token_j": {
                "online": self.online.energy_per_valid_token_j,
                "default": self.default.energy_per_valid_token_j,
                "oracle": self.oracle.energy_per_valid_token_j,
            },
            "totals": {
                "valid_tokens": self.online.valid_tokens,
                "online_energy_j": self.online.energy_j,
                "default_energy_j": self.default.energy_j,
                "saved_energy_j": self.default.energy_j - self.online.energy_j,
                "online_time_s": self.online.time_s,
                "default_time_s": self.default.time_s,
            },
            "phases": [
                {
                    "name": p.name,
                    "final_clock_mhz": p.final_clock_mhz,
                    "oracle_clock_mhz": p.oracle_clock_mhz,
                    "throughput_ratio": round(p.throughput_ratio, 6),
                    "saving": round(p.saving, 6),
                    "min_throughput_ratio": p.min_throughput_ratio,
                    "selections": p.selections,
                    "retrials": list(p.retrials),
                    "timeline": [
                        {"step": s, "clock_mhz": c, "state": st} for s, c, st in p.timeline
                    ],
                }
                for p in self.phases
            ],
            "notes": list(self.notes),
        }


def _saving(run: sim_job.Totals, default: sim_job.Totals) -> float:
    """Fraction of ``default``'s energy per valid token that ``run`` saves."""
    return 1.0 - run.energy_per_valid_token_j / default.energy_per_valid_token_j


COST_PARTS = ("warm-up", "probes", "interim clocks", "lock offset", "fallback", "idle")
"""The parts of ``learning_cost``, in its order."""


def learning_cost(
    job: sim_job.Job,
    results: Sequence[sim_job.StepResult],
    held_clocks_mhz: Mapping[str, int | None],
    final_clocks_mhz: Mapping[str, int | None],
    default_energy_j: float,
) -> dict[str, float]:
    """The online run's energy above a fixed-clock run's, step by step, by what each window ran.

    Each step's phase windows are compared with the same step (same noise) at
    ``held_clocks_mhz`` (``Job.step_truth``, locks released at idle as the agent does) and the
    difference goes to one part: ``probes`` (the window ran probe slices: trials and monitor
    checks), ``warm-up`` (default governor before the first lock), ``fallback``, ``lock
    offset`` (locked at the phase's final clock, ``final_clocks_mhz``) or ``interim clocks``
    (any other lock or trial window). ``idle`` is the rest of the step: the GPUs' idle draw,
    which in async mode follows the pools' times.

    Returns:
        Per part of ``COST_PARTS``, percentage points of ``default_energy_j`` (J, > 0); the
        parts sum to 100 x (online energy - held run's energy) / ``default_energy_j``.
    """
    parts = dict.fromkeys(COST_PARTS, 0.0)
    steps = {s.index: s for s in job.replay.steps}
    for r in results:
        _, held_j, _, held_phase_j = job.step_truth(
            steps[r.index], held_clocks_mhz, idle_locked=False
        )
        for p in job.phases:
            parts[_cost_part(r, p, final_clocks_mhz.get(p))] += (
                r.phase_energy_j[p] - held_phase_j[p]
            )
        parts["idle"] += (r.energy_j - sum(r.phase_energy_j.values())) - (
            held_j - sum(held_phase_j.values())
        )
    return {k: 100.0 * v / default_energy_j for k, v in parts.items()}


def _cost_part(r: sim_job.StepResult, phase: str, final_clock_mhz: int | None) -> str:
    """Which ``COST_PARTS`` entry one phase window of a step belongs to."""
    state = r.states.get(phase, "warmup")
    if r.probing.get(phase):
        return "probes"
    if state in ("warmup", "observe"):
        return "warm-up"
    if state == "fallback":
        return "fallback"
    if state == "locked" and r.clocks_mhz.get(phase) == final_clock_mhz:
        return "lock offset"
    return "interim clocks"


def _timeline(
    results: list[sim_job.StepResult], phase: str
) -> tuple[tuple[int, int | None, str], ...]:
    out: list[tuple[int, int | None, str]] = []
    for r in results:
        state = r.states.get(phase, "default")
        if r.probing.get(phase) and state != "locked":
            state = "trial"
        key = (r.clocks_mhz.get(phase), state)
        if not out or (out[-1][1], out[-1][2]) != key:
            out.append((r.index, key[0], key[1]))
    return tuple(out)


def _checked_sku(gpu: str, steps: int, oracle_margins: Sequence[float]) -> models.GpuSku:
    """The SKU ``gpu`` names, once the step count and oracle margins are valid.

    Raises:
        InvalidInputError: unknown GPU, ``steps < 1`` or a negative margin.
    """
    if steps < 1:
        raise errors.InvalidInputError("--steps", f"must be >= 1, got {steps}")
    for margin in oracle_margins:
        if not margin >= 0:
            raise errors.InvalidInputError("oracle_margins", f"must be >= 0, got {margin}")
    try:
        return models.get_sku(gpu)
    except KeyError:
        raise errors.InvalidInputError(
            "--gpu", f"unknown GPU {gpu!r}; known: {', '.join(models.sku_names())}"
        ) from None


def _checked_phases(spec: api_policy.RLEnergyPolicySpec, mode: sim_job.Mode) -> list[str]:
    """The training sub-phases the policy names, once every phase can be simulated.

    Raises:
        InvalidInputError: a phase with no simulated work, or sub-phases in async mode.
    """
    known = (*workload.PHASES, *api_phases.SUBPHASE_BY_NAME)
    for i, ph in enumerate(spec.phases):
        if ph.name not in known:
            raise errors.InvalidInputError(
                f"spec.phases[{i}].name",
                f"the simulator runs phases {', '.join(known)}; {ph.name!r} has no simulated work",
            )
    named_subphases = [p.name for p in spec.phases if p.name in api_phases.SUBPHASE_BY_NAME]
    if named_subphases and mode == "async":
        raise errors.InvalidInputError(
            "spec.phases",
            f"training sub-phases ({', '.join(named_subphases)}) are simulated in sync mode "
            "only; use --mode sync or the phases generation and training",
        )
    return named_subphases


def _check_logged_subphases(
    spec: api_policy.RLEnergyPolicySpec, replay: workload.Replay, trace_name: str
) -> None:
    """Every training sub-phase the policy names is one the trace logs.

    Raises:
        InvalidInputError: a named sub-phase the trace has no time for.
    """
    for i, ph in enumerate(spec.phases):
        if ph.name in api_phases.SUBPHASE_BY_NAME and ph.name not in replay.phase_names:
            logged = [n for n in replay.phase_names if n in api_phases.SUBPHASE_BY_NAME]
            raise errors.InvalidInputError(
                f"spec.phases[{i}].name",
                f"trace {trace_name} logs no {api_phases.SUBPHASE_BY_NAME[ph.name].timing_key} "
                f"time; its training sub-phases: {', '.join(logged) or 'none'}",
            )


def simulate(
    trace: str,
    gpu: str = "h100-sxm",
    mode: sim_job.Mode = "sync",
    *,
    steps: int = 200,
    policy: api_policy.RLEnergyPolicySpec | None = None,
    seed: int = 0,
    on_step: Callable[[sim_job.StepResult], None] | None = None,
    split: bool | None = None,
    idle_lock_mhz: int | None = None,
    oracle_margins: tuple[float, ...] = (),
) -> SimulationReport:
    """Replay ``trace`` on ``gpu`` in ``mode`` under EE-RL and the baselines.

    Args:
        trace: packaged trace name or path (CSV or verl console log).
        gpu: simulated SKU (``rlenergy.gpu.models.sku_names()``).
        mode: ``sync`` or ``async``.
        steps: RL steps to replay (cyclically if the trace is shorter).
        policy: the policy spec (default: both phases at minThroughputRatio 0.95). Its
            ``mode`` is overridden by ``mode``.
        seed: noise seed.
        on_step: progress callback.
        split: simulate the training side as the sub-phases the trace logs, each with its own
            physics (``workload.from_trace``); default: when the policy names a training
            sub-phase (``rlenergy.api.phases.TRAINING_SUBPHASES``). ``True`` with the default
            policy measures two phases on the split physics (what naming sub-phases adds).
        idle_lock_mhz: lock the GPUs at this clock in each step's idle gap instead of the
            default governor (``sim.job.run_job``); None: the node agent's reset.
        oracle_margins: throughput-ratio margins (each >= 0) at which to search the oracle
            again with every threshold raised by the margin
            (``SimulationReport.margin_oracle_saving``).

    Raises:
        InvalidInputError: unknown trace or GPU, bad step count, a negative oracle margin,
            a policy phase the simulator
            cannot run (a custom name, a sub-phase the trace does not log, sub-phases in async
            mode), or clocks the GPU does not support.
    """
    sku = _checked_sku(gpu, steps, oracle_margins)
    spec = policy or api_policy.RLEnergyPolicySpec()
    spec = spec.model_copy(update={"mode": mode})
    named_subphases = _checked_phases(spec, mode)
    parsed = traces.load_trace(trace)
    replay = workload.from_trace(
        parsed, sku, steps, split=bool(named_subphases) if split is None else split
    )
    _check_logged_subphases(spec, replay, parsed.name)
    try:
        job = sim_job.Job(replay, sku, mode, seed=seed, phases=[p.name for p in spec.phases])
    except ValueError as exc:
        raise errors.InvalidInputError("--mode", str(exc)) from None
    controller = config.build_controller(spec, sku.supported_sm_clocks_mhz())
    notes = list(replay.notes)
    if mode == "async" and job.num_gpus != replay.num_gpus:
        notes.append(f"async needs two pools: {job.num_gpus} GPUs simulated")
    for name in job.phases:
        if spec.phase(name) is None:
            notes.append(f"phase {name} not in the policy: default governor")
    account = sim_status.StatusAccount(controller, async_mode=mode == "async")
    results, _ = sim_job.run_job(job, account, on_step=on_step, idle_lock_mhz=idle_lock_mhz)
    online = sim_job.totals(job, results)
    default = sim_job.default_run(job)
    thresholds = {p.name: p.min_throughput_ratio for p in spec.phases}
    oracle_run, *held = sim_job.oracles(
        job,
        [{p: thresholds.get(p, 1.0) + m for p in job.phases} for m in (0.0, *oracle_margins)],
    )
    margin_oracle_saving = {
        m: _saving(h.totals, default) for m, h in zip(oracle_margins, held, strict=True)
    }
    final_clocks = {n: pc.locked_clock_mhz for n, pc in controller.phases.items()}
    cost = {
        m: learning_cost(job, results, h.clocks_mhz, final_clocks, default.energy_j)
        for m, h in zip(oracle_margins, held, strict=True)
    }
    measured = [r.measured_energy_j for r in results]
    summary = controller.summary()
    phase_reports = []
    for name in job.phases:
        pc: eerl.PhaseController | None = controller.phases.get(name)
        phase_reports.append(
            PhaseReport(
                name=name,
                final_clock_mhz=pc.locked_clock_mhz if pc else None,
                oracle_clock_mhz=oracle_run.clocks_mhz.get(name),
                throughput_ratio=default.phase_time_s[name] / online.phase_time_s[name],
                saving=1.0 - online.phase_energy_j[name] / default.phase_energy_j[name],
                min_throughput_ratio=thresholds.get(name, 1.0),
                timeline=_timeline(results, name),
                selections=int(str(summary[name]["selections"])) if pc else 0,
                retrials=tuple(pc.retrial_reasons) if pc else (),
            )
        )
    default_steps = []
    for s in replay.steps:
        t, e, _, _ = job.step_truth(s, {})
        default_steps.append((t, e))
    measured_total = sum(r.measured_energy_j or 0.0 for r in results)
    account.add_idle(measured_total - account.phase_measured_j)
    reported = {name: (acc.saving, acc.throughput_ratio) for name, acc in account.phases.items()}
    reported["total"] = (account.total.saving, account.total.throughput_ratio)
    reported_range = {
        name: (acc.saving_range, acc.throughput_ratio_range)
        for name, acc in [*account.phases.items(), ("total", account.total)]
    }
    truth = {p.name: (p.saving, p.throughput_ratio) for p in phase_reports}
    other_s = sum(s.other_time_s for s in replay.steps)
    truth["total"] = (
        1.0 - online.energy_j / default.energy_j,
        (default.time_s - other_s) / (online.time_s - other_s),
    )
    return SimulationReport(
        trace=parsed.name,
        gpu=sku.key,
        mode=mode,
        steps=steps,
        num_gpus=job.num_gpus,
        notes=tuple(notes),
        online=online,
        default=default,
        oracle=oracle_run.totals,
        measured_energy_j=None
        if any(m is None for m in measured)
        else sum(m or 0.0 for m in measured),
        trial_steps=controller.trial_steps,
        phases=tuple(phase_reports),
        results=tuple(results),
        default_steps=tuple(default_steps),
        reported=reported,
        reported_range=reported_range,
        truth={k: v for k, v in truth.items() if k in reported},
        margin_oracle_saving=margin_oracle_saving,
        learning_cost_pp=cost,
    )
