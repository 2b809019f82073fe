"""The progress sources' metric names against the pinned engines' real source.

``rlenergy.sdk.progress.ENGINES`` names, per engine, the decoded-token counter and the request
gauges. ``make engine-wheels`` (a prerequisite of ``make unit`` and ``make test``) caches the
pinned wheels; this test reads the metrics modules out of them with ``ast`` (nothing installed)
and checks each name is a metric the engine defines, with the labels the sources filter on, and
that the engine advances the counter where the source says.
"""

from __future__ import annotations

import ast

from test_engine_source import _source

from rlenergy.sdk import progress

MODULES = {
    "vllm": ["vllm/v1/metrics/loggers.py"],
    "sglang": ["sglang/srt/observability/metrics_collector.py"],
}


def _metrics(engine: str) -> dict[str, ast.Call]:
    """Metric name -> its constructor call (``Counter(name=...)``, ``Gauge(name=...)``)."""
    out: dict[str, ast.Call] = {}
    for module in MODULES[engine]:
        for node in ast.walk(_source(engine, module)):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                        out[str(kw.value.value)] = node
    return out


def _call_names(tree: ast.Module) -> set[str]:
    return {
        n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }


def _counter(engine: str) -> ast.Call:
    """The counter's constructor: prometheus-client drops a ``_total`` suffix from a Counter's
    name (vLLM writes ``vllm:generation_tokens``, SGLang ``sglang:realtime_tokens_total``)."""
    c = progress.ENGINES[engine]
    metrics = _metrics(engine)
    call = metrics.get(c.family) or metrics.get(c.sample)
    assert call is not None, f"{engine} {c.version} defines no counter {c.family!r}"
    assert isinstance(call.func, ast.Name | ast.Attribute)
    return call


def test_each_source_names_metrics_its_pinned_engine_defines() -> None:
    for engine, counter in progress.ENGINES.items():
        _counter(engine)
        metrics = _metrics(engine)
        for name in counter.busy:
            assert name in metrics, f"{engine} {counter.version} defines no gauge {name!r}"
        assert counter.sample == f"{counter.family}_total"  # a Counter's exposed sample
        assert counter.busy, engine


def test_sglang_decode_counter_has_the_mode_label_and_is_advanced_per_decode_batch() -> None:
    call = _counter("sglang")
    labels = next(kw.value for kw in call.keywords if kw.arg == "labelnames")
    assert "mode" in {c.value for c in ast.walk(labels) if isinstance(c, ast.Constant)}
    reporter = _source("sglang", "sglang/srt/managers/scheduler_components/metrics_reporter.py")
    decode = next(
        n
        for n in ast.walk(reporter)
        if isinstance(n, ast.FunctionDef) and n.name == "report_decode_stats"
    )
    assert "increment_realtime_tokens" in _call_names(ast.Module(body=[decode], type_ignores=[]))
    collector = _source("sglang", "sglang/srt/observability/metrics_collector.py")
    modes = {
        c.value
        for n in ast.walk(collector)
        if isinstance(n, ast.FunctionDef) and n.name == "increment_realtime_tokens"
        for c in ast.walk(n)
        if isinstance(c, ast.Constant)
    }
    assert progress.ENGINES["sglang"].match["mode"] in modes


def test_vllm_counter_is_advanced_by_each_iterations_generated_tokens() -> None:
    tree = _source("vllm", "vllm/v1/metrics/loggers.py")
    record = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef)
        and n.name == "record_iteration_stats"
        or isinstance(n, ast.FunctionDef)
        and n.name == "record"
    ]
    text = "\n".join(ast.unparse(n) for n in record)
    assert "self.counter_generation_tokens[engine_idx].inc(" in text
    assert "iteration_stats.num_generation_tokens" in text
