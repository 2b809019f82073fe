"""The smoke pod's trainer loop (``rlenergy.sdk.smoke``) against a recording client.

We test these aspects:
* each step signals ``generation`` then ``training``, reports progress through each phase at a
  constant rate up to ``phase_s`` x ``RATE_PER_S``, ends the phase (``idle``) and closes the
  step with its token workload; one line per step with the agent's per-phase energy;
* bad arguments raise ``ValueError``;
* ``wait_for_agent`` retries an unreachable agent and a 503 until the deadline, and raises a
  401/403 refusal at once.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlenergy.sdk import smoke, trainer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.now += dt


class Recorder:
    def __init__(self, clock: Clock, fail: list[BaseException] | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.clock = clock
        self.fail = fail or []

    def phase(self, name: str, *, step: int) -> object:
        if self.fail:
            raise self.fail.pop(0)
        self.calls.append(("phase", name, step, self.clock()))
        return object()

    def progress_total(self, total: float) -> None:
        self.calls.append(("progress", total, self.clock()))

    def end_step(self, step: int, **workload: Any) -> dict[str, object]:
        self.calls.append(("step", step, workload))
        return {"phaseEnergyJoules": {"generation": 1.5, "training": 2.0}}


def test_steps_signal_the_phases_progress_and_workload() -> None:
    clock = Clock()
    client = Recorder(clock)
    lines: list[str] = []
    assert smoke.run_steps(client, 2, 0.1, clock=clock, sleep=clock.sleep, echo=lines.append) == 2
    phases = [(c[1], c[2]) for c in client.calls if c[0] == "phase"]
    assert phases == [
        ("generation", 0), ("training", 0), ("idle", 0),
        ("generation", 1), ("training", 1), ("idle", 1),
    ]  # fmt: skip
    training = next(i for i, c in enumerate(client.calls) if c[:2] == ("phase", "training"))
    gen_totals = [c[1] for c in client.calls[1:training]]
    assert gen_totals == sorted(gen_totals)
    assert gen_totals[-1] == pytest.approx(0.1 * smoke.RATE_PER_S)
    assert len(gen_totals) >= 0.1 / smoke.PROGRESS_EVERY_S
    steps = [c for c in client.calls if c[0] == "step"]
    assert [s[1] for s in steps] == [0, 1]
    assert steps[0][2] == {
        "samples": smoke.SAMPLES,
        "response_tokens": smoke.RESPONSE_TOKENS,
        "prompt_tokens": smoke.PROMPT_TOKENS,
        "valid_tokens": smoke.RESPONSE_TOKENS,
    }
    assert lines[0] == 'step 0 phaseEnergyJoules {"generation": 1.5, "training": 2.0}'
    assert clock.now == pytest.approx(2 * 2 * 0.1)


@pytest.mark.parametrize(("steps", "phase_s"), [(0, 1.0), (1, 0.0), (-1, -1.0)])
def test_bad_arguments(steps: int, phase_s: float) -> None:
    with pytest.raises(ValueError, match="steps must be"):
        smoke.run_steps(Recorder(Clock()), steps, phase_s)


def test_wait_for_agent_retries_unreachable_and_503_then_answers() -> None:
    clock = Clock()
    client = Recorder(
        clock, [ConnectionRefusedError("no agent"), trainer.AgentRefusedError(503, "no API")]
    )
    smoke.wait_for_agent(client, 10.0, clock=clock, sleep=clock.sleep)
    assert client.calls[-1][:3] == ("phase", "idle", 0)
    assert clock.now == pytest.approx(2.0)


def test_wait_for_agent_gives_up_at_the_deadline_and_never_retries_a_refusal() -> None:
    clock = Clock()
    client = Recorder(clock, [ConnectionRefusedError("no agent")] * 10)
    with pytest.raises(ConnectionRefusedError):
        smoke.wait_for_agent(client, 3.0, clock=clock, sleep=clock.sleep)
    assert clock.now == pytest.approx(3.0)
    refused = Recorder(clock, [trainer.AgentRefusedError(401, "no token")])
    with pytest.raises(trainer.AgentRefusedError):
        smoke.wait_for_agent(refused, 30.0, clock=clock, sleep=clock.sleep)
