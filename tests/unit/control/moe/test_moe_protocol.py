"""Step-synchronous release rounds.

We test these aspects:
* all acks before the deadline: commit, applied at the same step for everyone;
* a rank missing the deadline: abort, the group stays exactly as before;
* a refusal aborts; stale or foreign acks change nothing.
"""

from __future__ import annotations

import pytest

from rlenergy import errors
from rlenergy.control.moe import base, protocol

TIMING = protocol.ProtocolTiming(4, 2)


def decision(active=(0, 1, 2, 3), rel=(3,), step=100, timing=TIMING):
    plan = base.ReleasePlan(release=rel, moves=(), refused=(), active_after=())
    return protocol.make_decision(
        plan, decision_id=7, active_before=active, step=step, timing=timing
    )


def test_deadline_and_apply_step():
    d = decision()
    assert (d.decided_at_step, d.ack_deadline_step, d.apply_at_step) == (100, 104, 106)
    assert d.active_after == (0, 1, 2)


def test_all_acks_commit_and_apply_at_the_same_step():
    r = protocol.ReleaseRound(decision())
    for w in (0, 1, 2, 3):
        assert r.ack(w, 7)
    assert r.advance(103) is protocol.RoundStatus.COMMITTED
    assert r.active_at(105) == (0, 1, 2, 3)
    assert r.active_at(106) == (0, 1, 2)


def test_missing_rank_aborts_at_deadline_and_group_is_unchanged():
    r = protocol.ReleaseRound(decision())
    for w in (0, 1, 3):
        r.ack(w, 7)
    assert r.advance(103) is protocol.RoundStatus.PENDING
    assert r.advance(104) is protocol.RoundStatus.ABORTED
    assert "[2]" in (r.abort_reason or "")
    assert r.active_at(1000) == (0, 1, 2, 3)
    assert not r.ack(2, 7), "a late ack must not revive an aborted round"
    assert r.status is protocol.RoundStatus.ABORTED


def test_refusal_aborts():
    r = protocol.ReleaseRound(decision())
    r.refuse(1, "expert copy failed")
    assert r.status is protocol.RoundStatus.ABORTED
    assert r.active_at(200) == (0, 1, 2, 3)


def test_stale_and_foreign_acks_are_ignored():
    r = protocol.ReleaseRound(decision())
    assert not r.ack(0, 6)
    assert not r.ack(9, 7)
    assert r.missing == (0, 1, 2, 3)


def test_bad_plans_are_refused():
    with pytest.raises(errors.InvalidInputError):
        decision(rel=())
    with pytest.raises(errors.InvalidInputError):
        decision(rel=(5,))
    with pytest.raises(errors.InvalidInputError):
        protocol.ProtocolTiming(0, 1)
