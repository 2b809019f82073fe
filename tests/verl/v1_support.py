"""verl 0.9.1's default (v1) trainer on a CPU, for tests/verl: real classes, real TransferQueue.

The v1 pieces the demo's ranks use too (``rlenergy_dev.verlv1``: TransferQueue on a local Ray,
the trainer with its ``ReplayBuffer`` / ``ReplayBufferAsync`` and DAPO's ``filter_groups``, the
driver's worker group, trajectories written as ``AgentLoopWorkerTQ`` writes them) in the three
``trainer.v1.trainer_mode`` values, with a rollout that scripts random lengths and rewards and,
for separate-async, the checkpoint engine's transport faked.
"""

from __future__ import annotations

import random
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import transfer_queue as tq
    from rlenergy_dev import verlv1
    from rlenergy_dev.verlv1 import (
        MODES,
        PARTITION,
        V1Group,
        start_transfer_queue,
        stop_transfer_queue,
    )
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.workers.engine_workers import ActorRolloutRefWorker

GROUP = 2
"""rollout.n: samples per prompt group."""
PROMPTS_PER_STEP = 3
"""train_batch_size: prompt groups a step trains on."""


@dataclass
class Rollout:
    """The agent loop's output, scripted: each prompt's samples, written to TransferQueue.

    ``AgentLoopManagerTQ.generate_sequences`` with vLLM faked: for every prompt of the batch the
    trainer submits, ``GROUP`` trajectories (``verlv1.put_group``). Every ``alike``-th
    prompt's samples score the same (DAPO's ``filter_groups`` evicts that group).

    Attributes:
        alike: every n-th submitted prompt gets equal rewards (0: none).
        written: trajectory key -> (prompt tokens, response tokens) of everything written.
        dropped_uids: the prompts whose samples all score alike.
    """

    alike: int = 3
    seed: int = 0
    global_steps: int = 1
    written: dict[str, tuple[int, int]] = field(default_factory=dict)
    dropped_uids: set[str] = field(default_factory=set)
    submitted: int = 0

    def generate_sequences(self, prompts: Any) -> None:
        """What ``AgentLoopManagerTQ.generate_sequences`` leaves in TransferQueue."""
        rng = random.Random(self.seed + self.submitted)
        for uid in list(prompts["uid"]):
            self.submitted += 1
            alike = self.alike > 0 and self.submitted % self.alike == 0
            if alike:
                self.dropped_uids.add(uid)
            samples = [
                (rng.randint(2, 6), rng.randint(1, 8), 1.0 if alike else float(session % 2))
                for session in range(GROUP)
            ]
            self.written.update(verlv1.put_group(uid, samples, self.global_steps))


class SentWeights:
    """The checkpoint engine's transport of separate-async (weights go to the rollout pool)."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    async def send_weights(self, params: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Take the weights (kept: the step they came with)."""
        assert sum(1 for _ in params) > 0
        self.sent.append(int(global_steps or 0))
        return {}


def v1_worker(worker: ActorRolloutRefWorker, mode: str) -> ActorRolloutRefWorker:
    """Make a ``verlrank.make_worker`` worker answer v1's calls in ``mode``
    (``verlv1.v1_worker``). Separate-async sends the weights through the checkpoint engine
    (:class:`SentWeights`) instead of the colocated ``naive`` sync."""
    verlv1.v1_worker(worker)
    if mode == "separate_async":
        worker.config.rollout.checkpoint_engine.backend = "nccl"
        worker.checkpoint_engine = SentWeights()
    return worker


def v1_trainer(mode: str, worker: ActorRolloutRefWorker, rollout: Rollout) -> PPOTrainer:
    """The v1 trainer of ``mode`` (``verlv1.v1_trainer``): ``GROUP`` samples per prompt,
    ``PROMPTS_PER_STEP`` prompts a step.

    Separate-async runs without hybrid replicas: lending the trainer's GPUs to generation
    between steps (``hybrid_rollout.enable_switch``) is not followed by the hook yet.
    """
    return verlv1.v1_trainer(mode, worker, rollout, group=GROUP, prompts_per_step=PROMPTS_PER_STEP)


stored = verlv1.trained_lengths
"""The ``response_mask`` of each sample of a batch as TransferQueue holds it."""


def new_uid() -> str:
    """A prompt uid as ``PPOTrainer._fetch_one_gen_batch`` makes them."""
    return str(uuid.uuid4())


__all__ = [
    "GROUP",
    "MODES",
    "PARTITION",
    "PROMPTS_PER_STEP",
    "Rollout",
    "SentWeights",
    "V1Group",
    "new_uid",
    "start_transfer_queue",
    "stop_transfer_queue",
    "stored",
    "tq",
    "v1_trainer",
    "v1_worker",
]
