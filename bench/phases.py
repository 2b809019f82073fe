"""Finer phases benchmark: what naming verl's training sub-phases adds.

Every shipped trace that logs two or more training sub-phases (``timing_s/old_log_prob``,
``ref``, ``values``, ``update_critic``, ``update_actor``) is simulated split by sub-phase
(``workload.from_trace(split=True)``: forward-only passes and updates each with their own
physics, ``rlenergy.gpu.models`` ``forward`` kind [MODEL]) on GPU curves of both families, sync
mode (every shipped trace is a sync run), three ways on the same steps and noise:

* ``two``: the default policy, ``generation`` and ``training`` (the sub-phases share a clock);
* ``fine``: ``generation`` plus every sub-phase long enough to probe, each its own phase (the
  rest stay ``training``). Long enough: a mean default-governor time on the simulated GPU of
  at least ``slices_per_phase x MIN_SLICE_S`` (1.2 s: the in-phase probe time of a full trial
  step, ``rlenergy.control.freq.eerl``); a (trace, GPU) with none is left out;
* ``fine+idle``: ``fine`` with each step's idle gap (reward, advantage, data: the step time
  the trace logs outside its GPU phases) locked at the GPU's lowest supported clock instead
  of the default governor the node agent returns it to.

Each row gives per way the online saving (energy per valid token vs the default governor,
trials included), online/oracle, the lowest phase's throughput margin over its threshold and
the status's largest saving / throughput-ratio error against the truth; then ``fine - two`` and
``idle - fine`` in percentage points of saving. The summary lines, per family: how many rows
keep every phase's threshold each way, the mean and range of what ``fine`` and the idle lock
add, and the worst status errors.

Usage: ``python bench/phases.py [--steps 200] [--seeds 0] [--jobs N]
[--family both|first|published] [--traces a,b] [--json]`` (``make bench-phases``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import runs as runs_mod
from rich.console import Console
from rich.table import Table

from rlenergy.api import phases as api_phases
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import eerl
from rlenergy.gpu import models, published
from rlenergy.sim import job as sim_job
from rlenergy.sim import report, traces, workload

GPUS = ("h100-sxm", "b200")
WAYS = ("two", "fine", "fine+idle")
PROBE_PHASE_S = eerl.ControllerSettings().slices_per_phase * eerl.MIN_SLICE_S
"""Shortest mean phase time that holds a full trial step's probe slices, s."""


def _sku(gpu: str) -> models.GpuSku:
    return published.get(gpu) if ":" in gpu else models.get_sku(gpu)


def subphase_times_s(trace: str, gpu: str, steps: int) -> dict[str, float]:
    """Mean default-governor time of each training sub-phase ``trace`` logs on ``gpu``, s."""
    sku = _sku(gpu)
    replay = workload.from_trace(traces.load_trace(trace), sku, steps, split=True)
    subs = [n for n in replay.phase_names if n in api_phases.SUBPHASE_BY_NAME]
    default = sim_job.default_run(sim_job.Job(replay, sku, "sync", phases=subs))
    return {n: default.phase_time_s[n] / steps for n in subs}


def run_row(run: tuple[str, str, int, int]) -> dict[str, Any] | None:
    """One bench row: ``(trace, gpu, steps, seed)`` simulated the three ways (``WAYS``).

    None where no sub-phase is long enough to probe (``PROBE_PHASE_S``).
    """
    name, gpu, steps, seed = run
    times = subphase_times_s(name, gpu, steps)
    subs = tuple(n for n, t in times.items() if t >= PROBE_PHASE_S)
    if not subs:
        return None
    rest = ["training"] if len(subs) < len(times) else []
    fine = api_policy.RLEnergyPolicySpec(
        phases=[api_policy.PhaseSpec(name=n) for n in ("generation", *subs, *rest)]
    )
    lowest = _sku(gpu).supported_sm_clocks_mhz()[-1]
    reports = {
        "two": report.simulate(name, gpu, "sync", steps=steps, seed=seed, split=True),
        "fine": report.simulate(name, gpu, "sync", steps=steps, seed=seed, policy=fine),
        "fine+idle": report.simulate(
            name, gpu, "sync", steps=steps, seed=seed, policy=fine, idle_lock_mhz=lowest
        ),
    }
    row: dict[str, Any] = {
        "trace": name,
        "gpu": gpu,
        "seed": seed,
        "family": "published" if ":" in gpu else "first",
        "subphases": list(subs),
        "subphase_times_s": times,
        "idle_share": _idle_share(reports["two"]),
    }
    for way, rep in reports.items():
        row[way] = {
            "online_saving": rep.online_saving,
            "oracle_saving": rep.oracle_saving,
            "online_to_oracle": rep.online_to_oracle,
            "throughput_ratio": rep.throughput_ratio,
            "phase_margin": min(p.throughput_ratio - p.min_throughput_ratio for p in rep.phases),
            "status_saving_error_pp": rep.status_errors[0],
            "status_ratio_error": rep.status_errors[1],
            "clocks": {p.name: p.final_clock_mhz for p in rep.phases},
        }
    row["fine_minus_two_pp"] = 100.0 * (row["fine"]["online_saving"] - row["two"]["online_saving"])
    row["idle_minus_fine_pp"] = 100.0 * (
        row["fine+idle"]["online_saving"] - row["fine"]["online_saving"]
    )
    return row


def _idle_share(rep: report.SimulationReport) -> float:
    """Share of the default run's step time the GPUs idle (the trace's gaps)."""
    total = sum(t for t, _ in rep.default_steps)
    busy = sum(rep.default.phase_time_s.values())
    return max(total - busy, 0.0) / total if total > 0 else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0", help="comma-separated noise seeds")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--family", choices=("both", "first", "published"), default="both")
    parser.add_argument("--traces", default="", help="comma-separated (default: every shipped)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    gpus = (GPUS if args.family != "published" else ()) + (
        published.curve_names() if args.family != "first" else ()
    )
    names = [t for t in args.traces.split(",") if t] or list(traces.packaged_trace_names())
    seeds = [int(x) for x in args.seeds.split(",") if x]
    runs = [(n, g, args.steps, s) for s in seeds for n in names for g in gpus]
    rows, elapsed = runs_mod.run_in_order(run_row, runs, args.jobs, _progress)
    if args.json:
        runs_mod.print_json(rows, elapsed)
    else:
        _table(rows, args)
        print(f"{len(rows)} rows ({3 * len(rows)} runs) in {elapsed:.1f} s")
    out = sys.stderr if args.json else sys.stdout
    for line in summary_lines(rows):
        print(line, file=out)
    return 0


def _progress(run: tuple[str, str, int, int], r: dict[str, Any] | None) -> str:
    """The line each finished row prints to stderr."""
    if r is None:
        return f"{run[0]} {run[1]}: no sub-phase of {PROBE_PHASE_S:.1f} s"
    return (
        f"{r['trace']} {r['gpu']} seed {r['seed']}: fine - two "
        f"{r['fine_minus_two_pp']:+.2f} pp, idle - fine {r['idle_minus_fine_pp']:+.2f} pp"
    )


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    table = Table(title=f"Finer phases ({args.steps} steps, sync, seeds {args.seeds})")
    for col in ("trace", "gpu", "seed", "sub-phases", "idle"):
        table.add_column(col)
    for way in WAYS:
        table.add_column(f"{way}: saving, o/o, margin, status err", justify="right")
    table.add_column("fine-two pp", justify="right")
    table.add_column("idle-fine pp", justify="right")
    for r in rows:
        cells = []
        for way in WAYS:
            w = r[way]
            err = (
                "?"
                if w["status_saving_error_pp"] is None
                else f"{w['status_saving_error_pp']:.2f}/{w['status_ratio_error']:.3f}"
            )
            cells.append(
                f"{w['online_saving']:.1%} {w['online_to_oracle']:.2f} "
                f"{w['phase_margin']:+.3f} {err}"
            )
        table.add_row(
            r["trace"][:30],
            r["gpu"],
            str(r["seed"]),
            ",".join(r["subphases"]),
            f"{r['idle_share']:.0%}",
            *cells,
            f"{r['fine_minus_two_pp']:+.2f}",
            f"{r['idle_minus_fine_pp']:+.2f}",
        )
    Console(width=240).print(table)


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per family: thresholds kept each way, what ``fine`` and the idle lock add, status errors."""
    lines = []
    for family in ("first", "published"):
        fam = [r for r in rows if r["family"] == family]
        if not fam:
            continue
        kept = {w: sum(r[w]["phase_margin"] >= 0 for r in fam) for w in WAYS}
        gain = [r["fine_minus_two_pp"] for r in fam]
        idle = [r["idle_minus_fine_pp"] for r in fam]
        errs = {
            w: max((r[w]["status_saving_error_pp"] or 0.0) for r in fam) for w in ("two", "fine")
        }
        ratio_errs = {
            w: max((r[w]["status_ratio_error"] or 0.0) for r in fam) for w in ("two", "fine")
        }
        lines.append(
            f"{family} family ({len(fam)} rows): every phase's threshold kept on "
            + ", ".join(f"{w} {kept[w]}" for w in WAYS)
            + f"; fine - two saving {sum(gain) / len(gain):+.2f} pp mean "
            f"({min(gain):+.2f} to {max(gain):+.2f}); idle lock - fine "
            f"{sum(idle) / len(idle):+.2f} pp mean ({min(idle):+.2f} to {max(idle):+.2f}); "
            f"worst status error two {errs['two']:.2f} pp / {ratio_errs['two']:.4f}, "
            f"fine {errs['fine']:.2f} pp / {ratio_errs['fine']:.4f}"
        )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
