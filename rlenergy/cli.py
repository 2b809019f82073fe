"""``rlenergy`` command line: the main job (``simulate``), the MoE rollout and trace listing.

Bad input exits with code 2 and one line naming the field and the allowed values, never a
traceback. The commands run the simulator (``rlenergy.sim``), whose numpy, matplotlib and rich
come with the ``sim`` extra; without it a command says in one line what to install. The dev
cluster is development tooling outside the package: ``python -m rlenergy_dev.devcluster`` in a
source checkout (docs/dev-cluster.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rlenergy import __version__, errors

SIM_EXTRA_MODULES = ("numpy", "matplotlib", "rich")
"""What the simulator commands import beyond the core dependencies (the ``sim`` extra in
``pyproject.toml``)."""
SIM_INSTALL = "pip install 'rl-energy-operator[sim]'"
SIM_COMMANDS = ("simulate", "rollout-sim", "traces")
"""The commands that run the simulator: every command but ``--version`` and ``--help``."""


def missing_sim_modules() -> list[str]:
    """The modules of the ``sim`` extra that are not installed (empty when it is)."""
    return [m for m in SIM_EXTRA_MODULES if importlib.util.find_spec(m) is None]


def _fail(message: str) -> int:
    print(f"rlenergy: error: {message}", file=sys.stderr)
    return 2


def _load_policy(path: str) -> Any:
    from rlenergy.api.v1alpha1 import policy as api_policy

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise errors.InvalidInputError("--policy", f"cannot read {path}: {exc.strerror}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise errors.InvalidInputError(
            "--policy", f"{path} is not valid YAML{where}: {problem}"
        ) from None
    return api_policy.parse_policy(document)


def _fmt_clock(clock: int | None) -> str:
    return "default" if clock is None else f"{clock} MHz"


def _timeline_text(timeline: Sequence[tuple[int, int | None, str]]) -> str:
    parts = []
    for step, clock, state in timeline:
        label = "trial" if state == "trial" else ("default" if clock is None else str(clock))
        parts.append(f"{label}@{step}")
    if len(parts) > 8:
        parts = [*parts[:4], "...", *parts[-3:]]
    return " > ".join(parts)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run ``rlenergy simulate``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from rlenergy.sim import report as sim_report

    policy = _load_policy(args.policy) if args.policy else None
    console = Console(stderr=args.json)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=args.json or not sys.stderr.isatty(),
    ) as progress:
        task = progress.add_task(f"replaying {args.trace}", total=args.steps)
        rep = sim_report.simulate(
            args.trace,
            args.gpu,
            args.mode,
            steps=args.steps,
            policy=policy,
            seed=args.seed,
            on_step=lambda _r: progress.advance(task),
            split=True if args.split else None,
        )
    if args.plot:
        from rlenergy.sim import plot as sim_plot

        sim_plot.plot_report(rep, Path(args.plot))
    if args.json:
        print(json.dumps(rep.to_json(), indent=2))
        return 0
    for note in rep.notes:
        console.print(f"[dim]note: {note}[/dim]")
    table = Table(
        title=f"EE-RL on {rep.trace}: {rep.gpu}, {rep.mode}, {rep.steps} steps, {rep.num_gpus} GPUs"
    )
    table.add_column("phase")
    table.add_column("clocks over steps (clock@step)")
    table.add_column("final", justify="right")
    table.add_column("oracle", justify="right")
    table.add_column("throughput vs default", justify="right")
    table.add_column("energy saved", justify="right")
    for p in rep.phases:
        table.add_row(
            p.name,
            _timeline_text(p.timeline),
            _fmt_clock(p.final_clock_mhz),
            _fmt_clock(p.oracle_clock_mhz),
            f"{p.throughput_ratio:.3f} (min {p.min_throughput_ratio:.2f})",
            f"{p.saving:.1%}",
        )
    console.print(table)
    totals = Table(title="Whole run (trials included)")
    totals.add_column("policy")
    totals.add_column("J per valid token", justify="right")
    totals.add_column("saving", justify="right")
    totals.add_column("throughput vs default", justify="right")
    totals.add_row("default governor", f"{rep.default.energy_per_valid_token_j:.4g}", "-", "1.000")
    totals.add_row(
        "EE-RL online",
        f"{rep.online.energy_per_valid_token_j:.4g}",
        f"{rep.online_saving:.1%}",
        f"{rep.throughput_ratio:.3f}",
    )
    totals.add_row(
        "oracle fixed clocks",
        f"{rep.oracle.energy_per_valid_token_j:.4g}",
        f"{rep.oracle_saving:.1%}",
        f"{rep.default.time_s / rep.oracle.time_s:.3f}",
    )
    console.print(totals)
    err = rep.measured_energy_error
    console.print(
        f"online / oracle saving: [bold]{rep.online_to_oracle:.2f}[/bold]; trial steps: "
        f"{rep.trial_steps}; saved {(rep.default.energy_j - rep.online.energy_j) / 3.6e6:.2f} kWh "
        f"over {rep.online.valid_tokens:.3g} valid tokens; measured vs true energy: "
        + ("unknown" if err is None else f"{err:+.3%}")
    )
    if args.plot:
        console.print(f"plot written to {args.plot}")
    return 0


def cmd_traces(args: argparse.Namespace) -> int:
    """Run ``rlenergy traces``: list the shipped traces."""
    from rich.console import Console
    from rich.table import Table

    from rlenergy.sim import traces

    table = Table(title="Shipped RL step traces")
    for col in ("name", "steps", "GPUs", "GPU", "notes"):
        table.add_column(col)
    for name in traces.packaged_trace_names():
        t = traces.load_trace(name)
        table.add_row(
            name, str(len(t.steps)), str(t.num_gpus), t.gpu_description[:40], "; ".join(t.notes)
        )
    Console().print(table)
    return 0


def cmd_rollout_sim(args: argparse.Namespace) -> int:
    """Run ``rlenergy rollout-sim``: verl-style MoE rollout vs FlexFloor worker release."""
    from rlenergy.sim import rollout_report

    return rollout_report.main(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    from rlenergy.gpu import models

    parser = argparse.ArgumentParser(
        prog="rlenergy", description="GPU energy control for RL post-training."
    )
    parser.add_argument("--version", action="version", version=f"rlenergy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="replay an RL trace through the simulator and EE-RL")
    sim.add_argument(
        "--trace", default="verl-gpg-qwen2-7b-fsdp-8gpu", help="packaged trace name or a path"
    )
    sim.add_argument("--gpu", default="h100-sxm", choices=models.sku_names(published=True))
    sim.add_argument("--mode", default="sync", choices=("sync", "async"))
    sim.add_argument("--policy", help="RLEnergyPolicy YAML (or its spec)")
    sim.add_argument("--steps", type=int, default=200, help="RL steps (traces replay cyclically)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--plot", help="write a PNG plot here")
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.add_argument(
        "--split",
        action="store_true",
        help="run the training side as the sub-phases the trace logs, each with its own "
        "physics (the default when the policy lists a sub-phase)",
    )
    sim.set_defaults(func=cmd_simulate)
    ro = sub.add_parser("rollout-sim", help="MoE rollout: verl-style baseline vs FlexFloor")
    if not missing_sim_modules():  # its options live in the simulator, which needs numpy
        from rlenergy.sim import rollout_report

        rollout_report.add_arguments(ro)
    ro.set_defaults(func=cmd_rollout_sim)
    tr = sub.add_parser("traces", help="list the shipped traces")
    tr.set_defaults(func=cmd_traces)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlenergy`` script; returns the exit code."""
    raw = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    missing = missing_sim_modules()
    if missing and raw[:1] and raw[0] in SIM_COMMANDS:
        return _fail(
            f"`rlenergy {raw[0]}` runs the simulator, which needs {', '.join(missing)}: "
            f"{SIM_INSTALL}"
        )
    args = parser.parse_args(raw)
    try:
        result: int = args.func(args)
        return result
    except errors.InvalidInputError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
