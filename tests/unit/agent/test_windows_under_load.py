"""Phase windows within 1 % of the simulator's truth on a machine busy with other work.

The demo's set-up in small: the agent (signal server, meter) in this process, the simulated
GPUs' counters written by ``podtrainer.WorkFeed`` on a host thread from the trainer's work log,
the trainer a process of its own signalling through the SDK with its truth labels switched by
``podtrainer._label_at_signals``, and every CPU core kept busy by a process spinning in a loop.
The answer to a phase signal arrives, and the host thread writes the counters, tens of ms late
on such a machine; the windows must still match the truth, since the truth switches where the
agent read the counters (``boundaryMonotonicSeconds``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from agent_support import LOCKED_PLAN, POD_A, DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import server
from rlenergy_dev import podtrainer

pytestmark = pytest.mark.slow

STEPS = 12
PHASE_S = 0.2
BURNERS_PER_CORE = 1
"""Spinning processes per core beside the test's own (the agent's threads, the trainer, the
feed). Three per core failed the 1 % bound in 1 of 6 runs (2.04 %) when the machine also ran
other tests; one per core gave at most 0.38 % in 6 runs on that machine."""
TRAINER = """
import os, sys, time, types
from rlenergy.sdk import trainer
from rlenergy_dev import podtrainer

sock, token, work_file, steps, phase_s = sys.argv[1:6]
client = trainer.RLEnergyClient(sock, token_file=token, strict=True)
hook = types.SimpleNamespace(client=client)
fd = os.open(work_file, os.O_WRONLY | os.O_APPEND)

def work(kind, label, boundary_s=None):
    args = (kind, label) if boundary_s is None else (kind, label, boundary_s)
    os.write(fd, podtrainer.work_record(*args))

podtrainer._label_at_signals(hook, work)
for s in range(int(steps)):
    for phase in ("generation", "training"):
        hook.client.phase(phase, step=s)
        work(phase, f"{phase}-{s}")  # the phase's work starts
        time.sleep(float(phase_s))
        work("idle", podtrainer.tail_label(f"{phase}-{s}"))  # done: idle until the next signal
        time.sleep(0.05)
    hook.client.phase("idle", step=s)  # as the verl hook closes a step: idle, then the end
    client.end_step(s, samples=8, response_tokens=800, prompt_tokens=80, valid_tokens=700)
"""


def test_windows_match_the_truth_with_every_core_busy(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    drv = make_driver(8)
    agent = standin_agent({POD_A: list(drv.uuids)}, LOCKED_PLAN, time.monotonic)
    stop = threading.Event()

    def sample() -> None:  # the node loop's periodic sampling
        while not stop.wait(0.1):
            agent.meter.sample()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    reviews = FakeReviews()
    sock = short_tmp / "a.sock"
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    token = short_tmp / "token"
    token.write_text(reviews.issue(POD_A))
    work_file = short_tmp / "work.log"
    work_file.write_text("")
    feed = podtrainer.WorkFeed(drv, work_file, lambda: drv.uuids).start()
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])  # noqa: S603
        for _ in range(BURNERS_PER_CORE * len(os.sched_getaffinity(0)))
    ]
    try:
        run = subprocess.run(  # noqa: S603
            [sys.executable, "-c", TRAINER, str(sock), str(token), str(work_file), str(STEPS),
             str(PHASE_S)],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        for b in burners:
            b.kill()
            b.wait()
        time.sleep(0.1)  # the feed writes the last records
        feed.stop()
        stop.set()
        sampler.join()
        srv.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    errors = []
    for rec in agent.report().steps:
        for p in rec.phases:
            label = f"{p.phase}-{rec.step}"
            truth = sum(
                drv.truth_j(u, lb)
                for u in drv.uuids
                for lb in (label, podtrainer.tail_label(label))
            )
            assert p.energy_joules is not None and truth > 0
            errors.append((abs(p.energy_joules - truth) / truth, label))
    assert len(errors) == 2 * STEPS
    worst = max(errors)
    print(
        f"{len(errors)} windows, every core busy: max |error| {100 * worst[0]:.4f} % ({worst[1]})"
    )
    assert worst[0] < 0.01, worst
