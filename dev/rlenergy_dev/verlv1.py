"""verl 0.9.1's default (v1) trainer in one process on a CPU: real classes, real TransferQueue.

The v1 trainer (``verl/trainer/ppo/v1``, what ``trainer.use_v1: true`` runs) keeps every
sample in TransferQueue (PyPI ``TransferQueue``, import ``transfer_queue``) and hands its
methods ``KVBatchMeta`` handles; verl's ``tqbridge`` turns them into the worker's
``TensorDict``. What runs for real: TransferQueue's controller and ``SimpleStorage`` units
(Ray actors) on a local Ray bound to loopback, the trainer's ``prepare_step`` (prompt
registration), its ``ReplayBuffer`` / ``ReplayBufferAsync`` with DAPO's ``filter_groups`` (and
its refill, ``PPOTrainer._add_prompts_to_generate``), its ``_update_actor``, verl's
``tqbridge`` and the ``ActorRolloutRefWorker`` methods ``rlenergy.sdk.verl_hook.install``
wraps. The fakes are the GPU parts, as in ``rlenergy_dev.verlrank``: the engine, and the
rollout, which writes each trajectory to TransferQueue the way verl's ``AgentLoopWorkerTQ``
does (:func:`put_group`) with lengths and rewards its caller scripts.

Callers: ``rlenergy_dev.podtrainer`` (the demo's ranks, the real-node e2e's trainer pod) and
tests/verl. Imports Ray, torch, verl and TransferQueue at module import: only processes that
have them (``.venv-verl``, the trainer pod with that venv mounted) import this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
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
"""verl 0.9.1's ``trainer.v1.trainer_mode`` values and their trainer classes (``sync``: the
default of ``trainer/config/ppo_trainer.yaml``)."""
PARTITION = "train"
"""The TransferQueue partition the v1 trainer trains from (fixed in ``PPOTrainer.step``)."""
OBJECT_STORE_BYTES = 80 * 2**20
"""Ray's object store, bytes: just over Ray's minimum (75 MiB, ``ray_constants.
OBJECT_STORE_MINIMUM_MEMORY_BYTES``). TransferQueue moves samples over ZMQ, not through it; and
Ray's default (30 % of the RAM) aborts the start in a container whose ``/dev/shm`` is smaller
once that default is over 10 GB (``ray/_private/services.py``: containerd gives a pod 64 MiB)."""


def start_transfer_queue(
    *, num_cpus: int = 8, storage_units: int = 2, start_lock: Path | None = None
) -> None:
    """A local Ray on loopback and TransferQueue's controller and storage units on it.

    Args:
        num_cpus: Ray's logical CPUs. The controller and each storage unit are Ray actors of
            one CPU each, so Ray gets more logical CPUs than a small machine's cores (the
            raylet also starts this many Python workers ahead of use: the fewest that hold the
            actors, ``storage_units + 1``, is the lightest).
        storage_units: ``SimpleStorage`` units (TransferQueue's default: 2; a process of its
            own that stores one step's few samples needs one).
        start_lock: a file the processes of one machine lock while they start their Ray, one
            at a time: Ray aborts a node whose raylet has not registered within a fixed 30 s
            (``ray/_private/node.py``), which three starting at once on two busy cores
            exceeded.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    with contextlib.ExitStack() as held:
        if start_lock is not None:
            lock = held.enter_context(start_lock.open("a"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=OBJECT_STORE_BYTES,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        )
        conf = {"backend": {"SimpleStorage": {"num_data_storage_units": storage_units}}}
        tq.init(OmegaConf.create(conf))


def stop_transfer_queue() -> None:
    """Tear down what :func:`start_transfer_queue` started."""
    tq.close()
    ray.shutdown()


def put_group(
    uid: str,
    samples: Sequence[tuple[int, int, float]],
    global_steps: int,
    *,
    generator: torch.Generator | None = None,
) -> dict[str, tuple[int, int]]:
    """Write one prompt's trajectories to TransferQueue as ``AgentLoopWorkerTQ`` does.

    Each sample goes under ``{uid}_{session}_0`` with the fields (``prompts``, ``responses``,
    ``response_mask``, ``loss_mask``, ``input_ids``, ``position_ids``, ``rm_scores``: the score
    at the last response token) and tags (``status``, lengths, ``global_steps``) verl's agent
    loop writes; then the prompt's own key gets the status ``finished``, which the replay buffer
    waits for.

    Args:
        uid: the prompt's uid (the trainer's, from ``PPOTrainer._fetch_one_gen_batch``).
        samples: (prompt tokens >= 1, response tokens >= 0, sequence score) per sample; a
            sample of 0 response tokens is an aborted one (verl's ``response/aborted_ratio``).
        global_steps: the step the trajectories were generated for.
        generator: token ids' random generator.

    Returns:
        trajectory key -> (prompt tokens, response tokens).
    """
    keys, fields, tags = [], [], []
    for session, (p_len, r_len, score) in enumerate(samples):
        prompt_ids = torch.randint(1, 50, (p_len,), generator=generator)
        response_ids = torch.randint(1, 50, (r_len,), generator=generator)
        scores = torch.zeros(r_len)
        if r_len:
            scores[-1] = score
        keys.append(f"{uid}_{session}_0")
        fields.append(
            {
                "prompts": prompt_ids,
                "responses": response_ids,
                "response_mask": torch.ones(r_len, dtype=torch.int64),
                "loss_mask": torch.ones(r_len, dtype=torch.int64),
                "input_ids": torch.cat([prompt_ids, response_ids]),
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
                "global_steps": global_steps,
                "min_global_steps": global_steps - 1,
                "max_global_steps": global_steps - 1,
            }
        )
    tq.kv_batch_put(
        keys=keys, fields=tu.list_of_dict_to_tensordict(fields), tags=tags, partition_id=PARTITION
    )
    tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "finished"})
    return {k: (s[0], s[1]) for k, s in zip(keys, samples, strict=True)}


def prompts() -> Iterator[dict[str, Any]]:
    """The dataloader: one prompt per batch (``gen_batch_size`` 1, as DAPO's refill asks)."""
    while True:
        yield {"raw_prompt": np.array([[{"role": "user", "content": "2+2?"}]], dtype=object)}


class V1Group:
    """The driver's ``actor_rollout_wg``, in process.

    Each call hands the ``KVBatchMeta`` to the worker's real (registered, hook-wrapped) method,
    where verl's ``tqbridge`` reads it.
    """

    def __init__(self, worker: ActorRolloutRefWorker) -> None:
        self.worker = worker

    def compute_log_prob(self, batch: Any) -> Any:
        """``ActorRolloutRefWorker.compute_log_prob`` (``_compute_old_log_prob``'s call)."""
        return ActorRolloutRefWorker.compute_log_prob(self.worker, batch)

    def update_actor(self, batch: Any) -> Any:
        """``ActorRolloutRefWorker.update_actor`` (``PPOTrainer._update_actor``'s call)."""
        return ActorRolloutRefWorker.update_actor(self.worker, batch)


def v1_worker(worker: ActorRolloutRefWorker) -> ActorRolloutRefWorker:
    """Make a ``verlrank.make_worker`` worker answer v1's calls.

    verl's ``tqbridge`` asks the worker whether its rank collects the actor mesh's outputs
    (``Worker.query_collect_info``): one rank, it does.
    """
    worker._Worker__dispatch_dp_rank = {}
    worker._Worker__collect_dp_rank = {}
    worker._register_dispatch_collect_info("actor", dp_rank=0, is_collect=True)
    return worker


def v1_trainer(
    mode: str,
    worker: ActorRolloutRefWorker,
    rollout: Any,
    *,
    group: int,
    prompts_per_step: int,
    mini_batch: int = 2,
) -> PPOTrainer:
    """The v1 trainer of ``mode`` with the driver state its step methods read.

    DAPO's ``filter_groups`` on the canonical reward (``rm_scores``), no off-policy bound; the
    replay buffer is the one verl builds for the mode (``PPOTrainer._build_replay_buffer``).
    Separate-async runs without hybrid replicas: the trainer's GPUs only train, the standalone
    rollout pool generates (verl's v0 fully-async semantics).

    Args:
        mode: a key of :data:`MODES`.
        worker: the :func:`v1_worker` the driver's ``actor_rollout_wg`` calls.
        rollout: the agent loop manager: ``generate_sequences(prompts)`` leaves each prompt's
            trajectories in TransferQueue (:func:`put_group`).
        group: ``rollout.n``, samples per prompt.
        prompts_per_step: ``data.train_batch_size``, prompt groups a step trains on.
        mini_batch: ``actor.ppo_mini_batch_size``, prompts per update mini-batch.
    """
    trainer = object.__new__(MODES[mode])
    trainer.config = OmegaConf.create(
        {
            "data": {"train_batch_size": prompts_per_step, "gen_batch_size": 1},
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
                "rollout": {"n": group, "temperature": 1.0},
                "actor": {
                    "calculate_entropy": False,
                    "entropy_coeff": 0.0,
                    "ppo_mini_batch_size": mini_batch,
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
    trainer.train_dataloader = prompts()
    trainer.train_dataloader_it = None
    trainer.agent_loop_manager = rollout
    trainer.actor_rollout_wg = V1Group(worker)
    trainer.replay_buffer = trainer._build_replay_buffer()
    if mode == "separate_async":
        trainer._enable_hybrid_replicas = False
        trainer.current_mode = HybridEngineMode.TRAINER
    trainer.replay_buffer.poll_interval = 0.05
    return trainer


def trained_lengths(batch: Any) -> dict[str, torch.Tensor]:
    """The ``response_mask`` of each sample of ``batch`` as TransferQueue holds it."""
    data = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"]
    )
    return dict(zip(batch.keys, data["response_mask"].unbind(), strict=True))


def clear(batch: Any) -> None:
    """Drop a trained batch's samples from TransferQueue (``PPOTrainer.fit``'s cleanup)."""
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


__all__ = [
    "MODES",
    "OBJECT_STORE_BYTES",
    "PARTITION",
    "V1Group",
    "clear",
    "prompts",
    "put_group",
    "start_transfer_queue",
    "stop_transfer_queue",
    "trained_lengths",
    "v1_trainer",
    "v1_worker",
]
