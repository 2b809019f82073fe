"""The inference engine's lifecycle through verl 0.9.1's real classes: weight sync, failures.

verl's colocated ``ActorRolloutRefWorker.update_weights`` wakes the rollout's weights, copies
the trained weights and wakes the KV cache (``resume(tags=["weights"])``, ``update_weights``,
``resume(tags=["kv_cache"])``); generation starts when it returns. A plan listing
``weight-sync`` gets that call as a window at its own clock; the default plan leaves it idle.
A verl call that raises (the actor's update, the weight sync) or an engine server whose process
dies during generation sends ``idle`` at once: the node agent (stand-in NVML, real Unix-socket
server) returns the GPUs to the default governor, well within a second, with no lease needed.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_support import DriverFactory
from rlenergy_dev import verlrank
from test_verl_hook import _batch
from test_verl_subphases import DEFAULT, Job, MakeJob
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.padding import left_right_2_no_padding

from rlenergy.api import node as api_node
from rlenergy.sdk import pod_engines, verl_hook

ROOT = Path(__file__).resolve().parents[2]
SYNC = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="weight-sync", clockMHz=1110, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=1500, state="locked"),
    ],
)


@pytest.fixture
def make_job(
    hooked: None, cpu_weight_sync: None, make_driver: DriverFactory, short_tmp: Path
) -> Iterator[MakeJob]:
    """One verl rank against a real agent (``test_verl_subphases.Job``), stopped after."""
    made: list[Job] = []

    def make(plan: api_node.ClockPlan) -> Job:
        made.append(Job(make_driver(2), plan, short_tmp))
        return made[-1]

    yield make
    for j in made:
        j.stop()


class PacedRollout(verlrank.KeepRollout):
    """verl's rollout adapter whose wake-ups and weight copy take time and see the clocks."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job
        self.fail_update = False

    async def resume(self, tags: list[str]) -> None:
        self.job._pace(f"resume-{tags[0]}", 0)
        await super().resume(tags)

    async def update_weights(self, params: Any, **kw: Any) -> None:
        if self.fail_update:
            raise RuntimeError("engine died during the weight copy")
        self.job._pace("copy", 0)
        await super().update_weights(params, **kw)


def _phases(j: Job, step: int) -> dict[str, api_node.PhaseWindowReport]:
    """The agent's record of ``step`` so far (a step still running included), by phase."""
    return {w.phase: w for w in j.agent.step_record(step).phases}


def _locked(j: Job) -> set[int | None]:
    return {int(g.lock_max_mhz) if g.locked else None for g in map(j.drv.gpu, j.gpus)}


def _sync(j: Job, step: int) -> None:
    """verl's real colocated ``update_weights(global_steps=step - 1)``, booked as ``sync-N``."""
    j.call = f"sync-{step}"
    j.drv.set_work(j.gpus, "training", j.call)
    try:
        asyncio.run(verlrank.weights_done(j.worker, step - 1))
    finally:
        j.drv.set_work(j.gpus, "idle", "idle")
        j.call = "idle"


def test_a_plan_listing_the_weight_sync_gives_it_a_window_then_generation(
    make_job: MakeJob,
) -> None:
    j = make_job(SYNC)
    rollout = j.worker.rollout = PacedRollout(j)
    j.step(1)  # the agent's plan is unknown before its first answer: no weight-sync window
    assert [w.phase for w in j.windows(1)] == ["generation", "training"]
    _sync(j, 2)
    assert rollout.resumed == ["weights", "kv_cache"] * 2
    # every part of verl's sync (both wake-ups, the copy) ran at the weight-sync clock
    assert j.held["sync-2"] == {1110}
    assert verl_hook.hook().phase == "generation" and _locked(j) == {1395}  # fully awake
    windows = _phases(j, 2)
    assert sorted(windows) == ["weight-sync"]  # closed; generation runs on
    sync = windows["weight-sync"]
    assert sync.requested_clock_mhz == 1110
    assert sync.energy_joules == pytest.approx(j.truth("sync-2"), rel=0.02)


def test_the_default_plan_leaves_the_weight_sync_idle(make_job: MakeJob) -> None:
    j = make_job(DEFAULT)
    j.worker.rollout = PacedRollout(j)
    j.step(1)
    _sync(j, 2)
    assert j.held["sync-2"] == {None}  # the default governor
    assert _phases(j, 2) == {}  # no window closed before generation (still open)
    assert verl_hook.hook().phase == "generation" and _locked(j) == {1395}


def test_an_update_that_raises_returns_the_gpus_to_the_default_governor_at_once(
    make_job: MakeJob,
) -> None:
    j = make_job(SYNC)
    j.step(1)
    asyncio.run(verlrank.weights_done(j.worker, 1))
    batch, _, _ = _batch(2)
    batch = batch[verlrank.dapo_keep(batch)]
    ActorRolloutRefWorker.compute_log_prob(j.worker, left_right_2_no_padding(batch.to_tensordict()))
    assert _locked(j) == {1500}

    def dead(data: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    j.engine.train_mini_batch = dead  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="illegal memory access"):  # verl's error, unchanged
        j.trainer._update_actor(batch)
    assert _locked(j) == {None}
    h = verl_hook.hook()
    assert h.phase == "idle"
    assert h.aborts == [
        "verl's update_actor raised RuntimeError: CUDA error: an illegal memory access was "
        "encountered"
    ]
    assert sorted(_phases(j, 2)) == ["generation", "training", "weight-sync"]


def test_a_weight_sync_that_raises_returns_the_gpus_at_once(make_job: MakeJob) -> None:
    j = make_job(SYNC)
    rollout = j.worker.rollout = PacedRollout(j)
    j.step(1)
    rollout.fail_update = True
    with pytest.raises(RuntimeError, match="weight copy"):
        _sync(j, 2)
    assert j.held["sync-2"] == {1110}  # the wake-up of the weights ran in the window
    assert _locked(j) == {None} and verl_hook.hook().phase == "idle"
    assert sorted(_phases(j, 2)) == ["weight-sync"]


ENGINE = textwrap.dedent(
    """
    import asyncio, time
    from rlenergy_dev.vllmserver import VllmServer
    from rlenergy.sdk import verl_hook

    verl_hook.patch_engine_server(VllmServer, "vllm")  # what install() does in its process
    server = VllmServer()
    asyncio.run(server.launch_server())
    server.serve(4)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_an_engine_server_dying_mid_generation_aborts_within_a_second(
    make_job: MakeJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "engines"
    monkeypatch.setenv(pod_engines.ENGINE_DIR_ENV, str(folder))
    j = make_job(DEFAULT)  # its hook's default sources read the pod's published engines
    env = {
        **os.environ,
        pod_engines.ENGINE_DIR_ENV: str(folder),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "agent")]),
    }
    proc = subprocess.Popen(  # noqa: S603 - this interpreter, a script of this test
        [sys.executable, "-c", ENGINE], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        asyncio.run(verlrank.weights_done(j.worker, 0))
        h = verl_hook.hook()
        assert h.phase == "generation" and _locked(j) == {1395}
        time.sleep(0.3)  # the window's reporter reads the engine's counter
        gen = h.sources["generation"][0]
        assert gen.reporter is not None and gen.reporter.reports > 0
        assert gen.variant == "vllm"
        proc.kill()
        proc.wait()
        died = time.monotonic()
        while _locked(j) != {None} and time.monotonic() - died < 1.0:
            time.sleep(0.005)
        took = time.monotonic() - died
    finally:
        proc.kill()
        proc.wait()
    assert _locked(j) == {None}, "the GPUs still locked 1 s after the engine died"
    assert took < 1.0
    assert h.phase == "idle" and len(h.aborts) == 1
    assert h.aborts[0].startswith("inference engine lost: vllm at http://127.0.0.1:")
    print(f"engine death to default governor: {took * 1e3:.0f} ms")
