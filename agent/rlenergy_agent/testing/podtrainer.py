"""A trainer that runs in a pod on the dev cluster's real node and replays a verl trace.

The real-node end-to-end test (tests/e2e/test_real_node.py) runs this module in the project's
agent image (``python3 -m rlenergy_agent.testing.podtrainer``) in a pod that requests
``nvidia.com/gpu``. It drives the trainer SDK exactly as a verl job would
(``rlenergy.sdk.verl.RLEnergyVerlCallback`` over the agent's Unix socket), step by step, and
closes the loop on the clock its GPUs really run, as ``rlenergy_agent.testing.fullstack`` does:
a phase's work advances, tick by tick, at ``dt / T(f)``, with ``f`` the lowest SM clock of the
pod's GPUs read through the real pynvml (``rlenergy_agent.nvml.lib``; the stand-in library
the device plugin mounted, like the NVIDIA container toolkit mounts the driver's) and ``T(f)``
the phase's time at that clock.

The replay comes precomputed from the host (``replay_file``, made by :func:`replay_document`
with the simulator: the pod image carries no numpy): per step and phase the time at each
effective clock, the tokens and the progress shape. The simulated GPUs' physics run on the
host (``StandinDriver``), which needs to know what the GPUs execute: the trainer writes the
running phase's kind to ``work_file`` (a hostPath), the simulated hardware's input, read by the
host's physics loop (:class:`WorkFeed`). No signal, plan or attribution goes that way.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PHASES = ("generation", "training")
TICK_S = 0.005


def replay_document(job: Any, sku: Any) -> dict[str, Any]:
    """The JSON replay of a (time-compressed) ``rlenergy.sim.job.Job`` for the pod.

    Args:
        job: ``rlenergy.sim.job.Job``.
        sku: its ``rlenergy.gpu.models.GpuSku``.

    Returns:
        ``{"steps": [{"index", "other_time_s", "valid_tokens", "workload" (the fields of
        ``rlenergy.sdk.verl_hook.TrainedBatch``), "phases": {phase:
        {"kind", "tokens", "progress_shape", "times_s": {effective MHz: s}}}}]}``.
    """
    steps = []
    for step in job.replay.steps:
        w = step.workload
        phases = {}
        for phase in PHASES:
            pw = step.phase(phase)
            times: dict[str, float] = {}
            for lock in (None, *sku.supported_sm_clocks_mhz()):
                f = int(sku.effective_clock_mhz(pw.kind, lock))
                times.setdefault(str(f), job.phase_truth(step, phase, lock)[0])
            phases[phase] = {
                "kind": pw.kind,
                "tokens": w.phase_tokens(phase),
                "progress_shape": pw.progress_shape,
                "times_s": times,
            }
        steps.append(
            {
                "index": step.index,
                "other_time_s": step.other_time_s,
                "valid_tokens": w.valid_tokens,
                "workload": {
                    "samples": w.samples,
                    "aborted_samples": 0,
                    "valid_tokens": w.valid_tokens,
                    "response_tokens": w.response_tokens,
                    "prompt_tokens": w.prompt_tokens,
                },
                "phases": phases,
            }
        )
    return {"steps": steps}


class WorkFeed:
    """Host side: the simulated GPUs run what the pod's trainer says it runs.

    Applies the kind the trainer writes to ``work_file`` to the pod's GPUs and advances every
    GPU's counters in real time, so the pod's phases drive the physics.

    Args:
        driver: the ``StandinDriver`` of the node.
        work_file: the file the pod writes (through a hostPath).
        uuids: returns the pod's GPU UUIDs (known once the device plugin allocated them).
        tick_s: counter update period, s.
    """

    def __init__(self, driver: Any, work_file: Path, uuids: Any, *, tick_s: float = 0.004) -> None:
        self.driver = driver
        self.work_file = work_file
        self.uuids = uuids
        self.tick_s = tick_s
        self.kinds_seen: list[str] = []
        self.kind = "idle"
        """What the pod's GPUs run now (the trainer's last word)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="work-feed", daemon=True)

    def start(self) -> WorkFeed:
        """Start the physics loop."""
        self._thread.start()
        return self

    def _run(self) -> None:
        last = time.monotonic()
        seen = ""
        while not self._stop.wait(self.tick_s):
            try:
                raw = self.work_file.read_text()
            except OSError:
                raw = ""
            uuids = tuple(self.uuids())
            if raw and raw != seen and uuids:
                try:
                    work = json.loads(raw)
                except ValueError:
                    work = None  # a write in progress: read again next tick
                if work is not None:
                    seen = raw
                    self.driver.set_work(uuids, work["kind"], work["label"])
                    self.kind = str(work["kind"])
                    self.kinds_seen.append(work["label"])
            now = time.monotonic()
            self.driver.advance(now - last)
            last = now

    def stop(self) -> None:
        """Stop the loop."""
        self._stop.set()
        self._thread.join(timeout=5)


def _time_at(times: Mapping[str, float], clock_mhz: float) -> float:
    """Phase time at the effective clock: the entry of the nearest tabulated clock."""
    best = min(times, key=lambda k: abs(int(k) - clock_mhz))
    return times[best]


def run(
    replay: Mapping[str, Any],
    work_file: Path,
    uuids: Sequence[str],
    *,
    max_steps: int = 0,
    loop: bool = False,
) -> list[dict[str, Any]]:
    """Replay every step through the SDK; returns per step and phase the time and clocks seen.

    With ``loop`` the replay starts over (step numbers go on) until the process is stopped.
    """
    from rlenergy.sdk import verl as sdk_verl  # noqa: PLC0415
    from rlenergy_agent.nvml import lib  # noqa: PLC0415 - pynvml, only in the pod

    lib.init()
    handles = [lib.handle_by_uuid(u) for u in uuids]
    callback = sdk_verl.RLEnergyVerlCallback()

    def clock() -> float:
        return float(min(lib.clock_mhz(h, lib.CLOCK_SM) for h in handles))

    def work(kind: str, label: str) -> None:
        tmp = work_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"kind": kind, "label": label}))
        os.replace(tmp, work_file)

    out = []
    steps = replay["steps"][: max_steps or None]
    rounds = 0
    while True:
        out += _replay_round(steps, rounds * len(steps), callback, clock, work)
        rounds += 1
        if not loop:
            break
    lib.shutdown()
    return out


def _replay_round(
    steps: Sequence[Mapping[str, Any]], first: int, callback: Any, clock: Any, work: Any
) -> list[dict[str, Any]]:
    from rlenergy.sim.workload import reported_progress  # noqa: PLC0415 - the simulator's

    out = []
    for step in steps:
        s = first + int(step["index"])
        for phase in PHASES:
            ph = step["phases"][phase]
            if phase == "generation":
                callback.on_generation_start(s)
            else:
                callback.on_training_start(s)
            work(ph["kind"], f"{phase}-{s}")
            done, clocks = 0.0, set()
            start = last = time.monotonic()
            while done < 1.0:
                time.sleep(TICK_S)
                now = time.monotonic()
                f = clock()
                clocks.add(int(f))
                done += (now - last) / _time_at(ph["times_s"], f)
                last = now
                frac = min(done, 1.0)
                callback.on_phase_progress(
                    ph["tokens"] * reported_progress(frac, ph["progress_shape"]),
                    measured_at_s=now,  # counted at the tick's end, before the clock read
                )
            if phase == "generation":
                callback.on_generation_end(s)
            else:
                from rlenergy.sdk import verl_hook  # noqa: PLC0415

                callback.on_step_end(s, verl_hook.TrainedBatch(**step["workload"]))
            work("idle", f"idle-{s}")
            out.append(
                {"step": s, "phase": phase, "seconds": last - start, "clocks": sorted(clocks)}
            )
            if phase == "generation":
                time.sleep(step["other_time_s"])
        print(json.dumps(out[-2:]), flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python3 -m rlenergy_agent.testing.podtrainer --replay FILE --work-file FILE``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--replay", type=Path, required=True, help="replay JSON (from the host)")
    parser.add_argument("--work-file", type=Path, required=True, help="phase kind for the host")
    parser.add_argument("--steps", type=int, default=0, help="replay only the first N steps")
    parser.add_argument("--loop", action="store_true", help="start over until stopped")
    args = parser.parse_args(argv)
    uuids = [u for u in os.environ.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if u]
    if not uuids:
        parser.error("NVIDIA_VISIBLE_DEVICES is empty: the pod got no nvidia.com/gpu")
    replay = json.loads(args.replay.read_text())
    run(replay, args.work_file, uuids, max_steps=args.steps, loop=args.loop)
    print("replay done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
