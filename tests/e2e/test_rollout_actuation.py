"""FlexFloor actuation on the real control plane: parked GPUs and a resized rollout pool.

What runs: the CRDs, the operator as a local process, three node agents on the stand-in NVML
(``rlenergy_dev.fullstack``), a StatefulSet ``rollout-pool`` of 4 rollout workers
(2 GPUs each, scheduled on the KWOK GPU nodes and run by the real StatefulSet controller), and
a policy with ``rollout.releaseAction: scale`` whose expert floor is 2 workers (16 experts of
1 GB, 10 GB per worker with 2 GB of dense weights: 8 experts per worker).

The test plays the rollout dispatcher and the workers through the SDK: node 0 is the trainer
(it publishes the dispatcher's state, ``nextStepWorkers``), node 1 a rollout-only worker node.

We check:
* park: a released worker's GPUs (2 of node 1's) drop to the lowest supported SM clock, read
  back through NVML, shown in the agent's metrics (parked, parked clock, effective clock,
  released GPU-seconds counting up once their power dropped); an idle signal of the same step
  keeps them parked; the next step's first phase signal un-parks them (metrics and stand-in
  lock);
* scale: between steps the operator shrinks the pool 4 -> 2 (``/scale``; the controller deletes
  the pods), refuses 2 -> 1 (``ShrinkRejected: ... minimum is 2``, a Warning event, pool
  untouched), grows it back 2 -> 4; the pool is never seen below the floor;
* status.rollout: the floor, the released GPU-seconds equal to the node reports' records as
  published (a report holds only what the operator has not folded), occupied
  GPU-seconds and tokens per occupied GPU-second, nothing parked at the end;
* a LeaderWorkerSet (its CRD's /scale subresource, no controller; its pods made by hand on
  node 0, whose report publishes) is resized through the same generic code path: 3 -> 2,
  2 -> 1 refused, 2 -> 3;
* a RayCluster worker group (its CRD, no KubeRay controller): 3 -> 2 names the released pod
  (both GPUs parked in the node report) in ``scaleStrategy.workersToDelete``; 2 -> 1 with no
  released pod known is refused (``WorkersUnknown``, a Warning event, replicas untouched);
  2 -> 3 raises replicas and clears the deleted pod's entry; the other group is untouched.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_support import get_json, wait_until
from rlenergy_agent import server
from rlenergy_dev import fullstack, standin
from rlenergy_dev.devcluster import DevCluster

from rlenergy.sdk import trainer

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
POOL = "rollout-pool"
FLOOR = 2
GB = 10**9
RESPONSE_TOKENS = 4096.0
OPT_IN = {"rlenergy.io/allow-scale-by": "moe-rollout"}


def _pool(replicas: int) -> dict[str, Any]:
    labels = {"app": POOL}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        # the workload's opt-in: the operator resizes only worker sets that name the policy
        "metadata": {"name": POOL, "annotations": OPT_IN},
        "spec": {
            "replicas": replicas,
            "serviceName": POOL,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                    "containers": [
                        {
                            "name": "rollout",
                            "image": "registry.invalid/rollout-worker:1",
                            "resources": {"limits": {"nvidia.com/gpu": "2"}},
                        }
                    ],
                },
            },
        },
    }


def _policy() -> dict[str, Any]:
    return {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": "moe-rollout"},
        "spec": {
            "selector": {"matchLabels": {"app": POOL}},
            # warm-up longer than the test: the plan stays at the default governor
            "controller": {"warmupSteps": 50},
            "rollout": {
                "workerSetRef": {"kind": "StatefulSet", "name": POOL},
                "experts": {"count": 16, "bytesPerExpert": GB},
                "workerMemoryBytes": 10 * GB,
                "denseBytes": 2 * GB,
                "minActiveWorkers": 1,
                "releaseAction": "scale",
            },
        },
    }


def _metrics(agent: fullstack.NodeAgent) -> str:
    """The agent's /metrics as of now: the agent serves a rendering again to scrapes within
    ``server.METRICS_REUSE_S``, so this waits that long first (a state change just made is in
    the page)."""
    time.sleep(server.METRICS_REUSE_S)
    url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback only
        return str(resp.read().decode())


def _gauge(text: str, name: str, uuid: str, extra: str = "") -> float | None:
    pattern = rf'^{name}{{gpu_uuid="{re.escape(uuid)}"{extra}[^}}]*}} (\S+)$'
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else None


def _scale_decision(stack: Any, step: int) -> dict[str, Any] | None:
    """``status.rollout.scale`` once it is the decision for ``step``, else None."""
    s = stack.policy_status().get("rollout", {}).get("scale") or {}
    return s if s.get("forStep") == step else None


def _worker_pods(dev_cluster: Any, namespace: str, names: list[str]) -> None:
    """Pods of the policy (label ``app: POOL``) on the first node, as a worker set's controller
    would make them (none runs here): the operator reads only the reports of nodes that host
    the policy's pods."""
    for name in names:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": POOL}},
            "spec": {
                "nodeName": dev_cluster.nodes[0],
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "w", "image": "registry.invalid/rollout-worker:1"}],
            },
        }
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))


def _publish_rollout(
    dev_cluster: Any,
    namespace: str,
    policy: str,
    gpus: list[dict[str, Any]],
    step: int,
    active: int,
    next_step_workers: int,
) -> None:
    """Write the first node's report with a dispatcher publication, as its agent relays it."""
    node = dev_cluster.nodes[0]
    report = {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyNodeReport",
        "metadata": {"name": f"{policy}-{node}"},
        "spec": {
            "policyName": policy,
            "nodeName": node,
            "gpus": gpus,
            "rollout": {
                "step": step,
                "activeWorkers": active,
                "nextStepWorkers": next_step_workers,
            },
        },
    }
    dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(report))


@pytest.mark.timeout(300)
def test_park_and_scale_between_steps(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path
):
    t0 = time.monotonic()
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    policy = _policy()
    name = policy["metadata"]["name"]
    dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_pool(4)))
    seen_replicas: list[int] = []

    def pool() -> dict[str, Any]:
        sts = get_json(dev_cluster, "statefulset", POOL, "-n", namespace)
        seen_replicas.append(int(sts["spec"]["replicas"]))
        return dict(sts)

    def pool_at(n: int) -> bool:
        sts = pool()
        return sts["spec"]["replicas"] == n and sts.get("status", {}).get("replicas", -1) == n

    wait_until(lambda: pool_at(4), timeout=60, what="rollout pool created with 4 workers")

    stack = fullstack.FullStack(
        dev_cluster.kubeconfig, namespace, name, dev_cluster.nodes, tmp_path / "stack", lib_dir
    )
    with stack:
        stack.start_operator()
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
        stack.start_agents()
        published = fullstack.PublishedRecords(stack.node_reports).start()
        for a in stack.agents:
            wait_until(lambda a=a: a.plan_step() >= 0, timeout=60, what=f"plan on {a.node}")
        clients = {
            a.node: trainer.RLEnergyClient(
                str(a.socket), strict=True, timeout_s=10.0, token_file=str(a.pod.token_file)
            )
            for a in stack.agents
            if a.pod is not None
        }
        driver_node, worker_node = stack.agents[0], stack.agents[1]
        released = worker_node.uuids[6:]  # rollout worker 3: the last 2 GPUs of node 1
        kept = worker_node.uuids[0]
        t_ready = time.monotonic()

        def begin(step: int) -> None:
            for a in stack.agents:
                clients[a.node].phase("generation", step=step)
                a.driver.set_work(a.uuids, "generation", f"gen-{step}")

        def finish(step: int, active: int, released_workers: int, nxt: int) -> None:
            for a in stack.agents:
                clients[a.node].phase("idle", step=step)
                a.driver.set_work(a.uuids, "idle", f"idle-{step}")
            for a in (driver_node, stack.agents[2]):  # node 1 is rollout-only
                clients[a.node].end_step(
                    step,
                    samples=64,
                    response_tokens=RESPONSE_TOKENS,
                    prompt_tokens=1024,
                    valid_tokens=RESPONSE_TOKENS,
                )
            clients[driver_node.node].publish_rollout(
                step,
                active_workers=active,
                released_workers=released_workers,
                next_step_workers=nxt,
            )

        # ----- step 0: worker 3 is released and parked; the pool shrinks to 2 after it.
        begin(0)
        worker_node.driver.advance(0.2)
        answer = clients[worker_node.node].park(0, gpus=released)
        assert set(answer["parked"]) == set(released), answer
        # The released rank's engine lets go of its GPUs: their power drops, and only from
        # then on is the park credited released GPU-seconds.
        worker_node.driver.set_work(released, "idle", "released-0")
        report = wait_until(
            lambda: next(
                (
                    r["spec"]
                    for r in stack.node_reports()
                    if r["spec"]["nodeName"] == worker_node.node
                    and any(g.get("parked") for g in r["spec"]["gpus"])
                ),
                None,
            ),
            timeout=30,
            what="node report showing the parked GPUs",
        )
        lowest = min(
            next(g for g in report["gpus"] if g["uuid"] == released[0])["supportedClocksMHz"]
        )
        assert all(v["clockMHz"] == lowest for v in answer["parked"].values()), answer
        clients[worker_node.node].phase("idle", step=0)  # same step: still parked
        text = _metrics(worker_node)
        for u in released:
            assert worker_node.driver.gpu(u).locked
            assert worker_node.driver.gpu(u).lock_max_mhz == lowest
            assert _gauge(text, "rlenergy_agent_gpu_parked", u) == 1.0
            assert _gauge(text, "rlenergy_agent_gpu_parked_clock_hertz", u) == lowest * 1e6
            effective = _gauge(text, "rlenergy_agent_gpu_sm_clock_hertz", u, ',kind="effective"')
            assert effective == lowest * 1e6, text
        assert _gauge(text, "rlenergy_agent_gpu_parked", kept) == 0.0
        assert not worker_node.driver.gpu(kept).locked  # warm-up plan: default governor
        before = _gauge(text, "rlenergy_agent_released_gpu_seconds_total", released[0]) or 0.0
        wait_until(
            lambda: (
                (_gauge(_metrics(worker_node), "rlenergy_agent_released_gpu_seconds_total",
                        released[0]) or 0.0) > before
            ),
            timeout=10,
            interval=0.05,
            what="released GPU-seconds counting up while parked",
        )  # fmt: skip
        finish(0, active=3, released_workers=1, nxt=2)
        wait_until(lambda: pool_at(2), timeout=60, what="pool shrunk to 2 between steps")

        # ----- step 1: the first signal of the next step un-parks; 2 -> 1 is refused.
        begin(1)
        text = _metrics(worker_node)
        for u in released:
            assert not worker_node.driver.gpu(u).locked, "still locked after the next step began"
            assert _gauge(text, "rlenergy_agent_gpu_parked", u) == 0.0
            assert _gauge(text, "rlenergy_agent_gpu_parked_clock_hertz", u) is None
        parked_s = _gauge(text, "rlenergy_agent_released_gpu_seconds_total", released[0])
        assert parked_s is not None and parked_s > 0
        finish(1, active=2, released_workers=0, nxt=1)

        def refused() -> dict[str, Any] | None:
            scale = stack.policy_status().get("rollout", {}).get("scale") or {}
            return scale if scale.get("forStep") == 2 else None

        scale = wait_until(refused, timeout=30, what="the decision for step 2")
        assert scale["reason"] == "ShrinkRejected", scale
        assert f"minimum is {FLOOR}" in scale["message"], scale
        assert scale["target"] == scale["current"] == 2, scale
        assert pool_at(2)
        events = get_json(dev_cluster, "events", "-n", namespace)["items"]
        assert any(
            e.get("reason") == "ShrinkRejected" and e.get("type") == "Warning" for e in events
        ), [e.get("reason") for e in events]

        # ----- step 2: the dispatcher needs 4 workers again: the pool grows back.
        begin(2)
        finish(2, active=2, released_workers=0, nxt=4)
        wait_until(lambda: pool_at(4), timeout=60, what="pool grown back to 4")
        begin(3)  # node 1's step 2 record is finished once step 3 has begun there
        clients[worker_node.node].phase("idle", step=3)

        status = wait_until(
            lambda: (
                s
                if (s := stack.policy_status().get("rollout", {})).get("throughStep", -1) >= 2
                else None
            ),
            timeout=30,
            what="status.rollout through step 2",
        )
        records = published.stop()
        step0 = records[worker_node.node][0]
        assert step0["releasedGpuSeconds"] == pytest.approx(2 * parked_s, rel=0.05)
        assert status["floor"] == FLOOR
        assert status["active"] == 4
        assert status["parkedGpus"] == 0
        assert status["releasedGpuSeconds"] == pytest.approx(
            sum(
                s.get("releasedGpuSeconds", 0.0)
                for by_step in records.values()
                for step, s in by_step.items()
                if step <= 2
            )
        )
        assert status["releasedGpuSeconds"] > 0
        assert status["responseTokens"] == 3 * RESPONSE_TOKENS
        assert status["occupiedGpuSeconds"] > 0
        assert status["tokensPerOccupiedGpuSecond"] == pytest.approx(
            status["responseTokens"] / status["occupiedGpuSeconds"], rel=1e-4
        )
        assert min(seen_replicas) == FLOOR, seen_replicas
        for c in clients.values():
            c.close()
        print(
            f"\nrollout actuation: parked {2 * parked_s:.2f} GPU-s at {lowest} MHz; pool "
            f"{sorted(set(seen_replicas), reverse=True)} (min {min(seen_replicas)}); status "
            f"{json.dumps(status)}; {time.monotonic() - t_ready:.1f} s after the agents were "
            f"up, {time.monotonic() - t0:.1f} s in all"
        )


def _open_crd(group: str, kind: str, plural: str, subresources: dict[str, Any]) -> dict[str, Any]:
    """A namespaced ``v1`` CRD whose spec and status keep any field (no controller runs)."""
    open_object = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": subresources,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"spec": open_object, "status": open_object},
                        }
                    },
                }
            ],
        },
    }


def _lws_crd() -> dict[str, Any]:
    """LeaderWorkerSet's CRD reduced to what the operator touches: the /scale subresource with
    the paths of the real one (sigs.k8s.io/lws: .spec.replicas, .status.replicas)."""
    return _open_crd(
        "leaderworkerset.x-k8s.io",
        "LeaderWorkerSet",
        "leaderworkersets",
        {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
            },
        },
    )


def _raycluster_crd() -> dict[str, Any]:
    """KubeRay's RayCluster CRD reduced to what the operator touches: ``spec.workerGroupSpecs``
    (kept as written; no /scale, as the real one)."""
    return _open_crd("ray.io", "RayCluster", "rayclusters", {"status": {}})


def _apply_crd(dev_cluster: DevCluster, crd: dict[str, Any]) -> None:
    dev_cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd))
    dev_cluster.wait_crds_established(crd["metadata"]["name"])


@pytest.mark.timeout(180)
def test_leaderworkerset_is_resized_through_the_generic_scale_subresource(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path
):
    """The same /scale code path on a LeaderWorkerSet (a custom resource); the dispatcher's
    publication is written into a node report directly (no agent needed for the decision)."""
    _apply_crd(dev_cluster, _lws_crd())
    lws = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": POOL, "annotations": OPT_IN},
        "spec": {"replicas": 3, "leaderWorkerTemplate": {"size": 2}},
    }
    dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(lws))
    _worker_pods(dev_cluster, namespace, [f"{POOL}-{i}" for i in range(3)])
    policy = _policy()
    policy["spec"]["rollout"]["workerSetRef"] = {"kind": "LeaderWorkerSet", "name": POOL}
    name = policy["metadata"]["name"]
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    stack = fullstack.FullStack(
        dev_cluster.kubeconfig, namespace, name, dev_cluster.nodes[:1], tmp_path / "stack", lib_dir
    )

    def publish(step: int, nxt: int) -> None:
        gpus = [{"uuid": "GPU-lws-0", "condition": "ok"}]
        _publish_rollout(dev_cluster, namespace, name, gpus, step, 3, nxt)

    def replicas() -> int:
        return int(
            get_json(dev_cluster, "leaderworkerset", POOL, "-n", namespace)["spec"]["replicas"]
        )

    def scale_for(step: int) -> dict[str, Any] | None:
        return _scale_decision(stack, step)

    with stack:
        stack.start_operator()
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
        publish(0, 2)
        wait_until(lambda: replicas() == 2, timeout=60, what="LeaderWorkerSet shrunk to 2")
        decided = wait_until(lambda: scale_for(1), timeout=30, what="decision for step 1")
        assert decided["reason"] == "ShrinkBetweenSteps" and decided["target"] == 2, decided
        publish(1, 1)
        refused = wait_until(lambda: scale_for(2), timeout=30, what="decision for step 2")
        assert refused["reason"] == "ShrinkRejected", refused
        assert f"minimum is {FLOOR}" in refused["message"], refused
        assert replicas() == 2
        publish(2, 3)
        wait_until(lambda: replicas() == 3, timeout=30, what="LeaderWorkerSet grown to 3")


@pytest.mark.timeout(180)
def test_raycluster_worker_group_deletes_the_released_pod_by_name(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path
):
    """A RayCluster worker group (its CRD, no KubeRay controller): the operator's writes to
    ``workerGroupSpecs[i].replicas`` and ``scaleStrategy.workersToDelete``. The node report
    (written directly) carries the dispatcher's publication and per GPU its pod and ``parked``.
    The floor is 1 here (18 expert slots per worker), so a refusal is the released pods'."""
    _apply_crd(dev_cluster, _raycluster_crd())
    wait_until(
        lambda: dev_cluster.kubectl("get", "rayclusters.ray.io", "-A", check=False).returncode == 0,
        timeout=30,
        what="rayclusters served",
    )
    cluster, group = "rc", "rollout"
    template = {"spec": {"containers": [{"name": "ray-worker", "image": "rayproject/ray:2"}]}}
    rc = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": cluster, "annotations": OPT_IN},
        "spec": {
            "headGroupSpec": {"rayStartParams": {}, "template": template},
            "workerGroupSpecs": [
                {"groupName": "cpu", "replicas": 1, "template": template},
                {
                    "groupName": group,
                    "replicas": 3,
                    "minReplicas": 0,
                    "maxReplicas": 8,
                    "rayStartParams": {},
                    "template": template,
                },
            ],
        },
    }
    dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(rc))
    policy = _policy()
    policy["spec"]["rollout"]["workerSetRef"] = {
        "kind": "RayCluster",
        "name": cluster,
        "workerGroupName": group,
    }
    policy["spec"]["rollout"]["workerMemoryBytes"] = 20 * GB  # 18 slots: floor 1
    name = policy["metadata"]["name"]
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    stack = fullstack.FullStack(
        dev_cluster.kubeconfig, namespace, name, dev_cluster.nodes[:1], tmp_path / "stack", lib_dir
    )
    pods = [f"{cluster}-{group}-worker-{s}" for s in ("a2b4c", "d5f7g", "h9j2k")]
    _worker_pods(dev_cluster, namespace, pods)

    def publish(step: int, nxt: int, parked: dict[str, bool]) -> None:
        gpus = [
            {"uuid": f"GPU-{pod}-{i}", "condition": "ok", "pod": f"{namespace}/{pod}",
             "parked": is_parked}
            for pod, is_parked in parked.items()
            for i in range(2)
        ]  # fmt: skip
        gpus.append(
            {"uuid": "GPU-head", "pod": f"{namespace}/{cluster}-head-x7z2q", "parked": True}
        )
        _publish_rollout(dev_cluster, namespace, name, gpus, step, len(parked), nxt)

    def worker_group() -> dict[str, Any]:
        obj = get_json(dev_cluster, "rayclusters.ray.io", cluster, "-n", namespace)
        groups = {g["groupName"]: g for g in obj["spec"]["workerGroupSpecs"]}
        assert groups["cpu"] == rc["spec"]["workerGroupSpecs"][0], groups  # untouched
        return dict(groups[group])

    def scale_for(step: int) -> dict[str, Any] | None:
        return _scale_decision(stack, step)

    with stack:
        stack.start_operator()
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(policy))
        # step 0: the first worker was released and parked; the dispatcher needs 2 next
        publish(0, 2, {pods[0]: True, pods[1]: False, pods[2]: False})
        shrunk = wait_until(
            lambda: g if (g := worker_group())["replicas"] == 2 else None,
            timeout=60,
            what="worker group shrunk to 2",
        )
        assert shrunk["scaleStrategy"]["workersToDelete"] == [pods[0]], shrunk
        decided = wait_until(lambda: scale_for(1), timeout=30, what="decision for step 1")
        assert decided["reason"] == "ShrinkBetweenSteps" and decided["target"] == 2, decided
        assert decided["workersToDelete"] == [pods[0]], decided
        # step 1: KubeRay deleted pods[0]; 1 worker next, but no released pod is known
        publish(1, 1, {pods[1]: False, pods[2]: False})
        refused = wait_until(lambda: scale_for(2), timeout=30, what="decision for step 2")
        assert refused["reason"] == "WorkersUnknown", refused
        assert "1 released worker pod needed, 0 known" in refused["message"], refused
        assert refused["target"] == refused["current"] == 2, refused
        assert worker_group()["replicas"] == 2
        events = get_json(dev_cluster, "events", "-n", namespace)["items"]
        assert any(
            e.get("reason") == "WorkersUnknown" and e.get("type") == "Warning" for e in events
        ), [e.get("reason") for e in events]
        # step 2: 3 workers again: replicas up, the deleted pod's entry cleared
        publish(2, 3, {pods[1]: False, pods[2]: False})
        grown = wait_until(
            lambda: g if (g := worker_group())["replicas"] == 3 else None,
            timeout=30,
            what="worker group grown to 3",
        )
        assert grown["scaleStrategy"]["workersToDelete"] == [], grown
        assert (
            wait_until(lambda: scale_for(3), timeout=30, what="decision for step 3")["reason"]
            == "GrowBetweenSteps"
        )
