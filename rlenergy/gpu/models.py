"""GPU performance and power models per SKU, loaded from ``data/gpus.yaml``.

Callers: ``rlenergy.gpu.simulated`` (the simulated device), ``rlenergy.sim.workload`` (rescaling
trace phase times to a SKU) and ``rlenergy.sim.job`` (ground truth and the oracle).

Model (docs/simulator.md, "GPU model", [MODEL]): at SM clock ``f`` with boost clock ``f0``

* time  ``t(f) = t(f0) * ((1 - m) * f0 / f + m)``
* power ``P(f) = Pc + Pd * (f / f0) ** a``

with ``m`` the share of the phase that does not scale with the SM clock. For generation ``m``
grows with the mean context length (longer KV reads make decode more memory bound) [MODEL].
"""

from __future__ import annotations

import functools
import math
from importlib import resources
from typing import Literal

import pydantic
import yaml

PhaseKind = Literal["generation", "forward", "training", "idle"]
"""What a phase does to the GPU: decode (memory bound), forward passes only (verl's
log-probability and value passes, ``rlenergy.api.phases``), train (forward, backward and
optimizer; compute bound) or nothing."""


class _Frozen(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")


class GenerationModel(_Frozen):
    """Decode-phase parameters (see module docstring)."""

    m0: float = pydantic.Field(gt=0, lt=1)
    m_ctx_slope: float
    ctx_ref_tokens: float = pydantic.Field(gt=0)
    m_min: float = pydantic.Field(gt=0, lt=1)
    m_max: float = pydantic.Field(gt=0, lt=1)
    pc_w: float = pydantic.Field(ge=0)
    pd_w: float = pydantic.Field(ge=0)
    a: float = pydantic.Field(gt=0)

    def memory_share(self, mean_context_tokens: float) -> float:
        """Share ``m`` of decode time that does not scale with the SM clock (0..1)."""
        ctx = max(mean_context_tokens, 1.0)
        m = self.m0 + self.m_ctx_slope * math.log(ctx / self.ctx_ref_tokens)
        return min(max(m, self.m_min), self.m_max)


class TrainingModel(_Frozen):
    """Compute-bound phase parameters (see module docstring)."""

    m: float = pydantic.Field(gt=0, lt=1)
    pc_w: float = pydantic.Field(ge=0)
    pd_w: float = pydantic.Field(ge=0)
    a: float = pydantic.Field(gt=0)


class GpuSku(_Frozen):
    """One GPU SKU: clocks, power and phase models. Units in field names."""

    key: str
    nvml_name: str
    gpu_product_label: str
    max_sm_clock_mhz: int = pydantic.Field(gt=0)
    min_sm_clock_mhz: int = pydantic.Field(gt=0)
    clock_step_mhz: int = pydantic.Field(gt=0)
    memory_clock_mhz: int = pydantic.Field(gt=0)
    power_limit_w: float = pydantic.Field(gt=0)
    min_power_limit_w: float = pydantic.Field(gt=0)
    idle_power_w: float = pydantic.Field(gt=0)
    memory_bandwidth_tbps: float = pydantic.Field(gt=0)
    dense_bf16_tflops: float = pydantic.Field(gt=0)
    generation: GenerationModel
    training: TrainingModel
    forward: TrainingModel | None = None
    """Forward-only passes (``PhaseKind`` ``forward``); None: as ``training``."""

    def _compute(self, kind: PhaseKind) -> TrainingModel:
        """The compute-bound model of ``kind`` (``forward`` or ``training``)."""
        if kind == "forward" and self.forward is not None:
            return self.forward
        return self.training

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """Supported SM clocks, descending, as NVML lists them at the top memory clock."""
        return tuple(range(self.max_sm_clock_mhz, self.min_sm_clock_mhz - 1, -self.clock_step_mhz))

    def memory_share(self, kind: PhaseKind, mean_context_tokens: float) -> float:
        """Share of phase time that does not scale with the SM clock (idle: 1)."""
        if kind == "generation":
            return self.generation.memory_share(mean_context_tokens)
        if kind in ("training", "forward"):
            return self._compute(kind).m
        return 1.0

    def time_factor(self, kind: PhaseKind, clock_mhz: float, mean_context_tokens: float) -> float:
        """Phase time at ``clock_mhz`` relative to the time at max boost (>= 1 below boost)."""
        m = self.memory_share(kind, mean_context_tokens)
        return (1.0 - m) * self.max_sm_clock_mhz / clock_mhz + m

    def power_w(self, kind: PhaseKind, clock_mhz: float) -> float:
        """Mean board power of a phase at ``clock_mhz``, W (before the power limit)."""
        if kind == "idle":
            return self.idle_power_w
        p = self.generation if kind == "generation" else self._compute(kind)
        return float(p.pc_w + p.pd_w * (clock_mhz / self.max_sm_clock_mhz) ** p.a)

    def idle_power_for(self, locked_mhz: float | None) -> float:
        """Idle power, W, with a clock lock held (``locked_mhz``) or not (this family: the same)."""
        return self.idle_power_w

    def power_capped_clock_mhz(self, kind: PhaseKind, power_limit_w: float | None = None) -> float:
        """Highest clock at which the phase stays within the power limit, MHz (continuous).

        Args:
            kind: phase kind.
            power_limit_w: board power limit, W (None: the SKU's default limit). A limit set
                with ``nvmlDeviceSetPowerManagementLimit`` caps the default governor and any
                lock alike [MODEL: the governor settles where the phase's P(f) meets the limit].
        """
        limit = self.power_limit_w if power_limit_w is None else power_limit_w
        if kind == "idle" or self.power_w(kind, self.max_sm_clock_mhz) <= limit:
            return float(self.max_sm_clock_mhz)
        p = self.generation if kind == "generation" else self._compute(kind)
        ratio = max(limit - p.pc_w, 0.0) / p.pd_w
        return float(max(self.max_sm_clock_mhz * ratio ** (1.0 / p.a), self.min_sm_clock_mhz))

    def effective_clock_mhz(
        self, kind: PhaseKind, locked_max_mhz: float | None, power_limit_w: float | None = None
    ) -> float:
        """Clock the GPU runs a phase at: the lock (or boost) capped by the power limit."""
        target = float(self.max_sm_clock_mhz) if locked_max_mhz is None else float(locked_max_mhz)
        return min(target, self.power_capped_clock_mhz(kind, power_limit_w))


class ClockEstimate(_Frozen):
    """A clock the SKU model prefers for one phase, and what the model expects of it.

    Attributes:
        clock_mhz: SM clock to lock, MHz.
        throughput_ratio: model phase throughput at the clock / at the default governor.
        energy_ratio: model phase energy at the clock / at the default governor (same work).
    """

    clock_mhz: int
    throughput_ratio: float
    energy_ratio: float


def estimate_best_clock(
    sku: GpuSku,
    kind: PhaseKind,
    min_throughput_ratio: float,
    mean_context_tokens: float,
    clocks_mhz: tuple[int, ...] | list[int],
) -> ClockEstimate | None:
    """The model's most energy-efficient clock that keeps ``min_throughput_ratio``.

    A prior, not a measurement: it applies this SKU's [MODEL] phase curves (module docstring)
    to the default governor (boost capped by the power limit) and to every clock in
    ``clocks_mhz``. Observe mode reports it as a recommendation; enforce mode measures instead.

    Args:
        sku: the GPU model.
        kind: ``generation``, ``forward`` or ``training`` (``idle`` has no clock effect: None).
        min_throughput_ratio: least throughput vs the default governor, in (0, 1].
        mean_context_tokens: mean context length of the phase (generation's memory share).
        clocks_mhz: candidate SM clocks, MHz.

    Returns:
        The estimate, or None when no candidate below the default clock keeps the ratio.
    """
    if kind == "idle":
        return None
    f_def = sku.effective_clock_mhz(kind, None)
    t_def = sku.time_factor(kind, f_def, mean_context_tokens)
    e_def = sku.power_w(kind, f_def) * t_def
    best: ClockEstimate | None = None
    for clock in clocks_mhz:
        f = sku.effective_clock_mhz(kind, clock)
        if f >= f_def:
            continue
        t = sku.time_factor(kind, f, mean_context_tokens)
        thr, energy = t_def / t, sku.power_w(kind, f) * t / e_def
        if thr >= min_throughput_ratio and (best is None or energy < best.energy_ratio):
            best = ClockEstimate(clock_mhz=int(clock), throughput_ratio=thr, energy_ratio=energy)
    return best


def sku_for_nvml_name(name: str) -> GpuSku | None:
    """The SKU whose NVML device name is ``name`` (case-insensitive), if the catalog has it."""
    for sku in catalog().skus.values():
        if sku.nvml_name.lower() == name.strip().lower():
            return sku
    return None


class ReferenceGpu(_Frozen):
    """A GPU that a trace was recorded on (used for rescaling phase times only)."""

    key: str
    memory_bandwidth_tbps: float = pydantic.Field(gt=0)
    dense_bf16_tflops: float = pydantic.Field(gt=0)
    match: tuple[str, ...]


class SensorModel(_Frozen):
    """NVML sensor behaviour (see gpus.yaml for sources)."""

    energy_counter_update_min_s: float
    energy_counter_update_max_s: float
    power_average_window_s: float
    power_read_noise_frac: float


class NoiseModel(_Frozen):
    """Run-to-run variation [MODEL]."""

    phase_time_sigma_frac: float = pydantic.Field(ge=0)
    phase_power_sigma_frac: float = pydantic.Field(ge=0)
    per_gpu_power_spread_frac: float = pydantic.Field(ge=0)


class Catalog(_Frozen):
    """Everything in ``gpus.yaml``."""

    skus: dict[str, GpuSku]
    reference_gpus: dict[str, ReferenceGpu]
    sensors: SensorModel
    noise: NoiseModel


@functools.cache
def catalog() -> Catalog:
    """Load and validate the packaged ``data/gpus.yaml`` (cached)."""
    text = resources.files("rlenergy.gpu").joinpath("data/gpus.yaml").read_text()
    raw = yaml.safe_load(text)
    for section in ("skus", "reference_gpus"):
        for key, value in raw[section].items():
            value["key"] = key
    return Catalog.model_validate(raw)


def sku_names(*, published: bool = False) -> tuple[str, ...]:
    """Names accepted by ``get_sku`` (with ``published``: also the second family's curves)."""
    if not published:
        return tuple(catalog().skus)
    from rlenergy.gpu import published as published_family

    return (*catalog().skus, *published_family.curve_names())


def get_sku(name: str) -> GpuSku:
    """Return the SKU model called ``name``.

    ``<sku>:<curve>`` names a curve of the published family (``rlenergy.gpu.published``).

    Raises:
        KeyError: unknown SKU; the message lists the known ones.
    """
    if ":" in name:
        from rlenergy.gpu import published as published_family

        return published_family.get(name)
    skus = catalog().skus
    if name not in skus:
        raise KeyError(f"unknown GPU {name!r}; known: {', '.join(skus)}")
    return skus[name]


def match_reference_gpu(description: str) -> ReferenceGpu | None:
    """Find the reference GPU named in a trace's free-text GPU description, if any."""
    for ref in catalog().reference_gpus.values():
        if any(token.lower() in description.lower() for token in ref.match):
            return ref
    return None
