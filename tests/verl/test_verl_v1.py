"""The hook on verl 0.9.1's default trainer (``trainer.use_v1: true``), in its three modes.

verl's real v1 classes (``PPOTrainerSync``, ``PPOTrainerColocateAsync``,
``PPOTrainerSeparateAsync``), their real replay buffers with DAPO's ``filter_groups``, real
TransferQueue on a local Ray, verl's ``tqbridge`` and the hooked ``ActorRolloutRefWorker``
methods on a CPU engine (``v1_support``), and a real node agent on the stand-in NVML behind its
Unix-socket server. Each step's ``rlenergy/*`` keys must land in verl's metrics dict with the
valid tokens of the batch the replay buffer handed the step (DAPO's evicted groups never count),
and the agent must see each phase.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import v1_support as v1
from agent_support import DriverFactory, hooked_agent
from rlenergy_agent import service
from rlenergy_dev import verlrank
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker

from rlenergy.api import node as api_node
from rlenergy.sdk import verl_hook

POD = service.PodRef("rl", "verl-worker-0", "11111111-2222-3333-4444-555555555555")
PLAN = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=1755, state="locked"),
    ],
)


@pytest.fixture(scope="module")
def transfer_queue() -> Iterator[None]:
    v1.start_transfer_queue()
    yield
    v1.stop_transfer_queue()


async def _weights(worker: ActorRolloutRefWorker, step: int) -> None:
    """``checkpoint_manager.update_weights(global_steps)`` reaching the worker (``on_step_end``)."""
    await ActorRolloutRefWorker.update_weights(worker, global_steps=step)


@pytest.mark.parametrize("mode", list(v1.MODES))
def test_v1_steps_signal_phases_and_put_the_dapo_filtered_workload_into_verls_metrics(
    mode: str,
    transfer_queue: None,
    hooked: None,
    cpu_weight_sync: None,
    make_driver: DriverFactory,
    short_tmp: Path,
) -> None:
    colocated = mode != "separate_async"
    with hooked_agent(make_driver, short_tmp, PLAN, POD) as (drv, gpus, agent):
        engine = verlrank.CpuEngine()
        worker = v1.v1_worker(verlrank.make_worker(engine), mode)
        rollout = v1.Rollout()
        trainer = v1.v1_trainer(mode, worker, rollout)
        asyncio.run(_weights(worker, 0))  # on_init_end
        for step in (1, 2):
            hook = verl_hook.hook()
            assert (hook.phase, hook.step) == ("generation" if colocated else "idle", step)
            if colocated:
                assert all(drv.gpu(u).lock_max_mhz == 1395 for u in gpus)
                drv.set_work(gpus, "generation", f"gen-{step}")
                for _ in range(40):
                    drv.advance(0.1)
                    agent.meter.sample()
            trainer.global_steps = rollout.global_steps = step
            trainer.prepare_step()  # verl registers the step's prompts; the rollout writes them
            batch, sample_metrics = trainer.replay_buffer.sample(
                global_steps=step, partition_id=v1.PARTITION, batch_size=v1.PROMPTS_PER_STEP
            )
            assert sample_metrics["training/filter_groups/evicted_samples"] >= 1
            trained = v1.stored(batch)  # the samples this step trains on, as TransferQueue has them
            assert not {k.split("_")[0] for k in trained} & rollout.dropped_uids
            trainer.actor_rollout_wg.compute_log_prob(batch)  # _compute_old_log_prob's call
            assert hook.phase == "training"
            assert all(drv.gpu(u).lock_max_mhz == 1755 for u in gpus)
            drv.set_work(gpus, "training", f"train-{step}")
            for _ in range(30):
                drv.advance(0.1)
                agent.meter.sample()
            before = engine.trained_tokens
            metrics: dict[str, float] = {}
            trainer._update_actor(batch, metrics)  # verl's v1 method, hooked
            drv.set_work(gpus, "idle", "idle")
            valid = sum(int(m.sum()) for m in trained.values())
            assert metrics["rlenergy/valid_tokens"] == valid
            assert engine.trained_tokens - before == valid  # what the engine trained on
            assert metrics["rlenergy/trained_samples"] == len(trained)
            assert metrics["rlenergy/response_tokens"] == sum(
                rollout.written[k][1] for k in trained
            )
            assert metrics["rlenergy/prompt_tokens"] == sum(rollout.written[k][0] for k in trained)
            assert "actor/pg_loss" in metrics and not any(
                k.startswith("actor/rlenergy") for k in metrics
            )
            train_truth = sum(drv.truth_j(u, f"train-{step}") for u in gpus)
            assert metrics["rlenergy/energy/training_j"] == pytest.approx(train_truth, rel=0.02)
            if colocated:
                gen_truth = sum(drv.truth_j(u, f"gen-{step}") for u in gpus)
                assert metrics["rlenergy/energy/generation_j"] == pytest.approx(gen_truth, rel=0.02)
            assert metrics["rlenergy/energy_per_valid_token_j"] == pytest.approx(
                metrics["rlenergy/energy/step_j"] / valid
            )
            assert not any(drv.gpu(u).locked for u in gpus)  # the step ended: idle, default
            v1.tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)  # fit's cleanup
            asyncio.run(_weights(worker, step))  # on_step_end
        by_step = {r.step: r for r in agent.report().steps}
        assert {p.phase for p in by_step[1].phases} >= {"training"}
        if not colocated:
            assert worker.checkpoint_engine.sent == [0, 1, 2]


def _v1_shard(lengths: list[int]) -> TensorDict:
    """A worker's v1 shard as ``tqbridge`` reads it from TransferQueue, ``prompts`` missing."""
    import torch

    rows = [
        {
            "input_ids": torch.arange(1, n + 4),
            "loss_mask": torch.ones(n, dtype=torch.int64),
            "response_mask": torch.ones(n, dtype=torch.int64),
        }
        for n in lengths
    ]
    return tu.list_of_dict_to_tensordict(rows)


def test_a_v1_step_whose_batch_the_hook_cannot_count_completes_as_unhooked(
    hooked: None,
    make_driver: DriverFactory,
    short_tmp: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with hooked_agent(make_driver, short_tmp, PLAN, POD) as (drv, gpus, agent):
        verl_hook.hook().enter("generation", 1)
        hooked_engine, plain_engine = verlrank.CpuEngine(), verlrank.CpuEngine()
        with caplog.at_level(logging.WARNING, logger="rlenergy.sdk.verl_hook"):
            out = ActorRolloutRefWorker.update_actor(
                verlrank.make_worker(hooked_engine), _v1_shard([3, 5, 2])
            )
            again = ActorRolloutRefWorker.update_actor(
                verlrank.make_worker(hooked_engine), _v1_shard([4])
            )
        # verl's own method, undecorated by the hook: what the step does unhooked
        unhooked = ActorRolloutRefWorker.update_actor.__wrapped__.__wrapped__
        plain = unhooked.__wrapped__(verlrank.make_worker(plain_engine), _v1_shard([3, 5, 2]))
        metrics = tu.get(out, "metrics")
        assert metrics["pg_loss"] == tu.get(plain, "metrics")["pg_loss"]
        assert hooked_engine.trained_tokens == 10 + 4 and plain_engine.trained_tokens == 10
        assert metrics[verl_hook.UNKNOWN_KEY] == 1.0
        assert not any(
            k.startswith("rlenergy/energy") or k == "rlenergy/valid_tokens" for k in metrics
        )
        assert tu.get(again, "metrics")[verl_hook.UNKNOWN_KEY] == 1.0
        assert verl_hook.hook().phase == "idle"
        assert not any(drv.gpu(u).locked for u in gpus)  # the GPUs went back to the default
        warnings = [r for r in caplog.records if "count the step's workload" in r.getMessage()]
        assert len(warnings) == 1  # one line, not one per step
        assert "prompts" in warnings[0].getMessage()
