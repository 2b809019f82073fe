"""Liveness that means it (issue #16, item 5): the probe fails while a status write has not
come back through the policy watch (``liveness.EchoTracker`` and the ``policy_watch`` probe
handler kopf runs for ``/healthz``)."""

from __future__ import annotations

import kopf
import pytest
from rlenergy_operator import handlers, liveness, settings

pytestmark = pytest.mark.field


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_write_the_watch_never_brings_back_fails_the_probe(monkeypatch: pytest.MonkeyPatch):
    clock = _Clock()
    echoes = liveness.EchoTracker(bound_s=60.0, clock=clock)
    monkeypatch.setattr(handlers, "ECHOES", echoes)
    assert handlers.policy_watch_probe() == "ok"  # nothing written: a quiet cluster is live
    echoes.wrote(("team-a", "grpo"), "100")
    clock.t += 30
    echoes.seen(("team-a", "grpo"), "100")  # the next pass still sees the old body
    echoes.wrote(("team-a", "grpo"), "100")  # and writes again: the first write's age counts
    assert handlers.policy_watch_probe() == "ok"
    clock.t += 31
    with pytest.raises(kopf.PermanentError, match=r"team-a/grpo 61 s ago never came back"):
        handlers.policy_watch_probe()
    echoes.seen(("team-a", "grpo"), "101")  # the watch delivers again
    assert handlers.policy_watch_probe() == "ok"
    echoes.wrote(("team-b", "x"), "7")
    clock.t += 120
    echoes.forget(("team-b", "x"))  # deleted: nothing to wait for
    assert echoes.overdue() == {}


def test_the_bound_is_above_kopfs_own_reconnect():
    cfg = settings.OperatorConfig()
    s = kopf.OperatorSettings()
    settings.configure_kopf(s, cfg)
    assert cfg.watch_echo_bound_s > s.watching.inactivity_timeout + cfg.reconcile_interval_s
    assert handlers.ECHOES.bound_s == cfg.watch_echo_bound_s
