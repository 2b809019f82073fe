"""Pure builders (rlenergy_operator.builders) and the operator settings.

We test these aspects:
* the node-agent DaemonSet: GPU nodes only, tolerates the nvidia.com/gpu taint, CAP_SYS_ADMIN
  only (not privileged, everything else dropped), seccomp RuntimeDefault, AppArmor only when
  set (RuntimeDefault, Unconfined, localhost/<profile>), NODE_NAME from the downward API; the
  signal-socket hostPath at the SDK's default folder; no policy (agents discover it); liveness
  and readiness probes on /healthz;
* conditions keep lastTransitionTime while their status holds;
* merge patches: nothing when nothing changed, deletions as null, lists replaced;
* plan change detection and the Event text; node summary and the Progressing/Degraded logic;
* settings: env prefix, units; kopf tuned for status storage, our finalizer and peering name
  (status kept in the declared schema, written through /status, one active operator).
"""

from __future__ import annotations

import kopf
import pytest
from rlenergy_operator import builders, settings

from rlenergy.api import node as api_node
from rlenergy.api import signals
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.sdk import trainer


def test_agent_daemonset():
    cfg = settings.OperatorConfig(namespace="ops", agent_image="img:1")
    ds = builders.agent_daemonset(cfg)
    assert ds["metadata"] == {
        "name": "rlenergy-node-agent",
        "namespace": "ops",
        "labels": builders.AGENT_LABELS,
    }
    pod = ds["spec"]["template"]["spec"]
    assert (
        ds["spec"]["selector"]["matchLabels"].items()
        <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    expr = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]["matchExpressions"][0]
    assert expr == {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    (c,) = pod["containers"]
    assert c["image"] == "img:1"
    assert c["securityContext"]["privileged"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "priorityClassName" not in pod
    # the signal socket: its host folder mounted where the SDK looks (trainers mount the same)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert volumes["socket"]["hostPath"] == {
        "path": "/var/run/rlenergy",
        "type": "DirectoryOrCreate",
    }
    assert mounts["socket"] == {"name": "socket", "mountPath": "/var/run/rlenergy"}
    assert env["RLENERGY_AGENT_SOCKET_PATH"]["value"] == trainer.DEFAULT_SOCKET
    # the audience the trainer pods' projected tokens are issued for (chart agent.tokenAudience)
    assert env["RLENERGY_AGENT_TOKEN_AUDIENCE"]["value"] == signals.TOKEN_AUDIENCE
    # no policy: one DaemonSet serves every policy, each agent discovers its node's policy
    assert "RLENERGY_AGENT_POLICY_NAME" not in env and "RLENERGY_AGENT_NAMESPACE" not in env
    # liveness and readiness on /healthz (fails only when NVML answers on no GPU)
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    live = c["livenessProbe"]
    assert live["failureThreshold"] * live["periodSeconds"] >= 60 and live["timeoutSeconds"] >= 5


def test_agent_daemonset_socket_dir_is_a_setting(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RLENERGY_OPERATOR_AGENT_SOCKET_DIR", "/run/rl")
    pod = builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"]
    (socket_volume,) = [v for v in pod["volumes"] if v["name"] == "socket"]
    assert socket_volume["hostPath"]["path"] == "/run/rl"
    # the container side stays where the SDK looks
    assert {"name": "socket", "mountPath": "/var/run/rlenergy"} in pod["containers"][0][
        "volumeMounts"
    ]
    with pytest.raises(ValueError, match="pattern"):
        settings.OperatorConfig(agent_socket_dir="relative")


def test_agent_runs_under_the_default_seccomp_profile_and_a_chosen_apparmor_profile(
    monkeypatch: pytest.MonkeyPatch,
):
    def context() -> dict:
        pod = builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"]
        return dict(pod["containers"][0]["securityContext"])

    ctx = context()
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert "appArmorProfile" not in ctx  # default: the runtime decides (nodes without AppArmor)
    for value, field in (
        ("RuntimeDefault", {"type": "RuntimeDefault"}),
        ("localhost/rlenergy-agent", {"type": "Localhost", "localhostProfile": "rlenergy-agent"}),
    ):
        monkeypatch.setenv("RLENERGY_OPERATOR_AGENT_APPARMOR_PROFILE", value)
        assert context()["appArmorProfile"] == field
    for bad in ("runtime/default", "localhost/", "Localhost"):
        with pytest.raises(ValueError, match="pattern"):
            settings.OperatorConfig(agent_apparmor_profile=bad)


def test_agent_daemonset_for_a_node_without_pod_network(monkeypatch: pytest.MonkeyPatch):
    # The chart passes these as JSON env (configmap.yaml); the dev cluster's real node uses them.
    monkeypatch.setenv("RLENERGY_OPERATOR_AGENT_HOST_NETWORK", "true")
    monkeypatch.setenv("RLENERGY_OPERATOR_AGENT_API_SERVER_HOST", "127.0.0.1")
    monkeypatch.setenv("RLENERGY_OPERATOR_AGENT_API_SERVER_PORT", "6443")
    monkeypatch.setenv(
        "RLENERGY_OPERATOR_AGENT_EXTRA_ENV", '[{"name": "LD_LIBRARY_PATH", "value": "/lib/x"}]'
    )
    monkeypatch.setenv(
        "RLENERGY_OPERATOR_AGENT_EXTRA_VOLUMES", '[{"name": "nvml", "hostPath": {"path": "/x"}}]'
    )
    monkeypatch.setenv(
        "RLENERGY_OPERATOR_AGENT_EXTRA_VOLUME_MOUNTS", '[{"name": "nvml", "mountPath": "/lib/x"}]'
    )
    pod = builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == "6443"
    assert env["LD_LIBRARY_PATH"] == "/lib/x"
    assert {"name": "nvml", "mountPath": "/lib/x"} in c["volumeMounts"]
    assert {"name": "nvml", "hostPath": {"path": "/x"}} in pod["volumes"]
    # Defaults: the pod network and the kubernetes Service, nothing extra.
    for var in ("HOST_NETWORK", "API_SERVER_HOST", "API_SERVER_PORT", "EXTRA_ENV",
                "EXTRA_VOLUMES", "EXTRA_VOLUME_MOUNTS"):  # fmt: skip
        monkeypatch.delenv(f"RLENERGY_OPERATOR_AGENT_{var}")
    pod = builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"]
    assert "hostNetwork" not in pod
    assert not {"KUBERNETES_SERVICE_HOST", "LD_LIBRARY_PATH"} & {
        e["name"] for e in pod["containers"][0]["env"]
    }


def test_condition_transition_time():
    first = builders.condition("Ready", True, "AgentsDeployed", "ok", generation=1, now="t1")
    same = builders.condition(
        "Ready", True, "AgentsDeployed", "still", generation=2, now="t2", previous=[first]
    )
    flipped = builders.condition(
        "Ready", False, "InvalidSpec", "bad", generation=3, now="t3", previous=[same]
    )
    assert same["lastTransitionTime"] == "t1" and flipped["lastTransitionTime"] == "t3"
    assert flipped["observedGeneration"] == 3 and flipped["status"] == "False"
    merged = builders.merge_conditions(
        [flipped], [builders.condition("Degraded", False, "AsExpected", "", generation=3, now="t")]
    )
    assert [c["type"] for c in merged] == ["Ready", "Degraded"]


def test_merge_patch():
    old = {"a": {"x": 1, "y": 2}, "l": [1, 2], "k": 3}
    assert builders.merge_patch(old, {"a": {"x": 1, "y": 2}, "l": [1, 2]}) == {}
    assert builders.merge_patch(old, {"a": {"x": 1}, "l": [2]}) == {"a": {"y": None}, "l": [2]}
    assert builders.merge_patch(None, {"a": 1}) == {"a": 1}


def _plan(clock: int | None, state: str = "locked") -> api_node.ClockPlan:
    return api_node.ClockPlan(
        step=5, phases=[api_node.PhasePlan(phase="generation", clock_mhz=clock, state=state)]
    )


def test_plan_changed_and_description():
    old = _plan(1410).model_dump(by_alias=True)
    assert not builders.plan_changed(old, _plan(1410))
    assert builders.plan_changed(old, _plan(1320))
    assert builders.plan_changed(None, _plan(1320))
    assert builders.describe_plan(_plan(None, "warmup")) == "step 5: generation default (warmup)"


def test_node_summary_and_conditions():
    reps = [
        api_node.NodeReport(policy_name="p", node_name="a", gpus=[api_node.GpuStatus(uuid="G1")]),
        api_node.NodeReport(
            policy_name="p",
            node_name="b",
            gpus=[api_node.GpuStatus(uuid="G2", condition="lost", reason="Xid 79")],
        ),
    ]
    nodes = builders.node_summary(reps)
    assert (nodes.ready, nodes.total) == (1, 2)
    assert [e.reason for e in nodes.errors] == ["GPULost", "NoUsableGPU"]
    assert builders.degraded_condition(nodes, True, True)[:2] == (True, "NodeErrors")
    ok = api_status.NodesStatus(ready=1, total=1)
    assert builders.degraded_condition(ok, False, True)[:2] == (True, "NoClockTable")
    assert builders.degraded_condition(ok, True, True)[0] is False
    ph = lambda n, s: api_status.PhaseStatus(name=n, state=s)  # noqa: E731
    assert builders.progress_condition([ph("generation", "trial"), ph("training", "locked")])[
        :2
    ] == (True, "SelectingClocks")
    assert builders.progress_condition([ph("generation", "locked")])[1] == "ClocksLocked"
    assert builders.progress_condition([ph("generation", "observe")])[1] == "Observing"


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RLENERGY_OPERATOR_RECONCILE_INTERVAL_S", "0.5")
    monkeypatch.setenv("RLENERGY_OPERATOR_NAMESPACE", "x")
    cfg = settings.OperatorConfig()
    assert cfg.reconcile_interval_s == 0.5 and cfg.namespace == "x"
    monkeypatch.setenv("RLENERGY_OPERATOR_RESET_DEADLINE_S", "-1")
    with pytest.raises(ValueError):
        settings.OperatorConfig()


def test_kopf_is_tuned_for_status_storage_our_finalizer_and_peering():
    ks = kopf.OperatorSettings()
    settings.configure_kopf(ks, settings.OperatorConfig())
    # Progress and diff base in the declared status.kopf, not annotations (GitOps).
    assert isinstance(ks.persistence.progress_storage, kopf.StatusProgressStorage)
    assert isinstance(ks.persistence.diffbase_storage, kopf.StatusDiffBaseStorage)
    assert ks.persistence.finalizer == "rlenergy.io/reset-clocks"
    # A peering name of our own, an explicit priority.
    assert ks.peering.name == "rlenergy-operator" and ks.peering.priority == 100
    assert ks.execution.default_backoff == 5.0
    assert ks.execution.max_workers == 16  # 20 policies' passes wait on the API at once


def test_the_diff_base_skips_node_reports_and_keeps_policies():
    """kopf deep-copies a body into its diff base on every event; reports are never compared."""
    ks = kopf.OperatorSettings()
    settings.configure_kopf(ks, settings.OperatorConfig())
    store = ks.persistence.diffbase_storage
    report = kopf.Body(
        {
            "apiVersion": "rlenergy.io/v1alpha1",
            "kind": "RLEnergyNodeReport",
            "metadata": {"name": "p.n1", "namespace": "ns"},
            "spec": {"policyName": "p", "steps": [{"step": 0}]},
        }
    )
    assert store.build(body=report) == {}
    policy = kopf.Body(
        {
            "apiVersion": "rlenergy.io/v1alpha1",
            "kind": "RLEnergyPolicy",
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"a": "b"}}},
            "status": {"totals": {}},
        }
    )
    assert store.build(body=policy)["spec"] == {"selector": {"matchLabels": {"a": "b"}}}


def test_agent_daemonset_serves_signals_over_tls_on_the_node_ip(monkeypatch: pytest.MonkeyPatch):
    c = builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"][
        "containers"
    ][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["RLENERGY_AGENT_TLS_PORT"]["value"] == "9403"
    assert env["RLENERGY_AGENT_NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    (port,) = [p for p in c["ports"] if p["name"] == "signals-tls"]
    assert port["containerPort"] == port["hostPort"] == 9403
    monkeypatch.setenv("RLENERGY_OPERATOR_AGENT_TLS_PORT", "0")
    c = builders.agent_daemonset(settings.OperatorConfig())["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert "RLENERGY_AGENT_TLS_PORT" not in {e["name"] for e in c["env"]}
    assert [p["name"] for p in c["ports"]] == ["metrics"]
