r"""verl integration inside verl's own processes: phases, valid tokens, ``rlenergy/*`` metrics.

One setting turns it on for a verl job (verl 0.9.1's ``verl/trainer/main_ppo.py`` merges
``ray_kwargs.ray_init.runtime_env`` into ``ray.init``, and Ray runs a runtime env's
``worker_process_setup_hook`` in every worker process of the job before it runs a task)::

    python3 -m verl.trainer.main_ppo ... \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rlenergy.sdk.verl_hook.install

:func:`install` wraps, without forking verl, the real methods where the work happens
(``docs/verl.md`` says what runs where):

* in the GPU workers, ``verl.workers.engine_workers.ActorRolloutRefWorker``:
  ``update_weights`` (colocated sync mode, checkpoint backend ``naive``: it wakes the rollout's
  weights, syncs them and wakes the KV cache, so the next step's **generation** starts when it
  returns, the engine fully awake; the call itself is **weight-sync** where the plan lists it
  (``rlenergy.api.phases.WEIGHT_SYNC``), else the GPUs stay ``idle``; its ``global_steps``
  argument names the step just trained; other backends send the weights to rollout GPUs
  elsewhere and these GPUs go ``idle``), ``compute_log_prob`` /
  ``compute_ref_log_prob`` / ``update_actor`` (**training**: the first of them ends
  generation; ``update_actor`` closes the step with its token workload and reads the step's
  energy back from the agent). Each of the three is a training sub-phase
  (``rlenergy.api.phases``: ``old-log-prob``, ``ref``, ``update-actor``) signalled under its own
  name when the agent's plan lists it (the policy's ``spec.phases``; the phase signal's answer
  says, ``RLEnergyClient.plan_phases``), else as ``training`` (also before the agent's first
  answer); consecutive calls under one name are one window; verl's LoRA reference pass
  (``compute_log_prob`` with ``no_lora_adapter``) is ``ref``. The wrappers sit below verl's
  ``register``/``tqbridge`` decorators (re-registered with verl's own ``register``), so they
  see the real ``TensorDict`` the engine trains on. Only ``LOCAL_RANK`` 0 of a pod signals
  (one caller per pod; the agent acts on every GPU of the calling pod);
* in the same GPU workers, PPO's critic: verl 0.9.1 runs it as a plain
  ``verl.workers.engine_workers.TrainingWorker`` of a ``value_model`` (``main_ppo_v0``'s
  ``add_critic_worker``; ``RayPPOTrainer.init_workers`` colocates it with the actor in one
  process per GPU), and the driver's ``RayPPOTrainer._compute_values`` / ``_update_critic`` call
  its ``infer_batch`` / ``train_mini_batch`` (``CRITIC_METHODS``). Those two are wrapped the
  same way and enter the ``values`` / ``update-critic`` sub-phases when the plan lists them,
  else ``training``; only on the critic (``is_critic``: the actor's and reference's own inner
  ``TrainingWorker`` run the same methods inside the actor's calls, and stay theirs);
* in the driver (verl's ``TaskRunner`` is a Ray actor too), ``RayPPOTrainer._update_actor``:
  it counts the step's workload on the whole batch that reaches the update (after DAPO's
  dynamic sampling dropped its groups), hands it to the workers with the batch
  (``meta_info[WORKLOAD_KEY]``, which ``DataProto.to_tensordict`` carries as non-tensor data),
  and puts the ``rlenergy/*`` keys into verl's step metrics (console, W&B...).

Valid tokens are response tokens under ``response_mask`` of the samples reaching
``update_actor`` (:func:`trained_batch`); aborted samples (no response token, verl's
``response/aborted_ratio`` definition in ``verl/trainer/ppo/metric_utils.py``) count as not
trained. In-phase progress comes with the same setting (:meth:`VerlHook.add_default_sources`):
generation from the decoded-token counters of the pod's rollout servers (``vLLMHttpServer`` /
``SGLangHttpServer``, whose ``launch_server`` is wrapped to publish their ``/metrics``,
``rlenergy.sdk.pod_engines``), training from a forward hook on the actor's torch module; the
generated tokens are the generation source's total; the critic's module (``engine.module`` of
its ``TrainingWorker``) joins the training counter at the critic's first call. In verl's async
recipes the rollout pool's ``CheckpointEngineWorker.update_weights`` sets the pool's step
(``RolloutPoolPhases``).

A wrapped verl method that raises, and a published engine whose process ends during
generation, abort the phase: the GPUs go ``idle`` at once (:meth:`VerlHook.abort`; the rollout
pool's ``RolloutPoolPhases.abort``) and verl's error goes on unchanged.

Nothing here imports torch or verl at module import: the SDK stays slim. Callers: Ray (the
setup hook), ``tests/verl``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from rlenergy.api import phases
from rlenergy.sdk import pod_engines, progress, trainer

log = logging.getLogger(__name__)
_T = TypeVar("_T")

WORKER_CLASS = ("verl.workers.engine_workers", "ActorRolloutRefWorker")
TRAINER_CLASS = ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer")
"""verl's legacy driver (``trainer.use_v1=false``, ``main_ppo_v0``)."""
V1_TRAINER_CLASS = ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer")
"""verl 0.9.1's default driver (``trainer.use_v1: true``): the base of its sync,
colocate-async and separate-async trainers (``verl/trainer/ppo/v1``)."""
TRAINING_METHODS = ("compute_log_prob", "compute_ref_log_prob", "update_actor")
CRITIC_CLASS = ("verl.workers.engine_workers", "TrainingWorker")
"""PPO's critic in verl 0.9.1 (``Role.Critic``: ``ray.remote(TrainingWorker)``)."""
CRITIC_METHODS = {"infer_batch": "compute_values", "train_mini_batch": "update_critic"}
"""The critic worker's methods and the sub-phase method (``rlenergy.api.phases``) each runs:
``RayPPOTrainer._compute_values`` calls ``critic_wg.infer_batch``, ``_update_critic`` calls
``critic_wg.train_mini_batch`` (``verl/trainer/ppo/ray_trainer.py``)."""
CRITIC_MODEL_TYPE = "value_model"
"""``TrainingWorkerConfig.model_type`` of the critic (the actor's and reference's inner
``TrainingWorker``: ``language_model``)."""
WEIGHTS_METHOD = "update_weights"
CHECKPOINT_WORKER_CLASS = ("verl.checkpoint_engine.base", "CheckpointEngineWorker")
"""The rollout pool's weight receiver in verl's async recipes (non-``naive`` backends)."""
ENGINE_SERVERS = {
    ("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer"): "vllm",
    ("verl.workers.rollout.sglang_rollout.async_sglang_server", "SGLangHttpServer"): "sglang",
}
"""verl 0.9.1's rollout server actors and the engine each runs (patched when imported)."""
WORKLOAD_KEY = "rlenergy_workload"
"""``meta_info`` / non-tensor key carrying the step's :class:`TrainedBatch` to the workers."""
PREFIX = "rlenergy/"
UNKNOWN_KEY = f"{PREFIX}workload_unknown"
"""Metric set to 1 for a step whose batch the hook could not count (no token or energy keys)."""
_PATCHED = "__rlenergy_patched__"


@dataclasses.dataclass(frozen=True)
class TrainedBatch:
    """Token workload of the samples that reach the actor update.

    Attributes:
        samples: samples with at least one response token under ``response_mask``.
        aborted_samples: samples with none (aborted or zero-length).
        valid_tokens: response tokens under ``response_mask``: what the update trains on.
        response_tokens: response tokens under ``attention_mask`` (tool output included).
        prompt_tokens: prompt tokens under ``attention_mask``.
    """

    samples: int
    aborted_samples: int
    valid_tokens: float
    response_tokens: float
    prompt_tokens: float

    def metrics(self) -> dict[str, float]:
        """The ``rlenergy/*`` metric keys of the workload."""
        return {
            f"{PREFIX}valid_tokens": float(self.valid_tokens),
            f"{PREFIX}trained_samples": float(self.samples),
            f"{PREFIX}aborted_samples": float(self.aborted_samples),
            f"{PREFIX}response_tokens": float(self.response_tokens),
            f"{PREFIX}prompt_tokens": float(self.prompt_tokens),
        }


def trained_batch(batch: Any) -> TrainedBatch:
    """Count the workload of a verl batch, padded or unpadded.

    Args:
        batch: a ``verl.DataProto`` or a ``TensorDict`` in one of verl 0.9.1's two layouts:

            * padded (the legacy ``RayPPOTrainer``): ``response_mask`` (samples x response
              width) and ``attention_mask`` (samples x prompt + response width), as
              ``RayPPOTrainer.fit`` builds it and ``left_right_2_no_padding`` keeps it;
            * unpadded (the v1 trainer's TransferQueue fields, ``verl/trainer/ppo/v1``):
              ``response_mask``, ``responses`` and ``prompts`` with one row per sample, each
              as long as that sample's response or prompt: jagged nested tensors, or plain
              tensors when every row has the same length (verl's
              ``tensordict_utils.list_of_dict_to_tensordict`` stacks those).

    Raises:
        KeyError: ``response_mask`` is missing, or neither ``attention_mask`` nor ``prompts``
            and ``responses`` are there (the message names the keys present).
    """
    tensors = getattr(batch, "batch", batch)
    keys = set(tensors.keys())
    if "response_mask" not in keys:
        raise KeyError(f"no response_mask in the batch (keys: {sorted(keys)})")
    mask = tensors["response_mask"]
    nested = bool(getattr(mask, "is_nested", False))
    if "attention_mask" in keys and not nested:
        attention = tensors["attention_mask"]
        width = int(mask.shape[-1])
        response_tokens = float(attention[:, -width:].sum().item())
        prompt_tokens = float(attention[:, :-width].sum().item())
    elif {"prompts", "responses"} <= keys:
        response_tokens = _tokens(tensors["responses"])
        prompt_tokens = _tokens(tensors["prompts"])
    else:
        raise KeyError(
            f"neither attention_mask nor prompts and responses in the batch (keys: {sorted(keys)})"
        )
    per_sample = _row_sums(mask) if nested else mask.sum(-1).double()
    samples = int((per_sample > 0).sum().item())
    return TrainedBatch(
        samples=samples,
        aborted_samples=int(per_sample.numel()) - samples,
        valid_tokens=float(per_sample.sum().item()),
        response_tokens=response_tokens,
        prompt_tokens=prompt_tokens,
    )


def _tokens(rows: Any) -> float:
    """Elements of an unpadded field: a jagged tensor's packed values, or a plain tensor's."""
    if getattr(rows, "is_nested", False):
        offsets = rows.offsets()
        return float((offsets[-1] - offsets[0]).item())
    return float(rows.numel())


def _row_sums(mask: Any) -> Any:
    """Per-row sums of a jagged nested tensor, from one cumulative sum of its ``values()``.

    Rows are ``offsets()`` apart (verl's own lengths: ``PPOTrainer._compute_metrics`` reads
    ``offsets().diff()``, ``verl/trainer/ppo/v1/trainer_base.py``).
    """
    import torch  # noqa: PLC0415 - a nested batch means torch is there; the SDK stays slim

    values = mask.values().double()
    cum = torch.cat([values.new_zeros(1), values.cumsum(0)])
    offsets = mask.offsets()
    return cum[offsets[1:]] - cum[offsets[:-1]]


class ProgressSource(Protocol):
    """In-phase progress of one kind of phase (the seam for engine metrics and forward hooks).

    ``begin`` is called when the phase starts with the worker instance (e.g. to find the actor
    module for a torch forward hook) and ``report``, which takes the phase's cumulative work so
    far (decoded tokens in generation, trained tokens in training) and sends it to the agent;
    call it every few tens of ms from the source's own thread or hook. ``end`` is called when
    the phase ends and returns the phase's total (``None``: unknown). A source may also have
    ``watch(worker)``, called when another worker continues the open phase (verl's critic in a
    ``training`` window the actor opened).
    """

    def begin(self, worker: Any, report: Callable[[float], None]) -> None:
        """The phase started."""

    def end(self) -> float | None:
        """The phase ended: its total work (tokens), or ``None``."""


def _watch(source: ProgressSource, worker: Any) -> None:
    """Call a source's optional ``watch(worker)``: ``worker`` continues the open phase.

    E.g. verl's critic after the actor's passes, both ``training``: its work counts from now on.
    """
    watch = getattr(source, "watch", None)
    if worker is not None and callable(watch):
        watch(worker)


def progress_kind(phase: str) -> str | None:
    """The progress-source kind serving phase ``phase``.

    Returns:
        ``generation`` for generation; ``training`` for training and every training
        sub-phase (``rlenergy.api.phases.TRAINING_SUBPHASES``: forward passes and updates both
        count trained tokens); ``None`` for ``idle`` or a custom phase (no source).
    """
    kind = phases.phase_kind(phase)
    return phases.TRAINING if kind == "forward" else kind


class VerlHook:
    """Per-process state: the current phase and step, the agent client, progress sources.

    Args:
        client: the agent client (default: a new ``RLEnergyClient``; best effort).
        signals: whether this process signals the agent (default: ``LOCAL_RANK`` is 0).
    """

    def __init__(
        self, client: trainer.RLEnergyClient | None = None, *, signals: bool | None = None
    ) -> None:
        self.client = client or trainer.RLEnergyClient()
        self.signals = signals if signals is not None else os.environ.get("LOCAL_RANK", "0") == "0"
        self.phase = "idle"
        self.step = 0
        self.sources: dict[str, list[ProgressSource]] = {
            phases.GENERATION: [],
            phases.TRAINING: [],
        }
        """Progress sources by kind (:func:`progress_kind`): ``training`` serves every
        training sub-phase."""
        self.generated_tokens: float | None = None
        """Tokens the generation sources counted in the current step (``None``: no source)."""
        self.generation_source: str | None = None
        """Where the current step's generation progress was read (the sources' ``variant``:
        the engine metric naming matched, ``sdk``; ``None``: not read)."""
        self.reported = progress.ReportedTokens()
        """Decoded tokens the job's own code reports (:meth:`report_tokens`): the generation
        source's fallback when the engines' metrics are missing."""
        self.aborts: list[str] = []
        """Why each abort of this process happened (:meth:`abort`), oldest first."""
        self._lock = threading.Lock()

    def add_default_sources(self) -> None:
        """Plug the sources a verl job has by itself (what :func:`install` gives every worker).

        * generation: the decoded tokens of the pod's inference engines
          (``pod_engines.PodEngines``: the rollout servers' ``/metrics``, published by the
          wrapped ``launch_server``, in any naming of ``progress.VARIANTS``), else, where
          their counter is missing (``progress.MetricsUnavailable``), the tokens the job's own
          code reports (:meth:`report_tokens`; ``progress.WithFallback``); an engine whose
          process ends during generation aborts the phase (:meth:`abort`);
        * training: the tokens of the forward passes of the actor's (and reference's) torch
          module (``progress.TrainingTokens`` on ``worker.actor.engine.module``) and, from the
          critic's first window on, of the critic's (its ``TrainingWorker``'s
          ``engine.module``): each window counts what ran in it.

        A source that cannot be read sends nothing (logged once per phase): the agent then sees
        the window without progress and EE-RL uses whole-phase evidence, which the policy's
        ``status.phases[].probeEvidence`` says.
        """
        self.add_progress_source(
            "generation",
            progress.PhaseProgress(
                lambda worker: progress.WithFallback(pod_engines.PodEngines(), self.reported),
                on_lost=self.abort,
            ),
        )
        self.add_progress_source("training", progress.PhaseProgress(progress.TrainingTokens))

    def add_progress_source(self, phase: str, source: ProgressSource) -> None:
        """Plug in-phase progress for a kind of phase: ``generation`` or ``training``.

        A ``training`` source serves ``training`` and every training sub-phase the plan names
        (``begin``/``end`` once per sub-phase window).

        Raises:
            ValueError: another kind (a sub-phase name included: use ``training``).
        """
        if phase not in self.sources:
            raise ValueError(
                f"phase must be one of {sorted(self.sources)}, not {phase!r} "
                "(training sources serve every training sub-phase)"
            )
        self.sources[phase].append(source)

    def enter(self, phase: str, step: int, worker: Any = None) -> None:
        """Enter ``phase`` of ``step``; ends the current phase.

        Already in it: the window goes on, and a progress source with a ``watch(worker)``
        method counts ``worker``'s work too from now on (``progress.PhaseProgress.watch``).
        """
        with self._lock:
            if phase == self.phase and step == self.step:
                for src in self.sources.get(progress_kind(phase) or "", ()):
                    _watch(src, worker)
                return
            self._end_sources()
            self.phase, self.step = phase, step
            if phase == phases.GENERATION:
                self.generated_tokens = None
                self.generation_source = None
            if self.signals:
                self.client.phase(phase, step=step)
            for src in self.sources.get(progress_kind(phase) or "", ()):
                src.begin(worker, self._report)

    def training_phase(self, method: str) -> str:
        """The phase name verl's worker method ``method`` runs under now.

        Args:
            method: a training sub-phase's method (``rlenergy.api.phases.SubPhase.method``:
                ``TRAINING_METHODS``, ``compute_values`` and ``update_critic``, the latter two
                what the critic's ``CRITIC_METHODS`` run).

        Returns:
            Its sub-phase's name (``old-log-prob``, ``ref``, ``values``, ``update-critic``,
            ``update-actor``) when the
            agent's plan lists it (``RLEnergyClient.plan_phases``, the newest phase answer),
            else ``training`` (also before the agent's first answer, and in processes that
            do not signal).

        Raises:
            KeyError: ``method`` is no training sub-phase's method.
        """
        sub = phases.SUBPHASE_BY_METHOD[method]
        return phases.signal_name(sub.name, self.client.plan_phases)

    def enter_training(self, method: str, worker: Any = None) -> str:
        """Enter the phase of worker method ``method`` (:meth:`training_phase`) of the step.

        A method under the same name as the current phase continues its window (e.g.
        ``compute_log_prob`` then ``compute_ref_log_prob``, both ``training``; or the critic's
        ``compute_values`` after them); another name ends it and opens a new one.

        Returns:
            The phase entered.

        Raises:
            KeyError: ``method`` is no training sub-phase's method.
        """
        name = self.training_phase(method)
        self.enter(name, self.step, worker)
        return name

    def report_tokens(self, tokens: float) -> None:
        """``tokens`` more were decoded (the job's own count, e.g. from an agent loop).

        Used for generation's progress only while the engines' counter cannot be read.

        Raises:
            ValueError: a negative count.
        """
        self.reported.add(tokens)

    def enter_weight_sync(self, step: int, worker: Any = None) -> str | None:
        """Enter the weight sync before step ``step``'s generation, if the plan lists it.

        Returns:
            ``weight-sync`` when entered (``rlenergy.api.phases.weight_sync_signal``), else
            ``None``: nothing is signalled and the GPUs stay in their phase (``idle``).
        """
        name = phases.weight_sync_signal(self.client.plan_phases)
        if name is not None:
            self.enter(name, step, worker)
        return name

    def abort(self, reason: str) -> None:
        """A wrapped verl call or an inference engine failed: these GPUs go ``idle`` now.

        The ``idle`` signal reaches the agent at once (it returns the pod's GPUs to the default
        governor; the agent's phase leases are only the backstop for a signal that never
        comes). Safe from a progress source's own thread (:class:`progress.PhaseProgress`
        ``on_lost``): the window's sources are then left to close at the next transition.
        Already ``idle``: nothing is sent.
        """
        self.aborts.append(reason)
        log.warning("rlenergy verl hook: %s; the GPUs go idle (default governor)", reason)
        in_source = threading.current_thread().name == progress.REPORTER_THREAD
        if not in_source:
            self._lock.acquire()
        try:
            if self.phase == phases.IDLE:
                return
            if not in_source:
                self._end_sources()
            self.phase = phases.IDLE
            if self.signals:
                self.client.phase(phases.IDLE, step=self.step)
        finally:
            if not in_source:
                self._lock.release()

    def _report(self, total: float) -> None:
        if self.signals:
            self.client.progress_total(total)

    def _end_sources(self) -> None:
        sources = self.sources.get(progress_kind(self.phase) or "", ())
        totals = [src.end() for src in sources]
        known = [t for t in totals if t is not None]
        if self.phase == phases.GENERATION and known:
            self.generated_tokens = float(sum(known))
            variants = [getattr(src, "variant", None) for src in sources]
            self.generation_source = ",".join(v for v in variants if v) or None

    def end_step(self, workload: TrainedBatch | None) -> dict[str, float]:
        """Close the current step with ``workload``; returns its ``rlenergy/*`` metrics.

        The energy keys (``rlenergy/energy/<phase>_j`` per phase window name of the step, e.g.
        ``rlenergy/energy/update-actor_j`` when the plan names that sub-phase;
        ``rlenergy/energy/step_j``, ``rlenergy/energy_per_valid_token_j``) are the agent's
        measurement of the calling pod's GPUs, J, present when the agent answered.

        ``workload`` ``None`` (the batch could not be counted): the GPUs still go ``idle`` (the
        phase's clock is released), the agent gets no workload for the step, and the metrics
        say so (``rlenergy/workload_unknown`` 1) instead of carrying token or energy figures.
        """
        with self._lock:
            self._end_sources()
            step = self.step
            self.phase = "idle"
            out = workload.metrics() if workload is not None else {UNKNOWN_KEY: 1.0}
            if self.generated_tokens is not None:
                out[f"{PREFIX}generated_tokens"] = self.generated_tokens
            if not self.signals:
                return out
            self.client.phase("idle", step=step)
            if workload is None:
                return out
            answer = self.client.end_step(
                step,
                samples=workload.samples,
                response_tokens=workload.response_tokens,
                prompt_tokens=workload.prompt_tokens,
                valid_tokens=workload.valid_tokens,
                mean_context_tokens=(
                    (workload.response_tokens + workload.prompt_tokens) / workload.samples
                    if workload.samples
                    else 0.0
                ),
                generation_progress_source=self.generation_source,
            )
        energy = answer.get("phaseEnergyJoules") or {}
        total = 0.0
        for phase, joules in energy.items():
            if joules is not None:
                out[f"{PREFIX}energy/{phase}_j"] = float(joules)
                total += float(joules)
        if energy and all(j is not None for j in energy.values()):
            out[f"{PREFIX}energy/step_j"] = total
            if workload.valid_tokens > 0:
                out[f"{PREFIX}energy_per_valid_token_j"] = total / workload.valid_tokens
            if self.generated_tokens:
                out[f"{PREFIX}energy_per_generated_token_j"] = total / self.generated_tokens
        return out


_FAILED: set[str] = set()
"""Sites whose failure was logged in this process (each is logged once)."""


def safely(site: str, work: Callable[[], _T]) -> _T | None:
    """Run the hook's own ``work`` so that it can never break the verl method around it.

    Args:
        site: what ``work`` does, for the log line (e.g. ``count the step's workload``).
        work: the hook's part of a wrapped verl call (signals, counting, metrics).

    Returns:
        ``work()``'s result, or ``None`` when it raised: the error is logged once per site and
        process (a warning naming the site and the error), and verl's method goes on exactly
        as it would unhooked.
    """
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - the user's job must never fail for our sake
        if site not in _FAILED:
            _FAILED.add(site)
            log.warning(
                "rlenergy verl hook: could not %s (%s: %s); verl goes on unchanged, and this "
                "step's rlenergy figures are marked unknown (logged once)",
                site,
                type(exc).__name__,
                exc,
            )
        return None


_HOOK: VerlHook | None = None
_POOL: progress.RolloutPoolPhases | None = None


def hook() -> VerlHook:
    """This process's hook (made on first use, with the default progress sources)."""
    global _HOOK  # noqa: PLW0603 - one per process, as Ray's setup hook runs once per worker
    if _HOOK is None:
        _HOOK = VerlHook()
        _HOOK.add_default_sources()
    return _HOOK


def pool_phases() -> progress.RolloutPoolPhases:
    """This process's rollout-pool phase tracker (async verl; made on first use).

    It reads the pod's engines (``pod_engines.PodEngines``) and signals through this
    process's hook client.
    """
    global _POOL  # noqa: PLW0603 - one per process, like the hook
    if _POOL is None:
        _POOL = progress.RolloutPoolPhases(pod_engines.PodEngines(), hook().client)
    return _POOL


def _workload_of(data: Any) -> TrainedBatch:
    """The whole step's workload the driver attached, else this rank's shard's."""
    from verl.utils import tensordict_utils as tu  # noqa: PLC0415 - verl only in its image

    attached = tu.get(data, WORKLOAD_KEY)
    if isinstance(attached, dict):
        return TrainedBatch(**attached)
    return trained_batch(data)


def _add_metrics(output: Any, extra: dict[str, float]) -> None:
    """Merge ``extra`` into the ``metrics`` of a worker's output ``TensorDict`` (if it has one)."""
    from verl.utils import tensordict_utils as tu  # noqa: PLC0415 - verl only in its image

    metrics = tu.get(output, "metrics") if output is not None else None
    if isinstance(metrics, dict):
        tu.assign_non_tensor_data(output, "metrics", {**metrics, **extra})


REF_IN_ACTOR_FLAG = "no_lora_adapter"
"""Non-tensor key verl 0.9.1 sets on a ``compute_log_prob`` batch that is the reference pass
(``RayPPOTrainer._compute_ref_log_prob`` with ``ref_in_actor``: LoRA, the actor without its
adapter is the reference)."""


def _subphase_method(name: str, data: Any) -> str:
    """The worker method whose sub-phase a call of ``name`` on ``data`` runs.

    ``compute_log_prob`` on a batch with ``REF_IN_ACTOR_FLAG`` is verl's reference pass (it
    times it as ``ref``), so it runs under ``compute_ref_log_prob``'s sub-phase.
    """
    if name != "compute_log_prob":
        return name
    from verl.utils import tensordict_utils as tu  # noqa: PLC0415 - verl only in its image

    return "compute_ref_log_prob" if tu.get(data, REF_IN_ACTOR_FLAG, False) else name


def _aborting(site: str, error: BaseException) -> None:
    """Abort this process's phase: verl's own call at ``site`` raised ``error`` (guarded)."""
    h = _HOOK
    if h is not None:
        safely(
            "abort the phase",
            lambda: h.abort(f"verl's {site} raised {type(error).__name__}: {error}"),
        )


def _training(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        h = safely("start the hook", hook)
        if h is not None:
            safely(f"signal {name}", lambda: h.enter_training(_subphase_method(name, data), self))
        try:
            output = method(self, data, *args, **kwargs)
        except BaseException as exc:
            _aborting(name, exc)
            raise
        if name == "update_actor" and h is not None:
            workload = safely("count the step's workload", lambda: _workload_of(data))
            extra = safely("close the step", lambda: h.end_step(workload))
            if extra:
                safely("add rlenergy metrics", lambda: _add_metrics(output, extra))
        return output

    return wrapper


def is_critic(worker: Any) -> bool:
    """Whether ``worker`` (a ``TrainingWorker``) is PPO's critic (``CRITIC_MODEL_TYPE``).

    verl 0.9.1 builds the critic's ``TrainingWorkerConfig`` with ``model_type="value_model"``
    (``RayPPOTrainer.init_workers``); the actor's and reference's inner ``TrainingWorker``
    (``ActorRolloutRefWorker.actor`` / ``.ref``) and the SFT trainer's have ``language_model``.
    """
    return getattr(getattr(worker, "config", None), "model_type", None) == CRITIC_MODEL_TYPE


def _critic(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    sub_method = CRITIC_METHODS[name]

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The actor's own calls reach the same methods on its inner TrainingWorker (keyword
        # ``data=``), inside the wrapped ActorRolloutRefWorker methods: they are not the critic's.
        critic = safely("tell the critic", lambda: is_critic(self))
        if critic:
            safely(f"signal {name}", lambda: hook().enter_training(sub_method, self))
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            if critic:
                _aborting(f"critic {name}", exc)
            raise

    return wrapper


def _weights(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(
        self: Any, global_steps: int | None = None, mode: str = "auto", **kwargs: Any
    ) -> Any:
        step = (global_steps or 0) + 1
        # The sync wakes the rollout's weights, copies them and wakes its KV cache: a window
        # of its own where the plan lists it (else the GPUs stay idle until it returns).
        safely("signal the weight sync", lambda: hook().enter_weight_sync(step, self))
        try:
            result = await method(self, global_steps, mode, **kwargs)
        except BaseException as exc:
            _aborting(WEIGHTS_METHOD, exc)
            raise

        def enter() -> None:
            # verl resolves "auto" to the checkpoint engine's backend; "naive" is the colocated
            # sync mode, where the call ends with the rollout on these GPUs woken up: the
            # engine is fully awake, generation starts. Any other backend sends the weights to
            # rollout GPUs elsewhere: these GPUs wait (idle).
            colocated = (
                mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
            ) == "naive"
            hook().enter("generation" if colocated else "idle", step, self)

        safely("signal generation after update_weights", enter)
        return result

    return wrapper


def _pool_weights(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(self: Any, global_steps: int | None = None, **kwargs: Any) -> Any:
        try:
            result = await method(self, global_steps, **kwargs)
        except BaseException as exc:
            pool = _POOL
            why = f"verl's {WEIGHTS_METHOD} raised {type(exc).__name__}: {exc}"
            if pool is not None:
                safely("abort the rollout pool's window", lambda: pool.abort(why))
            raise

        def follow() -> None:
            # The rollout pool now holds the weights of step ``global_steps``: what it generates
            # next is step global_steps + 1, the step the trainer pool trains meanwhile (the
            # same numbering as the colocated ``update_weights``).
            if hook().signals:
                pool = pool_phases()
                pool.set_step((global_steps or 0) + 1)
                pool.start()

        safely("follow the rollout pool's step", follow)
        return result

    return wrapper


def _publishing(engine: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def launch_server(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await method(self, *args, **kwargs)
        port = getattr(self, "_server_port", None)
        if port is not None:  # headless (node_rank > 0) servers serve no HTTP
            safely(
                f"publish the {engine} server's /metrics",
                lambda: pod_engines.publish(
                    engine, pod_engines.metrics_url(str(self._server_address), int(port))
                ),
            )
        return result

    setattr(launch_server, _PATCHED, True)
    return launch_server


def patch_engine_server(cls: type, engine: str) -> None:
    """Wrap a rollout server's ``launch_server`` to publish its ``/metrics`` (idempotent).

    The class is verl's ``vLLMHttpServer`` or ``SGLangHttpServer`` (``ENGINE_SERVERS``);
    once ``launch_server`` returned, ``_server_address`` / ``_server_port`` are where its
    HTTP server listens (``verl/workers/rollout/utils.py`` ``run_uvicorn``).

    Raises:
        ValueError: an engine without a pinned token counter.
    """
    progress.engine_counter(engine)
    original = cls.__dict__["launch_server"]
    if not getattr(original, _PATCHED, False):
        cls.launch_server = _publishing(engine, original)  # type: ignore[attr-defined]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after ``name`` is first imported.

    No import of our own: the engine servers' modules import vLLM/SGLang, which only their
    processes should pay for.
    """

    def __init__(self, name: str, then: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            self.then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def after_import(name: str, then: Callable[[types.ModuleType], None]) -> None:
    """``then(module)`` now if ``name`` is imported, else right after its first import."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def _rewrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``cls.name`` (a verl ``@register`` method) by ``make(method)``, re-registered.

    verl's ``register`` wraps the method in ``tqbridge`` (which turns TransferQueue metadata
    into the real ``TensorDict``) and records the dispatch mode on the wrapper
    (``verl/single_controller/base/decorator.py``): the new function wraps the method below
    both and goes through verl's own ``register`` again with the same dispatch attributes.
    """
    from verl.single_controller.base import decorator  # noqa: PLC0415 - verl only in its image

    registered = cls.__dict__[name]
    if getattr(registered, _PATCHED, False):
        return
    attrs = getattr(registered, decorator.MAGIC_ATTR)
    below = registered.__wrapped__.__wrapped__  # register's inner -> tqbridge's inner -> method
    new = decorator.register(**attrs)(make(below))
    setattr(new, _PATCHED, True)
    setattr(cls, name, new)


def patch_worker(cls: type) -> None:
    """Wrap ``ActorRolloutRefWorker``'s generation and training methods (idempotent)."""
    for name in TRAINING_METHODS:
        _rewrap(cls, name, functools.partial(_training, name))
    _rewrap(cls, WEIGHTS_METHOD, _weights)


def patch_critic(cls: type) -> None:
    """Wrap ``TrainingWorker``'s ``infer_batch`` / ``train_mini_batch`` (idempotent).

    On PPO's critic (:func:`is_critic`) they enter ``values`` / ``update-critic`` (or
    ``training``); on any other ``TrainingWorker`` they run as before, signalling nothing.
    The step stays closed by ``update_actor``, which ``RayPPOTrainer.fit`` runs after
    ``_update_critic``.
    """
    for name in CRITIC_METHODS:
        _rewrap(cls, name, functools.partial(_critic, name))


def _lift_metrics(metrics: dict[str, Any], workload: TrainedBatch | None) -> None:
    """Put the workers' ``rlenergy/*`` keys and the step's workload into verl's step metrics.

    verl's drivers prefix every key of the actor's output with ``actor/`` (legacy
    ``RayPPOTrainer._update_actor`` via ``reduce_metrics``, v1 ``PPOTrainer._update_actor``
    via ``rename_dict``): the hook's own keys get their name back. A step whose workload the
    driver could not count says so (``UNKNOWN_KEY``) unless the workers counted it.
    """
    for key in [k for k in metrics if k.startswith("actor/" + PREFIX)]:
        metrics[key.removeprefix("actor/")] = metrics.pop(key)
    if workload is not None:
        for key, value in workload.metrics().items():
            metrics.setdefault(key, value)
        metrics.pop(UNKNOWN_KEY, None)


def patch_trainer(cls: type) -> None:
    """Wrap the legacy ``RayPPOTrainer._update_actor``: whole-batch workload in, ``rlenergy/*`` out.

    The hook's part never fails the call (:func:`safely`): an uncountable batch goes to the
    update without a workload and its step is marked unknown.
    """
    original = cls.__dict__["_update_actor"]
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def _update_actor(self: Any, batch: Any) -> Any:
        workload = safely("count the step's workload", lambda: trained_batch(batch))
        if workload is not None:
            batch.meta_info[WORKLOAD_KEY] = dataclasses.asdict(workload)
        try:
            actor_output = original(self, batch)
        finally:
            batch.meta_info.pop(WORKLOAD_KEY, None)
        safely(
            "add rlenergy metrics",
            lambda: _lift_metrics(actor_output.meta_info.setdefault("metrics", {}), workload),
        )
        return actor_output

    setattr(_update_actor, _PATCHED, True)
    cls._update_actor = _update_actor  # type: ignore[attr-defined]


V1_FIELDS = ("prompts", "responses", "response_mask")
"""The TransferQueue fields :func:`trained_batch` reads of a v1 batch (all nested)."""


def v1_workload(batch: Any) -> TrainedBatch:
    """The workload of the samples a v1 step trains on.

    Args:
        batch: the ``transfer_queue.KVBatchMeta`` that ``PPOTrainer._update_actor`` gets: the
            samples the replay buffer handed to this step (after DAPO's ``filter_groups``
            dropped its groups, ``verl/trainer/ppo/v1/replay_buffer.py``) plus the padding
            samples ``upsample_batch_to_divisible_size`` added (``tags[i]["is_padding"]``),
            which are not counted.

    Raises:
        KeyError: a field of ``V1_FIELDS`` is not in the TransferQueue.
    """
    import transfer_queue as tq  # noqa: PLC0415 - v1 verl only

    keys = [k for k, tag in zip(batch.keys, batch.tags, strict=True) if not tag.get("is_padding")]
    if not keys:
        return TrainedBatch(0, 0, 0.0, 0.0, 0.0)
    data = tq.kv_batch_get(
        keys=keys, partition_id=batch.partition_id, select_fields=list(V1_FIELDS)
    )
    return trained_batch(data)


def patch_v1_trainer(cls: type) -> None:
    """Wrap the v1 ``PPOTrainer._update_actor(batch, metrics)`` (verl's default trainer).

    Same contract as :func:`patch_trainer`: the whole step's workload (:func:`v1_workload`)
    rides to the workers in ``batch.extra_info`` (which verl's ``tqbridge`` turns into the
    ``TensorDict``'s non-tensor data), and the step's ``rlenergy/*`` keys land in verl's
    ``metrics`` dict under their own names. ``fit``'s sync, colocate-async and separate-async
    modes all train through this method (``verl/trainer/ppo/v1/trainer_base.py``).
    """
    original = cls.__dict__["_update_actor"]
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def _update_actor(self: Any, batch: Any, metrics: dict[str, Any]) -> Any:
        workload = safely("count the step's workload", lambda: v1_workload(batch))
        extra = getattr(batch, "extra_info", None)
        if workload is not None and isinstance(extra, dict):
            extra[WORKLOAD_KEY] = dataclasses.asdict(workload)
        try:
            out = original(self, batch, metrics)
        finally:
            if isinstance(extra, dict):
                extra.pop(WORKLOAD_KEY, None)
        safely("add rlenergy metrics", lambda: _lift_metrics(metrics, workload))
        return out

    setattr(_update_actor, _PATCHED, True)
    cls._update_actor = _update_actor  # type: ignore[attr-defined]


def patch_checkpoint_worker(cls: type) -> None:
    """Wrap ``CheckpointEngineWorker.update_weights``: the rollout pool's step (idempotent).

    In verl's async recipes (fully async, one-step-off: ``CheckpointEngineManager`` with a
    backend other than ``naive``) the rollout pool's workers receive each new policy there
    (``verl/checkpoint_engine/base.py``); after it the pod's ``RolloutPoolPhases`` signals
    generation of step ``global_steps + 1`` whenever the pod's engines hold requests.
    """
    _rewrap(cls, WEIGHTS_METHOD, _pool_weights)


def _patch(module: str, name: str, patch: Callable[[type], None]) -> str | None:
    """Apply ``patch`` to ``module.name``; returns why it could not be (``None``: patched)."""
    try:
        patch(getattr(importlib.import_module(module), name))
    except Exception as exc:  # noqa: BLE001 - a verl we do not govern runs unpatched
        return f"{module}.{name} ({type(exc).__name__}: {exc})"
    return None


def _patch_logged(module: str, name: str, patch: Callable[[type], None]) -> None:
    why = _patch(module, name, patch)
    if why is not None:
        log.warning("rlenergy verl hook: not patched: %s; it runs unhooked", why)


RAY_NESTED_INIT = (2, 55, 0)
"""The first Ray whose ``ray.init`` accepts a runtime env whose ``worker_process_setup_hook``
was already turned into Ray's reserved variable, as long as both name the same hook
(ray-project/ray PR 61473, in ``ray/_private/runtime_env/setup_hook.py``
``_check_setup_hook_consistency``). Older Rays abort such a nested ``ray.init`` (a KubeRay
RayJob's driver calling ``ray.init`` with the job's hook, vLLM's Ray executor in a child of a
hooked worker) with "The env var, __RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR, is not permitted"."""


def ray_version_problem(version: str) -> str | None:
    """One line on what to change when Ray ``version`` aborts nested ``ray.init`` calls.

    Returns:
        ``None`` for Ray ``RAY_NESTED_INIT`` or later (or a version that does not parse).
    """
    try:
        parts = tuple(int(p) for p in version.split(".")[:3])
    except ValueError:
        return None
    if parts >= RAY_NESTED_INIT:
        return None
    need = ".".join(map(str, RAY_NESTED_INIT))
    return (
        f"Ray {version} aborts a nested ray.init whose runtime env carries this hook (KubeRay "
        f"RayJobs, vLLM's Ray executor); upgrade to Ray >= {need}, or set the hook only once, "
        "at job level (docs/verl.md, 'Ray and KubeRay')"
    )


RESERVED_HOOK_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
"""The environment variable Ray reserves for the job's setup hook (``ray_constants
.WORKER_PROCESS_SETUP_HOOK_ENV_VAR``): ``ray.init`` (or the job supervisor) turns the runtime
env's ``worker_process_setup_hook`` into it, and each worker process runs what it names."""

HOOK_PATH = "rlenergy.sdk.verl_hook.install"
"""This hook as the module-path string a runtime env names (``docs/verl.md``)."""

_CALLABLE_KEY = "ray_runtime_env_func::"
"""How Ray's reserved variable names a hook given as a callable, not a module path
(``ray/_private/runtime_env/setup_hook.py``, ``RUNTIME_ENV_FUNC_IDENTIFIER``)."""


def setup_hook_conflict(reserved: str | None, declared: object) -> str | None:
    """One line on what to change when a job carries two different setup hooks.

    Args:
        reserved: the value of ``RESERVED_HOOK_VAR`` in this process (``None``: unset, as
            outside a Ray worker); a module path, or a callable's key.
        declared: the ``worker_process_setup_hook`` of this process's Ray runtime env
            (``None``: none, or no Ray); a module path, or a callable's ``__name__``.

    Returns:
        ``None`` when one hook governs the job: the reserved variable is unset, names this
        hook, or names the hook the runtime env declares (a user's own hook that calls
        :func:`install`, the documented fallback). Otherwise the line: the reserved variable
        was set by hand (a pod's ``env``, ``env_vars``) or inherited from a parent job with a
        different hook, Ray runs only what it names, and a nested ``ray.init`` with the other
        hook is refused (``Conflicting worker_process_setup_hook``, or ``is not permitted``
        before Ray ``RAY_NESTED_INIT``).
    """
    if not reserved or reserved == HOOK_PATH:
        return None
    if declared is None or declared == reserved:
        return None
    if reserved.startswith(_CALLABLE_KEY) and "." not in str(declared):
        return None  # a callable hook: Ray keeps only its __name__ in the runtime env
    shown = "a callable" if reserved.startswith(_CALLABLE_KEY) else repr(reserved)
    return (
        f"Ray's reserved {RESERVED_HOOK_VAR} already names {shown}, but this job's runtime env "
        f"sets worker_process_setup_hook {declared!r}: two setup hooks in one job; remove "
        f"{RESERVED_HOOK_VAR} from the pod's env and the runtime env's env_vars and set "
        f"worker_process_setup_hook once, at job level (RayJob.spec.runtimeEnvYAML), or call "
        f"{HOOK_PATH}() from your own hook; running unhooked, at default clocks"
    )


JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Where Ray's job supervisor (``ray job submit``, a KubeRay RayJob) hands the entrypoint
driver its job config, ``{"runtime_env": {...}}``
(``ray_constants.RAY_JOB_CONFIG_JSON_ENV_VAR``)."""


def _declared_hook() -> object:
    """The job's ``worker_process_setup_hook`` as declared (``None``: none, or unknown).

    A submitted job's driver reads it from ``JOB_CONFIG_VAR``; a Ray worker from its job
    config (the core worker's ``get_job_config()``, set before the setup hook runs). Never
    ``ray.get_runtime_context().runtime_env``: inside a setup hook, before the worker's first
    task, Ray 2.55.1 crashes the worker process with SIGSEGV there.
    """
    text = os.environ.get(JOB_CONFIG_VAR)
    if text:
        return dict(json.loads(text).get("runtime_env") or {}).get("worker_process_setup_hook")
    ray_worker = sys.modules.get("ray._private.worker")
    worker = getattr(ray_worker, "global_worker", None)
    if worker is None or not worker.connected:
        return None
    env = worker.core_worker.get_job_config().runtime_env_info.serialized_runtime_env
    return dict(json.loads(env)).get("worker_process_setup_hook") if env else None


_INSTALL_LOCK = threading.Lock()
_INSTALLED: dict[str, bool] = {}
"""Set once :func:`install` ran in this process (tests restore verl's classes and clear it)."""


TESTED_VERL = "0.9.1"
"""The verl release the hook's wrappers are matched to (pyproject's ``verl`` extra)."""


def install() -> None:
    """Ray ``worker_process_setup_hook``: patch verl's classes in this process.

    The GPU workers' phases and training progress (the critic's included), the drivers'
    workload count (the legacy ``RayPPOTrainer`` now; verl's default v1 ``PPOTrainer`` when
    its module is first imported, so processes that never run the driver do not import it),
    the async rollout pool's weight versions; the rollout servers (imported later, only in
    their own processes) publish their metrics URL on import; verl's ``AgentLoopManager``
    announces each batch to a FlexFloor request router when the job names one
    (``rlenergy.sdk.verl_placement``; otherwise it runs as before). Best effort: a process without
    verl, or with a verl whose classes moved, logs one line naming what it left unpatched and
    runs at default clocks; every wrapper's own work is guarded (:func:`safely`), so the hook
    never fails the job.

    Idempotent: a second call in one process (a user's hook that calls it, an actor's
    restarted task) changes nothing and logs nothing. Under two different setup hooks in one
    job (:func:`setup_hook_conflict`) it logs that one line and installs nothing.
    """
    with _INSTALL_LOCK:
        if _INSTALLED:
            return
        _INSTALLED["done"] = True
        try:
            conflict = setup_hook_conflict(os.environ.get(RESERVED_HOOK_VAR), _declared_hook())
        except Exception as exc:  # noqa: BLE001 - the check never fails the job
            conflict = None
            log.debug("rlenergy verl hook: runtime env unreadable: %s", exc)
        if conflict is not None:
            log.warning("rlenergy verl hook: %s", conflict)
            return
        _install()


def _install() -> None:
    missing = [
        why
        for (module, name), patch in (
            (WORKER_CLASS, patch_worker),
            (CRITIC_CLASS, patch_critic),
            (TRAINER_CLASS, patch_trainer),
            (CHECKPOINT_WORKER_CLASS, patch_checkpoint_worker),
        )
        if (why := _patch(module, name, patch)) is not None
    ]
    if missing:
        version = getattr(sys.modules.get("verl"), "__version__", "not importable")
        log.warning(
            "rlenergy verl hook: verl %s is not the governed verl %s; left unpatched, at default "
            "clocks: %s",
            version,
            TESTED_VERL,
            "; ".join(missing),
        )
    ray = sys.modules.get("ray")
    problem = ray_version_problem(str(getattr(ray, "__version__", ""))) if ray else None
    if problem is not None:
        log.warning("rlenergy verl hook: %s", problem)
    after_import(
        V1_TRAINER_CLASS[0],
        lambda mod: _patch_logged(mod.__name__, V1_TRAINER_CLASS[1], patch_v1_trainer),
    )
    from rlenergy.sdk import verl_placement  # noqa: PLC0415 - it imports this module

    manager = verl_placement.MANAGER_CLASS
    after_import(
        manager[0],
        lambda mod: _patch_logged(
            mod.__name__, manager[1], verl_placement.patch_agent_loop_manager
        ),
    )
    for (module, name), engine in ENGINE_SERVERS.items():

        def then(mod: types.ModuleType, name: str = name, engine: str = engine) -> None:
            _patch_logged(mod.__name__, name, functools.partial(patch_engine_server, engine=engine))

        after_import(module, then)


__all__ = [
    "PREFIX",
    "WORKLOAD_KEY",
    "ProgressSource",
    "TrainedBatch",
    "VerlHook",
    "hook",
    "after_import",
    "install",
    "is_critic",
    "patch_checkpoint_worker",
    "patch_critic",
    "patch_engine_server",
    "patch_trainer",
    "patch_v1_trainer",
    "safely",
    "setup_hook_conflict",
    "v1_workload",
    "patch_worker",
    "pool_phases",
    "ray_version_problem",
    "progress_kind",
    "trained_batch",
]
