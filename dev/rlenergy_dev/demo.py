"""``make demo``: the whole loop on this machine, no GPU and no Docker.

Builds or reuses the control-plane binaries (``make bins``), starts the dev cluster with 3 fake
GPU nodes (8 H100 each), ``helm install``s the chart with the in-cluster operator scaled to 0,
runs the operator and one node agent per node as local processes (agents on the stand-in NVML
backed by the simulator), applies the sample policy, and runs a verl job of 3 ranks, one per
node, while printing ``kubectl get rlep`` live; then prints a summary table, writes a plot and
tears everything down.

Each rank is a process of the pinned verl (``.venv-verl``, ``make venv-verl``) running
``rlenergy_dev.podtrainer``, the trainer of the real-node e2e's pod: verl 0.9.1's real
worker and driver methods on a CPU torch model (verl's default v1 trainer, ``PPOTrainerSync``,
over real TransferQueue on a local Ray per rank; ``--trainer legacy``: the legacy
``RayPPOTrainer``), hooked by ``rlenergy.sdk.verl_hook.install``
(the one setting docs/verl.md gives a verl job), replaying a real verl trace's phase times
(time-compressed) closed-loop on the clock its GPUs run. Its signals reach its node's agent
with a token the API server bound to its trainer pod object; the GPUs' physics follow what it
runs (``podtrainer.WorkFeed``), and the measured energy is compared with the simulator's truth.

    python -m rlenergy_dev.demo [--steps 40] [--plot out/demo.png] [--trainer v1|legacy]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

import rlenergy_dev
from rlenergy.api import signals
from rlenergy.sdk import pod_engines
from rlenergy.sdk import trainer as sdk_trainer
from rlenergy_dev import fullstack, podtrainer, standin
from rlenergy_dev.devcluster import DevCluster, MissingBinaryError
from rlenergy_dev.devcluster.binaries import resolve_binaries

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "rl-energy-system"
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
LIVE_EVERY_S = 10.0
"""How often ``kubectl get rlep`` is printed while the job runs, s."""


def _say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def _ensure_bins() -> None:
    try:
        resolve_binaries()
        _say("control-plane binaries: cached")
    except MissingBinaryError:
        _say("control-plane binaries missing: building them (make bins; ~30 min on 2 cores once)")
        subprocess.run(["bash", str(ROOT / "hack" / "controlplane-bins.sh")], check=True)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code."""
    ap = argparse.ArgumentParser(prog="make demo", description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--trace", default=fullstack.DEFAULT_TRACE)
    ap.add_argument("--plot", type=Path, default=ROOT / "out" / "demo.png")
    ap.add_argument(
        "--trainer",
        choices=podtrainer.TRAINERS,
        default="v1",
        help="the ranks' verl trainer: verl's default v1 (sync mode) or the legacy RayPPOTrainer",
    )
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    _ensure_bins()
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    sample = yaml.safe_load((ROOT / "crds" / "samples" / "sync-job.yaml").read_text())
    sample["spec"]["controller"] = {"warmupSteps": 2, "trialSteps": 2}
    name = sample["metadata"]["name"]
    work = Path(tempfile.mkdtemp(prefix="rlenergy-demo-"))
    _say("starting the dev cluster: etcd, kube-apiserver, KCM, scheduler, KWOK (3 GPU nodes)")
    with DevCluster(startup_timeout=180) as cluster:
        cluster.start(nodes=3, gpus_per_node=8, gpu_product="NVIDIA-H100-80GB-HBM3")
        _say(f"cluster up in {time.monotonic() - t0:.0f} s; helm install rl-energy")
        cluster.kubectl("create", "namespace", NAMESPACE)
        cluster.helm(
            "install", "rl-energy", str(ROOT / "helm" / "rl-energy"), "-n", NAMESPACE,
            "--set", "operator.replicas=0", "--wait", "--timeout", "120s",
        )  # fmt: skip
        stack = fullstack.FullStack(
            cluster.kubeconfig, NAMESPACE, name, cluster.nodes, work, lib_dir
        )
        with stack:
            _say("operator and 3 node agents (stand-in NVML) as local processes")
            stack.start_operator()
            cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(sample))
            stack.start_agents()
            # A node report holds the records the operator has not folded: read meanwhile.
            published = fullstack.PublishedRecords(stack.node_reports).start()
            job, factor = fullstack.compressed_replay(
                args.trace,
                stack.sku,
                args.steps,
                num_gpus=24,
                longest_phase_s=fullstack.LONGEST_PHASE_S,
            )
            stack.apply_power_spread(job)
            replay = work / "replay.json"
            replay.write_text(json.dumps(podtrainer.replay_document(job, stack.sku)))
            _say(
                f"3 verl ranks (verl 0.9.1's {args.trainer} trainer on a CPU model, the hook "
                f"installed) replay "
                f"{args.trace} ({args.steps} steps, time x1/{factor:.0f})"
            )
            print("  " + cluster.kubectl("get", "rlep", "-n", NAMESPACE).stdout.splitlines()[0])
            records = _run_ranks(stack, replay, args.steps, work, cluster, args.trainer)
            deadline = time.monotonic() + 60
            status = stack.policy_status()
            while (status.get("totals", {}).get("throughStep") or 0) < args.steps:
                if time.monotonic() > deadline:
                    raise TimeoutError("the operator did not account every step")
                time.sleep(0.3)
                status = stack.policy_status()
            table = cluster.kubectl("get", "rlep", "-n", NAMESPACE).stdout
            errors = _energy_errors(stack, published.stop())
            _summary(status, table, errors, records)
            _plot(records, status, args.plot)
            cluster.kubectl("delete", "rlep", name, "-n", NAMESPACE, "--timeout=60s")
            locked = [u for a in stack.agents for u in a.uuids if a.driver.gpu(u).locked]
            _say(f"policy deleted; GPUs still locked: {len(locked)}")
        cluster.helm("uninstall", "rl-energy", "-n", NAMESPACE, "--wait")
    _say(f"torn down; demo took {time.monotonic() - t0:.0f} s")
    return 0


def _run_ranks(
    stack: fullstack.FullStack,
    replay: Path,
    steps: int,
    work: Path,
    cluster: DevCluster,
    trainer: str = "v1",
) -> list[dict[str, Any]]:
    """Run one verl rank per node to the end of the replay; returns every rank's step records.

    Each rank is ``podtrainer`` in ``.venv-verl`` with its node's GPUs
    (``NVIDIA_VISIBLE_DEVICES``, the stand-in library and state file as pynvml's), its trainer
    pod's token and its node agent's socket; a ``WorkFeed`` per node runs the GPUs' physics.
    ``trainer``: ``podtrainer``'s ``--trainer`` (the v1 ranks start their local Rays one at a
    time, ``--ray-start-lock``).

    Raises:
        RuntimeError: ``.venv-verl`` is missing, or a rank failed (with its log's tail).
    """
    if not VERL_PYTHON.is_file():
        raise RuntimeError(f"{VERL_PYTHON} missing: build the pinned verl with `make venv-verl`")
    feeds, ranks = [], []
    try:
        for a in stack.agents:
            assert a.pod is not None
            work_file = work / f"work-{a.node}.jsonl"
            feeds.append(podtrainer.WorkFeed(a.driver, work_file, lambda a=a: a.uuids).start())
            env = {
                **rlenergy_dev.source_env(os.environ),
                **a.driver.env(stack.lib_dir),
                "NVIDIA_VISIBLE_DEVICES": ",".join(a.uuids),
                sdk_trainer.SOCKET_ENV: str(a.socket),
                signals.TOKEN_FILE_ENV: str(a.pod.token_file),
                pod_engines.ENGINE_DIR_ENV: str(work / f"engines-{a.node}"),
            }
            log = (work / f"rank-{a.node}.log").open("w")
            cmd = [
                str(VERL_PYTHON), "-W", "ignore", "-m", "rlenergy_dev.podtrainer",
                "--replay", str(replay), "--work-file", str(work_file), "--steps", str(steps),
                "--trainer", trainer, "--ray-start-lock", str(work / "ray-start.lock"),
            ]  # fmt: skip
            ranks.append((a, subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
        last = time.monotonic()
        while any(proc.poll() is None for _, proc, _ in ranks):
            time.sleep(0.5)
            for a, proc, log in ranks:
                if proc.poll() not in (None, 0):
                    tail = Path(log.name).read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"the rank on {a.node} failed:\n{tail}")
            if time.monotonic() - last >= LIVE_EVERY_S:
                last = time.monotonic()
                out = cluster.kubectl("get", "rlep", "-n", NAMESPACE).stdout.splitlines()
                print(f"  {out[-1]}", flush=True)
    finally:
        for _, proc, log in ranks:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)
            log.close()
        for feed in feeds:
            feed.stop()
    return [
        r
        for _, _, log in ranks
        for r in podtrainer.step_records(Path(log.name).read_text(errors="replace"))
    ]


def _truth_j(a: fullstack.NodeAgent, step: int, phase: str) -> float:
    """The simulator's energy of a node's phase window: its label's and its tail's."""
    labels = (f"{phase}-{step}", podtrainer.tail_label(f"{phase}-{step}"))
    return sum(a.driver.truth_j(u, label) for u in a.uuids for label in labels)


def _energy_errors(
    stack: fullstack.FullStack, published: dict[str, dict[int, dict[str, Any]]]
) -> list[tuple[float, str]]:
    """|measured - true| / true of every phase window the nodes published, and the window.

    ``published``: node -> step -> record (``fullstack.PublishedRecords``).
    """
    agents = {a.node: a for a in stack.agents}
    out = []
    for node, by_step in published.items():
        a = agents.get(node)
        if a is None:
            continue
        for s in by_step.values():
            for p in s["phases"]:
                want = _truth_j(a, s["step"], p["phase"])
                if want:
                    err = abs(p["energyJoules"] - want) / want
                    out.append((err, f"{a.node} step {s['step']} {p['phase']}"))
    return out


def _summary(
    status: dict[str, object],
    table: str,
    errors: list[tuple[float, str]],
    records: Sequence[dict[str, Any]],
) -> None:
    print("\nkubectl get rlep:\n" + table)
    phases = status.get("phases") or []
    totals = status.get("totals") or {}
    assert isinstance(phases, list) and isinstance(totals, dict)
    head = ("phase", "state", "clock MHz", "tput", "J/valid token", "saving %")
    print(f"{head[0]:<11}{head[1]:<9}{head[2]:>10}{head[3]:>8}{head[4]:>15}{head[5]:>10}")
    for p in phases:
        print(
            f"{p['name']:<11}{p.get('state', ''):<9}{str(p.get('clockMHz') or 'default'):>10}"
            f"{p.get('throughputRatio', 0):>8.3f}{p.get('energyPerValidTokenJoules', 0):>15.6f}"
            f"{p.get('saving', {}).get('percent', 0):>10.2f}"
        )
    print(
        f"{'total':<11}{'':<9}{'':>10}{totals.get('throughputRatio', 0):>8.3f}{'':>15}"
        f"{totals.get('savingPercent', 0):>10.2f}"
    )
    if errors:
        worst, where = max(errors)
        print(
            f"measured vs simulator truth, {len(errors)} phase windows: max |error| "
            f"{worst * 100:.4f} % ({where})"
        )
    if records:
        last = max(records, key=lambda r: r["step"])["metrics"]
        keys = sorted(k for k in last if k.startswith("rlenergy/"))
        print("verl's metrics dict, last step of a rank: " + ", ".join(
            f"{k}={last[k]:.4g}" for k in keys
        ))  # fmt: skip


def _plot(records: Sequence[dict[str, Any]], status: dict[str, object], path: Path) -> None:
    """Per step: the SM clock the ranks' GPUs ran longest per phase, the energy verl was told."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({r["step"] for r in records})
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for ph in fullstack.PHASES:
        held: dict[int, dict[str, float]] = {s: {} for s in steps}  # step -> MHz -> s
        for r in records:
            for mhz, sec in r["clocks"][ph].items():
                held[r["step"]][mhz] = held[r["step"]].get(mhz, 0.0) + sec
        longest = [int(max(held[s].items(), key=lambda kv: kv[1])[0]) for s in steps]
        ax1.step(steps, longest, where="post", label=ph)
        joules = [
            sum(r["metrics"].get(f"rlenergy/energy/{ph}_j", 0.0) for r in records if r["step"] == s)
            for s in steps
        ]
        ax2.plot(steps, joules, label=ph)
    ax1.set_ylabel("SM clock the GPUs ran\nlongest in the phase, MHz")
    ax2.set_ylabel("rlenergy/energy/<phase>_j\nin verl's metrics, 3 ranks, J")
    ax2.set_xlabel("RL step")
    ax1.legend()
    totals = status.get("totals") or {}
    saving = totals.get("savingPercent") if isinstance(totals, dict) else None
    fig.suptitle(f"rl-energy full-stack demo: saving {saving} % vs the default governor")
    fig.tight_layout()
    fig.savefig(path)
    _say(f"plot written to {path}")


if __name__ == "__main__":
    sys.exit(main())
