"""The trainer-pod webhook on the real API server: a pod with only the opt-in label is admitted
under Pod Security ``restricted`` with the agent token, the CA bundle and the endpoint.

The operator runs as a subprocess (``python -m rlenergy_operator --standalone``) serving its
admission webhook on a local port; the chart's own MutatingWebhookConfiguration
(``helm template --show-only templates/webhook.yaml``) is applied with its Service reference
replaced by that URL, so its selectors, failure policy and reinvocation policy are the ones
tested. The operator sets the configuration's ``caBundle`` to its CA at start-up. Checked:

* a pod with only ``rlenergy.io/inject: "true"`` in a ``restricted`` namespace is admitted
  with the projected volume, the mount and the environment; its CA bundle ConfigMap exists;
* pods without the label, pods of no policy and pods of the operator's namespace are not
  changed;
* with the operator stopped the same pod is admitted unchanged at once (``failurePolicy:
  Ignore``), and the operator, back, warns on the policy that it runs ungoverned;
* admission latency with the webhook against a pod the webhook is not called for (p50, p99).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from chart_support import CHART, helm
from e2e_support import get_json, wait_until
from rlenergy_dev.devcluster import DevCluster
from rlenergy_operator import injection
from rlenergy_operator import webhook as webhook_module

from rlenergy.api import signals

ROOT = Path(__file__).resolve().parents[2]
LEVEL = "pod-security.kubernetes.io/enforce"
RESTRICTED_CONTAINER = {
    "name": "trainer",
    "image": "verl:latest",
    "securityContext": {
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Operator:
    """The operator with its webhook on ``port``, as a subprocess."""

    def __init__(self, cluster: DevCluster, namespace: str, config: str, log: Path) -> None:
        self.cluster, self.namespace, self.config, self.log = cluster, namespace, config, log
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.cluster.kubeconfig),
            # this checkout's code, whatever the interpreter has installed
            "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("", "operator", "agent")),
            "RLENERGY_OPERATOR_NAMESPACE": self.namespace,
            "RLENERGY_OPERATOR_WEBHOOK_PORT": str(self.port),
            "RLENERGY_OPERATOR_WEBHOOK_SERVICE": "127.0.0.1",
            "RLENERGY_OPERATOR_WEBHOOK_CONFIGURATION": self.config,
            "RLENERGY_OPERATOR_RETRY_DELAY_S": "1",
        }
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlenergy_operator", "--standalone", "--all-namespaces"],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT),
            )  # fmt: skip
        wait_until(self.listening, timeout=90, what=f"the operator's webhook on {self.port}")

    def listening(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"operator exited: {self.log.read_text(errors='replace')[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def chart_webhook(release_namespace: str, name: str, url: str) -> dict[str, Any]:
    """The chart's MutatingWebhookConfiguration, renamed and pointed at ``url``."""
    out = helm(
        "template", "rl-energy", str(CHART), "--namespace", release_namespace,
        "--show-only", "templates/webhook.yaml",
    )  # fmt: skip
    (config,) = [
        d for d in yaml.safe_load_all(out) if d and d["kind"] == "MutatingWebhookConfiguration"
    ]
    config["metadata"] = {"name": name}
    for hook in config["webhooks"]:
        hook["clientConfig"] = {"url": url}
    return dict(config)


def _ca_bundle(cluster: DevCluster, config: str) -> str | None:
    """The first webhook's ``caBundle`` of MutatingWebhookConfiguration ``config`` (None: unset)."""
    hooks = get_json(cluster, "mutatingwebhookconfiguration", config)["webhooks"]
    return cast(str | None, hooks[0]["clientConfig"].get("caBundle"))


@pytest.fixture
def setup(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path
) -> Iterator[tuple[Operator, str, str]]:
    """(operator, trainer namespace labelled restricted, the operator's namespace)."""
    op_ns = f"rlenergy-op-{uuid.uuid4().hex[:6]}"
    dev_cluster.kubectl("create", "namespace", op_ns)
    dev_cluster.kubectl("label", "namespace", namespace, f"{LEVEL}=restricted")
    config = f"rlenergy-test-{uuid.uuid4().hex[:6]}"
    op = Operator(dev_cluster, op_ns, config, tmp_path / "operator.log")
    webhook = chart_webhook(op_ns, config, f"https://127.0.0.1:{op.port}/inject-pod")
    dev_cluster.kubectl("apply", "-f", "-", input=json.dumps(webhook))
    try:
        op.start()
        wait_until(
            lambda: _ca_bundle(dev_cluster, config),
            timeout=60,
            what="the operator to set the webhook's caBundle",
        )
        policy = {
            "apiVersion": "rlenergy.io/v1alpha1",
            "kind": "RLEnergyPolicy",
            "metadata": {"name": "job", "namespace": namespace},
            "spec": {"selector": {"matchLabels": {"app": "trainer"}}},
        }
        dev_cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))
        wait_until(
            lambda: dev_cluster.kubectl(
                "get", "configmap", injection.CA_CONFIGMAP, "-n", namespace, check=False
            ).returncode == 0,
            timeout=60,
            what="the CA bundle ConfigMap in the trainer namespace",
        )  # fmt: skip
        yield op, namespace, op_ns
    finally:
        op.stop()
        dev_cluster.kubectl("delete", "mutatingwebhookconfiguration", config, check=False)
        dev_cluster.kubectl("delete", "namespace", op_ns, "--wait=false", check=False)
        log = op.log.read_text(errors="replace") if op.log.exists() else ""
        assert "Traceback (most recent call last)" not in log, log[-4000:]


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [dict(RESTRICTED_CONTAINER)]},
    }


def _create(cluster: DevCluster, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    out = cluster.kubectl("create", "-n", namespace, "-o", "json", "-f", "-", input=json.dumps(pod))
    return dict(json.loads(out.stdout))


OPT_IN = {"app": "trainer", injection.LABEL: "true"}


def test_a_pod_with_only_the_label_is_injected_under_restricted(
    dev_cluster: DevCluster, setup: tuple[Operator, str, str]
) -> None:
    _, ns, op_ns = setup
    pod = _create(dev_cluster, ns, _pod("trainer-0", OPT_IN))
    assert injection.is_injected(pod), pod["spec"]
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == injection.VOLUME]
    assert "projected" in vol and "hostPath" not in vol
    c = pod["spec"]["containers"][0]
    assert {"name": injection.VOLUME, "mountPath": injection.MOUNT_PATH, "readOnly": True} in c[
        "volumeMounts"
    ]
    env = {e["name"]: e for e in c["env"]}
    assert env[signals.HOST_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env[signals.CA_FILE_ENV]["value"] == signals.DEFAULT_CA_FILE
    ca = get_json(dev_cluster, "configmap", injection.CA_CONFIGMAP, "-n", ns)["data"]["ca.crt"]
    secret = get_json(dev_cluster, "secret", "rlenergy-ca", "-n", op_ns)
    assert ca.startswith("-----BEGIN CERTIFICATE-----") and secret["type"] == "kubernetes.io/tls"

    # not touched: no label, no policy, the operator's own namespace
    plain = _create(dev_cluster, ns, _pod("plain", {"app": "trainer"}))
    assert not injection.is_injected(plain) and "env" not in plain["spec"]["containers"][0]
    other = _create(dev_cluster, ns, _pod("other", {"app": "other", injection.LABEL: "true"}))
    assert not injection.is_injected(other)
    own = _create(dev_cluster, op_ns, _pod("own", OPT_IN))
    assert not injection.is_injected(own)


def _admission_ms(cluster: DevCluster, ns: str, labels: dict[str, str], n: int) -> list[float]:
    """Server-side dry-run creations through the Python client, one connection, ms each."""
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
    out = []
    for i in range(n):
        body = _pod(f"lat-{i}", labels)
        t0 = time.perf_counter()
        api.create_namespaced_pod(ns, body, dry_run="All")
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def test_admission_latency_with_the_webhook(
    dev_cluster: DevCluster, setup: tuple[Operator, str, str]
) -> None:
    _, ns, _ = setup
    _admission_ms(dev_cluster, ns, OPT_IN, 5)  # warm both connections
    with_hook = _admission_ms(dev_cluster, ns, OPT_IN, 60)
    without = _admission_ms(dev_cluster, ns, {"app": "trainer"}, 60)

    def p99(v: list[float]) -> float:
        return sorted(v)[int(0.99 * (len(v) - 1))]

    print(
        f"\nadmission ms: webhook p50 {statistics.median(with_hook):.1f} p99 {p99(with_hook):.1f}; "
        f"no webhook p50 {statistics.median(without):.1f} p99 {p99(without):.1f}"
    )
    assert p99(with_hook) < 5000  # under the webhook's timeoutSeconds: never the timeout


def test_with_the_operator_down_pods_are_admitted_and_the_policy_says_so(
    dev_cluster: DevCluster, setup: tuple[Operator, str, str]
) -> None:
    op, ns, _ = setup
    op.stop()
    t0 = time.monotonic()
    pod = _create(dev_cluster, ns, _pod("while-down", OPT_IN))
    took = time.monotonic() - t0
    assert not injection.is_injected(pod)
    assert took < 5.0, f"admission waited {took:.1f} s for a webhook that is down"
    op.start()

    def warned() -> bool:
        events = get_json(
            dev_cluster, "events", "-n", ns, "--field-selector", "reason=PodNotInjected"
        )["items"]
        return any("while-down" in e.get("message", "") for e in events)

    wait_until(warned, timeout=90, what="a PodNotInjected warning on the policy")


def _documented(kind: str) -> dict[str, Any]:
    """The label-only trainer pod (``Pod``) or the KubeRay worker template (``RayCluster``)
    of docs/verl.md, as a pod."""
    text = (ROOT / "docs" / "verl.md").read_text()
    for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
        doc = yaml.safe_load(block) or {}
        if kind == "Pod" and doc.get("kind") == "Pod":
            return dict(doc)
        groups = (doc.get("spec") or {}).get("workerGroupSpecs") if kind == "RayCluster" else None
        if groups:
            template = groups[0]["template"]
            return {"apiVersion": "v1", "kind": "Pod", "metadata": dict(template["metadata"]),
                    "spec": template["spec"]}  # fmt: skip
    raise AssertionError(f"docs/verl.md shows no {kind} block")


def _documented_pod_is_injected(
    dev_cluster: DevCluster, setup: tuple[Operator, str, str], kind: str
) -> None:
    _, ns, _ = setup
    pod = _documented(kind)
    assert pod["metadata"]["labels"][injection.LABEL] == "true"
    pod["metadata"]["name"] = f"doc-{kind.lower()}"
    pod["metadata"]["labels"]["app"] = "trainer"  # what this test's policy selects
    c = pod["spec"]["containers"][0]
    c.setdefault("securityContext", RESTRICTED_CONTAINER["securityContext"])  # a Ray image's
    c["securityContext"].setdefault("runAsUser", 1000)  # user is numeric; this image is not
    c.get("resources", {}).pop("limits", None)  # no device plugin on this namespace's nodes
    created = _create(dev_cluster, ns, pod)
    assert injection.is_injected(created), created["spec"]


def test_the_documented_trainer_pod_is_injected(
    dev_cluster: DevCluster, setup: tuple[Operator, str, str]
) -> None:
    _documented_pod_is_injected(dev_cluster, setup, "Pod")


def test_the_documented_kuberay_worker_is_injected(
    dev_cluster: DevCluster, setup: tuple[Operator, str, str]
) -> None:
    _documented_pod_is_injected(dev_cluster, setup, "RayCluster")


def test_a_deleted_ca_bundle_is_published_again(
    dev_cluster: DevCluster, setup: tuple[Operator, str, str]
) -> None:
    _, ns, _ = setup
    dev_cluster.kubectl("delete", "configmap", injection.CA_CONFIGMAP, "-n", ns)
    wait_until(
        lambda: dev_cluster.kubectl(
            "get", "configmap", injection.CA_CONFIGMAP, "-n", ns, check=False
        ).returncode == 0,
        timeout=90,
        what="the CA bundle ConfigMap back",
    )  # fmt: skip


def test_a_replaced_webhook_configuration_gets_the_ca_back(
    dev_cluster: DevCluster, setup: tuple[Operator, str, str]
) -> None:
    """The chart's configuration re-created without ``caBundle`` after the operator started (a
    GitOps sync that replaces it, ``kubectl replace``, the chart installed after the operator):
    the API server cannot verify the webhook and admits pods uninjected until the operator,
    which checks every ``CA_BUNDLE_CHECK_S``, sets the CA again."""
    op, ns, op_ns = setup
    dev_cluster.kubectl("delete", "mutatingwebhookconfiguration", op.config)
    webhook = chart_webhook(op_ns, op.config, f"https://127.0.0.1:{op.port}/inject-pod")
    dev_cluster.kubectl("create", "-f", "-", input=json.dumps(webhook))
    t0 = time.monotonic()
    wait_until(
        lambda: _ca_bundle(dev_cluster, op.config),
        timeout=webhook_module.CA_BUNDLE_CHECK_S * 3,
        interval=0.2,
        what="the operator to set the replaced configuration's caBundle",
    )
    print(f"\ncaBundle back {time.monotonic() - t0:.1f} s after the configuration was replaced")
    pod = _create(dev_cluster, ns, _pod("after-replace", OPT_IN))
    assert injection.is_injected(pod), pod["spec"]
    assert "did not trust this operator's CA" in op.log.read_text(errors="replace")
