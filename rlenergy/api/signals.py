"""Wire models of the trainer -> node agent signal protocol (HTTP over the agent's Unix socket).

The trainer SDK (``rlenergy.sdk.trainer.RLEnergyClient``) sends these requests and the agent's
signal server (``rlenergy_agent.server``) parses them with the same models, so the two sides
cannot drift apart. JSON, camelCase aliases, unknown fields refused (a misspelt ``gpus`` must
not silently widen a signal to every GPU of the pod).

Every request carries ``Authorization: Bearer <token>``: the pod's projected, audience-bound
service-account token (``TOKEN_AUDIENCE``; docs/agent.md). The agent answers:

========================  =======================  =====================================
path                      request                  answer (200)
========================  =======================  =====================================
``/v1/phase``             ``PhaseRequest``         ``PhaseAnswer``
``/v1/progress``          ``ProgressRequest``      ``PodAnswer``
``/v1/step``              ``StepRequest``          ``PodAnswer``
``/v1/park``              ``ParkRequest``          ``ParkAnswer``
``/v1/unpark``            ``UnparkRequest``        ``UnparkAnswer``
``/v1/rollout``           ``RolloutDispatch``      ``PodAnswer``
``/v1/rollout/lost``      ``LostWorkersRequest``   ``LostWorkersAnswer``
========================  =======================  =====================================

Refusals are ``ErrorAnswer`` with status 400 (bad body), 401 (no or invalid token), 403 (the
token's pod is not on this node or holds none of the named GPUs), 404 (unknown path), 409
(stale rollout step), 413 (body too large) or 503 (the token could not be checked: API server
unreachable).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from rlenergy.api import naming
from rlenergy.api.node import (
    MAX_STEP,
    MAX_TOKENS,
    RolloutDispatch,
    SleepCheck,
    TokenWorkloadReport,
)

TOKEN_AUDIENCE = "rlenergy-agent"
"""Default audience of the trainer pod's projected token (chart value ``agent.tokenAudience``)."""
TOKEN_FILE_ENV = "RLENERGY_AGENT_TOKEN_FILE"
"""Environment variable naming the token file in the trainer container."""
DEFAULT_TOKEN_FILE = "/var/run/secrets/rlenergy/token"
"""Where the trainer pod mounts the projected token by default (docs/verl.md)."""
CA_FILE_ENV = "RLENERGY_AGENT_CA_FILE"
"""Environment variable naming the CA bundle that signs the agents' serving certificates."""
DEFAULT_CA_FILE = "/var/run/secrets/rlenergy/ca.crt"
"""Where the injected volume puts the CA bundle (next to the token)."""
HOST_ENV = "RLENERGY_AGENT_HOST"
"""Environment variable with the node's IP (downward API ``status.hostIP``): the agent's TLS
endpoint."""
PORT_ENV = "RLENERGY_AGENT_PORT"
"""Environment variable with the agent's TLS port on the node."""
DEFAULT_TLS_PORT = 9403
"""The agent's TLS signal port on the node's IP (chart value ``agent.tlsPort``)."""


class _Wire(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(
        extra="forbid",
        populate_by_name=True,
        alias_generator=naming.camel,
        frozen=True,
        allow_inf_nan=False,
    )


MAX_IN_FLIGHT = 1_000_000
"""Most requests a rollout engine may report in flight (a bound, not a model of any engine)."""
MAX_MONOTONIC_S = 1e10
"""Largest CLOCK_MONOTONIC reading a progress report may carry, s (317 years of uptime)."""


_GPUS: Any = Field(
    default_factory=list,
    max_length=64,
    description="GPU (or MIG) UUIDs the signal is for, each the pod's own; empty: all of them.",
)


class PhaseRequest(_Wire):
    """The pod enters ``phase`` of RL step ``step`` now (``idle``/``none``/``""``: between)."""

    phase: str = Field(max_length=253, description="Phase name (generation, training, ...).")
    step: int = Field(ge=0, le=MAX_STEP, description="RL step index.")
    gpus: list[str] = _GPUS


class AppliedClock(_Wire):
    """What the actuator did on one GPU for a phase signal (read back from NVML)."""

    requested_mhz: int | None = Field(description="Plan clock, MHz.")
    target_mhz: int | None = Field(description="Clock written, MHz.")
    effective_mhz: int | None = Field(description="Read back, MHz.")
    skipped: str | None = Field(None, description="Why nothing was written (e.g. NoPermission).")
    error: str | None = Field(None, description="NVML error, if the write failed.")


class PhaseAnswer(_Wire):
    """The answer to ``PhaseRequest``."""

    pod: str = Field(description="The authenticated caller, ``namespace/name``.")
    gpus: list[str] = Field(description="Physical GPU UUIDs acted on.")
    latency_seconds: float = Field(description="Signal received to clocks applied, s.")
    applied: dict[str, AppliedClock] = Field(description="Per GPU UUID.")
    plan_phases: list[str] = Field(
        default_factory=list,
        description=(
            "Phase names of the plan the agent follows now, in the policy's order (its "
            "spec.phases; observe-mode plans included); empty when the agent has no plan. "
            "A trainer signals a training sub-phase (rlenergy.api.phases) under its own name "
            "only when it is listed here, else as training."
        ),
    )
    boundary_monotonic_seconds: float | None = Field(
        None,
        description=(
            "When the agent read the GPUs' energy counters for the window boundary this "
            "signal made (CLOCK_MONOTONIC, shared by the node's processes, s): the energy "
            "before it counts in the window the signal closed, after it in the one it opened. "
            "A trainer that books its work by time books the switch here, not at the answer's "
            "arrival, which a busy node delays by tens of ms."
        ),
    )


class ProgressRequest(_Wire):
    """Progress of the current phase: ``total`` (cumulative, preferred) or ``amount`` (delta)."""

    total: float | None = Field(
        None, ge=0, le=MAX_TOKENS, description="Progress of the phase so far (tokens, iters)."
    )
    amount: float | None = Field(
        None, ge=0, le=MAX_TOKENS, description="Progress since the last report."
    )
    at_monotonic_seconds: float | None = Field(
        None,
        ge=0,
        le=MAX_MONOTONIC_S,
        description="When the trainer measured ``total`` (CLOCK_MONOTONIC of the node), s.",
    )
    in_flight: int | None = Field(
        None,
        ge=0,
        le=MAX_IN_FLIGHT,
        description="Requests the caller has in flight now (rollout engines); with it the "
        "agent watches the phase for stalls (progress frozen, requests in flight, low power).",
    )

    @pydantic.model_validator(mode="after")
    def _one_of(self) -> ProgressRequest:
        if (self.total is None) == (self.amount is None):
            raise ValueError("give exactly one of 'total' (cumulative) or 'amount' (delta)")
        return self


class StepRequest(_Wire):
    """The pod finished RL step ``step`` with this token workload."""

    step: int = Field(ge=0, le=MAX_STEP, description="RL step index.")
    workload: TokenWorkloadReport


class ParkRequest(_Wire):
    """Park the pod's GPUs (or ``gpus``) at their lowest clock: a released rollout worker."""

    step: int = Field(ge=0, le=MAX_STEP, description="RL step of the release.")
    gpus: list[str] = _GPUS


class ParkedGpu(_Wire):
    """A GPU parked by a ``ParkRequest``."""

    clock_mhz: int | None = Field(description="Lock made (null: none).")


class ParkApplied(_Wire):
    """The actuator's read-back for a parked GPU."""

    effective_mhz: int | None = Field(description="Read back, MHz.")
    error: str | None = Field(None, description="NVML error, if the write failed.")


class ParkAnswer(_Wire):
    """The answer to ``ParkRequest``."""

    pod: str
    parked: dict[str, ParkedGpu] = Field(description="GPUs parked by this signal.")
    already: list[str] = Field(description="GPUs that were parked before (untouched).")
    applied: dict[str, ParkApplied] = Field(description="Read-back where a clock was set.")


class UnparkRequest(_Wire):
    """End the pod's parks (all, or those of ``gpus``)."""

    gpus: list[str] = _GPUS


class UnparkAnswer(_Wire):
    """The answer to ``UnparkRequest``."""

    pod: str
    released_gpu_seconds: float = Field(description="GPU time of the parks ended, GPU-s.")


class LostWorkersRequest(_Wire):
    """Ask which rollout worker pods the operator found lost mid-rollout (no fields)."""


class LostWorkersAnswer(_Wire):
    """The rollout worker pods the policy's status names lost (``status.rollout.failure``).

    The operator sets ``lostWorkers`` from the node agents' ended pods
    (``rlenergy_operator.rolloutfaults``); the agent follows the policy object and relays it
    to the dispatcher, which has no Kubernetes credentials and calls
    ``RolloutPlanner.rank_lost`` for each of its ranks on those pods.
    """

    pod: str
    lost_workers: list[str] = Field(
        default_factory=list, description="namespace/name of each lost rollout worker pod."
    )


class SleepRequest(_Wire):
    """The pod's engine is put to sleep (``begin``) or slept (``end``).

    ``begin`` comes before the engine's sleep call, ``end`` after it returned: the agent reads
    the pod's GPUs' memory and power at each.
    """

    step: int = Field(ge=0, le=MAX_STEP, description="RL step of the sleep.")
    stage: Literal["begin", "end"] = Field(description="begin: before the sleep; end: after.")


class SleepAnswer(_Wire):
    """The answer to a sleep signal: the check, once the sleep ended (``None`` at ``begin``)."""

    pod: str
    check: SleepCheck | None = None


class PodAnswer(_Wire):
    """The answer to progress, step and rollout signals: who was heard."""

    pod: str


class StepAnswer(_Wire):
    """The answer to a step signal: the step's energy on the caller's GPUs, per phase."""

    pod: str
    phase_energy_joules: dict[str, float | None] = Field(
        default_factory=dict,
        description=(
            "Energy the agent metered on the calling pod's GPUs in each phase window of the "
            "step, J (summed over the pod's windows; null: a window's energy is unknown)."
        ),
    )


class ErrorAnswer(_Wire):
    """Any refusal (4xx/5xx): what is wrong and what to change."""

    error: str


REQUESTS: dict[str, type[pydantic.BaseModel]] = {
    "/v1/phase": PhaseRequest,
    "/v1/progress": ProgressRequest,
    "/v1/step": StepRequest,
    "/v1/park": ParkRequest,
    "/v1/unpark": UnparkRequest,
    "/v1/rollout": RolloutDispatch,
    "/v1/rollout/lost": LostWorkersRequest,
    "/v1/sleep": SleepRequest,
}
"""The request model of each signal path."""


def requested_gpus(request: pydantic.BaseModel) -> list[str]:
    """The GPUs a request names (empty: every GPU of the caller's pod, or none applies)."""
    gpus = getattr(request, "gpus", None)
    return list(gpus) if gpus else []


PHASE_ANNOTATION = "rlenergy.io/phase"
"""Pod annotation carrying the pod's current phase (``phaseSource: annotation``)."""
STEP_ANNOTATION = "rlenergy.io/step"
"""Pod annotation carrying the RL step of ``PHASE_ANNOTATION`` (decimal, >= 0)."""
WORKLOAD_ANNOTATION = "rlenergy.io/workload"
"""Pod annotation carrying the last finished step's workload: a ``StepRequest`` as JSON."""


def annotated_phase(annotations: dict[str, str] | None) -> PhaseRequest | None:
    """The phase signal a pod's annotations carry (``phaseSource: annotation``).

    Args:
        annotations: ``metadata.annotations`` of the pod (``None``: none).

    Returns:
        A ``PhaseRequest`` for all of the pod's GPUs, or ``None`` when the pod carries neither
        ``PHASE_ANNOTATION`` nor ``STEP_ANNOTATION``.

    Raises:
        ValueError: only one of the two is set, or the step is not a decimal integer >= 0, or
            the phase is too long; the message names the annotation to fix.
    """
    got = annotations or {}
    phase, step = got.get(PHASE_ANNOTATION), got.get(STEP_ANNOTATION)
    if phase is None and step is None:
        return None
    if phase is None or step is None:
        missing = PHASE_ANNOTATION if phase is None else STEP_ANNOTATION
        raise ValueError(f"annotation {missing} is missing: set both in one patch")
    if not step.strip().isdecimal():
        raise ValueError(f"annotation {STEP_ANNOTATION}={step!r} must be an integer >= 0")
    try:
        return PhaseRequest(phase=phase, step=int(step))
    except pydantic.ValidationError as exc:
        raise ValueError(f"annotation {PHASE_ANNOTATION}: {exc.errors()[0]['msg']}") from None


def annotated_workload(annotations: dict[str, str] | None) -> StepRequest | None:
    """The step end a pod's ``WORKLOAD_ANNOTATION`` carries (``None``: not set).

    Raises:
        ValueError: the value is not a ``StepRequest`` JSON document (the message says why).
    """
    raw = (annotations or {}).get(WORKLOAD_ANNOTATION)
    if raw is None:
        return None
    try:
        return StepRequest.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "value"
        raise ValueError(f"annotation {WORKLOAD_ANNOTATION}: {where}: {err['msg']}") from None
