"""EE-RL beside the peers a user could pick, on the same simulated GPUs, seeds and noise.

One row per shipped trace x {h100-sxm, b200} x {sync, async}, each figure the mean over the
seeds (every method runs on the same ``Job``: same steps, noise draws and GPUs):

* EE-RL (``rlenergy.sim.report.simulate``, trials included);
* online peers, paying for what they learn: the real Zeus ``GlobalPowerLimitOptimizer``
  (``bench/zeus_sim.py``) with its stock settings (``ZeusCost(eta=0.5)``, 25 W steps, 10 warm-up
  and 40 profiling steps per limit) and with ``MaxSlowdownConstraint(1 / threshold)``; a
  static-clock user who sweeps one GPU clock over the first steps and locks the best
  (``rlenergy.sim.peers.StaticSweepUser``, as with ``nvidia-smi -lgc``);
* bounds chosen in hindsight, no learning cost: the best static clock, the best static power
  limit (``rlenergy.sim.peers``), the per-phase oracle (``rlenergy.sim.job.oracle``).

Saving = energy per valid token saved vs the default governor; throughput = default time / run
time. ``EE/online`` = EE-RL's saving / the best online peer's among those whose throughput
keeps the threshold (``inf`` when none saves anything); ``EE/static`` = EE-RL's / the best
hindsight static clock's; ``captured`` = the share of the per-phase oracle's advantage over
the best online peer that EE-RL captures, (EE-RL - best online peer) / (oracle - best online
peer), in savings (``rlenergy.sim.peers.capture_share``; 1.0 where the oracle has no advantage and EE-RL loses
none). Before the last line: the ceiling of both ratios (the per-phase oracle, no learning
cost, in EE-RL's place), then the worst captured share and the rows below
``TARGET_CAPTURED``, with the targets; the last line:
``worst EE-RL / best online peer X; worst EE-RL / best hindsight static clock Y``.

Usage: ``python bench/peers.py [--steps 200] [--seeds 0,1,2] [--traces a,b] [--json out]``
(``make bench-peers``; needs the ``peers`` extra: ``pip install -e '.[peers]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zeus_sim  # noqa: E402
from zeus.optimizer.power_limit import MaxSlowdownConstraint  # noqa: E402

from rlenergy.api.v1alpha1 import policy as api_policy  # noqa: E402
from rlenergy.control.freq import config  # noqa: E402
from rlenergy.gpu import models
from rlenergy.sim import job as sim_job  # noqa: E402
from rlenergy.sim import peers, report, traces, workload  # noqa: E402

GPUS = ("h100-sxm", "b200")
MODES = ("sync", "async")
ONLINE = ("zeus-stock", "zeus-slowdown", "static-sweep")
HINDSIGHT = ("static-clock", "static-power", "oracle")
TARGET_CAPTURED = 0.8
"""Target share of the per-phase oracle's advantage over the best online peer that EE-RL
captures, on every row."""
TARGET_TO_STATIC = 0.98
"""Target of EE-RL's saving over the best hindsight static clock's, on every row."""


def run_row(trace: str, gpu: str, mode: sim_job.Mode, steps: int, seed: int) -> dict[str, Any]:
    """Every method on one job; savings and throughputs vs the default governor."""
    spec = api_policy.RLEnergyPolicySpec().model_copy(update={"mode": mode})
    threshold = min(p.min_throughput_ratio for p in spec.phases)
    sku = models.get_sku(gpu)
    rep = report.simulate(trace, gpu, mode, steps=steps, seed=seed)
    replay = workload.from_trace(traces.load_trace(trace), sku, steps)
    job = sim_job.Job(replay, sku, mode, seed=seed)
    default = sim_job.default_run(job)
    out: dict[str, Any] = {
        "ee-rl": (peers.saving(rep.online, rep.default), peers.throughput(rep.online, rep.default))
    }
    detail: dict[str, Any] = {}
    for name, selector in (
        ("zeus-stock", None),
        ("zeus-slowdown", MaxSlowdownConstraint(factor=1.0 / threshold)),
    ):
        peer = zeus_sim.ZeusPowerLimitPeer(workload.PHASES, selector)
        results, _ = sim_job.run_job(job, peer, on_start=peer.bind)
        tot = sim_job.totals(job, results)
        out[name] = (peers.saving(tot, default), peers.throughput(tot, default))
        detail[name] = peer.state
    cands = (
        config.build_controller(spec, sku.supported_sm_clocks_mhz())
        .phases["generation"]
        .settings.candidates_mhz
    )
    user = peers.StaticSweepUser(workload.PHASES, cands, threshold, async_mode=mode == "async")
    results, _ = sim_job.run_job(job, user, idle_unlocked=False)  # nvidia-smi -lgc holds
    tot = sim_job.totals(job, results)
    out["static-sweep"] = (peers.saving(tot, default), peers.throughput(tot, default))
    detail["static-sweep"] = user.locked
    clock = peers.best_static_clock(job, threshold)
    power = peers.best_static_power_limit(job, threshold)
    out["static-clock"] = (
        peers.saving(clock.totals, default),
        peers.throughput(clock.totals, default),
    )
    out["static-power"] = (
        peers.saving(power.totals, default),
        peers.throughput(power.totals, default),
    )
    out["oracle"] = (
        peers.saving(rep.oracle, rep.default),
        peers.throughput(rep.oracle, rep.default),
    )
    detail["static-clock"] = clock.setting
    detail["static-power"] = power.setting
    return {"threshold": threshold, "methods": out, "detail": detail}


def _ratio(ee: float, peer: float) -> float:
    if peer <= 1e-9:
        return math.inf if ee > 1e-9 else 1.0
    return ee / peer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--traces", default="", help="comma-separated (default: every shipped)")
    parser.add_argument("--gpus", default=",".join(GPUS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    names = [t for t in args.traces.split(",") if t] or list(traces.packaged_trace_names())
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in names:
        for gpu in args.gpus.split(","):
            for mode in args.modes.split(","):
                runs = [run_row(name, gpu, mode, args.steps, s) for s in seeds]  # type: ignore[arg-type]
                threshold = runs[0]["threshold"]
                methods = {
                    m: (
                        statistics.fmean(r["methods"][m][0] for r in runs),
                        statistics.fmean(r["methods"][m][1] for r in runs),
                    )
                    for m in runs[0]["methods"]
                }
                ee = methods["ee-rl"][0]
                ok_online = [methods[m][0] for m in ONLINE if methods[m][1] >= threshold - 1e-9]
                row = {
                    "trace": name,
                    "gpu": gpu,
                    "mode": mode,
                    "threshold": threshold,
                    "methods": methods,
                    "detail": [r["detail"] for r in runs],
                    "ee_to_online": _ratio(ee, max(ok_online, default=0.0)),
                    "ee_to_static_clock": _ratio(ee, methods["static-clock"][0]),
                    "ee_to_oracle": _ratio(ee, methods["oracle"][0]),
                    "oracle_to_online": _ratio(methods["oracle"][0], max(ok_online, default=0.0)),
                    "oracle_to_static_clock": _ratio(
                        methods["oracle"][0], methods["static-clock"][0]
                    ),
                    "captured": peers.capture_share(
                        ee, max(ok_online, default=0.0), methods["oracle"][0]
                    ),
                }
                rows.append(row)
                print(
                    f"{name} {gpu} {mode}: "
                    + " ".join(f"{m} {s:+.1%}/{t:.3f}" for m, (s, t) in methods.items()),
                    file=sys.stderr,
                    flush=True,
                )
    elapsed = time.perf_counter() - t0
    table = Table(
        title=f"EE-RL vs peers: saving / throughput vs default ({args.steps} steps, seeds {args.seeds})"
    )
    cols = [
        *("trace", "gpu", "mode", "ee-rl", *ONLINE, *HINDSIGHT),
        *("EE/online", "EE/static", "captured"),
    ]
    for col in cols:
        table.add_column(col, justify="left" if col in ("trace", "gpu", "mode") else "right")
    for r in rows:
        cells = [f"{r['methods'][m][0]:+.1%} {r['methods'][m][1]:.3f}" for m in cols[3:-3]]
        table.add_row(
            r["trace"][:40],
            r["gpu"],
            r["mode"],
            *cells,
            f"{r['ee_to_online']:.2f}",
            f"{r['ee_to_static_clock']:.2f}",
            f"{r['captured']:.2f}",
        )
    Console(width=250).print(table)
    print(f"{len(rows)} rows x {len(seeds)} seeds in {elapsed:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "elapsed_s": elapsed}, indent=1))
    worst_online = min(rows, key=lambda r: r["ee_to_online"])
    worst_static = min(rows, key=lambda r: r["ee_to_static_clock"])
    print(
        f"worst rows: online {worst_online['trace']} {worst_online['gpu']} "
        f"{worst_online['mode']}; static clock {worst_static['trace']} {worst_static['gpu']} "
        f"{worst_static['mode']}"
    )
    # The ceiling: the per-phase oracle (no learning cost) in EE-RL's place on every row.
    cap_online = min(rows, key=lambda r: r["oracle_to_online"])
    cap_static = min(rows, key=lambda r: r["oracle_to_static_clock"])
    print(
        f"ceiling (per-phase oracle in EE-RL's place): worst oracle / best online peer "
        f"{cap_online['oracle_to_online']:.2f} ({cap_online['trace']} {cap_online['gpu']} "
        f"{cap_online['mode']}); worst oracle / best hindsight static clock "
        f"{cap_static['oracle_to_static_clock']:.2f} ({cap_static['trace']} "
        f"{cap_static['gpu']} {cap_static['mode']})"
    )
    worst_captured = min(rows, key=lambda r: r["captured"])
    print(
        f"captured share of the per-phase oracle's advantage over the best online peer: worst "
        f"{worst_captured['captured']:.2f} ({worst_captured['trace']} {worst_captured['gpu']} "
        f"{worst_captured['mode']}), below {TARGET_CAPTURED} on "
        f"{sum(r['captured'] < TARGET_CAPTURED for r in rows)} of {len(rows)} rows; targets: "
        f"captured >= {TARGET_CAPTURED}, EE-RL / best online peer > 1, EE-RL / best hindsight "
        f"static clock >= {TARGET_TO_STATIC}, on every row"
    )
    print(
        f"worst EE-RL / best online peer {worst_online['ee_to_online']:.2f}; "
        f"worst EE-RL / best hindsight static clock {worst_static['ee_to_static_clock']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
