"""verl's training sub-phases as phases of their own, end to end on the stand-in.

The policy names the sub-phases (``spec.phases``); the operator's plan carries them to the node
agent; the agent's answer to each phase signal names the plan's phases (``planPhases``); the
trainer's hook (``rlenergy.sdk.verl_hook.VerlHook``, driven as verl's wrapped worker methods
drive it) signals each named sub-phase under its own name and the rest as ``training``; the
agent meters each as its own window, answers the step's energy per phase (the
``rlenergy/energy/<phase>_j`` keys) and the operator's job loop folds each into its own
``status.phases[]`` entry and controller. The default plan (generation, training) keeps every
training method in one ``training`` window, as before.

We test these aspects:
* the phase answer names the plan's phases (observe plans included), none without a plan; a
  signal the agent does not answer keeps the client's list;
* the hook's windows, clocks, progress and energy keys for a plan naming ``update-actor`` only,
  for the default plan, and before the agent's first answer;
* the job loop folds a real agent's sub-phase windows into per-phase status and starts each
  named sub-phase's own trials.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from agent_support import DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import server, service
from rlenergy_dev import standin
from rlenergy_operator import jobloop

from rlenergy.api import node as api_node
from rlenergy.api import phases as api_phases
from rlenergy.api.v1alpha1 import policy
from rlenergy.gpu import models
from rlenergy.sdk import trainer, verl_hook

POD = service.PodRef("rl", "verl-worker-0", "11111111-2222-3333-4444-555555555555")
AT = "2026-12-05T08:00:00Z"
WORKLOAD = verl_hook.TrainedBatch(
    samples=8, aborted_samples=0, valid_tokens=800.0, response_tokens=800.0, prompt_tokens=400.0
)
METHODS = ("compute_log_prob", "compute_ref_log_prob", "update_actor")
"""verl 0.9.1's order in ``RayPPOTrainer.fit``: old log-probs, reference, update."""


def _plan(entries: Sequence[tuple[str, int | None]], *, enforce: bool = True) -> api_node.ClockPlan:
    return api_node.ClockPlan(
        step=0,
        enforce=enforce,
        phases=[
            api_node.PhasePlan(phase=name, clockMHz=mhz, state="locked") for name, mhz in entries
        ],
    )


class Tokens:
    """A training progress source (``verl_hook.ProgressSource``) the test advances itself.

    Attributes:
        begun: how many windows it served.
    """

    def __init__(self) -> None:
        self.report: Callable[[float], None] | None = None
        self.total = 0.0
        self.begun = 0

    def begin(self, worker: object, report: Callable[[float], None]) -> None:
        self.report, self.total = report, 0.0
        self.begun += 1

    def add(self, tokens: float) -> None:
        assert self.report is not None, "no training window open"
        self.total += tokens
        self.report(self.total)

    def end(self) -> float | None:
        self.report = None
        return self.total


class Rank:
    """One verl rank's hook against a real agent behind its Unix-socket server."""

    def __init__(self, drv: standin.StandinDriver, agent: service.Agent, folder: Path) -> None:
        self.drv, self.agent = drv, agent
        self.gpus = list(drv.uuids)
        reviews = FakeReviews()
        self.srv = server.SignalServer(folder / "agent.sock", agent, reviews.authenticator())
        self.srv.start()
        self.client = reviews.client(folder / "agent.sock", POD, folder, strict=True)
        self.hook = verl_hook.VerlHook(self.client)
        self.tokens = Tokens()
        self.hook.add_progress_source("training", self.tokens)

    def work(self, label: str, seconds: float, kind: models.PhaseKind = "training") -> None:
        self.drv.set_work(self.gpus, kind, label)
        for _ in range(round(seconds / 0.1)):
            self.drv.advance(0.1)
            self.agent.meter.sample()

    def locks(self) -> set[int | None]:
        """The SM clock lock of the rank's GPUs now, MHz (``None``: default governor)."""
        g = [self.drv.gpu(u) for u in self.gpus]
        return {int(x.lock_max_mhz) if x.locked else None for x in g}

    def step(self, step: int) -> tuple[list[str], dict[str, float]]:
        """One step as verl's wrapped methods run it; (phase of each method, step metrics).

        ``self.held`` gets the GPUs' locks during each method.
        """
        self.hook.enter("generation", step)  # update_weights(global_steps=step - 1) returned
        self.work(f"gen-{step}", 3.0, "generation")
        entered = []
        self.held: list[set[int | None]] = []
        for method in METHODS:
            entered.append(self.hook.enter_training(method))
            self.held.append(self.locks())
            self.work(f"{method}-{step}", 1.0)
            self.tokens.add(100.0)
        self.drv.set_work(self.gpus, "idle", "idle")
        return entered, self.hook.end_step(WORKLOAD)

    def stop(self) -> None:
        self.client.close()
        self.srv.stop()


MakeRank = Callable[[api_node.ClockPlan | None], Rank]


@pytest.fixture
def rank(make_driver: DriverFactory, short_tmp: Path) -> Iterator[MakeRank]:
    made: list[Rank] = []

    def make(plan: api_node.ClockPlan | None) -> Rank:
        drv = make_driver(2)
        agent = standin_agent({POD: list(drv.uuids)}, plan, lambda: drv.virtual_s)
        made.append(Rank(drv, agent, short_tmp))
        return made[-1]

    yield make
    for r in made:
        r.stop()


def test_the_phase_answer_names_the_plans_phases(rank: MakeRank) -> None:
    r = rank(None)
    client = r.client
    assert client.plan_phases == ()
    client.phase("generation", step=0)
    assert client.last_response["planPhases"] == [] and client.plan_phases == ()
    named = [("generation", 1395), ("old-log-prob", None), ("update-actor", 1755)]
    r.agent.set_plan(_plan(named))
    client.phase("generation", step=1)
    assert client.last_response["planPhases"] == ["generation", "old-log-prob", "update-actor"]
    assert client.plan_phases == ("generation", "old-log-prob", "update-actor")
    # observe mode: the agent never touches clocks, but the trainer's windows still follow the
    # policy's phases, so the observed status has each of them
    r.agent.set_plan(_plan([("generation", None), ("ref", None)], enforce=False))
    client.phase("training", step=1)
    assert client.plan_phases == ("generation", "ref")
    assert r.locks() == {None}
    r.agent.set_plan(None)  # policy removed
    client.phase("generation", step=2)
    assert client.plan_phases == ()
    # an unanswered signal (agent gone) keeps the newest list
    r.agent.set_plan(_plan(named))
    client.phase("generation", step=3)
    r.srv.stop()
    lenient = trainer.RLEnergyClient(client.socket_path, token_file=client.token.path)
    lenient._plan_phases = client.plan_phases
    lenient.phase("update-actor", step=3)
    assert lenient.plan_phases == ("generation", "old-log-prob", "update-actor")


def test_a_named_sub_phase_is_its_own_window_clock_progress_and_energy_key(rank: MakeRank) -> None:
    r = rank(_plan([("generation", 1395), ("training", None), ("update-actor", 1755)]))
    seen: dict[int, dict[str, float]] = {}
    for step in (1, 2):
        entered, seen[step] = r.step(step)
        # compute_log_prob and compute_ref_log_prob stay in one training window
        assert entered == ["training", "training", "update-actor"]
        assert r.held == [{None}, {None}, {1755}]  # the sub-phase's own clock
    # each training window had its own progress: the source began once per window
    assert r.tokens.begun == 4
    by_step = {rec.step: rec for rec in r.agent.report().steps}
    for step in (1, 2):
        windows = {p.phase: p for p in by_step[step].phases}
        assert [p.phase for p in by_step[step].phases] == ["generation", "training", "update-actor"]
        assert windows["update-actor"].requested_clock_mhz == 1755
        assert windows["training"].requested_clock_mhz is None  # default governor
        assert windows["training"].progress == 200.0  # old log-probs + reference passes
        assert windows["update-actor"].progress == 100.0
        truth = {
            "generation": sum(r.drv.truth_j(u, f"gen-{step}") for u in r.gpus),
            "training": sum(r.drv.truth_j(u, f"{m}-{step}") for u in r.gpus for m in METHODS[:2]),
            "update-actor": sum(r.drv.truth_j(u, f"update_actor-{step}") for u in r.gpus),
        }
        m = seen[step]
        for name, joules in truth.items():
            assert windows[name].energy_joules == pytest.approx(joules, rel=0.02)
            assert m[f"rlenergy/energy/{name}_j"] == windows[name].energy_joules
        step_j = sum(w.energy_joules or 0.0 for w in windows.values())
        assert m["rlenergy/energy/step_j"] == pytest.approx(step_j, rel=1e-12)
        assert not {k for k in m if k.startswith("rlenergy/energy/")} - {
            f"rlenergy/energy/{n}_j" for n in (*truth, "step")
        }


def test_the_default_plan_keeps_every_training_method_in_one_training_window(
    rank: MakeRank,
) -> None:
    r = rank(_plan([("generation", 1395), ("training", None)]))
    entered, metrics = r.step(1)
    assert entered == ["training"] * 3
    rec = r.agent.report().steps[0]
    assert [p.phase for p in rec.phases] == ["generation", "training"]
    assert rec.phases[1].progress == 300.0 and r.tokens.begun == 1
    assert sorted(k for k in metrics if k.startswith("rlenergy/energy/")) == [
        "rlenergy/energy/generation_j",
        "rlenergy/energy/step_j",
        "rlenergy/energy/training_j",
    ]


def test_before_the_first_answer_the_hook_signals_training(rank: MakeRank) -> None:
    # A worker whose first call is a training method (no weight update signalled generation
    # before it): it has no answer yet, so old-log-prob is training; the answer names the plan.
    r = rank(_plan([("generation", 1395), ("old-log-prob", 1200), ("update-actor", 1755)]))
    assert r.hook.enter_training("compute_log_prob") == "training"
    assert r.locks() == {None}  # training: not in the plan
    assert r.hook.enter_training("compute_ref_log_prob") == "training"  # ref is not named
    assert r.hook.enter_training("update_actor") == "update-actor"
    assert r.locks() == {1755}
    r.hook.end_step(WORKLOAD)
    entered, _ = r.step(1)
    assert entered == ["old-log-prob", "training", "update-actor"]
    assert r.held == [{1200}, {None}, {1755}]


def test_processes_that_do_not_signal_stay_in_training(caplog: pytest.LogCaptureFixture) -> None:
    # LOCAL_RANK != 0: no agent answer ever, so every method is training (one window).
    h = verl_hook.VerlHook(trainer.RLEnergyClient("/nonexistent/agent.sock"), signals=False)
    assert [h.training_phase(m) for m in METHODS] == ["training"] * 3
    with caplog.at_level(logging.WARNING):
        assert h.enter_training("update_actor") == "training"
    assert not caplog.records  # nothing sent


def test_the_job_loop_folds_a_real_agents_sub_phases_into_per_phase_status(rank: MakeRank) -> None:
    names = ["generation", "old-log-prob", "ref", "update-actor"]
    spec = policy.parse_policy(
        {"selector": {"matchLabels": {"a": "b"}}, "phases": [{"name": n} for n in names]}
    )
    loop = jobloop.JobLoop(spec, 1)
    r = rank(loop.plan(AT))
    energy: dict[str, float] = dict.fromkeys(names, 0.0)
    for step in (0, 1):
        plan = loop.plan(AT)
        assert plan.step == step
        r.agent.set_plan(plan)
        entered, metrics = r.step(step)
        assert entered == ["old-log-prob", "ref", "update-actor"]
        for n in names:
            energy[n] += metrics[f"rlenergy/energy/{n}_j"]
        assert loop.advance([r.agent.report()]) == [step]
    status = {p.name: p for p in loop.phase_status()}
    assert list(status) == names  # training is not a phase of this policy: nothing booked to it
    assert set(loop.account.phases) == set(names)
    for n in names:
        assert status[n].measured_joules == pytest.approx(energy[n], rel=1e-9)
        # two steps of 3 s generation and 1 s per sub-phase
        assert status[n].measured_seconds == pytest.approx(6.0 if n == "generation" else 2.0)
    # two clean warm-up steps of every phase: each named sub-phase runs its own trial
    after = loop.plan(AT)
    assert {p.phase: p.state for p in after.phases} == dict.fromkeys(names, "trial")
    assert api_phases.SUBPHASE_BY_NAME["update-actor"].method == METHODS[2]
