"""Chaos on the node agents and their GPUs (stand-in NVML), with the real operator.

* an agent SIGKILLed mid-phase leaves its locks behind; the restarted agent (what the
  DaemonSet does) resets them at start-up, before any new signal, and the job carries on;
* the stand-in NVML loses a GPU, refuses permission, or resets a GPU's energy counter
  mid-run: only that GPU degrades, visibly in the node report; the energy of every published
  step is known and sane (a reset counter never yields a negative or inflated window).

Each ends with the promises of ``chaos_support.Stack`` (totals equal the sum of the published
step records; the policy's deletion resets every GPU that can be reset; nothing stuck).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from chaos_support import stack, wait_until
from rlenergy_dev import standin
from rlenergy_dev.devcluster import DevCluster


def test_agent_sigkill_mid_phase_then_restart_resets_clocks(
    chaos_cluster: DevCluster, namespace: str, tmp_path: Path, standin_lib: Path
):
    with stack(chaos_cluster, namespace, tmp_path, standin_lib) as s:
        s.start()
        s.run_steps(4)
        victim = s.agents[0]
        seen: dict[str, list[str]] = {}

        def kill_mid_phase() -> None:
            seen["before"] = victim.locked()
            victim.proc.kill()
            seen["after_kill"] = victim.locked()

        s.run_steps(1, mid_phase={s.step: kill_mid_phase})
        # A lock made by the dead agent outlives it (so the restart has something to undo).
        assert seen["after_kill"] == seen["before"]
        victim.start()
        wait_until(lambda: victim.locked() == [], timeout=10, what="stale locks reset at start-up")
        s.run_steps(3)
        st = s.check_totals()
        reps = s.snapshot()
        assert {r["spec"]["nodeName"] for r in reps} == {a.node for a in s.agents}
        s.delete_and_check_reset()
        s.no_tracebacks()
        print(f"locks before the kill: {seen['before']}; totals {st['totals']}")


@pytest.mark.parametrize("fault", ["lost", "no_permission", "counter_reset"])
def test_nvml_fault_degrades_only_that_gpu(
    chaos_cluster: DevCluster, namespace: str, tmp_path: Path, standin_lib: Path, fault: str
):
    with stack(chaos_cluster, namespace, tmp_path, standin_lib) as s:
        victim = s.agents[0]
        bad = victim.uuids[1]
        if fault == "no_permission":
            for u in victim.uuids:
                victim.driver.gpu(u).fail_clock_set = standin.NO_PERMISSION
        s.start()
        s.run_steps(3)

        def inject() -> None:
            if fault == "lost":
                victim.driver.gpu(bad).fail_all = standin.GPU_IS_LOST
            elif fault == "counter_reset":
                victim.driver.reset_counter(bad, 0)

        fault_step = s.step
        s.run_steps(1, mid_phase={fault_step: inject})
        s.run_steps(3)
        st = s.check_totals()
        reps = {r["spec"]["nodeName"]: r["spec"] for r in s.snapshot()}
        gpus = {g["uuid"]: g for g in reps[victim.node]["gpus"]}
        if fault == "lost":
            assert gpus[bad]["condition"] == "lost", gpus[bad]
            assert gpus[victim.uuids[0]]["condition"] in ("ok", "degraded"), gpus
        elif fault == "no_permission":
            for u in victim.uuids:
                assert gpus[u]["condition"] == "measureOnly", gpus[u]
                assert "NoPermission" in gpus[u]["reason"], gpus[u]
            assert victim.locked() == []
        # Other nodes never notice.
        for a in s.agents[1:]:
            assert all(g["condition"] == "ok" for g in reps[a.node]["gpus"]), reps[a.node]["gpus"]
        # Every window's energy is known and sane: never negative, never more than the truth.
        for rec in reps[victim.node]["steps"]:
            for ph in rec["phases"]:
                e = ph.get("energyJoules")
                assert e is None or e >= 0, ph
                truth = sum(
                    victim.driver.truth_j(u, f"{ph['phase']}-{rec['step']}") for u in victim.uuids
                )
                if e is not None and truth > 0:
                    assert e <= truth * 1.05 + 1.0, (fault, rec["step"], ph["phase"], e, truth)
        assert st["totals"]["missedSteps"] == 0
        if fault == "lost":
            # A lost GPU cannot acknowledge a reset: the finalizer still goes (deadline at most).
            t0 = time.monotonic()
            chaos_cluster.kubectl("delete", "rlep", s.policy, "-n", namespace, "--timeout=90s")
            print(f"policy with a lost GPU deleted in {time.monotonic() - t0:.0f} s")
            for a in s.agents:
                assert [u for u in a.locked() if u != bad] == []
        else:
            s.delete_and_check_reset()
        s.no_tracebacks()
