"""The Helm chart: value combinations, schema, no hooks, CRDs identical to the generated ones,
the agent DaemonSet the operator renders from the chart's configuration, and per-component
RBAC on the real API server (``kubectl auth can-i``).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from rlenergy_dev.devcluster import K8S_VERSION, DevCluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rl-energy"
KUBE = K8S_VERSION.lstrip("v")

COMBINATIONS = {
    "defaults": [],
    "no-gpu-toleration": ["--set", "agent.tolerateGpuTaint=false"],
    "monitoring": [
        "--set", "metrics.serviceMonitor.enabled=true",
        "--set", "metrics.podMonitor.enabled=true",
        "--set", "grafanaDashboard.enabled=false",
    ],
    "local-operator": ["--set", "operator.replicas=0"],
    "priority-class": ["--set", "agent.priorityClassName=system-node-critical"],
    "namespaced": ["--set", "rbac.watchNamespaces={team-a,team-b}"],
    "shards": ["--set", "operator.shards=3"],
}  # fmt: skip


def _template(cluster: DevCluster, *args: str) -> list[dict[str, Any]]:
    res = cluster.helm(
        "template", "rl", str(CHART), "--namespace", "rl-energy-system", "--kube-version", KUBE,
        *args,
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def test_chart_crds_are_the_generated_ones():
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    shipped = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert shipped == generated
    for name in generated:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"helm/rl-energy/crds/{name} differs from crds/{name}: cp crds/*.yaml helm/rl-energy/crds/"
        )


def test_helm_lint_strict(dev_cluster: DevCluster):
    for args in COMBINATIONS.values():
        res = dev_cluster.helm("lint", "--strict", str(CHART), *args)
        assert "0 chart(s) failed" in res.stdout


@pytest.mark.parametrize("combo", sorted(COMBINATIONS))
def test_template_renders_without_hooks(dev_cluster: DevCluster, combo: str):
    docs = _template(dev_cluster, *COMBINATIONS[combo])
    for d in docs:
        annotations = d["metadata"].get("annotations") or {}
        assert not any(k.startswith("helm.sh/hook") for k in annotations), d["metadata"]
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    assert sum(d["kind"] == "Deployment" for d in docs) == (3 if combo == "shards" else 1)
    assert deploy["spec"]["replicas"] == (0 if combo == "local-operator" else 2)
    pod = deploy["spec"]["template"]["spec"]["containers"][0]
    assert pod["livenessProbe"] and pod["readinessProbe"] and pod["resources"]["limits"]
    kinds = {d["kind"] for d in docs}
    assert ("ServiceMonitor" in kinds) == (combo == "monitoring")
    assert ("PodMonitor" in kinds) == (combo == "monitoring")


@pytest.mark.parametrize("namespaces", [[], ["team-a", "team-b"]])
def test_each_operator_shard_is_a_deployment_with_its_own_peering(
    dev_cluster: DevCluster, namespaces: list[str]
):
    ns_args = ["--set", "rbac.watchNamespaces={" + ",".join(namespaces) + "}"] if namespaces else []
    for shards, names in [
        (1, ["rlenergy-operator"]),
        (3, ["rlenergy-operator-3-0", "rlenergy-operator-3-1", "rlenergy-operator-3-2"]),
    ]:
        docs = _template(dev_cluster, "--set", f"operator.shards={shards}", *ns_args)
        deploys = [d for d in docs if d["kind"] == "Deployment"]
        assert [d["metadata"]["name"] for d in deploys] == (
            ["rl-rl-energy-operator"]
            if shards == 1
            else [f"rl-rl-energy-operator-{k}" for k in range(shards)]
        )
        for k, d in enumerate(deploys):
            env = {
                e["name"]: e["value"] for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
            }
            assert env["RLENERGY_OPERATOR_SHARDS"] == str(shards)
            assert env["RLENERGY_OPERATOR_SHARD_INDEX"] == str(k)
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert labels["app.kubernetes.io/component"] == "operator"  # the Services select all
            assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        kind = "KopfPeering" if namespaces else "ClusterKopfPeering"
        peerings = sorted(
            (d["metadata"]["name"], d["metadata"].get("namespace"))
            for d in docs
            if d["kind"] == kind
        )
        assert peerings == sorted((n, ns) for n in names for ns in (namespaces or [None]))


def test_bad_values_fail_with_their_path(dev_cluster: DevCluster):
    for args, path in [
        (["--set", "agent.metricsPort=x"], "/agent/metricsPort"),
        (["--set", "operator.replicas=-1"], "/operator/replicas"),
        (["--set", "operator.shards=0"], "/operator/shards"),
        (["--set", "agent.stateDir=relative"], "/agent/stateDir"),
        (["--set", "agent.unknownKey=1"], "/agent"),
    ]:
        res = dev_cluster.helm("template", "rl", str(CHART), *args, check=False)
        assert res.returncode != 0 and path in res.stderr, res.stderr


def test_notes_warn_without_the_gpu_toleration(dev_cluster: DevCluster, namespace: str):
    dev_cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    res = dev_cluster.helm(
        "install", "notes", str(CHART), "-n", namespace, "--dry-run", "--set",
        "agent.tolerateGpuTaint=false",
    )  # fmt: skip
    assert "WARNING: agent.tolerateGpuTaint=false" in res.stdout
    assert "--set agent.tolerateGpuTaint=true" in res.stdout


def test_operator_renders_the_charts_agent_settings(
    dev_cluster: DevCluster, monkeypatch: pytest.MonkeyPatch
):
    from rlenergy_operator import builders, settings

    args = [
        "--set", "agent.image.repository=registry.example/agent", "--set", "agent.image.tag=9.9",
        "--set", "agent.priorityClassName=system-node-critical", "--set", "agent.metricsPort=9500",
        "--set", "agent.stateDir=/srv/rlenergy", "--set", "agent.resources.limits.memory=80Mi",
        "--set", "agent.socketDir=/run/rl-sock", "--set", "agent.tokenAudience=rle-prod",
    ]  # fmt: skip
    docs = _template(dev_cluster, *args)
    cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")
    )
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"][0]["configMapRef"]["name"] == cm["metadata"]["name"]
    for key, value in cm["data"].items():
        monkeypatch.setenv(key, value)
    ds = builders.agent_daemonset(settings.OperatorConfig())
    assert ds["metadata"]["namespace"] == "rl-energy-system"
    pod = ds["spec"]["template"]["spec"]
    agent = pod["containers"][0]
    assert agent["image"] == "registry.example/agent:9.9"
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["serviceAccountName"] == "rl-rl-energy-agent"
    assert agent["ports"][0]["containerPort"] == 9500
    assert {"name": "RLENERGY_AGENT_METRICS_PORT", "value": "9500"} in agent["env"]
    assert {"name": "RLENERGY_AGENT_TOKEN_AUDIENCE", "value": "rle-prod"} in agent["env"]
    assert agent["resources"]["limits"]["memory"] == "80Mi"
    paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    assert paths == {
        "state": "/srv/rlenergy",
        "pod-resources": "/var/lib/kubelet/pod-resources",
        "socket": "/run/rl-sock",
    }
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    sec = agent["securityContext"]
    assert sec["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert sec["privileged"] is False and sec["readOnlyRootFilesystem"] is True
    monkeypatch.setenv("RLENERGY_OPERATOR_AGENT_TOLERATE_GPU_TAINT", "false")
    assert (
        builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"][
            "tolerations"
        ]
        == []
    )


def test_helm_install_and_least_privilege_rbac(dev_cluster: DevCluster, namespace: str):
    dev_cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    release = "rbac"
    dev_cluster.helm(
        "install", release, str(CHART), "-n", namespace, "--set", "operator.replicas=0",
        "--wait", "--timeout", "60s",
    )  # fmt: skip
    try:
        op = f"system:serviceaccount:{namespace}:{release}-rl-energy"
        agent = f"system:serviceaccount:{namespace}:{release}-rl-energy-agent"

        def can(who: str, *args: str) -> bool:
            res = dev_cluster.kubectl("auth", "can-i", *args, f"--as={who}", check=False)
            return res.stdout.strip() == "yes"

        assert can(op, "patch", "rlenergypolicies.rlenergy.io/status", "-A")
        assert can(op, "watch", "rlenergynodereports.rlenergy.io", "-A")
        assert can(op, "create", "daemonsets.apps", "-n", namespace)
        assert can(op, "patch", "clusterkopfpeerings.kopf.dev")
        assert not can(op, "create", "daemonsets.apps", "-n", "default")
        assert not can(op, "get", "secrets", "-n", namespace)
        assert can(op, "list", "nodes")  # their taints, when no agent schedules
        assert not can(op, "patch", "nodes")
        assert not can(op, "create", "rlenergynodereports.rlenergy.io", "-A")
        # FlexFloor scale: the /scale subresource of rollout worker sets, nothing more
        assert can(op, "patch", "statefulsets.apps", "--subresource=scale", "-n", "default")
        assert can(op, "get", "statefulsets.apps", "--subresource=scale", "-n", "default")
        assert not can(op, "patch", "statefulsets.apps", "-n", "default")
        assert not can(op, "delete", "statefulsets.apps", "-n", "default")

        # a RayCluster worker group: get and patch the RayCluster (no /scale), nothing more.
        # A SubjectAccessReview names the group: `auth can-i` cannot without KubeRay's CRD.
        def can_ray(verb: str) -> bool:
            review = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": op,
                    "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                    "resourceAttributes": {
                        "group": "ray.io",
                        "resource": "rayclusters",
                        "verb": verb,
                        "namespace": "default",
                    },
                },
            }
            res = dev_cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review))
            return bool(json.loads(res.stdout)["status"].get("allowed"))

        assert can_ray("get") and can_ray("patch")
        for verb in ("update", "delete", "create", "list", "watch"):
            assert not can_ray(verb), verb
        assert not can(op, "delete", "pods", "-n", "default")
        assert can(agent, "create", "rlenergynodereports.rlenergy.io", "-n", "default")
        assert can(agent, "patch", "rlenergynodereports.rlenergy.io", "-n", "default")
        assert can(agent, "get", "rlenergypolicies.rlenergy.io", "-n", "default")
        assert can(agent, "list", "pods", "-A")
        # policy discovery: every namespace's policies (read only) and pods (list only)
        assert can(agent, "list", "rlenergypolicies.rlenergy.io", "-A")
        assert not can(agent, "create", "rlenergypolicies.rlenergy.io", "-n", "default")
        assert not can(agent, "delete", "rlenergypolicies.rlenergy.io", "-n", "default")
        assert not can(agent, "get", "secrets", "-n", "default")
        assert not can(agent, "list", "secrets", "-A")
        assert not can(agent, "patch", "pods", "-n", "default")
        assert not can(agent, "patch", "rlenergypolicies.rlenergy.io", "-A")
        assert not can(agent, "patch", "rlenergypolicies.rlenergy.io/status", "-A")
        assert not can(agent, "get", "secrets", "-A")
        assert not can(agent, "create", "daemonsets.apps", "-n", namespace)
    finally:
        dev_cluster.helm("uninstall", release, "-n", namespace, "--wait")


def test_the_charts_agent_role_reviews_tokens_and_nothing_more(dev_cluster: DevCluster):
    """The chart's agent ClusterRole, applied to the API server: TokenReview create (the trainer
    pods' bearer tokens, ``rlenergy_agent.identity``) is granted, asked through a
    SubjectAccessReview; other review kinds and pod reads beyond list are not."""
    docs = _template(dev_cluster)
    role = next(
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-agent")
    )
    assert {
        "apiGroups": ["authentication.k8s.io"],
        "resources": ["tokenreviews"],
        "verbs": ["create"],
    } in role["rules"]
    binding = next(
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == role["metadata"]["name"]
    )
    (sa,) = binding["subjects"]
    name = f"chart-agent-{uuid.uuid4().hex[:6]}"
    role["metadata"] = {"name": name}
    binding["metadata"] = {"name": name}
    binding["roleRef"]["name"] = name
    items = {"apiVersion": "v1", "kind": "List", "items": [role, binding]}
    dev_cluster.kubectl("apply", "-f", "-", input=json.dumps(items))
    try:
        user = f"system:serviceaccount:{sa['namespace']}:{sa['name']}"

        def allowed(group: str, resource: str, verb: str) -> bool:
            review = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": user,
                    "groups": ["system:serviceaccounts"],
                    "resourceAttributes": {"group": group, "resource": resource, "verb": verb},
                },
            }
            res = dev_cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review))
            return bool(json.loads(res.stdout)["status"].get("allowed"))

        assert allowed("authentication.k8s.io", "tokenreviews", "create")
        assert not allowed("authorization.k8s.io", "subjectaccessreviews", "create")
        assert not allowed("", "serviceaccounts/token", "create")
        assert not allowed("", "pods", "get")
    finally:
        dev_cluster.kubectl("delete", "-f", "-", input=json.dumps(items), check=False)
