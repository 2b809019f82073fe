"""Shared helpers of the agent unit tests (imported as a top-level module, like e2e_support)."""

from __future__ import annotations

import contextlib
import json
import random
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlenergy_agent import actuator, energy, identity, server, service
from rlenergy_agent.nvml import backend
from rlenergy_dev import standin

from rlenergy.api import node as api_node
from rlenergy.sdk import trainer, verl_hook

DriverFactory = Callable[..., standin.StandinDriver]

POD_A = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
POD_B = service.PodRef("team-a", "trainer-1", "66666666-7777-8888-9999-000000000000")
"""Two trainer pods of one namespace (their UIDs never index-shaped)."""
LOCKED_PLAN = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=1755, state="locked"),
    ],
)
"""A plan that locks both phases (generation 1395 MHz, training 1755 MHz) from step 0."""


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


def discovered_meter(
    clock: Callable[[], float], wall: Callable[[], float], totals: Path | None = None
) -> energy.EnergyMeter:
    """An ``EnergyMeter`` over the GPUs the stand-in NVML shows, timed by ``clock``/``wall`` (s)."""
    found = backend.discover()
    return energy.EnergyMeter(
        found.gpus,
        energy_sources({u: g.probe() for u, g in found.gpus.items()}),
        totals_path=totals,
        clock=clock,
        wall=wall,
    )


def probe_plan(
    schedule: Sequence[int | None], slice_s: float, *, training_locked: bool = False
) -> api_node.ClockPlan:
    """Step 0's plan: generation probed in slices of ``slice_s`` s through ``schedule`` (MHz,
    ``None`` = default governor); with ``training_locked`` also a training entry at the default
    (locked, no clock)."""
    phases = [
        api_node.PhasePlan(
            phase="generation",
            clockMHz=None,
            state="trial",
            probeClocksMHz=list(schedule),
            probeSliceSeconds=slice_s,
        )
    ]
    if training_locked:
        phases.append(api_node.PhasePlan(phase="training", clockMHz=None, state="locked"))
    return api_node.ClockPlan(step=0, phases=phases)


def standin_actuator(
    drv: standin.StandinDriver,
    state: Path | None = None,
    *,
    clock: Callable[[], float] | None = None,
    **kw: bool,
) -> actuator.Actuator:
    """A started ``Actuator`` over the stand-in NVML's GPUs, as the agent's start-up makes it.

    Args:
        drv: the stand-in driver (its library preloaded).
        state: the lock state file (``None``: in memory).
        clock: the actuator's monotonic time source, s (default: the driver's virtual time).
        kw: ``enforce`` / ``probe_writes`` of ``Actuator``.
    """
    found = backend.discover()
    act = actuator.Actuator(
        found.gpus,
        actuator.LockStateFile(state),
        clock=clock or (lambda: drv.virtual_s),
        **kw,
    )
    caps = {u: g.probe() for u, g in found.gpus.items()}
    act.start(
        persistence={u: c.persistence for u, c in caps.items()},
        mig_uuids={u: g.mig_uuids for u, g in found.gpus.items()},
    )
    return act


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


AUDIENCE = "rlenergy-agent"


class FakeReviews:
    """A TokenReview stand-in for unit tests: tokens issued here are bound to a pod and node.

    Args:
        node: the node a token names by default.
    """

    def __init__(self, node: str = "node-1") -> None:
        self.node = node
        self.bound: dict[str, tuple[service.PodRef, str, str]] = {}
        self.calls = 0
        self.down = False

    def issue(
        self,
        pod: service.PodRef,
        *,
        node: str | None = None,
        audience: str = AUDIENCE,
        exp_s: float | None = None,
    ) -> str:
        """A JWT-shaped token bound to ``pod`` (``exp`` claim ``exp_s``; default an hour)."""
        import base64
        import json
        import time

        claims = {
            "exp": int(exp_s if exp_s is not None else time.time() + 3600),
            "n": len(self.bound),
        }
        body = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
        token = f"eyJhbGciOiJSUzI1NiJ9.{body}.c2ln"
        self.bound[token] = (pod, self.node if node is None else node, audience)
        return token

    def review(self, token: str, audiences: Sequence[str]) -> identity.Review:
        """What the API server would answer."""
        self.calls += 1
        if self.down:
            raise identity.ReviewUnavailableError("connection refused")
        hit = self.bound.get(token)
        if hit is None:
            return identity.Review(False, error="invalid bearer token")
        pod, node, aud = hit
        if aud not in audiences:
            return identity.Review(
                False, error="token audiences is invalid for the target audiences"
            )
        extra = {identity.EXTRA_POD_NAME: [pod.name], identity.EXTRA_POD_UID: [pod.uid]}
        if node:
            extra[identity.EXTRA_NODE_NAME] = [node]
        return identity.Review(
            True,
            username=f"system:serviceaccount:{pod.namespace}:default",
            extra=extra,
            audiences=[aud],
        )

    def authenticator(self, **kw: Any) -> identity.TokenAuthenticator:
        """A ``TokenAuthenticator`` over these reviews."""
        return identity.TokenAuthenticator(self.review, AUDIENCE, **kw)

    def client(
        self, sock: Path, pod: service.PodRef, folder: Path, **kw: Any
    ) -> trainer.RLEnergyClient:
        """An SDK client of ``pod`` (its token written to a file in ``folder``)."""
        token_file = folder / f"token-{len(self.bound)}"
        token_file.write_text(self.issue(pod))
        return trainer.RLEnergyClient(str(sock), token_file=str(token_file), **kw)


class WatchStream:
    """A watch response as ``kubeapi.Watch`` reads it: JSON lines of ``events``, then (with
    ``hold``) the connection held open until ``hold`` is set (the API server's long request)."""

    def __init__(self, events: list[dict[str, Any]], hold: threading.Event | None) -> None:
        self.events, self.hold, self.status = events, hold, 200

    def stream(self, amt: Any = None, decode_content: bool = False) -> Any:
        for e in self.events:
            yield (json.dumps(e) + "\n").encode()
        if self.hold is not None:
            self.hold.wait(5)

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


@contextlib.contextmanager
def hooked_agent(
    make_driver: DriverFactory,
    folder: Path,
    plan: api_node.ClockPlan,
    pod: service.PodRef,
    gpus: int = 2,
) -> Iterator[tuple[standin.StandinDriver, list[str], service.Agent]]:
    """A real agent on ``gpus`` stand-in GPUs behind its Unix-socket server (in ``folder``),
    and this process's verl hook signalling it as ``pod`` (a strict client: refusals raise).

    Yields:
        (the stand-in driver, its GPU UUIDs, the agent); the server stops on exit.
    """
    drv = make_driver(gpus)
    uuids = list(drv.uuids)
    agent = standin_agent({pod: uuids}, plan, lambda: drv.virtual_s)
    sock = folder / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        verl_hook._HOOK = verl_hook.VerlHook(reviews.client(sock, pod, folder, strict=True))
        yield drv, uuids, agent
    finally:
        srv.stop()
