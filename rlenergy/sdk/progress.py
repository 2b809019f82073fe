"""In-phase progress for EE-RL's probe slices: the engines' own token counters and a torch hook.

EE-RL trials run a phase as short slices at alternating clocks (``rlenergy.control.freq.probe``)
and compare the work done per slice, so the agent needs the phase's cumulative progress every
few tens of ms. A verl rollout is one blocking ``generate_sequences`` call and its update one
``update_actor`` call, so no trainer code runs in between to report it; the progress comes from
counters that the work itself advances, read on a thread of the worker process:

* generation: the inference engine's own decoded-token counter (``ENGINES``), read from its
  Prometheus exposition (``HttpExposition``: the engine's ``/metrics`` URL in the pod) or from
  the process's prometheus-client registry when the engine runs in-process
  (``RegistryExposition``; verl's vLLM/SGLang rollout servers), parsed with prometheus-client's
  own text parser, in whichever known naming the engine serves (``VARIANTS``: vLLM's own, Ray's,
  a router's; SGLang's ``sglang:`` and ``sglang_``), each series (engine index, rank) tracked
  as its own monotonic counter (``MonotonicSeries``: ranks that vanish or restart never make
  progress fall); a counter in no known naming raises ``MetricsUnavailable``, and
  ``WithFallback`` then counts the tokens the job reports itself (``ReportedTokens``);
* training: ``ForwardTokenCounter``, a forward hook on the actor module counting the tokens and
  micro-batches its forward passes processed (on CUDA counted once the pass's kernels are done,
  through a CUDA event, so the count does not run ahead of the GPU).

``ProgressReporter`` reads a source every ``period_s`` (20 ms: 50 Hz, within the 50 ms the
probes need) during a phase and sends the phase's total since its start to the agent
(``RLEnergyClient.progress_total``), with one last report right before the phase ends. A source
that cannot be read (no engine metrics, no counter) sends nothing (never a flat line that
reads as an idle engine): the agent then sees a window without progress and EE-RL falls back
to whole-phase evidence and says so in status (``PhaseStatus.probeEvidence``); it never
interpolates over a phase it did not hear. An engine that goes away mid-phase
(``EngineLost``) is handed to the reporter's ``on_lost`` (the verl hook aborts the phase).

prometheus-client is imported only when a source is read: vLLM and SGLang both require it, so
it is in every engine image. Callers: ``rlenergy.sdk.verl`` hooks, trainer code.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 0.02
"""Progress read and report period, s (50 Hz; EE-RL's slices are 25 ms or longer and the
controller sizes them to at least twice the largest report gap,
``rlenergy.control.freq.eerl.SLICE_PER_PROGRESS_GAP``)."""


class ProgressUnavailable(Exception):
    """A progress source cannot be read (engine metrics missing, URL refused, bad exposition)."""


class MetricsUnavailable(ProgressUnavailable):
    """A metric the source needs is in none of its known variants (``VARIANTS``).

    Attributes:
        engine: the engine whose exposition was read (``vllm``, ``sglang``).
        metric: the metric missing, as the pinned engine names it (e.g.
            ``vllm:generation_tokens_total``).
        tried: the sample names looked for, one per variant, in the order tried.
    """

    def __init__(self, engine: str, metric: str, tried: Sequence[str], hint: str = "") -> None:
        self.engine = engine
        self.metric = metric
        self.tried = tuple(tried)
        super().__init__(
            f"{metric} is not in the {engine} exposition (looked for {', '.join(self.tried)}){hint}"
        )


class EngineLost(ProgressUnavailable):
    """An inference engine that was being read has gone (its process ended) mid-phase.

    Raised once per engine by ``rlenergy.sdk.pod_engines.PodEngines``; a
    :class:`ProgressReporter` with ``on_lost`` hands it on (the verl hook aborts the phase).
    """


REPORTER_THREAD = "rlenergy-progress"
"""The name of :class:`ProgressReporter`'s thread (a callback can tell it runs there)."""


@dataclasses.dataclass(frozen=True)
class EngineCounter:
    """One way an inference engine's metrics are named: its decoded-token counter and gauges.

    Attributes:
        engine: engine name (``vllm``, ``sglang``).
        version: the engine version the names were read from (pyproject ``engines`` pins) or
            the versions the variant covers.
        family: the metric family as prometheus-client's parser names it (counter names lose
            their ``_total`` suffix there).
        sample: the sample name in the exposition (``<family>_total``).
        match: label values a sample must carry to count (other labels are summed over:
            engine indexes, TP/PP/EP ranks, DP ranks, a router's ``server``).
        source: where the names come from (the file that defines the metrics).
        advances: when the counter advances.
        busy: gauges whose sum is the requests the engine holds (running + queued): > 0 while
            it generates (``RolloutPoolPhases``); each is required.
        variant: the variant's name (recorded by the sources as ``variant``).
        busy_optional: gauges added to ``busy`` when the exposition has them (held requests
            an older engine counts apart, e.g. vLLM V0's swapped requests).
    """

    engine: str
    version: str
    family: str
    sample: str
    match: Mapping[str, str]
    source: str
    advances: str
    busy: tuple[str, ...] = ()
    variant: str = ""
    busy_optional: tuple[str, ...] = ()


ENGINES: dict[str, EngineCounter] = {
    "vllm": EngineCounter(
        engine="vllm",
        version="0.33.0",
        family="vllm:generation_tokens",
        sample="vllm:generation_tokens_total",
        match={},
        source=(
            "vllm/v1/metrics/loggers.py (PrometheusStatLogger, labels model_name, engine); the "
            "same counter and gauges in V0's vllm/engine/metrics.py, whose "
            "vllm:num_requests_swapped (requests swapped to CPU, held too) was deprecated in "
            "0.8 (github.com/vllm-project/vllm/pull/14136), hidden from 0.9 unless "
            "--show-hidden-metrics-for-version=0.8 (github.com/vllm-project/vllm/pull/15458), "
            "then removed"
        ),
        advances="every engine step, by IterationStats.num_generation_tokens",
        busy=("vllm:num_requests_running", "vllm:num_requests_waiting"),
        variant="vllm",
        busy_optional=("vllm:num_requests_swapped",),
    ),
    "sglang": EngineCounter(
        engine="sglang",
        version="0.5.23",
        family="sglang:realtime_tokens",
        sample="sglang:realtime_tokens_total",
        match={"mode": "decode"},
        source=(
            "sglang/srt/observability/metrics_collector.py (SchedulerMetricsCollector, labels "
            "model_name, engine_type, tp_rank, pp_rank, moe_ep_rank, mode); advanced in "
            "sglang/srt/managers/scheduler_components/metrics_reporter.py report_decode_stats"
        ),
        advances="every decode iteration, by the iteration's generated tokens",
        busy=("sglang:num_running_reqs", "sglang:num_queue_reqs"),
        variant="sglang",
    ),
}
"""The pinned engines' decoded-token counters, read from their wheels' source. Not
``sglang:generation_tokens_total``: SGLang advances that one only when a request finishes
(``TokenizerMetricsCollector.observe_one_finished_request``), too late for a slice."""


def _renamed(base: EngineCounter, prefix: str, variant: str, **changes: Any) -> EngineCounter:
    """``base`` with its engine prefix (``vllm:``, ``sglang:``) replaced by ``prefix``."""
    old = f"{base.engine}:"

    def name(n: str) -> str:
        return prefix + n.removeprefix(old)

    return dataclasses.replace(
        base,
        family=name(base.family),
        sample=name(base.sample),
        busy=tuple(name(g) for g in base.busy),
        busy_optional=tuple(name(g) for g in base.busy_optional),
        variant=variant,
        **changes,
    )


VARIANTS: dict[str, tuple[EngineCounter, ...]] = {
    "vllm": (
        ENGINES["vllm"],
        _renamed(
            ENGINES["vllm"],
            "ray_vllm_",
            "vllm-ray",
            version="0.33.0",
            source=(
                "vllm/v1/metrics/ray_wrappers.py RayPrometheusStatLogger: the same metrics "
                "through ray.util.metrics, ':' turned to '_' "
                "(_get_sanitized_opentelemetry_name), exported by Ray's metrics agent with "
                "its 'ray_' prefix for application metrics"
            ),
        ),
        EngineCounter(
            engine="vllm",
            version="production-stack router",
            family="vllm:output_tokens",
            sample="vllm:output_tokens_total",
            match={},
            source=(
                "vllm-project/production-stack src/vllm_router/services/metrics_service/"
                "__init__.py: the router's own counter (labels server, model) and its "
                "re-export of each engine's running / waiting gauges (label server)"
            ),
            advances="by the router, for the responses it relays",
            busy=("vllm:num_requests_running", "vllm:num_requests_waiting"),
            variant="vllm-router",
        ),
    ),
    "sglang": (
        ENGINES["sglang"],
        _renamed(
            ENGINES["sglang"],
            "sglang_",
            "sglang-underscore",
            version="0.5.23",
            source=(
                "the same metrics with '_' for ':': SGLang's Ray stat loggers "
                "(sglang/srt/observability/ray_wrappers.py _get_sanitized_opentelemetry_name, "
                "used by sglang/srt/ray/engine.py) and Dynamo's SGLang publisher before "
                "github.com/ai-dynamo/dynamo/pull/5701 (add_prefix='sglang_')"
            ),
        ),
        _renamed(
            ENGINES["sglang"],
            "ray_sglang_",
            "sglang-ray",
            version="0.5.23",
            source=(
                "sglang/srt/observability/ray_wrappers.py names as Ray's metrics agent "
                "exports them ('ray_' prefix for application metrics)"
            ),
        ),
    ),
}
"""Every known naming of each engine's decoded-token counter and busy gauges, tried in order
(the pinned engine's own names first). A source records the variant it matched (``variant``);
the first variant with a sample of its counter in the exposition is the one read."""


def engine_counter(engine: str) -> EngineCounter:
    """The pinned counter of ``engine`` (``ENGINES``).

    Raises:
        ValueError: an engine without a pinned counter (says which are known).
    """
    try:
        return ENGINES[engine]
    except KeyError:
        raise ValueError(
            f"no token counter known for engine {engine!r}; use one of {sorted(ENGINES)}"
        ) from None


Series = tuple[tuple[str, str], ...]
"""One series of a metric: its label set, sorted (``(("engine", "0"), ("model_name", "m"))``)."""


@dataclasses.dataclass(frozen=True)
class EngineReading:
    """One read of an engine's exposition, in the first variant found (``VARIANTS``).

    Attributes:
        variant: the naming matched.
        tokens: the decoded-token counter's value per series (label set), tokens.
        held: the requests the engine holds (the variant's busy gauges summed over their
            series), or ``None`` when not asked for.
    """

    variant: EngineCounter
    tokens: dict[Series, float]
    held: float | None = None


_HINT = (
    ": is the engine serving its metrics (vLLM: not --disable-log-stats; SGLang: --enable-metrics)?"
)


def _is_counter_sample(name: str, sample: str) -> bool:
    """Whether sample ``name`` is the counter ``sample``, with or without its ``_total``.

    An exposition written without a ``TYPE counter`` line keeps the suffix in the family; one
    that re-exports the counter as a gauge may drop it.
    """
    return name in (sample, sample.removesuffix("_total"))


def read_engine(families: Iterable[Any], engine: str, *, busy: bool = False) -> EngineReading:
    """Read ``engine``'s decoded-token counter (and its held requests) from parsed families.

    The variants of ``VARIANTS[engine]`` are tried in order; the first whose counter has a
    sample (with the variant's ``match`` labels) is read, its other labels (engine index,
    ranks, a router's ``server``) kept apart per series.

    Args:
        families: prometheus-client metric families (``parser.text_string_to_metric_families``
            or a registry's ``collect()``).
        engine: ``vllm`` or ``sglang``.
        busy: also sum the variant's busy gauges (``held``).

    Raises:
        ValueError: unknown engine.
        MetricsUnavailable: no variant's counter is there, or the matched variant lacks a busy
            gauge (``busy``); the error names the metric and every name tried.
    """
    variants = VARIANTS.get(engine)
    if variants is None:
        engine_counter(engine)  # raises the ValueError naming the known engines
        raise AssertionError  # pragma: no cover - ENGINES and VARIANTS have the same keys
    samples = [s for fam in families for s in fam.samples]
    for v in variants:
        series: dict[Series, float] = {}
        for s in samples:
            if _is_counter_sample(s.name, v.sample) and all(
                s.labels.get(k) == val for k, val in v.match.items()
            ):
                key = tuple(sorted(s.labels.items()))
                series[key] = series.get(key, 0.0) + float(s.value)
        if not series:
            continue
        held = None
        if busy:
            held = 0.0
            for gauge in (*v.busy, *v.busy_optional):
                found = [float(s.value) for s in samples if s.name == gauge]
                if not found and gauge in v.busy:
                    raise MetricsUnavailable(
                        engine,
                        gauge,
                        [gauge],
                        f" although its counter {v.sample} is (variant {v.variant}){_HINT}",
                    )
                held += sum(found)
        return EngineReading(v, series, held)
    pinned = engine_counter(engine)
    where = f" with {dict(pinned.match)}" if pinned.match else ""
    raise MetricsUnavailable(
        engine, pinned.sample + where, [f"{v.sample} ({v.variant})" for v in variants], _HINT
    )


def _families(exposition: str) -> list[Any]:
    from prometheus_client import parser

    try:
        return list(parser.text_string_to_metric_families(exposition))
    except ValueError as exc:
        raise ProgressUnavailable(f"not a Prometheus exposition: {exc}") from exc


def held_requests(exposition: str, engine: str) -> float:
    """Requests ``engine`` holds now (running + waiting, summed over engines and ranks).

    The first variant of ``VARIANTS[engine]`` with one of its busy gauges in the text is read.

    Raises:
        ValueError: unknown engine.
        MetricsUnavailable: no variant's busy gauges are there, or one of them is missing.
        ProgressUnavailable: the text does not parse.
    """
    engine_counter(engine)
    samples = [s for fam in _families(exposition) for s in fam.samples]
    names = {s.name for s in samples}
    for v in VARIANTS[engine]:
        if names.isdisjoint(v.busy):
            continue
        for gauge in v.busy:
            if gauge not in names:
                raise MetricsUnavailable(engine, gauge, [gauge], f" (variant {v.variant})")
        wanted = {*v.busy, *v.busy_optional}
        return sum(float(s.value) for s in samples if s.name in wanted)
    pinned = engine_counter(engine)
    raise MetricsUnavailable(
        engine,
        pinned.busy[0],
        [f"{v.busy[0]} ({v.variant})" for v in VARIANTS[engine]],
        _HINT,
    )


def decoded_tokens(exposition: str, engine: str) -> float:
    """Tokens ``engine`` decoded so far, from its Prometheus text exposition (one read).

    Args:
        exposition: the text of the engine's ``/metrics`` (Prometheus text format 0.0.4, what
            prometheus-client serves without an OpenMetrics ``Accept`` header).
        engine: ``vllm`` or ``sglang``.

    Returns:
        The counter summed over every series (engine index, rank) in the exposition, tokens.
        Across reads use a :class:`MonotonicSeries` (the sources do): a series that vanishes
        or resets makes this plain sum fall.

    Raises:
        ValueError: unknown engine.
        MetricsUnavailable: the counter is in no variant of ``VARIANTS[engine]``.
        ProgressUnavailable: the text does not parse.
    """
    return sum(read_engine(_families(exposition), engine).tokens.values())


class MonotonicSeries:
    """A sum of counter series that never falls: each series is its own monotonic counter.

    A series (label set) keeps counting its last value when it vanishes from a read (an
    elastic-EP shrink drops the removed ranks' series; a scrape that misses one), and a series
    whose value falls was reset (the rank's process restarted): its last value stays counted
    and its new value adds to it (Prometheus' ``increase()`` treats a counter reset the same
    way). The total is what the engine decoded while this object watched plus the first read's
    values, so a phase's progress (a difference of two totals) is never negative.

    Attributes:
        resets: series resets seen.
    """

    def __init__(self) -> None:
        self._last: dict[Series, float] = {}
        self._carried = 0.0
        self.resets = 0

    def update(self, series: Mapping[Series, float]) -> float:
        """Take one read's values per series; returns the monotonic total."""
        for key, value in series.items():
            last = self._last.get(key)
            if last is not None and value < last:
                self._carried += last
                self.resets += 1
            self._last[key] = value
        return self.total()

    def total(self) -> float:
        """The total so far (no new read)."""
        return self._carried + sum(self._last.values())


class ProgressSource(Protocol):
    """Anything with a cumulative work counter (tokens, micro-batches)."""

    def total(self) -> float:
        """Cumulative work so far; raises ``ProgressUnavailable`` when it cannot be read."""
        ...


class HttpExposition:
    """An engine's ``/metrics`` URL in the pod (e.g. ``http://127.0.0.1:8000/metrics``).

    Reads the engine's counter in the first naming of ``VARIANTS[engine]`` the page has and
    tracks it per series (:class:`MonotonicSeries`), so the total never falls while the
    engine's ranks come and go.

    Args:
        url: the exposition URL (the engine's own server; loopback inside the pod).
        engine: ``vllm`` or ``sglang``.
        timeout_s: per read, s (kept under the report period's scale).

    Attributes:
        variant: the variant the last read matched (``EngineCounter.variant``; ``None``
            before the first successful read).
        last_total: the monotonic total of the last successful read, tokens.
    """

    def __init__(self, url: str, engine: str, *, timeout_s: float = 0.5) -> None:
        engine_counter(engine)
        self.url = url
        self.engine = engine
        self.timeout_s = timeout_s
        self.series = MonotonicSeries()
        self.variant: str | None = None
        self.last_total: float | None = None

    def read(self) -> str:
        """The exposition's text now.

        Raises:
            ProgressUnavailable: the URL cannot be read.
        """
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:  # noqa: S310
                return str(resp.read().decode("utf-8"))
        except (urllib.error.URLError, OSError) as exc:
            raise ProgressUnavailable(f"{self.url}: {exc}") from exc

    def _take(self, reading: EngineReading) -> float:
        if reading.variant.variant != self.variant:
            log.info(
                "%s at %s: engine metrics named as %s (%s)",
                self.engine,
                self.url,
                reading.variant.variant,
                reading.variant.sample,
            )
        self.variant = reading.variant.variant
        self.last_total = self.series.update(reading.tokens)
        return self.last_total

    def total(self) -> float:
        """Decoded tokens so far (monotonic over the page's series).

        Raises:
            MetricsUnavailable: the counter is in no known variant.
            ProgressUnavailable: the page cannot be read or parsed.
        """
        return self._take(read_engine(_families(self.read()), self.engine))

    def activity(self) -> tuple[float, float]:
        """(requests held, decoded tokens so far) from one read of the page."""
        reading = read_engine(_families(self.read()), self.engine, busy=True)
        return reading.held or 0.0, self._take(reading)


class RegistryExposition:
    """The engine's counter in this process's prometheus-client registry (in-process engine).

    vLLM's ``PrometheusStatLogger`` registers in the default registry (or the multiprocess one
    under ``PROMETHEUS_MULTIPROC_DIR``, ``vllm/v1/metrics/prometheus.py``); verl runs its rollout
    engine inside the worker process, so the worker reads the counter without HTTP. Tracked per
    series like :class:`HttpExposition`.

    Args:
        engine: ``vllm`` or ``sglang``.
        registry: a prometheus-client ``CollectorRegistry`` (default: the global one, or a
            multiprocess registry when ``PROMETHEUS_MULTIPROC_DIR`` is set).
    """

    def __init__(self, engine: str, registry: Any = None) -> None:
        self.counter = engine_counter(engine)
        self._registry = registry
        self.series = MonotonicSeries()
        self.variant: str | None = None

    def _get_registry(self) -> Any:
        if self._registry is None:
            import os

            from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                reg = CollectorRegistry()
                multiprocess.MultiProcessCollector(reg)  # type: ignore[no-untyped-call]
                self._registry = reg
            else:
                self._registry = REGISTRY
        return self._registry

    def total(self) -> float:
        """Decoded tokens so far (monotonic over the registry's series)."""
        reading = read_engine(self._get_registry().collect(), self.counter.engine)
        self.variant = reading.variant.variant
        return self.series.update(reading.tokens)


class ReportedTokens:
    """Decoded tokens the trainer's own code reports (the SDK's count, not the engine's).

    For a generation phase whose engine metrics are missing (:class:`WithFallback`): code that
    sees the tokens come back (an agent loop, a rollout callback) calls :meth:`add`. A count
    that has not moved for ``stale_after_s`` is unavailable, not flat: a silent reporter must
    not read as an idle engine.

    Args:
        stale_after_s: how long the count stays current after the last ``add``, s.
        clock: monotonic clock (tests).
    """

    variant = "sdk"

    def __init__(
        self, *, stale_after_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._tokens = 0.0
        self._at: float | None = None
        self._lock = threading.Lock()

    def add(self, tokens: float) -> None:
        """``tokens`` more were decoded (>= 0).

        Raises:
            ValueError: a negative count.
        """
        if tokens < 0:
            raise ValueError(f"reported tokens must be >= 0, got {tokens}")
        with self._lock:
            self._tokens += float(tokens)
            self._at = self._clock()

    def total(self) -> float:
        """The tokens reported so far.

        Raises:
            ProgressUnavailable: nothing reported in the last ``stale_after_s``.
        """
        with self._lock:
            if self._at is None or self._clock() - self._at > self.stale_after_s:
                raise ProgressUnavailable(
                    f"no SDK-reported tokens in the last {self.stale_after_s:g} s"
                )
            return self._tokens


class WithFallback:
    """The engine's counter, else the SDK-reported tokens, continuous across a switch.

    ``total`` reads ``primary``; when it raises ``ProgressUnavailable`` (``MetricsUnavailable``:
    the counter is in no known naming) it reads ``fallback``; when both raise, the primary's
    error goes up (the reporter then sends nothing: never 0 tokens/s as if the engine idled).
    On a switch between them the total carries on from the last value sent, so the phase's
    progress neither jumps nor falls. An engine that went away (:class:`EngineLost`) is not
    covered over: it goes up as it is.

    Args:
        primary: the engine source (``pod_engines.PodEngines``, :class:`HttpExposition`).
        fallback: the SDK's count (:class:`ReportedTokens`).

    Attributes:
        variant: what the last read used: the primary's ``variant`` (e.g. ``vllm``,
            ``sglang-underscore``) or the fallback's (``sdk``).
        last_error: the primary's last error (``None``: it was read).
    """

    def __init__(self, primary: ProgressSource, fallback: ProgressSource) -> None:
        self.primary = primary
        self.fallback = fallback
        self._using: ProgressSource | None = None
        self._offset = 0.0
        self._last: float | None = None
        self.variant: str | None = None
        self.last_error: str | None = None

    def total(self) -> float:
        """Progress so far from whichever source can be read."""
        try:
            value, used = self.primary.total(), self.primary
            self.last_error = None
        except EngineLost:
            raise
        except ProgressUnavailable as exc:
            self.last_error = str(exc)
            try:
                value, used = self.fallback.total(), self.fallback
            except ProgressUnavailable:
                raise exc from None
        if used is not self._using:
            self._offset = 0.0 if self._last is None else self._last - value
            self._using = used
        self.variant = getattr(used, "variant", None)
        self._last = value + self._offset
        return self._last


class ForwardTokenCounter:
    """A forward hook on a torch module counting the tokens its forward passes processed.

    Tokens of a pass: ``numel`` of its ``input_ids`` (keyword, else the first tensor argument):
    with verl's ``use_remove_padding`` that is the packed (1, total_nnz) batch, the valid
    tokens; padded batches count their padding, which the GPU computes too. Only tensor shapes
    are read, never values, so the hook adds no device sync. On a CUDA module the pass is
    counted once a CUDA event recorded after it has completed (``torch.cuda.Event.query``, no
    wait), so the count follows the GPU, not the host running ahead of it; on CPU at once.

    Args:
        module: the actor module (e.g. verl's ``actor_module_fsdp``); any ``torch.nn.Module``.

    Attributes:
        micro_batches: forward passes counted (completed).
    """

    def __init__(self, module: Any) -> None:
        self.tokens = 0.0
        self.micro_batches = 0
        self._pending: deque[tuple[Any, float]] = deque()
        self._lock = threading.Lock()
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = next((a for a in args if hasattr(a, "numel") and hasattr(a, "shape")), None)
        if ids is None:
            return
        n = float(ids.numel())
        device = getattr(ids, "device", None)
        if device is not None and getattr(device, "type", "cpu") == "cuda":
            # torch is the hooked module's own library: only CUDA modules reach this line.
            torch: Any = importlib.import_module("torch")
            event = torch.cuda.Event()
            event.record()
            with self._lock:
                self._pending.append((event, n))
            return
        with self._lock:
            self.tokens += n
            self.micro_batches += 1

    def total(self) -> float:
        """Tokens of the completed forward passes so far."""
        with self._lock:
            while self._pending and self._pending[0][0].query():
                _, n = self._pending.popleft()
                self.tokens += n
                self.micro_batches += 1
            return self.tokens

    def remove(self) -> None:
        """Remove the hook from the module."""
        self._handle.remove()


class ProgressReporter:
    """Reads a source during a phase and reports the phase's progress to the agent.

    ``start`` takes the source's value as the phase's zero and starts a daemon thread that
    every ``period_s`` sends ``source.total() - zero`` through ``report`` (normally
    ``RLEnergyClient.progress_total``); ``stop`` sends one last value and ends the thread.
    A source that raises ``ProgressUnavailable`` is logged once per phase and nothing is sent
    for it (the agent then reports the window without progress: whole-phase evidence). A
    source that raises :class:`EngineLost` on the thread calls ``on_lost`` with the reason
    (once) and ends the thread; nothing more is sent for the phase, not even at ``stop``.

    Args:
        source: the counter.
        report: called with the phase's cumulative progress.
        period_s: read period, s.
        clock: monotonic clock (tests).
        on_lost: called on the thread when the source's engine went away (``None``: it is
            treated as any unreadable source).
    """

    def __init__(
        self,
        source: ProgressSource,
        report: Callable[[float], None],
        *,
        period_s: float = DEFAULT_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.source = source
        self.report = report
        self.period_s = period_s
        self._clock = clock
        self._zero: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        self.on_lost = on_lost
        self.lost: str | None = None
        """Why the source's engine went away this phase (``None``: it did not)."""
        self.reports = 0
        self.last_total: float | None = None
        """The newest value sent (``None``: nothing sent this phase)."""
        self.last_error: str | None = None

    def _read(self, *, watch_lost: bool = False) -> float | None:
        try:
            value = self.source.total()
        except EngineLost as exc:
            self.last_error = str(exc)
            if watch_lost and self.on_lost is not None:
                self.lost = str(exc)
                self._stop.set()
                self.on_lost(f"inference engine lost: {exc}")
            return None
        except ProgressUnavailable as exc:
            self.last_error = str(exc)
            if not self._warned:
                log.warning("no in-phase progress (%s): EE-RL uses whole-phase evidence", exc)
                self._warned = True
            return None
        if self._zero is None:
            self._zero = value
        return max(value - self._zero, 0.0)

    def _send(self, *, watch_lost: bool = False) -> None:
        if self.lost is not None:
            return
        done = self._read(watch_lost=watch_lost)
        if done is not None and self.lost is None:
            self.report(done)
            self.reports += 1
            self.last_total = done

    def start(self) -> None:
        """The phase starts now: take the zero and report every ``period_s``."""
        self.stop(final=False)
        self._zero = None
        self._warned = False
        self.last_total = None
        self.lost = None
        self._read()
        self._stop.clear()

        def run() -> None:
            nxt = self._clock()
            while not self._stop.is_set():
                nxt += self.period_s
                self._stop.wait(max(nxt - self._clock(), 0.0))
                if self._stop.is_set():
                    return
                self._send(watch_lost=True)

        self._thread = threading.Thread(target=run, name=REPORTER_THREAD, daemon=True)
        self._thread.start()

    def stop(self, *, final: bool = True) -> None:
        """The phase ends: stop the thread, then send the last value (``final``)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            if final:
                self._send()


class PhaseSignals(Protocol):
    """The agent client's phase and progress signals (``RLEnergyClient``)."""

    def phase(self, name: str, *, step: int) -> object:
        """Enter phase ``name`` of step ``step``."""
        ...

    def progress_total(self, total: float, *, in_flight: int | None = None) -> None:
        """Cumulative progress of the current phase; ``in_flight``: requests held now."""
        ...


class ActivitySource(Protocol):
    """An engine's requests held now and tokens decoded so far (``HttpExposition``)."""

    def activity(self) -> tuple[float, float]:
        """(requests held, decoded tokens); raises ``ProgressUnavailable`` when unreadable."""
        ...


class RolloutPoolPhases:
    """A rollout pool's own phases, from its engine's request gauges (async verl).

    In verl's one-step-off and fully-async recipes the rollout replicas run on their own GPU
    pool and serve requests while the trainer pool trains (``verl/experimental/
    one_step_off_policy/ray_trainer.py``, ``verl/experimental/fully_async_policy/``): no
    rollout call brackets their work, so the pool's workers signal it themselves. A thread in
    the rollout worker reads the engine's exposition every ``period_s``: when the engine holds
    requests (``EngineCounter.busy``: running + waiting) it signals ``generation`` of the pool's
    step and reports the tokens decoded since with the requests in flight (the agent's stall
    watch); once it has held none for ``idle_after_s`` it
    sends the last total and signals ``idle``. The pool's step is the policy version its
    weights came from: call ``set_step`` from the rollout worker's ``update_weights`` (verl
    passes ``global_steps``); a weight update while generating starts the new step's window.
    An unreadable exposition sends nothing (no phase is guessed).

    Args:
        source: the engine's exposition (``HttpExposition``).
        client: the agent client of this worker.
        step: the pool's step before the first weight update.
        period_s: read period, s.
        idle_after_s: time without held requests that ends a generation window, s (the
            engine's queue empties briefly between agent-loop turns).
        clock: monotonic clock (tests).
    """

    def __init__(
        self,
        source: ActivitySource,
        client: PhaseSignals,
        *,
        step: int = 0,
        period_s: float = DEFAULT_PERIOD_S,
        idle_after_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.client = client
        self.step = step
        self.period_s = period_s
        self.idle_after_s = idle_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._busy = False
        self._zero = 0.0
        self._last_tokens = 0.0
        self._quiet_since: float | None = None
        self._new_step = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.windows = 0
        self.last_error: str | None = None

    def set_step(self, step: int) -> None:
        """The pool's weights are now those of policy step ``step``."""
        with self._lock:
            if step != self.step:
                self.step = step
                self._new_step = self._busy

    def abort(self, reason: str) -> None:
        """The engine (or the pool's weight update) failed: an open window ends ``idle`` now.

        The agent returns the pool's GPUs to the default governor at once; the next held
        requests open a new window.
        """
        log.warning("rollout pool: %s; the GPUs go idle (default governor)", reason)
        with self._lock:
            if self._busy:
                self.client.phase("idle", step=self.step)
                self._busy = False

    def tick(self) -> None:
        """Read the engine once and signal what changed (the thread's body; tests).

        An engine that went away (:class:`EngineLost`) aborts an open window (:meth:`abort`).
        """
        try:
            held, tokens = self.source.activity()
        except EngineLost as exc:
            self.last_error = str(exc)
            self.abort(f"inference engine lost: {exc}")
            return
        except ProgressUnavailable as exc:
            self.last_error = str(exc)
            return
        now = self._clock()
        n = int(held)  # with the count the agent also watches the window for stalls
        with self._lock:
            if held > 0:
                self._quiet_since = None
                if not self._busy or self._new_step:
                    if self._busy:
                        self.client.progress_total(max(tokens - self._zero, 0.0), in_flight=n)
                    self.client.phase("generation", step=self.step)
                    self._busy, self._new_step = True, False
                    self._zero = tokens
                    self.windows += 1
                self.client.progress_total(max(tokens - self._zero, 0.0), in_flight=n)
            elif self._busy:
                if tokens > self._last_tokens:
                    self.client.progress_total(max(tokens - self._zero, 0.0), in_flight=n)
                if self._quiet_since is None:
                    self._quiet_since = now
                elif now - self._quiet_since >= self.idle_after_s:
                    self.client.progress_total(max(tokens - self._zero, 0.0), in_flight=n)
                    self.client.phase("idle", step=self.step)
                    self._busy = False
            self._last_tokens = tokens

    def start(self) -> None:
        """Start the reading thread."""
        if self._thread is not None:
            return
        self._stop.clear()

        def run() -> None:
            while not self._stop.wait(self.period_s):
                self.tick()

        self._thread = threading.Thread(target=run, name="rlenergy-pool", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (a generation window still open is closed with ``idle``)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            if self._busy:
                self.client.phase("idle", step=self.step)
                self._busy = False


def verl_actor_module(worker: Any) -> Any:
    """The torch module verl 0.9.1's actor trains, from its worker.

    ``verl.workers.engine_workers.ActorRolloutRefWorker.actor`` is a ``TrainingWorker`` whose
    ``engine`` (``verl/workers/engine/fsdp/transformer_impl.py`` ``FSDPEngine``) holds the
    wrapped ``module``; the engine calls it as ``module(input_ids=..., use_cache=False)``.

    Raises:
        ProgressUnavailable: the worker has no initialised actor engine (the path says which
            attribute is missing).
    """
    obj = worker
    for name in ("actor", "engine", "module"):
        obj = getattr(obj, name, None)
        if obj is None:
            raise ProgressUnavailable(f"verl worker has no actor.engine.module (no {name!r})")
    return obj


def verl_training_modules(worker: Any) -> list[Any]:
    """The distinct torch modules verl 0.9.1's training phase runs forward passes on.

    For an ``ActorRolloutRefWorker``: the actor's (``verl_actor_module``) and, when the worker
    has a reference model of its own (``ActorRolloutRefWorker.ref``, a ``TrainingWorker`` that
    ``compute_ref_log_prob`` runs), the reference's ``ref.engine.module``; the same module once.
    For a ``TrainingWorker`` of its own (PPO's critic, ``Role.Critic``, with no ``actor``): its
    ``engine.module``.

    Raises:
        ProgressUnavailable: the worker has no initialised actor engine (nor an engine module
            of its own).
    """
    own = getattr(getattr(worker, "engine", None), "module", None)
    if getattr(worker, "actor", None) is None and own is not None:
        return [own]
    modules = [verl_actor_module(worker)]
    ref = getattr(getattr(worker, "ref", None), "engine", None)
    module = getattr(ref, "module", None)
    if module is not None and all(module is not m for m in modules):
        modules.append(module)
    return modules


class TrainingTokens:
    """Tokens of the completed forward passes over verl workers' training modules.

    One ``ForwardTokenCounter`` per module of ``verl_training_modules(worker)`` (log-prob,
    reference log-prob and update passes all count: the training phase's GPU work), and of
    each further worker :meth:`watch` is given (PPO's critic, which verl runs as a worker of its
    own in the same process: values and critic update passes count too).

    Raises:
        ProgressUnavailable: the worker has no initialised actor engine.
    """

    def __init__(self, worker: Any) -> None:
        self.modules: list[Any] = []
        self.counters: list[ForwardTokenCounter] = []
        self.watch(worker)

    def watch(self, worker: Any) -> None:
        """Count the training modules of ``worker`` too (a module already counted: once).

        Raises:
            ProgressUnavailable: ``worker`` has no training module (nothing added).
        """
        for module in verl_training_modules(worker):
            if all(module is not m for m in self.modules):
                self.modules.append(module)
                self.counters.append(ForwardTokenCounter(module))

    def total(self) -> float:
        """Tokens counted so far, summed over the modules."""
        return sum(c.total() for c in list(self.counters))


class PhaseProgress:
    """One phase's progress for a per-phase hook: ``begin(worker, report)`` / ``end()``.

    The shape of ``rlenergy.sdk.verl_hook``'s progress seam: at the phase's start it makes the
    source once from the worker (``make``: e.g. ``lambda w: ForwardTokenCounter(
    verl_actor_module(w))`` or ``lambda w: HttpExposition(url, "vllm")``) and runs a
    ``ProgressReporter`` on it; at the end it stops the reporter and returns the phase's total.
    A source with a ``watch(worker)`` method (``TrainingTokens``) is given each later phase's
    worker before it starts (and, through :meth:`watch`, the worker continuing a phase), so a
    phase run by another worker of the process (PPO's critic) counts that worker's work too.

    Args:
        make: builds the source from the worker; may raise ``ProgressUnavailable`` (then the
            phase has no progress and ``end`` returns ``None``).
        period_s: report period, s.
        on_lost: the reporters' ``on_lost`` (the source's engine went away mid-phase).
    """

    def __init__(
        self,
        make: Callable[[Any], ProgressSource],
        *,
        period_s: float = DEFAULT_PERIOD_S,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self._make = make
        self.period_s = period_s
        self.on_lost = on_lost
        self.source: ProgressSource | None = None
        self.reporter: ProgressReporter | None = None
        self.last_error: str | None = None

    def begin(self, worker: Any, report: Callable[[float], None]) -> None:
        """The phase starts: report its progress every ``period_s`` through ``report``."""
        if self.source is None:
            try:
                self.source = self._make(worker)
            except ProgressUnavailable as exc:
                self.last_error = str(exc)
                log.warning("no in-phase progress (%s): EE-RL uses whole-phase evidence", exc)
                return
        else:
            self.watch(worker)
        if self.reporter is not None:  # a window left open by an abort: closed, nothing sent
            self.reporter.stop(final=False)
        self.reporter = ProgressReporter(
            self.source, report, period_s=self.period_s, on_lost=self.on_lost
        )
        self.reporter.start()

    def watch(self, worker: Any) -> None:
        """Count ``worker``'s work too, from now on (its source's ``watch``, if it has one).

        For a phase that another worker of the process continues (verl's critic after the
        actor's log-prob passes, both ``training``): the phase's total goes on from its zero.
        """
        watch = getattr(self.source, "watch", None)
        if worker is None or not callable(watch):
            return
        try:
            watch(worker)
        except ProgressUnavailable as exc:  # the source counts what it counted before
            self.last_error = str(exc)
            log.warning("in-phase progress without this worker's modules (%s)", exc)

    def end(self) -> float | None:
        """The phase ends: the last report goes out; returns the phase's total (or ``None``).

        A phase whose engine went away (``on_lost``) sends no last report.
        """
        rep, self.reporter = self.reporter, None
        if rep is None:
            return None
        rep.stop()
        self.last_error = rep.last_error
        return rep.last_total

    @property
    def variant(self) -> str | None:
        """The metric variant the source read last (``VARIANTS``; ``sdk``: reported tokens)."""
        return getattr(self.source, "variant", None)
