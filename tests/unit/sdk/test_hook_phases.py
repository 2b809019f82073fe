"""Which phase the verl hook enters for each wrapped worker method, and which progress source
serves it (no verl needed; the hook against a real agent: ``tests/unit/agent/test_subphases.py``,
through verl's own classes: ``tests/verl/test_verl_subphases.py``).

We test these aspects:
* every wrapped training method is a training sub-phase of ``rlenergy.api.phases``;
* the name follows the client's newest plan phases (a sub-phase the plan names, else training);
* training progress sources serve ``training`` and every sub-phase, generation sources only
  generation; a sub-phase name is no source kind.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rlenergy.api import phases
from rlenergy.sdk import trainer, verl_hook


class Recorder:
    """A ``verl_hook.ProgressSource`` that records the windows it served."""

    def __init__(self) -> None:
        self.windows = 0
        self.open = False

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
