"""Reset on pod end, on the real control plane: a governed pod that ends gets its GPUs back at
the default governor within 10 s, whatever else the policy still runs on the node.

What runs: two trainer pods on one KWOK node (real pod objects; each signals with a token the
API server bound to it, checked by TokenReview); a fake kubelet PodResources server
(``rlenergy_agent.podmap.serve_fake_kubelet``) allocating two stand-in GPUs to each; one agent
process for that node on the stand-in ``libnvidia-ml.so.1`` with a clock plan file and the
default periods (1 s samples, 3 s API check).

We check:
* pod A locks its GPUs and parks one of them (a released rollout worker at the lowest clock);
  pod B locks its own. ``kubectl delete pod A``: both of A's GPUs are back at the default
  governor within 10 s (the kubelet's listing is kept on purpose: the API says the pod is
  gone), B's stay locked;
* pod B's allocation leaves the kubelet's listing (its containers ended): its GPUs are reset
  within 10 s too;
* with real tokens: pod B naming A's GPU, a pod of another node, and a token for another
  audience are refused (403, 403, 401);
* the agent log names both resets; the measured delays are printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import wait_until
from rlenergy_agent import podmap
from rlenergy_dev import standin
from rlenergy_dev.devcluster import DevCluster, trainers

from rlenergy.gpu import models
from rlenergy.sdk import trainer

ROOT = Path(__file__).resolve().parents[2]
PLAN = {"step": 0, "phases": [{"phase": "generation", "clockMHz": 1395, "state": "locked"}]}
RESET_BOUND_S = 10.0


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short folder for Unix sockets (108-byte path limit)."""
    with tempfile.TemporaryDirectory(prefix="rlp-", dir="/tmp") as d:
        yield Path(d)


def _reset_within(
    drv: standin.StandinDriver, gpus: list[str], bound_s: float, since_s: float
) -> float:
    """Seconds from ``since_s`` (monotonic) until none of ``gpus`` is locked (<= ``bound_s``)."""
    wait_until(
        lambda: not any(drv.gpu(u).locked for u in gpus),
        timeout=bound_s - (time.monotonic() - since_s),
        interval=0.05,
        what=f"{gpus} back at the default governor within {bound_s} s",
    )
    return time.monotonic() - since_s


@pytest.mark.timeout(240)
def test_a_pod_that_ends_gets_its_gpus_reset_within_10_s(
    dev_cluster: DevCluster, namespace: str, tmp_path: Path, short_dir: Path
):
    node = dev_cluster.nodes[1]
    k = dev_cluster.kubectl
    pod_a = trainers.create_trainer(k, namespace, "trainer-a", node, tmp_path)
    pod_b = trainers.create_trainer(k, namespace, "trainer-b", node, tmp_path)
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    a_gpus = [f"GPU-{node}-end-a{i}" for i in range(2)]
    b_gpus = [f"GPU-{node}-end-b{i}" for i in range(2)]
    sku = models.get_sku("h100-sxm")
    listed = {
        (namespace, pod_a.name): {"nvidia.com/gpu": a_gpus},
        (namespace, pod_b.name): {"nvidia.com/gpu": b_gpus},
    }
    kubelet_sock = str(short_dir / "kubelet.sock")
    agent_sock = short_dir / "agent.sock"
    kubelet = podmap.serve_fake_kubelet(kubelet_sock, lambda: dict(listed))
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    log_path = tmp_path / "agent.log"
    env = {key: v for key, v in os.environ.items() if not key.startswith("RLENERGY_AGENT_")}
    with standin.StandinDriver(tmp_path / "nvml.state", [(u, sku) for u in a_gpus + b_gpus]) as drv:
        env.update(drv.env(lib_dir))
        env.update(
            {
                "KUBECONFIG": str(dev_cluster.kubeconfig),
                "RLENERGY_AGENT_PODRESOURCES_SOCKET": kubelet_sock,
            }
        )
        with log_path.open("w") as err:
            proc = subprocess.Popen(
                standin.agent_argv(
                    node, agent_sock, tmp_path / "state", "--plan", str(tmp_path / "plan.json")
                ),
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        client_a = trainer.RLEnergyClient(
            str(agent_sock), strict=True, timeout_s=10.0, token_file=str(pod_a.token_file)
        )
        client_b = trainer.RLEnergyClient(
            str(agent_sock), strict=True, timeout_s=10.0, token_file=str(pod_b.token_file)
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline(), log_path.read_text()

            def signal_all() -> bool:
                try:
                    client_a.phase("generation", step=0)
                    client_b.phase("generation", step=0)
                except trainer.AgentRefusedError:
                    return False  # the pod UIDs are not listed yet
                return True

            wait_until(signal_all, timeout=30, what=f"signals accepted\n{log_path.read_text()}")
            # real tokens, real TokenReview: another pod's GPU, another node's pod, another
            # audience are all refused, and nothing is clocked by them
            intruder = trainer.RLEnergyClient(
                str(agent_sock), strict=True, token_file=str(pod_b.token_file), gpus=[a_gpus[0]]
            )
            with pytest.raises(trainer.AgentRefusedError, match="does not hold GPU") as info:
                intruder.phase("generation", step=0)
            assert info.value.status == 403
            elsewhere = trainers.create_trainer(
                k, namespace, "trainer-c", dev_cluster.nodes[2], tmp_path
            )
            far = trainer.RLEnergyClient(
                str(agent_sock), strict=True, token_file=str(elsewhere.token_file)
            )
            with pytest.raises(trainer.AgentRefusedError, match="this agent serves node") as info:
                far.phase("generation", step=0)
            assert info.value.status == 403
            wrong_aud = trainers.write_token(
                tmp_path / "wrong-aud",
                trainers.bound_token(k, namespace, pod_a.name, pod_a.uid, audience="other"),
            )
            stray = trainer.RLEnergyClient(str(agent_sock), strict=True, token_file=str(wrong_aud))
            with pytest.raises(trainer.AgentRefusedError, match="refused by the API") as info:
                stray.phase("generation", step=0)
            assert info.value.status == 401
            for c in (intruder, far, stray):
                c.close()
            client_a.park(0, gpus=[a_gpus[1]])
            assert all(drv.gpu(u).locked for u in a_gpus + b_gpus)
            assert drv.gpu(a_gpus[1]).lock_max_mhz < drv.gpu(a_gpus[0]).lock_max_mhz  # parked

            # 1. pod A is deleted; the kubelet's listing still has it: the API check resets it
            t0 = time.monotonic()
            k("delete", "pod", pod_a.name, "-n", namespace, "--wait=false")
            deleted_s = _reset_within(drv, a_gpus, RESET_BOUND_S, t0)
            assert all(drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1395 for u in b_gpus)

            # 2. pod B's containers end: the kubelet drops its allocation
            t0 = time.monotonic()
            del listed[(namespace, pod_b.name)]
            ended_s = _reset_within(drv, b_gpus, RESET_BOUND_S, t0)
            text = log_path.read_text()
            assert f"pod {namespace}/{pod_a.name} ended" in text, text
            assert f"pod {namespace}/{pod_b.name} ended" in text, text
            print(f"reset after pod deletion: {deleted_s:.2f} s; after the kubelet dropped the "
                  f"pod: {ended_s:.2f} s (bound {RESET_BOUND_S} s)")  # fmt: skip
        except BaseException:
            print(log_path.read_text())
            raise
        finally:
            client_a.close()
            client_b.close()
            proc.terminate()
            proc.wait(timeout=20)
            if proc.stdout is not None:
                proc.stdout.close()
            kubelet.stop(None)
    assert proc.returncode == 0
