"""``RLEnergyPolicy`` spec models (group ``rlenergy.io``, version ``v1alpha1``).

Pydantic v2 models are the contract: YAML uses camelCase aliases with units in names
(``minThroughputRatio``, ``clockRangeMHz``); field descriptions become ``kubectl explain``
text when the CRD is generated (``rlenergy.api.crdgen``). Specs forbid unknown fields so a
typo is an error, not a silently ignored setting.

Every cross-field rule exists twice, once as a pydantic validator (the simulator CLI, the
operator) and once as a CEL rule in ``x-kubernetes-validations`` (the API server refuses the
object at admission); ``tests/unit/api`` checks that both refuse the same documents.

Callers: ``rlenergy simulate --policy`` (``parse_policy``), ``rlenergy.control.freq.config``
and the operator (``rlenergy_operator``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field
from pydantic.config import JsonDict

from rlenergy import errors
from rlenergy.api import naming

GROUP = "rlenergy.io"
VERSION = "v1alpha1"
KIND = "RLEnergyPolicy"
PLURAL = "rlenergypolicies"
SHORT_NAME = "rlep"
CATEGORY = "rlenergy"

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""RFC 1123 label: phase names appear in metric labels and status keys."""


def _cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    out: JsonDict = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class _Spec(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(
        extra="forbid", populate_by_name=True, alias_generator=naming.camel, frozen=True
    )


class ClockRange(_Spec):
    """An inclusive SM clock range."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.minClockMHz < self.maxClockMHz",
                    "minClockMHz must be lower than maxClockMHz",
                )
            ]
        }
    )

    min_mhz: int = Field(
        alias="minClockMHz", gt=0, le=10000, description="Lowest SM clock to consider, MHz."
    )
    max_mhz: int = Field(
        alias="maxClockMHz", gt=0, le=10000, description="Highest SM clock to consider, MHz."
    )

    @pydantic.model_validator(mode="after")
    def _ordered(self) -> ClockRange:
        if self.min_mhz >= self.max_mhz:
            raise ValueError("minClockMHz must be lower than maxClockMHz")
        return self


ClockMHz = Annotated[int, Field(gt=0, le=10000)]


class PhaseSpec(_Spec):
    """One phase of the RL step and its clock-selection constraints."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!(has(self.clockCandidatesMHz) && has(self.clockRangeMHz))",
                    "give clockCandidatesMHz or clockRangeMHz, not both",
                ),
                _cel(
                    "!has(self.stepMHz) || has(self.clockRangeMHz)",
                    "stepMHz needs clockRangeMHz",
                    ".stepMHz",
                ),
                _cel(
                    "!has(self.stepMHz) || !has(self.clockRangeMHz) || "
                    "(self.clockRangeMHz.maxClockMHz - self.clockRangeMHz.minClockMHz)"
                    " % self.stepMHz == 0",
                    "stepMHz must divide the span maxClockMHz - minClockMHz of clockRangeMHz",
                    ".stepMHz",
                ),
            ]
        }
    )

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL,
        description=(
            "Phase name: generation, training, a verl training sub-phase that gets a clock "
            "of its own (old-log-prob, ref, values, update-critic, update-actor; one the "
            "policy does not list stays part of training), weight-sync (verl's weight sync "
            "between two steps; unlisted, it stays idle), or a custom name the trainer SDK "
            "reports (lower case letters, digits and '-', at most 63 characters)."
        ),
    )
    min_throughput_ratio: float = Field(
        0.95,
        gt=0.0,
        le=1.0,
        description=(
            "Least share of the predicted default governor's throughput on the same tokens "
            "that a chosen clock must keep, in (0, 1]. Default 0.95."
        ),
    )
    clock_candidates_mhz: list[ClockMHz] | None = Field(
        None,
        min_length=1,
        max_length=32,
        description="Explicit candidate SM clocks, MHz, no repeats; each must be supported.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    clock_range_mhz: ClockRange | None = Field(
        None,
        description="Candidate SM clock range, MHz (instead of clockCandidatesMHz).",
    )
    step_mhz: int | None = Field(
        None,
        gt=0,
        le=10000,
        description="Spacing of candidates inside clockRangeMHz, MHz; must divide the span.",
    )

    @pydantic.model_validator(mode="after")
    def _one_source(self) -> PhaseSpec:
        if self.clock_candidates_mhz is not None and self.clock_range_mhz is not None:
            raise ValueError("give clockCandidatesMHz or clockRangeMHz, not both")
        if self.clock_candidates_mhz is not None:
            dupes = sorted(
                {c for c in self.clock_candidates_mhz if self.clock_candidates_mhz.count(c) > 1}
            )
            if dupes:
                raise ValueError(f"clockCandidatesMHz repeats {dupes}")
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
        "enforce",
        description=(
            "enforce: set clocks; observe: measure, recommend and estimate savings, "
            "never touch clocks."
        ),
    )
    warmup_steps: int = Field(
        2, ge=1, le=100, description="Default-governor RL steps before trials."
    )
    trial_steps: int = Field(
        8, ge=1, le=100, description="Most trial RL steps per selection round."
    )
    drift_threshold: float = Field(
        0.25,
        gt=0.0,
        le=10.0,
        description=(
            "Relative workload change (e.g. 0.25 = 25 %) past the range the lock's trial "
            "steps spanned that forces a re-trial."
        ),
    )
    max_trial_fraction: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="Share of RL steps that may run trials, in (0, 1].",
    )


DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


class LabelSelectorRequirement(_Spec):
    """One label requirement (as in a Kubernetes LabelSelector)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "(self.operator in ['In', 'NotIn']) == "
                    "(has(self.values) && size(self.values) > 0)",
                    "In and NotIn need values; Exists and DoesNotExist take none",
                    ".values",
                )
            ]
        }
    )

    key: str = Field(min_length=1, max_length=317, pattern=LABEL_KEY, description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]] | None = Field(
        None, max_length=64, description="Values for In and NotIn."
    )

    @pydantic.model_validator(mode="after")
    def _values(self) -> LabelSelectorRequirement:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError("In and NotIn need values; Exists and DoesNotExist take none")
        return self


class LabelSelector(_Spec):
    """Label selector of the RL job's pods (same namespace as the policy); must not be empty."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "(has(self.matchLabels) && size(self.matchLabels) > 0) || "
                    "(has(self.matchExpressions) && size(self.matchExpressions) > 0)",
                    "selector must not be empty: give matchLabels or matchExpressions "
                    "(an empty selector would govern every pod of the namespace)",
                )
            ]
        }
    )

    match_labels: dict[str, Annotated[str, Field(max_length=63)]] | None = Field(
        None,
        max_length=64,
        description="Labels every selected pod carries.",
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        None, max_length=16, description="Label requirements, ANDed."
    )

    @pydantic.model_validator(mode="after")
    def _not_empty(self) -> LabelSelector:
        if not self.match_labels and not self.match_expressions:
            raise ValueError(
                "selector must not be empty: give matchLabels or matchExpressions "
                "(an empty selector would govern every pod of the namespace)"
            )
        return self

    def to_query(self) -> str:
        """The selector as a Kubernetes ``labelSelector`` query string."""
        parts = [f"{k}={v}" for k, v in sorted((self.match_labels or {}).items())]
        for req in self.match_expressions or ():
            if req.operator == "Exists":
                parts.append(req.key)
            elif req.operator == "DoesNotExist":
                parts.append(f"!{req.key}")
            else:
                op = "in" if req.operator == "In" else "notin"
                parts.append(f"{req.key} {op} ({','.join(req.values or ())})")
        return ",".join(parts)


class WorkerSetRef(_Spec):
    """The disaggregated rollout worker set the operator may shrink between steps."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "(self.kind == 'RayCluster') == has(self.workerGroupName)",
                    "workerGroupName is required for a RayCluster and allowed only there",
                    ".workerGroupName",
                )
            ]
        }
    )

    kind: Literal["LeaderWorkerSet", "RayCluster", "StatefulSet"] = Field(
        description="LeaderWorkerSet, RayCluster (one worker group) or StatefulSet."
    )
    name: str = Field(
        min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="Object name."
    )
    worker_group_name: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        description="RayCluster worker group that runs the rollout workers.",
    )

    @pydantic.model_validator(mode="after")
    def _group(self) -> WorkerSetRef:
        if (self.kind == "RayCluster") != (self.worker_group_name is not None):
            raise ValueError("workerGroupName is required for a RayCluster and allowed only there")
        return self


class ExpertsSpec(_Spec):
    """The MoE model's experts (FlexFloor never releases below what holds all of them)."""

    count: int = Field(ge=1, le=65536, description="Experts per MoE layer.")
    replicas: int = Field(1, ge=1, le=64, description="Replicas every expert must keep.")
    bytes_per_expert: int = Field(ge=1, description="Memory of one expert over all layers, bytes.")


DEFAULT_MAX_WORKERS = 64
"""``spec.rollout.maxWorkers`` when a policy leaves it out, workers [MODEL: an MoE rollout of
a few hundred GPUs at 4-8 GPUs a worker; a larger set names its bound]."""


class RolloutSpec(_Spec):
    """How an MoE rollout worker set may shrink (FlexFloor)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.releaseAction != 'scale' || has(self.workerSetRef)",
                    "releaseAction scale needs workerSetRef",
                    ".workerSetRef",
                ),
                _cel(
                    "self.releaseAction != 'scale' || has(self.workerMemoryBytes)",
                    "releaseAction scale needs workerMemoryBytes (the expert floor is "
                    "computed from it)",
                    ".workerMemoryBytes",
                ),
                _cel(
                    "!has(self.maxWorkers) || !has(self.minActiveWorkers) || "
                    "self.maxWorkers >= self.minActiveWorkers",
                    "maxWorkers must be at least minActiveWorkers",
                    ".maxWorkers",
                ),
                _cel(
                    "!has(self.workerMemoryBytes) || self.workerMemoryBytes >= "
                    "(has(self.denseBytes) ? self.denseBytes : 0) + self.experts.bytesPerExpert",
                    "workerMemoryBytes must hold denseBytes plus one expert (bytesPerExpert)",
                    ".workerMemoryBytes",
                ),
            ]
        }
    )

    worker_set_ref: WorkerSetRef | None = Field(
        None, description="Worker set to shrink (releaseAction scale)."
    )
    experts: ExpertsSpec = Field(description="Experts that must stay available.")
    min_active_workers: int = Field(1, ge=1, le=4096, description="Never release below this.")
    max_workers: int = Field(
        DEFAULT_MAX_WORKERS,
        ge=1,
        le=4096,
        description=(
            "Most rollout workers the operator lets the worker set have (releaseAction scale): "
            "a published nextStepWorkers above it is refused (AboveMaxWorkers) and the set "
            "left as it is. The worker set's own annotation rlenergy.io/max-workers (or a "
            "RayCluster group's maxReplicas) lowers it further."
        ),
    )
    worker_memory_bytes: int | None = Field(
        None,
        ge=1,
        le=2**50,
        description=(
            "Memory one rollout worker has for weights and KV cache, bytes (its GPUs' memory "
            "x the engine's memory utilisation). With experts and denseBytes it sets the "
            "expert floor, ceil(count x replicas / experts per worker); required for scale."
        ),
    )
    dense_bytes: int = Field(
        0,
        ge=0,
        le=2**50,
        description="Non-expert weights every worker holds (attention, embeddings), bytes.",
    )
    release_action: Literal["park", "scale"] = Field(
        "park",
        description=(
            "park: the node agent runs a released worker's GPUs at the lowest supported SM "
            "clock until the step ends; scale: the same, and between steps the operator "
            "resizes workerSetRef to the count the dispatcher published, never below the "
            "expert floor."
        ),
    )

    @pydantic.model_validator(mode="after")
    def _scale(self) -> RolloutSpec:
        if self.max_workers < self.min_active_workers:
            raise ValueError("maxWorkers must be at least minActiveWorkers")
        if self.release_action == "scale" and self.worker_set_ref is None:
            raise ValueError("releaseAction scale needs workerSetRef")
        if self.release_action == "scale" and self.worker_memory_bytes is None:
            raise ValueError(
                "releaseAction scale needs workerMemoryBytes (the expert floor is computed from it)"
            )
        if (
            self.worker_memory_bytes is not None
            and self.worker_memory_bytes < self.dense_bytes + self.experts.bytes_per_expert
        ):
            raise ValueError(
                "workerMemoryBytes must hold denseBytes plus one expert (bytesPerExpert)"
            )
        return self


DEFAULT_PHASES = (PhaseSpec(name="generation"), PhaseSpec(name="training"))


class RLEnergyPolicySpec(_Spec):
    """Desired state of an RLEnergyPolicy."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "required": ["selector"],
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.phases) || "
                    "self.phases.all(p, self.phases.exists_one(q, q.name == p.name))",
                    "phase names must be unique",
                    ".phases",
                ),
                _cel(
                    "self.mode != 'async' || (has(self.phases) && size(self.phases) >= 2)",
                    "async mode needs at least two phases (one per GPU pool)",
                    ".phases",
                ),
            ],
        }
    )

    selector: LabelSelector | None = Field(
        None,
        description=(
            "Label selector of the RL job's pods in the policy's namespace. Required by the "
            "API server; optional only for rlenergy simulate."
        ),
    )
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: phases alternate on the same GPUs; async: separate pools run at once.",
    )
    phases: list[PhaseSpec] = Field(
        default_factory=lambda: list(DEFAULT_PHASES),
        min_length=1,
        max_length=16,
        description="Phases of the RL step and their constraints (default: generation, training).",
        json_schema_extra={"default": [{"name": "generation"}, {"name": "training"}]},
    )
    controller: ControllerSpec = Field(
        default_factory=ControllerSpec,
        description="EE-RL controller settings.",
        json_schema_extra={"default": {}},
    )
    rollout: RolloutSpec | None = Field(
        None, description="MoE rollout worker release (FlexFloor); absent for dense models."
    )
    phase_source: Literal["socket", "annotation"] = Field(
        "socket",
        description=(
            "How the trainer's phase signals reach the node agent. socket (default): the "
            "agent's Unix socket (rlenergy.sdk.trainer), about 1 ms to the clocks, with "
            "in-phase progress, so EE-RL trials run as in-phase probe slices. annotation: the "
            "trainer annotates its own pod (rlenergy.io/phase, rlenergy.io/step; "
            "rlenergy.sdk.annotate) and the agent learns them from a watch on its node's "
            "pods: an API round trip plus the watch (tens of ms), good for whole phases "
            "only, so EE-RL trials alternate whole steps (no probe slices)."
        ),
    )

    @pydantic.field_validator("phases")
    @classmethod
    def _unique_phases(cls, phases: list[PhaseSpec]) -> list[PhaseSpec]:
        names = [p.name for p in phases]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"phase names must be unique; repeated: {', '.join(dupes)}")
        return phases

    @pydantic.model_validator(mode="after")
    def _async_pools(self) -> RLEnergyPolicySpec:
        if self.mode == "async" and len(self.phases) < 2:
            raise ValueError("spec.phases: async mode needs at least two phases (one per GPU pool)")
        return self

    def phase(self, name: str) -> PhaseSpec | None:
        """The phase called ``name``, if declared."""
        return next((p for p in self.phases if p.name == name), None)


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "spec"


def parse_policy(document: Any, *, require_selector: bool = False) -> RLEnergyPolicySpec:
    """Validate a policy: a full ``RLEnergyPolicy`` object or just its ``spec``.

    Args:
        document: the parsed YAML.
        require_selector: refuse a spec without ``selector`` (the operator; the API server
            requires it too). ``rlenergy simulate`` leaves it out.

    Raises:
        InvalidInputError: the first invalid field, named by its YAML path, with what is allowed.
    """
    if not isinstance(document, dict):
        raise errors.InvalidInputError(
            "policy", "expected a YAML mapping (an RLEnergyPolicy or its spec)"
        )
    if "kind" in document:
        if document.get("kind") != KIND:
            raise errors.InvalidInputError("kind", f"expected {KIND}, got {document.get('kind')!r}")
        document = document.get("spec") or {}
        prefix = "spec."
    else:
        prefix = "spec." if "spec" in document else ""
        document = document.get("spec", document)
    try:
        spec = RLEnergyPolicySpec.model_validate(document)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        field = prefix + _loc(loc) if loc else (prefix.rstrip(".") or "spec")
        raise errors.InvalidInputError(field, err["msg"]) from None
    if require_selector and spec.selector is None:
        raise errors.InvalidInputError(prefix + "selector", "required (the RL job's pods)")
    return spec
