"""Bad policy specs through the real API server (``kubectl apply --dry-run=server``), fuzzed
with hypothesis, and the least-privilege RBAC matrix of the operator's and the agent's
ServiceAccounts (``kubectl auth can-i``).

RBAC source: the Helm chart has no RBAC templates yet, so the roles below are the ones
documented in docs/operator.md ("RBAC the chart must grant") and docs/agent.md / the agent's
code (its report, the policy's status.plan, the pod listing for UIDs). When the chart ships
them, render it instead (``helm template``) and keep this matrix.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlenergy.devcluster import DevCluster

VALID: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "fuzz"}},
    "mode": "sync",
    "phases": [
        {"name": "generation", "minThroughputRatio": 0.95},
        {
            "name": "training",
            "minThroughputRatio": 0.97,
            "clockRangeMHz": {"minClockMHz": 1200, "maxClockMHz": 1980},
            "stepMHz": 60,
        },
    ],
    "controller": {"mode": "enforce", "warmupSteps": 2, "trialSteps": 8, "maxTrialFraction": 0.25},
}
PATHS = [
    ("mode",),
    ("phaseSource",),
    ("selector",),
    ("phases",),
    ("phases", 0, "name"),
    ("phases", 0, "minThroughputRatio"),
    ("phases", 1, "clockRangeMHz", "minClockMHz"),
    ("phases", 1, "stepMHz"),
    ("phases", 0, "clockCandidatesMHz"),
    ("controller", "mode"),
    ("controller", "warmupSteps"),
    ("controller", "trialSteps"),
    ("controller", "maxTrialFraction"),
    ("controller", "driftThreshold"),
    ("rollout",),
    ("rollout", "minActiveWorkers"),
]
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.lists(st.integers(-5, 5000), max_size=4),
    st.dictionaries(st.sampled_from(["a", "name", "minClockMHz"]), st.integers(), max_size=2),
)


def _set(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(doc))
    cur: Any = out
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return out


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), junk), min_size=1, max_size=3))
def test_fuzzed_policy_specs_are_accepted_or_refused_with_the_field_named(
    chaos_cluster: DevCluster, edits: list[tuple[tuple[Any, ...], Any]]
):
    spec = VALID
    for path, value in edits:
        try:
            spec = _set(spec, path, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced the parent
    body = {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": "fuzz", "namespace": "default"},
        "spec": spec,
    }
    res = chaos_cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=json.dumps(body), check=False, timeout=60
    )
    if res.returncode == 0:
        return
    err = res.stderr
    assert "InternalError" not in err and "Internal error" not in err, err
    assert "spec." in err, f"refusal does not name the field: {err}"


# ----- RBAC ------------------------------------------------------------------------------------
OPERATOR_RULES = [
    {
        "apiGroups": ["rlenergy.io"],
        "resources": ["rlenergypolicies"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {
        "apiGroups": ["rlenergy.io"],
        "resources": ["rlenergypolicies/status"],
        "verbs": ["get", "patch"],
    },
    {
        "apiGroups": ["rlenergy.io"],
        "resources": ["rlenergynodereports"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings", "kopfpeerings"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {
        "apiGroups": ["apps"],
        "resources": ["statefulsets/scale"],
        "verbs": ["get", "patch", "update"],
    },
    {
        "apiGroups": ["leaderworkerset.x-k8s.io"],
        "resources": ["leaderworkersets/scale"],
        "verbs": ["get", "patch", "update"],
    },
    {"apiGroups": ["ray.io"], "resources": ["rayclusters"], "verbs": ["get", "patch"]},
]
OPERATOR_NS_RULES = [
    {
        "apiGroups": ["apps"],
        "resources": ["daemonsets"],
        "verbs": ["get", "create", "patch", "delete"],
    },
]
AGENT_RULES = [
    {
        "apiGroups": ["rlenergy.io"],
        "resources": ["rlenergynodereports"],
        "verbs": ["get", "create", "patch"],
    },
    {"apiGroups": ["rlenergy.io"], "resources": ["rlenergypolicies"], "verbs": ["get", "list"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
]

# (who, verb, resource, namespace or "" for the operator's namespace, allowed)
MATRIX = [
    ("operator", "patch", "rlenergypolicies", "team-a", True),
    ("operator", "patch", "rlenergypolicies/status", "team-a", True),
    ("operator", "watch", "rlenergynodereports", "team-a", True),
    ("operator", "create", "daemonsets", "", True),
    ("operator", "delete", "daemonsets", "", True),
    ("operator", "create", "events", "team-a", True),
    ("operator", "patch", "clusterkopfpeerings", "", True),
    ("operator", "create", "daemonsets", "team-a", False),
    ("operator", "create", "rlenergynodereports", "team-a", False),
    ("operator", "patch", "rlenergynodereports", "team-a", False),
    ("operator", "delete", "rlenergypolicies", "team-a", False),
    ("operator", "update", "rlenergypolicies", "team-a", False),
    ("operator", "get", "secrets", "team-a", False),
    ("operator", "get", "secrets", "", False),
    ("operator", "create", "pods", "team-a", False),
    ("operator", "create", "clusterrolebindings", "", False),
    ("operator", "delete", "pods", "team-a", False),
    ("agent", "create", "rlenergynodereports", "team-a", True),
    ("agent", "patch", "rlenergynodereports", "team-a", True),
    ("agent", "get", "rlenergypolicies", "team-a", True),
    ("agent", "list", "rlenergypolicies", "team-a", True),  # discovery
    ("agent", "list", "pods", "team-a", True),
    ("agent", "patch", "rlenergypolicies", "team-a", False),
    ("agent", "update", "rlenergypolicies", "team-a", False),
    ("agent", "create", "rlenergypolicies", "team-a", False),
    ("agent", "delete", "rlenergypolicies", "team-a", False),
    ("agent", "patch", "rlenergypolicies/status", "team-a", False),
    ("agent", "delete", "rlenergynodereports", "team-a", False),
    ("agent", "get", "secrets", "team-a", False),
    ("agent", "list", "secrets", "team-a", False),
    ("agent", "get", "secrets", "", False),
    ("agent", "create", "pods", "team-a", False),
    ("agent", "delete", "pods", "team-a", False),
    ("agent", "patch", "nodes", "", False),
    ("agent", "create", "daemonsets", "", False),
    ("agent", "create", "tokenreviews", "", True),  # the trainer pods' tokens (identity.py)
    ("agent", "create", "subjectaccessreviews", "", False),
    ("operator", "create", "tokenreviews", "", False),
]


@pytest.fixture(scope="module")
def rbac(chaos_cluster: DevCluster) -> str:
    ns = "rl-energy-rbac"
    items: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "rlenergy-operator", "namespace": ns},
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "rlenergy-node-agent", "namespace": ns},
        },
    ]
    for who, rules, sa in (
        ("rlenergy-operator", OPERATOR_RULES, "rlenergy-operator"),
        ("rlenergy-node-agent", AGENT_RULES, "rlenergy-node-agent"),
    ):
        items.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": f"rbac-test-{who}"},
                "rules": rules,
            }
        )
        items.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"rbac-test-{who}"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": f"rbac-test-{who}",
                },
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
            }
        )
    items.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "rlenergy-operator", "namespace": ns},
            "rules": OPERATOR_NS_RULES,
        }
    )
    items.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "rlenergy-operator", "namespace": ns},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "rlenergy-operator",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "rlenergy-operator", "namespace": ns}],
        }
    )
    chaos_cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    )
    return ns


@pytest.mark.parametrize("who,verb,resource,namespace,allowed", MATRIX, ids=lambda v: str(v))
def test_rbac_least_privilege(
    chaos_cluster: DevCluster,
    rbac: str,
    who: str,
    verb: str,
    resource: str,
    namespace: str,
    allowed: bool,
):
    sa = {"operator": "rlenergy-operator", "agent": "rlenergy-node-agent"}[who]
    ns = namespace or rbac
    res = chaos_cluster.kubectl(
        "auth",
        "can-i",
        verb,
        resource,
        "-n",
        ns,
        f"--as=system:serviceaccount:{rbac}:{sa}",
        check=False,
    )
    answer = res.stdout.strip()
    assert answer == ("yes" if allowed else "no"), (
        f"{who} {verb} {resource} in {ns}: {answer} {res.stderr}"
    )


@pytest.mark.parametrize(
    "verb,allowed",
    [("get", True), ("patch", True)]
    + [(v, False) for v in ("update", "delete", "create", "list", "watch")],
)
def test_rbac_operator_rayclusters_get_and_patch_only(
    chaos_cluster: DevCluster, rbac: str, verb: str, allowed: bool
):
    """A RayCluster worker group (FlexFloor scale): get and patch, nothing more. Asked through a
    SubjectAccessReview, which names the API group (``auth can-i`` cannot resolve
    ``rayclusters.ray.io`` without KubeRay's CRD and would ask about the core group)."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{rbac}:rlenergy-operator",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{rbac}"],
            "resourceAttributes": {
                "group": "ray.io",
                "resource": "rayclusters",
                "verb": verb,
                "namespace": "team-a",
            },
        },
    }
    res = chaos_cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review))
    assert bool(json.loads(res.stdout)["status"].get("allowed")) is allowed, res.stdout


def test_the_agent_daemonset_is_not_privileged(chaos_cluster: DevCluster):
    """The operator's agent DaemonSet: CAP_SYS_ADMIN only, everything else dropped, no privileged,
    read-only root filesystem (the builder's output, checked through server-side dry-run)."""
    from rlenergy_operator import builders, settings

    ds = builders.agent_daemonset(settings.OperatorConfig(namespace="default"))
    res = chaos_cluster.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(ds)
    )
    pod = json.loads(res.stdout)["spec"]["template"]["spec"]
    for c in pod["containers"]:
        sec = c["securityContext"]
        assert sec.get("privileged") is False, sec
        assert sec["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}, sec
        assert sec.get("allowPrivilegeEscalation") is False, sec
        assert sec.get("readOnlyRootFilesystem") is True, sec
    assert not pod.get("hostNetwork") and not pod.get("hostPID"), pod
