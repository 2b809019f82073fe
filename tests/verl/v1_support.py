"""verl 0.9.1's default (v1) trainer on a CPU, for tests/verl: real classes, real TransferQueue.

The v1 trainer (``verl/trainer/ppo/v1``) keeps every sample in TransferQueue (PyPI
``TransferQueue``, import ``transfer_queue``) and hands its methods ``KVBatchMeta`` handles;
verl's ``tqbridge`` turns them into the worker's ``TensorDict``. What runs for real here:
TransferQueue's controller and storage on a local Ray (loopback), the trainer's
``prepare_step`` (prompt registration), its ``ReplayBuffer`` / ``ReplayBufferAsync`` (with DAPO's
``filter_groups``), its ``_update_actor``, verl's ``tqbridge`` and the
``ActorRolloutRefWorker`` methods the hook wraps. The fakes are the GPU parts, as in
``rlenergy_dev.verlrank``: the engine (``CpuEngine``), the rollout (an agent loop that
writes each trajectory to TransferQueue the way ``AgentLoopWorkerTQ`` does, with scripted
lengths and rewards) and, for separate-async, the checkpoint engine's transport.
"""

from __future__ import annotations

import os
import random
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import numpy as np
    import ray
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import (
        HybridEngineMode,
        PPOTrainerSeparateAsync,
    )
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker

MODES: dict[str, type[PPOTrainer]] = {
    "sync": PPOTrainerSync,
    "colocate_async": PPOTrainerColocateAsync,
    "separate_async": PPOTrainerSeparateAsync,
}
"""verl 0.9.1's ``trainer.v1.trainer_mode`` values and their trainer classes."""
PARTITION = "train"
GROUP = 2
"""rollout.n: samples per prompt group."""
PROMPTS_PER_STEP = 3
"""train_batch_size: prompt groups a step trains on."""


def start_transfer_queue() -> None:
    """A local Ray on loopback and TransferQueue's controller and storage units on it.

    TransferQueue's controller and its two storage units are Ray actors of one CPU each, so
    Ray gets more logical CPUs than the machine's two cores.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    tq.init()


def stop_transfer_queue() -> None:
    """Tear down what :func:`start_transfer_queue` started."""
    tq.close()
    ray.shutdown()


@dataclass
class Rollout:
    """The agent loop's output, scripted: each prompt's samples, written to TransferQueue.

    ``AgentLoopManagerTQ.generate_sequences`` with vLLM faked: for every prompt of the batch the
    trainer submits, ``GROUP`` trajectories under ``{uid}_{session}_0`` with the fields and tags
    ``AgentLoopWorkerTQ`` writes, then the prompt's status ``finished``. Every ``alike``-th
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
            keys, fields, tags = [], [], []
            for session in range(GROUP):
                p_len, r_len = rng.randint(2, 6), rng.randint(1, 8)
                key = f"{uid}_{session}_0"
                self.written[key] = (p_len, r_len)
                prompt_ids = torch.randint(1, 50, (p_len,))
                response_ids = torch.randint(1, 50, (r_len,))
                scores = torch.zeros(r_len)
                scores[-1] = 1.0 if alike else float(session % 2)
                input_ids = torch.cat([prompt_ids, response_ids])
                keys.append(key)
                fields.append(
                    {
                        "prompts": prompt_ids,
                        "responses": response_ids,
                        "response_mask": torch.ones(r_len, dtype=torch.int64),
                        "loss_mask": torch.ones(r_len, dtype=torch.int64),
                        "input_ids": input_ids,
                        "position_ids": torch.arange(p_len + r_len),
                        "rm_scores": scores,
                    }
                )
                tags.append(
                    {
                        "status": "success",
                        "prompt_len": p_len,
                        "response_len": r_len,
                        "seq_len": p_len + r_len,
                        "global_steps": self.global_steps,
                        "min_global_steps": self.global_steps - 1,
                        "max_global_steps": self.global_steps - 1,
                    }
                )
            tq.kv_batch_put(
                keys=keys,
                fields=tu.list_of_dict_to_tensordict(fields),
                tags=tags,
                partition_id=PARTITION,
            )
            tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "finished"})


def _prompts() -> Iterator[dict[str, Any]]:
    """The dataloader: one prompt per batch (``gen_batch_size`` 1, as DAPO's refill asks)."""
    while True:
        yield {"raw_prompt": np.array([[{"role": "user", "content": "2+2?"}]], dtype=object)}


class V1Group:
    """The driver's ``actor_rollout_wg``, in process: each call hands the ``KVBatchMeta`` to the
    worker's real (registered, hook-wrapped) method, where verl's ``tqbridge`` reads it."""

    def __init__(self, worker: ActorRolloutRefWorker) -> None:
        self.worker = worker

    def compute_log_prob(self, batch: Any) -> Any:
        """``ActorRolloutRefWorker.compute_log_prob`` (``_compute_old_log_prob``'s call)."""
        return ActorRolloutRefWorker.compute_log_prob(self.worker, batch)

    def update_actor(self, batch: Any) -> Any:
        """``ActorRolloutRefWorker.update_actor`` (``PPOTrainer._update_actor``'s call)."""
        return ActorRolloutRefWorker.update_actor(self.worker, batch)


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
    """Make a ``verlrank.make_worker`` worker answer v1's calls in ``mode``.

    verl's ``tqbridge`` asks the worker whether its rank collects the actor mesh's outputs
    (``Worker.query_collect_info``): one rank, it does. Separate-async sends the weights
    through the checkpoint engine (:class:`SentWeights`) instead of the colocated ``naive`` sync.
    """
    worker._Worker__dispatch_dp_rank = {}  # type: ignore[attr-defined]
    worker._Worker__collect_dp_rank = {}  # type: ignore[attr-defined]
    worker._register_dispatch_collect_info("actor", dp_rank=0, is_collect=True)
    if mode == "separate_async":
        worker.config.rollout.checkpoint_engine.backend = "nccl"
        worker.checkpoint_engine = SentWeights()
    return worker


def v1_trainer(mode: str, worker: ActorRolloutRefWorker, rollout: Rollout) -> PPOTrainer:
    """The v1 trainer of ``mode`` with the driver state its step methods read.

    Separate-async runs without hybrid replicas: lending the trainer's GPUs to generation
    between steps (``hybrid_rollout.enable_switch``) is not followed by the hook yet.

    DAPO's ``filter_groups`` on the canonical reward (``rm_scores``), no off-policy bound; the
    replay buffer is the one verl builds for the mode (``PPOTrainer._build_replay_buffer``).
    """
    trainer = object.__new__(MODES[mode])
    trainer.config = OmegaConf.create(
        {
            "data": {"train_batch_size": PROMPTS_PER_STEP, "gen_batch_size": 1},
            "algorithm": {
                "filter_groups": {"enable": True, "metric": "reward", "max_inflight_gen_batches": 1}
            },
            "reward": {"reward_model": {"enable": False, "enable_resource_pool": False}},
            "skip": {"rollout_tq": {"enable": False}},
            "trainer": {
                "v1": {
                    "trainer_mode": mode,
                    mode: {"parameter_sync_step": 1},
                    "sampler": {
                        "max_off_policy_threshold": None,
                        "max_off_policy_strategy": "drop",
                        "sampler_kwargs": {},
                    },
                }
            },
            "actor_rollout_ref": {
                "rollout": {"n": GROUP, "temperature": 1.0},
                "actor": {
                    "calculate_entropy": False,
                    "entropy_coeff": 0.0,
                    "ppo_mini_batch_size": 2,
                    "ppo_epochs": 1,
                    "data_loader_seed": 0,
                    "shuffle": False,
                },
            },
        }
    )
    trainer.trainer_mode = mode
    trainer.parameter_sync_step = 1
    trainer.global_steps = 1
    trainer.train_dataloader = _prompts()
    trainer.train_dataloader_it = None
    trainer.agent_loop_manager = rollout
    trainer.actor_rollout_wg = V1Group(worker)
    trainer.replay_buffer = trainer._build_replay_buffer()
    if mode == "separate_async":
        # No hybrid replicas (``actor_rollout_ref.hybrid_engine=False``): the trainer's GPUs
        # only train, the standalone rollout pool generates (verl's v0 fully-async semantics).
        trainer._enable_hybrid_replicas = False
        trainer.current_mode = HybridEngineMode.TRAINER
    trainer.replay_buffer.poll_interval = 0.05
    return trainer


def stored(batch: Any) -> dict[str, torch.Tensor]:
    """The ``response_mask`` of each sample of ``batch`` as TransferQueue holds it."""
    data = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"]
    )
    return dict(zip(batch.keys, data["response_mask"].unbind(), strict=True))


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
    "v1_trainer",
    "v1_worker",
]
