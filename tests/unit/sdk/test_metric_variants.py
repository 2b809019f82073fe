"""Engine metrics as engines really serve them: real expositions, other namings, ranks that go.

The vLLM 0.33.0 and SGLang 0.5.23 expositions here are generated with prometheus-client from
the pinned wheels' own metric definitions (``make engine-wheels``; read with ``ast``, nothing
installed): every Counter / Gauge / Histogram / Summary whose name and label names the source
states (``vllm/v1/metrics/loggers.py`` ``PrometheusStatLogger``, labels ``model_name`` and
``engine`` as its ``__init__`` assigns them; ``sglang/srt/observability/metrics_collector.py``,
the scheduler's labels as its ``SchedulerMetricsCollector`` factory builds them). Every metric
the source defines carries a value, so a source that read a neighbour (prompt tokens, the
per-request generation-token histogram, SGLang's finished-request counter) would be caught.
The other namings (``progress.VARIANTS``) are produced from the same definitions by the rename
their source applies (Ray's wrappers' ``_get_sanitized_opentelemetry_name`` and Ray's ``ray_``
prefix), or written from the router's metric module (vLLM production-stack).
"""

from __future__ import annotations

import ast
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from test_engine_source import _source

from rlenergy.sdk import pod_engines, progress

KINDS = {
    "_counter_cls": prometheus_client.Counter,
    "_gauge_cls": prometheus_client.Gauge,
    "_histogram_cls": prometheus_client.Histogram,
    "Counter": prometheus_client.Counter,
    "Gauge": prometheus_client.Gauge,
    "Histogram": prometheus_client.Histogram,
    "Summary": prometheus_client.Summary,
}
SGLANG_LABELS = {
    "model_name": "m",
    "engine_type": "unified",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
    "dp_rank": "0",
}
"""The scheduler collector's labels (``metrics_collector.py``, the ``labels`` dict built before
``scheduler_collector_cls(labels=...)``, with ``dp_rank`` under data parallelism)."""


def _vllm_labelnames() -> list[str]:
    tree = _source("vllm", "vllm/v1/metrics/loggers.py")
    cls = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name == "PrometheusStatLogger"
    )
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "labelnames"
        ):
            names = ast.literal_eval(node.value)
            assert isinstance(names, list)
            return [str(n) for n in names]
    raise AssertionError("PrometheusStatLogger assigns no labelnames")


class Wheel:
    """A registry holding every metric an engine module defines, renamed by ``rename``."""

    def __init__(
        self,
        engine: str,
        module: str,
        namespace: dict[str, Any],
        rename: Callable[[str], str] = lambda n: n,
    ) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.metrics: dict[str, Any] = {}
        self.rename = rename
        for node in ast.walk(_source(engine, module)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            kind = KINDS.get(
                func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            )
            kw = {k.arg: k.value for k in node.keywords}
            name = kw.get("name")
            if kind is None or not isinstance(name, ast.Constant) or "labelnames" not in kw:
                continue
            try:
                labelnames = list(eval(ast.unparse(kw["labelnames"]), {"list": list}, namespace))  # noqa: S307 - the wheel's own label expression
            except Exception:  # noqa: BLE001, S112 - a label set only a running engine knows
                continue
            try:
                doc = str(ast.literal_eval(kw["documentation"]))
            except (KeyError, ValueError):  # built at run time: the name stands in
                doc = str(name.value)
            try:
                self.metrics[str(name.value)] = kind(
                    rename(str(name.value)), doc, labelnames, registry=self.registry
                )
            except ValueError:  # defined twice in the module (per mode): once is enough
                continue

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set (gauge) or advance to (counter) ``value`` on the series ``labels``."""
        metric = self.metrics[name]
        values = [labels.get(k, "x") for k in metric._labelnames]
        if isinstance(metric, prometheus_client.Counter):
            if tuple(values) in metric._metrics:  # a counter set lower: a fresh series
                metric.remove(*values)
            metric.labels(*values).inc(value)
            return
        child = metric.labels(*values)
        if isinstance(metric, prometheus_client.Gauge):
            child.set(value)
        else:
            child.observe(value)

    def noise(self, value: float, **labels: str) -> None:
        """Every metric the module defines gets ``value`` on the series ``labels``."""
        for name in self.metrics:
            self.set(name, value, **labels)

    def text(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()


def _vllm(rename: Callable[[str], str] = lambda n: n) -> Wheel:
    return Wheel("vllm", "vllm/v1/metrics/loggers.py", {"labelnames": _vllm_labelnames()}, rename)


def _sglang(rename: Callable[[str], str] = lambda n: n) -> Wheel:
    return Wheel(
        "sglang",
        "sglang/srt/observability/metrics_collector.py",
        {"labels": SGLANG_LABELS},
        rename,
    )


def _ray(name: str) -> str:
    """Ray's wrappers' rename (both engines' ``_get_sanitized_opentelemetry_name``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _fill_vllm(w: Wheel) -> None:
    """DP 2 (engines 0 and 1); every other metric far off the counter's values."""
    for engine in ("0", "1"):
        w.noise(10_000.0, model_name="m", engine=engine)
    w.set("vllm:generation_tokens", 120.0, model_name="m", engine="0")
    w.set("vllm:generation_tokens", 80.0, model_name="m", engine="1")
    w.set("vllm:num_requests_running", 3.0, model_name="m", engine="0")
    w.set("vllm:num_requests_running", 1.0, model_name="m", engine="1")
    w.set("vllm:num_requests_waiting", 2.0, model_name="m", engine="0")
    w.set("vllm:num_requests_waiting", 0.0, model_name="m", engine="1")


def test_vllm_0_33_exposition_from_the_pinned_wheel() -> None:
    w = _vllm()
    _fill_vllm(w)
    text = w.text()
    assert "# HELP vllm:generation_tokens_total Number of generation tokens processed." in text
    assert "vllm:prompt_tokens_total{" in text
    assert "vllm:request_generation_tokens_sum{" in text  # the per-request histogram
    assert progress.decoded_tokens(text, "vllm") == 200.0
    assert progress.held_requests(text, "vllm") == 6.0
    assert progress.read_engine(progress._families(text), "vllm").variant.variant == "vllm"


def test_vllm_through_rays_metrics_agent() -> None:
    w = _vllm(lambda n: "ray_" + _ray(n))
    _fill_vllm(w)
    text = w.text()
    assert "ray_vllm_generation_tokens_total{" in text
    assert not [ln for ln in text.splitlines() if ln.startswith("vllm:")]
    reading = progress.read_engine(progress._families(text), "vllm", busy=True)
    assert reading.variant.variant == "vllm-ray"
    assert (sum(reading.tokens.values()), reading.held) == (200.0, 6.0)


def test_vllm_production_stack_router() -> None:
    # src/vllm_router/services/metrics_service/__init__.py of vllm-project/production-stack.
    reg = prometheus_client.CollectorRegistry()
    out = prometheus_client.Counter(
        "vllm:output_tokens_total",
        "Total output tokens generated",
        ["server", "model"],
        registry=reg,
    )
    running = prometheus_client.Gauge(
        "vllm:num_requests_running", "Number of running requests", ["server"], registry=reg
    )
    waiting = prometheus_client.Gauge(
        "vllm:num_requests_waiting", "Number of waiting requests", ["server"], registry=reg
    )
    prometheus_client.Counter(
        "vllm:input_tokens_total", "Total input tokens processed", ["server", "model"], registry=reg
    ).labels("a", "m").inc(9999)
    for server, n, r, q in (("http://a:8000", 70, 2, 1), ("http://b:8000", 30, 1, 0)):
        out.labels(server, "m").inc(n)
        running.labels(server).set(r)
        waiting.labels(server).set(q)
    text = prometheus_client.generate_latest(reg).decode()
    reading = progress.read_engine(progress._families(text), "vllm", busy=True)
    assert reading.variant.variant == "vllm-router"
    assert (sum(reading.tokens.values()), reading.held) == (100.0, 4.0)


def _fill_sglang(w: Wheel) -> None:
    """EP 4 (moe_ep_rank / tp_rank 0-3): decode tokens 10, 20, 30, 40; prefill far bigger."""
    for rank in range(4):
        labels = {**SGLANG_LABELS, "tp_rank": str(rank), "moe_ep_rank": str(rank)}
        w.noise(10_000.0, **labels, mode="prefill_compute")
        w.set("sglang:realtime_tokens_total", 10.0 * (rank + 1), **labels, mode="decode")
        w.set("sglang:num_running_reqs", 2.0, **labels)
        w.set("sglang:num_queue_reqs", 1.0, **labels)


@pytest.mark.parametrize(
    ("rename", "variant", "name"),
    [
        (lambda n: n, "sglang", "sglang:realtime_tokens_total{"),
        (_ray, "sglang-underscore", "sglang_realtime_tokens_total{"),
        (lambda n: "ray_" + _ray(n), "sglang-ray", "ray_sglang_realtime_tokens_total{"),
    ],
    ids=["colon", "underscore", "ray"],
)
def test_sglang_0_5_23_exposition_in_each_separator(
    rename: Callable[[str], str], variant: str, name: str
) -> None:
    w = _sglang(rename)
    _fill_sglang(w)
    text = w.text()
    assert name in text
    assert rename("sglang:generation_tokens_total") in text  # finished requests: not read
    reading = progress.read_engine(progress._families(text), "sglang", busy=True)
    assert reading.variant.variant == variant
    assert sum(reading.tokens.values()) == 100.0  # decode only, over the four ranks
    assert reading.held == 12.0
    assert progress.held_requests(text, "sglang") == 12.0


def test_a_missing_counter_names_it_and_every_variant_tried() -> None:
    w = _vllm()
    _fill_vllm(w)
    text = "\n".join(ln for ln in w.text().splitlines() if "generation_tokens_total" not in ln)
    with pytest.raises(progress.MetricsUnavailable) as err:
        progress.decoded_tokens(text + "\n", "vllm")
    assert err.value.metric == "vllm:generation_tokens_total"
    assert err.value.tried == (
        "vllm:generation_tokens_total (vllm)",
        "ray_vllm_generation_tokens_total (vllm-ray)",
        "vllm:output_tokens_total (vllm-router)",
    )
    assert isinstance(err.value, progress.ProgressUnavailable)  # the reporters' one error
    s = _sglang()
    _fill_sglang(s)
    only_running = "\n".join(ln for ln in s.text().splitlines() if "num_queue_reqs" not in ln)
    with pytest.raises(progress.MetricsUnavailable, match="sglang:num_queue_reqs"):
        progress.held_requests(only_running + "\n", "sglang")


class Served:
    """A registry served on 127.0.0.1 (an engine's ``/metrics``)."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.server, _ = prometheus_client.start_http_server(
            0, addr="127.0.0.1", registry=self.registry
        )
        self.url = pod_engines.metrics_url("127.0.0.1", self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def _sglang_decode(registry: prometheus_client.CollectorRegistry) -> Any:
    return prometheus_client.Counter(
        "sglang:realtime_tokens_total",
        "Total number of tokens processed.",
        [*SGLANG_LABELS, "mode"],
        registry=registry,
    )


def _rank(counter: Any, rank: int) -> Any:
    return counter.labels(**{**SGLANG_LABELS, "moe_ep_rank": str(rank), "mode": "decode"})


def test_an_ep_shrink_that_drops_ranks_series_never_makes_progress_fall(served: Served) -> None:
    tokens = _sglang_decode(served.registry)
    for rank in range(4):
        _rank(tokens, rank).inc(1000)
    source = progress.HttpExposition(served.url, "sglang")
    sent: list[float] = []
    reporter = progress.ProgressReporter(source, sent.append, period_s=3600)
    reporter.start()  # zero: 4000
    for rank in range(4):
        _rank(tokens, rank).inc(50)
    reporter._send()
    for rank in (2, 3):  # elastic EP shrinks to ranks 0-1: their series are gone
        tokens.remove(*{**SGLANG_LABELS, "moe_ep_rank": str(rank), "mode": "decode"}.values())
    reporter._send()
    _rank(tokens, 0).inc(30)
    _rank(tokens, 1).inc(20)
    reporter.stop()
    assert sent == [200.0, 200.0, 250.0]  # never below 200, then the survivors' 50 more
    assert source.variant == "sglang"


def test_a_counter_reset_counts_its_new_value_on_top(served: Served) -> None:
    tokens = _sglang_decode(served.registry)
    _rank(tokens, 0).inc(1000)
    _rank(tokens, 1).inc(500)
    source = progress.HttpExposition(served.url, "sglang")
    assert source.total() == 1500.0
    tokens.remove(*{**SGLANG_LABELS, "moe_ep_rank": "1", "mode": "decode"}.values())
    _rank(tokens, 1).inc(7)  # rank 1's scheduler restarted: its counter starts again
    assert source.total() == 1507.0
    assert source.series.resets == 1
    _rank(tokens, 1).inc(3)
    assert source.total() == 1510.0


def test_an_engine_whose_process_is_gone_keeps_its_count_in_the_pods_sum(
    tmp_path: Path, served: Served
) -> None:
    tokens = _sglang_decode(served.registry)
    _rank(tokens, 0).inc(100)
    other = Served()
    try:
        vllm = prometheus_client.Counter(
            "vllm:generation_tokens", "t", ["model_name", "engine"], registry=other.registry
        ).labels("m", "0")
        vllm.inc(40)
        pod_engines.publish("sglang", served.url, directory=tmp_path)
        gone = pod_engines.publish("vllm", other.url, directory=tmp_path)
        engines = pod_engines.PodEngines(tmp_path)
        assert engines.total() == 140.0
        assert engines.variant == "sglang,vllm"
        vllm.inc(10)
        assert engines.total() == 150.0
        gone.unlink()  # its process ended: the folder no longer lists it
        with pytest.raises(progress.EngineLost, match=f"vllm at {other.url} stopped"):
            engines.total()  # said once (the hook aborts the generation window on it)
        assert engines.total() == 150.0
        _rank(tokens, 0).inc(5)
        assert engines.total() == 155.0
    finally:
        other.close()


def test_missing_engine_metrics_fall_back_to_sdk_tokens_never_to_zero(served: Served) -> None:
    prometheus_client.Counter(  # a server with metrics, but not the decoded-token counter
        "vllm:prompt_tokens", "p", ["model_name", "engine"], registry=served.registry
    ).labels("m", "0").inc(5)
    now = [0.0]
    sdk = progress.ReportedTokens(stale_after_s=1.0, clock=lambda: now[0])
    source = progress.WithFallback(progress.HttpExposition(served.url, "vllm"), sdk)
    sent: list[float] = []
    reporter = progress.ProgressReporter(source, sent.append, period_s=3600)
    reporter.start()
    reporter._send()
    assert sent == []  # neither the engine nor the SDK has tokens: nothing, not 0 tokens/s
    assert "vllm:generation_tokens_total is not in the vllm exposition" in (
        reporter.last_error or ""
    )
    sdk.add(300)
    reporter._send()  # the zero is the first value read
    sdk.add(200)
    reporter._send()
    assert sent == [0.0, 200.0]
    assert source.variant == "sdk"
    assert "ray_vllm_generation_tokens_total" in (source.last_error or "")
    now[0] = 5.0  # the SDK stopped reporting: unavailable, not a flat (idle-looking) line
    reporter._send()
    reporter.stop(final=False)
    assert sent == [0.0, 200.0]
    with pytest.raises(ValueError, match=">= 0"):
        sdk.add(-1)


def test_a_switch_between_engine_and_sdk_tokens_neither_jumps_nor_falls(served: Served) -> None:
    c = prometheus_client.Counter(
        "vllm:generation_tokens", "t", ["model_name", "engine"], registry=served.registry
    ).labels("m", "0")
    c.inc(5000)
    sdk = progress.ReportedTokens()
    source = progress.WithFallback(progress.HttpExposition(served.url, "vllm"), sdk)
    assert source.total() == 5000.0 and source.variant == "vllm"
    served.close()  # the engine's server went away; the SDK still counts
    sdk.add(40)
    assert source.total() == 5000.0 and source.variant == "sdk"
    sdk.add(60)
    assert source.total() == 5060.0


class _Lost:
    """A source whose engine goes away after ``alive`` reads."""

    def __init__(self, alive: int) -> None:
        self.alive = alive
        self.reads = 0

    def total(self) -> float:
        self.reads += 1
        if self.reads > self.alive:
            raise progress.EngineLost("vllm at http://127.0.0.1:1/metrics stopped")
        return 10.0 * self.reads


def test_a_lost_engine_on_the_reporters_thread_calls_on_lost_once_and_sends_no_more() -> None:
    lost: list[tuple[str, str]] = []
    sent: list[float] = []
    rep = progress.ProgressReporter(
        _Lost(alive=3),
        sent.append,
        period_s=0.002,
        on_lost=lambda why: lost.append((why, threading.current_thread().name)),
    )
    rep.start()
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.005)
    rep.stop()  # no final report after the loss
    assert lost == [
        (
            "inference engine lost: vllm at http://127.0.0.1:1/metrics stopped",
            progress.REPORTER_THREAD,
        )
    ]
    assert sent == [10.0, 20.0]  # reads 2 and 3, from the zero of read 1
    assert rep.lost is not None
    early = progress.ProgressReporter(_Lost(alive=0), sent.append, on_lost=lost.append)
    early.start()  # lost at the phase's zero read: not this phase's engine, no abort
    early.stop(final=False)
    assert len(lost) == 1


def test_a_lost_engine_or_a_failed_weight_update_ends_the_rollout_pools_window() -> None:
    class Signals:
        def __init__(self) -> None:
            self.sent: list[tuple[str, float]] = []

        def phase(self, name: str, *, step: int) -> None:
            self.sent.append((name, step))

        def progress_total(self, total: float, *, in_flight: int | None = None) -> None:
            self.sent.append(("progress", total))

    class Engine:
        def __init__(self) -> None:
            self.lost = False

        def activity(self) -> tuple[float, float]:
            if self.lost:
                raise progress.EngineLost("sglang at http://127.0.0.1:2/metrics stopped")
            return 3.0, 100.0

    sig, engine = Signals(), Engine()
    pool = progress.RolloutPoolPhases(engine, sig, step=5)
    pool.tick()
    assert sig.sent == [("generation", 5), ("progress", 0.0)]
    engine.lost = True
    pool.tick()
    assert sig.sent[-1] == ("idle", 5)  # at once, not after idle_after_s
    assert pool.last_error == "sglang at http://127.0.0.1:2/metrics stopped"
    pool.abort("again")  # nothing open: nothing sent
    assert sig.sent.count(("idle", 5)) == 1
    engine.lost = False
    pool.tick()  # held requests again: a new window
    assert sig.sent[-2:] == [("generation", 5), ("progress", 0.0)]
    pool.abort("verl's update_weights raised RuntimeError: copy failed")
    assert sig.sent[-1] == ("idle", 5)


def test_vllm_v0s_swapped_requests_count_as_held_when_served() -> None:
    # V0's vllm/engine/metrics.py (label model_name): swapped requests were held too; shown
    # until 0.8, then only with --show-hidden-metrics-for-version=0.8, then removed.
    reg = prometheus_client.CollectorRegistry()
    for name, value in (
        ("vllm:num_requests_running", 3),
        ("vllm:num_requests_waiting", 2),
        ("vllm:num_requests_swapped", 4),
    ):
        prometheus_client.Gauge(name, name, ["model_name"], registry=reg).labels("m").set(value)
    prometheus_client.Counter("vllm:generation_tokens", "t", ["model_name"], registry=reg).labels(
        "m"
    ).inc(50)
    text = prometheus_client.generate_latest(reg).decode()
    assert progress.held_requests(text, "vllm") == 9.0
    reading = progress.read_engine(progress._families(text), "vllm", busy=True)
    assert (reading.variant.variant, reading.held, sum(reading.tokens.values())) == (
        "vllm",
        9.0,
        50.0,
    )
