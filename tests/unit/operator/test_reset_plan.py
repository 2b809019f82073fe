"""``jobloop.reset_plan``: the plan a deleted policy leaves for its agents (every phase back to
the default governor, nothing enforced) and when none is needed. Written against the 56
mutants of ``reset_plan`` that no unit test reached (docs/mutation.md)."""

from __future__ import annotations

from typing import Any

import pytest
from rlenergy_operator import jobloop

from rlenergy.api import node as api_node

AT = "2026-12-02T05:00:00Z"


def _published(**kw: Any) -> dict[str, Any]:
    plan = {
        "step": 17,
        "policyGeneration": 3,
        "enforce": True,
        "phases": [
            {"phase": "generation", "clockMHz": 1305, "state": "locked"},
            {"phase": "training", "clockMHz": None, "state": "trial"},
        ],
    }
    plan.update(kw)
    return plan


def test_a_locked_plan_is_reset_phase_by_phase_at_its_own_step() -> None:
    plan = jobloop.reset_plan(_published(), generation=4, issued_at=AT)
    assert plan == api_node.ClockPlan(
        step=17,
        policy_generation=4,
        enforce=False,
        phases=[
            api_node.PhasePlan(
                phase=name,
                clock_mhz=None,
                state="fallback",
                reason="policy deleted: reset to default",
            )
            for name in ("generation", "training")
        ],
        issued_at=AT,
    )


@pytest.mark.parametrize(
    ("published", "needed"),
    [
        (_published(), True),  # enforced and locked
        (_published(enforce=False), True),  # observe mode, yet a clock is still published
        (_published(phases=[{"phase": "generation", "clockMHz": None}]), True),  # enforced
        (_published(enforce=False, phases=[{"phase": "generation", "clockMHz": None}]), False),
        (_published(enforce=False, phases=[]), False),
    ],
)
def test_a_reset_is_needed_while_anything_is_enforced_or_locked(
    published: dict[str, Any], needed: bool
) -> None:
    assert (jobloop.reset_plan(published, generation=1, issued_at=AT) is not None) is needed


def test_a_policy_that_never_published_a_plan_still_gets_a_reset_at_step_0() -> None:
    # No status.plan yet: enforcement is assumed (the default), no phase is named.
    plan = jobloop.reset_plan({}, generation=2, issued_at=AT)
    assert plan is not None
    assert (plan.step, plan.policy_generation, plan.enforce, plan.phases) == (0, 2, False, [])
    assert plan.issued_at == AT
    # A step the status left null counts as 0, a phase without a name as "".
    odd = jobloop.reset_plan({"step": None, "phases": [{"clockMHz": 1200}]}, 2, AT)
    assert odd is not None and odd.step == 0 and [p.phase for p in odd.phases] == [""]
