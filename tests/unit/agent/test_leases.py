"""Phase leases (``rlenergy_agent.leases``): a trainer that stops signalling gets no lock kept.

We test: a locked phase silent past its lease returns its GPUs to the default governor from the
agent's own sampling pass (``observe``), books its window as measured and says so in the node
report and in /metrics; progress reports renew the lease; the lease follows the phase's longest
window on the node (three times it, at least two minutes); idle windows and other pods' locks
are left alone.
"""

from __future__ import annotations

from agent_support import LOCKED_PLAN as PLAN
from agent_support import POD_A, POD_B, DriverFactory, standin_agent
from rlenergy_agent import leases, metrics, service
from rlenergy_dev import standin


def _run(
    drv: standin.StandinDriver,
    agent: service.Agent,
    seconds: float,
    *,
    step_s: float = 5.0,
    progress: bool = False,
) -> None:
    """Advance the stand-in GPUs and run the agent's sampling pass every ``step_s``."""
    done, total = 0.0, 0.0
    while done < seconds:
        drv.advance(step_s)
        done += step_s
        agent.meter.sample()
        if progress:
            total += 100.0
            agent.progress_total(POD_A, total)
        agent.observe()


def test_a_locked_phase_silent_past_its_lease_goes_back_to_the_default_governor(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    a = list(drv.uuids)
    agent = standin_agent({POD_A: a}, PLAN, lambda: drv.virtual_s)
    agent.phase(POD_A, "generation", 3)
    drv.set_work(a, "generation", "gen")
    assert agent.lease_s("generation") == leases.LEASE_FIRST_S  # no window of it closed yet
    _run(drv, agent, leases.LEASE_FIRST_S - 10)
    assert all(drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1395 for u in a)
    assert not agent.report().expired_leases
    _run(drv, agent, 20)
    assert not any(drv.gpu(u).locked for u in a)  # the trainer died: default governor
    (expired,) = agent.report().expired_leases
    assert (expired.pod, expired.phase, expired.step, expired.gpus) == (
        str(POD_A),
        "generation",
        3,
        sorted(a),
    )
    assert expired.silent_seconds > expired.lease_seconds == leases.LEASE_FIRST_S
    assert agent.report_due
    # The window is booked as measured, under its step.
    (win,) = agent.steps[3]["generation"]
    assert win.energy_joules is not None and win.energy_joules > 0
    text = metrics.render(agent).decode()
    assert 'rlenergy_agent_leases_expired_total{node="node-1",policy="pol"} 1.0' in text
    _run(drv, agent, 600)
    assert len(agent.report().expired_leases) == 1  # once


def test_progress_reports_renew_the_lease(make_driver: DriverFactory) -> None:
    drv = make_driver(1)
    a = list(drv.uuids)
    agent = standin_agent({POD_A: a}, PLAN, lambda: drv.virtual_s)
    agent.phase(POD_A, "generation", 0)
    _run(drv, agent, 2 * leases.LEASE_FIRST_S, progress=True)
    assert drv.gpu(a[0]).locked and not agent.report().expired_leases


def test_the_lease_follows_the_phases_longest_window_on_the_node(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    a, b = [drv.uuids[0]], [drv.uuids[1]]
    agent = standin_agent({POD_A: a, POD_B: b}, PLAN, lambda: drv.virtual_s)
    agent.phase(POD_A, "training", 0)
    _run(drv, agent, 60)
    agent.phase(POD_A, "idle", 0)  # a 60 s training window closed
    assert agent.lease_s("training") == leases.LEASE_FACTOR * 60
    assert agent.lease_s("generation") == leases.LEASE_FIRST_S
    agent.phase(POD_A, "generation", 1)
    _run(drv, agent, 10)
    agent.phase(POD_A, "idle", 1)  # a 10 s generation window: the floor holds
    assert agent.lease_s("generation") == leases.LEASE_MIN_S
    agent.phase(POD_A, "training", 1)
    agent.phase(POD_B, "generation", 1)
    _run(drv, agent, leases.LEASE_MIN_S - 10)
    assert drv.gpu(b[0]).locked  # within its lease
    _run(drv, agent, 20)
    assert not drv.gpu(b[0]).locked  # generation: past 120 s
    assert drv.gpu(a[0]).locked and drv.gpu(a[0]).lock_max_mhz == 1755  # training: 180 s
    _run(drv, agent, 60)
    assert not drv.gpu(a[0]).locked
    assert [e.phase for e in agent.report().expired_leases] == ["generation", "training"]


def test_an_idle_window_never_expires(make_driver: DriverFactory) -> None:
    drv = make_driver(1)
    a = list(drv.uuids)
    agent = standin_agent({POD_A: a}, PLAN, lambda: drv.virtual_s)
    agent.phase(POD_A, "idle", 0)
    _run(drv, agent, 2 * leases.LEASE_FIRST_S, step_s=30.0)
    assert not agent.report().expired_leases
