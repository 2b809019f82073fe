"""``phaseSource: annotation`` on the real control plane: the trainer annotates its own pod, the
node agent's watch locks that pod's GPUs; the latency annotation patch -> clocks applied.

What runs: the CRDs; a policy with ``phaseSource: annotation`` whose ``status.plan`` the test
writes (no operator: generation 1395 MHz, training 1755 MHz, both locked); a trainer pod on a
KWOK node and a second pod on the same node that holds no GPU; a fake kubelet PodResources
server allocating two stand-in GPUs to the trainer; one agent process for that node on the
stand-in ``libnvidia-ml.so.1`` following the policy (``--policy``); the trainer side is the
SDK's ``rlenergy.sdk.annotate.PodAnnotator`` with a token bound to the trainer pod (its
service account, the API server's own audience), over the cluster's CA.

We check:
* without RBAC the patch is refused (403, naming the ClusterRole to bind); with the chart's
  ``trainer-annotations`` ClusterRole (rendered by helm from ``helm/rl-energy``) bound by a
  RoleBinding, it is accepted;
* the agent watches the node's pods once the policy says ``annotation``; every phase patch
  moves the trainer's GPUs to the plan's clock of that phase; ``PATCHES`` alternating phases
  give the latency patch sent -> both stand-in GPUs at the new clock, printed as p50/p99
  (docs/agent.md quotes it), each under ``BOUND_S`` (a correctness bound: the signal arrives
  through the watch, not a speed target; bench/ holds those);
* the workload annotation ends each step: the node report in the API carries the steps with
  their workload;
* a pod of the node that holds no GPU annotating itself clocks nothing (the agent logs why);
* side by side, the same agent's socket path on the same phase changes (printed, for the
  trade-off docs/agent.md states).
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import get_json, get_json_if_found, wait_until
from rlenergy_agent import podmap
from rlenergy_dev import standin
from rlenergy_dev.devcluster import DevCluster, trainers

from rlenergy import errors
from rlenergy.api import naming
from rlenergy.api import node as api_node
from rlenergy.gpu import models
from rlenergy.sdk import annotate, trainer

pytestmark = pytest.mark.field
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rl-energy"
POLICY = "annotated"
CLOCK_MHZ = {"generation": 1395, "training": 1755}
PATCHES = 200
BOUND_S = 2.0
WORKLOAD = {"samples": 8, "response_tokens": 800, "prompt_tokens": 100, "valid_tokens": 800}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short folder for Unix sockets (108-byte path limit)."""
    with tempfile.TemporaryDirectory(prefix="rla-", dir="/tmp") as d:
        yield Path(d)


def _policy(ns: str) -> str:
    return json.dumps(
        {
            "apiVersion": "rlenergy.io/v1alpha1",
            "kind": "RLEnergyPolicy",
            "metadata": {"name": POLICY, "namespace": ns},
            "spec": {
                "selector": {"matchLabels": {"job": "annotated"}},
                "phaseSource": "annotation",
            },
        }
    )


def _trainer_role(cluster: DevCluster, name: str) -> dict[str, Any]:
    """The chart's trainer-annotations ClusterRole, as helm renders it, renamed for this test."""
    out = subprocess.run(  # noqa: S603 - the pinned helm
        [str(cluster.binaries.helm), "template", "rel", str(CHART), "--show-only",
         "templates/rbac.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(out) if d]
    role = next(d for d in docs if d["metadata"]["name"].endswith("-trainer-annotations"))
    assert role["kind"] == "ClusterRole" and role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
        # marks the role's holders for the chart's own-pod admission policy (test_privilege)
        {"apiGroups": ["rlenergy.io"], "resources": ["phaseannotations"], "verbs": ["patch"]},
    ]
    role["metadata"] = {"name": name}
    return role


def _ca_file(cluster: DevCluster, path: Path) -> str:
    kc = yaml.safe_load(cluster.kubeconfig.read_text())
    path.write_bytes(base64.b64decode(kc["clusters"][0]["cluster"]["certificate-authority-data"]))
    return str(path)


def _pod_token(k: trainers.Kubectl, pod: trainers.TrainerPod, path: Path) -> str:
    """A token of the pod's service account bound to the pod, for the API server itself."""
    token = k(
        "create", "token", "default", "-n", pod.namespace, "--bound-object-kind=Pod",
        f"--bound-object-name={pod.name}", f"--bound-object-uid={pod.uid}", "--duration=3600s",
    ).stdout.strip()  # fmt: skip
    return str(trainers.write_token(path, token))


def _at(drv: standin.StandinDriver, uuids: list[str], mhz: int) -> bool:
    return all((g := drv.gpu(u)).locked and g.lock_max_mhz == mhz for u in uuids)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


@pytest.mark.timeout(300)
def test_annotation_patches_drive_the_pods_gpus_through_the_watch(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path, short_dir: Path
):
    node = dev_cluster.nodes[0]
    ns = namespace
    k = dev_cluster.kubectl
    k("apply", "-f", "-", input=_policy(ns))
    plan = api_node.ClockPlan(
        step=0,
        phases=[
            api_node.PhasePlan(phase=p, clockMHz=c, state="locked") for p, c in CLOCK_MHZ.items()
        ],
    ).model_dump(by_alias=True, mode="json", exclude_none=True)
    k(
        "patch", "rlenergypolicies", POLICY, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"plan": plan}}),
    )  # fmt: skip
    pod = trainers.create_trainer(k, ns, "trainer-0", node, tmp_path, labels={"job": "annotated"})
    idle = trainers.create_trainer(k, ns, "no-gpus", node, tmp_path, labels={"job": "annotated"})
    wait_until(
        lambda: (
            get_json(dev_cluster, "pod", pod.name, "-n", ns)["status"].get("phase") == "Running"
        ),
        timeout=90,
        what="trainer pod Running on the KWOK node",
    )
    ca = _ca_file(dev_cluster, tmp_path / "ca.crt")
    notes = annotate.PodAnnotator(
        dev_cluster.server, ns, pod.name, token_file=_pod_token(k, pod, tmp_path / "sa"),
        ca_file=ca, strict=True,
    )  # fmt: skip
    other = annotate.PodAnnotator(
        dev_cluster.server, ns, idle.name, token_file=_pod_token(k, idle, tmp_path / "sa2"),
        ca_file=ca, strict=True,
    )  # fmt: skip

    # 1. RBAC: refused until the chart's ClusterRole is bound to the trainers' service account
    with pytest.raises(errors.PermanentError, match="HTTP 403.*trainer-annotations"):
        notes.phase("idle", step=0)
    role = f"{ns}-trainer-annotations"
    k("apply", "-f", "-", input=json.dumps(_trainer_role(dev_cluster, role)))
    k("create", "rolebinding", "trainers", "-n", ns, f"--clusterrole={role}",
      f"--serviceaccount={ns}:default")  # fmt: skip
    wait_until(lambda: _accepted(notes), timeout=30, what="the patch allowed by the RoleBinding")

    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    uuids = [f"GPU-{node}-ann-{i}" for i in range(2)]
    sku = models.get_sku("h100-sxm")
    kubelet_sock = str(short_dir / "kubelet.sock")
    kubelet = podmap.serve_fake_kubelet(
        kubelet_sock, lambda: {(ns, pod.name): {"nvidia.com/gpu": uuids}}
    )
    log_path = tmp_path / "agent.log"
    env = {key: v for key, v in os.environ.items() if not key.startswith("RLENERGY_AGENT_")}
    with standin.StandinDriver(tmp_path / "nvml.state", [(u, sku) for u in uuids]) as drv:
        env.update(drv.env(lib_dir))
        env.update(
            {
                "KUBECONFIG": str(dev_cluster.kubeconfig),
                "RLENERGY_AGENT_PODRESOURCES_SOCKET": kubelet_sock,
                "RLENERGY_AGENT_NAMESPACE": ns,
                "RLENERGY_AGENT_PLAN_POLL_S": "0.2",
                "RLENERGY_AGENT_REPORT_INTERVAL_S": "0.2",
            }
        )
        with log_path.open("w") as err:
            proc = subprocess.Popen(
                standin.agent_argv(node, short_dir / "agent.sock", tmp_path / "state",
                                   "--policy", POLICY),
                env=env, stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline(), log_path.read_text()
            # 2. the watch starts with the policy's phaseSource; the first phase locks
            notes.phase("generation", step=0)
            wait_until(
                lambda: _at(drv, uuids, CLOCK_MHZ["generation"]),
                timeout=60,
                what=f"generation locks the trainer's GPUs\n{log_path.read_text()}",
            )
            assert "phaseSource annotation: watching the pods of" in log_path.read_text()

            # 3. latency: patch sent -> both GPUs at the new phase's clock
            latency_s: list[float] = []
            patch_s: list[float] = []
            for i in range(1, PATCHES + 1):
                phase = "training" if i % 2 else "generation"
                step = i // 2
                if phase == "generation":  # step - 1 ends first: its workload
                    notes.end_step(step - 1, **WORKLOAD)
                t0 = time.perf_counter()
                notes.phase(phase, step=step)
                patch_s.append(time.perf_counter() - t0)
                while not _at(drv, uuids, CLOCK_MHZ[phase]):
                    assert time.perf_counter() - t0 < BOUND_S, (
                        f"{phase} of step {step} not applied within {BOUND_S} s\n"
                        f"{log_path.read_text()}"
                    )
                    time.sleep(0.0005)
                latency_s.append(time.perf_counter() - t0)
            p50, p99 = statistics.median(latency_s), _quantile(latency_s, 0.99)
            print(
                f"annotation patch -> clocks applied over {len(latency_s)} phases: "
                f"p50 {1000 * p50:.1f} ms, p99 {1000 * p99:.1f} ms, max "
                f"{1000 * max(latency_s):.1f} ms (the PATCH alone: p50 "
                f"{1000 * statistics.median(patch_s):.1f} ms, p99 "
                f"{1000 * _quantile(patch_s, 0.99):.1f} ms)"
            )

            # 4. the node report in the API has the steps and their annotated workload
            def steps() -> list[dict[str, Any]]:
                name = naming.report_name(POLICY, node)
                rep = get_json_if_found(dev_cluster, "rlenergynodereports", name, "-n", ns)
                return list(rep["spec"].get("steps") or []) if rep else []

            done = wait_until(
                lambda: (s := steps()) and len(s) >= 5 and s, timeout=30, what="steps reported"
            )
            assert all(s["workload"]["samples"] == 8 for s in done), done
            assert {p["phase"] for s in done for p in s["phases"]} == set(CLOCK_MHZ)

            # 5. a pod of the node without GPUs annotating itself clocks nothing
            last = "training" if PATCHES % 2 else "generation"
            other.phase("generation" if last == "training" else "training", step=PATCHES)
            wait_until(
                lambda: "holds no GPU on node" in log_path.read_text(),
                timeout=30,
                what="the GPU-less pod's annotation refused",
            )
            assert _at(drv, uuids, CLOCK_MHZ[last])

            # 6. side by side: the same phase changes over the agent's socket (same agent)
            client = trainer.RLEnergyClient(
                str(short_dir / "agent.sock"), strict=True, timeout_s=10.0,
                token_file=str(pod.token_file),
            )  # fmt: skip
            socket_s = [_socket_phase(client, drv, uuids, PATCHES + i) for i in range(PATCHES)]
            client.close()
            print(
                f"socket signal -> clocks applied over {len(socket_s)} phases: p50 "
                f"{1000 * statistics.median(socket_s):.1f} ms, p99 "
                f"{1000 * _quantile(socket_s, 0.99):.1f} ms; annotation / socket p50 "
                f"{p50 / statistics.median(socket_s):.1f}x"
            )
        except BaseException:
            print(log_path.read_text())
            raise
        finally:
            notes.close()
            other.close()
            proc.terminate()
            proc.wait(timeout=20)
            if proc.stdout is not None:
                proc.stdout.close()
            kubelet.stop(None)
            k("delete", "clusterrole", role, "--ignore-not-found")
        assert proc.returncode == 0
        assert not any(drv.gpu(u).locked for u in uuids)  # reset on exit


def _socket_phase(
    client: trainer.RLEnergyClient, drv: standin.StandinDriver, uuids: list[str], i: int
) -> float:
    """Seconds from a socket phase signal to both GPUs at its clock."""
    phase = "training" if i % 2 else "generation"
    t0 = time.perf_counter()
    client.phase(phase, step=i // 2)
    while not _at(drv, uuids, CLOCK_MHZ[phase]):
        assert time.perf_counter() - t0 < BOUND_S, f"socket {phase} not applied in {BOUND_S} s"
        time.sleep(0.0005)
    return time.perf_counter() - t0


def _accepted(notes: annotate.PodAnnotator) -> bool:
    try:
        return notes.phase("idle", step=0)
    except errors.PermanentError:
        return False  # the RoleBinding is not in the authorizer's cache yet
