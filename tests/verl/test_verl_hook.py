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
from typing import Any

import numpy as np
import pytest
import torch
from agent_support import DriverFactory, FakeReviews, standin_agent
from omegaconf import OmegaConf
from rlenergy_agent import server, service
from verl import DataProto
from verl.single_controller.base import decorator
from verl.trainer.ppo import metric_utils
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
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
N = 4  # rollout.n: samples per prompt group
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
    bs = len(lengths)
    prompt_ids = torch.zeros(bs, P, dtype=torch.long)
    response_ids = torch.zeros(bs, R, dtype=torch.long)
    attention = torch.zeros(bs, P + R, dtype=torch.long)
    for i, (n_p, n_r) in enumerate(zip(prompts, lengths, strict=True)):
        prompt_ids[i, P - n_p :] = torch.randint(1, 50, (n_p,))
        response_ids[i, :n_r] = torch.randint(1, 50, (n_r,))
        attention[i, P - n_p : P] = 1
        attention[i, P : P + n_r] = 1
    position = torch.clamp(torch.cumsum(attention, dim=-1) - 1, min=0)
    token_scores = torch.zeros(bs, R)
    for i, n_r in enumerate(lengths):
        token_scores[i, max(n_r - 1, 0)] = scores[i]
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=-1),
            "attention_mask": attention,
            "position_ids": position,
            "response_mask": attention[:, P:].clone(),
            "token_level_scores": token_scores,
            "token_level_rewards": token_scores.clone(),
            "advantages": torch.zeros(bs, R),
            "returns": torch.zeros(bs, R),
            "old_log_probs": torch.zeros(bs, R),
        },
        non_tensors={"uid": np.array(uids, dtype=object)},
    )
    return batch, lengths, prompts


def _dapo_keep(batch: DataProto) -> list[int]:
    """DAPO dynamic sampling: keep the groups whose sequence scores differ (verl's DAPO recipe
    keeps a uid when the std of its samples' ``token_level_scores.sum(-1)`` is > 0)."""
    seq = batch.batch["token_level_scores"].sum(-1).tolist()
    by_uid: dict[str, list[float]] = {}
    for uid, s in zip(batch.non_tensor_batch["uid"], seq, strict=True):
        by_uid.setdefault(uid, []).append(s)
    kept = {u for u, v in by_uid.items() if np.std(v) > 0 or len(v) == 1}
    return [i for i, u in enumerate(batch.non_tensor_batch["uid"]) if u in kept]


class CpuEngine:
    """Stands in for the GPU engine behind ``ActorRolloutRefWorker.actor``: a small CPU torch
    model trained on the no-padding batch verl hands over (``loss_mask`` = response mask)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.trained_tokens = 0
        self.calls: list[str] = []

    def _tokens(self, data: Any) -> torch.Tensor:
        ids = data["input_ids"]
        return ids.values() if ids.is_nested else ids.flatten()

    def infer_batch(self, data: Any) -> Any:
        self.calls.append("infer")
        with torch.no_grad():
            self.model(self._tokens(data))
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"mfu": 0.0}})

    @property
    def engine(self) -> CpuEngine:
        return self

    is_param_offload_enabled = False

    def get_per_tensor_param(self, **kw: Any) -> tuple[Any, None]:
        return ((n, p.detach()) for n, p in self.model.named_parameters()), None

    def train_mini_batch(self, data: Any) -> Any:
        self.calls.append("train")
        tokens = self._tokens(data)
        logits = self.model(tokens[:-1])
        loss = torch.nn.functional.cross_entropy(logits, tokens[1:])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.trained_tokens += int(data["loss_mask"].sum().item())
        metrics = {"mfu": 0.0, "pg_loss": float(loss.item())}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})


class LocalGroup:
    """The driver's ``actor_rollout_wg``, in process: each call goes to the worker's real
    (registered, re-wrapped) method with the TensorDict the driver built."""

    def __init__(self, worker: ActorRolloutRefWorker) -> None:
        self.worker = worker

    def update_actor(self, data: Any) -> Any:
        return ActorRolloutRefWorker.update_actor(self.worker, data)


def _trainer(worker: ActorRolloutRefWorker) -> RayPPOTrainer:
    trainer = object.__new__(RayPPOTrainer)  # no Ray cluster: the driver's state only
    trainer.config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"multi_turn": {"enable": False}, "temperature": 1.0, "n": N},
                "actor": {
                    "calculate_entropy": False,
                    "entropy_coeff": 0.0,
                    "ppo_mini_batch_size": 2,
                    "ppo_epochs": 1,
                    "data_loader_seed": 0,
                    "shuffle": False,
                },
            }
        }
    )
    trainer.actor_rollout_wg = LocalGroup(worker)
    return trainer


def _worker(engine: CpuEngine) -> ActorRolloutRefWorker:
    worker = object.__new__(ActorRolloutRefWorker)  # no process group, no GPU
    worker.actor = engine
    worker.ref = engine
    worker.enable_routing_replay = False
    worker.rollout = KeepRollout()
    worker.config = OmegaConf.create(
        {
            "rollout": {
                "name": "vllm",
                "free_cache_engine": True,
                "checkpoint_engine": {"backend": "naive"},
            }
        }
    )
    worker.peft_merge = False
    worker.layered_summon = False
    worker.base_sync_done = False
    return worker


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
    kept = _dapo_keep(batch)
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
    drv = make_driver(2)
    gpus = list(drv.uuids)
    agent = standin_agent({POD: gpus}, PLAN, lambda: drv.virtual_s)
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        verl_hook._HOOK = verl_hook.VerlHook(reviews.client(sock, POD, short_tmp, strict=True))
        engine = CpuEngine()
        worker = _worker(engine)
        trainer = _trainer(worker)
        # verl's startup: update_weights(global_steps=0) wakes the rollout -> step 1 generates
        asyncio.run(_weights_done(worker, 0))
        assert worker.rollout.sent == [0]
        for step in (1, 2):
            assert verl_hook.hook().phase == "generation" and verl_hook.hook().step == step
            assert all(drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1395 for u in gpus)
            drv.set_work(gpus, "generation", f"gen-{step}")
            for _ in range(50):
                drv.advance(0.1)
                agent.meter.sample()
            batch, lengths, _ = _batch(step)
            kept = _dapo_keep(batch)
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
            asyncio.run(_weights_done(worker, step))
            assert worker.rollout.sent[-1] == step
        report = agent.report()
        by_step = {r.step: r for r in report.steps}
        assert (
            by_step[1].workload.valid_tokens
            == verl_hook.trained_batch(_batch(1)[0][_dapo_keep(_batch(1)[0])]).valid_tokens
        )
        assert {p.phase for p in by_step[2].phases} == {"generation", "training"}
    finally:
        srv.stop()


async def _weights_done(worker: ActorRolloutRefWorker, global_steps: int) -> None:
    """verl's real ``update_weights`` (re-registered by the hook) on its colocated ("naive")
    path: the engine's parameters go to the rollout adapter, which keeps them."""
    await ActorRolloutRefWorker.update_weights(worker, global_steps=global_steps, mode="naive")


class KeepRollout:
    """The worker's rollout adapter (``ServerAdapter``): wake-ups and weights, kept."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.resumed: list[str] = []

    async def resume(self, tags: list[str]) -> None:
        self.resumed += tags

    async def update_weights(self, params: Any, **kw: Any) -> None:
        assert sum(1 for _ in params) > 0
        self.sent.append(int(kw.get("global_steps") or 0))
