"""Operator <-> node agent wire models: the clock plan and the per-step energy records.

The operator writes a ``ClockPlan`` into ``RLEnergyPolicy.status.plan``; agents watch it and
apply it locally the moment a phase starts (clock switches never wait for the operator). Each
agent writes one ``RLEnergyNodeReport`` per policy and node whose spec is a ``NodeReport``:
GPU states and a bounded list of ``StepRecord``s, at most one write per RL step. Camel-case
aliases are the YAML/JSON names; units are in the names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from rlenergy.api import naming


class _Wire(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(
        populate_by_name=True, alias_generator=naming.camel, extra="ignore", frozen=True
    )


PlanState = Literal["warmup", "trial", "locked", "fallback", "observe"]

MAX_STEP = 2**31 - 1
"""Largest RL step a signal or report may carry: a step a second for 68 years, and within the
int32 range every consumer (the operator's status, Prometheus, kubectl columns) reads exactly.
A step of 2^64 + 1 would pass JSON but not the API server's int64 fields."""
MAX_TOKENS = 1e12
"""Largest token count of one step, tokens [MODEL: a million samples of a million tokens; any
real batch is far smaller]: the bound keeps counters summed over steps finite."""
MAX_WORKERS = 4096
"""Largest rollout worker count a dispatcher may publish (``spec.rollout.maxWorkers`` bounds
it further per policy)."""

POD_REF_MAX = 317
"""Longest ``namespace/name`` of a pod: a 63-character namespace, ``/``, a 253-character name."""


class _Input(_Wire):
    """A model a trainer pod sends (through its node agent): finite numbers only."""

    model_config = pydantic.ConfigDict(allow_inf_nan=False)


class PhasePlan(_Wire):
    """What agents do during one phase."""

    phase: str = Field(description="Phase name (generation, training or custom).")
    clock_mhz: int | None = Field(
        None,
        description="SM clock to lock during the phase; null = default governor.",
    )
    state: PlanState = Field(description="Selection state that produced this plan.")
    probe_clocks_mhz: list[int | None] = Field(
        default_factory=list,
        description=(
            "When set, run the phase as slices cycling through these clocks "
            "(null = default governor)."
        ),
    )
    probe_slice_seconds: float = Field(0.0, ge=0, description="Probe slice length, s.")
    reason: str = Field("", description="Why, for humans.")
    since_step: int | None = Field(
        None,
        ge=0,
        description="First RL step this phase has run with this clock and state.",
    )


class ClockPlan(_Wire):
    """The operator's plan for a policy's GPUs, valid from ``step`` on."""

    step: int = Field(ge=0, description="First RL step the plan applies to.")
    policy_generation: int = Field(0, ge=0, description="metadata.generation planned for.")
    enforce: bool = Field(True, description="False in observe mode: agents never touch clocks.")
    phases: list[PhasePlan] = Field(default_factory=list, description="One entry per phase.")
    issued_at: str | None = Field(
        None,
        description="RFC 3339 time the operator published this plan.",
    )

    def for_phase(self, phase: str) -> PhasePlan | None:
        """The entry for ``phase``, if any."""
        return next((p for p in self.phases if p.phase == phase), None)


class TokenWorkloadReport(_Input):
    """The step's token workload as the trainer SDK reported it (job level).

    Finite and at most ``MAX_TOKENS`` each (``samples`` at most ``MAX_STEP``), so the agent's
    and the operator's sums stay finite.
    """

    samples: int = Field(ge=0, le=MAX_STEP, description="Samples (responses) in the step's batch.")
    response_tokens: float = Field(
        ge=0, le=MAX_TOKENS, description="Response tokens generated in the step."
    )
    prompt_tokens: float = Field(
        ge=0, le=MAX_TOKENS, description="Prompt tokens of the step's samples."
    )
    valid_tokens: float = Field(
        ge=0,
        le=MAX_TOKENS,
        description="Valid training tokens: response tokens of samples that reach the update.",
    )
    mean_context_tokens: float = Field(
        ge=0, le=MAX_TOKENS, description="Mean prompt + response tokens per sample."
    )
    generation_progress_source: str | None = Field(
        None,
        max_length=253,
        description="Where the step's in-phase generation progress was read: the inference "
        "engine's metric naming the SDK matched (vllm, vllm-ray, vllm-router, sglang, "
        "sglang-underscore, sglang-ray; several engines comma-separated), sdk (tokens the job "
        "reported itself, the engine's counter missing), or null (none, or not said).",
    )


class SliceReport(_Wire):
    """One probe slice on this node (energy summed over the node's GPUs of the job)."""

    clock_mhz: int | None = Field(
        None, description="SM clock of the slice, MHz; null = default governor."
    )
    duration_seconds: float = Field(ge=0, description="Length of the slice, s.")
    progress: float = Field(
        ge=0, description="Work done in the slice, in the SDK's unit for the phase."
    )
    energy_joules: float | None = Field(
        None, ge=0, description="Energy of the slice, J; null = unknown."
    )
    stalled: bool = Field(
        False,
        description="The slice overlaps a stall (progress frozen with requests in flight at "
        "low power) or was held through one: its probe block is not evidence.",
    )
    effective_clock_mhz: int | None = Field(
        None,
        description="Lowest SM clock a GPU of the slice held over two consecutive read-backs "
        "during a locked slice, MHz "
        "(null: default governor or unread); a block is credited to it when a cap held the "
        "GPU below the lock.",
    )
    energy_source: str | None = Field(
        None,
        description="instant_power (mean of the slice's power samples) or the counter "
        "fallback's source; a probe block compares power only within one source.",
    )
    rate_reports: int | None = Field(
        None,
        ge=0,
        description="Progress reports the slice's rate was measured from (inside it, at its "
        "own clock); fewer than 2: its progress is the log interpolated across its boundaries "
        "(a report gap longer than the slice mixes clocks) and its probe block is not "
        "evidence; null: not counted.",
    )
    lead_seconds: float = Field(
        0.0,
        ge=0,
        description="Time from the slice's start until the phase's work began (the trainer "
        "signalled before its first kernels; from the progress log), s: no part of the "
        "slice's rate or power, and the default governor would wait as long.",
    )
    lead_energy_joules: float | None = Field(
        None,
        ge=0,
        description="Energy of that lead, J (included in energyJoules); null: no lead or unknown.",
    )


class PhaseWindowReport(_Wire):
    """One phase window of one step on this node."""

    phase: str = Field(description="Phase name as the trainer SDK signalled it.")
    duration_seconds: float = Field(ge=0, description="Length of the window, s.")
    energy_joules: float | None = Field(
        None,
        ge=0,
        description="Counter deltas summed over the node's GPUs; null = unknown.",
    )
    requested_clock_mhz: int | None = Field(
        None,
        description="SM clock the plan asked for, MHz; null = default governor.",
    )
    applied_clock_mhz: int | None = Field(
        None,
        description="Lowest SM clock a GPU of the window held over two consecutive read-backs "
        "after the switch, MHz (one low read between reads at the lock is a transient).",
    )
    slowdown: bool = Field(
        False, description="A power/thermal clock-event reason held the clock down."
    )
    slices: list[SliceReport] = Field(
        default_factory=list, description="Probe slices of an in-phase trial, in order."
    )
    error: str | None = Field(None, description="Errors in the window (NVML calls), for humans.")
    energy_source: str | None = Field(
        None,
        description="counter | power_integration | averaged_power | unavailable | mixed.",
    )
    incomplete: bool = Field(
        False, description="A GPU failed or was lost in the window; energy is a lower bound."
    )
    low_confidence: bool = Field(
        False,
        description="Averaged power only and the window is shorter than twice its 1 s average.",
    )
    gpu_energy_joules: dict[str, float | None] = Field(
        default_factory=dict,
        description="Per GPU UUID energy of the window, J (null = unknown).",
    )
    progress: float = Field(
        0.0, ge=0, description="Work the trainer SDK reported in the window (its unit)."
    )
    progress_mean_gap_seconds: float | None = Field(
        None,
        ge=0,
        description=(
            "Window length / (progress reports that advanced the total + 1): the mean time "
            "between the trainer's progress steps, s; null = no progress reported in the window "
            "(EE-RL then uses whole-phase evidence)."
        ),
    )
    progress_max_gap_seconds: float | None = Field(
        None,
        ge=0,
        description=(
            "Largest time between the window's start, the trainer's progress reports that "
            "advanced the total and its end, s; null = no progress reported in the window."
        ),
    )
    gpu_seconds: float = Field(0.0, ge=0, description="Window time x the window's GPUs, GPU-s.")
    released_gpu_seconds: float = Field(
        0.0,
        ge=0,
        description="Part of gpuSeconds the GPUs spent parked (released rollout workers), GPU-s.",
    )
    stalled_seconds: float = Field(
        0.0,
        ge=0,
        description="Part of durationSeconds the window was stalled (progress frozen with "
        "requests in flight at low power), s; excluded from savings and trial evidence.",
    )
    stalled_energy_joules: float | None = Field(
        0.0,
        ge=0,
        description="Part of energyJoules spent stalled, J (same source); null = unknown.",
    )


class StepRecord(_Wire):
    """One RL step as seen by one node."""

    step: int = Field(ge=0, description="RL step number, as the trainer SDK reported it.")
    workload: TokenWorkloadReport
    phases: list[PhaseWindowReport] = Field(
        default_factory=list, description="Phase windows of the step on this node, in order."
    )
    idle_energy_joules: float | None = Field(
        None,
        ge=0,
        description="Energy outside phase windows during the step.",
    )
    idle_gpu_seconds: float | None = Field(
        None,
        ge=0,
        description="Time outside phase windows during the step, summed over the GPUs, GPU-s "
        "(async mode: a pool's wait for the slower one; null: not reported).",
    )
    released_gpu_seconds: float = Field(
        0.0,
        ge=0,
        description="GPU time parked in this step as released rollout workers, GPU-s.",
    )


GpuCondition = Literal["ok", "measureOnly", "degraded", "lost"]
ClockState = Literal["unlocked", "settling", "asRequested", "capped", "unexplained", "idle"]


class EnergyCrossCheck(_Wire):
    """The last check of the energy counter against integrated instant power on one GPU."""

    counter_joules: float = Field(ge=0, description="Energy from the counter over the check, J.")
    power_joules: float = Field(ge=0, description="Instant power integrated over the same time, J.")
    window_seconds: float = Field(ge=0, description="Check length, s.")
    mismatch: bool = Field(description="The two disagree by more than the threshold (15 %).")
    mismatches: int = Field(0, ge=0, description="Checks that mismatched since the agent began.")


class GpuStatus(_Wire):
    """One GPU on the node."""

    uuid: str = Field(description="GPU UUID (never an index).")
    name: str = Field("", description="GPU product name (NVML).")
    condition: GpuCondition = Field(
        "ok",
        description="ok; measureOnly (energy measured, clocks not controlled); degraded "
        "(telemetry partly unavailable); lost.",
    )
    reason: str = Field(
        "", description="Why the condition is not ok, e.g. NoPermission, ClockListUnavailable."
    )
    locked_clock_mhz: int | None = Field(None, description="Current lock; null = default.")
    reset_acknowledged: bool = Field(
        False,
        description="Clocks returned to the default governor after policy removal.",
    )
    energy_joules_total: float = Field(0.0, ge=0, description="Running energy total of the GPU, J.")
    supported_clocks_mhz: list[int] = Field(
        default_factory=list,
        description="Supported SM clocks at the highest memory clock, MHz (NVML); for candidates.",
    )
    energy_source: str | None = Field(
        None,
        description="counter | power_integration | averaged_power | unavailable.",
    )
    energy_known: bool = Field(
        True,
        description="False when no energy reading works (energyJoulesTotal is then meaningless).",
    )
    phase: str | None = Field(None, description="Current phase on this GPU (idle-watchdog hint).")
    pod: str | None = Field(None, description="namespace/name of the pod holding the GPU.")
    parked: bool = Field(
        False,
        description="Parked at its lowest SM clock as a released rollout worker (FlexFloor).",
    )
    requested_clock_mhz: int | None = Field(
        None,
        description="SM clock the plan asks for on this GPU, MHz; null = default governor.",
    )
    effective_clock_mhz: int | None = Field(
        None,
        description="SM clock read back after the lock settled (re-read while locked), MHz.",
    )
    clock_state: ClockState = Field(
        "unlocked",
        description="The lock against what the GPU runs: unlocked, settling, asRequested, "
        "capped (below the lock with a clock-event reason), unexplained (below it with none), "
        "idle.",
    )
    clock_limit: str = Field(
        "",
        description="The clock-event reasons holding a capped GPU below its lock, e.g. "
        "SwPowerCap,SwThermalSlowdown.",
    )
    energy_cross_check: EnergyCrossCheck | None = Field(
        None,
        description="Last energy counter vs instant power check (counter-metered GPUs only).",
    )
    stalled_seconds: float | None = Field(
        None,
        ge=0,
        description="The pod's phase on this GPU is stalled (progress frozen with requests in "
        "flight at low power) since this long, s; null = not stalled.",
    )


class RolloutDispatch(_Input):
    """What the rollout dispatcher published through its node agent (FlexFloor).

    The dispatcher (trainer side) has no Kubernetes credentials; it posts this to its node's
    agent (``POST /v1/rollout``), which carries it in its node report. The operator reads the
    newest one (highest ``step``) over the policy's reports: ``nextStepWorkers`` is the worker
    count the next step needs (``releaseAction: scale``).
    """

    step: int = Field(ge=0, le=MAX_STEP, description="RL step the counts describe.")
    active_workers: int = Field(
        ge=0, le=MAX_WORKERS, description="Rollout workers in the EP group at the end."
    )
    released_workers: int = Field(
        0, ge=0, le=MAX_WORKERS, description="Workers released during the step."
    )
    next_step_workers: int | None = Field(
        None,
        ge=1,
        le=MAX_WORKERS,
        description="Workers the next step needs (the operator resizes the worker set).",
    )
    worker_pods: list[Annotated[str, Field(max_length=POD_REF_MAX)]] = Field(
        default_factory=list,
        max_length=MAX_WORKERS,
        description=(
            "namespace/name of the pod of each active rank, rank order (the operator tells a "
            "rollout worker pod that ended mid-rollout from any other)."
        ),
    )
    failure: RolloutFailure | None = Field(
        None, description="The newest shrink step of ``step`` that failed; null: none."
    )
    reloaded_experts: list[Annotated[int, Field(ge=0, le=MAX_STEP)]] = Field(
        default_factory=list,
        max_length=65536,
        description=(
            "Experts reloaded onto survivors (a lost rank's, from the weights) or copied to "
            "them (a committed release) during the step."
        ),
    )
    placement_unbalanced: bool = Field(
        False,
        description=(
            "The survivors host unequal expert counts after reloads or copies, until the "
            "engine group is rebalanced (a restart or the next placement)."
        ),
    )


class RolloutFailure(_Input):
    """One failed shrink step of the rollout dispatcher (FlexFloor's fail-safe outcome)."""

    reason: Literal[
        "ReleaseAborted", "ResizeInFlight", "RankLost", "EngineDegraded", "ShrinkRecoveryFailed"
    ] = Field(
        description=(
            "ReleaseAborted: a release round aborted (a refusal or a missed ack deadline; the "
            "group is unchanged); ResizeInFlight: the engine's resize was sent and did not "
            "end within the commit timeout; RankLost: a rank left without a plan (torn down "
            "abort-style); EngineDegraded: the engine refused a resize for good (HTTP 409 or "
            "a reconfiguration already active) and no further release is sent to it; "
            "ShrinkRecoveryFailed: growing the group back before the next rollout failed (the "
            "next step runs with the size read back)."
        )
    )
    message: str = Field("", max_length=1024, description="What happened, for the Event.")
    ranks: list[Annotated[int, Field(ge=0, le=MAX_STEP)]] = Field(
        default_factory=list, max_length=4096, description="Ranks the failure concerns."
    )


class EndedPod(_Wire):
    """A pod the agent governed that ended; the agent reset its GPUs to the default governor."""

    pod: str = Field(description="namespace/name.")
    how: Literal["NotAllocated", "EndedInApi"] = Field(
        description=(
            "NotAllocated: the kubelet no longer allocates it GPUs; EndedInApi: the API shows "
            "it deleted, being deleted, terminal or replaced by a pod of another UID."
        )
    )
    gpus: list[str] = Field(default_factory=list, description="Its GPUs, reset.")
    parked: bool = Field(
        False, description="Every GPU it held was parked (a released rollout worker)."
    )
    step: int = Field(-1, ge=-1, description="Newest RL step the agent had seen then (-1: none).")


class ExpiredLease(_Wire):
    """A phase whose trainer went silent past its lease; the agent reset its GPUs."""

    pod: str = Field(max_length=317, description="namespace/name of the signalling pod.")
    phase: str = Field(max_length=253, description="The phase that was open.")
    step: int = Field(ge=0, description="Its RL step.")
    silent_seconds: float = Field(
        ge=0, description="Time since the pod's newest phase signal or progress report, s."
    )
    lease_seconds: float = Field(
        ge=0,
        description="The lease: 3 x the phase's longest window on this node, at least 120 s "
        "(1800 s before one closed), s.",
    )
    gpus: list[str] = Field(
        default_factory=list, max_length=64, description="Its GPUs, back at the default governor."
    )


SleepResult = Literal["Verified", "Mismatch", "Unknown"]


class SleepGpuReading(_Wire):
    """One GPU read by the agent before and after an engine's sleep."""

    gpu: str = Field(max_length=96, description="GPU UUID.")
    memory_before_bytes: int | None = Field(
        None, ge=0, description="Framebuffer memory in use at the sleep's start, bytes."
    )
    memory_after_bytes: int | None = Field(
        None, ge=0, description="Framebuffer memory in use after the sleep returned, bytes."
    )
    power_before_watts: float | None = Field(
        None, ge=0, description="Power at the sleep's start (instant power where NVML has it), W."
    )
    power_after_watts: float | None = Field(
        None, ge=0, description="Power after the sleep returned, read the same way, W."
    )


class SleepCheck(_Wire):
    """An engine sleep a trainer pod signalled, checked against the GPUs' memory and power."""

    pod: str = Field(max_length=317, description="namespace/name of the signalling pod.")
    step: int = Field(ge=0, description="RL step of the sleep.")
    result: SleepResult = Field(
        description="Verified: memory and power dropped on every GPU; Mismatch: the sleep was "
        "signalled but memory or power did not drop on a GPU (the engine kept its memory or "
        "kept working); Unknown: a reading failed, nothing is claimed."
    )
    reason: str = Field("", max_length=1024, description="What did not drop, for humans.")
    saved_watts: float | None = Field(
        None,
        ge=0,
        description="Power the sleep freed, summed over the GPUs, W; set only when Verified.",
    )
    gpus: list[SleepGpuReading] = Field(
        default_factory=list, max_length=64, description="The readings per GPU."
    )


NodeConditionType = Literal["PodResourcesListed", "GpusSettled"]


class NodeCondition(_Wire):
    """One condition of the node's agent (what it can trust now)."""

    type: NodeConditionType = Field(
        description="PodResourcesListed: the kubelet's PodResources listing is fresh enough to "
        "attribute GPUs; GpusSettled: no GPU is lost, off its lock or being re-initialised "
        "(windows on such a GPU carry an error and are kept out of savings)."
    )
    status: Literal["True", "False"] = Field(description="True or False.")
    reason: str = Field(
        "",
        max_length=64,
        description="Why, e.g. Fresh, Stale, Expired, Waiting, ResourceExhausted, Unavailable, "
        "SocketMissing; Settled, GpuLost, LockLost, DriverChanged.",
    )
    message: str = Field("", max_length=1024, description="What happened and what to do.")


class NodeReport(_Wire):
    """Spec of an ``RLEnergyNodeReport``: one per policy and node, written by that node's agent."""

    policy_name: str = Field(description="RLEnergyPolicy of this report (same namespace).")
    node_name: str = Field(description="Node whose agent writes this report.")
    gpus: list[GpuStatus] = Field(
        default_factory=list, description="The node's GPUs, one entry per physical GPU."
    )
    steps: list[StepRecord] = Field(
        default_factory=list,
        description="The step records the operator has not folded yet (after "
        "foldedThroughStep; bounded), oldest first.",
    )
    last_step: int = Field(-1, description="Newest step reported (-1: none).")
    folded_through_step: int = Field(
        -1,
        ge=-1,
        le=MAX_STEP,
        description="The policy's totals.throughStep the agent read when it left out the "
        "records the operator had folded: every record at or before it left this report, and "
        "a step after it that the report lacks was skipped (-1: no record left).",
    )
    measured_joules_total: float = Field(
        0.0,
        ge=0,
        description="Sum of energyJoulesTotal over the node's GPUs whose energy is known, J.",
    )
    unattributed_joules_total: float = Field(
        0.0,
        ge=0,
        description="Energy of GPUs no pod holds, J.",
    )
    released_gpu_seconds_total: float = Field(
        0.0,
        ge=0,
        description="GPU time parked as released rollout workers since the agent started, GPU-s.",
    )
    rollout: RolloutDispatch | None = Field(
        None, description="The rollout dispatcher's newest publication on this node."
    )
    ended_pods: list[EndedPod] = Field(
        default_factory=list,
        max_length=64,
        description="Governed pods that ended, newest last (bounded; FlexFloor's lost ranks).",
    )
    expired_leases: list[ExpiredLease] = Field(
        default_factory=list,
        max_length=64,
        description="Phases whose trainer stopped signalling past the lease, newest last "
        "(bounded); their GPUs were returned to the default governor.",
    )
    sleep_checks: list[SleepCheck] = Field(
        default_factory=list,
        max_length=64,
        description="Engine sleeps the trainer signalled, each checked against the GPUs' "
        "memory and power, newest last (bounded); a sleep's saving is claimed only when "
        "Verified.",
    )
    conditions: list[NodeCondition] = Field(
        default_factory=list,
        max_length=8,
        description="The agent's conditions: its kubelet listing and its GPUs' lifecycle.",
    )
    nvml_error: str | None = Field(
        None,
        max_length=1024,
        description="Why the agent cannot load NVML on this node, with the fix (the agent "
        "pod's runtime class); null when NVML works. The node then lists no GPU.",
    )


def unfolded_steps(steps: Sequence[int], folded_through_step: int) -> tuple[list[int], int]:
    """The steps a node report holds once the policy's status folded ``folded_through_step``.

    The operator folds a step into ``status.totals`` in the same status write that moves
    ``totals.throughStep`` to it, so a record at or before the ``throughStep`` an agent read
    from the API server is in the totals for good and leaves the report; every later record
    stays until a status that folded it is read. A report then holds what the operator has not
    folded (a few records) instead of a window of ``MAX_STEPS_KEPT`` (32) of them.

    Args:
        steps: the finished steps the agent holds records of, ascending.
        folded_through_step: ``status.totals.throughStep`` as the agent last read it (-1:
            unknown, nothing folded, the policy is gone).

    Returns:
        (the steps the report holds, its ``foldedThroughStep``): the latter is
        ``folded_through_step`` when a record left, else -1, so a report that dropped nothing
        keeps its window from its oldest record (``rlenergy.control.freq.aggregate``: a node
        that started late does not count for the steps before its first record, while a
        report that left records out counts for every step after ``foldedThroughStep``).
    """
    kept = [s for s in steps if s > folded_through_step]
    return kept, folded_through_step if len(kept) < len(steps) else -1


def wire_form(report: NodeReport) -> dict[str, Any]:
    """``report`` as an agent writes it: JSON (camelCase) without the members the CRD restores.

    Leaves out every object member whose value is null where null is its default (a null
    member and a missing one mean the same to the report's readers; a null whose field has
    another default, ``stalledEnergyJoules``' unknown, stays: the CRD marks such a field
    ``nullable``) and every member equal to its field's scalar default (``false``, ``0.0``,
    ``""``, -1): the CRD
    declares each such default (``rlenergy.api.crdgen``; ``tests/unit/api/test_wire_form.py``
    holds them equal), so the API server stores and answers the same object as for the whole
    dump (structural schema defaulting). Lists keep every item, so list indexes (a JSON
    Patch's paths) hold on the stored object. Each probe slice of a step record carried
    ``"stalled": false`` and ``"leadSeconds": 0.0``: a probed step of 8 GPUs shrinks by about a
    quarter.

    Returns:
        The spec as a JSON-ready dict.
    """
    data = report.model_dump(by_alias=True, mode="json")
    _strip(report, data)
    return data


def _strip(model: pydantic.BaseModel, data: dict[str, Any]) -> None:
    """Drop from ``data`` (``model``'s dump) the null members and the scalar defaults."""
    for name, field in type(model).model_fields.items():
        key = field.alias or name
        if key not in data:
            continue
        value = getattr(model, name)
        default = field.default
        if value is None:
            if not isinstance(default, bool | int | float | str):
                del data[key]  # null is the default, or the field has none: missing says it
        elif (
            isinstance(default, bool | int | float | str)
            and type(value) is type(default)
            and value == default
        ):
            del data[key]
        elif isinstance(value, pydantic.BaseModel):
            _strip(value, data[key])
        elif isinstance(value, list | tuple):
            for item, dumped in zip(value, data[key], strict=True):
                if isinstance(item, pydantic.BaseModel):
                    _strip(item, dumped)
        elif isinstance(value, dict):
            data[key] = {k: v for k, v in data[key].items() if v is not None}
