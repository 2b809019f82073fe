"""The smoke test's loop with a real operator and agent: a report, a lock and a saving.

On the session's control plane (``rlenergy_dev.fullstack``: the operator and one node agent as
local processes, the agent on the stand-in ``libnvidia-ml.so.1`` with 8 simulated H100 GPUs, its
trainer a pod object on the KWOK node with a token the API server bound to it), the smoke policy
of ``rlenergy_kubectl.smoke`` is applied and the smoke pod's program, ``python -m
rlenergy.sdk.smoke``, runs as a process with that pod's token and the agent's socket, as it runs
in the pod. The simulated GPUs run a steady memory-bound load (the smoke program runs no GPU
kernel; on the dev cluster the stand-in is the hardware). We test these aspects:

* the plugin's own reading of the status (``smoke.evaluate``) sees a node report, a locked
  phase and a saving, and the saving is positive on the loaded GPUs; the time from the first
  signal to that is printed (what "within a minute" is measured by);
* the smoke program printed one line per step with the agent's per-phase energy (J > 0).

``kubectl rlenergy smoke`` itself (the pod, the plugin) runs on the real node in
``tests/e2e/test_runbook.py``; ``tests/e2e/test_kubectl_smoke_writes.py`` checks its API writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rlenergy_dev
from e2e_support import wait_until
from rlenergy_dev import fullstack, standin
from rlenergy_dev.devcluster import DevCluster
from rlenergy_kubectl import smoke

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240.0


@pytest.mark.timeout(600)
def test_smoke_program_shows_report_lock_and_saving(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path
) -> None:
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    stack = fullstack.FullStack(
        dev_cluster.kubeconfig,
        namespace,
        smoke.POLICY,
        dev_cluster.nodes[:1],
        tmp_path / "stack",
        lib_dir,
    )
    with stack:
        stack.start_operator()
        policy = smoke.policy(namespace)
        dev_cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))
        stack.start_agents()
        (agent,) = stack.agents
        assert agent.pod is not None
        agent.driver.set_work(agent.uuids, "generation")  # a steady memory-bound load
        agent.driver.start()
        env = {
            **rlenergy_dev.source_env(os.environ),
            "RLENERGY_AGENT_SOCKET": str(agent.socket),
            "RLENERGY_AGENT_TOKEN_FILE": str(agent.pod.token_file),
        }
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlenergy.sdk.smoke", "--steps", "480"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            first_seen: dict[str, float] = {}

            def passed() -> smoke.Result | None:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                obj = {**policy, "status": stack.policy_status()}
                result = smoke.evaluate(obj, stack.node_reports())
                for what in {"report", "lock", "saving"} - set(result.missing):
                    first_seen.setdefault(what, round(time.monotonic() - t0, 1))
                return result if result.ok else None

            result = wait_until(passed, timeout=TIMEOUT_S, interval=1.0, what="smoke PASS")
            elapsed = time.monotonic() - t0
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=30)
            agent.driver.stop()
        print(smoke.render(result, namespace=namespace, elapsed_s=elapsed))
        print(
            f"smoke loop: PASS {elapsed:.1f} s after the first signal; first seen (s): {first_seen}"
        )
        assert result.saving_percent is not None and result.saving_percent > 0, result
        lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
        assert lines, out
        energy = json.loads(lines[0].split("phaseEnergyJoules ", 1)[1])
        assert energy and all(j > 0 for j in energy.values()), lines[0]
        dev_cluster.kubectl("delete", "rlep", smoke.POLICY, "-n", namespace, "--timeout=60s")
