"""In-phase progress from ``verl_hook.install()`` alone, through verl 0.9.1's real worker classes.

``install()`` is the one setting a user adds; with it each GPU worker's hook reads, during
generation, the decoded tokens of the pod's inference engines (the rollout server publishes its
``/metrics`` from the wrapped ``launch_server``) and, during training, the tokens of the forward
passes of the actor's torch module. Here the engine is vLLM 0.33.0's real counter and gauges
(``vllm:generation_tokens``, ``vllm:num_requests_*``) in a prometheus-client registry served on
127.0.0.1 (the only fake: vLLM itself), the actor a small CPU torch model behind verl's real
``ActorRolloutRefWorker`` methods, the agent a real node agent on the stand-in NVML. Without a
published engine the generation window has no progress and EE-RL says it uses whole-phase
evidence. The async rollout pool's step follows verl's ``CheckpointEngineWorker.update_weights``.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import verl
from agent_support import DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import server
from rlenergy_dev import verlrank
from rlenergy_dev.verlrank import VllmServer
from test_verl_hook import PLAN, POD, _batch
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.padding import left_right_2_no_padding

from rlenergy.api import workload as api_workload
from rlenergy.control.freq import aggregate, base, eerl
from rlenergy.sdk import pod_engines, verl_hook

VERL = Path(verl.__file__).parent
GEN_S = 1.2  # s: 8 probe slices of 4 report gaps (20-30 ms) fit (eerl.SLICE_PER_PROGRESS_GAP)


@pytest.fixture
def engine_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "engines"
    monkeypatch.setenv(pod_engines.ENGINE_DIR_ENV, str(folder))
    return folder


def _method(cls_name: str, path: Path, name: str) -> ast.AsyncFunctionDef:
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return next(n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == name)


@pytest.mark.parametrize(("module", "cls_name"), list(verl_hook.ENGINE_SERVERS))
def test_the_patched_engine_servers_are_verls(module: str, cls_name: str) -> None:
    """The names the publishing wrapper relies on, in the pinned verl's source (its server
    modules import vLLM/SGLang, not installed here, so read, not imported)."""
    path = VERL.parent / (module.replace(".", "/") + ".py")
    launch = _method(cls_name, path, "launch_server")
    source = ast.unparse(launch) + ast.unparse(
        next(
            n
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.ClassDef) and n.name == cls_name
        )
    )
    assert "self._server_port, self._server_task = await run_uvicorn(" in source
    assert "self._server_address" in source
    assert _method(cls_name, path, "set_global_steps")  # what update_weights reaches


def test_after_import_patches_a_module_on_its_first_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "rl_fake_server_mod.py").write_text(
        "class Server:\n    async def launch_server(self):\n        pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []
    verl_hook.after_import("rl_fake_server_mod", lambda m: seen.append(m.__name__))
    assert seen == []
    importlib.import_module("rl_fake_server_mod")
    assert seen == ["rl_fake_server_mod"]
    verl_hook.after_import("rl_fake_server_mod", lambda m: seen.append("again"))
    assert seen == ["rl_fake_server_mod", "again"]  # already imported: at once
    sys.modules.pop("rl_fake_server_mod")


def _controller(phase: str) -> eerl.EERLController:
    clocks = tuple(range(1980, 990, -15))
    ctl = eerl.EERLController(
        [eerl.PhaseSettings(phase, 0.9, (1785, 1590, 1395, 1200), clocks, 1980)],
        eerl.ControllerSettings(warmup_steps=2),
    )
    for step in range(2):
        work = api_workload.TokenWorkload(64, 1e5, 1e4, 1e5, 2000.0)
        warm = base.PhaseObservation(phase, GEN_S, 1e3, None, 1980, progress_gap_s=0.02)
        ctl.observe(base.StepObservation(step, work, {phase: warm}))
    return ctl


def test_install_alone_gives_verl_in_phase_progress_and_whole_phase_without_an_engine(
    hooked: None,
    cpu_weight_sync: None,
    engine_dir: Path,
    make_driver: DriverFactory,
    short_tmp: Path,
) -> None:
    drv = make_driver(2)
    gpus = list(drv.uuids)
    agent = standin_agent({POD: gpus}, PLAN, time.monotonic)
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    vllm = VllmServer()
    # The engine server's process: install() wraps its launch_server, which publishes.
    verl_hook.patch_engine_server(VllmServer, "vllm")
    asyncio.run(vllm.launch_server())
    try:
        [published] = pod_engines.published(engine_dir)
        assert published.url == f"http://127.0.0.1:{vllm._server_port}/metrics"
        h = verl_hook.VerlHook(reviews.client(sock, POD, short_tmp, strict=True))
        h.add_default_sources()  # what hook() does in a worker after install()
        verl_hook._HOOK = h
        engine = verlrank.CpuEngine()
        worker = verlrank.make_worker(engine)
        trainer = verlrank.make_trainer(worker)
        metrics: dict[int, dict[str, float]] = {}
        for step in (1, 2):
            if step == 2:  # the engine went away: no source for generation
                vllm.close()
                for f in engine_dir.glob("*.json"):
                    f.unlink()
            asyncio.run(verlrank.weights_done(worker, step - 1))
            assert h.phase == "generation" and h.step == step
            drv.set_work(gpus, "generation", f"gen-{step}")
            decoded0 = vllm.decoded
            vllm.serve(8)
            time.sleep(GEN_S)
            vllm.serve(0)
            time.sleep(0.05)  # the reporter's next read sees the last token
            decoded = vllm.decoded - decoded0
            batch, _, _ = _batch(step)
            batch = batch[verlrank.dapo_keep(batch)]
            forwarded0 = engine.forwarded
            ActorRolloutRefWorker.compute_log_prob(
                worker, left_right_2_no_padding(batch.to_tensordict())
            )
            drv.set_work(gpus, "training", f"train-{step}")
            out = trainer._update_actor(batch)
            trained = engine.forwarded - forwarded0
            metrics[step] = out.meta_info["metrics"]
            drv.set_work(gpus, "idle", "idle")
            rec = {r.step: r for r in agent.report().steps}[step]
            gen = next(p for p in rec.phases if p.phase == "generation")
            train = next(p for p in rec.phases if p.phase == "training")
            # Training: every token of the forward passes (log-prob and update) counted.
            assert trained > 0 and train.progress == trained
            if step == 1:
                # Generation: the engine's own counter, read over its published /metrics, in
                # vLLM's own naming, which the node report keeps with the step's workload.
                assert rec.workload.generation_progress_source == "vllm"
                assert 0.9 * decoded <= gen.progress <= decoded * 1.001
                assert metrics[1]["rlenergy/generated_tokens"] == pytest.approx(gen.progress)
                assert gen.progress_mean_gap_seconds is not None
                assert gen.progress_mean_gap_seconds <= 0.05
            else:
                assert rec.workload.generation_progress_source is None
                assert gen.progress == 0 and gen.progress_mean_gap_seconds is None
                assert "rlenergy/generated_tokens" not in metrics[2]
            # EE-RL on this window: in-phase slices with the engine's counter, whole-phase
            # evidence (said so, as status.phases[].probeEvidence shows it) without it.
            obs = aggregate.job_step(step, [agent.report()]).observation
            ctl = _controller("generation")
            ctl.observe(
                base.StepObservation(2, obs.workload, {"generation": obs.phases["generation"]})
            )
            evidence = ctl.phases["generation"].probe_evidence
            if step == 1:
                assert evidence.startswith("in-phase slices"), evidence
            else:
                assert evidence.startswith("whole-phase: no in-phase progress"), evidence
        assert metrics[1]["rlenergy/valid_tokens"] > 0
    finally:
        vllm.close()
        srv.stop()


class KeepAdapter:
    """The rollout pool worker's server adapter: receives the weights (kept)."""

    def __init__(self) -> None:
        self.steps: list[int | None] = []

    async def update_weights(
        self, weights: Any, global_steps: int | None = None, **kw: Any
    ) -> None:
        self.steps.append(global_steps)


class OneTensor:
    """The checkpoint engine's receiving side: one tensor per update."""

    wire_format = "named_tensors"

    def receive_weights(self, global_steps: int | None = None) -> Any:
        yield "w", torch.zeros(2)


def test_rollout_pool_step_follows_verls_checkpoint_worker_update_weights(
    hooked: None,
    engine_dir: Path,
    make_driver: DriverFactory,
    short_tmp: Path,
) -> None:
    drv = make_driver(1)
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, time.monotonic)
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    vllm = VllmServer()
    verl_hook.patch_engine_server(VllmServer, "vllm")
    asyncio.run(vllm.launch_server())
    worker = object.__new__(CheckpointEngineWorker)  # no Ray, no process group
    worker.checkpoint_engine = OneTensor()
    worker.server_adapter = KeepAdapter()
    try:
        verl_hook._HOOK = verl_hook.VerlHook(reviews.client(sock, POD, short_tmp, strict=True))
        decoded: dict[int, float] = {}
        for version in (0, 1, 2):
            # verl's real CheckpointEngineWorker.update_weights, as re-registered by install()
            asyncio.run(CheckpointEngineWorker.update_weights(worker, global_steps=version))
            assert worker.server_adapter.steps[-1] == version
            pool = verl_hook.pool_phases()
            assert pool.step == version + 1
            before = vllm.decoded
            vllm.serve(6)
            time.sleep(0.4)
            vllm.serve(0)
            time.sleep(0.3)  # the pool's window closes after 0.1 s without requests
            decoded[version + 1] = vllm.decoded - before
        verl_hook.pool_phases().stop()
    finally:
        vllm.close()
        srv.stop()
    assert pool.last_error is None and pool.windows == 3
    steps = {r.step: r for r in agent.report().steps}
    for step in (1, 2):
        [gen] = steps[step].phases
        assert gen.phase == "generation"
        assert 0.5 * decoded[step] <= gen.progress <= decoded[step] * 1.001


class FailingAdapter(KeepAdapter):
    """The pool's server adapter whose engine dies while receiving weights."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    async def update_weights(
        self, weights: Any, global_steps: int | None = None, **kw: Any
    ) -> None:
        if self.fail:
            raise ConnectionError("rollout server gone while receiving weights")
        await super().update_weights(weights, global_steps, **kw)


def test_a_failed_pool_weight_update_ends_its_generation_window_at_once(
    hooked: None,
    engine_dir: Path,
    make_driver: DriverFactory,
    short_tmp: Path,
) -> None:
    drv = make_driver(1)
    gpus = list(drv.uuids)
    agent = standin_agent({POD: gpus}, PLAN, time.monotonic)
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    vllm = VllmServer()
    verl_hook.patch_engine_server(VllmServer, "vllm")
    asyncio.run(vllm.launch_server())
    worker = object.__new__(CheckpointEngineWorker)
    worker.checkpoint_engine = OneTensor()
    worker.server_adapter = adapter = FailingAdapter()
    try:
        verl_hook._HOOK = verl_hook.VerlHook(reviews.client(sock, POD, short_tmp, strict=True))
        asyncio.run(CheckpointEngineWorker.update_weights(worker, global_steps=0))
        pool = verl_hook.pool_phases()
        pool.idle_after_s = 60.0  # only the abort can end the window in this test
        vllm.serve(6)
        deadline = time.monotonic() + 5
        while not drv.gpu(gpus[0]).locked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert drv.gpu(gpus[0]).lock_max_mhz == 1395  # the pool generates
        vllm.serve(0)
        adapter.fail = True
        with pytest.raises(ConnectionError, match="rollout server gone"):
            asyncio.run(CheckpointEngineWorker.update_weights(worker, global_steps=1))
        assert not drv.gpu(gpus[0]).locked  # at once: no lease, no idle_after_s
    finally:
        if verl_hook._POOL is not None:
            verl_hook._POOL.stop()
        vllm.close()
        srv.stop()
