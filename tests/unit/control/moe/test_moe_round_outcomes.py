"""Release rounds in detail: what a decision carries and why a round aborted.

We test these aspects:
* a decision carries the plan's expert copies (every rank loads them before the apply step);
* a round has no abort reason while pending or once committed; a refusal and a missed
  deadline say who and why, in full.
"""

from __future__ import annotations

from rlenergy.control.moe import base, protocol


def decision() -> base.ReleaseDecision:
    plan = base.ReleasePlan(
        release=(3,),
        moves=(base.ExpertMove(6, 3, 0), base.ExpertMove(7, 3, 1)),
        refused=(),
        active_after=(0, 1, 2),
    )
    return protocol.make_decision(
        plan, decision_id=7, active_before=(3, 1, 2, 0), step=100, timing=protocol.ProtocolTiming()
    )


def test_a_decision_carries_the_copies_and_the_default_timing():
    d = decision()
    assert d.moves == (base.ExpertMove(6, 3, 0), base.ExpertMove(7, 3, 1))
    assert d.active_before == (0, 1, 2, 3)
    # Default timing: 8 steps to acknowledge, 2 more before the apply step.
    assert (d.ack_deadline_step, d.apply_at_step) == (108, 110)


def test_abort_reasons_in_full():
    r = protocol.ReleaseRound(decision())
    assert r.abort_reason is None
    r.ack(0, 7)
    r.ack(1, 7)
    assert r.advance(107) is protocol.RoundStatus.PENDING and r.abort_reason is None
    assert r.advance(108) is protocol.RoundStatus.ABORTED
    assert r.abort_reason == "ranks [2, 3] did not acknowledge release 7 by decode step 108"
    refused = protocol.ReleaseRound(decision())
    refused.refuse(1, "expert copy failed")
    assert refused.abort_reason == "worker 1 refused: expert copy failed"
    refused.refuse(2, "later")  # the round is decided: the first reason stands
    assert refused.abort_reason == "worker 1 refused: expert copy failed"
    done = protocol.ReleaseRound(decision())
    for w in (0, 1, 2, 3):
        done.ack(w, 7)
    assert done.status is protocol.RoundStatus.COMMITTED and done.abort_reason is None
    assert done.advance(200) is protocol.RoundStatus.COMMITTED
