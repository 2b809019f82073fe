"""``make demo``: the whole loop on this machine, no GPU and no Docker.

Builds or reuses the control-plane binaries (``make bins``), starts the dev cluster with 3 fake
GPU nodes (8 H100 each), ``helm install``s the chart with the in-cluster operator scaled to 0,
runs the operator and one node agent per node as local processes (agents on the stand-in NVML
backed by the simulator), applies the sample policy, replays a real verl trace through the SDK
while printing ``kubectl get rlep`` live, then prints a summary table, writes a plot and tears
everything down.

    python -m rlenergy_agent.testing.demo [--steps 40] [--plot out/demo.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from rlenergy.devcluster import DevCluster, MissingBinaryError
from rlenergy.devcluster.binaries import resolve_binaries
from rlenergy_agent.testing import fullstack, standin

ROOT = Path(__file__).resolve().parents[3]
NAMESPACE = "rl-energy-system"


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
            job, factor = fullstack.compressed_replay(
                args.trace,
                stack.sku,
                args.steps,
                num_gpus=24,
                longest_phase_s=fullstack.LONGEST_PHASE_S,
            )
            _say(
                f"replaying {args.trace} ({args.steps} steps, time x1/{factor:.0f}) through "
                "the trainer SDK"
            )

            def live(truth: fullstack.StepTruth) -> None:
                if truth.step % 5 == 4:
                    out = cluster.kubectl("get", "rlep", "-n", NAMESPACE).stdout.splitlines()
                    print(f"  step {truth.step + 1:3d}  {out[-1]}", flush=True)

            print("  " + cluster.kubectl("get", "rlep", "-n", NAMESPACE).stdout.splitlines()[0])
            truths = stack.run_trainer(job, on_step=live)
            deadline = time.monotonic() + 60
            status = stack.policy_status()
            while status.get("totals", {}).get("throughStep") != args.steps - 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("the operator did not account every step")
                time.sleep(0.3)
                status = stack.policy_status()
            table = cluster.kubectl("get", "rlep", "-n", NAMESPACE).stdout
            errors = _energy_errors(stack, truths)
            _summary(status, table, errors)
            _plot(truths, status, args.plot)
            cluster.kubectl("delete", "rlep", name, "-n", NAMESPACE, "--timeout=60s")
            locked = [u for a in stack.agents for u in a.uuids if a.driver.gpu(u).locked]
            _say(f"policy deleted; GPUs still locked: {len(locked)}")
        cluster.helm("uninstall", "rl-energy", "-n", NAMESPACE, "--wait")
    _say(f"torn down; demo took {time.monotonic() - t0:.0f} s")
    return 0


def _energy_errors(stack: fullstack.FullStack, truths: list[fullstack.StepTruth]) -> list[float]:
    recs = {
        (r["spec"]["nodeName"], s["step"]): s
        for r in stack.node_reports()
        for s in r["spec"].get("steps", [])
    }
    out = []
    for t in truths:
        for a in stack.agents:
            rec = recs.get((a.node, t.step))
            if rec is None:
                continue
            for p in rec["phases"]:
                want = t.joules.get((a.node, p["phase"]))
                if want:
                    out.append(abs(p["energyJoules"] - want) / want)
    return out


def _summary(status: dict[str, object], table: str, errors: list[float]) -> None:
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
        print(
            f"measured vs simulator truth, {len(errors)} phase windows: max |error| "
            f"{max(errors) * 100:.4f} %"
        )


def _plot(truths: list[fullstack.StepTruth], status: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    steps = [t.step for t in truths]
    for ph in fullstack.PHASES:
        ax1.step(steps, [t.clocks_mhz[ph] or 1980 for t in truths], where="post", label=ph)
        ax2.plot(steps, [sum(j for (_, p), j in t.joules.items() if p == ph) for t in truths],
                 label=ph)  # fmt: skip
    ax1.set_ylabel("locked SM clock, MHz\n(1980 = default governor)")
    ax2.set_ylabel("measured energy per step, J")
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
