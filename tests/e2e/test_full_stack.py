"""The whole loop on the real control plane: operator, 3 node agents, stand-in NVML, SDK.

What runs (``rlenergy_dev.fullstack``): the CRDs applied to the dev cluster, the
operator as a local process, one agent per fake GPU node as a local process on the stand-in
``libnvidia-ml.so.1`` (pynvml loads it through ``LD_LIBRARY_PATH``; 8 simulated H100 GPUs per
node), and a simulated trainer, one rank per node, replaying a real verl trace
(``verl-gpg-qwen2-7b-fsdp-8gpu``, time-compressed to about 0.55 s of generation and 1.5 s of
training per step) through ``RLEnergyVerlCallback`` to the agents' sockets. Each rank's phase
progress follows the clock its node's agent actually locked, slice by slice, and is reported to
the agent as it goes. The agents write their ``RLEnergyNodeReport``s and follow
``status.plan``, EE-RL trials included (in-phase probe slices).

We check: the policy's status gets per-phase savings and totals and ``kubectl get rlep`` shows
the saving; the agents ran the trials' probe slices (or, on a loaded machine, whole-step
trials) and generation ends at a clock below max with a positive saving (locked, or at its
interim clock once the job's trial budget is spent); against the simulator's truth (``_truth``: the same steps under the default
governor), every locked clock keeps its phase's threshold on the run's steps, every phase's
and the job's whole-run true throughput ratio (trials included) keeps it within
``TRIAL_ALLOWANCE``, and the status's saving and throughput ratio are within
``SAVING_TOLERANCE_PP`` and ``RATIO_TOLERANCE`` of the true ones (trials included; judged
after every other check; a miss fails the test, except on a phase whose trials fell back to
whole steps on a loaded machine: an expected failure naming ``WHOLE_STEP_LIMITATION``); totals
equal the sum of the node reports; every measured phase energy of every node and step is
within 1 % of the simulator's truth (the windows that miss it are printed); after the policy is
deleted the finalizer is lifted on the agents' reset acknowledgements (not the deadline) and
every GPU is back at its default clocks.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_support import get_json, wait_until
from rlenergy_dev import fullstack, standin
from rlenergy_dev.devcluster import DevCluster

from rlenergy.api import node as api_node
from rlenergy.sim import job as sim_job
from tests import factories

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "build" / "fullstack-e2e.json"
"""Every node report's step records, the simulator's truth per step and the final status of the
last run, for replaying a run's accounting offline (``_write_results``)."""
STEPS = 40
ENERGY_TOLERANCE = 0.01
SAVING_TOLERANCE_PP = 1.0
"""Largest gap between the status's saving and the true saving, percentage points."""
RATIO_TOLERANCE = 0.01
"""Largest gap between the status's throughput ratio and the true ratio."""
WHOLE_STEP_LIMITATION = (
    "open limitation: the trainer's progress came too seldom for in-phase "
    "slices of the compressed generation phase (a loaded machine: status probeEvidence "
    "whole-phase), so its trials ran whole steps, whose default-governor time and energy come "
    "from the token model (2-11 % per step on real traces); measured 2026-12-02 with progress "
    "every 17-37 ms: generation saving 2.75 % vs 3.86 % true, ratio 0.979 vs 0.9935"
)
"""Why truth misses of phases whose trials ran whole steps end the test as an expected failure:
a documented fallback with a known precision, reported (``-ra``) with its figures. A miss of a
phase probed in-phase fails the test, as does every other check."""
TRIAL_ALLOWANCE = 0.03
"""How far a phase's whole-run true ratio may fall below its threshold in these 40 steps: 4
warm up and up to a quarter of max(steps, 40) trial (``eerl._trial_budget_left``), half of each
probe's slices at the lever-arm clock (``eerl.PROBE_MIN_RATIO``, 0.85); the promise on the
whole run is made over long runs (``make bench-energy``, 200 steps), the lock's here
(``_lock_misses``). As tests/unit/agent/test_status_truth.py."""


def _truth_misses(
    report: dict[str, tuple[float | None, float | None]],
    true_figures: dict[str, tuple[float, float]],
    thresholds: dict[str, float],
) -> list[str]:
    """What of the status is off the truth: each phase's and the job's whole-run true
    throughput ratio more than ``TRIAL_ALLOWANCE`` below its threshold, the saving more than
    ``SAVING_TOLERANCE_PP`` off, the ratio more than ``RATIO_TOLERANCE`` off."""
    misses = []
    for key, (saving, ratio) in report.items():
        true_saving, true_ratio = true_figures[key]
        if true_ratio < thresholds[key] - TRIAL_ALLOWANCE:
            misses.append(
                f"{key} true throughput ratio {true_ratio:.4f} < {thresholds[key]} - "
                f"{TRIAL_ALLOWANCE} (trials)"
            )
        if saving is None or abs(saving - true_saving) > SAVING_TOLERANCE_PP:
            misses.append(f"{key} saving {saving} vs true {true_saving:.2f}")
        if ratio is None or abs(ratio - true_ratio) > RATIO_TOLERANCE:
            misses.append(f"{key} throughput ratio {ratio} vs true {true_ratio:.4f}")
    return misses


def _lock_misses(
    job: sim_job.Job, phases: dict[str, dict[str, Any]], thresholds: dict[str, float]
) -> dict[str, tuple[int, float]]:
    """Each locked phase whose clock misses its threshold in truth: (clock, true ratio), the
    default governor's time of the run's steps over their time at the lock (the simulator)."""
    default = sim_job.default_run(job)
    out = {}
    for name in fullstack.PHASES:
        clock = phases[name].get("clockMHz")
        if phases[name]["state"] != "locked" or clock is None:
            continue
        ratio = (
            default.phase_time_s[name] / sim_job.fixed_run(job, {name: clock}).phase_time_s[name]
        )
        if ratio < thresholds[name]:
            out[name] = (clock, ratio)
    return out


def _block_summary(
    job: sim_job.Job, records: dict[tuple[str, int], dict[str, Any]]
) -> dict[tuple[str, int], tuple[int, float, float]]:
    """Per (phase, clock): the probe blocks of every node's records, their mean and worst
    error against the truth at their clock (``fullstack.probe_block_errors``)."""
    steps = {s.index: s for s in job.replay.steps}
    errs: dict[tuple[str, int], list[float]] = {}
    for (_node, index), rec in sorted(records.items()):
        record = api_node.StepRecord.model_validate(rec)
        for phase, _, clock, ratio, true in fullstack.probe_block_errors(
            job, steps[index], record.phases
        ):
            errs.setdefault((phase, clock), []).append(ratio - true)
    return {
        k: (len(v), round(sum(v) / len(v), 4), round(max(v, key=abs), 4))
        for k, v in sorted(errs.items())
    }


def _long_windows(
    truths: list[fullstack.StepTruth], records: dict[tuple[str, int], dict[str, Any]]
) -> list[tuple[int, str, float, float]]:
    """(step, phase, longest window over the nodes, s; the slowest rank's work, s) wherever
    the window outlasts the work by 20 ms or more (the rank's tick and end signal included)."""
    out = []
    for t in truths:
        for phase in fullstack.PHASES:
            windows = [
                w["durationSeconds"]
                for (_node, step), rec in records.items()
                if step == t.step
                for w in rec["phases"]
                if w["phase"] == phase
            ]
            if windows and max(windows) - t.work_seconds[phase] >= 0.02:
                out.append((t.step, phase, round(max(windows), 4), round(t.work_seconds[phase], 4)))
    return out


def _write_results(
    truths: list[fullstack.StepTruth],
    records: dict[tuple[str, int], dict[str, Any]],
    final: dict[str, Any],
    policy: dict[str, Any],
    reports: list[dict[str, Any]],
) -> None:
    """``RESULTS``: the run's records ({node: {step: record}}), truths, final status and the
    node reports' last specs without their steps."""

    def truth(t: fullstack.StepTruth) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(t):
            v = getattr(t, f.name)
            if isinstance(v, dict):
                v = {
                    "/".join(k) if isinstance(k, tuple) else k: sorted(x or 0 for x in val)
                    if isinstance(val, set)
                    else val
                    for k, val in v.items()
                }
            out[f.name] = v
        return out

    by_node: dict[str, dict[int, dict[str, Any]]] = {}
    for (node, step), rec in sorted(records.items()):
        by_node.setdefault(node, {})[step] = rec
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "policy": policy,
                "status": final,
                "records": by_node,
                "truths": [truth(t) for t in truths],
                "nodes": [{k: v for k, v in r["spec"].items() if k != "steps"} for r in reports],
            },
            indent=1,
            default=str,
        )
    )


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def _record_energy(rec: dict[str, Any]) -> float:
    return sum(p.get("energyJoules") or 0.0 for p in rec["phases"]) + (
        rec.get("idleEnergyJoules") or 0.0
    )


def _truth(
    truths: list[fullstack.StepTruth],
    records: dict[tuple[str, int], dict[str, Any]],
    agents: list[fullstack.NodeAgent],
) -> dict[str, tuple[float, float]]:
    """(true saving %, true throughput ratio) per phase and ``total`` over the run.

    Time: the default governor's phase time on the same steps vs the time the slowest rank's
    work took (the trainer's tick past the finish left out). Energy: the default governor's
    phase energy vs what the GPUs drew; the job total adds the idle windows the agents
    measured to both (the idle gaps last as long under either).
    """
    out: dict[str, tuple[float, float]] = {}
    e_run = e_def = t_run = t_def = 0.0
    for ph in fullstack.PHASES:
        run_j = sum(t.joules[(a.node, ph)] for t in truths for a in agents)
        def_j = sum(t.default_joules[(a.node, ph)] for t in truths for a in agents)
        run_s = sum(t.work_seconds[ph] for t in truths)
        def_s = sum(t.default_seconds[ph] for t in truths)
        out[ph] = (100.0 * (1.0 - run_j / def_j), def_s / run_s)
        e_run, e_def, t_run, t_def = e_run + run_j, e_def + def_j, t_run + run_s, t_def + def_s
    idle_j = sum(r.get("idleEnergyJoules") or 0.0 for r in records.values())
    out["total"] = (100.0 * (1.0 - (e_run + idle_j) / (e_def + idle_j)), t_def / t_run)
    return out


@pytest.mark.timeout(600)
def test_full_stack_savings_run(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path
):
    t0 = time.monotonic()
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    policy = factories.sample_policy(warmupSteps=4, trialSteps=4)
    name = policy["metadata"]["name"]
    stack = fullstack.FullStack(
        dev_cluster.kubeconfig, namespace, name, dev_cluster.nodes, tmp_path / "stack", lib_dir
    )
    records: dict[tuple[str, int], dict[str, Any]] = {}
    # A report holds only the records the operator has not folded: they are read meanwhile.
    published = fullstack.PublishedRecords(stack.node_reports)

    def collect(_truth: fullstack.StepTruth | None = None) -> None:
        published.read()
        for node, by_step in published.records.items():
            for step, rec in by_step.items():
                records[(node, step)] = rec

    with stack:
        stack.start_operator()
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
        stack.start_agents()
        published.start()
        wait_until(
            lambda: _condition(stack.policy_status(), "Ready").get("status") == "True",
            timeout=60,
            what="policy Ready",
        )
        job, factor = fullstack.compressed_replay(
            fullstack.DEFAULT_TRACE,
            stack.sku,
            STEPS,
            num_gpus=24,
            longest_phase_s=fullstack.LONGEST_PHASE_S,
        )
        started = time.monotonic()
        truths = stack.run_trainer(job, on_step=collect)
        replay_s = time.monotonic() - started
        final = wait_until(
            lambda: (
                s
                if (s := stack.policy_status()).get("totals", {}).get("throughStep") == STEPS - 1
                else None
            ),
            timeout=60,
            what="every step accounted",
        )
        published.stop()
        collect()
        _write_results(truths, records, final, policy, stack.node_reports())

        # The status against the simulator's truth: each phase's and the job's saving and
        # throughput ratio vs the same steps under the default governor, trials included; and
        # every phase's (and the job's) true throughput ratio against its threshold (the job:
        # the lowest phase threshold). The trainer's tick is printed with them: ticks of tens
        # of ms (a loaded machine) blur the probe slices the counterfactual is measured from.
        true_figures = _truth(truths, records, stack.agents)
        status_phases = {p["name"]: p for p in final["phases"]}
        report = {
            ph: (status_phases[ph]["saving"].get("percent"), status_phases[ph]["throughputRatio"])
            for ph in fullstack.PHASES
        }
        report["total"] = (final["totals"]["savingPercent"], final["totals"]["throughputRatio"])
        ticks = sorted(stack.phase_ticks_s)
        compared = {
            **{k: (report[k], tuple(round(x, 4) for x in true_figures[k])) for k in report},
            "trainer tick ms p50/p95/max": tuple(
                round(1000 * ticks[min(int(q * len(ticks)), len(ticks) - 1)], 1)
                for q in (0.5, 0.95, 1.0)
            ),
        }
        print("status vs truth ((saving %, throughput ratio), (true ...)):", compared)
        thresholds = {p["name"]: p["minThroughputRatio"] for p in policy["spec"]["phases"]}
        thresholds["total"] = min(thresholds.values())
        misses = _truth_misses(report, true_figures, thresholds)
        locks = _lock_misses(job, status_phases, thresholds)
        blocks = _block_summary(job, records)
        print("probe blocks vs truth (phase, clock): (blocks, mean error, worst error):", blocks)
        print("windows over the work by 20 ms or more:", _long_windows(truths, records))
        # Judged after every other check below, which must pass regardless. Phases probed
        # in-phase in fewer than two steps ran their trials on whole steps.
        probed = {ph: sum(len(t.locks_seen[ph]) > 1 for t in truths) for ph in fullstack.PHASES}
        whole_step = {ph for ph in fullstack.PHASES if probed[ph] < 2}
        truth_misses = (misses, locks, compared) if misses or locks else None

        # Measured phase energy per node and step vs the simulator's truth.
        errors = []
        off: list[tuple[str, int, str, dict[str, Any], float]] = []
        for truth in truths:
            for a in stack.agents:
                rec = records[(a.node, truth.step)]
                for phase in fullstack.PHASES:
                    window = next((p for p in rec["phases"] if p["phase"] == phase), None)
                    assert window is not None, (a.node, truth.step, rec)
                    want = truth.joules[(a.node, phase)]
                    errors.append(abs(window["energyJoules"] - want) / want)
                    if errors[-1] > ENERGY_TOLERANCE:
                        off.append((a.node, truth.step, phase, window, want))
        assert len(errors) == STEPS * len(stack.agents) * 2
        if off:
            print("windows off the truth:", json.dumps(off, default=str))
        assert max(errors) <= ENERGY_TOLERANCE, (max(errors), off)

        # Status: per-phase saving, totals, nodes; totals = the sum of the node reports.
        totals = final["totals"]
        assert totals["steps"] == STEPS
        assert totals["missedSteps"] == 0 and totals["unknownEnergySteps"] == 0
        joules = sum(_record_energy(r) for r in records.values())
        assert totals["measuredJoules"] == pytest.approx(joules, rel=1e-9)
        tokens = sum(s.workload.valid_tokens for s in job.replay.steps)
        assert totals["validTokens"] == pytest.approx(tokens)
        # The saving is what the status says it is: predicted default minus measured.
        assert totals["savedJoules"] == pytest.approx(
            totals["predictedDefaultJoules"] - totals["comparedMeasuredJoules"], rel=1e-6
        )
        phases = {p["name"]: p for p in final["phases"]}
        for phase in fullstack.PHASES:
            assert "percent" in phases[phase]["saving"], phases[phase]
            assert phases[phase]["measuredJoules"] > 0
            assert phases[phase]["state"] in ("trial", "locked"), phases[phase]
        assert final["nodes"]["ready"] == 3 and final["nodes"]["total"] == 3
        # The agents ran in-phase probes: phases ran under several locks (trial slices).
        gen = phases["generation"]
        max_mhz = stack.sku.max_sm_clock_mhz
        assert "training" not in whole_step, probed  # 1.5 s phases: slices at any cadence
        if "generation" in whole_step:
            # A loaded machine: the trainer's progress came too seldom for in-phase slices of
            # this compressed phase (status probeEvidence whole-phase while it was so): trials
            # of whole steps (docs/agent.md).
            print("generation probed on whole steps:", probed, gen["probeEvidence"])
            trials = {c for t in truths for c in t.locks_seen["generation"]} - {None}
            assert trials, [t.locks_seen["generation"] for t in truths]
        # EE-RL ran generation below max at a saving, through NVML: locked, or (whole-step
        # trials having spent the job's trial budget, eerl._trial_budget_left) at its interim
        # clock until the budget frees.
        final_mhz = truths[-1].clocks_mhz["generation"]
        assert final_mhz is not None and final_mhz < max_mhz, truths[-1]
        assert gen["saving"]["percent"] > 0, gen
        if gen["state"] == "locked":
            assert gen["clockMHz"] == final_mhz, (gen, truths[-1])
        else:
            print("generation not locked in", STEPS, "steps:", gen["state"], final_mhz, "MHz")
        clocks = {ph: [t.clocks_mhz[ph] for t in truths] for ph in fullstack.PHASES}
        print(clocks)
        print(probed)
        table = dev_cluster.kubectl("get", "rlep", name, "-n", namespace).stdout.splitlines()
        col = table[0].index("SAVING %")
        assert table[1][col:].split()[0] not in ("<none>", ""), table
        print(
            f"\nfull stack: {STEPS} steps replayed in {replay_s:.1f} s (time x1/{factor:.0f}); "
            f"saving {totals['savingPercent']:.2f} % (throughput ratio "
            f"{totals['throughputRatio']:.4f}); max phase energy error "
            f"{max(errors) * 100:.4f} %; "
            + "; ".join(
                f"{ph} {phases[ph]['state']} {phases[ph].get('clockMHz')} MHz saving "
                f"{phases[ph]['saving'].get('percent')} % throughput ratio "
                f"{phases[ph]['throughputRatio']}"
                for ph in fullstack.PHASES
            )
        )
        print("\n".join(table))

        # Deletion: the agents acknowledge the reset plan, the finalizer goes, clocks default.
        t_del = time.monotonic()
        dev_cluster.kubectl("delete", "rlep", name, "-n", namespace, "--timeout=60s")
        deleted_s = time.monotonic() - t_del
        assert deleted_s < 25, f"finalizer took {deleted_s:.1f} s: reset acks missing?"
        for a in stack.agents:
            for u in a.uuids:
                assert not a.driver.gpu(u).locked, f"{u} still locked after the policy went"
        events = get_json(dev_cluster, "events", "-n", namespace)["items"]
        assert not [e for e in events if e.get("reason") == "ResetDeadlineExceeded"]
        stack.stop_agents()
        for a in stack.agents:
            assert a.proc is not None and a.proc.returncode == 0, stack.agent_output(a)[-2000:]
            assert "Traceback" not in stack.agent_output(a), stack.agent_output(a)[-4000:]
        stack.stop_operator()
        assert "Traceback (most recent call last)" not in stack.operator_log.read_text()
    print(f"full-stack e2e took {time.monotonic() - t0:.1f} s")
    if truth_misses is not None:
        missed = {m.split()[0] for m in misses} | set(locks)
        if whole_step and missed <= whole_step | {"total"}:
            pytest.xfail(f"{WHOLE_STEP_LIMITATION}: {truth_misses}")
        pytest.fail(f"status or locks off the truth: {truth_misses}")
