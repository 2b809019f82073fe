"""One verl 0.9.1 rank on a CPU: verl's real worker and driver classes, a small torch engine.

What the real-node e2e's trainer pod (``rlenergy_dev.podtrainer``) and the verl tests
(``tests/verl``) run instead of a GPU job: ``verl.workers.engine_workers.ActorRolloutRefWorker``
and ``verl.trainer.ppo.ray_trainer.RayPPOTrainer`` built without Ray or a process group
(``object.__new__`` and the attributes their methods read), so that calling their real methods
(``update_weights``, ``compute_log_prob``, ``RayPPOTrainer._update_actor`` ->
``update_actor``) runs verl's own code, and with it the methods ``rlenergy.sdk.verl_hook.
install`` wrapped. PPO's critic is verl's real ``TrainingWorker`` (:func:`make_critic`, reached
from the driver's real ``RayPPOTrainer._compute_values`` / ``_update_critic``). The only fakes
are the GPU parts: the FSDP engines (:class:`CpuEngine`, a two-layer CPU torch model trained on
the no-padding batch verl hands over; :class:`CpuValueEngine`, the critic's), the rollout's
server adapter (:class:`KeepRollout`), the CUDA device calls of the weight sync and of the
worker's memory log (:data:`CPU_DEVICE`) and vLLM itself
(``rlenergy_dev.vllmserver.VllmServer``, re-exported here).

Imports torch and verl at module import: only processes that have them (``.venv-verl``, the
trainer pod with that venv mounted) import this module. Callers: ``podtrainer``, tests/verl.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
from verl.utils.profiler import DistProfiler
from verl.workers import engine_workers
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from rlenergy_dev import podtrainer
from rlenergy_dev.vllmserver import VllmServer

GROUP = podtrainer.GROUP
"""rollout.n of the rank's batches: samples per prompt group."""

Pace = Callable[[str, int], None]
"""``pace(call, tokens)``: called before each forward chunk of the engine with the call
(``infer`` or ``train``) and the tokens forwarded so far including this chunk; it returns
when the (simulated) GPU work reached that point."""


class CpuEngine:
    """The GPU engine behind ``ActorRolloutRefWorker.actor``, on a CPU.

    verl's ``TrainingWorker`` / ``FSDPEngine`` replaced by a small CPU torch model trained on
    the no-padding batch verl hands over (``loss_mask`` = response mask), its module where
    verl's engine holds it (``actor.engine.module``, what the hook's forward counter finds).

    Args:
        chunk_tokens: forward the batch in chunks of this many tokens (0: in one pass), with
            ``pace`` before each.
        pace: see :data:`Pace` (``None``: no waiting).

    Attributes:
        trained_tokens: response tokens (``loss_mask``) of the update passes so far.
        forwarded: tokens of every forward pass so far.
        calls: ``infer`` / ``train`` per engine call.
    """

    is_param_offload_enabled = False

    def __init__(self, *, chunk_tokens: int = 0, pace: Pace | None = None) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
        self.module = self.model
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.chunk_tokens = chunk_tokens
        self.pace = pace
        self.trained_tokens = 0
        self.forwarded = 0
        self.calls: list[str] = []

    @property
    def engine(self) -> CpuEngine:
        """The ``TrainingWorker.engine`` of verl: this object."""
        return self

    @staticmethod
    def tokens(data: Any) -> torch.Tensor:
        """The token ids of a batch verl hands the engine (nested: its packed values)."""
        ids = data["input_ids"]
        return ids.values() if ids.is_nested else ids.flatten()

    def _chunks(self, call: str, tokens: torch.Tensor) -> list[torch.Tensor]:
        size = self.chunk_tokens or int(tokens.numel())
        out = []
        for start in range(0, int(tokens.numel()), max(size, 2)):
            chunk = tokens[start : start + max(size, 2)]
            if self.pace is not None:
                self.pace(call, self.forwarded + int(chunk.numel()))
            self.forwarded += int(chunk.numel())
            out.append(chunk)
        return out

    def infer_batch(self, data: Any) -> Any:
        """Log-prob pass: a forward pass per chunk, no gradient."""
        self.calls.append("infer")
        tokens = self.tokens(data)
        with torch.no_grad():
            for chunk in self._chunks("infer", tokens) if tokens.numel() else []:
                self.model(chunk)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def get_per_tensor_param(self, **kw: Any) -> tuple[Any, None]:
        """(name, tensor) of every parameter, as the weight sync reads them."""
        return ((n, p.detach()) for n, p in self.model.named_parameters()), None

    def train_mini_batch(self, data: Any) -> Any:
        """Update pass: next-token loss per chunk, one SGD step each."""
        self.calls.append("train")
        loss = torch.zeros(())
        for chunk in self._chunks("train", self.tokens(data)):
            if chunk.numel() < 2:
                continue
            logits = self.model(chunk)
            loss = torch.nn.functional.cross_entropy(logits[:-1], chunk[1:])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.trained_tokens += int(data["loss_mask"].sum().item())
        metrics = {"mfu": 0.0, "pg_loss": float(loss.item())}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})


class CpuValueEngine:
    """The GPU engine behind PPO's critic ``TrainingWorker``, on a CPU.

    Stands where verl's ``FSDPEngine`` of a ``value_model`` stands (``TrainingWorker.engine``)
    and answers the calls verl's real ``TrainingWorker.infer_batch`` / ``train_mini_batch`` /
    ``train_batch`` make on it: a small CPU torch model with one value per token
    (``module``, where the hook's forward counter finds the critic's module), forwarded over
    the no-padding batch in chunks with ``pace`` before each (:data:`Pace`: ``infer`` /
    ``train``), its values nested like ``input_ids`` (what ``no_padding_2_padding`` slices).
    Also the engine of an actor's inner ``TrainingWorker`` (:func:`make_training_worker`).

    Args:
        chunk_tokens: forward the batch in chunks of this many tokens (0: in one pass).
        pace: see :data:`Pace` (``None``: no waiting).

    Attributes:
        forwarded: tokens of every forward pass so far.
        calls: ``infer`` / ``train`` per engine call.
    """

    is_param_offload_enabled = False

    def __init__(self, *, chunk_tokens: int = 0, pace: Pace | None = None) -> None:
        torch.manual_seed(1)
        self.module = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.01)
        self.chunk_tokens = chunk_tokens
        self.pace = pace
        self.forwarded = 0
        self.calls: list[str] = []

    def _values(self, call: str, tokens: torch.Tensor) -> Iterator[torch.Tensor]:
        """The values of each chunk, forwarded when the caller asks for it."""
        size = max(self.chunk_tokens or int(tokens.numel()), 1)
        for start in range(0, int(tokens.numel()), size):
            chunk = tokens[start : start + size]
            if self.pace is not None:
                self.pace(call, self.forwarded + int(chunk.numel()))
            self.forwarded += int(chunk.numel())
            yield self.module(chunk).squeeze(-1)

    def infer_batch(self, data: Any, loss_function: Any = None) -> dict[str, Any]:
        """Values pass (``compute_loss=False``): a forward pass per chunk, no gradient."""
        self.calls.append("infer")
        ids = data["input_ids"]
        with torch.no_grad():
            values = torch.cat(list(self._values("infer", ids.values())))
        nested = torch.nested.nested_tensor_from_jagged(values, ids.offsets())
        return {"model_output": {"values": nested}, "loss": [0.0], "metrics": {}}

    def train_batch(self, data: Any, loss_function: Any) -> dict[str, Any]:
        """Update pass of one mini-batch: values regressed to zero, one SGD step per chunk."""
        self.calls.append("train")
        losses = []
        for values in self._values("train", data["input_ids"].values()):
            loss = (values**2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            losses.append(float(loss.item()))
        return {"model_output": {}, "loss": losses, "metrics": {"grad_norm": 0.0}}

    def get_per_tensor_param(self, **kw: Any) -> tuple[Any, None]:
        """(name, tensor) of every parameter, as the weight sync reads them (as the actor's)."""
        return ((n, p.detach()) for n, p in self.module.named_parameters()), None

    @staticmethod
    def train_mode(**kw: Any) -> Any:
        """``BaseEngine.train_mode``: nothing to load on a CPU."""
        return contextlib.nullcontext()

    @staticmethod
    def eval_mode(**kw: Any) -> Any:
        """``BaseEngine.eval_mode``: nothing to load on a CPU."""
        return contextlib.nullcontext()

    @staticmethod
    def lr_scheduler_step() -> float:
        """The (constant) learning rate."""
        return 0.01

    @staticmethod
    def get_data_parallel_rank() -> int:
        """One rank."""
        return 0

    @staticmethod
    def get_data_parallel_size() -> int:
        """One rank."""
        return 1

    @staticmethod
    def get_data_parallel_group() -> None:
        """No group of its own (the default 1-process group)."""
        return None

    @staticmethod
    def is_mp_src_rank_with_outputs() -> bool:
        """This rank returns the outputs."""
        return True


class NoFlops:
    """``TrainingWorker.flops_counter`` without a GPU: MFU 0 (verl's driver pops the key)."""

    @staticmethod
    def estimate_flops(*args: Any, **kwargs: Any) -> tuple[float, float]:
        """(estimated, promised) FLOPs."""
        return 0.0, 1.0


def make_critic(engine: CpuValueEngine) -> TrainingWorker:
    """PPO's critic as verl 0.9.1 runs it: a ``TrainingWorker`` of a ``value_model``.

    What ``RayPPOTrainer.init_workers`` builds for ``Role.Critic`` (``main_ppo_v0``'s
    ``add_critic_worker``: ``ray.remote(TrainingWorker)``, ``TrainingWorkerConfig(model_type=
    "value_model", ...)``), without Ray or a process group, ``engine`` as its engine; verl's
    real ``infer_batch`` / ``train_mini_batch`` / ``train_batch`` run on it.
    """
    return make_training_worker(engine, "value_model")


def make_training_worker(engine: Any, model_type: str) -> TrainingWorker:
    """A verl ``TrainingWorker`` of ``model_type`` on ``engine``, without Ray or a GPU.

    ``value_model``: the critic (:func:`make_critic`); ``language_model``: what
    ``ActorRolloutRefWorker.init_model`` puts in ``.actor`` / ``.ref`` (their
    ``compute_log_prob`` / ``update_actor`` call its ``infer_batch`` / ``train_mini_batch``).
    """
    worker = object.__new__(TrainingWorker)
    worker.config = OmegaConf.create({"model_type": model_type})
    worker.model_config = OmegaConf.create({"use_remove_padding": True, "model_type": model_type})
    worker.engine_config = OmegaConf.create(
        {
            "use_dynamic_bsz": False,
            "max_token_len_per_gpu": 4096,
            "infer_max_token_len_per_gpu": 4096,
            "micro_batch_size_per_gpu": 2,
            "infer_micro_batch_size_per_gpu": 2,
            "use_fused_kernels": False,
            "forward_only": False,
        }
    )
    worker.engine = engine
    worker.device_name = "cpu"
    worker.flops_counter = NoFlops()
    worker.loss_fn = lambda *a, **k: None  # the engine computes its own loss
    worker.profiler = DistProfiler(rank=0)
    return worker


class Done:
    """A finished non-blocking worker-group call (``.get()``, as verl's futures)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        """The call's result."""
        return self.value


class CriticGroup:
    """The driver's ``critic_wg``, in process.

    Each call goes to verl's real (re-wrapped) ``TrainingWorker`` method on the critic.
    """

    def __init__(self, critic: TrainingWorker) -> None:
        self.critic = critic

    def infer_batch(self, data: Any) -> Done:
        """``TrainingWorker.infer_batch`` (``RayPPOTrainer._compute_values``)."""
        return Done(TrainingWorker.infer_batch(self.critic, data))

    def train_mini_batch(self, data: Any) -> Done:
        """``TrainingWorker.train_mini_batch`` (``RayPPOTrainer._update_critic``)."""
        return Done(TrainingWorker.train_mini_batch(self.critic, data))


class KeepRollout:
    """The worker's rollout adapter (verl's ``ServerAdapter``): wake-ups and weights, kept."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.resumed: list[str] = []

    async def resume(self, tags: list[str]) -> None:
        """Wake up (weights or KV cache, by tag)."""
        self.resumed += tags

    async def update_weights(self, params: Any, **kw: Any) -> None:
        """Receive the new weights (kept: the step they came with)."""
        assert sum(1 for _ in params) > 0
        self.sent.append(int(kw.get("global_steps") or 0))


class LocalGroup:
    """The driver's ``actor_rollout_wg``, in process.

    Each call goes to the worker's real (registered, re-wrapped) method with the TensorDict
    the driver built.
    """

    def __init__(self, worker: ActorRolloutRefWorker) -> None:
        self.worker = worker

    def update_actor(self, data: Any) -> Any:
        """``ActorRolloutRefWorker.update_actor`` on the worker."""
        return ActorRolloutRefWorker.update_actor(self.worker, data)


def make_worker(engine: CpuEngine) -> ActorRolloutRefWorker:
    """An ``ActorRolloutRefWorker`` with ``engine`` as actor and reference.

    Colocated vLLM rollout on the ``naive`` checkpoint backend; no process group, no GPU.
    """
    worker = object.__new__(ActorRolloutRefWorker)
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


def make_trainer(
    worker: ActorRolloutRefWorker, critic: TrainingWorker | None = None
) -> RayPPOTrainer:
    """The driver's state ``RayPPOTrainer._update_actor`` reads, its worker group in process.

    With ``critic`` (:func:`make_critic`), also what ``_compute_values`` / ``_update_critic``
    read (``critic_wg``: :class:`CriticGroup`).
    """
    trainer = object.__new__(RayPPOTrainer)  # no Ray cluster: the driver's state only
    trainer.config = OmegaConf.create(
        {
            "critic": {
                "ppo_mini_batch_size": 2,
                "ppo_epochs": 1,
                "data_loader_seed": 0,
                "shuffle": False,
            },
            "actor_rollout_ref": {
                "rollout": {"multi_turn": {"enable": False}, "temperature": 1.0, "n": GROUP},
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
    trainer.actor_rollout_wg = LocalGroup(worker)
    if critic is not None:
        trainer.critic_wg = CriticGroup(critic)
    return trainer


async def weights_done(worker: ActorRolloutRefWorker, global_steps: int) -> None:
    """The real ``update_weights`` of verl (re-registered by the hook), colocated ("naive").

    The engine's parameters go to the rollout adapter, which keeps them.
    """
    await ActorRolloutRefWorker.update_weights(worker, global_steps=global_steps, mode="naive")


class CpuDevice:
    """``get_torch_device()`` without a GPU: the CUDA calls of the weight sync are no-ops."""

    @staticmethod
    def empty_cache() -> None:
        """No cache to free."""
        return None

    @staticmethod
    def synchronize() -> None:
        """Nothing to wait for."""
        return None

    @staticmethod
    def max_memory_allocated() -> int:
        """No device memory (``TrainingWorker``'s memory metrics)."""
        return 0

    @staticmethod
    def max_memory_reserved() -> int:
        """No device memory (``TrainingWorker``'s memory metrics)."""
        return 0


CPU_DEVICE: dict[str, Any] = {
    "get_torch_device": lambda: CpuDevice,
    "set_expandable_segments": lambda enable: None,
    "log_gpu_memory_usage": lambda *a, **k: None,
}
"""``verl.workers.engine_workers`` attributes the colocated weight sync (and the
``TrainingWorker``'s memory metrics) call on the GPU, made CPU no-ops (set them on the module;
the sync's ``torch.distributed.barrier`` needs a process group too: :func:`use_cpu`)."""


def use_cpu() -> None:
    """Make this process's verl weight sync run on a CPU.

    :data:`CPU_DEVICE` on ``verl.workers.engine_workers`` and a 1-process gloo group (for a
    process of its own, the pod; tests set the same with ``monkeypatch``).
    """
    for name, value in CPU_DEVICE.items():
        setattr(engine_workers, name, value)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )


def batch_of(
    lengths: Sequence[int],
    prompts: Sequence[int],
    scores: Sequence[float],
    uids: Sequence[str],
) -> DataProto:
    """A rollout batch as ``RayPPOTrainer.fit`` holds it before the update.

    Args:
        lengths: response tokens per sample (0: an aborted sample).
        prompts: prompt tokens per sample (>= 1).
        scores: the sequence score of each sample (at its last response token).
        uids: prompt group of each sample.

    Returns:
        A ``DataProto`` with left-padded prompts, right-padded responses, masks, positions,
        scores/rewards and zero advantages/returns/old log-probs, ``uid`` as non-tensor data.
    """
    p_width, r_width = max(prompts), max(max(lengths), 1)
    bs = len(lengths)
    prompt_ids = torch.zeros(bs, p_width, dtype=torch.long)
    response_ids = torch.zeros(bs, r_width, dtype=torch.long)
    attention = torch.zeros(bs, p_width + r_width, dtype=torch.long)
    gen = torch.Generator().manual_seed(bs)
    for i, (n_p, n_r) in enumerate(zip(prompts, lengths, strict=True)):
        prompt_ids[i, p_width - n_p :] = torch.randint(1, 50, (n_p,), generator=gen)
        response_ids[i, :n_r] = torch.randint(1, 50, (n_r,), generator=gen)
        attention[i, p_width - n_p : p_width] = 1
        attention[i, p_width : p_width + n_r] = 1
    position = torch.clamp(torch.cumsum(attention, dim=-1) - 1, min=0)
    token_scores = torch.zeros(bs, r_width)
    for i, n_r in enumerate(lengths):
        token_scores[i, max(n_r - 1, 0)] = scores[i]
    return DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=-1),
            "attention_mask": attention,
            "position_ids": position,
            "response_mask": attention[:, p_width:].clone(),
            "token_level_scores": token_scores,
            "token_level_rewards": token_scores.clone(),
            "advantages": torch.zeros(bs, r_width),
            "returns": torch.zeros(bs, r_width),
            "old_log_probs": torch.zeros(bs, r_width),
        },
        non_tensors={"uid": np.array(list(uids), dtype=object)},
    )


def dapo_keep(batch: DataProto) -> list[int]:
    """DAPO dynamic sampling: the samples of the groups whose sequence scores differ.

    verl's DAPO recipe keeps a uid when the std of its samples' ``token_level_scores.sum(-1)``
    is > 0, or when the group has one sample.
    """
    seq = batch.batch["token_level_scores"].sum(-1).tolist()
    by_uid: dict[str, list[float]] = {}
    for uid, s in zip(batch.non_tensor_batch["uid"], seq, strict=True):
        by_uid.setdefault(uid, []).append(s)
    kept = {u for u, v in by_uid.items() if np.std(v) > 0 or len(v) == 1}
    return [i for i, u in enumerate(batch.non_tensor_batch["uid"]) if u in kept]


__all__ = [
    "CPU_DEVICE",
    "GROUP",
    "CpuDevice",
    "CpuEngine",
    "CpuValueEngine",
    "CriticGroup",
    "Done",
    "KeepRollout",
    "LocalGroup",
    "NoFlops",
    "Pace",
    "VllmServer",
    "batch_of",
    "dapo_keep",
    "make_critic",
    "make_training_worker",
    "make_trainer",
    "make_worker",
    "use_cpu",
    "weights_done",
]
