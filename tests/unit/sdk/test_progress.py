"""Progress sources: the pinned engines' counters parsed from their real expositions.

vLLM 0.33.0 registers ``vllm:generation_tokens`` (labels ``model_name``, ``engine``) with
prometheus-client in the frontend process; SGLang 0.5.23 runs its scheduler in child processes
that write ``sglang:realtime_tokens`` (labels ``model_name``, ``engine_type``, ``tp_rank``,
``pp_rank``, ``moe_ep_rank``, ``mode``) to ``PROMETHEUS_MULTIPROC_DIR``, and its HTTP server
exposes them through ``multiprocess.MultiProcessCollector``. The tests build both expositions
the same way, with prometheus-client itself, and read them over 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import multiprocess

from rlenergy.sdk import progress


def _vllm_registry(tokens: dict[str, float]) -> prometheus_client.CollectorRegistry:
    reg = prometheus_client.CollectorRegistry()
    c = prometheus_client.Counter(
        name="vllm:generation_tokens",
        documentation="Number of generation tokens processed.",
        labelnames=["model_name", "engine"],
        registry=reg,
    )
    prompt = prometheus_client.Counter(
        name="vllm:prompt_tokens",
        documentation="Number of prefill tokens processed.",
        labelnames=["model_name", "engine"],
        registry=reg,
    )
    for engine, n in tokens.items():
        c.labels("m", engine).inc(n)
        prompt.labels("m", engine).inc(10 * n)  # never counted as decode progress
    return reg


def test_vllm_counter_is_summed_over_engines_and_from_the_registry() -> None:
    reg = _vllm_registry({"0": 120.0, "1": 80.0})
    text = prometheus_client.generate_latest(reg).decode()
    assert "vllm:generation_tokens_total{" in text  # the sample name users scrape
    assert progress.decoded_tokens(text, "vllm") == 200.0
    assert progress.RegistryExposition("vllm", reg).total() == 200.0


def test_missing_counter_and_bad_text_are_unavailable_not_zero() -> None:
    text = prometheus_client.generate_latest(_vllm_registry({"0": 5.0})).decode()
    with pytest.raises(progress.ProgressUnavailable, match="sglang:realtime_tokens_total"):
        progress.decoded_tokens(text, "sglang")
    with pytest.raises(progress.ProgressUnavailable, match="not a Prometheus exposition"):
        progress.decoded_tokens("vllm:generation_tokens_total{ 1\n", "vllm")
    with pytest.raises(ValueError, match="use one of"):
        progress.decoded_tokens(text, "tgi")
    with pytest.raises(progress.ProgressUnavailable, match="127.0.0.1"):
        progress.HttpExposition("http://127.0.0.1:9/metrics", "vllm", timeout_s=0.2).total()


_SGLANG_SCHEDULER = textwrap.dedent(
    """
    import sys
    from prometheus_client import Counter
    rank = sys.argv[1]
    c = Counter(
        name="sglang:realtime_tokens",
        documentation="Total number of tokens processed (updated on each log interval). "
        "mode: prefill_compute, prefill_cache, decode.",
        labelnames=["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "mode"],
    )
    labels = dict(model_name="m", engine_type="unified", tp_rank=rank, pp_rank="0",
                  moe_ep_rank="0")
    c.labels(**labels, mode="prefill_compute").inc(1000)
    c.labels(**labels, mode="prefill_cache").inc(500)
    for _ in range(int(sys.argv[2])):
        c.labels(**labels, mode="decode").inc(64)
    """
)


def test_sglang_decode_counter_from_its_multiprocess_exposition(tmp_path: Path) -> None:
    mp = tmp_path / "prom"
    mp.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp)}
    for rank, iters in (("0", 10), ("1", 5)):  # two TP ranks' scheduler processes
        subprocess.run(
            [sys.executable, "-c", _SGLANG_SCHEDULER, rank, str(iters)], env=env, check=True
        )
    reg = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(mp))
    server, _ = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        # Decode only: prefill modes are not decode progress.
        assert progress.HttpExposition(url, "sglang").total() == 64.0 * 15
    finally:
        server.shutdown()
        server.server_close()


class _Counter:
    def __init__(self) -> None:
        self.value = 1000.0
        self.fail = False

    def total(self) -> float:
        if self.fail:
            raise progress.ProgressUnavailable("gone")
        return self.value


def test_reporter_sends_the_phase_total_from_its_zero_and_a_final_value() -> None:
    src = _Counter()
    sent: list[float] = []
    rep = progress.ProgressReporter(src, sent.append, period_s=0.01)
    rep.start()  # the engine's counter is cumulative since it started: 1000 is the zero
    src.value = 1100.0
    deadline = time.monotonic() + 5
    while (not sent or sent[-1] < 100.0) and time.monotonic() < deadline:
        time.sleep(0.005)
    src.value = 1250.0
    rep.stop()
    assert sent[-1] == 250.0  # the last value goes out when the phase ends
    assert all(0.0 <= v <= 250.0 for v in sent) and sent == sorted(sent)
    n = rep.reports
    rep.stop()  # idempotent: no thread, nothing more sent
    assert rep.reports == n
    with pytest.raises(ValueError, match="period_s"):
        progress.ProgressReporter(src, sent.append, period_s=0)


def test_reporter_sends_nothing_for_a_source_it_cannot_read() -> None:
    src = _Counter()
    src.fail = True
    sent: list[float] = []
    rep = progress.ProgressReporter(src, sent.append, period_s=0.005)
    rep.start()
    time.sleep(0.05)
    rep.stop()
    assert sent == [] and rep.reports == 0 and rep.last_error == "gone"


def test_reporter_reads_at_20_hz_or_more_under_a_busy_thread() -> None:
    src = _Counter()
    stamps: list[float] = []
    rep = progress.ProgressReporter(src, lambda v: stamps.append(time.monotonic()))
    stop = threading.Event()

    def busy() -> None:  # a Python thread holding the GIL in bursts (the trainer's loop)
        while not stop.is_set():
            sum(range(20_000))

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    rep.start()
    time.sleep(1.0)
    rep.stop()
    stop.set()
    t.join()
    assert len(stamps) >= 20  # 50 Hz asked; at least 20 Hz with the GIL contended


def test_held_requests_sum_running_and_waiting_of_both_engines() -> None:
    for engine, running, waiting in (
        ("vllm", "vllm:num_requests_running", "vllm:num_requests_waiting"),
        ("sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs"),
    ):
        reg = prometheus_client.CollectorRegistry()
        r = prometheus_client.Gauge(running, "r", ["model_name", "rank"], registry=reg)
        w = prometheus_client.Gauge(waiting, "w", ["model_name", "rank"], registry=reg)
        r.labels("m", "0").set(3)
        r.labels("m", "1").set(2)
        w.labels("m", "0").set(4)
        text = prometheus_client.generate_latest(reg).decode()
        assert progress.held_requests(text, engine) == 9.0
        with pytest.raises(progress.ProgressUnavailable, match=running):
            progress.held_requests("", engine)


class _Activity:
    def __init__(self) -> None:
        self.held = 0.0
        self.tokens = 500.0
        self.fail = False

    def activity(self) -> tuple[float, float]:
        if self.fail:
            raise progress.ProgressUnavailable("engine gone")
        return self.held, self.tokens


class _Signals:
    def __init__(self) -> None:
        self.sent: list[tuple[str, float]] = []

    def phase(self, name: str, *, step: int) -> None:
        self.sent.append((name, step))

    def progress_total(self, total: float, *, in_flight: int | None = None) -> None:
        self.sent.append(("progress", total))
        self.in_flight = in_flight


def test_rollout_pool_phases_follow_the_engine_and_the_weight_version() -> None:
    src, sig, now = _Activity(), _Signals(), [0.0]
    pool = progress.RolloutPoolPhases(src, sig, step=3, idle_after_s=0.1, clock=lambda: now[0])
    pool.tick()
    assert sig.sent == []  # nothing held: no phase
    src.held = 5.0
    pool.tick()
    assert sig.sent == [("generation", 3), ("progress", 0.0)]  # 500 is this window's zero
    assert sig.in_flight == 5  # the engine's held requests go along (stall watch)
    src.tokens = 800.0
    pool.set_step(4)  # update_weights(global_steps=4) while generating: a new window
    pool.tick()
    assert sig.sent[2:] == [("progress", 300.0), ("generation", 4), ("progress", 0.0)]
    sig.sent.clear()
    src.held, src.tokens = 0.0, 850.0
    now[0] = 1.0
    pool.tick()  # the queue empties: tokens still counted, the window stays open
    now[0] = 1.05
    pool.tick()
    assert sig.sent == [("progress", 50.0)]
    now[0] = 1.11
    pool.tick()
    assert sig.sent[1:] == [("progress", 50.0), ("idle", 4)]
    sig.sent.clear()
    src.fail = True
    pool.tick()
    assert sig.sent == [] and pool.last_error == "engine gone"
    assert pool.windows == 2


def test_phase_progress_makes_its_source_once_and_returns_each_phase_total() -> None:
    src = _Counter()
    made: list[object] = []

    def make(worker: object) -> _Counter:
        made.append(worker)
        return src

    sent: list[float] = []
    pp = progress.PhaseProgress(make, period_s=0.005)
    assert pp.end() is None  # no phase begun
    for phase_tokens in (40.0, 70.0):
        pp.begin("worker", sent.append)
        src.value += phase_tokens
        assert pp.end() == phase_tokens and sent[-1] == phase_tokens
    assert made == ["worker"]

    def missing(worker: object) -> progress.ProgressSource:
        return progress.ForwardTokenCounter(progress.verl_actor_module(worker))

    class Worker:  # verl's worker before init_model: no actor engine yet
        actor = None

    blind = progress.PhaseProgress(missing)
    blind.begin(Worker(), sent.append)
    assert blind.end() is None and "no 'actor'" in (blind.last_error or "")
