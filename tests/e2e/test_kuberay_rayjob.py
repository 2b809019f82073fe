"""The documented KubeRay RayJob (``docs/examples/verl-rayjob.yaml``) on the dev cluster.

KubeRay's own CRDs (``tests/e2e/testdata/kuberay-v1.5.0``, vendored from the v1.5.0 tag) are
installed and the KubeRay operator of the same release (``ray-operator``, built by ``make
bins`` from the Go module proxy: ``hack/kuberay-bin.sh``) runs as a process against the
cluster; our operator and its trainer-pod webhook run as in ``test_pod_injection``, and the
policy is ``crds/samples/sync-job.yaml``. Pods land on KWOK nodes (they need not run).

We test these aspects:
* the RayJob is accepted by KubeRay's published schema (a typo in the example fails here) and
  names the hook once, at job level, as a module-path string in ``spec.runtimeEnvYAML``;
* no pod template sets Ray's reserved setup-hook variable (a second hook), and each carries
  the policy's label and the opt-in label;
* KubeRay turns the RayJob into a RayCluster whose head and worker pods carry both labels and
  were injected by our webhook (the agent's volume, mount and environment) when KubeRay
  created them, and its submitter Job hands the hook to ``ray job submit --runtime-env-json``;
* the same for the templates alone, as server-side dry runs (what the webhook does with the
  example, whatever KubeRay adds).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import get_json, wait_until
from rlenergy_dev.devcluster import DevCluster
from rlenergy_dev.devcluster.binaries import default_bin_dir
from rlenergy_operator import injection
from test_pod_injection import LEVEL, Operator
from test_pod_injection import setup as setup  # the fixture: operator, webhook, policy

from rlenergy.api import signals
from rlenergy.sdk import verl_hook

ROOT = Path(__file__).resolve().parents[2]
KUBERAY_CRDS = Path(__file__).resolve().parent / "testdata" / "kuberay-v1.5.0"
EXAMPLE = ROOT / "docs" / "examples" / "verl-rayjob.yaml"
POLICY = ROOT / "crds" / "samples" / "sync-job.yaml"


@pytest.fixture(scope="module")
def kuberay_crds(dev_cluster: DevCluster) -> None:
    """KubeRay's RayCluster and RayJob CRDs, server-side (too large for client-side apply)."""
    dev_cluster.kubectl("apply", "--server-side", "-f", str(KUBERAY_CRDS), timeout=180)
    dev_cluster.wait_crds_established("rayclusters.ray.io", "rayjobs.ray.io", timeout_s=120)


@pytest.fixture
def kuberay_operator(
    dev_cluster: DevCluster, kuberay_crds: None, setup: tuple[Operator, str, str], tmp_path: Path
) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    """KubeRay's operator watching the test's namespace (its metrics and probes off)."""
    exe = default_bin_dir() / "ray-operator"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: run 'make bins' (hack/kuberay-bin.sh builds it)")
    _, ns, _ = setup
    log = tmp_path / "ray-operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(exe),
                f"--kubeconfig={dev_cluster.kubeconfig}",
                f"--watch-namespace={ns}",
                "--enable-leader-election=false",
                "--metrics-addr=0",
                "--health-probe-bind-address=0",
                "--log-stdout-encoder=console",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield ns, log, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        text = log.read_text(errors="replace")
        assert "panic:" not in text, text[-4000:]


def _templates(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = job["spec"]["rayClusterSpec"]
    out = {"head": spec["headGroupSpec"]["template"]}
    for group in spec["workerGroupSpecs"]:
        out[group["groupName"]] = group["template"]
    return out


def _dry_run_pod(cluster: DevCluster, ns: str, name: str, template: dict[str, Any]) -> Any:
    """The pod KubeRay would create from ``template``, as the API server would admit it."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template.get("metadata", {}), "name": name},
        "spec": template["spec"],
    }
    out = cluster.kubectl(
        "create", "--dry-run=server", "-n", ns, "-o", "json", "-f", "-", input=json.dumps(pod)
    )
    return json.loads(out.stdout)


def test_the_documented_rayjob_is_accepted_and_its_pods_are_injected(
    dev_cluster: DevCluster,
    kuberay_crds: None,
    setup: tuple[Operator, str, str],  # noqa: F811 - the fixture imported above
) -> None:
    _, ns, _ = setup
    # The example's images are not restricted-ready; Pod Security is not what is tested here.
    dev_cluster.kubectl("label", "namespace", ns, f"{LEVEL}-")
    dev_cluster.kubectl("apply", "-n", ns, "-f", str(POLICY))
    dev_cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    job = get_json(dev_cluster, "rayjob", "grpo-qwen-7b", "-n", ns)
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert runtime_env == {"worker_process_setup_hook": verl_hook.HOOK_PATH}

    selector = yaml.safe_load(POLICY.read_text())["spec"]["selector"]["matchLabels"]
    templates = _templates(job)
    assert set(templates) == {"head", "gpu"}
    for group, template in templates.items():
        labels = template["metadata"]["labels"]
        assert labels[injection.LABEL] == "true" and selector.items() <= labels.items(), group
        for c in template["spec"]["containers"]:
            names = {e["name"] for e in c.get("env", [])}
            assert verl_hook.RESERVED_HOOK_VAR not in names, (group, c["name"])

        pod = _dry_run_pod(dev_cluster, ns, f"grpo-qwen-7b-{group}-0", template)
        assert injection.is_injected(pod), (group, pod["spec"])
        (c, *_) = pod["spec"]["containers"]
        assert {"name": injection.VOLUME, "mountPath": injection.MOUNT_PATH, "readOnly": True} in (
            c["volumeMounts"]
        )
        env = {e["name"]: e for e in c["env"]}
        assert env[signals.HOST_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"


def _cluster_pods(cluster: DevCluster, ns: str) -> dict[str, Any] | None:
    """KubeRay's head and worker pods of the RayJob's RayCluster, by ``ray.io/node-type``."""
    clusters = get_json(cluster, "rayclusters", "-n", ns)["items"]
    if not clusters:
        return None
    name = clusters[0]["metadata"]["name"]
    pods = get_json(cluster, "pods", "-n", ns, "-l", f"ray.io/cluster={name}")["items"]
    kinds = {p["metadata"]["labels"].get("ray.io/node-type"): p for p in pods}
    return kinds if {"head", "worker"} <= set(kinds) else None


def test_kuberay_turns_the_rayjob_into_pods_our_webhook_injected(
    dev_cluster: DevCluster, kuberay_operator: tuple[str, Path, subprocess.Popen[bytes]]
) -> None:
    ns, log, proc = kuberay_operator
    # The dev cluster has only GPU nodes, tainted as NVIDIA's GPU nodes are: the head (a CPU
    # node's pod in a real cluster) and the workers tolerate the taint here, so that both run
    # (on KWOK) and KubeRay reads the cluster ready.
    job = yaml.safe_load(EXAMPLE.read_text())
    for template in _templates(job).values():
        template["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]

    def pods_of_the_job() -> dict[str, Any] | None:
        if proc.poll() is not None:
            pytest.fail(f"ray-operator exited: {log.read_text(errors='replace')[-3000:]}")
        return _cluster_pods(dev_cluster, ns)

    dev_cluster.kubectl("label", "namespace", ns, f"{LEVEL}-")
    dev_cluster.kubectl("apply", "-n", ns, "-f", str(POLICY))
    dev_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(job))
    try:
        pods = wait_until(
            pods_of_the_job,
            timeout=240,
            what="KubeRay's head and worker pods of the RayJob",
        )
    except BaseException:
        job = dev_cluster.kubectl("get", "rayjob,raycluster,pod", "-n", ns, "-o", "yaml")
        events = dev_cluster.kubectl("get", "events", "-n", ns, check=False).stdout
        print(log.read_text(errors="replace")[-6000:], job.stdout[-4000:], events[-3000:])
        raise
    (cluster,) = get_json(dev_cluster, "rayclusters", "-n", ns)["items"]
    owner = cluster["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("RayJob", "grpo-qwen-7b")
    selector = yaml.safe_load(POLICY.read_text())["spec"]["selector"]["matchLabels"]
    for kind, pod in pods.items():
        labels = pod["metadata"]["labels"]
        assert labels[injection.LABEL] == "true" and selector.items() <= labels.items(), kind
        assert injection.is_injected(pod), (kind, pod["spec"])
        (c, *_) = pod["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env[signals.HOST_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
        assert verl_hook.RESERVED_HOOK_VAR not in env, kind

    # Once the cluster reads ready (KWOK marks the pods running), KubeRay's submitter Job
    # passes the job's runtime env, the hook in it, to `ray job submit --runtime-env-json`.
    def submitter() -> str | None:
        jobs = get_json(dev_cluster, "jobs", "-n", ns)["items"]
        return json.dumps(jobs[0]["spec"]["template"]["spec"]["containers"]) if jobs else None

    try:
        command = wait_until(submitter, timeout=180, what="KubeRay's submitter Job")
    except BaseException:
        state = dev_cluster.kubectl("get", "rayjob,raycluster,pod", "-n", ns, "-o", "wide")
        print(state.stdout, log.read_text(errors="replace")[-4000:])
        raise
    assert "--runtime-env-json" in command and verl_hook.HOOK_PATH in command, command
