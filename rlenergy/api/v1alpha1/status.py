"""``RLEnergyPolicy`` status models: what the operator measured and decided.

Written only by the operator, through the ``/status`` subresource. Every field the operator
writes is declared here, so the generated CRD schema declares it too (the API server silently
drops undeclared status fields). Optional numbers are left out when unknown,
never written as 0 (an unreadable energy counter must not look like a saving). Models ignore
unknown keys: kopf keeps its own bookkeeping under ``status.kopf``.

Callers: the operator's status builder (``rlenergy_operator.builders``), ``crdgen``, tests.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from rlenergy.api import naming
from rlenergy.api import node as api_node


class _Status(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(
        extra="ignore", populate_by_name=True, alias_generator=naming.camel, frozen=True
    )


ConditionType = Literal["Ready", "Progressing", "Degraded", "RolloutStalled"]
CONDITION_TYPES: tuple[ConditionType, ...] = ("Ready", "Progressing", "Degraded", "RolloutStalled")


class Condition(_Status):
    """One condition, in the shape of Kubernetes' metav1.Condition."""

    type: ConditionType = Field(description="Ready, Progressing, Degraded or RolloutStalled.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason, for machines.",
    )
    message: str = Field("", max_length=32768, description="What happened, for humans.")
    last_transition_time: str = Field(
        description="RFC 3339 time the status last changed.",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int = Field(0, ge=0, description="metadata.generation it describes.")


class Saving(_Status):
    """Energy saved against the predicted default governor on the same tokens."""

    percent: float | None = Field(
        None,
        description=(
            "Saved joules / predicted default joules x 100 over the compared steps; absent "
            "when not computable (no prediction or unknown energy)."
        ),
    )
    joules: float | None = Field(None, description="Predicted default minus measured, J.")
    low_percent: float | None = Field(
        None,
        description=(
            "Lowest saving the evidence allows, %: against the low bound of the default "
            "counterfactual (a locked clock's ratio from the clock model or the blocks measured "
            "at it, whichever is lower, less 2 standard errors); absent with percent."
        ),
    )
    high_percent: float | None = Field(
        None,
        description="Highest saving the evidence allows, %: against the high bound; absent "
        "with percent.",
    )


class _DefaultBounds(_Status):
    """Bounds of the predicted default-governor figures, shared by a phase and the totals.

    The controller's evidence +-2 standard errors (``STATUS_Z`` in rlenergy/control/freq/eerl.py).
    """

    predicted_default_low_joules: float = Field(
        0.0,
        ge=0,
        description="Low bound of predictedDefaultJoules over the same windows, J.",
    )
    predicted_default_high_joules: float = Field(
        0.0,
        ge=0,
        description="High bound of predictedDefaultJoules over the same windows, J.",
    )
    predicted_default_low_seconds: float = Field(
        0.0,
        ge=0,
        description="Low bound of predictedDefaultSeconds over the same windows, s.",
    )
    predicted_default_high_seconds: float = Field(
        0.0,
        ge=0,
        description="High bound of predictedDefaultSeconds over the same windows, s.",
    )


class PhaseStatus(_DefaultBounds):
    """One phase: chosen clock, throughput and energy against the predicted default governor."""

    name: str = Field(description="Phase name.")
    state: api_node.PlanState = Field(
        description="warmup, trial, locked, fallback (default governor after an error) or observe."
    )
    clock_mhz: int | None = Field(
        None,
        description="Chosen SM clock, MHz; absent = default governor (or none chosen yet).",
    )
    recommended_clock_mhz: int | None = Field(
        None,
        description=(
            "Observe mode: the clock the GPU model prefers for this phase under "
            "minThroughputRatio, MHz (a model prior; enforce mode measures instead)."
        ),
    )
    estimated_saving_percent: float | None = Field(
        None,
        description=(
            "Observe mode: phase energy saving the GPU model expects at recommendedClockMHz, "
            "% of the default governor's (a [MODEL] estimate, not a measurement)."
        ),
    )
    recommendation_basis: str | None = Field(
        None,
        description="Observe mode: where recommendedClockMHz comes from, or why there is none.",
    )
    min_throughput_ratio: float | None = Field(
        None,
        description="Effective threshold (async mode may relax it into the slower pool's slack).",
    )
    throughput_ratio: float | None = Field(
        None,
        description=(
            "Predicted default-governor phase time / measured phase time over the compared "
            "steps, trials included (1 = as fast as the default)."
        ),
    )
    energy_per_valid_token_joules: float | None = Field(
        None,
        description="Measured phase energy per valid token of the newest complete step, J.",
    )
    predicted_default_energy_per_valid_token_joules: float | None = Field(
        None,
        description="Predicted default-governor phase energy per valid token, same step, J.",
    )
    measured_joules: float = Field(0.0, ge=0, description="Measured phase energy, all steps, J.")
    predicted_default_joules: float = Field(
        0.0,
        ge=0,
        description="Predicted default-governor phase energy over the compared steps, J.",
    )
    compared_measured_joules: float = Field(
        0.0,
        ge=0,
        description="Measured phase energy of the compared steps, J.",
    )
    measured_seconds: float = Field(0.0, ge=0, description="Phase time of the compared steps, s.")
    predicted_default_seconds: float = Field(
        0.0,
        ge=0,
        description="Predicted default-governor phase time of the compared steps, s.",
    )
    throughput_ratio_low: float | None = Field(
        None,
        description="Lowest throughput ratio the evidence allows (predictedDefaultLowSeconds / "
        "measuredSeconds).",
    )
    throughput_ratio_high: float | None = Field(
        None,
        description="Highest throughput ratio the evidence allows (predictedDefaultHighSeconds "
        "/ measuredSeconds).",
    )
    basis_energy_source: str | None = Field(
        None,
        description=(
            "Energy source (counter, power_integration, ...) of the phase's first "
            "default-governor window; only windows metered by it are compared (like with like)."
        ),
    )
    saving: Saving = Field(default_factory=Saving, description="Saving of this phase.")
    selections: int = Field(0, ge=0, description="Clock selections made so far.")
    last_retrial_reason: str | None = Field(None, description="Why the newest re-trial started.")
    probe_evidence: str | None = Field(
        None,
        description=(
            "What EE-RL's trials of this phase measure: in-phase slices (the trainer's progress "
            "reports resolve them) or whole-phase steps (no or too coarse progress), and why."
        ),
    )


class Totals(_DefaultBounds):
    """Job totals over every accounted step (source: the node reports)."""

    steps: int = Field(0, ge=0, description="Complete RL steps accounted.")
    through_step: int = Field(
        -1,
        ge=-1,
        description="Newest step accounted (-1: none); the restart checkpoint.",
    )
    measured_joules: float = Field(0.0, ge=0, description="Measured GPU energy, J.")
    predicted_default_joules: float = Field(
        0.0,
        ge=0,
        description="Predicted default-governor energy of the compared steps, J.",
    )
    compared_measured_joules: float = Field(
        0.0,
        ge=0,
        description="Measured energy of the compared steps, J.",
    )
    saved_joules: float = Field(
        0.0,
        description="predictedDefaultJoules - comparedMeasuredJoules, J.",
    )
    measured_seconds: float = Field(
        0.0,
        ge=0,
        description="Busy time of the compared steps (phases), s.",
    )
    predicted_default_seconds: float = Field(
        0.0,
        ge=0,
        description="Predicted default-governor busy time of the compared steps, s.",
    )
    saving_percent: float | None = Field(
        None,
        description="savedJoules / predictedDefaultJoules x 100; absent when not computable.",
    )
    throughput_ratio: float | None = Field(
        None,
        description="Predicted default step time / measured step time over the compared steps.",
    )
    throughput_ratio_low: float | None = Field(
        None,
        description="Lowest throughput ratio the evidence allows (predictedDefaultLowSeconds / "
        "measuredSeconds).",
    )
    throughput_ratio_high: float | None = Field(
        None,
        description="Highest throughput ratio the evidence allows (predictedDefaultHighSeconds "
        "/ measuredSeconds).",
    )
    saving_low_percent: float | None = Field(
        None,
        description="Lowest saving the evidence allows, % (predictedDefaultLowJoules less "
        "comparedMeasuredJoules over it); absent with savingPercent.",
    )
    saving_high_percent: float | None = Field(
        None,
        description="Highest saving the evidence allows, % (predictedDefaultHighJoules); "
        "absent with savingPercent.",
    )
    valid_tokens: float = Field(
        0.0, ge=0, description="Valid training tokens (responses that reach the update)."
    )
    compared_steps: int = Field(
        0,
        ge=0,
        description="Steps with both a measured energy and a default prediction.",
    )
    unknown_energy_steps: int = Field(
        0,
        ge=0,
        description="Steps whose energy was unknown (an unreadable counter): never counted as 0.",
    )
    missed_steps: int = Field(
        0,
        ge=0,
        description="Steps that left the node reports' window before they were accounted.",
    )
    stalled_seconds: float = Field(
        0.0,
        ge=0,
        description="Stalled rollout time (progress frozen with requests in flight at low "
        "power), excluded from every compared figure, s.",
    )
    stalled_joules: float = Field(
        0.0,
        ge=0,
        description="Energy of the stalled time, J: in measuredJoules, never compared.",
    )
    source_mismatch_steps: int = Field(
        0,
        ge=0,
        description="Steps not compared because a phase's energy came from another source "
        "(counter, integrated power) than its default-governor basis: savings compare like "
        "with like.",
    )


class ScaleStatus(_Status):
    """The newest between-steps resize decision of the rollout worker set (releaseAction scale)."""

    for_step: int = Field(ge=0, description="RL step the dispatcher asked the worker count for.")
    desired: int = Field(ge=1, description="Workers the dispatcher asked for, workers.")
    current: int = Field(ge=0, description="Replicas of the worker set when decided, workers.")
    target: int = Field(ge=0, description="Replicas after the decision, workers.")
    floor: int = Field(
        ge=1, description="max(expert floor, experts.replicas, minActiveWorkers), workers."
    )
    reason: str = Field(
        description=(
            "AtTarget, ShrinkBetweenSteps, GrowBetweenSteps, ShrinkRejected, AboveMaxWorkers "
            "(more than spec.rollout.maxWorkers or the workload's rlenergy.io/max-workers), "
            "WorkerSetNotFound, ScaleFailed, UnsupportedWorkerSet; for a RayCluster worker "
            "group also WorkersUnknown (fewer released worker pods known than the shrink "
            "needs) and OutsideWorkerGroupBounds (target outside minReplicas..maxReplicas)."
        )
    )
    message: str = Field("", description="What happened, for humans.")
    workers_to_delete: list[str] | None = Field(
        None,
        description=(
            "RayCluster: the released worker pods this shrink named in the group's "
            "scaleStrategy.workersToDelete."
        ),
    )
    decided_at: str | None = Field(
        None,
        description="RFC 3339 time of the decision.",
        json_schema_extra={"format": "date-time"},
    )


class RolloutFailureStatus(_Status):
    """The newest failed shrink step of the rollout (FlexFloor's fail-safe outcome)."""

    reason: str = Field(
        description=(
            "RolloutWorkerLost (a rollout worker pod ended mid-rollout: its node agent saw it "
            "deleted, preempted or no longer allocated), or the dispatcher's ReleaseAborted, "
            "ResizeInFlight, RankLost, EngineDegraded, ShrinkRecoveryFailed."
        )
    )
    message: str = Field("", description="What happened and what to do.")
    step: int = Field(ge=0, description="RL step the dispatcher had published last, then.")
    lost_workers: list[str] | None = Field(
        None, description="namespace/name of the rollout worker pods that ended mid-rollout."
    )
    since: str | None = Field(
        None,
        description="RFC 3339 time the operator first saw it.",
        json_schema_extra={"format": "date-time"},
    )


class RolloutStatus(_Status):
    """MoE rollout worker release (FlexFloor), from the node reports and the worker set.

    ``releasedGpuSeconds``, ``responseTokens`` and ``occupiedGpuSeconds`` are folded once per
    complete RL step and checkpointed with ``throughStep`` (a restart neither loses nor double
    counts a step).
    """

    active: int = Field(
        0,
        ge=0,
        description=(
            "Active rollout workers: the worker set's replicas (scale), else the dispatcher's "
            "newest published count."
        ),
    )
    released: int = Field(
        0, ge=0, description="Workers released in the dispatcher's newest published step."
    )
    released_gpu_seconds: float = Field(
        0.0,
        ge=0,
        description="GPU time parked as released rollout workers, over the folded steps, GPU-s.",
    )
    parked_gpus: int = Field(0, ge=0, description="GPUs parked now (node reports), GPUs.")
    occupied_gpu_seconds: float = Field(
        0.0,
        ge=0,
        description=(
            "GPU time in generation windows minus the parked part, over the folded steps, GPU-s."
        ),
    )
    response_tokens: float = Field(
        0.0,
        ge=0,
        description="Response tokens of the folded steps (trainer SDK), tokens.",
    )
    tokens_per_occupied_gpu_second: float | None = Field(
        None,
        description=(
            "responseTokens / occupiedGpuSeconds, tokens per GPU-s; absent before a step "
            "with generation time is folded."
        ),
    )
    through_step: int = Field(
        -1,
        ge=-1,
        description="Newest step folded into the sums (-1: none); the restart checkpoint.",
    )
    floor: int | None = Field(
        None,
        ge=1,
        description=(
            "Fewest workers a resize may leave: max(expert floor, experts.replicas, "
            "minActiveWorkers); absent without workerMemoryBytes."
        ),
    )
    scale: ScaleStatus | None = Field(
        None, description="Newest resize decision of workerSetRef (releaseAction scale)."
    )
    failure: RolloutFailureStatus | None = Field(
        None,
        description=(
            "The newest failed shrink step, while it stands (the policy is Degraded with its "
            "reason); cleared once the dispatcher publishes a later step without a failure."
        ),
    )
    reloaded_experts: list[int] | None = Field(
        None,
        description=(
            "Experts the dispatcher reloaded onto survivors (a lost rank's) or copied to them "
            "(a release) in its newest published step."
        ),
    )
    placement_unbalanced: bool = Field(
        False,
        description=(
            "The survivors host unequal expert counts (after reloads or copies) until the "
            "engine group is rebalanced; the dispatcher's newest publication."
        ),
    )


class NodeError(_Status):
    """One node-level problem."""

    node: str = Field(description="Node name.")
    gpu: str | None = Field(None, description="GPU UUID, when one GPU is concerned.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field("", description="What happened.")


class NodesStatus(_Status):
    """Node agents reporting for this policy."""

    ready: int = Field(0, ge=0, description="Nodes whose report is current and has a usable GPU.")
    total: int = Field(0, ge=0, description="Nodes with a report.")
    errors: list[NodeError] = Field(
        default_factory=list,
        max_length=64,
        description="Node and GPU errors (at most 64).",
    )


class RLEnergyPolicyStatus(_Status):
    """Observed state of an RLEnergyPolicy."""

    observed_generation: int | None = Field(
        None, description="metadata.generation last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=8,
        description="Ready, Progressing and Degraded, with reasons.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    plan: api_node.ClockPlan | None = Field(
        None, description="Clock plan the node agents apply (one entry per phase)."
    )
    phases: list[PhaseStatus] = Field(
        default_factory=list, max_length=16, description="Per-phase results."
    )
    totals: Totals | None = Field(None, description="Job totals.")
    rollout: RolloutStatus | None = Field(None, description="MoE rollout worker release.")
    nodes: NodesStatus | None = Field(None, description="Node agents ready and total.")
    kopf: dict[str, Any] | None = Field(
        None,
        description="kopf's handler progress and last handled spec (operator bookkeeping).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    def condition(self, type_: ConditionType) -> Condition | None:
        """The condition of ``type_``, if set."""
        return next((c for c in self.conditions if c.type == type_), None)

    def phase(self, name: str) -> PhaseStatus | None:
        """The status of phase ``name``, if any."""
        return next((p for p in self.phases if p.name == name), None)
