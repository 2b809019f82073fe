"""A second family of GPU curves, shaped on published measurements (``data/gpus-published.yaml``).

The first family (``rlenergy.gpu.models``) is the model EE-RL's fit assumes,
``t(f) = t0((1-m) f0/f + m)``. This family is not: each curve reproduces a shape that public
measurements show (the sources are ../shared/calibration/published-dvfs/README.md rows, named in
the YAML beside every number, or [MODEL]):

* time: a roofline with a smooth knee, ``t(f) = o + (1-o) g(f) / g(f0)``,
  ``g(f) = ((k f0 / f)^p + 1)^(1/p)``: compute time ``k f0 / f`` against a clock-free memory
  time, so the clock-insensitive share ``m`` is not one number but rises with the clock from
  near 0 (``k > 1``: batched, speculative or MoE decode, m 0.15-0.34) to above 0.99 (``k`` well
  below 1: small-batch decode on HBM parts); optionally a throughput step below a clock (a
  kernel threshold);
* power: a floor plus dynamic power linear in ``f`` below a voltage knee and ``f^3`` above it,
  ``P(f) = floor + dyn (f/f0) max(1, f/fv)^2 / max(1, f0/fv)^2``, so energy per token has an
  interior minimum;
* the default governor: locks at or above ``lock_clamp_mhz`` run at the clamp, and a phase whose
  ``P(f)`` passes the power limit runs at the highest clock of a plateau grid
  (``cap_plateau_mhz``) within it: compute-bound training at the default governor is
  power-capped at 73-80 % of the nominal clock;
* idle power is higher while a clock is locked (``locked_idle_power_w``).

Not modelled: the default clock's dithering over time (it is the capped clock's mean), history
and temperature drift, memory-clock interplay.
"""

from __future__ import annotations

import functools
import math
from importlib import resources

import pydantic
import yaml

from rlenergy.gpu import models


class _Frozen(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")


class TimeCurve(_Frozen):
    """Phase time vs SM clock (module docstring); fractions are of the max clock."""

    overhead: float = pydantic.Field(ge=0, lt=1)
    knee_frac: float = pydantic.Field(gt=0)
    sharpness: float = pydantic.Field(gt=0)
    step_below_frac: float | None = None
    step_factor: float = pydantic.Field(default=1.0, ge=1)

    def raw(self, f_frac: float) -> float:
        """Unnormalised time at clock fraction ``f_frac`` of the max clock."""
        g = float(((self.knee_frac / f_frac) ** self.sharpness + 1.0) ** (1.0 / self.sharpness))
        step = (
            self.step_factor
            if self.step_below_frac is not None and f_frac < self.step_below_frac
            else 1.0
        )
        return step * g

    def factor(self, f_frac: float) -> float:
        """Time at ``f_frac`` relative to the time at the max clock."""
        return self.overhead + (1.0 - self.overhead) * self.raw(f_frac) / self.raw(1.0)


class PowerCurve(_Frozen):
    """Board power vs SM clock (module docstring), W."""

    floor_w: float = pydantic.Field(ge=0)
    dyn_w: float = pydantic.Field(ge=0)
    voltage_knee_frac: float = pydantic.Field(gt=0, le=1)

    def watts(self, f_frac: float) -> float:
        """Power at clock fraction ``f_frac`` of the max clock, W."""
        v = max(1.0, f_frac / self.voltage_knee_frac) ** 2
        v0 = max(1.0, 1.0 / self.voltage_knee_frac) ** 2
        return self.floor_w + self.dyn_w * f_frac * v / v0


class PhaseCurve(_Frozen):
    """Time and power of one phase kind."""

    time: TimeCurve
    power: PowerCurve


class PublishedSku(models.GpuSku):
    """A SKU of the published family: the same clocks and sensors, other physics.

    ``generation`` / ``training`` (first-family parameters) are kept only so that code reading
    the first family's fields still runs; every physics method is overridden.
    """

    curve: str
    lock_clamp_mhz: int | None = None
    cap_plateau_mhz: int = pydantic.Field(gt=0)
    locked_idle_power_w: float = pydantic.Field(gt=0)
    gen_curve: PhaseCurve
    train_curve: PhaseCurve
    fwd_curve: PhaseCurve | None = None
    """Forward-only passes (``PhaseKind`` ``forward``); None: as ``train_curve``."""

    def _phase(self, kind: models.PhaseKind) -> PhaseCurve:
        if kind == "generation":
            return self.gen_curve
        if kind == "forward" and self.fwd_curve is not None:
            return self.fwd_curve
        return self.train_curve

    def memory_share(self, kind: models.PhaseKind, mean_context_tokens: float) -> float:
        """Local clock-insensitive share at the default clock: ``1 - d ln t / d ln f``."""
        if kind == "idle":
            return 1.0
        f = self.effective_clock_mhz(kind, None) / self.max_sm_clock_mhz
        curve = self._phase(kind).time
        h = 1e-4
        slope = (math.log(curve.factor(f * (1 + h))) - math.log(curve.factor(f))) / math.log(1 + h)
        return min(max(1.0 + slope, 0.0), 1.0)

    def time_factor(
        self, kind: models.PhaseKind, clock_mhz: float, mean_context_tokens: float
    ) -> float:
        """Phase time at ``clock_mhz`` relative to the time at the max clock."""
        if kind == "idle":
            return 1.0
        return self._phase(kind).time.factor(clock_mhz / self.max_sm_clock_mhz)

    def power_w(self, kind: models.PhaseKind, clock_mhz: float) -> float:
        """Mean board power at ``clock_mhz``, W (before the power limit)."""
        if kind == "idle":
            return self.idle_power_w
        return self._phase(kind).power.watts(clock_mhz / self.max_sm_clock_mhz)

    def idle_power_for(self, locked_mhz: float | None) -> float:
        """Idle power, W: higher while a clock is locked."""
        return self.idle_power_w if locked_mhz is None else self.locked_idle_power_w

    def power_capped_clock_mhz(
        self, kind: models.PhaseKind, power_limit_w: float | None = None
    ) -> float:
        """Highest plateau clock whose power is within the limit, MHz (plateau grid)."""
        limit = self.power_limit_w if power_limit_w is None else power_limit_w
        top = float(self.max_sm_clock_mhz)
        if kind == "idle" or self.power_w(kind, top) <= limit:
            return top
        step = self.cap_plateau_mhz
        f = top - step
        while f > self.min_sm_clock_mhz and self.power_w(kind, f) > limit:
            f -= step
        return float(max(f, self.min_sm_clock_mhz))

    def effective_clock_mhz(
        self,
        kind: models.PhaseKind,
        locked_max_mhz: float | None,
        power_limit_w: float | None = None,
    ) -> float:
        """The lock (or the max clock) clamped, then capped by the power limit."""
        target = float(self.max_sm_clock_mhz) if locked_max_mhz is None else float(locked_max_mhz)
        if self.lock_clamp_mhz is not None:
            target = min(target, float(self.lock_clamp_mhz))
        return min(target, self.power_capped_clock_mhz(kind, power_limit_w))


@functools.cache
def _raw() -> dict[str, object]:
    text = resources.files("rlenergy.gpu").joinpath("data/gpus-published.yaml").read_text()
    data: dict[str, object] = yaml.safe_load(text)
    return data


@functools.cache
def curves() -> dict[str, PublishedSku]:
    """Every curve of the family, keyed ``<sku>:<curve>`` (e.g. ``h100-sxm:hbm-decode``)."""
    out: dict[str, PublishedSku] = {}
    skus = _raw()["skus"]
    if not isinstance(skus, dict):
        raise ValueError("gpus-published.yaml: skus must be a mapping")
    for sku_key, spec in skus.items():
        fields = models.get_sku(sku_key).model_dump()
        fields.update({k: v for k, v in spec.items() if k not in CURVE_KEYS})
        for name, over in spec["curves"].items():
            key = f"{sku_key}:{name}"
            out[key] = PublishedSku.model_validate(
                {
                    **fields,
                    "key": key,
                    "curve": name,
                    "gen_curve": _merge(spec["generation"], over.get("generation", {})),
                    "train_curve": _merge(spec["training"], over.get("training", {})),
                    "fwd_curve": _merge(spec["forward"], over.get("forward", {}))
                    if "forward" in spec
                    else None,
                }
            )
    return out


CURVE_KEYS = ("generation", "training", "forward", "curves")
"""Keys of a SKU entry in gpus-published.yaml that are curves, not SKU fields."""


def _merge(base: dict[str, dict[str, float]], over: dict[str, dict[str, float]]) -> PhaseCurve:
    merged = {k: {**v, **over.get(k, {})} for k, v in base.items()}
    return PhaseCurve.model_validate(merged)


def curve_names() -> tuple[str, ...]:
    """Every ``<sku>:<curve>`` of the family."""
    return tuple(curves())


def get(name: str) -> PublishedSku:
    """The curve called ``<sku>:<curve>``.

    Raises:
        KeyError: unknown name; the message lists the known ones.
    """
    known = curves()
    if name not in known:
        raise KeyError(f"unknown published curve {name!r}; known: {', '.join(known)}")
    return known[name]
