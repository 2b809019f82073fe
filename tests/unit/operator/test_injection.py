"""The webhook's pod injection, pure: whom it changes, what it adds, what it never touches."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from rlenergy_operator import injection

from rlenergy.api import signals

CFG = injection.InjectConfig(operator_namespace="rl-energy-system", port=9403)
SELECTOR = {"matchLabels": {"app": "trainer"}}
POLICIES = [("job", SELECTOR)]


def _pod(labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "trainer-0",
            "namespace": "team-a",
            "labels": {"app": "trainer", injection.LABEL: "true"} if labels is None else labels,
        },
        "spec": {"containers": [{"name": "trainer", "image": "verl"}], **spec},
    }


# ----- whom ----------------------------------------------------------------------------------


def test_an_opted_in_pod_a_policy_selects_is_injected() -> None:
    d = injection.decide(_pod(), "team-a", POLICIES, CFG)
    assert (d.inject, d.reason, d.policies) == (True, "Selected", ("job",))


@pytest.mark.parametrize(
    ("labels", "reason"),
    [
        ({"app": "trainer"}, "NotOptedIn"),
        ({"app": "trainer", injection.LABEL: "false"}, "NotOptedIn"),
        ({"app": "trainer", injection.LABEL: "True"}, "NotOptedIn"),
        ({"app": "other", injection.LABEL: "true"}, "NoPolicy"),
    ],
)
def test_pods_without_the_label_or_a_policy_are_left_alone(
    labels: dict[str, str], reason: str
) -> None:
    assert injection.decide(_pod(labels), "team-a", POLICIES, CFG) == injection.Decision(
        False, reason
    )


def test_the_operators_own_namespace_is_never_injected() -> None:
    d = injection.decide(_pod(), "rl-energy-system", POLICIES, CFG)
    assert (d.inject, d.reason) == (False, "OperatorNamespace")


def test_no_policy_in_the_namespace_means_no_injection() -> None:
    assert injection.decide(_pod(), "team-a", [], CFG).reason == "NoPolicy"


def test_an_invalid_selector_selects_nothing_and_others_still_count() -> None:
    bad = {"matchExpressions": [{"key": "app", "operator": "Near"}]}
    assert injection.decide(_pod(), "team-a", [("bad", bad)], CFG).inject is False
    d = injection.decide(_pod(), "team-a", [("bad", bad), ("job", SELECTOR)], CFG)
    assert d.policies == ("job",)


# ----- what ----------------------------------------------------------------------------------


def test_the_injection_adds_the_projected_volume_mount_and_env() -> None:
    pod = injection.injected(_pod(), CFG)
    (vol,) = pod["spec"]["volumes"]
    assert vol["name"] == injection.VOLUME
    sources = vol["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["audience"] == "rlenergy-agent"
    assert sources[1]["configMap"]["name"] == injection.CA_CONFIGMAP
    assert "hostPath" not in vol
    c = pod["spec"]["containers"][0]
    assert c["volumeMounts"] == [
        {"name": injection.VOLUME, "mountPath": injection.MOUNT_PATH, "readOnly": True}
    ]
    env = {e["name"]: e for e in c["env"]}
    assert env[signals.HOST_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env[signals.PORT_ENV]["value"] == "9403"
    assert env[signals.TOKEN_FILE_ENV]["value"] == signals.DEFAULT_TOKEN_FILE
    assert env[signals.CA_FILE_ENV]["value"] == signals.DEFAULT_CA_FILE


def test_the_injection_is_idempotent() -> None:
    once = injection.injected(_pod(), CFG)
    again = copy.deepcopy(once)
    assert injection.inject_into(again, CFG) == []
    assert again == once


def test_init_containers_and_every_container_get_it() -> None:
    pod = _pod(initContainers=[{"name": "warm", "image": "x"}])
    pod["spec"]["containers"].append({"name": "sidecar", "image": "y"})
    added = injection.inject_into(pod, CFG)
    assert {a for a in added if a.startswith("mount:")} == {
        "mount:warm",
        "mount:trainer",
        "mount:sidecar",
    }
    assert len(pod["spec"]["volumes"]) == 1


def test_the_users_volumes_mounts_and_env_are_kept() -> None:
    user_env = [
        {"name": signals.PORT_ENV, "value": "9999"},
        {"name": "OTHER", "value": "1"},
    ]
    user_mounts = [{"name": "data", "mountPath": "/data"}]
    pod = _pod(volumes=[{"name": "data", "emptyDir": {}}])
    pod["spec"]["containers"][0].update(env=copy.deepcopy(user_env), volumeMounts=list(user_mounts))
    injection.inject_into(pod, CFG)
    c = pod["spec"]["containers"][0]
    assert c["env"][:2] == user_env  # first, unchanged; the user's port wins
    assert [e["name"] for e in c["env"]].count(signals.PORT_ENV) == 1
    assert c["volumeMounts"][0] == user_mounts[0]
    assert pod["spec"]["volumes"][0] == {"name": "data", "emptyDir": {}}


def test_a_hand_written_token_mount_is_kept_and_no_second_volume_added() -> None:
    """A pod written as the docs once showed (its own token volume at the same path)."""
    pod = _pod(volumes=[{"name": "rlenergy-token", "projected": {"sources": []}}])
    pod["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "rlenergy-token", "mountPath": injection.MOUNT_PATH, "readOnly": True}
    ]
    injection.inject_into(pod, CFG)
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["rlenergy-token"]
    assert len(pod["spec"]["containers"][0]["volumeMounts"]) == 1


def test_a_pod_that_already_has_the_volume_gets_no_second_copy() -> None:
    pod = _pod(volumes=[injection.volume(CFG)])
    injection.inject_into(pod, CFG)
    assert [v["name"] for v in pod["spec"]["volumes"]] == [injection.VOLUME]


def test_injected_leaves_its_argument_unchanged() -> None:
    pod = _pod()
    before = copy.deepcopy(pod)
    injection.injected(pod, CFG)
    assert pod == before


def test_the_injected_spec_has_nothing_pod_security_restricted_refuses() -> None:
    pod = injection.injected(_pod(), CFG)
    text = repr(pod)
    for forbidden in ("hostPath", "hostNetwork", "privileged", "capabilities", "hostPort"):
        assert forbidden not in text
    assert set(pod["spec"]["volumes"][0]) == {"name", "projected"}


# ----- pods admitted without it --------------------------------------------------------------


def test_selected_opted_in_pods_without_the_volume_are_ungoverned() -> None:
    plain = _pod()
    done = injection.injected(_pod(), CFG)
    done["metadata"]["name"] = "trainer-1"
    other = _pod({"app": "other", injection.LABEL: "true"})
    not_opted = _pod({"app": "trainer"})
    assert injection.ungoverned([plain, done, other, not_opted], SELECTOR) == ["trainer-0"]
