"""A verl rank in a pod on the dev cluster's real node, replaying a verl trace's physics.

The real-node end-to-end test (tests/e2e/test_real_node.py) runs this module in the project's
agent image (``python3 -m rlenergy_dev.podtrainer``) in a pod that requests
``nvidia.com/gpu``, with the pinned verl and torch of ``.venv-verl`` on ``PYTHONPATH`` (a
read-only hostPath: a verl image in miniature); ``make demo`` runs it as a process per node.
The trainer is verl's own code, hooked the way a verl job is hooked: :func:`run` calls
``rlenergy.sdk.verl_hook.install`` (what Ray's ``worker_process_setup_hook`` runs in each
worker process) and then, per step, verl's real methods on a CPU rank
(``rlenergy_dev.verlrank``).

By default (``--trainer v1``) that is verl 0.9.1's default trainer, the v1 ``PPOTrainerSync``
(``rlenergy_dev.verlv1``), over the real TransferQueue on a local Ray in the process (its
controller and one storage unit, Ray actors on loopback): ``ActorRolloutRefWorker.
update_weights`` (``on_step_end``'s weight sync; the hook enters generation), the trainer's
``prepare_step`` submitting the step's prompts to the rollout, which decodes them through the
rollout server's token counter (vLLM's metric names, read by the hook over HTTP) and writes
the trajectories to TransferQueue as verl's agent loop does, its ``ReplayBuffer`` with DAPO's
``filter_groups`` (it evicts the group that scores alike and refills), ``compute_log_prob``
(the hook enters training; its forward hook on the actor module counts the tokens) and
``PPOTrainer._update_actor`` on the batch the replay buffer handed the step, which holds an
aborted sample (the hook counts the valid tokens, ends the step and puts its ``rlenergy/*``
metrics in verl's metrics dict). ``--trainer legacy`` runs verl's legacy
``RayPPOTrainer._update_actor`` (``trainer.use_v1=false``) on the same batch instead. Each
step's metrics are printed as one JSON line (``STEP {...}``) for the test.

The work is closed-loop on the clock the pod's GPUs really run, as
``rlenergy_dev.fullstack`` does: a phase's work advances, tick by tick, at
``dt / T(f)``, with ``f`` the lowest SM clock of the pod's GPUs read through the real pynvml
(``rlenergy_agent.nvml.lib``; the stand-in library the pod's CDI devices mount, as the NVIDIA
container toolkit's spec mounts the driver's) and ``T(f)`` the phase's time at that clock. Decoding
reports its tokens as that work advances; the training engine's forward chunks wait for it.

The replay comes precomputed from the host (``replay_file``, made by :func:`replay_document`
with the simulator): per step and phase the time at each effective clock, the tokens, the
progress shape and the batch. The simulated GPUs' physics run on the host (``StandinDriver``),
which needs to know what the GPUs execute: the trainer appends each switch of the work its
GPUs run to ``work_file`` (a hostPath), the simulated hardware's input, read by the host's
physics loop (:class:`WorkFeed`). No signal, plan or attribution goes that way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from rlenergy.sim.workload import reported_progress

PHASES = ("generation", "training")
TICK_S = 0.005
GROUP = 4
"""Samples per prompt group (verl's ``rollout.n``) of the pod's batches."""
GROUPS = 9
"""Prompt groups per batch: one is dropped by DAPO's dynamic sampling, eight reach the update."""
LENGTH_SCALE = 16
"""[MODEL] The pod's batch has the trace's mean response and prompt lengths over this (a CPU
model trains on it in the phase's time); valid tokens keep the trace's step-to-step shape."""
WRITTEN_KEPT_S = 5.0
"""How long ``WorkFeed`` remembers what it wrote to the counters, s (a boundary record arrives
an answer's round trip after the boundary: milliseconds, seconds at worst)."""
STEP_LINE = "STEP "
"""Prefix of the pod's per-step JSON line (the test parses the pod's log)."""


def step_batch(workload: Any, index: int) -> dict[str, Any]:
    """The batch of replay step ``index`` that reaches ``update_actor``, and what it must count.

    :data:`GROUPS` groups of :data:`GROUP` samples at the trace's mean lengths over
    :data:`LENGTH_SCALE`, spread 0.5x-1.5x; group ``index % (GROUPS - 1)`` scores alike (DAPO
    drops it; it is among the ``GROUPS - 1`` groups the v1 trainer submits first, the last group
    comes with its refill) and one sample of the next group is aborted (no response token).

    Args:
        workload: the step's ``rlenergy.sim.workload.TokenWorkload``.
        index: the step's index in the replay.

    Returns:
        ``{"lengths", "prompts", "scores", "uids", "dropped_uid", "valid_tokens",
        "trained_samples"}``: per sample response and prompt tokens, sequence score and
        group; the dropped group; the response tokens of the kept samples and how many of them
        have a response.
    """
    n = GROUPS * GROUP
    per = max(workload.samples, 1)
    mean_len = max(4, round(workload.response_tokens / per / LENGTH_SCALE))
    mean_prompt = max(2, round(workload.prompt_tokens / per / LENGTH_SCALE))
    dropped = index % (GROUPS - 1)
    aborted = (dropped + 1) * GROUP
    lengths, prompts, scores, uids = [], [], [], []
    for i in range(n):
        spread = 0.5 + ((i * 7 + index) % n) / (n - 1)
        g = i // GROUP
        lengths.append(0 if i == aborted else max(1, round(mean_len * spread)))
        prompts.append(max(1, round(mean_prompt * spread)))
        scores.append(1.0 if g == dropped else float((i + g) % 2))
        uids.append(f"step{index}-g{g}")
    kept = [i for i in range(n) if i // GROUP != dropped]
    return {
        "lengths": lengths,
        "prompts": prompts,
        "scores": scores,
        "uids": uids,
        "dropped_uid": f"step{index}-g{dropped}",
        "valid_tokens": sum(lengths[i] for i in kept),
        "trained_samples": sum(1 for i in kept if lengths[i] > 0),
    }


def replay_document(job: Any, sku: Any) -> dict[str, Any]:
    """The JSON replay of a (time-compressed) ``rlenergy.sim.job.Job`` for the pod.

    Args:
        job: ``rlenergy.sim.job.Job``.
        sku: its ``rlenergy.gpu.models.GpuSku``.

    Returns:
        ``{"steps": [{"index", "other_time_s", "batch" (:func:`step_batch`), "phases":
        {phase: {"kind", "tokens", "progress_shape", "times_s": {effective MHz: s}}}}]}``.
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
                "batch": step_batch(w, step.index),
                "phases": phases,
            }
        )
    return {"steps": steps}


def tail_label(label: str) -> str:
    """Truth label of a phase's tail: its work is done, the GPUs idle until the next signal.

    Generation's tail is the reward gap (the hook still counts it as generation: the training
    signal ends it); training's is the rest of its last tick. A phase window's truth is its
    label's energy plus its tail's.
    """
    return f"{label}/tail"


def work_record(kind: str, label: str, boundary_s: float | None = None) -> bytes:
    """One line of the work log: the GPUs run ``kind`` from now on, booked to ``label``.

    ``boundary_s``: the agent's window boundary (``PhaseAnswer.boundaryMonotonicSeconds``):
    the energy the GPUs' counters gained after it is booked to ``label`` (``WorkFeed``).
    """
    record: dict[str, Any] = {"kind": kind, "label": label, "at": time.monotonic()}
    if boundary_s is not None:
        record["at"], record["boundary"] = boundary_s, True
    return (json.dumps(record) + "\n").encode()


class WorkFeed:
    """Host side: the simulated GPUs run what the trainer's work log says, when it says.

    The trainer appends :func:`work_record` lines to ``work_file`` (a hostPath for a pod);
    each tick the feed reads the new lines and, for each in order, advances the GPUs' counters
    to the record's time (``at``, CLOCK_MONOTONIC: the node's, shared with its pods) under the
    previous work, then switches the pod's GPUs to the record's kind and label, so every
    switch is booked when the trainer made it, not up to a tick later.

    Args:
        driver: the ``StandinDriver`` of the node.
        work_file: the trainer's work log.
        uuids: returns the trainer's GPU UUIDs (known once the device plugin allocated them).
        tick_s: counter update period, s.
    """

    def __init__(self, driver: Any, work_file: Path, uuids: Any, *, tick_s: float = 0.004) -> None:
        self.driver = driver
        self.work_file = work_file
        self.uuids = uuids
        self.tick_s = tick_s
        self.kinds_seen: list[str] = []
        self.kind = "idle"
        """What the trainer's GPUs run now (its last record)."""
        self.label = "idle"
        """The truth label the trainer's GPUs book to now (its last record)."""
        self._written: list[tuple[float, str, dict[str, float]]] = []
        """(when written, label, J per GPU) of each counter advance of the last
        ``WRITTEN_KEPT_S`` seconds."""
        self._log: IO[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="work-feed", daemon=True)

    def start(self) -> WorkFeed:
        """Start the physics loop."""
        self._thread.start()
        return self

    def _records(self) -> list[dict[str, Any]]:
        """The complete lines appended since the last read (the log opened once it exists)."""
        if self._log is None:
            try:
                self._log = self.work_file.open("rb")
            except OSError:
                return []
        data = self._log.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written: read it next tick
        self._log.seek(len(whole) - len(data), os.SEEK_CUR)
        return [json.loads(line) for line in whole.splitlines() if line.strip()]

    def _advance(self, uuids: Sequence[str], dt_s: float) -> None:
        """Advance the counters by ``dt_s`` and note when that energy was written, and to what."""
        before = [self.driver.truth_j(u) for u in uuids]
        self.driver.advance(dt_s)
        gained = [self.driver.truth_j(u) - b for u, b in zip(uuids, before, strict=True)]
        self._written.append((time.monotonic(), self.label, dict(zip(uuids, gained, strict=True))))
        horizon = self._written[-1][0] - WRITTEN_KEPT_S
        while self._written and self._written[0][0] < horizon:
            self._written.pop(0)

    def _rebook_after(self, boundary_s: float, label: str) -> None:
        """Book the energy written after the agent's boundary read to ``label``.

        The agent read the counters at ``boundary_s``; whatever this loop wrote after that
        moment is in the window the boundary opened, whenever this loop (a host thread, late on
        a busy machine) got to write it. A real GPU's counter is kept by the GPU, not by a
        thread the host's load can delay.
        """
        for i, (written_s, was, gained) in enumerate(self._written):
            if written_s > boundary_s and was != label:
                for u, j in gained.items():
                    self.driver.rebook(u, was, label, j)
                self._written[i] = (written_s, label, gained)

    def _run(self) -> None:
        last = time.monotonic()
        pending: list[dict[str, Any]] = []
        while not self._stop.wait(self.tick_s):
            pending += self._records()
            now = time.monotonic()
            uuids = tuple(self.uuids())
            for work in pending if uuids else ():
                at = min(max(float(work["at"]), last), now)
                self._advance(uuids, at - last)
                last = at
                self.driver.set_work(uuids, work["kind"], work["label"])
                self.label = str(work["label"])
                if work.get("boundary"):
                    self._rebook_after(float(work["at"]), self.label)
                self.kind = str(work["kind"])
                self.kinds_seen.append(work["label"])
            if uuids:
                pending = []
                self._advance(uuids, now - last)
            else:
                self.driver.advance(now - last)
            last = now

    def stop(self) -> None:
        """Stop the loop."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._log is not None:
            self._log.close()


def step_records(log: str) -> list[dict[str, Any]]:
    """The per-step records a trainer printed (its :data:`STEP_LINE` lines), in order."""
    return [
        json.loads(line.removeprefix(STEP_LINE))
        for line in log.splitlines()
        if line.startswith(STEP_LINE)
    ]


def step_record_mismatches(
    record: Mapping[str, Any], spec: Mapping[str, Any], *, dapo_evicts: bool = True
) -> list[str]:
    """What a trainer's step record (:func:`step_records`) gets wrong against its replay step.

    Checked: the DAPO-dropped group is out of the trained batch (and, with ``dapo_evicts``, verl's
    replay buffer counted an eviction: the v1 trainer's ``training/filter_groups/
    evicted_samples``), the valid tokens and trained samples are the replay batch's own count,
    one aborted sample, verl's own ``actor/pg_loss`` beside the hook's keys, the generated tokens
    are the phase's decoded tokens (relative 1e-6) and the energy per valid token is the phases'
    energy over the valid tokens.

    Returns:
        One line per mismatch (empty: the record is right).
    """
    m, batch = record["metrics"], spec["batch"]
    wrong = []
    if batch["dropped_uid"] in record["kept_uids"] or len(record["kept_uids"]) != GROUPS - 1:
        wrong.append(f"kept groups {record['kept_uids']} (dropped {batch['dropped_uid']})")
    if dapo_evicts and not m.get("training/filter_groups/evicted_samples", 0) >= 1:
        wrong.append("verl's replay buffer evicted no sample")
    for key, want in (
        ("valid_tokens", batch["valid_tokens"]),
        ("trained_samples", batch["trained_samples"]),
        ("aborted_samples", 1),
    ):
        if m.get(f"rlenergy/{key}") != want:
            wrong.append(f"rlenergy/{key} {m.get(f'rlenergy/{key}')} != {want}")
    if "actor/pg_loss" not in m:
        wrong.append(f"no actor/pg_loss among {sorted(m)}")
    tokens = spec["phases"]["generation"]["tokens"]
    if abs(m.get("rlenergy/generated_tokens", -1) - tokens) > 1e-6 * abs(tokens):
        wrong.append(f"rlenergy/generated_tokens {m.get('rlenergy/generated_tokens')} != {tokens}")
    joules = [m.get(f"rlenergy/energy/{ph}_j", 0) for ph in PHASES]
    if not all(j > 0 for j in joules):
        wrong.append(f"phase energies {joules} not all > 0")
    elif m.get("rlenergy/valid_tokens"):
        per_token = sum(joules) / m["rlenergy/valid_tokens"]
        if abs(m.get("rlenergy/energy_per_valid_token_j", -1) - per_token) > 1e-6 * per_token:
            wrong.append(f"energy_per_valid_token_j {m.get('rlenergy/energy_per_valid_token_j')}")
    return wrong


def _time_at(times: Mapping[str, float], clock_mhz: float) -> float:
    """Phase time at the effective clock: the entry of the nearest tabulated clock."""
    best = min(times, key=lambda k: abs(int(k) - clock_mhz))
    return times[best]


class PhaseWork:
    """One phase's work, closed-loop on the GPUs' clock: ``done += dt / T(f)`` per tick.

    Args:
        times_s: the phase's time at each effective clock (``replay_document``).
        clock: the GPUs' SM clock now, MHz.
    """

    def __init__(self, times_s: Mapping[str, float], clock: Callable[[], float]) -> None:
        self.times_s = times_s
        self.clock = clock
        self.done = 0.0
        self.clocks: dict[int, float] = {}
        """Seconds of the phase at each SM clock read, MHz."""
        self.start = self.last = time.monotonic()

    def until(self, fraction: float, each: Callable[[float], None] | None = None) -> None:
        """Tick until ``fraction`` of the work is done, calling ``each(done)`` every tick."""
        while self.done < fraction:
            time.sleep(TICK_S)
            now = time.monotonic()
            f = self.clock()
            self.clocks[int(f)] = self.clocks.get(int(f), 0.0) + now - self.last
            self.done = min(self.done + (now - self.last) / _time_at(self.times_s, f), 1.0)
            self.last = now
            if each is not None:
                each(self.done)


def _work_for(progress: float, shape: float) -> float:
    """The work fraction at which ``reported_progress`` reaches ``progress`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if reported_progress(mid, shape) < progress else (lo, mid)
    return hi


def run(
    replay: Mapping[str, Any],
    work_file: Path,
    uuids: Sequence[str],
    *,
    max_steps: int = 0,
    loop: bool = False,
    trainer: str = "v1",
    ray_start_lock: Path | None = None,
) -> list[dict[str, Any]]:
    """Run every replay step through verl's hooked methods; returns each step's record.

    Steps are numbered from 1, as verl's ``global_steps``. With ``loop`` the replay starts
    over (step numbers go on) until the process is stopped. ``trainer``: one of
    :data:`TRAINERS`; ``ray_start_lock``: see ``verlv1.start_transfer_queue``.
    """
    from rlenergy_agent.nvml import lib  # noqa: PLC0415 - pynvml, only in the pod

    from rlenergy.sdk import verl_hook  # noqa: PLC0415

    verl_hook.install()  # what Ray's worker_process_setup_hook runs, before verl is used
    from rlenergy_dev import verlrank  # noqa: PLC0415 - torch and verl, in the pod

    verlrank.use_cpu()
    lib.init()
    handles = [lib.handle_by_uuid(u) for u in uuids]

    def clock() -> float:
        return float(min(lib.clock_mhz(h, lib.CLOCK_SM) for h in handles))

    log_fd = os.open(work_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def work(kind: str, label: str, boundary_s: float | None = None) -> None:
        # one write of one line: atomic on append
        os.write(log_fd, work_record(kind, label, boundary_s))

    _label_at_signals(verl_hook.hook(), work)
    engine = verlrank.CpuEngine(chunk_tokens=32)
    verl_hook.patch_engine_server(verlrank.VllmServer, "vllm")  # as install does on its import
    if trainer == "v1":
        rank: _Rank = _V1Rank(verlrank, engine, clock, work, ray_start_lock)
    else:
        rank = _Rank(verlrank, engine, clock, work)
    asyncio.run(rank.vllm.launch_server())  # publishes its /metrics for the pod's hook
    out = []
    steps = replay["steps"][: max_steps or None]
    rounds = 0
    try:
        while True:
            for step in steps:
                out.append(rank.step(rounds * len(steps) + int(step["index"]) + 1, step))
                print(STEP_LINE + json.dumps(out[-1]), flush=True)
            rounds += 1
            if not loop:
                break
    finally:
        rank.close()
        lib.shutdown()
        os.close(log_fd)
    return out


def _label_at_signals(hook: Any, work: Callable[..., None]) -> None:
    """Book the GPUs' energy to the phase the agent was told, from the moment it was told.

    Wraps the hook's ``client.phase`` so that the truth label switches where the agent's window
    does: at the moment the agent read the GPUs' counters for the boundary, which its answer
    carries (``boundaryMonotonicSeconds``; the answer's arrival, later by the round trip and
    by a busy machine's scheduling, without it). The GPUs idle until the phase's work starts
    (decoding once the weights are in, the engine's first forward chunk).
    Each window's truth is then its label's energy plus its tail's (:func:`tail_label`).
    """
    signal = hook.client.phase

    def phase(name: str, *, step: int) -> Any:
        hook.client.last_response = {}
        out = signal(name, step=step)
        at = hook.client.last_response.get("boundaryMonotonicSeconds")
        boundary = float(at) if isinstance(at, int | float) else None
        work("idle", f"{name}-{step}", boundary)  # the phase's own work switches the kind
        return out

    hook.client.phase = phase


class _Rank:
    """The pod's verl rank: a worker, the driver's update path and a vLLM server.

    The legacy trainer's step (``trainer.use_v1=false``): the driver's ``RayPPOTrainer.
    _update_actor`` on the batch ``RayPPOTrainer.fit`` holds, DAPO's groups dropped by
    ``verlrank.dapo_keep``. :class:`_V1Rank` runs verl's default trainer instead.
    """

    def __init__(self, verlrank: Any, engine: Any, clock: Any, work: Any) -> None:
        self.verlrank = verlrank
        self.engine = engine
        self.worker = verlrank.make_worker(engine)
        self.trainer = verlrank.make_trainer(self.worker)
        self.vllm = verlrank.VllmServer()
        self.clock = clock
        self.work = work

    def close(self) -> None:
        """Stop what the rank started."""
        self.vllm.close()

    def generate(self, s: int, step: Mapping[str, Any], record: dict[str, Any]) -> None:
        """Generation of step ``s``: decoding closed-loop on the clock, then the reward gap."""
        gen = step["phases"]["generation"]
        self.work(gen["kind"], f"generation-{s}")  # the rollout decodes once weights are in
        phase = PhaseWork(gen["times_s"], self.clock)
        self.vllm.hold(len(step["batch"]["lengths"]))
        decoded = [0.0]

        def decode(done: float) -> None:
            total = gen["tokens"] * reported_progress(done, gen["progress_shape"])
            self.vllm.decode(total - decoded[0])
            decoded[0] = total

        phase.until(1.0, decode)
        self.vllm.hold(0)
        self.work("idle", tail_label(f"generation-{s}"))
        record["seconds"]["generation"] = phase.last - phase.start
        record["clocks"]["generation"] = phase.clocks
        time.sleep(step["other_time_s"])  # reward: still generation to the hook, as in verl

    def pace_training(self, s: int, step: Mapping[str, Any], tokens: int) -> list[PhaseWork]:
        """Pace the engine's forward chunks on the training phase's work (``tokens`` in all).

        Returns the phase's work, filled in at the engine's first forward chunk.
        """
        train = step["phases"]["training"]
        base = self.engine.forwarded
        training: list[PhaseWork] = []

        def pace(call: str, n: int) -> None:
            if not training:  # the engine's first forward chunk: the GPUs start training
                self.work(train["kind"], f"training-{s}")
                training.append(PhaseWork(train["times_s"], self.clock))
            fraction = _work_for((n - base) / tokens, train["progress_shape"])
            training[0].until(fraction)
            if fraction >= 1.0:  # done: the GPUs idle until the step's end signal
                self.work("idle", tail_label(f"training-{s}"))

        self.engine.pace = pace
        return training

    @staticmethod
    def finish(
        record: dict[str, Any], training: list[PhaseWork], metrics: Mapping[str, Any]
    ) -> None:
        """Put the training phase's time and clocks and verl's scalar metrics in ``record``."""
        record["seconds"]["training"] = training[0].last - training[0].start
        record["clocks"]["training"] = training[0].clocks
        record["metrics"] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}

    def step(self, s: int, step: Mapping[str, Any]) -> dict[str, Any]:
        """Step ``s``: generation (weights in, decode), the reward gap, training."""
        from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: PLC0415
        from verl.workers.utils.padding import left_right_2_no_padding  # noqa: PLC0415

        record: dict[str, Any] = {"step": s, "seconds": {}, "clocks": {}}
        asyncio.run(self.verlrank.weights_done(self.worker, s - 1))  # generation of step s
        self.generate(s, step, record)
        spec = step["batch"]
        batch = self.verlrank.batch_of(
            spec["lengths"], spec["prompts"], spec["scores"], spec["uids"]
        )
        batch = batch[self.verlrank.dapo_keep(batch)]
        tokens = 2 * int(batch.batch["attention_mask"].sum())  # log-prob pass + update pass
        training = self.pace_training(s, step, tokens)
        td = left_right_2_no_padding(batch.to_tensordict())
        ActorRolloutRefWorker.compute_log_prob(self.worker, td)  # the hook enters training
        metrics = self.trainer._update_actor(batch).meta_info["metrics"]  # ends the step
        self.engine.pace = None
        self.finish(record, training, metrics)
        record["kept_uids"] = sorted(set(batch.non_tensor_batch["uid"]))
        return record


class _SpecRollout:
    """The v1 trainer's agent loop manager, scripted by the replay's batch.

    ``generate_sequences`` is what ``AgentLoopManagerTQ.generate_sequences`` does with vLLM
    faked: the step's first submission runs the generation phase (``_Rank.generate``: decoding
    closed-loop on the clock, the reward gap); then each submitted prompt gets the next group
    of the replay's batch (``step_batch``), written to TransferQueue
    (``verlv1.put_group``), and once those are used up a group that scores alike (DAPO's
    ``filter_groups`` evicts it). The first ``GROUPS - 1`` groups hold the dropped one; the
    replay buffer's refill (two prompts per evicted group in sync mode) gets the last group
    and one that scores alike, so the batch the step trains on is the replay batch's kept
    groups.

    Attributes:
        written: trajectory key -> (prompt tokens, response tokens) of the step.
        spec_uids: the trainer's prompt uid -> the replay batch's group uid.
    """

    def __init__(self, rank: _Rank, verlv1: Any) -> None:
        self.rank = rank
        self.verlv1 = verlv1
        self.written: dict[str, tuple[int, int]] = {}
        self.spec_uids: dict[str, str] = {}
        self._step: tuple[int, Mapping[str, Any], dict[str, Any]] | None = None
        self._next = 0

    def begin(self, s: int, step: Mapping[str, Any], record: dict[str, Any]) -> None:
        """Script step ``s`` from the replay's ``step``; ``record`` gets the generation's time."""
        self._step, self._next = (s, step, record), 0
        self.written, self.spec_uids = {}, {}

    def generate_sequences(self, prompts: Any) -> None:
        """Generate the submitted prompts' groups into TransferQueue."""
        assert self._step is not None, "begin() first"
        s, step, record = self._step
        if self._next == 0:
            self.rank.generate(s, step, record)
        spec = step["batch"]
        for uid in list(prompts["uid"]):
            g, self._next = self._next, self._next + 1
            members = range(g * GROUP, (g + 1) * GROUP)
            if g < GROUPS:
                samples = [
                    (spec["prompts"][i], spec["lengths"][i], spec["scores"][i]) for i in members
                ]
                self.spec_uids[uid] = f"step{step['index']}-g{g}"
            else:  # a refill past the replay's batch: alike scores, evicted
                samples = [(spec["prompts"][0], max(spec["lengths"]), 1.0)] * GROUP
                self.spec_uids[uid] = f"step{step['index']}-surplus{g}"
            self.written.update(self.verlv1.put_group(uid, samples, s))


class _V1Rank(_Rank):
    """The pod's verl rank on verl 0.9.1's default (v1) trainer, ``trainer_mode`` ``sync``.

    verl's real ``PPOTrainerSync`` (``rlenergy_dev.verlv1``) over real TransferQueue on a
    local Ray in this process: per step the driver's ``prepare_step`` submits the step's
    prompts, its ``ReplayBuffer`` (DAPO's ``filter_groups``: evicts the group that scores
    alike, refills through ``_add_prompts_to_generate``) hands the step its batch, the
    worker's ``compute_log_prob`` (``_compute_old_log_prob``'s call, through ``tqbridge``) and
    the driver's ``PPOTrainer._update_actor`` train on it, and ``fit``'s cleanup clears it.
    """

    def __init__(
        self, verlrank: Any, engine: Any, clock: Any, work: Any, start_lock: Path | None = None
    ) -> None:
        super().__init__(verlrank, engine, clock, work)
        from rlenergy_dev import verlv1  # noqa: PLC0415 - Ray and TransferQueue, in the pod

        self.verlv1 = verlv1
        # the controller and one storage unit: two actors, two Ray CPUs (the lightest Ray)
        verlv1.start_transfer_queue(num_cpus=2, storage_units=1, start_lock=start_lock)
        self.rollout = _SpecRollout(self, verlv1)
        self.trainer = verlv1.v1_trainer(
            "sync",
            verlv1.v1_worker(self.worker),
            self.rollout,
            group=GROUP,
            prompts_per_step=GROUPS - 1,
        )

    def close(self) -> None:
        """Stop the vLLM server, TransferQueue and Ray."""
        super().close()
        self.verlv1.stop_transfer_queue()

    def step(self, s: int, step: Mapping[str, Any]) -> dict[str, Any]:
        """Step ``s`` of the v1 trainer: weights in, generation, the replay buffer, training."""
        record: dict[str, Any] = {"step": s, "seconds": {}, "clocks": {}}
        # on_init_end / the previous step's on_step_end: the weights go in, generation of step s
        asyncio.run(self.verlrank.weights_done(self.worker, s - 1))
        self.trainer.global_steps = s
        self.rollout.begin(s, step, record)
        self.trainer.prepare_step()  # registers the step's prompts; the rollout generates them
        batch, metrics = self.trainer.replay_buffer.sample(
            global_steps=s, partition_id=self.verlv1.PARTITION, batch_size=GROUPS - 1
        )
        lengths = [self.rollout.written[k] for k in batch.keys]
        tokens = 2 * sum(p + r for p, r in lengths)  # log-prob pass + update pass
        training = self.pace_training(s, step, tokens)
        self.trainer.actor_rollout_wg.compute_log_prob(batch)  # the hook enters training
        self.trainer._update_actor(batch, metrics)  # verl's v1 method: ends the step
        self.engine.pace = None
        self.finish(record, training, metrics)
        uids = {k.split("_")[0] for k in batch.keys}
        record["kept_uids"] = sorted(self.rollout.spec_uids[u] for u in uids)
        self.verlv1.clear(batch)  # fit's cleanup
        return record


TRAINERS = ("v1", "legacy")
"""``--trainer``: verl 0.9.1's default v1 trainer (:class:`_V1Rank`), or the legacy
``RayPPOTrainer`` (:class:`_Rank`)."""


def visible_gpus() -> list[str]:
    """UUIDs of this container's GPUs, as a CUDA workload finds them.

    ``NVIDIA_VISIBLE_DEVICES`` when it lists GPU UUIDs (a device plugin's ``envvar``
    strategy); else NVML's enumeration, which in a container lists the GPUs its devices gave it
    (the ``cdi-cri`` strategy sets no env). Empty when there is none or NVML is not loadable.
    """
    env = os.environ.get("NVIDIA_VISIBLE_DEVICES", "")
    listed = [u for u in env.split(",") if u.startswith(("GPU-", "MIG-"))]
    if listed:
        return listed
    from rlenergy_agent.nvml import lib  # noqa: PLC0415 - pynvml, only in the pod

    try:
        lib.init()
    except (lib.NvmlUnavailableError, lib.NvmlCallError):
        return []
    try:
        return [lib.uuid(lib.handle_by_index(i)) for i in range(lib.device_count())]
    finally:
        lib.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """``python3 -m rlenergy_dev.podtrainer --replay FILE --work-file FILE``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--replay", type=Path, required=True, help="replay JSON (from the host)")
    parser.add_argument("--work-file", type=Path, required=True, help="work log, for the host")
    parser.add_argument("--steps", type=int, default=0, help="replay only the first N steps")
    parser.add_argument("--loop", action="store_true", help="start over until stopped")
    parser.add_argument(
        "--trainer",
        choices=TRAINERS,
        default="v1",
        help="verl's default v1 trainer (sync mode) or the legacy RayPPOTrainer",
    )
    parser.add_argument(
        "--ray-start-lock",
        type=Path,
        help="lock this file while starting the v1 trainer's local Ray (ranks of one machine)",
    )
    args = parser.parse_args(argv)
    uuids = visible_gpus()
    if not uuids:
        parser.error("no GPU visible (NVML lists none): the pod got no nvidia.com/gpu")
    replay = json.loads(args.replay.read_text())
    run(
        replay,
        args.work_file,
        uuids,
        max_steps=args.steps,
        loop=args.loop,
        trainer=args.trainer,
        ray_start_lock=args.ray_start_lock,
    )
    print("replay done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
