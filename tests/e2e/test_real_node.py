"""A user's day on a real node: the chart with the real images, pods in real containers.

The dev cluster runs with its real node (``DevCluster.start(real_node=True)``: containerd 2.4
with CDI, runc the default runtime and NVIDIA Container Toolkit's ``nvidia-container-runtime``
in CDI mode as the runtime handler ``nvidia``, a kubelet built from k8s v1.36.3, no KWOK node),
as NVIDIA's GPU Operator (>= v25.10) leaves a node. The project's operator and agent images
(``make images``) and the chart are pushed to the cluster's registry (``registry=True``:
Distribution on 127.0.0.1, containerd's mirror of ``ghcr.io``); the chart is installed with
``helm install oci://...`` and the kubelet pulls the chart's default image names through it. Eight stand-in GPUs (the stand-in
``libnvidia-ml.so.1`` over a state file the test's ``StandinDriver`` owns) get a CDI spec
(``RealNode.write_cdi_spec``: kinds ``nvidia.com/gpu`` and ``k8s.device-plugin.nvidia.com/gpu``,
one device per UUID and ``all``) and are advertised as ``nvidia.com/gpu`` by NVIDIA's
k8s-device-plugin v0.17.4 (``RealNode.start_device_plugin``: a host process over the stand-in
NVML) with their UUIDs as device IDs, so the kubelet allocates them and its PodResources API
reports them; its ``Allocate`` answers with CDI device names only (``cdi-cri``), so containerd's
CDI injection is the only way NVML reaches a pod.

The user's steps, in order: ``helm install`` the chart (hostNetwork, the API server at
127.0.0.1, the agent under the chart's default RuntimeClass ``nvidia``: its NVML comes only from
the toolkit's CDI injection of ``nvidia.com/gpu=all``, no hostPath of the library) -> operator
pod Ready -> apply a policy -> the operator's agent DaemonSet runs its pod on the real node
under that runtime class -> a trainer pod (``nvidia.com/gpu: 2``, the agent image running
``rlenergy_dev.podtrainer``, mounted from the checkout's ``dev/`` as the image ships no dev
tooling, with the pinned verl and torch mounted from
``.venv-verl``: verl 0.9.1's real worker and driver methods under ``verl_hook.install``, its
default v1 trainer over real TransferQueue on a local Ray in the pod,
replaying a verl trace time-compressed, with the projected service-account token for the
agent) -> each step's ``rlenergy/*`` keys in verl's metrics dict (``_check_verl_metrics``) ->
its GPUs' clocks change per phase (read from
the stand-in's state) at the clocks the plans named for each phase (``_check_planned_locks``)
and the policy status shows the generation phase's saving (the job's total is printed: at step
12 training is still trying clocks near the default); a phase the controller locked keeps its
minThroughputRatio at that clock in the replay's truth (``_check_locked_throughput``, which says
why the whole-run ratio of 12 steps is not held to it) -> a second pod's signals naming the
first pod's GPUs are refused (403) -> the agent pod is deleted and recreated by the DaemonSet
(its GPUs are reset when the agent stops) -> the trainer pod is deleted (its GPUs back to the
default governor within 10 s) -> the policy is deleted and the chart uninstalled: no lock, no
finalizer left. Measured figures (among them the agent's VmRSS idle and governing and its CPU
seconds per second idle and over the replay, recorded, not asserted: their targets live in
``make bench-agent``) are printed and written to ``build/realnode-e2e.json``.
"""

from __future__ import annotations

import collections
import json
import os
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
    ObjectVersions,
    get_json,
    gpu_locks,
    pod_ready,
    pods_of,
    real_node_cluster,
    real_node_values,
    start_nvidia_device_plugin,
    wait_until,
)
from rlenergy_agent.actuator import snap_clock_mhz
from rlenergy_agent.kube import report_name
from rlenergy_dev import fullstack, podtrainer, standin
from rlenergy_dev.devcluster import DevCluster
from rlenergy_dev.devcluster.nvidiaplugin import NvidiaDevicePlugin
from rlenergy_dev.devcluster.realnode import RealNode

from rlenergy.control.freq.eerl import INDIFFERENCE
from rlenergy.gpu import models

DEV_DIR = ROOT / "dev"
"""The folder that holds ``rlenergy_dev`` (the trainer pod's ``podtrainer``)."""
GPUS = 8
STEPS = 12
LONGEST_PHASE_S = 1.5
RESET_BOUND_S = 10.0
CPU_WINDOW_S = 10.0
"""How long the idle agent's CPU is read (its governing CPU is read over the whole replay)."""
"""docs/agent.md: a governed pod's GPUs are back at the default governor within 10 s of its end."""
RESULTS = ROOT / "build" / "realnode-e2e.json"
FAILURE_DIR = ROOT / "build" / "realnode-e2e-failure"
"""Where a failed planned-locks check leaves the node report and the agent's log."""

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[DevCluster]:
    with real_node_cluster("the real-node e2e test", registry=True) as c:
        yield c


def _node(c: DevCluster) -> RealNode:
    assert c.real_node is not None
    return c.real_node


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def _pod_rss_kib(pod_uid: str) -> dict[str, int]:
    """Memory (KiB) of a pod's containers (not its pause process): each process's VmRSS and the
    container cgroup's charged rss + page cache (what its memory limit counts), found through
    the kubelet's cgroupfs layout (``kubepods/<qos>/pod<uid>/<id>``)."""
    out: dict[str, int] = {}
    for procs in Path("/sys/fs/cgroup/memory").glob(f"kubepods*/**/pod{pod_uid}/*/cgroup.procs"):
        for pid in procs.read_text().split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if argv[0] == b"/pause":
                continue
            rss = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:"))
            out[f"VmRSS {pid} {b' '.join(argv[:3]).decode()}"] = rss
            stat = dict(
                ln.split() for ln in (procs.parent / "memory.stat").read_text().splitlines()
            )
            out[f"cgroup rss+cache {procs.parent.name[:12]}"] = (
                int(stat["rss"]) + int(stat["cache"])
            ) // 1024
    return out


def _pod_cpu_s(pod_uid: str) -> float:
    """CPU seconds (user + system, ``/proc/<pid>/stat``) the processes of a pod's containers
    (not its pause process) have used, found as in ``_pod_rss_kib``."""
    ticks = 0
    for procs in Path("/sys/fs/cgroup/memory").glob(f"kubepods*/**/pod{pod_uid}/*/cgroup.procs"):
        for pid in procs.read_text().split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if argv[0] != b"/pause":
                ticks += int(stat[11]) + int(stat[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _trainer_pod(
    name: str,
    ns: str,
    labels: dict[str, str],
    socket_dir: Path,
    work: Path,
    command: list[str],
    gpus: int,
    *,
    verl: bool = False,
) -> dict[str, Any]:
    """A pod of the agent image; with ``verl``, the pinned verl and torch (``VERL_SITE``,
    read-only) and the checkout's dev package (``DEV_DIR``, read-only: the image ships no dev
    tooling) on its ``PYTHONPATH`` and a pod-wide folder for its rollout servers."""
    resources = {"limits": {"nvidia.com/gpu": gpus}} if gpus else {}
    mounts, volumes, env = [], [], []
    if verl:
        if not VERL_SITE.is_dir():
            pytest.fail(f"{VERL_SITE} missing: build it with `make venv-verl`", pytrace=False)
        mounts = [
            {"name": "verl-site", "mountPath": "/opt/verl/site-packages", "readOnly": True},
            {"name": "rlenergy-dev", "mountPath": "/opt/rlenergy-dev", "readOnly": True},
            {"name": "engines", "mountPath": "/var/run/rlenergy-engines"},
        ]
        volumes = [
            {"name": "verl-site", "hostPath": {"path": str(VERL_SITE), "type": "Directory"}},
            {"name": "rlenergy-dev", "hostPath": {"path": str(DEV_DIR), "type": "Directory"}},
            {"name": "engines", "emptyDir": {}},
        ]
        env = [
            {"name": "PYTHONPATH", "value": "/opt/verl/site-packages:/opt/rlenergy-dev"},
            {"name": "RLENERGY_ENGINE_DIR", "value": "/var/run/rlenergy-engines"},
            {"name": "HOME", "value": "/var/run/rlenergy-engines"},
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "hostNetwork": True,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "containers": [
                {
                    "name": "trainer",
                    "image": f"{IMAGE_REPO}/rl-energy-agent:{TAG}",
                    "imagePullPolicy": "Never",
                    "command": command,
                    "env": env,
                    "resources": resources,
                    "volumeMounts": [
                        # read-only: the chart's socket-read-only policy refuses a writable one
                        {
                            "name": "agent-socket",
                            "mountPath": "/var/run/rlenergy",
                            "readOnly": True,
                        },
                        {"name": "replay", "mountPath": "/etc/rlenergy-replay"},
                        {"name": "work", "mountPath": "/var/run/rlenergy-work"},
                        {
                            "name": "rlenergy-token",
                            "mountPath": "/var/run/secrets/rlenergy",
                            "readOnly": True,
                        },
                        *mounts,
                    ],
                }
            ],
            "volumes": [
                {
                    "name": "agent-socket",
                    "hostPath": {"path": str(socket_dir), "type": "DirectoryOrCreate"},
                },
                {"name": "replay", "configMap": {"name": "trainer-replay"}},
                {"name": "work", "hostPath": {"path": str(work), "type": "DirectoryOrCreate"}},
                {
                    "name": "rlenergy-token",
                    "projected": {
                        "sources": [
                            {
                                "serviceAccountToken": {
                                    "audience": "rlenergy-agent",
                                    "expirationSeconds": 3600,
                                    "path": "token",
                                }
                            }
                        ]
                    },
                },
                *volumes,
            ],
        },
    }


def test_real_node_user_day(cluster: DevCluster, tmp_path: Path) -> None:
    figures: dict[str, Any] = {"cluster_start_s": cluster.timings}
    node = _node(cluster)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("rl-energy-operator", "rl-energy-agent"):
        archive = IMAGES / f"{name}.oci.tar"
        if not archive.is_file():
            pytest.fail(f"{archive} missing: build the images with `make images`", pytrace=False)
        t0 = time.monotonic()
        assert cluster.registry is not None  # ghcr.io's mirror: the kubelet pulls from it
        cluster.registry.push_image(archive, name, TAG)
        figures[f"push_{name}_s"] = round(time.monotonic() - t0, 2)
    assert not {
        f"{IMAGE_REPO}/rl-energy-operator:{TAG}",
        f"{IMAGE_REPO}/rl-energy-agent:{TAG}",
    } & set(node.images()), node.images()

    # Stand-in GPUs, their physics and the device plugin.
    lib_dir = standin.build_library(ROOT / "build" / "nvml-standin")
    sku = models.get_sku("h100-sxm")
    state = work / "nvml" / "nvml.state"
    state.parent.mkdir()
    uuids = [f"GPU-realnode-{i:02d}" for i in range(GPUS)]
    driver = standin.StandinDriver(state, [(u, sku) for u in uuids])
    # The stand-in GPUs' CDI spec, read by the toolkit's runtime (handler `nvidia`).
    node.write_cdi_spec(lib_dir / "libnvidia-ml.so.1", state, uuids)
    # NVIDIA's device plugin: Allocate answers with CDI device names only (cdi-cri): containerd
    # applies the spec's edits, so the trainer gets the library, the state and its GPUs by CDI.
    plugin = start_nvidia_device_plugin(node, driver, lib_dir)
    trainer_gpus: list[tuple[str, ...]] = []
    feed = podtrainer.WorkFeed(
        driver,
        work / "trainer-work" / "work.jsonl",
        lambda: trainer_gpus[0] if trainer_gpus else (),
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
        _user_day(cluster, node, driver, plugin, feed, trainer_gpus, work, figures)
    finally:
        feed.stop()
        plugin.stop()
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(figures, indent=2, default=str))
        print(json.dumps(figures, indent=2, default=str))
        print(_summary(figures))
        driver.close()


def _user_day(
    c: DevCluster,
    node: RealNode,
    driver: standin.StandinDriver,
    plugin: NvidiaDevicePlugin,
    feed: podtrainer.WorkFeed,
    trainer_gpus: list[tuple[str, ...]],
    work: Path,
    figures: dict[str, Any],
) -> None:
    values = real_node_values(c, node, work)
    vfile = work / "values.json"
    vfile.write_text(json.dumps(values))
    assert c.registry is not None
    chart, version = c.registry.push_chart(CHART)  # a published chart: helm install oci://...
    t0 = time.monotonic()
    c.helm(
        "install",
        RELEASE,
        chart,
        "--version",
        version,
        "--plain-http",
        "-n",
        SYSTEM_NS,
        "--create-namespace",
        "-f",
        str(vfile),
        "--wait",
        "--timeout",
        "180s",
        timeout=240,
    )
    pulled = c.registry.manifest_gets()  # containerd pulled the default ghcr.io names from it
    assert any(
        "/rl-energy/rl-energy-operator/manifests/" in p and a.startswith("containerd/")
        for p, a in pulled
    ), pulled
    op = wait_until(
        lambda: [
            p for p in pods_of(c, SYSTEM_NS, "app.kubernetes.io/component=operator") if pod_ready(p)
        ],
        timeout=120,
        what="operator pod Ready",
    )[0]
    assert op["spec"]["nodeName"] == node.name
    assert op["status"]["podIP"] == "127.0.0.1", op["status"]  # hostNetwork on the loopback node
    figures["helm_install_to_operator_ready_s"] = round(time.monotonic() - t0, 1)

    # The user's policy; the operator creates the agent DaemonSet, whose pod runs on the node.
    ns = "team-a"
    c.kubectl("create", "namespace", ns)
    policy = yaml.safe_load(SAMPLE.read_text())
    # A 12-step day: trials may run every step (by default they take at most a quarter of the
    # run, so the controller is still trying clocks at step 12 and the saving is noise).
    policy["spec"]["controller"] = {"warmupSteps": 2, "trialSteps": 4, "maxTrialFraction": 1.0}
    pname = policy["metadata"]["name"]
    labels = dict(policy["spec"]["selector"]["matchLabels"])
    c.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(policy))
    t0 = time.monotonic()
    agent = wait_until(
        lambda: [
            p
            for p in pods_of(c, SYSTEM_NS, "app.kubernetes.io/name=rlenergy-node-agent")
            if pod_ready(p)
        ],
        timeout=180,
        what="agent pod Running and Ready on the real node",
    )[0]
    assert agent["spec"]["nodeName"] == node.name
    figures["policy_to_agent_ready_s"] = round(time.monotonic() - t0, 1)
    # NVML reached the agent only through the toolkit: the chart's default runtime class, no
    # volume of the driver library or its state, no library path of ours in its env.
    assert agent["spec"].get("runtimeClassName") == "nvidia", agent["spec"]
    host_paths = [v["hostPath"]["path"] for v in agent["spec"]["volumes"] if "hostPath" in v]
    assert not [h for h in host_paths if "nvml" in h], host_paths
    env = {e["name"] for c in agent["spec"]["containers"] for e in c.get("env", [])}
    assert not env & {"LD_LIBRARY_PATH", standin.STATE_ENV}, env
    figures["toolkit_log_tail"] = (
        (node.base / "toolkit" / "nvidia-container-runtime.log").read_text().splitlines()[-4:]
    )
    figures["agent_rss_kib_idle"] = _pod_rss_kib(agent["metadata"]["uid"])
    assert figures["agent_rss_kib_idle"], "no agent process found in the pod's cgroup"
    cpu0, t_cpu = _pod_cpu_s(agent["metadata"]["uid"]), time.monotonic()
    time.sleep(CPU_WINDOW_S)  # the agent idle: no GPU pod on the node yet
    figures["agent_cpu_s_per_s_idle"] = round(
        (_pod_cpu_s(agent["metadata"]["uid"]) - cpu0) / (time.monotonic() - t_cpu), 4
    )

    # The trainer pod: 2 GPUs, the SDK replaying the trace through the agent's socket.
    job, factor = fullstack.compressed_replay(
        fullstack.DEFAULT_TRACE,
        models.get_sku("h100-sxm"),
        STEPS,
        num_gpus=2,
        longest_phase_s=LONGEST_PHASE_S,
    )
    figures["time_compression"] = round(factor, 1)
    replay = podtrainer.replay_document(job, models.get_sku("h100-sxm"))
    (work / "replay.json").write_text(json.dumps(replay))
    c.kubectl(
        "create", "configmap", "trainer-replay", "-n", ns,
        f"--from-file=replay.json={work / 'replay.json'}",
    )  # fmt: skip
    socket_dir = Path(values["agent"]["socketDir"])
    pod = _trainer_pod(
        "trainer",
        ns,
        labels,
        socket_dir,
        work / "trainer-work",
        [
            "python3",
            "-m",
            "rlenergy_dev.podtrainer",
            "--replay",
            "/etc/rlenergy-replay/replay.json",
            "--work-file",
            "/var/run/rlenergy-work/work.jsonl",
            "--loop",
        ],
        gpus=2,
        verl=True,
    )
    # Every version of the node's report, as the API server stored it: a report holds only the
    # step records the operator has not folded yet, so a poll can miss a record.
    report_versions = ObjectVersions(
        c, "rlenergy.io", "v1alpha1", "rlenergynodereports", ns, report_name(pname, node.name)
    ).start()
    c.kubectl("apply", "-f", "-", input=json.dumps(pod))
    wait_until(lambda: plugin.allocations, timeout=60, what="the kubelet's Allocate call")
    trainer_gpus.append(plugin.allocations[-1])
    gpus = trainer_gpus[0]
    assert len(gpus) == 2 and set(gpus) <= set(driver.uuids), gpus

    # Its GPUs' clocks change per phase; the other GPUs stay at the default governor.
    locks_by_kind: dict[str, set[int | None]] = {}
    samples_by_kind: dict[str, collections.Counter[int | None]] = {}
    others = tuple(u for u in driver.uuids if u not in gpus)
    strays: list[dict[str, int | None]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.01):
            kind = feed.kind
            locks = gpu_locks(driver, gpus)
            locks_by_kind.setdefault(kind, set()).update(locks.values())
            samples_by_kind.setdefault(kind, collections.Counter()).update(locks.values())
            if set((o := gpu_locks(driver, others)).values()) != {None}:
                strays.append(o)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:

        def not_failed() -> None:
            phase = get_json(c, "pod", "trainer", "-n", ns)["status"].get("phase")
            assert phase in ("Pending", "Running"), (
                phase, c.kubectl("logs", "-n", ns, "trainer", check=False).stdout[-3000:]
            )  # fmt: skip

        def all_steps() -> dict[str, Any] | None:
            not_failed()
            s: dict[str, Any] = get_json(c, "rlep", pname, "-n", ns).get("status", {})
            return s if (s.get("totals", {}).get("throughStep") or -1) >= STEPS else None

        t0, cpu0 = time.monotonic(), _pod_cpu_s(agent["metadata"]["uid"])
        status = wait_until(
            all_steps,
            timeout=STEPS * 10 + 180,  # the v1 trainer starts its Ray and TransferQueue first
            interval=1,
            what=f"{STEPS} steps in the policy status",
        )
        figures["replay_to_status_s"] = round(time.monotonic() - t0, 1)
        figures["agent_cpu_s_per_s_governing"] = round(
            (_pod_cpu_s(agent["metadata"]["uid"]) - cpu0) / (time.monotonic() - t0), 4
        )
        sampling.set()
        published = {  # the node's step records, as they came
            int(r["step"]): r
            for version in report_versions.stop()
            for r in version["spec"].get("steps") or ()
        }
        assert published and not report_versions.errors, report_versions.errors
        figures["locks_by_phase_kind_mhz"] = {
            k: sorted(v, key=str) for k, v in locks_by_kind.items()
        }
        assert not strays, strays[:3]
        phase_locks = {k: v - {None} for k, v in locks_by_kind.items() if k != "idle"}
        assert phase_locks.get("generation") and phase_locks.get("training"), locks_by_kind
        assert phase_locks["generation"] != phase_locks["training"], locks_by_kind
        figures["policy_totals"] = status["totals"]
        figures["policy_phases"] = status.get("phases")
        totals = status["totals"]
        assert totals["savedJoules"] == pytest.approx(
            totals["predictedDefaultJoules"] - totals["comparedMeasuredJoules"], rel=1e-6
        ), totals
        # Generation (memory bound) saves from its first trial clocks on; training (compute
        # bound) is still trying clocks near the default at step 12, where a trial's slowdown
        # can cost as much as it saves, so the job's total is a figure, not an assertion.
        generation = next(p for p in status["phases"] if p["name"] == "generation")
        assert generation["saving"]["percent"] > 0, generation
        assert generation["saving"]["joules"] > 0, generation
        try:
            _check_planned_locks(c, ns, pname, node.name, published, samples_by_kind, figures)
        except AssertionError:  # keep what tells why: the whole report and the agent's log
            FAILURE_DIR.mkdir(parents=True, exist_ok=True)
            report = get_json(c, "rlenergynodereports", report_name(pname, node.name), "-n", ns)
            (FAILURE_DIR / "report.json").write_text(json.dumps(report, indent=1))
            log = c.kubectl("logs", "-n", SYSTEM_NS, agent["metadata"]["name"], check=False)
            (FAILURE_DIR / "agent.log").write_text(log.stdout + log.stderr)
            raise
        _check_locked_throughput(status, replay, figures)
        _check_verl_metrics(c.kubectl("logs", "-n", ns, "trainer").stdout, replay, figures)

        # A second pod signals for the first pod's GPUs: refused (403), the clocks are not its own.
        intruder = _trainer_pod(
            "intruder", ns, labels, socket_dir, work / "intruder-work",
            ["python3", "-c", INTRUDER.format(gpus=list(gpus))], gpus=0,
        )  # fmt: skip
        c.kubectl("apply", "-f", "-", input=json.dumps(intruder))
        wait_until(
            lambda: get_json(c, "pod", "intruder", "-n", ns)["status"].get("phase")
            in ("Succeeded", "Failed"),
            timeout=120, what="the second pod's signal",
        )  # fmt: skip
        out = c.kubectl("logs", "-n", ns, "intruder").stdout
        assert "REFUSED 403" in out, out
        c.kubectl("delete", "pod", "intruder", "-n", ns, "--wait=false")

        # The agent pod is deleted: it resets its GPUs on SIGTERM, the DaemonSet recreates it, and
        # the trainer's GPUs are governed again.
        t0 = time.monotonic()
        c.kubectl("delete", "pod", "-n", SYSTEM_NS, agent["metadata"]["name"], "--wait=false")
        wait_until(
            lambda: set(gpu_locks(driver, gpus).values()) == {None},
            timeout=RESET_BOUND_S + 30, interval=0.05, what="GPUs reset by the stopping agent",
        )  # fmt: skip
        figures["agent_delete_to_reset_s"] = round(time.monotonic() - t0, 2)
        new_agent = wait_until(
            lambda: [
                p for p in pods_of(c, SYSTEM_NS, "app.kubernetes.io/name=rlenergy-node-agent")
                if pod_ready(p) and p["metadata"]["uid"] != agent["metadata"]["uid"]
            ],
            timeout=180, what="the recreated agent pod Ready",
        )[0]  # fmt: skip
        figures["agent_delete_to_new_agent_ready_s"] = round(time.monotonic() - t0, 1)
        wait_until(
            lambda: any(v is not None for v in gpu_locks(driver, gpus).values()),
            timeout=120, interval=0.05, what="the trainer's GPUs governed by the new agent",
        )  # fmt: skip
        figures["agent_rss_kib_running"] = _pod_rss_kib(new_agent["metadata"]["uid"])

        # The trainer pod is deleted: its GPUs are back at the default governor within 10 s.
        t0 = time.monotonic()
        c.kubectl("delete", "pod", "trainer", "-n", ns, "--wait=false")
        wait_until(
            lambda: set(gpu_locks(driver, gpus).values()) == {None},
            timeout=RESET_BOUND_S + 20, interval=0.05, what="the deleted trainer's GPUs reset",
        )  # fmt: skip
        figures["trainer_delete_to_reset_s"] = round(time.monotonic() - t0, 2)
        assert figures["trainer_delete_to_reset_s"] <= RESET_BOUND_S, figures

        # The policy is deleted, then the chart: no lock, no finalizer, no DaemonSet left.
        c.kubectl("delete", "rlep", pname, "-n", ns, "--timeout=90s", timeout=120)
        wait_until(
            lambda: c.kubectl("get", "ds", "-n", SYSTEM_NS, "rlenergy-node-agent", check=False)
            .returncode != 0,
            timeout=60, what="the agent DaemonSet removed with the last policy",
        )  # fmt: skip
        c.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "120s", timeout=180)
        wait_until(
            lambda: not get_json(c, "pods", "-n", SYSTEM_NS)["items"],
            timeout=120, what="no pod left in the release namespace",
        )  # fmt: skip
        assert set(gpu_locks(driver, driver.uuids).values()) == {None}
        for kind in ("rlep", "rlenergynodereports"):
            items = get_json(c, kind, "-A")["items"]
            assert all(not i["metadata"].get("finalizers") for i in items), items
    finally:
        sampling.set()
        sampler.join()
        report_versions.stop()


def _summary(figures: dict[str, Any]) -> str:
    """The figures the closing note asks for, on one line (``-s`` shows it)."""

    def vmrss_mb(key: str) -> str:
        rss = figures.get(key) or {}
        return "/".join(f"{v / 1024:.1f}" for k, v in rss.items() if k.startswith("VmRSS")) or "?"

    return (
        f"real node: trainer pod deleted -> GPUs reset {figures.get('trainer_delete_to_reset_s')} s"
        f" (bound {RESET_BOUND_S:.0f} s); agent pod deleted -> reset "
        f"{figures.get('agent_delete_to_reset_s')} s; agent VmRSS idle {vmrss_mb('agent_rss_kib_idle')}"
        f" MB, governing {vmrss_mb('agent_rss_kib_running')} MB; agent CPU s/s idle "
        f"{figures.get('agent_cpu_s_per_s_idle')}, governing "
        f"{figures.get('agent_cpu_s_per_s_governing')}; lock samples at planned clocks "
        f"{figures.get('lock_samples_at_planned_clock')}; throughput "
        f"{figures.get('throughput_ratio_by_phase')}"
    )


PLANNED_SHARE = 0.9
"""Share of a phase's lock samples that must be at a clock the plans named for that phase; the
rest are the few samples at each phase boundary between the trainer's kind file (what the
sampler reads) and its signal (what moves the lock): 24 boundaries of 10 ms samples in a run of
thousands."""


def _check_planned_locks(
    c: DevCluster,
    ns: str,
    policy: str,
    node: str,
    published: dict[int, dict[str, Any]],
    samples_by_kind: dict[str, collections.Counter[int | None]],
    figures: dict[str, Any],
) -> None:
    """The trainer's GPUs ran the clocks the plans named for each phase.

    Planned: per phase, the clock each of the node's published windows (``published``: step
    -> record, read while the report held them) was asked for and each probe slice's clock
    (``None``: the default governor), snapped to the GPUs' supported clocks as the agent snaps
    them (``actuator.snap_clock_mhz``). At least ``PLANNED_SHARE`` of the samples of a phase
    hold one of them.
    """
    report = get_json(c, "rlenergynodereports", report_name(policy, node), "-n", ns)["spec"]
    supported = report["gpus"][0]["supportedClocksMHz"]

    def snap(mhz: int | None) -> int | None:
        return None if mhz is None else snap_clock_mhz(mhz, supported)

    planned: dict[str, set[int | None]] = {}
    for step in [*published.values(), *report["steps"]]:
        for w in step["phases"]:
            clocks = planned.setdefault(w["phase"], set())
            clocks.add(snap(w.get("requestedClockMHz")))
            clocks.update(snap(sl.get("clockMHz")) for sl in w.get("slices") or ())
    figures["planned_clocks_mhz"] = {k: sorted(v, key=str) for k, v in planned.items()}
    shares = {}
    for phase in ("generation", "training"):
        seen = samples_by_kind.get(phase, collections.Counter())
        total = sum(seen.values())
        assert total and planned.get(phase), (phase, seen, planned)
        shares[phase] = sum(n for mhz, n in seen.items() if mhz in planned[phase]) / total
    figures["lock_samples_at_planned_clock"] = shares
    assert all(v >= PLANNED_SHARE for v in shares.values()), (shares, samples_by_kind, planned)


def _check_locked_throughput(
    status: dict[str, Any], replay: dict[str, Any], figures: dict[str, Any]
) -> None:
    """A phase the controller locked keeps its minThroughputRatio at that clock, in truth.

    The truth is the replay's own phase times at each effective clock (what the pod's work
    takes, ``podtrainer.replay_document``): default-governor time over time at the lock, summed
    over the replayed steps. The status' whole-run ``throughputRatio`` (0.92-0.95 in earlier
    runs) is not held to the threshold here: in 12 steps the warm-up and the trials (the
    controller may spend a quarter of ``max(steps, 40)`` steps on trials, ``eerl.
    _trial_budget_left``) are not amortised, and the promise on the whole run (docs/operator.md)
    is made over long runs (``make bench-energy``: 200 steps).
    """
    sku = models.get_sku("h100-sxm")
    out: dict[str, Any] = {}
    for ph in status.get("phases") or ():
        name, lock = ph["name"], ph.get("clockMHz")
        out[name] = {"state": ph["state"], "clockMHz": lock, "status": ph.get("throughputRatio")}
        if ph["state"] != "locked" or lock is None:
            continue
        default_s = at_lock_s = 0.0
        for st in replay["steps"]:
            p = st["phases"][name]
            default_s += p["times_s"][str(int(sku.effective_clock_mhz(p["kind"], None)))]
            at_lock_s += p["times_s"][str(int(sku.effective_clock_mhz(p["kind"], lock)))]
        out[name]["true_at_lock"] = default_s / at_lock_s
        out[name]["threshold"] = ph["minThroughputRatio"]
    figures["throughput_ratio_by_phase"] = out
    for name, v in out.items():
        if "true_at_lock" in v:
            assert v["true_at_lock"] >= v["threshold"] - INDIFFERENCE, (name, v)


def _check_verl_metrics(log: str, replay: dict[str, Any], figures: dict[str, Any]) -> None:
    """Each of the first ``STEPS`` steps returned its ``rlenergy/*`` keys in verl's metrics.

    The pod prints, per step, the metrics dict verl's v1 ``PPOTrainer._update_actor`` filled
    (``podtrainer.STEP_LINE``). Valid tokens and trained samples are the replay batch's own
    count (``podtrainer.step_batch``: the group verl's replay buffer evicted by DAPO's
    ``filter_groups`` and the aborted sample out);
    the generated tokens are what the hook read from the rollout server's ``/metrics``, the
    phase's decoded tokens; the energy per phase is the agent's answer to the step's end.
    """
    records = {r["step"]: r for r in podtrainer.step_records(log)}
    assert all(s in records for s in range(1, STEPS + 1)), (sorted(records), log[-3000:])
    for s in range(1, STEPS + 1):
        wrong = podtrainer.step_record_mismatches(records[s], replay["steps"][s - 1])
        assert not wrong, (s, wrong)
    figures["verl_metrics_step_1"] = {
        k: v for k, v in records[1]["metrics"].items() if k.startswith("rlenergy/")
    }


INTRUDER = """
from rlenergy.sdk import trainer
client = trainer.RLEnergyClient(strict=True, gpus={gpus})
try:
    client.phase("generation", step=0).__enter__()
except trainer.AgentRefusedError as exc:
    print("REFUSED", exc.status, exc)
else:
    print("ACCEPTED", client.last_response)
"""
