"""Wire models of the FlexFloor rollout protocol, and the ``ElasticEngine`` seam.

The trainer's dispatcher and the in-process planner (``rlenergy.sdk.planner.RolloutPlanner``)
exchange these messages (JSON, camelCase aliases, unknown fields refused):

1. ``PlacementRequest`` -> ``PlacementResponse``: where each response of the batch decodes;
2. ``ProgressReport``: per rollout worker, at a decode step, unfinished responses and memory;
3. ``ReleaseDecision``: workers that leave the expert-parallel (EP) group at decode step
   ``applyAtStep``, if every rank acknowledges by ``ackDeadlineStep``;
4. ``ReleaseAck`` from each rank (``ok: false`` refuses), then ``ReleaseOutcome``
   (``Committed`` or ``Aborted``; after an abort the group is exactly ``activeBefore``;
   ``InFlight`` when an engine's resize was sent and has not ended).

Step-synchronous semantics are in ``rlenergy.control.moe.protocol``. ``ElasticEngine`` is the
interface of a rollout engine whose EP group can shrink (vLLM and SGLang elastic EP adapters in
``rlenergy.sdk.engines``; the simulated engine in ``rlenergy.sim.moe_engine``). It lives here,
below both, because the SDK and the simulator must not import each other.
"""

from __future__ import annotations

from typing import Literal, Protocol

import pydantic
from pydantic import Field

from rlenergy.api import naming


class _Wire(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(
        extra="forbid", populate_by_name=True, alias_generator=naming.camel, frozen=True
    )


class PromptInfo(_Wire):
    """One prompt of a rollout batch."""

    prompt_id: str = Field(min_length=1, description="Stable id across epochs.")
    prompt_tokens: int = Field(ge=0, description="Prompt length, tokens.")
    responses: int = Field(1, ge=1, description="Responses sampled for it (GRPO group size).")


class PlacementRequest(_Wire):
    """The dispatcher asks where to decode a batch."""

    rollout_id: str = Field(min_length=1, description="RL step identifier.")
    workers: list[int] = Field(min_length=1, description="Active EP ranks at the step start.")
    prompts: list[PromptInfo] = Field(min_length=1)


class Assignment(_Wire):
    """Where one response decodes."""

    prompt_id: str = Field()
    response_index: int = Field(ge=0, description="Index in its group.")
    worker: int = Field(ge=0, description="EP rank that decodes it.")
    predicted_tokens: float = Field(ge=1, description="Tokens.")
    queued: bool = Field(False, description="Waits for KV memory to free before it starts.")


class PlacementResponse(_Wire):
    """The planner's answer to a ``PlacementRequest``."""

    rollout_id: str = Field()
    assignments: list[Assignment]


class ProgressReport(_Wire):
    """One rollout worker's state at a decode step."""

    rollout_id: str = Field()
    worker: int = Field(ge=0)
    decode_step: int = Field(ge=0)
    unfinished: int = Field(ge=0, description="Responses queued or running on the worker.")
    experts: list[int] = Field(description="Expert indices resident on the worker.")
    kv_bytes: int = Field(ge=0, description="KV cache in use, bytes.")
    kv_reserved_bytes: int = Field(0, ge=0, description="Predicted further KV growth, bytes.")


class ExpertMove(_Wire):
    """Copy an expert's weights to a survivor before the release applies."""

    expert: int = Field(ge=0)
    source: int = Field(ge=0)
    target: int = Field(ge=0)


class ReleaseDecision(_Wire):
    """Workers leave the EP group at ``applyAtStep`` if all ranks ack by the deadline."""

    rollout_id: str = Field()
    decision_id: int = Field(ge=0)
    release: list[int] = Field(min_length=1, description="EP ranks that leave.")
    moves: list[ExpertMove] = Field(default_factory=list)
    active_before: list[int] = Field(min_length=1)
    decided_at_step: int = Field(ge=0)
    ack_deadline_step: int = Field(ge=0)
    apply_at_step: int = Field(ge=0)

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> ReleaseDecision:
        if not self.decided_at_step <= self.ack_deadline_step < self.apply_at_step:
            raise ValueError("need decidedAtStep <= ackDeadlineStep < applyAtStep")
        if not set(self.release) <= set(self.active_before):
            raise ValueError("release must be a subset of activeBefore")
        if len(self.release) >= len(self.active_before):
            raise ValueError("a release must leave at least one active worker")
        return self

    @property
    def active_after(self) -> list[int]:
        """The EP group from ``applyAtStep`` on, if the release commits."""
        gone = set(self.release)
        return [w for w in self.active_before if w not in gone]


class ReleaseAck(_Wire):
    """A rank's answer to a ``ReleaseDecision``."""

    rollout_id: str = Field()
    decision_id: int = Field(ge=0)
    worker: int = Field(ge=0)
    ok: bool = Field(True, description="False refuses the release (the round aborts).")
    reason: str | None = Field(None, description="Why the rank refused.")


class ReleaseOutcome(_Wire):
    """How a release round ended."""

    rollout_id: str = Field()
    decision_id: int = Field(ge=0)
    status: Literal["Committed", "Aborted", "InFlight"] = Field(
        description="InFlight: the engine's resize was sent and has not ended; the group is "
        "neither known to be activeBefore nor activeAfter (poll the engine)."
    )
    active_workers: list[int] = Field(
        min_length=1, description="The group; InFlight: activeBefore."
    )
    reason: str | None = None


class ElasticEngine(Protocol):
    """A rollout engine whose expert-parallel group can drop ranks during a rollout.

    Two-phase use per ``ReleaseDecision``: ``prepare_release`` (checks and readies; mutates
    nothing the engine cannot undo; its ack says whether the rank can apply), then exactly one
    of ``commit_release`` (the group shrinks at ``applyAtStep``) or ``abort_release``.
    """

    def active_ranks(self) -> tuple[int, ...]:
        """EP ranks in the group now, ascending."""
        ...

    def prepare_release(self, decision: ReleaseDecision) -> ReleaseAck:
        """Ready the release (expert copies loaded, no request in flight on released ranks)."""
        ...

    def commit_release(self, decision: ReleaseDecision) -> tuple[int, ...]:
        """Apply a prepared release; returns the new active ranks."""
        ...

    def abort_release(self, decision: ReleaseDecision) -> None:
        """Drop a prepared release; the group stays ``activeBefore``."""
        ...
