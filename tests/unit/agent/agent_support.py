"""Shared helpers of the agent unit tests (imported as a top-level module, like e2e_support)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from rlenergy_agent import actuator, energy, service
from rlenergy_agent.nvml import backend
from rlenergy_agent.testing import standin

from rlenergy.api import node as api_node

DriverFactory = Callable[..., standin.StandinDriver]


def make_uuids(n: int, seed: int = 7) -> list[str]:
    """``n`` random-looking GPU UUIDs (never index-shaped)."""
    rng = random.Random(seed)
    return [f"GPU-{rng.getrandbits(64):016x}-{i}" for i in range(n)]


def energy_sources(caps: Mapping[str, backend.Capabilities]) -> dict[str, energy.EnergySource]:
    """Each GPU's energy source from its capability probe (as the agent's start-up picks it)."""
    return {
        u: energy.source_for(c.energy_counter, c.instant_power, c.power_usage)
        for u, c in caps.items()
    }


def standin_agent(
    pods: Mapping[service.PodRef, list[str]],
    plan: api_node.ClockPlan | None,
    clock: Callable[[], float],
    *,
    node: str = "node-1",
    policy: str = "pol",
) -> service.Agent:
    """An ``Agent`` over the stand-in NVML's GPUs: started actuator, sampled meter, ``plan`` set.

    Args:
        pods: which pod holds which GPU UUIDs.
        plan: the clock plan the agent starts with.
        clock: monotonic time source of the meter and the agent, s.
        node: node name.
        policy: policy name.
    """
    found = backend.discover()
    caps = {u: g.probe() for u, g in found.gpus.items()}
    act = actuator.Actuator(found.gpus, actuator.LockStateFile(None), clock=clock)
    act.start(persistence={u: c.persistence for u, c in caps.items()})
    meter = energy.EnergyMeter(found.gpus, energy_sources(caps), clock=clock)
    meter.sample()
    agent = service.Agent(node, policy, act, meter, service.StaticPodMap(dict(pods)), clock=clock)
    agent.set_plan(plan)
    return agent
