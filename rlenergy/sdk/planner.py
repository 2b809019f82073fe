"""FlexFloor's planner inside the rollout dispatcher's process: placement, releases, rounds.

The dispatcher (verl's rollout manager, or any loop that hands prompts to engine replicas and
DP ranks) owns one ``RolloutPlanner`` and calls it directly, with no server in between:

* ``place(request)`` before a batch: every response of every prompt gets an EP rank
  (``PlacementResponse``), dealt longest predicted first so that the lock-stepped ranks
  carry equal loads at every decode step and kept within each rank's KV budget
  (``placement.place_lockstep_within``, the simulator's rule, over the predictor's
  per-prompt lengths), unless the guard (``placement.lockstep_makespan_s``) predicts the
  even split (verl's ``DataProto.chunk``, kept within the budgets too) to end no later;
  ``assign(prompt_ids, prompt_tokens, servers)`` is the same rule as a plain list of server
  indices, for a dispatcher's hook (``assignment``: with the ``queued`` flags and predicted
  lengths; verl's request router, ``rlenergy.sdk.verl_placement``, calls it);
* ``progress(reports)`` while decoding: the newest ``ProgressReport`` per active rank; returns
  a ``ReleaseDecision`` when the release rule (``release.FlexFloorPlanner``) lets finished
  ranks go, and opens its round;
* ``acknowledge(ack)`` per rank, and ``poll(step)`` at each decode step or timer tick: the
  round's ``ReleaseOutcome`` once decided. The ack deadline is both a decode step
  (``ackDeadlineStep``) and a wall-clock time (``ack_timeout_s``): a hung collective takes no
  decode step, so only the clock ends its round (``Aborted``, group unchanged);
* ``rank_lost(rank, reason)`` when a rank disappears without a plan (its pod deleted or
  preempted): any open round aborts at once (it would wait on the dead rank), the rank leaves
  the group, and the returned ``RankLoss`` says to tear the engine group down abort-style
  (no graceful destroy that waits on a collective with the dead rank);
* ``observe(prompt_ids, lengths)`` after the step: the predictor learns the lengths;
* ``follow_engine(...)`` once the engine adapter probed its engine (the release floor rises to
  the engine's; an engine that cannot shrink stops releases), and ``stop_releases(reason)``
  when the engine refused a resize for good (``rollout.failure_of`` -> ``EngineDegraded``).

Decisions go to the engines through ``rlenergy.sdk.rollout.apply_release`` (an
``ElasticEngine``: ``rlenergy.sdk.engines``), and a released rank parks its GPUs through its
node agent (``rollout.park_if_released``); the dispatcher publishes the next step's worker
count for the operator's scale (``trainer.RLEnergyClient.publish_rollout``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence

from rlenergy import errors
from rlenergy.api import rollout as api
from rlenergy.control.moe import base, placement, predictor, protocol, release


@dataclasses.dataclass(frozen=True)
class RankLoss:
    """What the dispatcher must do after a rank was lost without a plan.

    Attributes:
        rank: the lost EP rank.
        reason: why (for the log and the policy's Degraded condition).
        aborted: the outcome of the round that was open, aborted (``None``: none was open).
        active_workers: the ranks left, ascending.
        reload: expert -> survivor rank for the experts only the lost rank hosted (per its
            newest report): the restart loads them from the weights, each onto the survivor
            hosting the fewest experts then (ties: the lowest rank). Empty when the survivors
            host them all, or the lost rank never reported.
        unbalanced: the survivors then host unequal expert counts (the placement is
            temporarily unbalanced until the engine group is rebalanced).
        teardown: always ``True``: the engine group must be torn down abort-style (its
            collectives include the dead rank) and restarted with ``active_workers``.
    """

    rank: int
    reason: str
    aborted: api.ReleaseOutcome | None
    active_workers: tuple[int, ...]
    reload: dict[int, int] = dataclasses.field(default_factory=dict)
    unbalanced: bool = False
    teardown: bool = True


class RolloutPlanner:
    """The pure FlexFloor planner with the state one rollout needs, in-process.

    Args:
        layout: the EP group's memory layout (experts, bytes, ``minActiveWorkers``).
        finish_model: one rank's decode-time model (fit ``step_fixed_s`` and ``kv_s_per_byte``
            to two measured decode-step times: empty and full KV cache); the placement
            guard's step cost.
        cost_model: decode-step model for the release guard; ``None``: the rule alone.
        timing: the round's deadlines in decode steps.
        ack_timeout_s: wall-clock ack deadline of a round, s (> 0).
        length_predictor: per-prompt length history (default: 3 epochs, median fallback).
        clock: monotonic seconds (injected for tests).

    Raises:
        InvalidInputError: ``ack_timeout_s <= 0``.
    """

    def __init__(
        self,
        layout: base.MoeLayout,
        finish_model: placement.FluidFinishModel,
        *,
        cost_model: base.StepCostModel | None = None,
        timing: protocol.ProtocolTiming | None = None,
        ack_timeout_s: float = 30.0,
        length_predictor: predictor.LengthPredictor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ack_timeout_s <= 0:
            raise errors.InvalidInputError("ack_timeout_s", "must be > 0 s")
        self.layout = layout
        self.finish_model = finish_model
        self.timing = timing or protocol.ProtocolTiming()
        self.ack_timeout_s = ack_timeout_s
        self.predictor = length_predictor or predictor.LengthPredictor()
        self._cost_model = cost_model
        self._release = release.FlexFloorPlanner(layout, cost_model)
        self._clock = clock
        self._rollout_id = ""
        self._active: tuple[int, ...] = ()
        self._reports: dict[int, api.ProgressReport] = {}
        self._round: protocol.ReleaseRound | None = None
        self._round_deadline_s = 0.0
        self._next_id = 0
        self._stopped: str | None = None

    def stop_releases(self, reason: str) -> None:
        """Release no rank again in this planner's life (``progress`` returns ``None``).

        For an engine that refused a resize for good (``rollout.failure_of`` ->
        ``EngineDegraded``): asking it again would only repeat the refusal.
        """
        self._stopped = reason

    def follow_engine(self, can_shrink: bool, floor_ranks: int, refusal: str | None) -> None:
        """Plan only releases the engine accepts (its probed capabilities).

        An engine that cannot shrink stops releases (``stop_releases``); otherwise the release
        floor rises to the engine's (``layout.min_active_workers``), so the rule never decides
        a shrink the adapter would refuse at prepare (vLLM's EPLB floor: DP >= 2 at TP = 1).

        Args:
            can_shrink: ``EngineCapabilities.can_shrink``.
            floor_ranks: ``EngineCapabilities.floor_ranks`` (>= 1).
            refusal: ``EngineCapabilities.refusal`` (why it cannot shrink).
        """
        if not can_shrink:
            self.stop_releases(refusal or "the engine cannot shrink")
            return
        if floor_ranks > self.layout.min_active_workers:
            self.layout = dataclasses.replace(self.layout, min_active_workers=floor_ranks)
            self._release = release.FlexFloorPlanner(self.layout, self._cost_model)

    @property
    def releases_stopped(self) -> str | None:
        """Why releases were stopped (``stop_releases``), or ``None``."""
        return self._stopped

    @property
    def active_workers(self) -> tuple[int, ...]:
        """The EP group as the planner knows it (after committed releases), ascending."""
        return self._active

    def place(
        self,
        request: api.PlacementRequest,
        *,
        kv_budget_bytes: Sequence[int] | None = None,
    ) -> api.PlacementResponse:
        """Place every response of the batch on the request's active ranks, within memory.

        Args:
            request: the batch and the active ranks.
            kv_budget_bytes: KV memory per active rank (ascending rank order), bytes; ``None``:
                ``layout.kv_budget_bytes(len(request.workers))`` (even expert shards).

        Returns:
            One ``Assignment`` per response (prompt order, then response index); ``queued``
            marks a response whose predicted peak KV fits no rank's budget left (the engine
            admits it when memory frees).

        Raises:
            InvalidInputError: ``kv_budget_bytes`` does not have one entry per active rank.
        """
        self._rollout_id = request.rollout_id
        self._active = tuple(sorted(request.workers))
        self._reports = {}
        self._round = None
        ids: list[str] = []
        prompts: list[int] = []
        index: list[int] = []
        for p in request.prompts:
            for k in range(p.responses):
                ids.append(p.prompt_id)
                prompts.append(p.prompt_tokens)
                index.append(k)
        chosen, lengths = self._place(ids, prompts, len(self._active), kv_budget_bytes)
        return api.PlacementResponse.model_validate(
            {
                "rolloutId": request.rollout_id,
                "assignments": [
                    {
                        "promptId": ids[i],
                        "responseIndex": index[i],
                        "worker": self._active[chosen.worker_of[i]],
                        "predictedTokens": lengths[i],
                        "queued": chosen.queued[i],
                    }
                    for i in range(len(ids))
                ],
            }
        )

    def assign(
        self,
        prompt_ids: Sequence[Hashable],
        prompt_tokens: Sequence[int],
        servers: int,
        *,
        kv_budget_bytes: Sequence[int] | None = None,
    ) -> list[int]:
        """Which rollout server decodes each sample: the call-in for a dispatcher's hook.

        The rule is ``place``'s (``placement.place_lockstep_within`` over the predictor's
        per-prompt lengths, the even split when the guard predicts it ends no later), with
        the servers as the ranks. It leaves the release state (rounds, reports) alone.

        Args:
            prompt_ids: per sample, its prompt's stable id (the samples of one GRPO group
                repeat it), shape ``(n,)``.
            prompt_tokens: per sample, its prompt length, tokens, shape ``(n,)``.
            servers: rollout servers (engine replicas or DP ranks), >= 1.
            kv_budget_bytes: KV memory per server, bytes, shape ``(servers,)``; ``None``:
                ``layout.kv_budget_bytes(servers)``.

        Returns:
            Server index (``0 .. servers - 1``) per sample, shape ``(n,)``.

        Raises:
            InvalidInputError: ``servers < 1``, inputs of different lengths, or
                ``kv_budget_bytes`` without one entry per server.
        """
        chosen, _ = self.assignment(
            prompt_ids, prompt_tokens, servers, kv_budget_bytes=kv_budget_bytes
        )
        return list(chosen.worker_of)

    def assignment(
        self,
        prompt_ids: Sequence[Hashable],
        prompt_tokens: Sequence[int],
        servers: int,
        *,
        kv_budget_bytes: Sequence[int] | None = None,
    ) -> tuple[placement.Placement, list[float]]:
        """``assign`` with what a router reports: the placement and the predicted lengths.

        Returns:
            The ``Placement`` (server per sample, ``queued`` per sample, predicted peak KV per
            server, bytes) and the predicted response length per sample, tokens, shape
            ``(n,)``.

        Raises:
            InvalidInputError: as ``assign``.
        """
        if servers < 1:
            raise errors.InvalidInputError("servers", "need at least one rollout server")
        if len(prompt_tokens) != len(prompt_ids):
            raise errors.InvalidInputError("prompt_tokens", "need one prompt length per sample")
        return self._place(list(prompt_ids), list(prompt_tokens), servers, kv_budget_bytes)

    def _place(
        self,
        ids: Sequence[Hashable],
        prompts: Sequence[int],
        ranks: int,
        kv_budget_bytes: Sequence[int] | None,
    ) -> tuple[placement.Placement, list[float]]:
        budgets = (
            list(kv_budget_bytes)
            if kv_budget_bytes is not None
            else list(self.layout.kv_budget_bytes(ranks))
        )
        if len(budgets) != ranks:
            raise errors.InvalidInputError(
                "kv_budget_bytes", f"need one KV budget per rank ({ranks}), got {len(budgets)}"
            )
        lengths = [m.length_tokens for m in self.predictor.predict(ids)]
        kvb = self.layout.kv_bytes_per_token
        dealt = placement.place_lockstep_within(lengths, prompts, budgets, kvb)
        even = placement.fit_kv_budget(
            placement.place_even(len(ids), ranks), lengths, prompts, budgets, kvb
        )
        cost = [
            placement.lockstep_makespan_s(
                option.worker_of, lengths, prompts, ranks, self.finish_model
            )
            for option in (dealt, even)
        ]
        return (dealt if cost[0] <= cost[1] else even), lengths  # ties: dealt

    def progress(self, reports: Sequence[api.ProgressReport]) -> api.ReleaseDecision | None:
        """Take the ranks' newest reports; a release decision when finished ranks may go.

        No decision while a round is open, before every active rank reported, or when the
        rule (or guard) releases nobody.

        Raises:
            InvalidInputError: a report of another rollout.
        """
        for r in reports:
            if r.rollout_id != self._rollout_id:
                raise errors.InvalidInputError(
                    "rolloutId", f"report for {r.rollout_id!r}, planning {self._rollout_id!r}"
                )
            old = self._reports.get(r.worker)
            if old is None or r.decode_step >= old.decode_step:
                self._reports[r.worker] = r
        if self._stopped is not None or self._round is not None:
            return None
        if any(w not in self._reports for w in self._active):
            return None
        states = [
            base.WorkerState(
                worker=w,
                experts=frozenset(self._reports[w].experts),
                unfinished=self._reports[w].unfinished,
                kv_bytes=self._reports[w].kv_bytes,
                kv_reserved_bytes=self._reports[w].kv_reserved_bytes,
            )
            for w in self._active
        ]
        step = max(self._reports[w].decode_step for w in self._active)
        plan = self._release.plan(states, step)
        if not plan.release:
            return None
        decision = protocol.make_decision(
            plan,
            decision_id=self._next_id,
            active_before=self._active,
            step=step,
            timing=self.timing,
        )
        self._next_id += 1
        self._round = protocol.ReleaseRound(decision)
        self._round_deadline_s = self._clock() + self.ack_timeout_s
        return api.ReleaseDecision.model_validate(
            {
                "rolloutId": self._rollout_id,
                "decisionId": decision.decision_id,
                "release": list(decision.release),
                "moves": [
                    {"expert": m.expert, "source": m.source, "target": m.target}
                    for m in decision.moves
                ],
                "activeBefore": list(decision.active_before),
                "decidedAtStep": decision.decided_at_step,
                "ackDeadlineStep": decision.ack_deadline_step,
                "applyAtStep": decision.apply_at_step,
            }
        )

    def acknowledge(self, ack: api.ReleaseAck) -> api.ReleaseOutcome | None:
        """Record a rank's ack (``ok: false`` aborts); the outcome once the round is decided."""
        r = self._round
        if r is None or ack.decision_id != r.decision.decision_id:
            return None
        if not ack.ok:
            r.refuse(ack.worker, ack.reason or "refused")
        else:
            r.ack(ack.worker, ack.decision_id)
        return self._decided()

    def poll(self, decode_step: int | None = None) -> api.ReleaseOutcome | None:
        """Advance the open round to ``decode_step`` and the clock; its outcome when decided.

        A round whose acks are missing when the group reaches ``ackDeadlineStep`` or when
        ``ack_timeout_s`` has passed since the decision aborts (group unchanged).
        """
        r = self._round
        if r is None:
            return None
        if decode_step is not None:
            r.advance(decode_step)
        if r.status is protocol.RoundStatus.PENDING and self._clock() >= self._round_deadline_s:
            r.refuse(
                r.missing[0],
                f"ranks {list(r.missing)} did not acknowledge release "
                f"{r.decision.decision_id} within {self.ack_timeout_s:g} s",
            )
        return self._decided()

    def rank_lost(self, rank: int, reason: str) -> RankLoss:
        """A rank left without a plan (pod deleted, preempted): abort, drop it, tear down.

        Raises:
            InvalidInputError: ``rank`` is not in the group.
        """
        if rank not in self._active:
            raise errors.InvalidInputError(
                "rank", f"rank {rank} is not in the group {list(self._active)}"
            )
        aborted = None
        r = self._round
        if r is not None and r.status is protocol.RoundStatus.PENDING:
            r.refuse(rank, f"rank {rank} lost: {reason}")
            aborted = self._decided()
        self._round = None
        self._active = tuple(w for w in self._active if w != rank)
        lost = self._reports.pop(rank, None)
        hosted = {w: set(self._reports[w].experts) for w in self._active if w in self._reports}
        reload: dict[int, int] = {}
        if lost is not None and hosted:
            kept = set().union(*hosted.values())
            for expert in sorted(set(lost.experts) - kept):
                target = min(hosted, key=lambda w: (len(hosted[w]), w))
                hosted[target].add(expert)
                reload[expert] = target
        counts = {len(e) for e in hosted.values()}
        return RankLoss(rank, reason, aborted, self._active, reload, len(counts) > 1)

    def observe(self, prompt_ids: Sequence[Hashable], lengths_tokens: Sequence[float]) -> None:
        """After the step: response ``i`` of prompt ``prompt_ids[i]`` had ``lengths_tokens[i]``.

        Raises:
            InvalidInputError: as ``LengthPredictor.observe_step``.
        """
        self.predictor.observe_step(prompt_ids, lengths_tokens)

    def _decided(self) -> api.ReleaseOutcome | None:
        r = self._round
        if r is None or r.status is protocol.RoundStatus.PENDING:
            return None
        self._round = None
        if r.status is protocol.RoundStatus.COMMITTED:
            self._active = r.decision.active_after
            for w in r.decision.release:
                self._reports.pop(w, None)
            status, reason = "Committed", None
        else:
            status, reason = "Aborted", r.abort_reason
        return api.ReleaseOutcome.model_validate(
            {
                "rolloutId": self._rollout_id,
                "decisionId": r.decision.decision_id,
                "status": status,
                "activeWorkers": list(self._active),
                "reason": reason,
            }
        )
