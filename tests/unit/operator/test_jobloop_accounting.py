"""``JobLoop`` accounting on hand-written node reports whose figures are known exactly.

Every window runs at the default governor, which is its own counterfactual
(``EERLController.default_equivalent``), so each running sum is a sum the test can write down:
sync steps last the sum of their phases, async steps (pools at once) their slowest phase;
energy per valid token is the phase's energy over the step's valid tokens; a window whose
prediction is unknown (an error) is measured but never compared, and its step is not a compared
step; an unknown energy makes an unknown-energy step each time; stalled time and energy are
measured, never compared; a window from another source than its phase's first default-governor
window is measured, not compared. Written against the mutmut survivors of ``_account``,
``_observe`` and ``_predict`` (docs/mutation.md).
"""

from __future__ import annotations

import pytest
from hand_reports import STEPS, Steps, folded


@pytest.mark.parametrize(("mode", "step_seconds"), [("sync", 14.0 + 13.0), ("async", 10.0 + 8.0)])
def test_default_governor_steps_add_up_exactly(mode: str, step_seconds: float) -> None:
    loop = folded(mode, STEPS)
    acc = loop.account
    assert (acc.steps, acc.compared_steps, acc.through_step) == (2, 2, 1)
    assert acc.valid_tokens == 1500.0
    assert acc.measured_joules == acc.compared_measured_joules == 5100.0 + 4750.0
    assert acc.predicted_default_joules == 9850.0
    assert acc.measured_seconds == acc.predicted_default_seconds == step_seconds
    gen, train = acc.phases["generation"], acc.phases["training"]
    assert (gen.measured_joules, gen.compared_measured_joules) == (5500.0, 5500.0)
    assert (gen.measured_seconds, gen.predicted_default_seconds) == (18.0, 18.0)
    assert train.predicted_default_joules == 4200.0
    # the last step's energy per valid token: 2500 J / 500 tokens, 2200 J / 500 tokens
    assert gen.energy_per_valid_token_joules == 5.0
    assert gen.predicted_default_energy_per_valid_token_joules == 5.0
    assert train.energy_per_valid_token_joules == 4.4
    totals = loop.totals()
    assert (totals.saved_joules, totals.saving_percent, totals.throughput_ratio) == (
        0.0,
        0.0,
        1.0,
    )


def test_an_unpredictable_window_is_measured_never_compared() -> None:
    steps = dict(STEPS)
    steps[2] = (0.0, 10.0, {"generation": (6.0, 1800.0, None), "training": (3.0, 900.0, "NVML")})
    loop = folded("sync", steps)
    acc = loop.account
    assert (acc.steps, acc.compared_steps) == (3, 2)
    assert acc.measured_joules == 9850.0 + 2710.0
    assert acc.compared_measured_joules == acc.predicted_default_joules == 9850.0
    assert acc.measured_seconds == 27.0
    train = acc.phases["training"]
    assert train.measured_joules == 4200.0 + 900.0
    assert train.compared_measured_joules == train.predicted_default_joules == 4200.0
    assert train.measured_seconds == 9.0
    gen = acc.phases["generation"]
    assert gen.compared_measured_joules == 5500.0 + 1800.0  # its own window still compares
    # no valid tokens in the step: no energy per token (never a division by zero)
    assert gen.energy_per_valid_token_joules is None
    assert gen.predicted_default_energy_per_valid_token_joules is None


def test_every_unknown_energy_step_is_counted() -> None:
    steps = dict(STEPS)
    for step in (2, 3):
        steps[step] = (
            400.0,
            10.0,
            {"generation": (6.0, None, None), "training": (3.0, 900.0, None)},
        )
    loop = folded("sync", steps)
    acc = loop.account
    assert (acc.steps, acc.unknown_energy_steps, acc.compared_steps) == (4, 2, 2)
    assert acc.measured_joules == 9850.0  # an unknown step adds nothing, never 0 as known
    assert acc.valid_tokens == 1500.0 + 800.0
    assert acc.phases["generation"].energy_per_valid_token_joules is None
    assert acc.phases["training"].energy_per_valid_token_joules == 900.0 / 400.0


def test_stalled_time_and_energy_are_measured_never_compared() -> None:
    # Step 2: generation stalled 0.5 s (40 J of its 1800 J); step 3: training stalled 2 s (30 J).
    steps = dict(STEPS)
    steps[2] = (400.0, 10.0, {"generation": (6.5, 1800.0, None), "training": (3.0, 900.0, None)})
    steps[3] = (400.0, 10.0, {"generation": (6.0, 1700.0, None), "training": (5.0, 930.0, None)})
    extra = {
        (2, "generation"): {"stalled_seconds": 0.5, "stalled_energy_joules": 40.0},
        (3, "training"): {"stalled_seconds": 2.0, "stalled_energy_joules": 30.0},
    }
    acc = folded("sync", steps, extra=extra).account
    assert (acc.stalled_seconds, acc.stalled_joules) == (2.5, 70.0)
    assert (acc.compared_steps, acc.unknown_energy_steps) == (4, 0)
    # measured: every joule; compared: the unstalled windows (and idle energy) only
    assert acc.measured_joules == 9850.0 + 2710.0 + 2640.0
    assert acc.compared_measured_joules == acc.predicted_default_joules == 9850.0 + 2670.0 + 2610.0
    assert acc.measured_seconds == 27.0 + 9.0 + 9.0  # the stalled seconds taken out
    # A stall whose energy is unknown makes its step's energy unknown.
    extra[(4, "training")] = {"stalled_seconds": 1.0, "stalled_energy_joules": None}
    steps[4] = (400.0, 10.0, {"generation": (6.0, 1700.0, None), "training": (4.0, 900.0, None)})
    more = folded("sync", steps, extra=extra).account
    assert (more.unknown_energy_steps, more.stalled_seconds) == (1, 3.5)
    assert more.measured_joules == acc.measured_joules


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_step_without_phase_windows_adds_its_idle_energy_and_no_time(mode: str) -> None:
    # The trainer ended step 2 without signalling a phase: only the idle energy was measured.
    steps: Steps = {**STEPS, 2: (300.0, 60.0, {})}
    loop = folded(mode, steps)
    acc = loop.account
    assert (acc.steps, acc.compared_steps, acc.stalled_seconds) == (3, 3, 0.0)
    assert acc.measured_joules == acc.predicted_default_joules == 9850.0 + 60.0
    assert (
        acc.measured_seconds == acc.predicted_default_seconds == (27.0 if mode == "sync" else 18.0)
    )
    assert acc.valid_tokens == 1800.0


def test_energy_per_valid_token_of_a_one_token_step() -> None:
    steps: Steps = {0: (1.0, 0.0, {"generation": (2.0, 30.0, None), "training": (1.0, 12.0, None)})}
    gen = folded("sync", steps).account.phases["generation"]
    assert gen.energy_per_valid_token_joules == gen.predicted_default_energy_per_valid_token_joules
    assert gen.energy_per_valid_token_joules == 30.0


def test_the_basis_source_is_the_first_default_window_with_known_energy() -> None:
    # Generation's first windows are no basis: a requested clock (step 0), an error (step 1),
    # an unknown energy (step 2), all from the power sensor; the counter window of step 3 is.
    # Step 4's power window is then measured, not compared (like with like).
    steps: Steps = {
        0: (500.0, 0.0, {"generation": (8.0, 2500.0, None), "training": (5.0, 2200.0, None)}),
        1: (500.0, 0.0, {"generation": (8.0, 2500.0, "NVML"), "training": (5.0, 2200.0, None)}),
        2: (500.0, 0.0, {"generation": (8.0, None, None), "training": (5.0, 2200.0, None)}),
        3: (500.0, 0.0, {"generation": (8.0, 2400.0, None), "training": (5.0, 2100.0, None)}),
        4: (500.0, 0.0, {"generation": (7.0, 2000.0, None), "training": (5.0, 2100.0, None)}),
        5: (500.0, 0.0, {"generation": (7.0, 2000.0, None), "training": (5.0, 2100.0, None)}),
    }
    power = {"energy_source": "power"}
    extra = {
        (0, "generation"): {**power, "requested_clock_mhz": 1500, "applied_clock_mhz": 1500},
        (1, "generation"): power,
        (2, "generation"): power,
        (4, "generation"): power,
        (5, "generation"): power,
    }
    loop = folded("sync", steps, extra=extra)
    acc = loop.account
    assert loop.basis_source == {"generation": "counter", "training": "counter"}
    assert acc.source_mismatch_steps == 2
    gen = acc.phases["generation"]
    assert gen.compared_measured_joules == gen.predicted_default_joules == 2400.0
    assert gen.measured_joules == 2500.0 * 2 + 2400.0 + 2000.0 * 2


def test_a_phase_the_policy_does_not_name_is_its_own_prediction_at_the_default_governor() -> None:
    # The trainer signals a "reward" phase the policy does not list: no controller knows it, so
    # its default-governor windows are their own prediction and its failed window is unknown.
    steps: Steps = {
        s: (500.0, 0.0, {"generation": (8.0, 2500.0, None), "reward": (2.0, 300.0, None)})
        for s in (0, 1, 2, 3)
    }
    steps[2] = (500.0, 0.0, {"generation": (8.0, 2500.0, None), "reward": (2.0, 300.0, "NVML")})
    extra = {(3, "reward"): {"requested_clock_mhz": 1500}}
    loop = folded("sync", steps, extra=extra, phases=[{"name": "generation"}])
    acc = loop.account
    assert set(acc.phases) == {"generation", "reward"}
    reward = acc.phases["reward"]
    assert reward.basis_energy_source == "counter"
    assert reward.measured_joules == 1200.0
    assert reward.compared_measured_joules == reward.predicted_default_joules == 600.0
    assert (acc.steps, acc.compared_steps) == (4, 2)
    assert acc.predicted_default_seconds == 20.0
