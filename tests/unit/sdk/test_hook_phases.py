"""Which phase the verl hook enters for each wrapped worker method, and which progress source
serves it (no verl needed; the hook against a real agent: ``tests/unit/agent/test_subphases.py``,
through verl's own classes: ``tests/verl/test_verl_subphases.py``).

We test these aspects:
* every wrapped training method is a training sub-phase of ``rlenergy.api.phases``;
* the name follows the client's newest plan phases (a sub-phase the plan names, else training);
* training progress sources serve ``training`` and every sub-phase, generation sources only
  generation; a sub-phase name is no source kind;
* PPO's critic: its ``TrainingWorker`` methods run ``values`` / ``update-critic`` (or
  ``training``), only on a ``value_model`` worker; a worker continuing the open window (the
  critic after the actor's passes, both ``training``) is handed to the sources (``watch``),
  and the training-token counter then counts its module too, each module once.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from rlenergy.api import phases
from rlenergy.sdk import progress, trainer, verl_hook


class Recorder:
    """A ``verl_hook.ProgressSource`` that records the windows it served."""

    def __init__(self) -> None:
        self.windows = 0
        self.open = False
        self.watched: list[object] = []

    def watch(self, worker: object) -> None:
        assert self.open
        self.watched.append(worker)

    def begin(self, worker: object, report: Callable[[float], None]) -> None:
        assert not self.open
        self.windows += 1
        self.open = True

    def end(self) -> float | None:
        self.open = False
        return None


def _hook(plan: tuple[str, ...]) -> verl_hook.VerlHook:
    client = trainer.RLEnergyClient("/nonexistent/rlenergy.sock")
    client._plan_phases = plan  # what the newest phase answer said
    return verl_hook.VerlHook(client, signals=False)


def test_every_wrapped_training_method_is_a_training_sub_phase() -> None:
    assert [phases.SUBPHASE_BY_METHOD[m].name for m in verl_hook.TRAINING_METHODS] == [
        "old-log-prob",
        "ref",
        "update-actor",
    ]


@pytest.mark.parametrize(
    ("plan", "want"),
    [
        ((), ["training", "training", "training"]),
        (("generation", "training"), ["training", "training", "training"]),
        (("generation", "training", "update-actor"), ["training", "training", "update-actor"]),
        (
            ("generation", "old-log-prob", "ref", "update-actor"),
            ["old-log-prob", "ref", "update-actor"],
        ),
        (("generation", "ref", "values"), ["training", "ref", "training"]),
    ],
)
def test_the_phase_of_each_method_follows_the_plan(plan: tuple[str, ...], want: list[str]) -> None:
    h = _hook(plan)
    assert [h.training_phase(m) for m in verl_hook.TRAINING_METHODS] == want
    with pytest.raises(KeyError):
        h.training_phase("generate_sequences")


def test_progress_sources_are_keyed_by_kind() -> None:
    assert verl_hook.progress_kind("generation") == "generation"
    for name in ("training", *phases.SUBPHASE_BY_NAME):
        assert verl_hook.progress_kind(name) == "training"
    assert verl_hook.progress_kind("idle") is None
    assert verl_hook.progress_kind("reward") is None
    h = _hook(("generation", "old-log-prob", "update-actor"))
    gen, train = Recorder(), Recorder()
    h.add_progress_source("generation", gen)
    h.add_progress_source("training", train)
    with pytest.raises(ValueError, match="training sources serve every training sub-phase"):
        h.add_progress_source("update-actor", Recorder())
    h.enter("generation", 1)
    for m in verl_hook.TRAINING_METHODS:
        h.enter_training(m)  # old-log-prob, training (ref is not named), update-actor
    assert (gen.windows, train.windows) == (1, 3) and train.open and not gen.open
    h.enter_training("update_actor")  # the same phase and step: the window goes on
    assert train.windows == 3
    h.enter("reward", 1)  # a custom phase: no source
    assert not train.open and train.windows == 3


def test_the_critics_methods_run_the_values_and_update_critic_sub_phases() -> None:
    # verl 0.9.1: RayPPOTrainer._compute_values -> critic_wg.infer_batch,
    # _update_critic -> critic_wg.train_mini_batch
    assert verl_hook.CRITIC_CLASS == ("verl.workers.engine_workers", "TrainingWorker")
    assert list(verl_hook.CRITIC_METHODS) == ["infer_batch", "train_mini_batch"]
    subs = [phases.SUBPHASE_BY_METHOD[m] for m in verl_hook.CRITIC_METHODS.values()]
    assert [(s.name, s.kind) for s in subs] == [
        ("values", "forward"),
        ("update-critic", "training"),
    ]
    critic_methods = list(verl_hook.CRITIC_METHODS.values())
    for plan, want in (
        ((), ["training", "training"]),
        (("generation", "training"), ["training", "training"]),
        (("generation", "training", "update-critic"), ["training", "update-critic"]),
        (("generation", "values", "update-critic", "update-actor"), ["values", "update-critic"]),
    ):
        assert [_hook(plan).training_phase(m) for m in critic_methods] == want


def test_only_a_value_model_training_worker_is_the_critic() -> None:
    def worker(model_type: str | None) -> object:
        return SimpleNamespace(config=SimpleNamespace(model_type=model_type))

    assert verl_hook.is_critic(worker("value_model"))
    assert not verl_hook.is_critic(worker("language_model"))  # the actor's / ref's inner one
    assert not verl_hook.is_critic(worker(None))
    assert not verl_hook.is_critic(SimpleNamespace())


def test_a_worker_continuing_the_window_is_handed_to_the_training_sources() -> None:
    h = _hook(("generation", "training"))
    train = Recorder()
    h.add_progress_source("training", train)
    h.enter("generation", 1)
    h.enter_training("compute_log_prob", "actor")
    h.enter_training("compute_values", "critic")  # training too: the window goes on
    h.enter_training("update_critic", "critic")
    assert train.windows == 1 and train.watched == ["critic", "critic"]
    h.enter("generation", 2, "actor")  # another kind: no training source hears of it
    assert train.watched == ["critic", "critic"]


class _Module:
    """A torch module's forward-hook registry (what ``ForwardTokenCounter`` uses)."""

    def __init__(self) -> None:
        self.hooks: list[Callable[..., None]] = []

    def register_forward_hook(self, hook: Callable[..., None], **kw: Any) -> object:
        self.hooks.append(hook)
        return SimpleNamespace(remove=lambda: None)

    def forward(self, tokens: int) -> None:
        ids = SimpleNamespace(numel=lambda: tokens, shape=(tokens,), device=None)
        for hook in self.hooks:
            hook(self, (), {"input_ids": ids}, None)


def test_training_tokens_count_the_critics_module_once_it_is_watched() -> None:
    actor, critic = _Module(), _Module()
    arr = SimpleNamespace(
        actor=SimpleNamespace(engine=SimpleNamespace(module=actor)),
        ref=SimpleNamespace(engine=SimpleNamespace(module=actor)),  # ref in actor: once
    )
    critic_worker = SimpleNamespace(engine=SimpleNamespace(module=critic))  # no actor
    assert progress.verl_training_modules(critic_worker) == [critic]
    sent: list[float] = []
    pp = progress.PhaseProgress(progress.TrainingTokens, period_s=0.005)
    pp.begin(arr, sent.append)
    actor.forward(10)
    critic.forward(100)  # not watched yet: not counted
    pp.watch(critic_worker)  # the critic continues the window
    critic.forward(7)
    pp.watch(critic_worker)  # again: still one counter
    actor.forward(1)
    assert pp.end() == 18.0
    pp.begin(critic_worker, sent.append)  # a window of the critic's own
    critic.forward(5)
    assert pp.end() == 5.0
    assert isinstance(pp.source, progress.TrainingTokens) and len(pp.source.counters) == 2


def test_the_weight_sync_is_a_phase_only_where_the_plan_lists_it() -> None:
    assert phases.weight_sync_signal(("generation", "training")) is None
    assert phases.weight_sync_signal(("generation", "weight-sync")) == "weight-sync"
    assert phases.phase_kind(phases.WEIGHT_SYNC) is None  # no GPU model, no progress source
    plain = _hook(("generation", "training"))
    assert plain.enter_weight_sync(3) is None and plain.phase == "idle"
    listed = _hook(("generation", "weight-sync", "training"))
    assert listed.enter_weight_sync(3) == "weight-sync"
    assert (listed.phase, listed.step) == ("weight-sync", 3)


def test_an_abort_ends_the_window_and_goes_idle_once() -> None:
    h = _hook(("generation", "training"))
    gen = Recorder()
    h.add_progress_source("generation", gen)
    h.enter("generation", 2)
    assert gen.open
    h.abort("verl's update_actor raised RuntimeError: boom")
    assert h.phase == "idle" and not gen.open
    h.abort("again")  # already idle: nothing more
    assert h.aborts == ["verl's update_actor raised RuntimeError: boom", "again"]
    h.enter("generation", 2)  # the same step generates again: a new window
    assert gen.windows == 2
    h.report_tokens(5)
    assert h.reported.total() == 5
    with pytest.raises(ValueError, match=">= 0"):
        h.report_tokens(-1)
