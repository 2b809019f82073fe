"""The conditions one handler pass writes, bound once to the pass's generation and time.

A pass reads ``status.conditions``, sets some of them and writes the merged list back;
``PassConditions`` holds what every ``builders.condition`` call of that pass shares (the
previous list, ``metadata.generation``, now), so a handler names only type, status, reason and
message. Pure: no kopf, no Kubernetes client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlenergy.api.v1alpha1 import status as api_status
from rlenergy_operator import builders


class PassConditions:
    """The conditions of one pass.

    Args:
        previous: ``status.conditions`` as the pass read it (None: none yet).
        generation: ``metadata.generation`` the pass acts on.
        now: RFC 3339 time of the pass (``lastTransitionTime`` of a changed condition).
    """

    def __init__(
        self, previous: Sequence[Mapping[str, Any]] | None, *, generation: int, now: str
    ) -> None:
        self.previous = [dict(c) for c in previous or ()]
        self.generation = generation
        self.now = now
        self._updates: list[dict[str, Any]] = []

    def condition(
        self, type_: api_status.ConditionType, status: bool, reason: str, message: str
    ) -> None:
        """Set one condition (``builders.condition``: its time moves only on a change)."""
        self._updates.append(
            builders.condition(
                type_,
                status,
                reason,
                message,
                generation=self.generation,
                now=self.now,
                previous=self.previous,
            )
        )

    def previous_of(self, type_: api_status.ConditionType) -> Mapping[str, Any] | None:
        """The condition of that type as the pass read it, if any."""
        return next((c for c in self.previous if c.get("type") == type_), None)

    def was_true(self, type_: api_status.ConditionType) -> bool:
        """Whether the condition was True before this pass."""
        old = self.previous_of(type_)
        return old is not None and old.get("status") == "True"

    def merged(self) -> list[dict[str, Any]]:
        """The previous list with this pass's conditions replacing their types (fixed order)."""
        return builders.merge_conditions(self.previous, self._updates)


def invalid_spec(conds: PassConditions, message: str) -> None:
    """A spec admission could not refuse: not Ready, Degraded, with the validation message."""
    conds.condition("Ready", False, "InvalidSpec", message)
    conds.condition("Degraded", True, "InvalidSpec", message)


def accepted(conds: PassConditions, daemonset: str) -> None:
    """A valid spec with its node-agent DaemonSet (``namespace/name``) in place.

    Ready; Progressing only on the first pass (the job loop owns it after); Degraded cleared
    unless a loop finding other than an invalid spec stands.
    """
    conds.condition(
        "Ready", True, "AgentsDeployed", f"spec accepted; node agents: DaemonSet {daemonset}"
    )
    if conds.previous_of("Progressing") is None:
        conds.condition(
            "Progressing", True, "WaitingForReports", "no complete RL step reported yet"
        )
    degraded = conds.previous_of("Degraded")
    if degraded is None or degraded.get("reason") == "InvalidSpec":
        conds.condition("Degraded", False, "AsExpected", "no errors")
