"""A policy that names verl's training sub-phases (``rlenergy.api.phases``): the job loop folds
each into its own ``status.phases[]`` entry, account and controller, on hand-written node reports
(``hand_reports``) whose figures are known exactly. (A real agent's windows from the verl hook:
``tests/unit/agent/test_subphases.py``.)

We test these aspects:
* each named sub-phase's energy and time are its windows' own, and nothing is booked to a phase
  the policy does not name; the job's totals are the sum over every window;
* a failed window of one sub-phase falls back that sub-phase alone;
* after warm-up each named sub-phase runs its own trial with slices cut from its own windows;
* a ``training`` window (a trainer before the agent's first answer) is its own prediction at the
  default governor, never a sub-phase's.
"""

from __future__ import annotations

import pytest
from hand_reports import Steps, Window, folded, report, spec
from rlenergy_operator import jobloop

AT = "2026-12-05T08:00:00Z"
NAMES = ["generation", "old-log-prob", "ref", "update-actor"]
PHASES = [{"name": n} for n in NAMES]


def _windows(gen_j: float, old_j: float, ref_j: float, upd_j: float) -> dict[str, Window]:
    return {
        "generation": (10.0, gen_j, None),
        "old-log-prob": (1.5, old_j, None),
        "ref": (1.0, ref_j, None),
        "update-actor": (4.0, upd_j, None),
    }


STEPS: Steps = {
    0: (1000.0, 100.0, _windows(3000.0, 450.0, 300.0, 1900.0)),
    1: (500.0, 50.0, _windows(2500.0, 420.0, 280.0, 2000.0)),
}


def test_each_named_sub_phase_folds_into_its_own_status() -> None:
    loop = folded("sync", STEPS, phases=PHASES)
    status = {p.name: p for p in loop.phase_status()}
    assert list(status) == NAMES
    assert set(loop.account.phases) == set(NAMES)
    for i, name in enumerate(NAMES):
        want_j = sum(STEPS[s][2][name][1] or 0.0 for s in STEPS)
        want_s = sum(STEPS[s][2][name][0] for s in STEPS)
        assert status[name].measured_joules == pytest.approx(want_j, rel=1e-12), name
        assert status[name].measured_seconds == pytest.approx(want_s, rel=1e-12), name
        assert status[name].state == "trial"  # two clean warm-up steps each
        # each sub-phase's own energy per valid token of the newest step (500 valid tokens)
        newest = STEPS[1][2][name][1] or 0.0
        assert status[name].energy_per_valid_token_joules == pytest.approx(newest / 500.0), i
    totals = loop.totals()
    windows_j = sum(w[1] or 0.0 for s in STEPS.values() for w in s[2].values())
    assert totals.measured_joules == pytest.approx(windows_j + 150.0, rel=1e-12)  # + idle


def test_a_failed_sub_phase_window_falls_back_that_sub_phase_alone() -> None:
    steps: Steps = {**STEPS, 1: (500.0, 50.0, {**STEPS[1][2], "ref": (1.0, 280.0, "NVML")})}
    loop = folded("sync", steps, phases=PHASES)
    status = {p.name: p for p in loop.phase_status()}
    assert status["ref"].state == "fallback"
    assert status["ref"].last_retrial_reason == "error: gpu-node-0: NVML"
    assert {n: status[n].state for n in NAMES if n != "ref"} == dict.fromkeys(
        ["generation", "old-log-prob", "update-actor"], "trial"
    )


def test_after_warm_up_each_named_sub_phase_runs_its_own_trial() -> None:
    loop = jobloop.JobLoop(spec(phases=PHASES), 1)
    for last in (0, 1):
        assert loop.advance([report({s: STEPS[s] for s in range(last + 1)})]) == [last]
    plan = loop.plan(AT)
    assert plan.step == 2
    assert [(p.phase, p.state) for p in plan.phases] == [(n, "trial") for n in NAMES]
    # probe slices cut from each phase's own last window (10, 1.5, 1, 4 s) into 48; the 1 s
    # ref window fits only 40 of the shortest slice (eerl.MIN_SLICE_S, 25 ms)
    assert [p.probe_slice_seconds for p in plan.phases] == [0.208333, 0.03125, 0.025, 0.083333]
    assert all(p.probe_clocks_mhz for p in plan.phases)


def test_a_training_window_is_not_booked_to_a_sub_phase() -> None:
    # Step 0's trainer had no agent answer yet: its log-prob and reference passes went out as
    # training, the update as update-actor (the agent's plan was known by then).
    first = {
        "generation": (10.0, 3000.0, None),
        "training": (2.5, 750.0, None),
        "update-actor": (4.0, 1900.0, None),
    }
    steps: Steps = {0: (1000.0, 100.0, first), 1: STEPS[1]}
    loop = folded("sync", steps, phases=PHASES)
    acc = loop.account.phases
    assert acc["training"].measured_joules == 750.0
    assert acc["old-log-prob"].measured_joules == 420.0  # step 1's window alone
    assert acc["ref"].measured_joules == 280.0
    assert [p.name for p in loop.phase_status()] == NAMES
