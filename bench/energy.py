"""EE-RL energy benchmark: every shipped trace x {sync, async} x GPU curves of both physics families.

The first family is ``h100-sxm`` and ``b200`` (``rlenergy.gpu.models``, the model EE-RL's fit
assumes); the second is every curve of ``rlenergy.gpu.published`` (shapes from published
measurements: ``h100-sxm:hbm-decode`` etc.). Prints one row per run (online saving, oracle
saving, their ratio, throughput vs default, the lowest phase throughput ratio, trial steps,
measured-vs-true energy, and the largest error of the status's saving, in percentage points,
and throughput ratio against the truth over the phases and the job total: ``sim.status``) and, last, per family one line with the worst ``online_to_oracle`` and
the worst ``throughput_ratio - min_throughput_ratio`` (whole job and lowest phase). Targets:
online/oracle >= 0.95, throughput >= each phase's minThroughputRatio. Before it,
per family and margin of ``CEILING_MARGINS``, the ceiling: the oracle searched again with
every threshold raised by the margin (no learning cost) over the oracle, worst row and rows
below 0.95 (``report.simulate(oracle_margins=...)``).

Seeds: every figure is judged over several noise seeds (``--seeds``, default 0-2, one row per
seed; the summary lines take the worst over all of them): one seed hid threshold misses that
another showed (seed 0 kept every phase's threshold; seed 1 missed generation's by 0.028 on
TinyZero, ``b200:saturating-decode``, sync). Runs go to ``--jobs`` processes.

Usage: ``python bench/energy.py [--steps 200] [--seeds 0,1,2] [--jobs N]
[--family both|first|published] [--json]`` (``make bench-energy``).
"""

from __future__ import annotations

import argparse
import os
import sys

import runs as runs_mod
from rich.console import Console
from rich.table import Table

from rlenergy.control.freq import eerl
from rlenergy.gpu import published
from rlenergy.sim import report, traces

GPUS = ("h100-sxm", "b200")
MODES = ("sync", "async")
CEILING_MARGINS = (eerl.LOCK_MARGIN, 0.005)
"""Margins above every threshold at which each row's oracle is searched again (no learning
cost): the ceiling of online/oracle for a controller that keeps a verified margin (EE-RL's
locks add ``LOCK_MARGIN`` to a confidence bound)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated noise seeds")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--family", choices=("both", "first", "published"), default="both")
    parser.add_argument("--traces", default="", help="comma-separated (default: every shipped)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    gpus = (GPUS if args.family != "published" else ()) + (
        published.curve_names() if args.family != "first" else ()
    )
    names = [t for t in args.traces.split(",") if t] or traces.packaged_trace_names()
    seeds = [int(x) for x in args.seeds.split(",") if x]
    runs = [
        (name, gpu, mode, args.steps, seed)
        for seed in seeds
        for mode in args.modes.split(",")
        for name in names
        for gpu in gpus
    ]
    rows, elapsed = runs_mod.run_in_order(_run, runs, args.jobs, _progress)
    if args.json:
        runs_mod.print_json(rows, elapsed)
    else:
        table = Table(
            title=f"EE-RL vs default governor and oracle ({args.steps} steps, seeds {args.seeds})"
        )
        for col in (
            "trace",
            "gpu",
            "mode",
            "seed",
            "online",
            "oracle",
            "online/oracle",
            "throughput",
            "phase margin",
            "trials",
            "clocks gen/train (oracle)",
            "meas. err",
            "status err pp/ratio",
        ):
            table.add_column(
                col, justify="left" if col in ("trace", "gpu", "mode", "seed") else "right"
            )
        for r in rows:
            clocks = "/".join(str(r["clocks"][p] or "def") for p in ("generation", "training"))
            oracle = "/".join(
                str(r["oracle_clocks"][p] or "def") for p in ("generation", "training")
            )
            err = r["measured_energy_error"]
            table.add_row(
                r["trace"][:34],
                r["gpu"],
                r["mode"],
                str(r["seed"]),
                f"{r['online_saving']:.1%}",
                f"{r['oracle_saving']:.1%}",
                f"{r['online_to_oracle']:.2f}",
                f"{r['throughput_ratio']:.3f}",
                f"{r['phase_throughput_margin']:+.3f}",
                str(r["trial_steps"]),
                f"{clocks} ({oracle})",
                "unknown" if err is None else f"{err:+.2%}",
                _status_error(r),
            )
        Console(width=200).print(table)
        print(f"{len(rows)} runs in {elapsed:.1f} s")
    summary = sys.stderr if args.json else sys.stdout  # --json: stdout is the JSON alone
    for family in ("first", "published"):
        fam = [r for r in rows if r["family"] == family]
        if not fam:
            continue
        worst_ratio = min(fam, key=lambda r: r["online_to_oracle"])
        worst_margin = min(fam, key=lambda r: r["throughput_ratio"] - r["min_throughput_ratio"])
        worst_phase = min(fam, key=lambda r: r["phase_throughput_margin"])
        worst_kept = min(fam, key=lambda r: r["threshold_margin"])
        known = [r for r in fam if r["status_saving_error_pp"] is not None]
        unknown = len(fam) - len(known)
        if known:
            worst_sav = max(known, key=lambda r: r["status_saving_error_pp"])
            worst_thr = max(known, key=lambda r: r["status_ratio_error"])
            over_sav = sum(r["status_saving_error_pp"] > 1.0 for r in known)
            over_thr = sum(r["status_ratio_error"] > 0.01 for r in known)
            print(
                f"{family} family: status vs truth: worst saving error "
                f"{worst_sav['status_saving_error_pp']:.3f} pp {_where(worst_sav)}, "
                f"{over_sav} of {len(known)} rows over 1 pp; worst throughput ratio error "
                f"{worst_thr['status_ratio_error']:.4f} {_where(worst_thr)}, {over_thr} rows "
                f"over 0.01; targets 1 pp and 0.01"
                + (f"; {unknown} rows without a status figure" if unknown else ""),
                file=summary,
            )
        for m in CEILING_MARGINS:
            key = f"{m:g}"
            worst_c = min(fam, key=lambda r: r["ceiling"][key])
            print(
                f"{family} family: ceiling, the oracle held {m:g} above every threshold (no "
                f"learning cost) / the oracle: worst {worst_c['ceiling'][key]:.3f} "
                f"{_where(worst_c)}, below 0.95 on "
                f"{sum(r['ceiling'][key] < 0.95 for r in fam)} of {len(fam)} rows",
                file=summary,
            )
        below = sum(r["threshold_margin"] < 0 for r in fam)
        print(
            f"{family} family: worst online_to_oracle: {worst_ratio['online_to_oracle']:.3f} "
            f"{_where(worst_ratio)}; mean "
            f"{sum(r['online_to_oracle'] for r in fam) / len(fam):.3f}; "
            f"worst throughput_ratio - min_throughput_ratio: "
            f"{worst_margin['throughput_ratio'] - worst_margin['min_throughput_ratio']:+.4f} "
            f"{_where(worst_margin)}; "
            f"worst phase margin: {worst_phase['phase_throughput_margin']:+.4f} "
            f"{_where(worst_phase)}; threshold kept (sync: every phase, async: the job) on "
            f"{len(fam) - below} of {len(fam)} rows, worst {worst_kept['threshold_margin']:+.4f} "
            f"{_where(worst_kept)}",
            file=summary,
        )
    return 0


def _run(run: tuple[str, str, str, int, int]) -> dict[str, object]:
    """One bench row: ``(trace, gpu, mode, steps, seed)`` simulated (``report.simulate``)."""
    name, gpu, mode, steps, seed = run
    rep = report.simulate(name, gpu, mode, steps=steps, seed=seed, oracle_margins=CEILING_MARGINS)
    phase_margin = min(p.throughput_ratio - p.min_throughput_ratio for p in rep.phases)
    job_margin = rep.throughput_ratio - rep.min_throughput_ratio
    return {
        "trace": name,
        "gpu": gpu,
        "mode": mode,
        "seed": seed,
        "online_saving": rep.online_saving,
        "oracle_saving": rep.oracle_saving,
        "online_to_oracle": rep.online_to_oracle,
        "family": "published" if ":" in gpu else "first",
        "throughput_ratio": rep.throughput_ratio,
        "phase_throughput_margin": phase_margin,
        "threshold_margin": job_margin if mode == "async" else phase_margin,
        "min_throughput_ratio": rep.min_throughput_ratio,
        "trial_steps": rep.trial_steps,
        "measured_energy_error": rep.measured_energy_error,
        "status_saving_error_pp": rep.status_errors[0],
        "status_ratio_error": rep.status_errors[1],
        "clocks": {p.name: p.final_clock_mhz for p in rep.phases},
        "oracle_clocks": {p.name: p.oracle_clock_mhz for p in rep.phases},
        "ceiling": {f"{m:g}": x for m, x in rep.margin_oracle_to_oracle.items()},
    }


def _progress(run: object, r: dict[str, object] | None) -> str:
    """The line each finished row prints to stderr."""
    assert r is not None
    return (
        f"{r['trace']} {r['gpu']} {r['mode']} seed {r['seed']}: online "
        f"{r['online_saving']:.1%} oracle {r['oracle_saving']:.1%} online/oracle "
        f"{r['online_to_oracle']:.2f} throughput {r['throughput_ratio']:.3f} phase margin "
        f"{r['phase_throughput_margin']:+.3f}"
    )


def _where(row: dict[str, object]) -> str:
    """``(trace, gpu, mode, seed N)`` of a row, for the summary lines."""
    return f"({row['trace']}, {row['gpu']}, {row['mode']}, seed {row['seed']})"


def _status_error(row: dict[str, object]) -> str:
    """Status vs truth: the largest saving error (pp) and throughput ratio error of a row."""
    sav, thr = row["status_saving_error_pp"], row["status_ratio_error"]
    if not isinstance(sav, float) or not isinstance(thr, float):
        return "unknown"
    return f"{sav:.2f}/{thr:.4f}"


if __name__ == "__main__":
    raise SystemExit(main())
