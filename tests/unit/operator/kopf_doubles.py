"""Doubles of what kopf hands a handler, for the operator's handler unit tests."""

from __future__ import annotations

from typing import Any


class StatusPatch(dict[str, Any]):
    """kopf's ``patch``: a dict with a ``status`` dict the handler fills."""

    def __init__(self) -> None:
        super().__init__()
        self.status: dict[str, Any] = {}


class WarningLog:
    """A handler's ``logger``: warnings kept (formatted) in ``warnings``, info dropped."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, msg: str, *args: Any) -> None:
        self.warnings.append(msg % args)

    def info(self, msg: str, *args: Any) -> None:
        pass


def serving() -> Any:
    """What the operator's start-up handler leaves in ``memo["handover"]`` for a process that
    serves its shard (``rlenergy_operator.shards.Handover``, established)."""
    from rlenergy_operator import shards

    handover = shards.Handover()
    handover.observe([], 0.0)
    return handover
