"""Bad policy specs through the real API server (``kubectl apply --dry-run=server``), fuzzed
with hypothesis, and the agent DaemonSet's securityContext through server-side dry-run.

The least-privilege RBAC matrix is tests/e2e/test_privilege.py's: it asks the API server about
the roles the chart really installs (a hand-copied rule set here could drift from the chart).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlenergy_dev.devcluster import DevCluster

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
