"""The job-level EE-RL loop of one policy: node reports in, plan and accounting out.

Pure and deterministic (no kopf, no Kubernetes client, time passed in): the timer handler
feeds it the policy's node reports and writes what it returns into ``status``.

Order of calls on the controller, the same live and after a restart::

    decide(0), observe(0), decide(1), observe(1), ...

``decide(s)`` produces the plan published for step ``s``; ``observe(s)`` is called once step
``s`` is complete (``rlenergy.control.freq.aggregate``). Because the controller is
deterministic, replaying the node reports' steps in that order rebuilds its state exactly.

Accounting (``status.totals`` and each phase's joules and seconds) is folded once per step
and checkpointed in status together with ``totals.throughStep``: the status patch that adds
step ``s`` to the totals also moves the checkpoint, so a restart neither loses nor double
counts a step (steps ``<= throughStep`` only rebuild the controller, later ones are folded).
A new leader recomputes the checkpoint's measured sums (``measuredJoules``, ``validTokens``,
``steps`` ...) from the node reports' records where these still hold every counted step
(``measured_from_reports``), so a checkpoint folded from a view that lacked a node's report
is corrected, and after any failover the measured totals equal the sum of the records.

The agents leave out of their reports the records at or before the ``totals.throughStep``
they read from the API server (``api_node.unfolded_steps``; the report's
``foldedThroughStep`` says so): those are in a stored checkpoint for good, so a restart
folds the later records onto it exactly, while the controller is rebuilt from the records
the reports still hold (after a failover past the first unfolded step: none, and the
controller starts over from its warm-up). A replica whose checkpoint is older than the one
the agents pruned against does not fold (``handlers._not_behind``).

Stalled rollouts (``rlenergy.control.freq.aggregate``): the phase windows come without their
stalled time and energy; ``totals.stalledSeconds`` and ``stalledJoules`` carry them, the
stalled energy counts in ``measuredJoules`` but never in a compared figure.

Like with like: a phase window is compared only when its energy comes from the same source
(counter, integrated power, ...) as the phase's first default-governor window, the basis of the
default-governor model; a step with a window from another source is measured but not compared
(``totals.sourceMismatchSteps``), so a counter and a power sensor that disagree (the agents'
energy cross-check) never meet in one saving. Probe blocks compare power only between slices of
one source (``rlenergy.control.freq.probe``).

Default-governor predictions: a phase window that ran under the default governor is its own
prediction; otherwise the controller's default-governor model (fitted in warm-up) predicts
time and energy on the step's tokens. A step whose energy or prediction is unknown is not
compared (never counted as 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rlenergy.api import node as api_node
from rlenergy.api import phases as api_phases
from rlenergy.api import workload as api_workload
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.freq import aggregate, base, config, eerl
from rlenergy.gpu import models as gpu_models


@dataclasses.dataclass
class PhaseAccount:
    """Running sums of one phase; each field is the ``status.phases[]`` field of that name."""

    measured_joules: float = 0.0
    compared_measured_joules: float = 0.0
    predicted_default_joules: float = 0.0
    measured_seconds: float = 0.0
    predicted_default_seconds: float = 0.0
    predicted_default_low_joules: float = 0.0
    predicted_default_high_joules: float = 0.0
    predicted_default_low_seconds: float = 0.0
    predicted_default_high_seconds: float = 0.0
    energy_per_valid_token_joules: float | None = None
    predicted_default_energy_per_valid_token_joules: float | None = None
    basis_energy_source: str | None = None
    """The energy source of the phase's first default-governor window: the source its
    default-governor model is fitted on, so a compared window must come from it too. In the
    status checkpoint, so a restart whose node reports no longer hold that window keeps it."""


@dataclasses.dataclass
class Account:
    """Running sums of the job (restored from ``status.totals`` after a restart).

    Each field but ``phases`` is the ``status.totals`` field of that name, so the restore and
    the output are one loop over the fields (``_TOTALS_FIELDS``).
    """

    through_step: int = -1
    steps: int = 0
    measured_joules: float = 0.0
    compared_measured_joules: float = 0.0
    predicted_default_joules: float = 0.0
    measured_seconds: float = 0.0
    predicted_default_seconds: float = 0.0
    predicted_default_low_joules: float = 0.0
    predicted_default_high_joules: float = 0.0
    predicted_default_low_seconds: float = 0.0
    predicted_default_high_seconds: float = 0.0
    valid_tokens: float = 0.0
    compared_steps: int = 0
    unknown_energy_steps: int = 0
    missed_steps: int = 0
    stalled_seconds: float = 0.0
    stalled_joules: float = 0.0
    source_mismatch_steps: int = 0
    phases: dict[str, PhaseAccount] = dataclasses.field(default_factory=dict)


_TOTALS_FIELDS = tuple(f.name for f in dataclasses.fields(Account) if f.name != "phases")
_PHASE_FIELDS = tuple(f.name for f in dataclasses.fields(PhaseAccount))


def _fields(source: object, names: Sequence[str]) -> dict[str, Any]:
    return {n: getattr(source, n) for n in names}


_BOUNDS = (
    ("predicted_default_low_joules", "predicted_default_joules"),
    ("predicted_default_high_joules", "predicted_default_joules"),
    ("predicted_default_low_seconds", "predicted_default_seconds"),
    ("predicted_default_high_seconds", "predicted_default_seconds"),
)
"""Each bound's sum and the point sum it brackets (``PhaseAccount`` and ``Account`` alike)."""


def _bounds_from_point(acc: PhaseAccount | Account) -> None:
    """A checkpoint written without bounds: its compared windows count as exact.

    (A status written before the bounds existed restores them as 0; the windows it folded
    then widen nothing.)
    """
    if all(getattr(acc, bound) == 0.0 for bound, _ in _BOUNDS):
        for bound, point in _BOUNDS:
            setattr(acc, bound, getattr(acc, point))


def _add_bounds(
    acc: PhaseAccount | Account, low: tuple[float, float], high: tuple[float, float]
) -> None:
    """Fold one compared window's (or step's) bounds: each (energy J, time s)."""
    acc.predicted_default_low_joules += low[0]
    acc.predicted_default_high_joules += high[0]
    acc.predicted_default_low_seconds += low[1]
    acc.predicted_default_high_seconds += high[1]


def _pct_range(measured: float, low: float, high: float) -> tuple[float | None, float | None]:
    """(low, high) saving percent the bounds of the predicted default energy allow."""
    return _pct(low - measured, low), _pct(high - measured, high)


def _slowest(times: Sequence[float]) -> float:
    """The step time of pools that run at once: the slowest pool's, s (0 with none)."""
    return max(times, default=0.0)


def _pct(saved: float, predicted: float) -> float | None:
    return round(100.0 * saved / predicted, 3) if predicted > 0 else None


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


class JobLoop:
    """EE-RL controller + accounting for one policy generation.

    Args:
        spec: the validated spec.
        generation: ``metadata.generation`` the loop plans for.
    """

    def __init__(self, spec: api_policy.RLEnergyPolicySpec, generation: int) -> None:
        self.spec = spec
        self.generation = generation
        self.controller: eerl.EERLController | None = None
        self.clocks_mhz: tuple[int, ...] = ()
        self.account = Account(phases={p.name: PhaseAccount() for p in spec.phases})
        self.decisions: dict[int, base.Plan] = {}
        self.since: dict[str, tuple[int, int | None, str]] = {}
        self.replayed = 0
        self.rebuilt = False
        """Whether ``restore`` recomputed the measured totals from the node reports."""
        self.gpu_name: str | None = None
        self.last_workload: api_workload.TokenWorkload | None = None

    @property
    def basis_source(self) -> dict[str, str]:
        """Phase -> its default-governor basis source (``PhaseAccount.basis_energy_source``)."""
        return {
            name: pa.basis_energy_source
            for name, pa in self.account.phases.items()
            if pa.basis_energy_source
        }

    # ----- restore -----------------------------------------------------------------------
    @classmethod
    def restore(
        cls,
        spec: api_policy.RLEnergyPolicySpec,
        generation: int,
        status: api_status.RLEnergyPolicyStatus | None,
        reports: Sequence[api_node.NodeReport],
    ) -> JobLoop:
        """A loop rebuilt after a restart (or a spec change).

        Totals come from the status checkpoint, their measured sums recomputed from the node
        reports where these hold every step the checkpoint counted (``measured_from_reports``,
        then ``rebuilt`` is True); the controller is rebuilt by replaying the complete steps up
        to the checkpoint that the node reports still hold (the source of truth; an agent
        leaves out the records the status folded, so over such reports nothing is replayed).
        """
        loop = cls(spec, generation)
        if status is not None and status.totals is not None:
            loop.account = Account(
                **_fields(status.totals, _TOTALS_FIELDS), phases=loop.account.phases
            )
            _bounds_from_point(loop.account)
            for ph in status.phases:
                if ph.name in loop.account.phases:
                    loop.account.phases[ph.name] = PhaseAccount(**_fields(ph, _PHASE_FIELDS))
                    _bounds_from_point(loop.account.phases[ph.name])
            rebuilt = measured_from_reports(status.totals, reports, pools=spec.mode == "async")
            if rebuilt is not None:
                loop.rebuilt = True
                for name in MEASURED_TOTALS:
                    setattr(loop.account, name, getattr(rebuilt, name))
                for name, pa in loop.account.phases.items():
                    pa.measured_joules = rebuilt.phases.get(name, PhaseAccount()).measured_joules
        for step in aggregate.known_steps(reports):
            if step > loop.account.through_step:
                break
            if aggregate.step_state(step, reports) is not aggregate.StepState.COMPLETE:
                continue
            if not loop._ensure_controller(reports):
                break
            loop._observe(
                aggregate.job_step(step, reports, pools=loop.spec.mode == "async"), account=False
            )
            loop.replayed += 1
        return loop

    # ----- advance -----------------------------------------------------------------------
    def _ensure_controller(self, reports: Sequence[api_node.NodeReport]) -> bool:
        if self.controller is not None:
            return True
        clocks = aggregate.supported_clocks(reports)
        if not clocks:
            return False
        self.clocks_mhz = clocks
        self.controller = config.build_controller(self.spec, clocks)
        names = sorted({g.name for rep in reports for g in rep.gpus if g.name})
        self.gpu_name = names[0] if len(names) == 1 else None
        return True

    def _decide(self, step: int) -> base.Plan:
        assert self.controller is not None
        if step not in self.decisions:
            plan = self.decisions[step] = self.controller.decide(step)
            for name, d in plan.phases.items():
                prev = self.since.get(name)
                if prev is None or (prev[1], prev[2]) != (d.clock_mhz, d.state.value):
                    self.since[name] = (step, d.clock_mhz, d.state.value)
            for old in [s for s in self.decisions if s < step - 4]:
                del self.decisions[old]
        return self.decisions[step]

    def advance(self, reports: Sequence[api_node.NodeReport]) -> list[int]:
        """Fold every newly complete step, in order; returns the folded steps."""
        folded: list[int] = []
        for step in aggregate.known_steps(reports):
            if step <= self.account.through_step:
                continue
            state = aggregate.step_state(step, reports)
            if state is aggregate.StepState.PENDING:
                break
            if not self._ensure_controller(reports):
                break
            if state is aggregate.StepState.LOST:
                self.account.missed_steps += 1
                self.account.through_step = step
                continue
            self._observe(
                aggregate.job_step(step, reports, pools=self.spec.mode == "async"), account=True
            )
            folded.append(step)
        return folded

    def _observe(self, job: aggregate.JobStep, *, account: bool) -> None:
        assert self.controller is not None
        obs = job.observation
        self._decide(obs.step)
        for name, ph in obs.phases.items():
            default = ph.requested_clock_mhz is None and not ph.slices and ph.error is None
            if default and ph.energy_j is not None and ph.energy_source:
                pa = self.account.phases.setdefault(name, PhaseAccount())
                pa.basis_energy_source = pa.basis_energy_source or ph.energy_source
        if account:
            self._account(job)
        self.last_workload = obs.workload
        self.controller.observe(obs)
        self._decide(obs.step + 1)

    def _account(self, job: aggregate.JobStep) -> None:
        assert self.controller is not None
        obs = job.observation
        acc = self.account
        valid = obs.workload.valid_tokens
        step_energy = job.energy_j
        energy_known = _measure(acc, job)
        pred_energy: float | None = job.idle_energy_j
        pred_times: list[float] = []
        meas_times: list[float] = []
        bounds: list[tuple[tuple[float, float], tuple[float, float]]] = []
        times: dict[str, tuple[float, float]] = {}
        other_source = False
        for name, ph in obs.phases.items():
            pa = acc.phases.setdefault(name, PhaseAccount())
            pc = self.controller.phases.get(name)
            p_e, p_t = _predict(pc, ph, obs.workload)
            low, high = _predict_range(pc, ph, obs.workload, (p_e, p_t))
            basis = pa.basis_energy_source
            if basis and ph.energy_source and ph.energy_source != basis:
                # Like with like: the default-governor side comes from the basis source (a
                # counter vs integrated power disagreement would read as a saving).
                p_e, p_t, other_source = None, None, True
            if ph.energy_j is not None and p_e is not None and p_t is not None:
                pa.compared_measured_joules += ph.energy_j
                pa.predicted_default_joules += p_e
                pa.measured_seconds += ph.duration_s
                pa.predicted_default_seconds += p_t
                _add_bounds(pa, low, high)
            pa.energy_per_valid_token_joules = (
                ph.energy_j / valid if ph.energy_j is not None and valid > 0 else None
            )
            pa.predicted_default_energy_per_valid_token_joules = (
                p_e / valid if p_e is not None and valid > 0 else None
            )
            pred_energy = None if pred_energy is None or p_e is None else pred_energy + p_e
            if p_t is not None:
                pred_times.append(p_t)
                meas_times.append(ph.duration_s)
                times[name] = (ph.duration_s, p_t)
                bounds.append((low, high))
        idle_pred_j = idle_low_j = idle_high_j = job.idle_energy_j or 0.0
        if self.spec.mode == "async" and pred_energy is not None and job.idle_energy_j is not None:
            # The pools' waits are no constant: under the default governor each waits as long
            # as the slower pool's default time leaves it (base.async_default_idle_j); its
            # bounds over the phases' default-time bounds (base.async_default_idle_range_j).
            idle_j = job.idle_energy_j
            idle_pred_j = base.async_default_idle_j(idle_j, obs.pool_idle, times)
            idle_low_j, idle_high_j = base.async_default_idle_range_j(
                idle_j,
                obs.pool_idle,
                times,
                {n: (b[0][1], b[1][1]) for n, b in zip(times, bounds, strict=True)},
            )
            pred_energy += idle_pred_j - idle_j
        acc.source_mismatch_steps += other_source
        if step_energy is None or not energy_known:
            return  # unknown energy: measured as unknown (``_measure``), never compared
        if pred_energy is None or len(pred_times) != len(obs.phases):
            return
        acc.compared_steps += 1
        acc.compared_measured_joules += step_energy
        acc.predicted_default_joules += pred_energy
        pick = _slowest if self.spec.mode == "async" else sum  # async: pools run at once
        acc.measured_seconds += pick(meas_times)
        acc.predicted_default_seconds += pick(pred_times)
        low_t, high_t = pick([b[0][1] for b in bounds]), pick([b[1][1] for b in bounds])
        low_j = idle_low_j + sum(b[0][0] for b in bounds)
        high_j = idle_high_j + sum(b[1][0] for b in bounds)
        _add_bounds(acc, (low_j, low_t), (high_j, high_t))

    # ----- outputs -----------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The step the current plan is for."""
        return self.account.through_step + 1

    def plan(self, issued_at: str) -> api_node.ClockPlan:
        """The plan for the next step (default governor until the clock table is known)."""
        step = self.next_step
        if self.controller is None:
            return first_plan(self.spec, self.generation, issued_at, step=step)
        decided = self._decide(step)
        phases: list[api_node.PhasePlan] = []
        for p in self.spec.phases:
            d = decided.phases.get(p.name)
            if d is None:
                continue
            phases.append(
                api_node.PhasePlan(
                    phase=p.name,
                    clock_mhz=d.clock_mhz,
                    state=d.state.value,
                    probe_clocks_mhz=list(d.probe_clocks_mhz),
                    probe_slice_seconds=round(d.probe_slice_s, 6),
                    reason=d.reason,
                    since_step=self.since[p.name][0],
                )
            )
        return api_node.ClockPlan(
            step=step,
            policy_generation=self.generation,
            enforce=self.spec.controller.mode == "enforce",
            phases=phases,
            issued_at=issued_at,
        )

    def phase_status(self) -> list[api_status.PhaseStatus]:
        """Per-phase status (chosen clock, ratios, energy per valid token, saving)."""
        summary = self.controller.summary() if self.controller is not None else {}
        enforce = self.spec.controller.mode == "enforce"
        out = []
        for p in self.spec.phases:
            pa = self.account.phases.get(p.name, PhaseAccount())
            s = summary.get(p.name, {})
            state = str(s.get("state", "warmup" if enforce else "observe"))
            clock = s.get("clock_mhz")
            retrials = s.get("retrials") or []
            threshold = s.get("threshold", p.min_throughput_ratio)
            saved = pa.predicted_default_joules - pa.compared_measured_joules
            advice = {} if enforce else self._recommend(p)
            out.append(
                api_status.PhaseStatus.model_validate(
                    {
                        **advice,
                        **_fields(pa, _PHASE_FIELDS),
                        "name": p.name,
                        "state": state,
                        "clock_mhz": clock if state == "locked" else None,
                        "min_throughput_ratio": threshold,
                        "throughput_ratio": _ratio(
                            pa.predicted_default_seconds, pa.measured_seconds
                        ),
                        **_ratio_range(pa),
                        "saving": _saving(pa, saved),
                        "selections": s.get("selections", 0),
                        "last_retrial_reason": retrials[-1]
                        if isinstance(retrials, list) and retrials
                        else None,
                        "probe_evidence": s.get("probe_evidence"),
                    }
                )
            )
        return out

    def _recommend(self, phase: api_policy.PhaseSpec) -> dict[str, object]:
        """Observe mode: the GPU model's clock for ``phase`` (``PhaseStatus`` field names).

        Observe mode never changes clocks, so nothing but the default governor is measured;
        the recommendation is the SKU model's prior (``rlenergy.gpu.models``), labelled so.
        """
        if self.controller is None or self.last_workload is None:
            return {"recommendation_basis": "waiting for a complete step with a clock table"}
        kind = api_phases.phase_kind(phase.name)
        if kind is None:
            return {"recommendation_basis": f"no GPU model for a custom phase {phase.name!r}"}
        sku = gpu_models.sku_for_nvml_name(self.gpu_name or "")
        if sku is None:
            gpus = self.gpu_name or "mixed or unnamed GPUs"
            return {"recommendation_basis": f"no GPU model for {gpus}"}
        pc = self.controller.phases.get(phase.name)
        clocks = pc.settings.allowed_mhz if pc is not None else self.clocks_mhz
        est = gpu_models.estimate_best_clock(
            sku,
            kind,
            phase.min_throughput_ratio,
            self.last_workload.mean_context_tokens,
            clocks,
        )
        basis = f"{sku.key} [MODEL] phase curves at the newest step's tokens, not measured"
        if est is None:
            return {"recommendation_basis": f"{basis}: no clock keeps the threshold"}
        return {
            "recommended_clock_mhz": est.clock_mhz,
            "estimated_saving_percent": round(100.0 * (1.0 - est.energy_ratio), 2),
            "recommendation_basis": basis,
        }

    def totals(self) -> api_status.Totals:
        """Job totals (the restart checkpoint included)."""
        a = self.account
        saved = a.predicted_default_joules - a.compared_measured_joules
        low, high = _pct_range(
            a.compared_measured_joules,
            a.predicted_default_low_joules,
            a.predicted_default_high_joules,
        )
        point = _pct(saved, a.predicted_default_joules)
        return api_status.Totals(
            **_fields(a, _TOTALS_FIELDS),
            saved_joules=saved,
            saving_percent=point,
            saving_low_percent=low if point is not None else None,
            saving_high_percent=high if point is not None else None,
            throughput_ratio=_ratio(a.predicted_default_seconds, a.measured_seconds),
            throughput_ratio_low=_ratio(a.predicted_default_low_seconds, a.measured_seconds),
            throughput_ratio_high=_ratio(a.predicted_default_high_seconds, a.measured_seconds),
        )


def _saving(pa: PhaseAccount, saved: float) -> api_status.Saving:
    """A phase's saving: the point figure and the range its bounds allow."""
    point = _pct(saved, pa.predicted_default_joules)
    low, high = _pct_range(
        pa.compared_measured_joules,
        pa.predicted_default_low_joules,
        pa.predicted_default_high_joules,
    )
    return api_status.Saving(
        percent=point,
        joules=saved if pa.predicted_default_joules > 0 else None,
        low_percent=low if point is not None else None,
        high_percent=high if point is not None else None,
    )


def _ratio_range(acc: PhaseAccount | Account) -> dict[str, float | None]:
    """``throughput_ratio_low`` and ``_high`` of a phase or the job, by field name."""
    return {
        "throughput_ratio_low": _ratio(acc.predicted_default_low_seconds, acc.measured_seconds),
        "throughput_ratio_high": _ratio(acc.predicted_default_high_seconds, acc.measured_seconds),
    }


def first_plan(
    spec: api_policy.RLEnergyPolicySpec, generation: int, issued_at: str, *, step: int = 0
) -> api_node.ClockPlan:
    """The plan before any clock table is known: every phase on the default governor.

    The one place the first plan is built: ``policy_reconcile`` publishes it with Ready (so a
    policy is never Ready without a plan), and ``JobLoop.plan`` returns it until the first
    node report carries the GPUs' supported clocks.
    """
    enforce = spec.controller.mode == "enforce"
    state: api_node.PlanState = "warmup" if enforce else "observe"
    return api_node.ClockPlan(
        step=step,
        policy_generation=generation,
        enforce=enforce,
        phases=[
            api_node.PhasePlan(
                phase=p.name, clock_mhz=None, state=state, reason="waiting for clock table"
            )
            for p in spec.phases
        ],
        issued_at=issued_at,
    )


def reset_plan(
    published: Mapping[str, Any], generation: int, issued_at: str
) -> api_node.ClockPlan | None:
    """The plan that resets every phase to the default governor when the policy is deleted.

    Args:
        published: the ``status.plan`` the agents follow now (camelCase, may be empty).
        generation: ``metadata.generation`` of the policy being deleted.
        issued_at: RFC 3339 time of the reset.

    Returns:
        The reset plan (observe, no clock, state ``fallback``) for the published plan's step
        and phases; None when the published plan already locks nothing and enforces nothing.
    """
    phases = published.get("phases", [])
    if not (published.get("enforce", True) or any(p.get("clockMHz") for p in phases)):
        return None
    return api_node.ClockPlan(
        step=int(published.get("step") or 0),
        policy_generation=generation,
        enforce=False,
        phases=[
            api_node.PhasePlan(
                phase=p.get("phase", ""),
                clock_mhz=None,
                state="fallback",
                reason="policy deleted: reset to default",
            )
            for p in phases
        ],
        issued_at=issued_at,
    )


MEASURED_TOTALS = (
    "through_step",
    "steps",
    "measured_joules",
    "valid_tokens",
    "unknown_energy_steps",
    "missed_steps",
    "stalled_seconds",
    "stalled_joules",
)
"""The ``Account`` fields that are sums over the node reports' step records alone, with no
controller or spec in them (with each phase's ``measured_joules``): what a rebuild recomputes
from the reports (``JobLoop.restore``)."""


def _measure(acc: Account, job: aggregate.JobStep) -> bool:
    """Add one complete step's measured figures (``MEASURED_TOTALS``) to ``acc``.

    Returns:
        Whether the step's energy is known (every phase window, the idle energy and any stalled
        time metered); an unknown one counts in ``unknown_energy_steps``, never as 0.
    """
    obs = job.observation
    for name, ph in obs.phases.items():
        pa = acc.phases.setdefault(name, PhaseAccount())
        if ph.energy_j is not None:
            pa.measured_joules += ph.energy_j
    acc.steps += 1
    acc.through_step = obs.step
    acc.valid_tokens += obs.workload.valid_tokens
    # Stalled time (a hung rollout) is outside every phase figure (aggregate); it is measured
    # energy all the same, never compared with a default prediction.
    stalled_j = [ph.stalled_energy_j for ph in obs.phases.values() if ph.stalled_s > 0]
    acc.stalled_seconds += max((ph.stalled_s for ph in obs.phases.values()), default=0.0)
    acc.stalled_joules += sum(j for j in stalled_j if j is not None)
    step_energy = job.energy_j
    if step_energy is None or any(j is None for j in stalled_j):
        acc.unknown_energy_steps += 1
        return False
    acc.measured_joules += step_energy + sum(j for j in stalled_j if j is not None)
    return True


def measured_from_reports(
    checkpoint: api_status.Totals, reports: Sequence[api_node.NodeReport], *, pools: bool
) -> Account | None:
    """The checkpoint's measured sums recomputed from the node reports, when they hold them.

    The totals a leader checkpoints are only as exact as its view of the reports when it
    folded each step: a step folded while a node's report was missing from that view (a
    replica resumed by peering, ``reports.ReportCache._complete``) books the other nodes'
    energy alone. A new leader recomputes the measured sums (``MEASURED_TOTALS``, each phase's
    ``measured_joules``) of the checkpoint's steps from the records themselves, so after any
    failover they equal the sum of the records; a record is counted once however often it was
    read, as every step is folded once from the records of that step.

    The checkpoint counted the steps ``first .. throughStep``, ``first = throughStep + 1 -
    steps - missedSteps``. The reports hold them all when every report lists a GPU that
    measures energy (``aggregate.node_ready``: a node whose GPUs were lost since would drop
    out of every step) and has no record dropped before ``first`` (its oldest record at or
    before ``first``: the agents keep a bounded window of records).

    Args:
        checkpoint: ``status.totals`` as the previous leader wrote it.
        reports: every node report of the policy, untrimmed.
        pools: async mode (``aggregate.job_step``).

    Returns:
        The recomputed sums (``MEASURED_TOTALS`` and ``phases[*].measured_joules``); None when
        the reports do not hold every step the checkpoint counted, or fold them into another
        count of steps or missed steps (the checkpoint then stands as written).
    """
    first = checkpoint.through_step + 1 - checkpoint.steps - checkpoint.missed_steps
    if checkpoint.through_step < 0 or first < 0 or not reports:
        return None
    for rep in reports:
        if not aggregate.node_ready(rep) or not rep.steps:
            return None
        if min(r.step for r in rep.steps) > first:
            return None
    acc = Account(through_step=first - 1)
    for step in aggregate.known_steps(reports):
        if step < first:
            continue
        if step > checkpoint.through_step:
            break
        state = aggregate.step_state(step, reports)
        if state is aggregate.StepState.PENDING:
            return None
        if state is aggregate.StepState.LOST:
            acc.missed_steps += 1
            acc.through_step = step
            continue
        _measure(acc, aggregate.job_step(step, reports, pools=pools))
    counted = (acc.through_step, acc.steps, acc.missed_steps)
    if counted != (checkpoint.through_step, checkpoint.steps, checkpoint.missed_steps):
        return None
    return acc


def _predict_range(
    pc: eerl.PhaseController | None,
    ph: base.PhaseObservation,
    workload: api_workload.TokenWorkload,
    point: tuple[float | None, float | None],
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(low, high) bounds, each (energy J, time s), of the window's default counterfactual.

    ``eerl.PhaseController.default_equivalent_range``; the point itself where it gives none
    (0 where the point is unknown: such a window is not compared).
    """
    p_e, p_t = point[0] or 0.0, point[1] or 0.0
    if pc is None:
        return (p_e, p_t), (p_e, p_t)
    low, high = pc.default_equivalent_range(ph, workload)
    return (low.energy_j or p_e, low.time_s or p_t), (high.energy_j or p_e, high.time_s or p_t)


def _predict(
    pc: eerl.PhaseController | None,
    ph: base.PhaseObservation,
    workload: api_workload.TokenWorkload,
) -> eerl.DefaultEquivalent:
    """What the default governor would have needed for this phase window (energy J, time s)."""
    if pc is None:
        if ph.error is None and ph.requested_clock_mhz is None and not ph.slices:
            return eerl.DefaultEquivalent(ph.energy_j, ph.duration_s)
        return eerl.DefaultEquivalent(None, None)
    return pc.default_equivalent(ph, workload)
