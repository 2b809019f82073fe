"""Default-governor model: what a phase would cost under the default governor on given tokens.

EE-RL warm-up (step 2 of the ``rlenergy.control.freq.eerl`` docstring): fitted per phase on warm-up
steps under the default governor as a function of the step's token workload, so steps with different
response lengths are comparable. Model: ``time_s = a + b * tokens`` and ``energy_j = c + d *
tokens`` by least squares with a small ridge toward a pure per-token rate (stable with 2-3 warm-up
points). ``relative_sigma`` is the residual spread; on the shipped verl traces it is 2-11 % for
generation, which is why trial decisions use in-phase interleaved probes
(``rlenergy.control.freq.probe``) rather than step-level comparisons against this model.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope * x``; ``relative_sigma`` = residual sd / mean y."""

    intercept: float
    slope: float
    relative_sigma: float

    def __call__(self, x: float) -> float:
        """Predict ``y`` at ``x`` (never negative)."""
        return max(self.intercept + self.slope * x, 0.0)


def fit_linear(xs: list[float], ys: list[float], ridge: float = 0.1) -> LinearFit:
    """Least squares with a ridge on the intercept toward the per-unit-rate model.

    Args:
        xs: workload (tokens), one per observation.
        ys: measured cost (s or J), one per observation.
        ridge: weight pulling the intercept toward 0 relative to the data scale.

    Raises:
        ValueError: no observations or lengths differ.
    """
    if not xs or len(xs) != len(ys):
        raise ValueError("need matching, non-empty xs and ys")
    n = len(xs)
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    rate = my / mx if mx > 0 else 0.0
    if sxx <= 1e-12 * max(mx * mx, 1.0) or n < 3:
        slope, intercept = rate, 0.0
    else:
        sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
        ls_slope = sxy / sxx
        # Shrink toward the per-unit rate: lam in [0, 1) grows with the ridge and falls with spread.
        lam = ridge * (mx * mx) / (sxx / n + ridge * mx * mx)
        slope = (1 - lam) * ls_slope + lam * rate
        intercept = my - slope * mx
    resid = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    sd = math.sqrt(sum(r * r for r in resid) / max(n - 1, 1))
    return LinearFit(intercept, slope, sd / my if my > 0 else 0.0)


@dataclasses.dataclass
class DefaultModel:
    """Per-phase default-governor model of time and energy over tokens.

    Attributes:
        tokens: tokens of each default-governor observation.
        times_s: phase times, s.
        energies_j: phase energies, J (observations with unknown energy are left out).
    """

    tokens: list[float] = dataclasses.field(default_factory=list)
    times_s: list[float] = dataclasses.field(default_factory=list)
    energies_j: list[float] = dataclasses.field(default_factory=list)
    energy_tokens: list[float] = dataclasses.field(default_factory=list)
    max_points: int = 32

    def add(self, tokens: float, time_s: float, energy_j: float | None) -> None:
        """Record one default-governor phase window (keeps the newest ``max_points``)."""
        self.tokens.append(tokens)
        self.times_s.append(time_s)
        if energy_j is not None:
            self.energy_tokens.append(tokens)
            self.energies_j.append(energy_j)
        for series in (self.tokens, self.times_s, self.energy_tokens, self.energies_j):
            del series[: max(len(series) - self.max_points, 0)]

    @property
    def ready(self) -> bool:
        """At least one observation of time and energy."""
        return bool(self.tokens) and bool(self.energies_j)

    def time_fit(self) -> LinearFit:
        """Time model (requires ``ready``)."""
        return fit_linear(self.tokens, self.times_s)

    def energy_fit(self) -> LinearFit:
        """Energy model (requires ``ready``)."""
        return fit_linear(self.energy_tokens, self.energies_j)
