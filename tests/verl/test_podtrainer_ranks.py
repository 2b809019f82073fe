"""The verl rank of ``make demo`` and of the real-node pod, on verl's default (v1) trainer.

``rlenergy_dev.podtrainer`` runs as those run it: a process of ``.venv-verl``
(``python -m rlenergy_dev.podtrainer``) with its GPUs' stand-in NVML, a token bound to its pod
and a real node agent behind its Unix-socket server; the host runs the GPUs' physics from the
rank's work log (``podtrainer.WorkFeed``). The rank installs the hook and runs verl 0.9.1's
real ``PPOTrainerSync`` over real TransferQueue on a local Ray of its own.

We test these aspects:

* on the v1 trainer (the default) and on the legacy one (``--trainer legacy``), every step's
  ``rlenergy/*`` keys land in verl's metrics dict: valid tokens and trained
  samples are the replay batch's own count after the v1 replay buffer's DAPO ``filter_groups``
  evicted the group that scores alike (verl's own eviction metric says so; the legacy
  trainer's batch drops it as DAPO's recipe does), one aborted
  sample, the generated tokens the hook read from the rollout server's ``/metrics``, energy
  per phase and per valid token;
* the agent saw both phases of every step and left no GPU locked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rlenergy_dev
from agent_support import DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import server, service
from rlenergy_dev import fullstack, podtrainer

from rlenergy.api import node as api_node
from rlenergy.api import signals
from rlenergy.gpu import models
from rlenergy.sdk import pod_engines
from rlenergy.sdk import trainer as sdk_trainer

pytestmark = pytest.mark.timeout(600)

POD = service.PodRef("rl", "verl-rank-0", "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
PLAN = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=1755, state="locked"),
    ],
)
STEPS = 3


@pytest.mark.parametrize("trainer", ["v1", "legacy"])
def test_the_demos_rank_runs_verls_trainer_and_reports_each_steps_workload(
    trainer: str, make_driver: DriverFactory, standin_lib: Path, short_tmp: Path
) -> None:
    drv = make_driver(2)
    uuids = list(drv.uuids)
    agent = standin_agent({POD: uuids}, PLAN, time.monotonic)
    reviews = FakeReviews()
    token = short_tmp / "token"
    token.write_text(reviews.issue(POD))
    srv = server.SignalServer(short_tmp / "agent.sock", agent, reviews.authenticator())
    sku = models.get_sku("h100-sxm")
    job, _ = fullstack.compressed_replay(
        fullstack.DEFAULT_TRACE, sku, STEPS, num_gpus=2, longest_phase_s=0.4
    )
    replay = podtrainer.replay_document(job, sku)
    (short_tmp / "replay.json").write_text(json.dumps(replay))
    work_file = short_tmp / "work.jsonl"
    env = {
        **rlenergy_dev.source_env(os.environ),
        **drv.env(standin_lib),
        "NVIDIA_VISIBLE_DEVICES": ",".join(uuids),
        sdk_trainer.SOCKET_ENV: str(short_tmp / "agent.sock"),
        signals.TOKEN_FILE_ENV: str(token),
        pod_engines.ENGINE_DIR_ENV: str(short_tmp / "engines"),
    }
    cmd = [
        sys.executable, "-W", "ignore", "-m", "rlenergy_dev.podtrainer",
        "--replay", str(short_tmp / "replay.json"), "--work-file", str(work_file),
        "--steps", str(STEPS), "--trainer", trainer,
    ]  # fmt: skip
    srv.start()
    feed = podtrainer.WorkFeed(drv, work_file, lambda: uuids).start()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    finally:
        feed.stop()
        srv.stop()
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    records = {r["step"]: r for r in podtrainer.step_records(done.stdout)}
    assert sorted(records) == list(range(1, STEPS + 1)), log[-4000:]
    for s in range(1, STEPS + 1):
        wrong = podtrainer.step_record_mismatches(
            records[s], replay["steps"][s - 1], dapo_evicts=trainer == "v1"
        )
        assert not wrong, (s, wrong)
    by_step = {r.step: r for r in agent.report().steps}
    for s in range(1, STEPS + 1):
        assert {p.phase for p in by_step[s].phases} == {"generation", "training"}, by_step[s]
    assert not any(drv.gpu(u).locked for u in uuids)
