"""verl's training sub-phases as phases of their own, through verl 0.9.1's real classes.

``install()`` wraps ``ActorRolloutRefWorker``'s ``compute_log_prob``, ``compute_ref_log_prob``
and ``update_actor`` (the latter reached from the driver's real ``RayPPOTrainer._update_actor``);
the node agent (stand-in NVML, real Unix-socket server) follows a plan naming the sub-phases
``old-log-prob``, ``ref`` and ``update-actor`` and answers each phase signal with the plan's
phase names. Each verl method must then run in its own window at its own clock, with its own
forward-token progress (``add_default_sources``: the actor module's forward hook) and its own
``rlenergy/energy/<phase>_j`` key in verl's step metrics; verl's LoRA reference pass
(``compute_log_prob`` with ``no_lora_adapter``, ``ref_in_actor``) is ``ref``. Under the default
plan (generation, training) every training method is one ``training`` window, as before.

PPO's critic is verl's real ``TrainingWorker`` of a ``value_model`` (``verlrank.make_critic``),
reached from the driver's real ``RayPPOTrainer._compute_values`` / ``_update_critic`` between the
reference pass and the actor update, as ``RayPPOTrainer.fit`` runs them: a plan listing
``values`` and ``update-critic`` gives each its window, clock, progress (the critic module's
forward tokens) and energy key; the default plan keeps them in ``training``, whose progress then
counts the critic's passes too; the actor's own inner ``TrainingWorker`` (``language_model``)
runs the same methods without entering the critic's phases.

The CPU engine's ``pace`` advances the stand-in's virtual time inside verl's engine calls, so
each window's energy has a known truth (booked under the label of the verl call running).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_support import DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import server
from rlenergy_dev import standin, verlrank
from test_verl_hook import POD, _batch
from verl.single_controller.base import decorator
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
from verl.workers.utils.padding import left_right_2_no_padding

from rlenergy.api import node as api_node
from rlenergy.sdk import verl_hook

SUBPHASES = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="old-log-prob", clockMHz=1200, state="locked"),
        api_node.PhasePlan(phase="ref", clockMHz=None, state="locked"),
        api_node.PhasePlan(phase="update-actor", clockMHz=1755, state="locked"),
    ],
)
CRITIC = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=1500, state="locked"),
        api_node.PhasePlan(phase="values", clockMHz=1110, state="locked"),
        api_node.PhasePlan(phase="update-critic", clockMHz=1650, state="locked"),
        api_node.PhasePlan(phase="update-actor", clockMHz=1755, state="locked"),
    ],
)
"""PPO with its critic's sub-phases listed; the log-prob passes stay in ``training``."""
DEFAULT = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=None, state="locked"),
    ],
)
TICK_S = 0.05
"""Virtual time per forward chunk of the engine, s."""


class Job:
    """One verl rank (real worker and driver methods, CPU engine) against a real agent.

    Attributes:
        call: label of the verl call running now (the truth label of its energy).
        held: per label, the SM clock locks the GPUs held during its engine chunks, MHz.
        forwarded: per label, the tokens the engine forwarded in it.
    """

    def __init__(
        self,
        drv: standin.StandinDriver,
        plan: api_node.ClockPlan,
        folder: Path,
        *,
        critic: bool = False,
        inner_actor: bool = False,
    ) -> None:
        self.drv = drv
        self.gpus = list(drv.uuids)
        self.agent = standin_agent({POD: self.gpus}, plan, lambda: drv.virtual_s)
        reviews = FakeReviews()
        self.srv = server.SignalServer(folder / "agent.sock", self.agent, reviews.authenticator())
        self.srv.start()
        h = verl_hook.VerlHook(reviews.client(folder / "agent.sock", POD, folder, strict=True))
        h.add_default_sources()  # what hook() gives a worker after install()
        verl_hook._HOOK = h
        self.call = "idle"
        self.held: dict[str, set[int | None]] = {}
        self.forwarded: dict[str, int] = {}
        self.engine = verlrank.CpuEngine(chunk_tokens=16, pace=self._pace)
        self.worker = verlrank.make_worker(self.engine)
        self.engines: list[Any] = [self.engine]
        if inner_actor:  # verl's own layout: the actor and reference are inner TrainingWorkers
            inner = verlrank.CpuValueEngine(chunk_tokens=16, pace=self._pace)
            self.engines = [inner]
            self.worker.actor = verlrank.make_training_worker(inner, "language_model")
            self.worker.ref = self.worker.actor
        self.critic = None
        if critic:
            self.critic_engine = verlrank.CpuValueEngine(chunk_tokens=16, pace=self._pace)
            self.engines.append(self.critic_engine)
            self.critic = verlrank.make_critic(self.critic_engine)
        self.trainer = verlrank.make_trainer(self.worker, self.critic)

    @property
    def forwarded_now(self) -> int:
        """Tokens every engine (actor, critic) forwarded so far."""
        return sum(e.forwarded for e in self.engines)

    def _pace(self, kind: str, tokens: int) -> None:
        g = [self.drv.gpu(u) for u in self.gpus]
        self.held.setdefault(self.call, set()).update(
            int(x.lock_max_mhz) if x.locked else None for x in g
        )
        self.drv.advance(TICK_S)
        self.agent.meter.sample()

    def run(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``: a verl call whose GPU work is booked under ``call``."""
        self.call = call
        self.drv.set_work(self.gpus, "training", call)
        before = self.forwarded_now
        try:
            return fn(*args)
        finally:
            self.forwarded[call] = self.forwarded_now - before
            self.drv.set_work(self.gpus, "idle", "idle")
            self.call = "idle"

    def step(self, step: int, *, lora_ref: bool = False) -> dict[str, float]:
        """Step ``step`` as ``RayPPOTrainer.fit`` runs it; returns verl's step metrics."""
        asyncio.run(verlrank.weights_done(self.worker, step - 1))  # generation of step
        self.drv.set_work(self.gpus, "generation", f"gen-{step}")
        for _ in range(40):
            self.drv.advance(0.1)
            self.agent.meter.sample()
        batch, _, _ = _batch(step)
        batch = batch[verlrank.dapo_keep(batch)]
        worker = self.worker
        self.run(
            f"old-{step}",
            ActorRolloutRefWorker.compute_log_prob,
            worker,
            left_right_2_no_padding(batch.to_tensordict()),
        )
        ref_td = left_right_2_no_padding(batch.to_tensordict())
        if lora_ref:  # verl's _compute_ref_log_prob with ref_in_actor (LoRA)
            tu.assign_non_tensor(ref_td, no_lora_adapter=True)
            self.run(f"ref-{step}", ActorRolloutRefWorker.compute_log_prob, worker, ref_td)
        else:
            self.run(f"ref-{step}", ActorRolloutRefWorker.compute_ref_log_prob, worker, ref_td)
        if self.critic is not None:  # RayPPOTrainer.fit: values, advantages, update_critic
            values = self.run(f"values-{step}", self.trainer._compute_values, batch)
            batch = batch.union(values)
            self.run(f"critic-{step}", self.trainer._update_critic, batch)
        out = self.run(f"update-{step}", self.trainer._update_actor, batch)
        return dict(out.meta_info["metrics"])

    def truth(self, label: str) -> float:
        return sum(self.drv.truth_j(u, label) for u in self.gpus)

    def windows(self, step: int) -> list[api_node.PhaseWindowReport]:
        return next(r for r in self.agent.report().steps if r.step == step).phases

    def stop(self) -> None:
        verl_hook.hook().client.close()
        self.srv.stop()


MakeJob = Callable[..., "Job"]


@pytest.fixture
def job(
    hooked: None, cpu_weight_sync: None, make_driver: DriverFactory, short_tmp: Path
) -> Iterator[MakeJob]:
    made: list[Job] = []

    def make(plan: api_node.ClockPlan, **kw: bool) -> Job:
        made.append(Job(make_driver(2), plan, short_tmp, **kw))
        return made[-1]

    yield make
    for j in made:
        j.stop()


def test_a_plan_naming_the_sub_phases_gives_each_verl_method_its_window_and_key(
    job: MakeJob,
) -> None:
    j = job(SUBPHASES)
    for step, lora_ref in ((1, False), (2, True)):
        metrics = j.step(step, lora_ref=lora_ref)
        windows = j.windows(step)
        assert [w.phase for w in windows] == ["generation", "old-log-prob", "ref", "update-actor"]
        by = {w.phase: w for w in windows}
        label = {"old-log-prob": "old", "ref": "ref", "update-actor": "update"}
        # each verl method at its sub-phase's clock (ref: default governor)
        assert j.held[f"old-{step}"] == {1200}
        assert j.held[f"ref-{step}"] == {None}
        assert j.held[f"update-{step}"] == {1755}
        assert [by[n].requested_clock_mhz for n in label] == [1200, None, 1755]
        valid = metrics["rlenergy/valid_tokens"]
        assert valid > 0
        total = by["generation"].energy_joules
        assert total == pytest.approx(j.truth(f"gen-{step}"), rel=0.02)
        for name, call in label.items():
            w = by[name]
            assert w.energy_joules == pytest.approx(j.truth(f"{call}-{step}"), rel=0.02)
            assert metrics[f"rlenergy/energy/{name}_j"] == w.energy_joules
            # the forward-token counter served every sub-phase, each from its own zero
            assert j.forwarded[f"{call}-{step}"] > 0
            assert w.progress == j.forwarded[f"{call}-{step}"]
            total += w.energy_joules
        assert "rlenergy/energy/training_j" not in metrics
        assert metrics["rlenergy/energy/step_j"] == pytest.approx(total)
        assert metrics["rlenergy/energy_per_valid_token_j"] == pytest.approx(total / valid)


def _one_training_window(j: Any, calls: tuple[str, ...]) -> tuple[Any, dict[str, float]]:
    """Step 1 under the default plan: generation, then one training window over ``calls``."""
    metrics = j.step(1)
    windows = j.windows(1)
    assert [w.phase for w in windows] == ["generation", "training"]
    train = windows[1]
    assert train.progress == sum(j.forwarded[c] for c in calls)
    assert train.energy_joules == pytest.approx(sum(j.truth(c) for c in calls), rel=0.02)
    assert sorted(k for k in metrics if k.startswith("rlenergy/energy/")) == [
        "rlenergy/energy/generation_j",
        "rlenergy/energy/step_j",
        "rlenergy/energy/training_j",
    ]
    return train, metrics


def test_the_default_plan_keeps_every_training_method_one_training_window(job: MakeJob) -> None:
    train, metrics = _one_training_window(job(DEFAULT), ("old-1", "ref-1", "update-1"))
    assert train.requested_clock_mhz is None
    assert metrics["rlenergy/energy/training_j"] == train.energy_joules


def test_a_plan_naming_the_critics_sub_phases_gives_verls_critic_calls_their_windows(
    job: MakeJob,
) -> None:
    j = job(CRITIC, critic=True)
    for step in (1, 2):
        metrics = j.step(step)
        windows = j.windows(step)
        by = {w.phase: w for w in windows}  # the agent reports the windows by name
        assert sorted(by) == sorted(
            ["generation", "training", "values", "update-critic", "update-actor"]
        )
        assert len(windows) == 5
        # verl's critic TrainingWorker ran its real methods on its own engine
        assert j.critic_engine.calls[-3:] == ["infer", "train", "train"]
        assert j.held[f"old-{step}"] == j.held[f"ref-{step}"] == {1500}
        assert j.held[f"values-{step}"] == {1110}
        assert j.held[f"critic-{step}"] == {1650}
        assert j.held[f"update-{step}"] == {1755}
        calls = {
            "training": (f"old-{step}", f"ref-{step}"),
            "values": (f"values-{step}",),
            "update-critic": (f"critic-{step}",),
            "update-actor": (f"update-{step}",),
        }
        total = by["generation"].energy_joules
        for name, labels in calls.items():
            w = by[name]
            assert w.energy_joules == pytest.approx(sum(j.truth(c) for c in labels), rel=0.02)
            assert metrics[f"rlenergy/energy/{name}_j"] == w.energy_joules
            # the critic's windows count the critic module's forward tokens, from their zero
            assert w.progress == sum(j.forwarded[c] for c in labels) > 0
            total += w.energy_joules
        # one epoch of mini-batches over the batch the values pass read
        assert j.forwarded[f"values-{step}"] == j.forwarded[f"critic-{step}"]
        assert metrics["rlenergy/energy/step_j"] == pytest.approx(total)
        # the step still closes on update_actor, after the critic's update
        assert metrics["rlenergy/valid_tokens"] > 0


def test_the_default_plan_keeps_the_critics_calls_in_the_training_window(job: MakeJob) -> None:
    j = job(DEFAULT, critic=True)
    # the training counter counts the critic module's passes as well as the actor's
    _one_training_window(j, ("old-1", "ref-1", "values-1", "critic-1", "update-1"))
    assert j.forwarded["values-1"] > 0 and j.forwarded["critic-1"] > 0


def test_the_actors_own_training_worker_does_not_enter_the_critics_phases(job: MakeJob) -> None:
    # verl's ActorRolloutRefWorker calls infer_batch / train_mini_batch on its inner
    # language_model TrainingWorker: they stay the actor's sub-phases.
    j = job(CRITIC, inner_actor=True)
    metrics = j.step(1)
    windows = j.windows(1)
    assert [w.phase for w in windows] == ["generation", "training", "update-actor"]  # by name
    assert windows[1].progress == j.forwarded["old-1"] + j.forwarded["ref-1"] > 0
    assert windows[2].progress == j.forwarded["update-1"] > 0
    assert "rlenergy/energy/values_j" not in metrics
    assert "rlenergy/energy/update-critic_j" not in metrics


def test_install_wraps_the_critics_methods_keeping_verls_dispatch(hooked: None) -> None:
    for name in verl_hook.CRITIC_METHODS:
        fn = TrainingWorker.__dict__[name]
        assert getattr(fn, "__rlenergy_patched__", False)
        attrs = getattr(fn, decorator.MAGIC_ATTR)
        # verl's critic_wg calls are non-blocking, dispatched over the "train" mesh
        assert attrs["dispatch_mode"] is not None and attrs["blocking"] is False
    before = {n: TrainingWorker.__dict__[n] for n in verl_hook.CRITIC_METHODS}
    verl_hook.install()
    assert before == {n: TrainingWorker.__dict__[n] for n in verl_hook.CRITIC_METHODS}
