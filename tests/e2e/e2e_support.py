"""Helpers shared by the e2e tests (imported by conftest and the test modules)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import rlenergy_dev
from kubernetes import client, config, watch
from rlenergy_dev import standin
from rlenergy_dev.devcluster import DevCluster, MissingBinaryError
from rlenergy_dev.devcluster.cluster import free_port
from rlenergy_dev.devcluster.nvidiaplugin import NvidiaDevicePlugin
from rlenergy_dev.devcluster.realnode import RealNode

MANIFESTS = Path(__file__).resolve().parent / "manifests"
NODES = 3
GPUS_PER_NODE = 8
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"

T = TypeVar("T")


ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rl-energy"
SAMPLE = ROOT / "crds" / "samples" / "sync-job.yaml"
IMAGES = Path(os.environ.get("RLENERGY_IMAGES_DIR", ROOT / "build" / "images"))
"""The image archives ``make images`` builds (the real-node modules push them to the registry)."""
VERL_SITE = ROOT / ".venv-verl" / "lib" / "python3.11" / "site-packages"
"""The pinned verl and torch (``make venv-verl``) a real-node trainer pod runs (cp311, as the
image's Debian python3)."""
IMAGE_REPO = "ghcr.io/rl-energy"
TAG = rlenergy_dev.project_version()
RELEASE = "rl"
SYSTEM_NS = "rl-energy-system"


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout: float = 60,
    interval: float = 0.5,
    what: str = "",
    explain: Callable[[], str] | None = None,
) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout`` seconds.

    ``explain``: called once at the timeout; what it returns (the state that decides the wait:
    logs, objects) is added to the failure, since a CI run keeps nothing else.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = ""
            if explain is not None:
                try:
                    detail = "\n" + explain()
                except Exception as exc:  # noqa: BLE001 - the timeout is the failure to report
                    detail = f"\n(no explanation: {exc!r})"
            pytest.fail(f"timed out after {timeout} s waiting for {what or probe}{detail}")
        time.sleep(interval)


def webhook_explained(c: DevCluster) -> str:
    """Why the API server may be admitting pods without the webhook: its own log lines about
    webhook calls, the operator pods' state and log tail, and the webhook Service's endpoints."""
    assert c.workdir is not None
    api_log = Path(c.workdir) / "logs" / "kube-apiserver.log"
    text = api_log.read_text(errors="replace") if api_log.is_file() else ""
    calls = [line for line in text.splitlines() if "calling webhook" in line.lower()][-15:]
    parts = ["kube-apiserver log, lines about webhooks:", *calls]
    for p in pods_of(c, SYSTEM_NS, "app.kubernetes.io/component=operator"):
        name = p["metadata"]["name"]
        statuses = [
            (s["name"], s.get("restartCount"), s.get("ready"), s.get("state"))
            for s in p["status"].get("containerStatuses", [])
        ]
        parts.append(f"operator pod {name}: {p['status'].get('phase')} {statuses}")
        logs = c.kubectl("logs", "-n", SYSTEM_NS, name, "--tail=40", check=False)
        parts += ["its log (last 40 lines):", logs.stdout + logs.stderr]
    slices = c.kubectl("get", "endpointslices", "-n", SYSTEM_NS, "-o", "wide", check=False)
    parts += ["EndpointSlices:", slices.stdout + slices.stderr]
    return "\n".join(parts)


def get_json(cluster: DevCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def get_json_if_found(cluster: DevCluster, *args: str) -> Any | None:
    """``get_json``, or None while the object does not exist yet (an agent creates its node
    report with the first step records it publishes); any other error still raises."""
    res = cluster.kubectl("get", *args, "-o", "json", check=False)
    if res.returncode != 0 and "(NotFound)" in res.stderr:
        return None
    if res.returncode != 0:
        raise AssertionError(f"kubectl get {' '.join(args)} failed: {res.stderr}")
    return json.loads(res.stdout)


def real_node_cluster(who: str, **start: Any) -> DevCluster:
    """A started dev cluster with its real node and no KWOK node (``start``: more arguments of
    ``DevCluster.start``, e.g. ``registry=True``); the caller enters it (``with``) to stop it.

    Missing node binaries fail the test, naming ``who`` and ``make bins``'s error.
    """
    c = DevCluster(startup_timeout=180)
    try:
        c.start(nodes=0, real_node=True, **start)
    except MissingBinaryError as exc:
        pytest.fail(f"{who} needs the node binaries: {exc}", pytrace=False)
    return c


def start_nvidia_device_plugin(
    node: RealNode, driver: standin.StandinDriver, nvml_lib_dir: Path
) -> NvidiaDevicePlugin:
    """NVIDIA's device plugin on the real node over ``driver``'s GPUs (``cdi-cri``), registered.

    Write the node's CDI specs first (``node.write_cdi_spec``): containerd resolves the plugin's
    CDI device names through them.
    """
    return node.start_device_plugin(
        nvml_lib=nvml_lib_dir / "libnvidia-ml.so.1",
        cuda_lib=standin.build_cuda_library(nvml_lib_dir.parent / "cuda-standin"),
        state=driver.path,
        n_gpus=len(driver.uuids),
        driver_version=driver.state.driver_version.decode(),
    )


def pods_of(c: DevCluster, ns: str, selector: str) -> list[dict[str, Any]]:
    """The pods of namespace ``ns`` that label ``selector`` matches (``kubectl get -l``)."""
    return list(get_json(c, "pods", "-n", ns, "-l", selector)["items"])


def pod_ready(pod: dict[str, Any]) -> bool:
    """Whether ``pod`` (a pod object) has its Ready condition True."""
    return any(
        cond["type"] == "Ready" and cond["status"] == "True"
        for cond in pod.get("status", {}).get("conditions", [])
    )


def gpu_locks(driver: standin.StandinDriver, uuids: tuple[str, ...]) -> dict[str, int | None]:
    """Each stand-in GPU's locked SM clock, MHz (None: the default governor)."""
    return {u: (int(driver.gpu(u).lock_max_mhz) if driver.gpu(u).locked else None) for u in uuids}


def real_node_values(c: DevCluster, node: RealNode, work: Path) -> dict[str, Any]:
    """Chart values of an install on the real node: the operator and agents on the host network
    (the API server on 127.0.0.1 of the node's network), one operator replica reconciling every
    second, ports chosen free, the agent's state, socket and PodResources folders under ``work``
    and the node's. Callers add what their install differs in."""
    tolerate = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "hostNetwork": True,
        "apiServer": {"host": "127.0.0.1", "port": c.server.rsplit(":", 1)[1]},
        "operator": {
            "replicas": 1,
            "healthPort": free_port(),
            "metricsPort": free_port(),
            "reconcileIntervalS": 1,
            "tolerations": tolerate,
        },
        "agent": {
            "metricsPort": free_port(),
            "stateDir": str(work / "agent-state"),
            "socketDir": str(work / "agent-socket"),
            "podResourcesDir": str(node.pod_resources_dir),
        },
    }


class ObjectVersions:
    """Every version of one namespaced custom object that the API server sends a watch, kept
    from :meth:`start` to :meth:`stop` in ``versions`` (the objects as dicts, in order).

    A poll sees only the versions that live across one of its reads; a watch is sent each
    change. The watch asks for ``metadata.name=<name>`` so it may start before the object
    exists; each stream lasts ``WATCH_S`` seconds and the next one resumes from the last
    ``resourceVersion`` it saw, the first one from a list's (and after an error such as 410
    Gone, from a fresh list's).
    """

    WATCH_S = 5
    GIVE_UP_ERRORS = 20
    """Errors after which the watch ends by itself (its caller failed before :meth:`stop`)."""

    def __init__(
        self, cluster: DevCluster, group: str, version: str, plural: str, ns: str, name: str
    ) -> None:
        self.versions: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._api = client.CustomObjectsApi(config.new_client_from_config(str(cluster.kubeconfig)))
        self._what = (group, version, ns, plural)
        self._selector = f"metadata.name={name}"
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"watch {name}")

    def start(self) -> ObjectVersions:
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        """End the watch (within ``WATCH_S`` seconds) and return ``versions``."""
        self._stopping.set()
        self._thread.join(self.WATCH_S + 10)
        return self.versions

    def _run(self) -> None:
        resource_version: str | None = None
        while not self._stopping.is_set():
            w = watch.Watch()
            try:
                if resource_version is None:  # list, then watch from the list's version
                    listed: dict[str, Any] = self._api.list_namespaced_custom_object(
                        *self._what, field_selector=self._selector
                    )  # type: ignore[assignment]  # the client's stubs say object
                    self.versions.extend(listed["items"])
                    resource_version = listed["metadata"]["resourceVersion"]
                kwargs: dict[str, Any] = {
                    "field_selector": self._selector,
                    "timeout_seconds": self.WATCH_S,
                    "resource_version": resource_version,
                }
                for event in w.stream(
                    self._api.list_namespaced_custom_object, *self._what, **kwargs
                ):
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self.versions.append(event["object"])
                resource_version = w.resource_version
            except Exception as exc:  # noqa: BLE001 - kept, and the watch starts over from a list
                self.errors.append(repr(exc))
                resource_version = None
                if len(self.errors) >= self.GIVE_UP_ERRORS:  # the cluster is gone
                    return
                time.sleep(0.5)
