"""Training progress from a real torch forward hook, at 50 Hz, into a real agent's probe slices.

A small CPU torch causal LM (embedding, two transformer-style MLP blocks, LM head) trains on
packed micro-batches the way verl's dp_actor calls its actor module
(``actor_module(input_ids=..., position_ids=..., use_cache=False)`` on a (1, total_nnz) batch
with ``use_remove_padding``); ``rlenergy.sdk.progress.ForwardTokenCounter`` hooks the module and
``ProgressReporter`` sends the trained tokens to the node agent while it runs the training phase
as probe slices. The CPU's speed does not follow the stand-in's SM clock, so the paired
throughput ratio of the blocks is about 1: what is tested is that progress arrives at the
cadence the probes need and that EE-RL's trial takes its blocks.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from agent_support import DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import server, service

from rlenergy.api import node as api_node
from rlenergy.api import workload as api_workload
from rlenergy.control.freq import aggregate, base, eerl, probe
from rlenergy.sdk import progress

POD = service.PodRef("team-a", "actor-0", "11111111-2222-3333-4444-555555555555")
SLICE_S = 0.2
SCHEDULE = probe.block_schedule([1200, 1200])


class TinyLM(torch.nn.Module):
    """A causal-LM-shaped module called like verl calls the actor (keyword ``input_ids``)."""

    def __init__(self, vocab: int = 512, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.Sequential(
            *[
                torch.nn.Sequential(
                    torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
                )
                for _ in range(2)
            ]
        )
        self.head = torch.nn.Linear(dim, vocab)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = False
    ) -> torch.Tensor:
        return self.head(self.blocks(self.embed(input_ids)))


def _plan() -> api_node.ClockPlan:
    return api_node.ClockPlan(
        step=0,
        phases=[
            api_node.PhasePlan(phase="generation", clockMHz=None, state="locked"),
            api_node.PhasePlan(
                phase="training",
                clockMHz=None,
                state="trial",
                probeClocksMHz=list(SCHEDULE),
                probeSliceSeconds=SLICE_S,
            ),
        ],
    )


def test_forward_hook_counts_trained_tokens_into_the_probe_slices(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a small model on a shared CPU: no thread oversubscription
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    counter = progress.ForwardTokenCounter(model)
    drv = make_driver(2)
    agent = standin_agent({POD: list(drv.uuids)}, _plan(), time.monotonic)
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    agent.start_prober()
    trained = 0
    batches = 0

    def micro_batch(nnz: int) -> None:
        ids = torch.randint(0, 512, (1, nnz))
        logits = model(input_ids=ids, position_ids=torch.arange(nnz)[None], use_cache=False)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()

    micro_batch(32)  # torch's first pass sets up its kernels; before the phase, so not in it
    try:
        client = reviews.client(sock, POD, short_tmp, strict=True)
        reporter = progress.ProgressReporter(counter, client.progress_total)
        drv.set_work(drv.uuids, "training", "train")
        client.phase("training", step=0)
        reporter.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < len(SCHEDULE) * SLICE_S + 0.05:
            nnz = int(torch.randint(16, 48, ()).item())  # packed samples of varying length
            micro_batch(nnz)
            # On a GPU the host waits on kernels with the GIL released; on this CPU model the
            # loop would hold it and delay the in-process agent's slice switches.
            time.sleep(0.002)
            trained += nnz
            batches += 1
        reporter.stop()
        elapsed = time.monotonic() - t0
        client.phase("idle", step=0)
        client.end_step(
            0, samples=batches, response_tokens=trained, prompt_tokens=0, valid_tokens=trained
        )
        client.close()
    finally:
        agent.stop_prober()
        srv.stop()
        counter.remove()

    # The hook counted every token and micro-batch of the forward passes, nothing else.
    assert counter.total() == 32 + trained and counter.micro_batches == 1 + batches
    model(input_ids=torch.zeros((1, 5), dtype=torch.long), position_ids=torch.arange(5)[None])
    assert counter.total() == 32 + trained  # removed: no more counting
    # Reports at 20 Hz or more over the phase; each full slice carries trained tokens.
    assert reporter.reports >= elapsed / 0.05
    rec = agent.report().steps[0]
    train = next(p for p in rec.phases if p.phase == "training")
    assert train.progress == trained
    assert train.progress_mean_gap_seconds is not None and train.progress_mean_gap_seconds <= 0.05
    assert [s.clock_mhz for s in train.slices][: len(SCHEDULE)] == list(SCHEDULE)
    assert all(s.progress > 0 for s in train.slices[: len(SCHEDULE)])
    # EE-RL's probe reads paired blocks from these slices (the CPU does not slow at the
    # stand-in's clock, so their ratios are only noise around 1), and its trial keeps in-phase
    # evidence for this cadence.
    obs = aggregate.job_step(0, [agent.report()]).observation
    # (min_fraction 0.5: the in-process agent's switches jitter with this CPU loop; the agent
    # process of a real node is not in the trainer's process)
    blocks, _ = probe.blocks_from_slices(obs.phases["training"].slices, min_fraction=0.5)
    assert blocks and all(clock == 1200 and thr > 0 for clock, thr, _ in blocks), [
        (s.clock_mhz, round(s.duration_s, 3), s.progress) for s in obs.phases["training"].slices
    ]
    clocks = tuple(range(1980, 990, -15))
    ctl = eerl.EERLController(
        [eerl.PhaseSettings("training", 0.9, (1785, 1590, 1395, 1200), clocks, 1980)],
        eerl.ControllerSettings(warmup_steps=2),
    )
    for step in range(2):
        work = api_workload.TokenWorkload(64, 1e5 * (1 + step), 1e4, 1e5, 2000.0)
        warm = base.PhaseObservation(
            "training", 1.7 * (1 + step), 1e3 * (1 + step), None, 1980, progress_gap_s=0.02
        )
        ctl.observe(base.StepObservation(step, work, {"training": warm}))
    ctl.observe(base.StepObservation(2, obs.workload, {"training": obs.phases["training"]}))
    assert ctl.phases["training"].probe_evidence.startswith("in-phase slices")
