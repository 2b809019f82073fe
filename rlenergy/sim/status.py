"""What the operator's status would report for a simulated run, to judge it against the truth.

The operator folds each complete step into ``status`` (``rlenergy_operator.jobloop``): per
phase the measured window energy and time beside the default governor's counterfactual for the
same window, which comes from the controller (``eerl.PhaseController.default_equivalent``:
the window itself under the default governor, the paired default slices of a probed window,
the paired-probe fit for a locked one), computed before the controller sees the step. The
job's figures add the idle windows (measured) to both energies, in async mode with each pool's
longer or shorter wait under the default governor (``base.async_default_idle_j``); its time
is the sum of the phase times (the slower pool's in async mode). ``StatusAccount`` does the
same fold beside ``sim.job.run_job`` (it wraps the controller as the policy), so the bench can
print the status's saving and throughput ratio next to the simulator's truth.
"""

from __future__ import annotations

import dataclasses

from rlenergy.control.freq import base, eerl


@dataclasses.dataclass
class Sums:
    """Measured and predicted-default energy (J) and time (s) of compared windows."""

    measured_j: float = 0.0
    predicted_j: float = 0.0
    measured_s: float = 0.0
    predicted_s: float = 0.0

    @property
    def saving(self) -> float | None:
        """Reported saving, fraction of the predicted default energy (None: nothing compared)."""
        return 1.0 - self.measured_j / self.predicted_j if self.predicted_j > 0 else None

    @property
    def throughput_ratio(self) -> float | None:
        """Reported throughput ratio, predicted default time / measured time."""
        return self.predicted_s / self.measured_s if self.measured_s > 0 else None


class StatusAccount:
    """A ``FrequencyPolicy`` that forwards to ``controller`` and folds the status figures.

    Args:
        controller: the EE-RL controller the run uses.
        async_mode: pools run at once (a step's time is its slower phase's).
    """

    def __init__(self, controller: eerl.EERLController, *, async_mode: bool = False) -> None:
        self.controller = controller
        self.async_mode = async_mode
        self.phases: dict[str, Sums] = {}
        self.total = Sums()
        self.phase_measured_j = 0.0
        """Measured energy of every phase window with known energy, J (the idle windows are
        the step energy less this)."""
        self.idle_extra_j = 0.0
        """Async mode: the default governor's idle energy less the measured, over the compared
        steps, J (``base.async_default_idle_j``)."""

    def decide(self, step: int) -> base.Plan:
        """The controller's plan."""
        return self.controller.decide(step)

    def observe(self, observation: base.StepObservation) -> None:
        """Fold the step (before the controller learns from it), then forward it."""
        times: list[tuple[float, float]] = []
        energy: list[tuple[float, float]] = []
        for name, ph in observation.phases.items():
            pc = self.controller.phases.get(name)
            if pc is not None:
                p_e, p_t = pc.default_equivalent(ph, observation.workload)
            elif ph.error is None and ph.requested_clock_mhz is None and not ph.slices:
                p_e, p_t = ph.energy_j, ph.duration_s
            else:
                p_e, p_t = None, None
            if ph.energy_j is not None:
                self.phase_measured_j += ph.energy_j
            if ph.energy_j is None or p_e is None or p_t is None:
                continue
            acc = self.phases.setdefault(name, Sums())
            acc.measured_j += ph.energy_j
            acc.predicted_j += p_e
            acc.measured_s += ph.duration_s
            acc.predicted_s += p_t
            times.append((ph.duration_s, p_t))
            energy.append((ph.energy_j, p_e))
        if len(times) == len(observation.phases):
            pick = max if self.async_mode else sum
            self.total.measured_s += pick(t for t, _ in times)
            self.total.predicted_s += pick(p for _, p in times)
            self.total.measured_j += sum(e for e, _ in energy)
            self.total.predicted_j += sum(p for _, p in energy)
            idle = [p.energy_j for p in observation.pool_idle.values()]
            if self.async_mode and idle and all(j is not None for j in idle):
                idle_j = sum(j or 0.0 for j in idle)
                by_phase = dict(zip(observation.phases, times, strict=True))
                self.idle_extra_j += (
                    base.async_default_idle_j(idle_j, observation.pool_idle, by_phase) - idle_j
                )
        self.controller.observe(observation)

    def add_idle(self, idle_j: float) -> None:
        """Add the run's idle energy to both sides of the job total.

        The same under either, but for the async pools' longer or shorter waits
        (``idle_extra_j``).
        """
        self.total.measured_j += idle_j
        self.total.predicted_j += idle_j + self.idle_extra_j
