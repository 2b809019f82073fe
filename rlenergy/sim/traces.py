"""Parse real RL step logs: verl console logs and the CSV traces shipped as package data.

A trace is one row per RL step with verl's metric keys (``timing_s/gen``,
``response_length/mean``, ...). verl versions name metrics differently (``timing/gen`` in old
logs, ``timing_s/gen`` in new ones; some logs lack a metric), so ``METRIC_ALIASES`` maps each
quantity the simulator needs to the keys that carry it, and ``Trace.notes`` says which key was
used and what was missing, instead of guessing silently.

Callers: ``rlenergy.sim.workload`` turns ``StepRecord``s into per-SKU phase work;
``rlenergy.cli`` lists and loads traces.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from rlenergy import errors
from rlenergy.api import phases as api_phases

GEN_TIME_KEYS = (
    "timing_s/gen",
    "timing/gen",
    "timing_s/generate_sequences",
    "timing_s/get_batch_rollout_with_filtering",
)
"""Generation (rollout) phase time, s, in order of preference."""

TRAIN_TIME_PARTS = tuple(s.timing_key for s in api_phases.TRAINING_SUBPHASES)
"""GPU phases of the training side of a step (verl ``timing_s/<part>`` or ``timing/<part>``),
in the order a step runs them (``rlenergy.api.phases.TRAINING_SUBPHASES``)."""

_SUM_ORDER = ("old_log_prob", "ref", "values", "update_actor", "update_critic")
STEP_TIME_KEYS = ("timing_s/step", "timing/step")
EXCLUDED_TIME_PARTS = ("testing", "save_checkpoint")
"""Validation and checkpointing are not part of an RL step's work; removed from step time."""

METRIC_ALIASES: Mapping[str, tuple[str, ...]] = {
    "response_length_mean": ("response_length/mean",),
    "response_length_max": ("response_length/max",),
    "prompt_length_mean": ("prompt_length/mean",),
    "total_num_tokens": ("perf/total_num_tokens",),
    "total_num_samples": ("rollout/total_num_samples",),
    "too_bad_ratio": ("rollout/too_bad_sample_ratio",),
    "too_good_ratio": ("rollout/too_good_sample_ratio",),
}

_SNAPSHOT_MARKERS = ("sample_id", "table")
_STEP_RE = re.compile(r"(?:^|\s|\()step:(\d+)\s+-\s+(.*)$")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One RL step as logged, on the GPU the trace was recorded on.

    Attributes:
        step: the logged step number.
        gen_time_s: generation phase time, s.
        train_time_s: sum of the training-side GPU phases, s.
        other_time_s: the rest of the step (reward, advantage, data), s; GPU near idle.
        samples: samples that reach the training update.
        generated_samples: samples generated (>= samples when dynamic sampling drops groups).
        prompt_length_mean: mean prompt tokens per sample.
        response_length_mean: mean response tokens per sample.
        response_length_max: longest response, tokens.
        train_parts_s: the training-side GPU phases as logged, ``(timing key, s)`` in step
            order (keys of ``TRAIN_TIME_PARTS``); they sum to ``train_time_s``.
    """

    step: int
    gen_time_s: float
    train_time_s: float
    other_time_s: float
    samples: int
    generated_samples: int
    prompt_length_mean: float
    response_length_mean: float
    response_length_max: float
    train_parts_s: tuple[tuple[str, float], ...] = ()

    @property
    def valid_tokens(self) -> float:
        """Response tokens of samples that reach the update (``TokenWorkload.valid_tokens``)."""
        return self.samples * self.response_length_mean

    @property
    def response_tokens(self) -> float:
        """All generated response tokens, valid or not."""
        return self.generated_samples * self.response_length_mean

    @property
    def prompt_tokens(self) -> float:
        """Prompt tokens of the trained samples."""
        return self.samples * self.prompt_length_mean


@dataclasses.dataclass(frozen=True)
class Trace:
    """A parsed step trace.

    Attributes:
        name: trace name (file stem).
        steps: the usable steps in log order.
        meta: the ``.meta.json`` beside the trace, or ``{}``.
        gpu_description: free text naming the GPU the trace was recorded on.
        num_gpus: GPUs of the job (from meta; 8 when unknown, noted).
        notes: what was mapped, derived, skipped or missing, one line each.
    """

    name: str
    steps: tuple[StepRecord, ...]
    meta: Mapping[str, Any]
    gpu_description: str
    num_gpus: int
    notes: tuple[str, ...]


def packaged_trace_names(*, replayable_only: bool = True) -> tuple[str, ...]:
    """Names of the traces shipped in the package, sorted.

    Args:
        replayable_only: leave out snapshot tables (one row per configuration, not per step).
    """
    root = resources.files("rlenergy.sim").joinpath("data/traces")
    names = []
    for entry in root.iterdir():
        if entry.name.endswith(".csv"):
            header = entry.read_text().splitlines()[0].split(",")
            if replayable_only and any(m in header for m in _SNAPSHOT_MARKERS):
                continue
            names.append(entry.name[: -len(".csv")])
    return tuple(sorted(names))


def load_trace(name_or_path: str) -> Trace:
    """Load a packaged trace by name, or a CSV / verl console log by path.

    Raises:
        InvalidInputError: unknown name, unreadable file, malformed line or missing metric;
            the message names the trace, line or metric and what is allowed.
    """
    return build_trace(*load_rows(name_or_path))


def load_rows(name_or_path: str) -> tuple[str, list[dict[str, float]], Mapping[str, Any]]:
    """The metric rows of a trace as logged: ``(name, rows, meta)``.

    ``name_or_path`` is what ``load_trace`` takes: a packaged trace name, or the path of a
    ``.csv`` trace or a verl console log (its ``.meta.json`` beside it, if any, is the meta).

    Raises:
        InvalidInputError: as ``load_trace``.
    """
    path = Path(name_or_path)
    if path.suffix and path.exists():
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            raise errors.InvalidInputError("--trace", f"{name_or_path}: {exc.strerror}") from None
        meta_path = path.with_suffix(".meta.json")
        try:
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        except ValueError as exc:
            raise errors.InvalidInputError("--trace", f"{meta_path}: not JSON ({exc})") from None
        name = path.stem
        rows = _read_csv(text, name) if path.suffix == ".csv" else parse_console_log(text, name)
        return name, rows, meta
    root = resources.files("rlenergy.sim").joinpath("data/traces")
    entry = root.joinpath(f"{name_or_path}.csv")
    if not entry.is_file():
        known = ", ".join(packaged_trace_names())
        raise errors.InvalidInputError(
            "--trace",
            f"unknown trace {name_or_path!r}: give a packaged name ({known}) "
            "or the path of a .csv trace or a verl console log",
        )
    rows = _read_csv(entry.read_text(), name_or_path)
    meta_entry = root.joinpath(f"{name_or_path}.meta.json")
    meta = json.loads(meta_entry.read_text()) if meta_entry.is_file() else {}
    return name_or_path, rows, meta


def _read_csv(text: str, name: str) -> list[dict[str, float]]:
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    if any(m in header for m in _SNAPSHOT_MARKERS):
        raise errors.InvalidInputError(
            "--trace",
            f"{name} is a table of single-step snapshots (one row per configuration), not a "
            f"step trace; replayable traces: {', '.join(packaged_trace_names())}",
        )
    if "step" not in header:
        raise errors.InvalidInputError("--trace", f"{name}: CSV has no 'step' column")
    rows: list[dict[str, float]] = []
    for lineno, raw in enumerate(reader, start=2):
        row: dict[str, float] = {}
        for key, cell in raw.items():
            if key is None or cell is None or cell.strip() == "":
                continue
            try:
                row[key] = float(cell)
            except ValueError:
                continue  # text metrics (e.g. sample ids) are not used
        if "step" not in row:
            raise errors.InvalidInputError("--trace", f"{name}:{lineno}: row without a step number")
        rows.append(row)
    return rows


def parse_console_log(text: str, name: str = "log") -> list[dict[str, float]]:
    """Parse verl console output: lines of ``step:N - key:value - key:value ...``.

    Lines without ``step:N -`` are other log output and are skipped. A step line whose fields
    do not parse is an error (a truncated or mangled log should not be replayed silently).

    Raises:
        InvalidInputError: a malformed step line, naming its line number and the bad field.
    """
    rows: list[dict[str, float]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        match = _STEP_RE.search(line.strip())
        if match is None:
            continue
        row: dict[str, float] = {"step": float(match.group(1))}
        for field in match.group(2).split(" - "):
            key, sep, value = field.strip().rpartition(":")
            if not sep or not key:
                raise errors.InvalidInputError(
                    f"{name}:{lineno}",
                    f"malformed field {field.strip()!r}; expected 'key:value' separated by ' - '",
                )
            try:
                row[key.strip()] = float(value)
            except ValueError:
                raise errors.InvalidInputError(
                    f"{name}:{lineno}",
                    f"metric {key.strip()!r} has non-numeric value {value.strip()!r}",
                ) from None
        rows.append(row)
    if not rows:
        raise errors.InvalidInputError(
            "--trace", f"{name}: no 'step:N - key:value' lines found (is this a verl console log?)"
        )
    return rows


def _first(row: Mapping[str, float], keys: Iterable[str]) -> tuple[str, float] | None:
    for key in keys:
        value = row.get(key)
        if value is not None and math.isfinite(value):
            return key, value
    return None


def _metric(row: Mapping[str, float], quantity: str) -> float | None:
    found = _first(row, METRIC_ALIASES[quantity])
    return None if found is None else found[1]


def _train_parts(
    row: Mapping[str, float], used_keys: dict[str, set[str]]
) -> tuple[list[tuple[str, float]], float]:
    """(training parts logged, in ``TRAIN_TIME_PARTS`` order, s; their sum, s) of one row."""
    parts: list[tuple[str, float]] = []
    for part in TRAIN_TIME_PARTS:
        found = _first(row, (f"timing_s/{part}", f"timing/{part}"))
        if found is not None:
            parts.append((part, found[1]))
            used_keys.setdefault("training time", set()).add(found[0])
    logged = dict(parts)
    train_time = 0.0
    for part in _SUM_ORDER:  # the order the sum always had: identical replays
        train_time += logged.get(part, 0.0)
    return parts, train_time


def _samples(
    row: Mapping[str, float],
    name: str,
    meta_samples: int | None,
    seq_tokens: float,
    used_keys: dict[str, set[str]],
) -> tuple[int, int]:
    """(samples per step, samples generated) of one row.

    From the meta's batch x rollout_n, else the row's tokens over its mean sequence length
    (``seq_tokens``: prompt + response tokens), else its sample count.

    Raises:
        InvalidInputError: none of these is known.
    """
    samples = meta_samples
    generated = _metric(row, "total_num_samples")
    if samples is None:
        total_tokens = _metric(row, "total_num_tokens")
        if total_tokens is not None and seq_tokens > 0:
            samples = int(round(total_tokens / seq_tokens))
            used_keys.setdefault("samples", set()).add("perf/total_num_tokens / seq length")
        elif generated is not None:
            samples = int(generated)
        else:
            raise errors.InvalidInputError(
                "--trace",
                f"{name}: cannot derive samples per step: give train_batch_size and "
                "rollout_n in the .meta.json or log perf/total_num_tokens",
            )
    else:
        used_keys.setdefault("samples", {"meta train_batch_size x rollout_n"})
    generated_samples = max(int(generated), samples) if generated is not None else samples
    return samples, generated_samples


def build_trace(name: str, rows: list[dict[str, float]], meta: Mapping[str, Any]) -> Trace:
    """Turn metric rows into ``StepRecord``s, recording every mapping and gap in ``notes``.

    Raises:
        InvalidInputError: no row has a generation time, or the sample count cannot be derived.
    """
    notes: list[str] = []
    used_keys: dict[str, set[str]] = {}
    skipped: dict[str, int] = {}
    steps: list[StepRecord] = []
    batch = meta.get("train_batch_size")
    rollout_n = meta.get("rollout_n") or 1
    meta_samples = int(batch * rollout_n) if isinstance(batch, int | float) else None
    for row in rows:
        gen = _first(row, GEN_TIME_KEYS)
        if gen is None:
            skipped["no generation time"] = skipped.get("no generation time", 0) + 1
            continue
        used_keys.setdefault("generation time", set()).add(gen[0])
        parts, train_time = _train_parts(row, used_keys)
        resp_mean = _metric(row, "response_length_mean")
        if resp_mean is None or train_time <= 0:
            reason = "no response_length/mean" if resp_mean is None else "no training timings"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        prompt_mean = _metric(row, "prompt_length_mean")
        if prompt_mean is None:
            prompt_mean = 0.0
            skipped["prompt_length/mean missing, 0 used"] = (
                skipped.get("prompt_length/mean missing, 0 used", 0) + 1
            )
        resp_max = _metric(row, "response_length_max") or resp_mean
        step_time = _first(row, STEP_TIME_KEYS)
        excluded = sum(
            (_first(row, (f"timing_s/{p}", f"timing/{p}")) or ("", 0.0))[1]
            for p in EXCLUDED_TIME_PARTS
        )
        if step_time is None:
            other = 0.0
            skipped["no step time: other time 0"] = skipped.get("no step time: other time 0", 0) + 1
        else:
            other = max(step_time[1] - excluded - gen[1] - train_time, 0.0)
        samples, generated_samples = _samples(
            row, name, meta_samples, resp_mean + prompt_mean, used_keys
        )
        steps.append(
            StepRecord(
                step=int(row["step"]),
                gen_time_s=gen[1],
                train_time_s=train_time,
                other_time_s=other,
                samples=samples,
                generated_samples=generated_samples,
                prompt_length_mean=prompt_mean,
                response_length_mean=resp_mean,
                response_length_max=resp_max,
                train_parts_s=tuple(parts),
            )
        )
    if not steps:
        raise errors.InvalidInputError(
            "--trace",
            f"{name}: no usable step (need a generation time: one of {', '.join(GEN_TIME_KEYS)}; "
            "training timings; response_length/mean)",
        )
    for what, keys in sorted(used_keys.items()):
        notes.append(f"{what} from {', '.join(sorted(keys))}")
    for why, count in sorted(skipped.items()):
        notes.append(f"{count} step row(s): {why}")
    gpu = meta.get("gpu")
    gpu_description = str(gpu.get("type", "")) if isinstance(gpu, dict) else ""
    num_gpus = int(gpu.get("count", 0)) if isinstance(gpu, dict) and gpu.get("count") else 0
    if num_gpus <= 0:
        num_gpus = 8
        notes.append("GPU count unknown: 8 assumed")
    return Trace(
        name=name,
        steps=tuple(steps),
        meta=dict(meta),
        gpu_description=gpu_description,
        num_gpus=num_gpus,
        notes=tuple(notes),
    )
