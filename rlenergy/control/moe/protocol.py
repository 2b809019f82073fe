"""Step-synchronous commit of a release: every rank leaves at the same decode step, or none.

A rank that drops a peer from the all-to-all one step before the others hangs the collectives (case
#26 in docs/troubleshooting.md: DP skew past the NCCL timeout). So a release is a two-phase round:

1. the planner's ``ReleasePlan`` becomes a ``ReleaseDecision`` at decode step ``s0``, naming
   ``ack_deadline_step = s0 + ack_window_steps`` and ``apply_at_step = ack_deadline_step +
   apply_margin_steps``;
2. every rank of the current group loads the expert copies it receives, then acknowledges;
3. all acks in before the deadline: the round commits, and from ``apply_at_step`` on every
   rank runs without the released workers. A rank still missing when the group reaches the
   deadline (or a rank that refuses) aborts the round: nobody leaves, copied experts are
   dropped, the group is exactly ``active_before``.

Ranks block at ``apply_at_step`` until they hold the commit or the abort, so a late message
costs a stall, never a split group. Pure: the caller feeds acks and decode steps.
"""

from __future__ import annotations

import dataclasses
import enum

from rlenergy import errors
from rlenergy.control.moe import base


@dataclasses.dataclass(frozen=True)
class ProtocolTiming:
    """Deadlines of a release round, in decode steps.

    Attributes:
        ack_window_steps: decode steps the ranks have to acknowledge (default 8: at 10-50 ms
            per decode step that is 0.1-0.4 s, ample for a control message; expert copies
            longer than that stall the group at the apply step) [MODEL].
        apply_margin_steps: decode steps between the deadline and the apply step, so the
            commit or abort reaches every rank first (default 2) [MODEL].
    """

    ack_window_steps: int = 8
    apply_margin_steps: int = 2

    def __post_init__(self) -> None:
        if self.ack_window_steps < 1 or self.apply_margin_steps < 1:
            raise errors.InvalidInputError(
                "rollout.releaseTiming", "ack window and apply margin must be >= 1 decode step"
            )


def make_decision(
    plan: base.ReleasePlan,
    *,
    decision_id: int,
    active_before: tuple[int, ...],
    step: int,
    timing: ProtocolTiming,
) -> base.ReleaseDecision:
    """Turn a plan made at decode ``step`` into a decision with its deadline and apply step.

    Raises:
        InvalidInputError: the plan releases nobody, or a worker outside ``active_before``.
    """
    if not plan.release:
        raise errors.InvalidInputError("release", "the plan releases no worker")
    outside = set(plan.release) - set(active_before)
    if outside:
        raise errors.InvalidInputError("release", f"workers {sorted(outside)} are not active")
    deadline = step + timing.ack_window_steps
    return base.ReleaseDecision(
        decision_id=decision_id,
        release=plan.release,
        moves=plan.moves,
        active_before=tuple(sorted(active_before)),
        decided_at_step=step,
        ack_deadline_step=deadline,
        apply_at_step=deadline + timing.apply_margin_steps,
    )


class RoundStatus(enum.Enum):
    """Where a release round stands."""

    PENDING = "Pending"
    COMMITTED = "Committed"
    ABORTED = "Aborted"


class ReleaseRound:
    """The two-phase commit of one ``ReleaseDecision`` (see module docstring).

    Args:
        decision: the decision every rank of ``decision.active_before`` must acknowledge.
    """

    def __init__(self, decision: base.ReleaseDecision) -> None:
        self.decision = decision
        self.status = RoundStatus.PENDING
        self.abort_reason: str | None = None
        self._acked: set[int] = set()

    @property
    def missing(self) -> tuple[int, ...]:
        """Ranks that have not acknowledged yet, ascending."""
        return tuple(w for w in self.decision.active_before if w not in self._acked)

    def ack(self, worker: int, decision_id: int) -> bool:
        """Record a rank's acknowledgement.

        Returns:
            ``True`` when recorded; ``False`` for a stale or foreign ack (another decision id,
            a rank outside the group, or a round already decided), which changes nothing.
        """
        if (
            decision_id != self.decision.decision_id
            or worker not in self.decision.active_before
            or self.status is not RoundStatus.PENDING
        ):
            return False
        self._acked.add(worker)
        if not self.missing:
            self.status = RoundStatus.COMMITTED
        return True

    def refuse(self, worker: int, reason: str) -> None:
        """A rank cannot apply the release (e.g. an expert copy failed): abort the round."""
        if self.status is RoundStatus.PENDING:
            self.status = RoundStatus.ABORTED
            self.abort_reason = f"worker {worker} refused: {reason}"

    def advance(self, step: int) -> RoundStatus:
        """Tell the round the group reached decode ``step``; abort on a missed deadline."""
        if self.status is RoundStatus.PENDING and step >= self.decision.ack_deadline_step:
            self.status = RoundStatus.ABORTED
            self.abort_reason = (
                f"ranks {list(self.missing)} did not acknowledge release "
                f"{self.decision.decision_id} by decode step {self.decision.ack_deadline_step}"
            )
        return self.status

    def active_at(self, step: int) -> tuple[int, ...]:
        """The EP group that takes decode ``step``: smaller only once committed and applied."""
        if self.status is RoundStatus.COMMITTED and step >= self.decision.apply_at_step:
            return self.decision.active_after
        return self.decision.active_before
