"""``RLEnergyPolicy`` spec models (group ``rlenergy.io``, version ``v1alpha1``).

Pydantic v2 models are the contract: YAML uses camelCase aliases with units in names
(``minThroughputRatio``, ``clockRangeMHz``); field descriptions become ``kubectl explain``
text when the CRD is generated. Specs forbid unknown fields so a typo is an error, not a
silently ignored setting.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from rlenergy import errors

GROUP = "rlenergy.io"
VERSION = "v1alpha1"
KIND = "RLEnergyPolicy"


class _Spec(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class ClockRange(_Spec):
    """An inclusive SM clock range."""

    min_mhz: int = Field(alias="minClockMHz", gt=0, description="Lowest SM clock to consider, MHz.")
    max_mhz: int = Field(alias="maxClockMHz", gt=0, description="Highest SM clock to consider, MHz.")

    @pydantic.model_validator(mode="after")
    def _ordered(self) -> ClockRange:
        if self.min_mhz >= self.max_mhz:
            raise ValueError("minClockMHz must be lower than maxClockMHz")
        return self


class PhaseSpec(_Spec):
    """One phase of the RL step and its clock-selection constraints."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Phase name: generation, training, or a custom name the SDK reports.",
    )
    min_throughput_ratio: float = Field(
        0.95,
        alias="minThroughputRatio",
        gt=0.0,
        le=1.0,
        description="Least share of the default governor's throughput a chosen clock must keep, in (0, 1].",
    )
    clock_candidates_mhz: list[int] | None = Field(
        None,
        alias="clockCandidatesMHz",
        min_length=1,
        max_length=32,
        description="Explicit candidate SM clocks, MHz; each must be supported by the GPUs.",
    )
    clock_range_mhz: ClockRange | None = Field(
        None, alias="clockRangeMHz", description="Candidate SM clock range, MHz (instead of explicit candidates)."
    )
    step_mhz: int | None = Field(
        None, alias="stepMHz", gt=0, description="Spacing of candidates inside clockRangeMHz, MHz."
    )
    power_limit_watts: float | None = Field(
        None, alias="powerLimitWatts", gt=0, description="Optional power limit during this phase, W."
    )

    @pydantic.model_validator(mode="after")
    def _one_source(self) -> PhaseSpec:
        if self.clock_candidates_mhz is not None and self.clock_range_mhz is not None:
            raise ValueError("give clockCandidatesMHz or clockRangeMHz, not both")
        if self.step_mhz is not None and self.clock_range_mhz is None:
            raise ValueError("stepMHz needs clockRangeMHz")
        if self.step_mhz is not None and self.clock_range_mhz is not None:
            span = self.clock_range_mhz.max_mhz - self.clock_range_mhz.min_mhz
            if span % self.step_mhz:
                raise ValueError(f"stepMHz {self.step_mhz} must divide the range span {span} MHz")
        return self


class ControllerSpec(_Spec):
    """How the EE-RL controller searches and monitors."""

    mode: Literal["enforce", "observe"] = Field(
        "enforce", description="enforce: set clocks; observe: measure and recommend, never touch clocks."
    )
    warmup_steps: int = Field(2, alias="warmupSteps", ge=1, le=100, description="Default-governor steps before trials.")
    trial_steps: int = Field(8, alias="trialSteps", ge=1, le=100, description="Most trial steps per selection round.")
    drift_threshold: float = Field(
        0.25, alias="driftThreshold", gt=0.0, le=10.0, description="Relative workload change that forces a re-trial."
    )
    max_trial_fraction: float = Field(
        0.25, alias="maxTrialFraction", gt=0.0, le=1.0, description="Share of steps that may run trials."
    )
    objective: Literal["energyPerValidToken"] = Field(
        "energyPerValidToken", description="What the controller minimises."
    )


DEFAULT_PHASES = (PhaseSpec(name="generation"), PhaseSpec(name="training"))


class RLEnergyPolicySpec(_Spec):
    """Desired state of an RLEnergyPolicy."""

    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: phases alternate on the same GPUs; async: separate pools run at once."
    )
    phases: list[PhaseSpec] = Field(
        default_factory=lambda: list(DEFAULT_PHASES),
        min_length=1,
        max_length=16,
        description="Phases of the RL step and their constraints.",
    )
    controller: ControllerSpec = Field(default_factory=ControllerSpec, description="Controller settings.")

    @pydantic.model_validator(mode="after")
    def _unique_phases(self) -> RLEnergyPolicySpec:
        names = [p.name for p in self.phases]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"phase names must be unique; repeated: {', '.join(dupes)}")
        return self

    def phase(self, name: str) -> PhaseSpec | None:
        """The phase called ``name``, if declared."""
        return next((p for p in self.phases if p.name == name), None)


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "spec"


def parse_policy(document: Any) -> RLEnergyPolicySpec:
    """Validate a policy: a full ``RLEnergyPolicy`` object or just its ``spec``.

    Raises:
        InvalidInputError: the first invalid field, named by its YAML path, with what is allowed.
    """
    if not isinstance(document, dict):
        raise errors.InvalidInputError("policy", "expected a YAML mapping (an RLEnergyPolicy or its spec)")
    if "kind" in document:
        if document.get("kind") != KIND:
            raise errors.InvalidInputError("kind", f"expected {KIND}, got {document.get('kind')!r}")
        document = document.get("spec") or {}
        prefix = "spec."
    else:
        prefix = "spec." if "spec" in document else ""
        document = document.get("spec", document)
    try:
        return RLEnergyPolicySpec.model_validate(document)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        raise errors.InvalidInputError(prefix + _loc(tuple(err["loc"])), err["msg"]) from None
