"""The hook through verl 0.9.1's real classes: ``RayPPOTrainer._update_actor`` (driver) ->
``DataProto.to_tensordict`` + ``left_right_2_no_padding`` -> ``ActorRolloutRefWorker`` methods
re-registered with verl's ``register``/``tqbridge`` -> a small CPU torch model (the only fake:
the GPU engine) -> a real node agent on the stand-in NVML over its Unix socket.

The batch has groups DAPO's dynamic sampling drops (all samples of the group scored alike) and
aborted samples (no response token); valid tokens must be the masked response tokens of the
samples that reach ``update_actor``, exactly.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from agent_support import DriverFactory, hooked_agent
from rlenergy_agent import service
from rlenergy_dev import verlrank
from verl import DataProto
from verl.single_controller.base import decorator
from verl.trainer.ppo import metric_utils
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.padding import left_right_2_no_padding

from rlenergy.api import node as api_node
from rlenergy.sdk import verl_hook

POD = service.PodRef("rl", "verl-worker-0", "11111111-2222-3333-4444-555555555555")
PLAN = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=None, state="locked"),
    ],
)
N = verlrank.GROUP  # rollout.n: samples per prompt group
P, R = 6, 8  # prompt and response widths


def _batch(seed: int) -> tuple[DataProto, list[int], list[int]]:
    """A rollout batch as ``RayPPOTrainer.fit`` holds it before the update.

    Returns:
        (batch, response length per sample, prompt length per sample).
    """
    rng = random.Random(seed)
    groups = 6
    lengths, prompts, scores, uids = [], [], [], []
    for g in range(groups):
        alike = g in (1, 4)  # DAPO drops these: every sample of the group scores the same
        for k in range(N):
            lengths.append(rng.randint(1, R))
            prompts.append(rng.randint(2, P))
            scores.append(1.0 if alike else float((k + g) % 2))
            uids.append(f"uid-{g}")
    for aborted in (2, 13):  # in kept groups 0 and 3: zero-length, aborted samples
        lengths[aborted] = 0
    return verlrank.batch_of(lengths, prompts, scores, uids), lengths, prompts


def test_install_keeps_verls_dispatch_and_is_idempotent(hooked: None) -> None:
    for name in verl_hook.TRAINING_METHODS:
        fn = ActorRolloutRefWorker.__dict__[name]
        assert getattr(fn, "__rlenergy_patched__", False)
        attrs = getattr(fn, decorator.MAGIC_ATTR)
        assert attrs["dispatch_mode"] is not None and attrs["blocking"] is True
    weights = ActorRolloutRefWorker.__dict__[verl_hook.WEIGHTS_METHOD]
    assert getattr(weights, decorator.MAGIC_ATTR)["blocking"] is False
    before = {n: ActorRolloutRefWorker.__dict__[n] for n in verl_hook.TRAINING_METHODS}
    verl_hook.install()
    assert before == {n: ActorRolloutRefWorker.__dict__[n] for n in verl_hook.TRAINING_METHODS}


def test_trained_batch_counts_the_masked_response_tokens_of_kept_non_aborted_samples() -> None:
    batch, lengths, prompts = _batch(1)
    kept = verlrank.dapo_keep(batch)
    assert len(kept) == 4 * N  # groups 1 and 4 dropped
    trained = batch[kept]
    got = verl_hook.trained_batch(trained)
    assert got.valid_tokens == sum(lengths[i] for i in kept)
    assert got.aborted_samples == 2
    assert got.samples == len(kept) - 2
    assert got.prompt_tokens == sum(prompts[i] for i in kept)
    # verl's own metrics agree on the aborted samples and the lengths
    verl_metrics = metric_utils.compute_data_metrics(trained, use_critic=False)
    assert verl_metrics["response/aborted_ratio"] == pytest.approx(2 / len(kept))
    assert verl_metrics["response_length/mean"] == pytest.approx(got.valid_tokens / len(kept))
    assert "batch_size" not in verl_metrics  # what the old callback read


def test_steps_through_verls_update_path_signal_phases_and_return_energy_metrics(
    hooked: None, cpu_weight_sync: None, make_driver: DriverFactory, short_tmp: Path
) -> None:
    with hooked_agent(make_driver, short_tmp, PLAN, POD) as (drv, gpus, agent):
        engine = verlrank.CpuEngine()
        worker = verlrank.make_worker(engine)
        trainer = verlrank.make_trainer(worker)
        # verl's startup: update_weights(global_steps=0) wakes the rollout -> step 1 generates
        asyncio.run(verlrank.weights_done(worker, 0))
        assert worker.rollout.sent == [0]
        for step in (1, 2):
            assert verl_hook.hook().phase == "generation" and verl_hook.hook().step == step
            assert all(drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1395 for u in gpus)
            drv.set_work(gpus, "generation", f"gen-{step}")
            for _ in range(50):
                drv.advance(0.1)
                agent.meter.sample()
            batch, lengths, _ = _batch(step)
            kept = verlrank.dapo_keep(batch)
            batch = batch[kept]
            td = left_right_2_no_padding(batch.to_tensordict())
            ActorRolloutRefWorker.compute_log_prob(worker, td)  # training starts here
            assert verl_hook.hook().phase == "training"
            assert not any(drv.gpu(u).locked for u in gpus)  # training: default governor
            drv.set_work(gpus, "training", f"train-{step}")
            for _ in range(30):
                drv.advance(0.1)
                agent.meter.sample()
            before = engine.trained_tokens
            out = trainer._update_actor(batch)
            drv.set_work(gpus, "idle", "idle")
            metrics = out.meta_info["metrics"]
            valid = sum(lengths[i] for i in kept)
            assert metrics["rlenergy/valid_tokens"] == valid
            assert engine.trained_tokens - before == valid  # what the engine trained on
            assert metrics["rlenergy/trained_samples"] == len(kept) - sum(
                1 for i in kept if lengths[i] == 0
            )
            assert "actor/pg_loss" in metrics  # verl's own keys untouched
            gen_truth = sum(drv.truth_j(u, f"gen-{step}") for u in gpus)
            train_truth = sum(drv.truth_j(u, f"train-{step}") for u in gpus)
            assert metrics["rlenergy/energy/generation_j"] == pytest.approx(gen_truth, rel=0.02)
            assert metrics["rlenergy/energy/training_j"] == pytest.approx(train_truth, rel=0.02)
            assert metrics["rlenergy/energy_per_valid_token_j"] == pytest.approx(
                (metrics["rlenergy/energy/generation_j"] + metrics["rlenergy/energy/training_j"])
                / valid
            )
            asyncio.run(verlrank.weights_done(worker, step))
            assert worker.rollout.sent[-1] == step
        report = agent.report()
        by_step = {r.step: r for r in report.steps}
        assert (
            by_step[1].workload.valid_tokens
            == verl_hook.trained_batch(_batch(1)[0][verlrank.dapo_keep(_batch(1)[0])]).valid_tokens
        )
        assert {p.phase for p in by_step[2].phases} == {"generation", "training"}
