"""A trainer pod under Pod Security ``restricted`` on the real node, governed over TLS.

The whole dev cluster of this module runs in a network namespace the test makes
(``rlenergy_dev.devcluster.netns.private_network``: the pytest thread moves into a new namespace
before the cluster starts, so the API server, etcd, containerd, the kubelet, helm and kubectl
all run there, and back at the end). In it the real node has a pod network
(``DevCluster.start(pod_network=...)``): a Linux bridge ``rle0`` whose gateway 10.88.0.1 is the
node's IP, Debian's CNI ``bridge`` and ``host-local`` plugins giving pods that are not
``hostNetwork`` an address on it. So a pod in its own network namespace reaches the node's IP,
as on a cluster, while nothing leaves the test's namespace. Images, stand-in GPUs, CDI spec and
device plugin are set up as in tests/e2e/test_runbook.py; the chart is installed with the
webhook on (its default) and the agent's TLS port at its default 9403.

The trainer pod is written as docs/verl.md ("The trainer pod: one label") shows: the policy's
labels and ``rlenergy.io/inject: "true"``, the ``restricted`` security context, nothing
rlenergy-specific. It runs ``rlenergy_dev.podtrainer`` (verl 0.9.1's v1 trainer under
``verl_hook.install``, as tests/e2e/test_real_node.py) in the agent image as its non-root user;
the pinned verl and torch, the checkout's ``dev/`` package and the work log the host's physics
reads come from persistent volumes an administrator made (``local`` volumes, claimed in the
namespace), since ``restricted`` forbids hostPath volumes in the pod. We test these aspects:

* the pod is admitted in a namespace labelled ``pod-security.kubernetes.io/enforce:
  restricted``, with the projected token and CA bundle volume and the agent environment
  injected by the operator's webhook (called by the API server through its Service), no
  hostPath, no host network; its IP is on the bridge and its ``status.hostIP`` the node's;
* with no agent socket in the pod, its signals reach the agent only over TLS at
  ``status.hostIP:9403``: its GPUs' clocks are locked per phase (generation and training at
  different clocks, no other GPU locked) and the policy status counts the steps and accounts
  the saving of each phase (its sign after 20 steps on a loaded machine is a figure, see
  ``_governed``);
* admission of that pod through the webhook (server-side dry runs, each answer injected) and
  without it (no opt-in label): p50 and p99, the webhook's under its 5 s timeout;
* with the operator scaled to zero, the same pod is admitted at once, unchanged, and runs
  ungoverned (no lock on its GPUs); the operator, back, warns on the policy (``PodNotInjected``).

Figures (wall times, admission latency, admission time with the operator down) are printed and written to
``build/restricted-e2e.json``.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import (
    CHART,
    IMAGE_REPO,
    IMAGES,
    RELEASE,
    ROOT,
    SAMPLE,
    SYSTEM_NS,
    TAG,
    VERL_SITE,
    get_json,
    gpu_locks,
    pod_ready,
    pods_of,
    real_node_cluster,
    real_node_values,
    start_nvidia_device_plugin,
    wait_until,
    webhook_explained,
)
from rlenergy_dev import fullstack, podtrainer, standin
from rlenergy_dev.devcluster import DevCluster, netns
from rlenergy_dev.devcluster.nvidiaplugin import NvidiaDevicePlugin
from rlenergy_dev.devcluster.realnode import PodNetwork, RealNode

from rlenergy.gpu import models

NS = "team-a"
GPUS = 8
STEPS = 20
"""Replayed steps before the status is read (at 12, the generation phase may still be on its
first trials, near the default clock; the saving is then noise)."""
TLS_PORT = 9403
"""The chart's default ``agent.tlsPort``."""
NONROOT_UID = 65532
"""The images' non-root user ``rlenergy`` (hack/images/build.py)."""
NET = PodNetwork(bridge="rle0", subnet="10.88.0.0/24", gateway="10.88.0.1")
RESULTS = ROOT / "build" / "restricted-e2e.json"
ADMISSIONS = 100
"""Dry-run admissions timed with and without the webhook (p99 of 100: the second highest)."""
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""The container security context docs/verl.md shows (Pod Security ``restricted``)."""

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[DevCluster]:
    host = netns.current_namespace()
    with netns.private_network(NET) as own:
        assert own != host
        with real_node_cluster("the restricted trainer e2e test", pod_network=NET) as c:
            for rec in c.processes:  # every component runs in the test's namespace
                assert netns.namespace_of(rec.pid) == own, rec
            yield c
    assert netns.current_namespace() == host


def _volume(name: str, path: Path, node: str, *, read_only: bool) -> list[dict[str, Any]]:
    """A ``local`` PersistentVolume of ``path`` on ``node`` and the claim in ``NS`` bound to it:
    what an administrator hands a namespace where pods may not mount host folders."""
    mode = "ReadOnlyMany" if read_only else "ReadWriteOnce"
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{NS}-{name}"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": [mode],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "local": {"path": str(path)},
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "kubernetes.io/hostname",
                                        "operator": "In",
                                        "values": [node],
                                    }
                                ]
                            }
                        ]
                    }
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "accessModes": [mode],
                "storageClassName": "",
                "volumeName": f"{NS}-{name}",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]


def _trainer_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """The trainer pod as docs/verl.md writes it (labels, the restricted security context),
    with this test's trainer: the agent image running ``podtrainer`` as its non-root user."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {**labels, "rlenergy.io/inject": "true"},
        },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            # the agent image's user is root; the trainer runs as its non-root user
            "securityContext": {"runAsUser": NONROOT_UID, "runAsGroup": NONROOT_UID},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "containers": [
                {
                    "name": "trainer",
                    "image": f"{IMAGE_REPO}/rl-energy-agent:{TAG}",
                    "imagePullPolicy": "Never",
                    "command": [
                        "python3",
                        "-m",
                        "rlenergy_dev.podtrainer",
                        "--replay",
                        "/etc/rlenergy-replay/replay.json",
                        "--work-file",
                        "/var/run/rlenergy-work/work.jsonl",
                        "--loop",
                    ],  # fmt: skip
                    "env": [
                        {
                            "name": "PYTHONPATH",
                            "value": "/opt/verl/site-packages:/opt/rlenergy-dev",
                        },
                        {"name": "RLENERGY_ENGINE_DIR", "value": "/var/run/rlenergy-engines"},
                        {"name": "HOME", "value": "/var/run/rlenergy-engines"},
                    ],
                    "resources": {"limits": {"nvidia.com/gpu": "2"}},
                    "securityContext": RESTRICTED,
                    "volumeMounts": [
                        {"name": "replay", "mountPath": "/etc/rlenergy-replay"},
                        {"name": "work", "mountPath": "/var/run/rlenergy-work"},
                        {"name": "engines", "mountPath": "/var/run/rlenergy-engines"},
                        {"name": "verl", "mountPath": "/opt/verl/site-packages", "readOnly": True},
                        {"name": "dev", "mountPath": "/opt/rlenergy-dev", "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "replay", "configMap": {"name": "trainer-replay"}},
                {"name": "work", "persistentVolumeClaim": {"claimName": "work"}},
                {"name": "engines", "emptyDir": {}},
                {"name": "verl", "persistentVolumeClaim": {"claimName": "verl", "readOnly": True}},
                {"name": "dev", "persistentVolumeClaim": {"claimName": "dev", "readOnly": True}},
            ],
        },
    }


def test_restricted_trainer_pod(cluster: DevCluster) -> None:
    t_start = time.monotonic()
    figures: dict[str, Any] = {"cluster_start_s": cluster.timings}
    node = cluster.real_node
    assert node is not None
    if not VERL_SITE.is_dir():
        pytest.fail(f"{VERL_SITE} missing: build it with `make venv-verl`", pytrace=False)
    for name in ("rl-energy-operator", "rl-energy-agent"):
        archive = IMAGES / f"{name}.oci.tar"
        if not archive.is_file():
            pytest.fail(f"{archive} missing: build the images with `make images`", pytrace=False)
        node.import_image(archive)
    # A folder the trainer's non-root user can reach (pytest's tmp_path is root's only): the
    # work log it writes, the stand-in's state its NVML maps read-write.
    work = Path(tempfile.mkdtemp(prefix="rlenergy-restricted-"))
    work.chmod(0o755)
    (work / "trainer-work").mkdir(mode=0o777)
    (work / "trainer-work").chmod(0o777)
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    state = work / "nvml" / "nvml.state"
    state.parent.mkdir()
    state.parent.chmod(0o777)
    uuids = [f"GPU-restricted-{i:02d}" for i in range(GPUS)]
    driver = standin.StandinDriver(state, [(u, models.get_sku("h100-sxm")) for u in uuids])
    state.chmod(0o666)
    node.write_cdi_spec(lib_dir / "libnvidia-ml.so.1", state, uuids)
    plugin = start_nvidia_device_plugin(node, driver, lib_dir)  # CDI names only (cdi-cri)
    trainer_gpus: list[tuple[str, ...]] = []
    feed = podtrainer.WorkFeed(
        driver,
        work / "trainer-work" / "work.jsonl",
        lambda: trainer_gpus[-1] if trainer_gpus else (),
    ).start()
    try:
        wait_until(
            lambda: (
                get_json(cluster, "node", node.name)["status"]["allocatable"].get("nvidia.com/gpu")
                == str(GPUS)
            ),
            timeout=60,
            what="nvidia.com/gpu allocatable on the real node",
        )
        _day(cluster, node, driver, plugin, feed, trainer_gpus, work, figures)
    finally:
        figures["wall_s"] = round(time.monotonic() - t_start, 1)
        feed.stop()
        plugin.stop()
        driver.close()
        shutil.rmtree(work, ignore_errors=True)
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(figures, indent=2, default=str))
        print(json.dumps(figures, indent=2, default=str))


def _install(c: DevCluster, node: RealNode, work: Path, figures: dict[str, Any]) -> None:
    vfile = work / "values.json"
    vfile.write_text(json.dumps(real_node_values(c, node, work)))
    t0 = time.monotonic()
    c.helm(
        "install", RELEASE, str(CHART), "-n", SYSTEM_NS, "--create-namespace",
        "-f", str(vfile), "--wait", "--timeout", "300s", timeout=360,
    )  # fmt: skip
    op = wait_until(
        lambda: [
            p for p in pods_of(c, SYSTEM_NS, "app.kubernetes.io/component=operator") if pod_ready(p)
        ],
        timeout=180,
        what="operator pod Ready",
    )[0]
    assert op["status"]["podIP"] == NET.gateway, op["status"]  # hostNetwork: the node's IP
    figures["helm_install_to_operator_ready_s"] = round(time.monotonic() - t0, 1)


def _day(
    c: DevCluster,
    node: RealNode,
    driver: standin.StandinDriver,
    plugin: NvidiaDevicePlugin,
    feed: podtrainer.WorkFeed,
    trainer_gpus: list[tuple[str, ...]],
    work: Path,
    figures: dict[str, Any],
) -> None:
    _install(c, node, work, figures)
    c.kubectl("create", "namespace", NS)
    c.kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=restricted")
    policy = yaml.safe_load(SAMPLE.read_text())
    policy["spec"]["controller"] = {"warmupSteps": 2, "trialSteps": 4, "maxTrialFraction": 1.0}
    pname = policy["metadata"]["name"]
    labels = dict(policy["spec"]["selector"]["matchLabels"])
    c.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(policy))
    t0 = time.monotonic()
    wait_until(
        lambda: [
            p for p in pods_of(c, SYSTEM_NS, "app.kubernetes.io/name=rlenergy-node-agent")
            if pod_ready(p)
        ],
        timeout=240, what="agent pod Ready on the real node",
    )  # fmt: skip
    figures["policy_to_agent_ready_s"] = round(time.monotonic() - t0, 1)
    # The CA bundle the injected volume projects, written by the operator into the namespace.
    wait_until(
        lambda: c.kubectl("get", "configmap", "rlenergy-agent-ca", "-n", NS, check=False)
        .returncode == 0,
        timeout=120, what="ConfigMap rlenergy-agent-ca in the trainer namespace",
    )  # fmt: skip

    job, _ = fullstack.compressed_replay(
        fullstack.DEFAULT_TRACE, models.get_sku("h100-sxm"), STEPS, num_gpus=2,
        longest_phase_s=1.5,
    )  # fmt: skip
    replay = podtrainer.replay_document(job, models.get_sku("h100-sxm"))
    (work / "replay.json").write_text(json.dumps(replay))
    c.kubectl(
        "create", "configmap", "trainer-replay", "-n", NS,
        f"--from-file=replay.json={work / 'replay.json'}",
    )  # fmt: skip
    manifests = [
        *_volume("verl", VERL_SITE.resolve(), node.name, read_only=True),
        *_volume("dev", (ROOT / "dev").resolve(), node.name, read_only=True),
        *_volume("work", work / "trainer-work", node.name, read_only=False),
    ]
    c.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}),
    )

    # The pod as the docs write it: admitted under restricted, injected by the webhook. The
    # webhook answers through the chart's Service once the endpoints controller has published
    # the operator pod's address, which can trail the pod's Ready by seconds on a loaded
    # machine; until then the API server admits the pod uninjected (failurePolicy Ignore, the
    # case checked below with the operator at zero). A server-side dry run shows when it does.
    trainer_pod = json.dumps(_trainer_pod("trainer", labels))
    t0 = time.monotonic()
    wait_until(
        lambda: any(
            v["name"] == "rlenergy-agent"
            for v in json.loads(
                c.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", input=trainer_pod)
                .stdout
            )["spec"]["volumes"]
        ),
        timeout=120, what="the webhook injecting a dry-run of the trainer pod",
        explain=lambda: webhook_explained(c),
    )  # fmt: skip
    figures["webhook_injecting_wait_s"] = round(time.monotonic() - t0, 1)
    c.kubectl("apply", "-f", "-", input=trainer_pod)
    pod = get_json(c, "pod", "trainer", "-n", NS)
    spec = pod["spec"]
    assert not spec.get("hostNetwork"), spec
    assert not [v for v in spec["volumes"] if "hostPath" in v], spec["volumes"]
    injected = next((v for v in spec["volumes"] if v["name"] == "rlenergy-agent"), None)
    assert injected is not None, spec["volumes"]
    sources = injected["projected"]["sources"]
    assert any(
        s.get("serviceAccountToken", {}).get("audience") == "rlenergy-agent" for s in sources
    ), sources
    assert any(s.get("configMap", {}).get("name") == "rlenergy-agent-ca" for s in sources), sources
    mounts = [m["mountPath"] for m in spec["containers"][0]["volumeMounts"]]
    assert "/var/run/rlenergy" not in mounts, mounts  # no agent socket: TLS is the only way
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["RLENERGY_AGENT_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["RLENERGY_AGENT_PORT"]["value"] == str(TLS_PORT), env

    wait_until(lambda: plugin.allocations, timeout=120, what="the kubelet's Allocate call")
    trainer_gpus.append(plugin.allocations[-1])
    gpus = trainer_gpus[-1]
    running = wait_until(
        lambda: (p := get_json(c, "pod", "trainer", "-n", NS))["status"].get("podIP") and p,
        timeout=180, what="the trainer pod's IP",
    )  # fmt: skip
    st = running["status"]
    assert st["hostIP"] == NET.gateway, st
    pod_ip = ipaddress.ip_address(st["podIP"])
    assert pod_ip in ipaddress.ip_network(NET.subnet) and str(pod_ip) != NET.gateway, st
    figures["trainer_pod_ip"] = st["podIP"]
    _governed(c, driver, feed, gpus, pname, figures)
    t0 = time.monotonic()
    c.kubectl("delete", "pod", "trainer", "-n", NS, "--wait=false")
    wait_until(
        lambda: set(gpu_locks(driver, gpus).values()) == {None},
        timeout=30, interval=0.05, what="the deleted trainer's GPUs reset",
    )  # fmt: skip
    figures["trainer_delete_to_reset_s"] = round(time.monotonic() - t0, 2)
    _admission_latency(c, labels, figures)
    _operator_down(c, driver, plugin, trainer_gpus, labels, figures)


def _admission_latency(c: DevCluster, labels: dict[str, str], figures: dict[str, Any]) -> None:
    """Server-side dry-run creations of the trainer pod (Python client, one connection): with
    the opt-in label (the API server calls the webhook through its Service; every answer is
    injected, so none was admitted by ``failurePolicy: Ignore``) and without it (no call)."""
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(str(c.kubeconfig)))

    def admit_ms(opt_in: bool, n: int) -> list[float]:
        out = []
        for i in range(n):
            body = _trainer_pod(f"lat-{i}", labels)
            if not opt_in:
                del body["metadata"]["labels"]["rlenergy.io/inject"]
            t0 = time.perf_counter()
            pod = api.create_namespaced_pod(NS, body, dry_run="All")
            out.append((time.perf_counter() - t0) * 1e3)
            names = {v.name for v in pod.spec.volumes}
            assert ("rlenergy-agent" in names) is opt_in, names
        return out

    admit_ms(True, 5)  # warm the connection and the webhook's
    with_hook, without = admit_ms(True, ADMISSIONS), admit_ms(False, ADMISSIONS)

    def p99(v: list[float]) -> float:
        return sorted(v)[int(0.99 * (len(v) - 1))]

    figures["admission_ms"] = {
        "webhook_p50": round(statistics.median(with_hook), 1),
        "webhook_p99": round(p99(with_hook), 1),
        "no_webhook_p50": round(statistics.median(without), 1),
        "no_webhook_p99": round(p99(without), 1),
        "n": ADMISSIONS,
    }
    assert p99(with_hook) < 5000, figures  # under the webhook's timeoutSeconds


def _governed(
    c: DevCluster,
    driver: standin.StandinDriver,
    feed: podtrainer.WorkFeed,
    gpus: tuple[str, ...],
    pname: str,
    figures: dict[str, Any],
) -> None:
    """The trainer's GPUs locked per phase, only they; the steps and a saving in the status."""
    locks_by_kind: dict[str, collections.Counter[int | None]] = {}
    others = tuple(u for u in driver.uuids if u not in gpus)
    strays: list[dict[str, int | None]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            kind = feed.kind
            locks_by_kind.setdefault(kind, collections.Counter()).update(
                gpu_locks(driver, gpus).values()
            )
            if set((o := gpu_locks(driver, others)).values()) != {None}:
                strays.append(o)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:

        def all_steps() -> dict[str, Any] | None:
            phase = get_json(c, "pod", "trainer", "-n", NS)["status"].get("phase")
            assert phase in ("Pending", "Running"), (
                phase, c.kubectl("logs", "-n", NS, "trainer", check=False).stdout[-3000:]
            )  # fmt: skip
            s: dict[str, Any] = get_json(c, "rlep", pname, "-n", NS).get("status", {})
            return s if (s.get("totals", {}).get("throughStep") or -1) >= STEPS else None

        t0 = time.monotonic()
        status = wait_until(
            all_steps, timeout=STEPS * 10 + 300, interval=1, what=f"{STEPS} steps in the status"
        )
        figures["pod_to_status_steps_s"] = round(time.monotonic() - t0, 1)
    finally:
        stop.set()
        sampler.join()
    figures["locks_by_phase_kind_mhz"] = {k: dict(v) for k, v in locks_by_kind.items()}
    assert not strays, strays[:3]
    locked = {k: set(v) - {None} for k, v in locks_by_kind.items() if k != "idle"}
    assert locked.get("generation") and locked.get("training"), locks_by_kind
    assert locked["generation"] != locked["training"], locks_by_kind
    totals = figures["policy_totals"] = status["totals"]
    figures["policy_phases"] = status.get("phases")
    assert totals["savedJoules"] == pytest.approx(
        totals["predictedDefaultJoules"] - totals["comparedMeasuredJoules"], rel=1e-6
    ), totals
    assert totals["comparedMeasuredJoules"] > 0 and totals["validTokens"] > 0, totals
    savings = {p["name"]: p["saving"] for p in status["phases"]}
    figures["phase_saving"] = savings
    # The sign of a 20-step saving is not asserted: on this shared 2-core machine the pod's CPU
    # share moves a phase's time, and with it its energy, by more than the trials save (the
    # generation saving was +1.3 %, +1.9 % and -5.1 % in three runs with the same locks); the
    # locks above are what shows the pod governed, the long-run saving is `make bench-energy`'s.
    assert set(savings) == {"generation", "training"}, savings
    assert all(isinstance(v["joules"], float | int) for v in savings.values()), savings


def _operator_down(
    c: DevCluster,
    driver: standin.StandinDriver,
    plugin: NvidiaDevicePlugin,
    trainer_gpus: list[tuple[str, ...]],
    labels: dict[str, str],
    figures: dict[str, Any],
) -> None:
    """Operator at zero replicas: the same pod is admitted unchanged and runs ungoverned; the
    operator, back, warns on the policy."""
    op_selector = "app.kubernetes.io/component=operator"
    c.kubectl("scale", "deployment", "-n", SYSTEM_NS, "-l", op_selector, "--replicas=0")
    wait_until(lambda: not pods_of(c, SYSTEM_NS, op_selector), timeout=120, what="no operator pod")
    allocations = len(plugin.allocations)
    t0 = time.monotonic()
    c.kubectl("apply", "-f", "-", input=json.dumps(_trainer_pod("trainer-down", labels)))
    figures["admission_operator_down_s"] = round(time.monotonic() - t0, 2)
    spec = get_json(c, "pod", "trainer-down", "-n", NS)["spec"]
    assert "rlenergy-agent" not in {v["name"] for v in spec["volumes"]}, spec["volumes"]
    assert not [e for e in spec["containers"][0]["env"] if e["name"].startswith("RLENERGY_AGENT")]
    wait_until(
        lambda: get_json(c, "pod", "trainer-down", "-n", NS)["status"].get("phase") == "Running",
        timeout=180, what="the pod admitted with the operator down Running",
    )  # fmt: skip
    wait_until(lambda: len(plugin.allocations) > allocations, timeout=60, what="its Allocate")
    trainer_gpus.append(plugin.allocations[-1])
    gpus = trainer_gpus[-1]
    # Ungoverned: its GPUs stay at the default governor while it runs.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert set(gpu_locks(driver, gpus).values()) == {None}, gpu_locks(driver, gpus)
        assert get_json(c, "pod", "trainer-down", "-n", NS)["status"]["phase"] == "Running"
        time.sleep(1)
    t0 = time.monotonic()
    c.kubectl("scale", "deployment", "-n", SYSTEM_NS, "-l", op_selector, "--replicas=1")

    def warned() -> bool:
        events = get_json(c, "events", "-n", NS, "--field-selector", "reason=PodNotInjected")
        return any("trainer-down" in e.get("message", "") for e in events["items"])

    wait_until(warned, timeout=180, what="a PodNotInjected warning on the policy")
    figures["operator_up_to_warning_s"] = round(time.monotonic() - t0, 1)
    assert set(gpu_locks(driver, gpus).values()) == {None}
    c.kubectl("delete", "pod", "trainer-down", "-n", NS, "--wait=false")
