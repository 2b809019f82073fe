"""Phase names of an RL step, and verl's training sub-phases a policy may name on their own.

The default policy has two phases, ``generation`` and ``training``. verl times the training
side of a step in parts (``timing_s/old_log_prob``, ``timing_s/ref``, ``timing_s/values``,
``timing_s/update_critic``, ``timing_s/update_actor``; ``verl/trainer/ppo/ray_trainer.py``
``RayPPOTrainer.fit``) and runs each as its own worker call. Forward-only passes
(log-probabilities, values) and the update (forward, backward, optimizer) load the GPU
differently, so a policy may list any of them in ``spec.phases`` to get a clock of its own.
A sub-phase the policy does not name stays part of ``training``: the trainer signals the name
:func:`signal_name` gives.

Between two steps the colocated weight sync (``WEIGHT_SYNC``) may be a phase of its own the
same way.

Callers: ``rlenergy.sdk.verl_hook`` (which name to signal), ``rlenergy.sim.traces`` /
``rlenergy.sim.workload`` (sub-phase times of a trace), the operator's observe-mode prior.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Literal

GENERATION = "generation"
TRAINING = "training"
IDLE = "idle"
WEIGHT_SYNC = "weight-sync"
"""The colocated weight sync between two steps: verl's ``update_weights`` wakes the rollout's
weights, copies the trained weights into the engine and wakes its KV cache
(``verl/workers/engine_workers.py`` ``ActorRolloutRefWorker.update_weights``); generation
starts when it returns, the engine fully awake. A policy that lists it in ``spec.phases`` gets
it as a window (and clock) of its own; otherwise it stays part of ``idle`` (the default
governor), as the trainer signals it (:func:`weight_sync_signal`). A custom phase for the GPU
models (:func:`phase_kind` is ``None``): copying weights is neither decode nor training."""

SubPhaseKind = Literal["forward", "training"]
"""``forward``: forward passes only (log-probabilities, values); ``training``: the update."""


@dataclasses.dataclass(frozen=True)
class SubPhase:
    """One training sub-phase of a verl step.

    Attributes:
        name: the phase name a policy lists (a DNS label).
        timing_key: verl's ``timing_s/<key>`` (``timing/<key>`` in old logs).
        method: the method verl 0.9.1 calls for it: a
            ``verl.workers.engine_workers.ActorRolloutRefWorker`` method for the actor's
            sub-phases; for the critic's, the driver's ``RayPPOTrainer._compute_values`` /
            ``_update_critic`` without the underscore (they call the critic
            ``TrainingWorker``'s ``infer_batch`` / ``train_mini_batch``, which
            ``rlenergy.sdk.verl_hook.CRITIC_METHODS`` maps to these names).
        kind: how it loads the GPU (``SubPhaseKind``).
    """

    name: str
    timing_key: str
    method: str
    kind: SubPhaseKind


TRAINING_SUBPHASES: tuple[SubPhase, ...] = (
    SubPhase("old-log-prob", "old_log_prob", "compute_log_prob", "forward"),
    SubPhase("ref", "ref", "compute_ref_log_prob", "forward"),
    SubPhase("values", "values", "compute_values", "forward"),
    SubPhase("update-critic", "update_critic", "update_critic", "training"),
    SubPhase("update-actor", "update_actor", "update_actor", "training"),
)
"""verl's training sub-phases in the order a step runs them (``RayPPOTrainer.fit``)."""

SUBPHASE_BY_NAME: Mapping[str, SubPhase] = {s.name: s for s in TRAINING_SUBPHASES}
SUBPHASE_BY_METHOD: Mapping[str, SubPhase] = {s.method: s for s in TRAINING_SUBPHASES}
SUBPHASE_BY_TIMING_KEY: Mapping[str, SubPhase] = {s.timing_key: s for s in TRAINING_SUBPHASES}


def signal_name(subphase: str, policy_phases: Collection[str]) -> str:
    """The phase a trainer signals for training sub-phase ``subphase``.

    Args:
        subphase: a ``TRAINING_SUBPHASES`` name.
        policy_phases: the phase names of the policy's plan (empty: unknown yet).

    Returns:
        ``subphase`` where the policy names it, else ``training``.

    Raises:
        ValueError: ``subphase`` is not a training sub-phase.
    """
    if subphase not in SUBPHASE_BY_NAME:
        known = ", ".join(SUBPHASE_BY_NAME)
        raise ValueError(f"{subphase!r} is not a training sub-phase; known: {known}")
    return subphase if subphase in policy_phases else TRAINING


def weight_sync_signal(policy_phases: Collection[str]) -> str | None:
    """The phase a trainer signals for the weight sync (``WEIGHT_SYNC``).

    Args:
        policy_phases: the phase names of the policy's plan (empty: unknown yet).

    Returns:
        ``weight-sync`` where the policy names it, else ``None``: no signal, the GPUs stay in
        the phase they are in (``idle`` after a step ends).
    """
    return WEIGHT_SYNC if WEIGHT_SYNC in policy_phases else None


def phase_kind(name: str) -> Literal["generation", "forward", "training"] | None:
    """How a named phase loads the GPU: ``generation``, ``training``, a sub-phase's kind.

    Returns None for a custom phase name (no GPU model for it).
    """
    if name == GENERATION:
        return "generation"
    if name == TRAINING:
        return "training"
    sub = SUBPHASE_BY_NAME.get(name)
    return sub.kind if sub is not None else None
