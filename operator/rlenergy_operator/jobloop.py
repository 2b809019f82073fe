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

Default-governor predictions: a phase window that ran under the default governor is its own
prediction; otherwise the controller's default-governor model (fitted in warm-up) predicts
time and energy on the step's tokens. A step whose energy or prediction is unknown is not
compared (never counted as 0, field case #9).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rlenergy.api import node as api_node
from rlenergy.api import workload as api_workload
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.freq import aggregate, base, config, eerl
from rlenergy.sim import models as sim_models


@dataclasses.dataclass
class PhaseAccount:
    """Running sums of one phase."""

    measured_j: float = 0.0
    compared_measured_j: float = 0.0
    predicted_j: float = 0.0
    measured_s: float = 0.0
    predicted_s: float = 0.0
    last_epvt_j: float | None = None
    last_predicted_epvt_j: float | None = None


@dataclasses.dataclass
class Account:
    """Running sums of the job (restored from ``status.totals`` after a restart)."""

    through_step: int = -1
    steps: int = 0
    measured_j: float = 0.0
    compared_measured_j: float = 0.0
    predicted_j: float = 0.0
    measured_s: float = 0.0
    predicted_s: float = 0.0
    valid_tokens: float = 0.0
    compared_steps: int = 0
    unknown_energy_steps: int = 0
    missed_steps: int = 0
    phases: dict[str, PhaseAccount] = dataclasses.field(default_factory=dict)


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
        self.gpu_name: str | None = None
        self.last_workload: api_workload.TokenWorkload | None = None

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

        Totals come from the status checkpoint; the controller is rebuilt by replaying the
        complete steps up to the checkpoint from the node reports (the source of truth).
        """
        loop = cls(spec, generation)
        if status is not None and status.totals is not None:
            t = status.totals
            acc = loop.account
            acc.through_step = t.through_step
            acc.steps = t.steps
            acc.measured_j = t.measured_joules
            acc.predicted_j = t.predicted_default_joules
            acc.compared_measured_j = t.compared_measured_joules
            acc.measured_s = t.measured_seconds
            acc.predicted_s = t.predicted_default_seconds
            acc.valid_tokens = t.valid_tokens
            acc.compared_steps = t.compared_steps
            acc.unknown_energy_steps = t.unknown_energy_steps
            acc.missed_steps = t.missed_steps
            for ph in status.phases:
                if ph.name in acc.phases:
                    acc.phases[ph.name] = PhaseAccount(
                        measured_j=ph.measured_joules,
                        compared_measured_j=ph.compared_measured_joules,
                        predicted_j=ph.predicted_default_joules,
                        measured_s=ph.measured_seconds,
                        predicted_s=ph.predicted_default_seconds,
                        last_epvt_j=ph.energy_per_valid_token_joules,
                        last_predicted_epvt_j=ph.predicted_default_energy_per_valid_token_joules,
                    )
        for step in aggregate.known_steps(reports):
            if step > loop.account.through_step:
                break
            if aggregate.step_state(step, reports) is not aggregate.StepState.COMPLETE:
                continue
            if not loop._ensure_controller(reports):
                break
            loop._observe(aggregate.job_step(step, reports), account=False)
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
            self._observe(aggregate.job_step(step, reports), account=True)
            folded.append(step)
        return folded

    def _observe(self, job: aggregate.JobStep, *, account: bool) -> None:
        assert self.controller is not None
        obs = job.observation
        self._decide(obs.step)
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
        pred_energy: float | None = job.idle_energy_j
        pred_times: list[float] = []
        meas_times: list[float] = []
        for name, ph in obs.phases.items():
            pa = acc.phases.setdefault(name, PhaseAccount())
            pc = self.controller.phases.get(name)
            p_e, p_t = _predict(pc, ph, obs.workload)
            if ph.energy_j is not None:
                pa.measured_j += ph.energy_j
            if ph.energy_j is not None and p_e is not None and p_t is not None:
                pa.compared_measured_j += ph.energy_j
                pa.predicted_j += p_e
                pa.measured_s += ph.duration_s
                pa.predicted_s += p_t
            pa.last_epvt_j = ph.energy_j / valid if ph.energy_j is not None and valid > 0 else None
            pa.last_predicted_epvt_j = p_e / valid if p_e is not None and valid > 0 else None
            pred_energy = None if pred_energy is None or p_e is None else pred_energy + p_e
            if p_t is not None:
                pred_times.append(p_t)
                meas_times.append(ph.duration_s)
        acc.steps += 1
        acc.through_step = obs.step
        acc.valid_tokens += valid
        if step_energy is None:
            acc.unknown_energy_steps += 1
            return
        acc.measured_j += step_energy
        if pred_energy is None or len(pred_times) != len(obs.phases):
            return
        acc.compared_steps += 1
        acc.compared_measured_j += step_energy
        acc.predicted_j += pred_energy
        if self.spec.mode == "async":  # pools run at once: the slower one sets the step
            acc.measured_s += max(meas_times, default=0.0)
            acc.predicted_s += max(pred_times, default=0.0)
        else:
            acc.measured_s += sum(meas_times)
            acc.predicted_s += sum(pred_times)

    # ----- outputs -----------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The step the current plan is for."""
        return self.account.through_step + 1

    def plan(self, issued_at: str) -> api_node.ClockPlan:
        """The plan for the next step (default governor until the clock table is known)."""
        enforce = self.spec.controller.mode == "enforce"
        step = self.next_step
        phases: list[api_node.PhasePlan] = []
        if self.controller is None:
            state: api_node.PlanState = "warmup" if enforce else "observe"
            for p in self.spec.phases:
                phases.append(
                    api_node.PhasePlan(
                        phase=p.name, clockMHz=None, state=state, reason="waiting for clock table"
                    )
                )
        else:
            decided = self._decide(step)
            for p in self.spec.phases:
                d = decided.phases.get(p.name)
                if d is None:
                    continue
                phases.append(
                    api_node.PhasePlan(
                        phase=p.name,
                        clockMHz=d.clock_mhz,
                        state=d.state.value,
                        probeClocksMHz=list(d.probe_clocks_mhz),
                        probeSliceSeconds=round(d.probe_slice_s, 6),
                        reason=d.reason,
                        sinceStep=self.since[p.name][0],
                    )
                )
        return api_node.ClockPlan(
            step=step,
            policyGeneration=self.generation,
            enforce=enforce,
            phases=phases,
            issuedAt=issued_at,
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
            saved = pa.predicted_j - pa.compared_measured_j
            advice = {} if enforce else self._recommend(p)
            out.append(
                api_status.PhaseStatus.model_validate(
                    {
                        **advice,
                        "name": p.name,
                        "state": state,
                        "clockMHz": clock if state == "locked" else None,
                        "minThroughputRatio": threshold,
                        "throughputRatio": _ratio(pa.predicted_s, pa.measured_s),
                        "energyPerValidTokenJoules": pa.last_epvt_j,
                        "predictedDefaultEnergyPerValidTokenJoules": pa.last_predicted_epvt_j,
                        "measuredJoules": pa.measured_j,
                        "predictedDefaultJoules": pa.predicted_j,
                        "comparedMeasuredJoules": pa.compared_measured_j,
                        "measuredSeconds": pa.measured_s,
                        "predictedDefaultSeconds": pa.predicted_s,
                        "saving": {
                            "percent": _pct(saved, pa.predicted_j),
                            "joules": saved if pa.predicted_j > 0 else None,
                        },
                        "selections": s.get("selections", 0),
                        "lastRetrialReason": retrials[-1]
                        if isinstance(retrials, list) and retrials
                        else None,
                    }
                )
            )
        return out

    def _recommend(self, phase: api_policy.PhaseSpec) -> dict[str, object]:
        """Observe mode: the GPU model's clock for ``phase`` (status fields, camelCase).

        Observe mode never changes clocks, so nothing but the default governor is measured;
        the recommendation is the SKU model's prior (``rlenergy.sim.models``), labelled so.
        """
        if self.controller is None or self.last_workload is None:
            return {"recommendationBasis": "waiting for a complete step with a clock table"}
        if phase.name not in ("generation", "training"):
            return {"recommendationBasis": f"no GPU model for a custom phase {phase.name!r}"}
        sku = sim_models.sku_for_nvml_name(self.gpu_name or "")
        if sku is None:
            gpus = self.gpu_name or "mixed or unnamed GPUs"
            return {"recommendationBasis": f"no GPU model for {gpus}"}
        pc = self.controller.phases.get(phase.name)
        clocks = pc.settings.allowed_mhz if pc is not None else self.clocks_mhz
        kind: sim_models.PhaseKind = "generation" if phase.name == "generation" else "training"
        est = sim_models.estimate_best_clock(
            sku,
            kind,
            phase.min_throughput_ratio,
            self.last_workload.mean_context_tokens,
            clocks,
        )
        basis = f"{sku.key} [MODEL] phase curves at the newest step's tokens, not measured"
        if est is None:
            return {"recommendationBasis": f"{basis}: no clock keeps the threshold"}
        return {
            "recommendedClockMHz": est.clock_mhz,
            "estimatedSavingPercent": round(100.0 * (1.0 - est.energy_ratio), 2),
            "recommendationBasis": basis,
        }

    def totals(self) -> api_status.Totals:
        """Job totals (the restart checkpoint included)."""
        a = self.account
        saved = a.predicted_j - a.compared_measured_j
        return api_status.Totals(
            steps=a.steps,
            throughStep=a.through_step,
            measuredJoules=a.measured_j,
            predictedDefaultJoules=a.predicted_j,
            comparedMeasuredJoules=a.compared_measured_j,
            savedJoules=saved,
            savingPercent=_pct(saved, a.predicted_j),
            throughputRatio=_ratio(a.predicted_s, a.measured_s),
            measuredSeconds=a.measured_s,
            predictedDefaultSeconds=a.predicted_s,
            validTokens=a.valid_tokens,
            comparedSteps=a.compared_steps,
            unknownEnergySteps=a.unknown_energy_steps,
            missedSteps=a.missed_steps,
        )


def _predict(
    pc: eerl.PhaseController | None,
    ph: base.PhaseObservation,
    workload: api_workload.TokenWorkload,
) -> tuple[float | None, float | None]:
    """(energy J, time s) the default governor would have needed for this phase window."""
    if pc is None:
        if ph.error is None and ph.requested_clock_mhz is None and not ph.slices:
            return ph.energy_j, ph.duration_s
        return None, None
    return pc.default_equivalent(ph, workload)
