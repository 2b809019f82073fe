"""A simulated elastic expert-parallel engine (``rlenergy.api.rollout.ElasticEngine``).

Used by the SDK tests and the demo in place of vLLM or SGLang: it keeps the EP group and each
rank's experts, validates a release with the FlexFloor rule (``release.FlexFloorPlanner``),
copies experts on commit, and can be told that a rank is unresponsive (its ack misses the
deadline, so the release must abort and the group stay whole). No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlenergy.api import rollout as api
from rlenergy.control.moe import base, release


class SimulatedElasticEngine:
    """In-memory EP group.

    Args:
        layout: the group's memory layout.
        experts_of: experts resident per rank (rank ``i`` holds ``experts_of[i]``).
        unresponsive: ranks that never acknowledge (fault injection).
    """

    def __init__(
        self,
        layout: base.MoeLayout,
        experts_of: Iterable[Iterable[int]],
        *,
        unresponsive: Iterable[int] = (),
    ) -> None:
        self.layout = layout
        self.experts_of = {r: set(es) for r, es in enumerate(experts_of)}
        self._active = tuple(sorted(self.experts_of))
        self.unresponsive = set(unresponsive)
        self._prepared: dict[int, api.ReleaseDecision] = {}

    def active_ranks(self) -> tuple[int, ...]:
        """EP ranks in the group now, ascending."""
        return self._active

    def _states(self) -> list[base.WorkerState]:
        return [
            base.WorkerState(
                worker=r, experts=frozenset(self.experts_of[r]), unfinished=0, kv_bytes=0
            )
            for r in self._active
        ]

    def prepare_release(self, decision: api.ReleaseDecision) -> api.ReleaseAck:
        """Validate the release; an unresponsive rank in the group makes the ack fail."""

        def refuse(reason: str) -> api.ReleaseAck:
            return api.ReleaseAck(
                rollout_id=decision.rollout_id,
                decision_id=decision.decision_id,
                worker=min(decision.active_before),
                ok=False,
                reason=reason,
            )

        if tuple(decision.active_before) != self._active:
            return refuse(f"group is {list(self._active)}, not {decision.active_before}")
        late = sorted(self.unresponsive & set(self._active))
        if late:
            return refuse(
                f"ranks {late} missed the ack deadline at step {decision.ack_deadline_step}"
            )
        # The moves the decision names must make the release legal.
        moved = {r: set(es) for r, es in self.experts_of.items()}
        for move in decision.moves:
            moved[move.target].add(move.expert)
        states = [
            base.WorkerState(worker=r, experts=frozenset(moved[r]), unfinished=0, kv_bytes=0)
            for r in self._active
        ]
        plan = release.FlexFloorPlanner(self.layout).check(states, decision.release)
        if plan.refused:
            return refuse("; ".join(r.message for r in plan.refused))
        if plan.moves:
            return refuse(f"release orphans experts {[m.expert for m in plan.moves]}")
        self._prepared[decision.decision_id] = decision
        return api.ReleaseAck(
            rollout_id=decision.rollout_id,
            decision_id=decision.decision_id,
            worker=min(decision.active_before),
        )

    def commit_release(self, decision: api.ReleaseDecision) -> tuple[int, ...]:
        """Copy the experts and drop the released ranks."""
        prepared = self._prepared.pop(decision.decision_id, None)
        if prepared is None:
            raise ValueError(f"release {decision.decision_id} was not prepared")
        for move in decision.moves:
            self.experts_of[move.target].add(move.expert)
        self._active = tuple(decision.active_after)
        return self._active

    def abort_release(self, decision: api.ReleaseDecision) -> None:
        """Forget a prepared release; the group is unchanged."""
        self._prepared.pop(decision.decision_id, None)
