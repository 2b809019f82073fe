"""What the operator's status would report for a simulated run, to judge it against the truth.

The operator folds each complete step into ``status`` (``rlenergy_operator.jobloop``): per
phase the measured window energy and time beside the default governor's counterfactual for the
same window, which comes from the controller (``eerl.PhaseController.default_equivalent``:
the window itself under the default governor, the paired default slices of a probed window,
the paired-probe fit for a locked one), computed before the controller sees the step. The
job's figures add the idle windows (measured) to both energies, in async mode with each pool's
longer or shorter wait under the default governor (``base.async_default_idle_j``; its bounds
over the phases' default-time bounds, ``base.async_default_idle_range_j``); its time
is the sum of the phase times (the slower pool's in async mode). ``StatusAccount`` does the
same fold beside ``sim.job.run_job`` (it wraps the controller as the policy), so the bench can
print the status's saving and throughput ratio next to the simulator's truth.

Beside each point figure it folds the bounds of the default counterfactual
(``eerl.PhaseController.default_equivalent_range``): the range of saving and throughput ratio
that the status's evidence allows, which the bench checks the truth against where the point
figure is off.
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
    predicted_low_j: float = 0.0
    predicted_high_j: float = 0.0
    predicted_low_s: float = 0.0
    predicted_high_s: float = 0.0

    def add(
        self,
        measured: tuple[float, float],
        point: tuple[float, float],
        low: tuple[float, float],
        high: tuple[float, float],
    ) -> None:
        """Fold one compared window: each argument (energy J, time s)."""
        self.measured_j += measured[0]
        self.measured_s += measured[1]
        self.predicted_j += point[0]
        self.predicted_s += point[1]
        self.predicted_low_j += low[0]
        self.predicted_low_s += low[1]
        self.predicted_high_j += high[0]
        self.predicted_high_s += high[1]

    @property
    def saving_range(self) -> tuple[float, float] | None:
        """(low, high) saving the bounds of the default counterfactual allow (None: none)."""
        if self.predicted_low_j <= 0 or self.predicted_high_j <= 0:
            return None
        return 1.0 - self.measured_j / self.predicted_low_j, 1.0 - (
            self.measured_j / self.predicted_high_j
        )

    @property
    def throughput_ratio_range(self) -> tuple[float, float] | None:
        """(low, high) throughput ratio the bounds allow (None: nothing compared)."""
        if self.measured_s <= 0:
            return None
        return self.predicted_low_s / self.measured_s, self.predicted_high_s / self.measured_s

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
        self.idle_extra_low_j = 0.0
        self.idle_extra_high_j = 0.0
        """Async mode: the bounds of ``idle_extra_j`` over the phases' default-time bounds,
        J (``base.async_default_idle_range_j``)."""

    def decide(self, step: int) -> base.Plan:
        """The controller's plan."""
        return self.controller.decide(step)

    def observe(self, observation: base.StepObservation) -> None:
        """Fold the step (before the controller learns from it), then forward it."""
        times: list[tuple[float, float]] = []
        windows: list[tuple[tuple[float, float], ...]] = []
        for name, ph in observation.phases.items():
            pc = self.controller.phases.get(name)
            p_e: float | None
            p_t: float | None
            if pc is not None:
                p_e, p_t = pc.default_equivalent(ph, observation.workload)
                low, high = pc.default_equivalent_range(ph, observation.workload)
            elif ph.error is None and ph.requested_clock_mhz is None and not ph.slices:
                p_e, p_t = ph.energy_j, ph.duration_s
                low = high = eerl.DefaultEquivalent(p_e, p_t)
            else:
                p_e, p_t = None, None
            if ph.energy_j is not None:
                self.phase_measured_j += ph.energy_j
            if ph.energy_j is None or p_e is None or p_t is None:
                continue
            window = (
                (ph.energy_j, ph.duration_s),
                (p_e, p_t),
                (low.energy_j or p_e, low.time_s or p_t),
                (high.energy_j or p_e, high.time_s or p_t),
            )
            self.phases.setdefault(name, Sums()).add(*window)
            times.append((ph.duration_s, p_t))
            windows.append(window)
        if len(windows) == len(observation.phases):
            pick = max if self.async_mode else sum
            self.total.add(
                *((sum(w[k][0] for w in windows), pick(w[k][1] for w in windows)) for k in range(4))
            )
            idle = [p.energy_j for p in observation.pool_idle.values()]
            if self.async_mode and idle and all(j is not None for j in idle):
                idle_j = sum(j or 0.0 for j in idle)
                by_phase = dict(zip(observation.phases, times, strict=True))
                bounds = {
                    name: (w[2][1], w[3][1])
                    for name, w in zip(observation.phases, windows, strict=True)
                }
                self.idle_extra_j += (
                    base.async_default_idle_j(idle_j, observation.pool_idle, by_phase) - idle_j
                )
                low_j, high_j = base.async_default_idle_range_j(
                    idle_j, observation.pool_idle, by_phase, bounds
                )
                self.idle_extra_low_j += low_j - idle_j
                self.idle_extra_high_j += high_j - idle_j
        self.controller.observe(observation)

    def add_idle(self, idle_j: float) -> None:
        """Add the run's idle energy to both sides of the job total.

        The same under either, but for the async pools' longer or shorter waits
        (``idle_extra_j``; the bounds with theirs, ``idle_extra_low_j`` and ``_high_j``).
        """
        self.total.measured_j += idle_j
        self.total.predicted_j += idle_j + self.idle_extra_j
        self.total.predicted_low_j += idle_j + self.idle_extra_low_j
        self.total.predicted_high_j += idle_j + self.idle_extra_high_j
