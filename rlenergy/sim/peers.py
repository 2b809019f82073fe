"""Peers of EE-RL a user could pick instead, and bounds chosen in hindsight (bench/peers.py).

Online peers pay for what they learn, as EE-RL does:

* ``StaticSweepUser``: one SM clock for the whole GPU (``nvidia-smi -lgc``, no per-phase
  switching). Over the first steps the user runs the default governor and then each sweep
  clock for a few steps, compares energy and time per valid token (what verl's step log and
  ``nvidia-smi`` show), and locks the cheapest clock whose throughput keeps the threshold for
  the rest of the job.
* Zeus's ``GlobalPowerLimitOptimizer`` (the real package; bench/peers.py drives it).

Bounds with no learning cost, chosen on the truth of the same job (``Job`` analytics):

* ``best_static_clock``: one clock for every phase, the lowest energy per valid token whose
  whole-job throughput ratio vs the default governor keeps the threshold;
* ``best_static_power_limit``: the same over power limits (default governor under the limit);
* the per-phase oracle is ``rlenergy.sim.job.oracle``.

The hindsight peers are held to the job's throughput (the user's view), not to each phase's
threshold as EE-RL and the oracle are, which can only favour them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rlenergy.control.freq import base
from rlenergy.sim import job as sim_job


@dataclasses.dataclass(frozen=True)
class Bound:
    """A setting chosen in hindsight and what it does over the whole job.

    Attributes:
        setting: the clock (MHz) or power limit (W); None: the default governor.
        totals: the job's truth at that setting.
    """

    setting: float | None
    totals: sim_job.Totals


def _best(
    job: sim_job.Job,
    options: Sequence[tuple[float | None, sim_job.Totals]],
    threshold: float,
) -> Bound:
    default = sim_job.default_run(job)
    best = Bound(None, default)
    for setting, tot in options:
        if default.time_s / tot.time_s < threshold - 1e-12:
            continue
        if tot.energy_per_valid_token_j < best.totals.energy_per_valid_token_j:
            best = Bound(setting, tot)
    return best


def best_static_clock(
    job: sim_job.Job, threshold: float, clocks_mhz: Sequence[int] | None = None
) -> Bound:
    """The single clock for all phases, chosen in hindsight (see module docstring).

    Args:
        job: the job (its noise draws are the run's).
        threshold: least whole-job throughput ratio vs the default governor, in (0, 1].
        clocks_mhz: clocks to consider (default: every supported clock down to half of max).
    """
    sku = job.sku
    grid = clocks_mhz or [c for c in sku.supported_sm_clocks_mhz() if c >= sku.max_sm_clock_mhz / 2]
    options: list[tuple[float | None, sim_job.Totals]] = [
        (float(c), sim_job.fixed_run(job, dict.fromkeys(job.phases, float(c)))) for c in grid
    ]
    return _best(job, options, threshold)


def best_static_power_limit(job: sim_job.Job, threshold: float, step_w: float = 5.0) -> Bound:
    """The power limit for all GPUs under the default governor, chosen in hindsight.

    Args:
        job: the job.
        threshold: least whole-job throughput ratio vs the default governor, in (0, 1].
        step_w: grid step from the SKU's default limit down to its minimum, W.
    """
    sku = job.sku
    limits: list[float] = []
    w = sku.power_limit_w
    while w >= sku.min_power_limit_w - 1e-9:
        limits.append(w)
        w -= step_w
    options: list[tuple[float | None, sim_job.Totals]] = [
        (lim, sim_job.fixed_run(job, {}, lim)) for lim in limits
    ]
    return _best(job, options, threshold)


class StaticSweepUser:
    """A user who sweeps one GPU clock over the first steps, then locks the best one.

    Satisfies ``rlenergy.control.freq.base.FrequencyPolicy``. The sweep runs the default
    governor, then each clock of ``sweep_mhz`` (descending), ``steps_per_setting`` steps each,
    on every phase at once (a GPU lock does not know phases). It then locks, for every phase,
    the setting with the lowest mean energy per valid token among those whose mean time per
    valid token is at most the default's / ``threshold`` (the default governor when none is).
    Step time is the sum of phase times (sync) or the longest phase (async pools run at once);
    step energy is the sum of the phases' counter readings.

    Args:
        phases: phase names.
        sweep_mhz: clocks to try, MHz.
        threshold: least throughput ratio vs the default governor, in (0, 1].
        steps_per_setting: steps per setting (the first of each is discarded as a transient).
        async_mode: the phases run at once on separate pools.
    """

    def __init__(
        self,
        phases: Sequence[str],
        sweep_mhz: Sequence[int],
        threshold: float,
        *,
        steps_per_setting: int = 3,
        async_mode: bool = False,
    ) -> None:
        if steps_per_setting < 2:
            raise ValueError("steps_per_setting must be >= 2 (the first step is discarded)")
        self.phases = tuple(phases)
        self.settings: tuple[int | None, ...] = (None, *sorted(sweep_mhz, reverse=True))
        self.threshold = threshold
        self.steps_per_setting = steps_per_setting
        self.async_mode = async_mode
        self.locked: int | None = None
        self.done = False
        self._samples: dict[int | None, list[tuple[float, float]]] = {}

    @property
    def sweep_steps(self) -> int:
        """Steps the sweep takes."""
        return len(self.settings) * self.steps_per_setting

    def _setting(self, step: int) -> int | None:
        if step < self.sweep_steps:
            return self.settings[step // self.steps_per_setting]
        return self.locked

    def decide(self, step: int) -> base.Plan:
        """The sweep setting of ``step``, or the locked clock after the sweep."""
        if step >= self.sweep_steps and not self.done:
            self._choose()
        clock = self._setting(step)
        state = base.PhaseState.TRIAL if step < self.sweep_steps else base.PhaseState.LOCKED
        reason = "sweep" if state is base.PhaseState.TRIAL else "locked"
        return base.Plan(
            step, {p: base.PhaseDecision(clock, state, reason=reason) for p in self.phases}
        )

    def observe(self, observation: base.StepObservation) -> None:
        """Record the step's time and energy per valid token during the sweep."""
        step = observation.step
        if step >= self.sweep_steps or step % self.steps_per_setting == 0:
            return
        obs = list(observation.phases.values())
        tokens = observation.workload.valid_tokens
        if not obs or tokens <= 0 or any(o.energy_j is None or o.error for o in obs):
            return
        times = [o.duration_s for o in obs]
        t = max(times) if self.async_mode else sum(times)
        e = sum(o.energy_j or 0.0 for o in obs)
        self._samples.setdefault(self._setting(step), []).append((t / tokens, e / tokens))

    def _choose(self) -> None:
        self.done = True
        means = {
            s: (sum(x[0] for x in v) / len(v), sum(x[1] for x in v) / len(v))
            for s, v in self._samples.items()
            if v
        }
        if None not in means:
            self.locked = None
            return
        t_def, e_def = means[None]
        best, best_e = None, e_def
        for s, (t, e) in means.items():
            if s is None or t_def / t < self.threshold:
                continue
            if e < best_e:
                best, best_e = s, e
        self.locked = best


def saving(run: sim_job.Totals, default: sim_job.Totals) -> float:
    """Energy per valid token saved vs the default governor (fraction)."""
    return 1.0 - run.energy_per_valid_token_j / default.energy_per_valid_token_j


def throughput(run: sim_job.Totals, default: sim_job.Totals) -> float:
    """Whole-job throughput vs the default governor (default time / run time)."""
    return default.time_s / run.time_s if run.time_s > 0 else math.inf


def capture_share(ee: float, peer: float, oracle: float) -> float:
    """Share of the oracle's saving advantage over ``peer`` that ``ee`` captures.

    Args:
        ee: EE-RL's saving, fraction of default energy per valid token.
        peer: the best online peer's saving (0.0 when none keeps the threshold).
        oracle: the per-phase oracle's saving.

    Returns:
        (ee - peer) / (oracle - peer); where the oracle leads the peer by under 1e-9, 1.0 if
        ``ee`` is no more than 1e-9 behind the peer, else 0.0.
    """
    gap = oracle - peer
    if gap <= 1e-9:
        return 1.0 if ee >= peer - 1e-9 else 0.0
    return (ee - peer) / gap
