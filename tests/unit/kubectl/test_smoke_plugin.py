"""``kubectl rlenergy smoke``, pure parts: the manifests it applies and how it reads the result.

We test these aspects:
* the smoke policy is a valid ``RLEnergyPolicy`` (the API model) that selects the smoke pod;
* the pod asks for one GPU, runs ``python3 -m rlenergy.sdk.smoke``, carries what the webhook
  would inject (the projected token for the agents' audience, the CA bundle, the endpoint
  environment the SDK reads) and meets Pod Security ``restricted`` unless ``host_network``,
  where the namespace the smoke test makes is ``privileged``;
* ``deploy/smoke/smoke.yaml`` is what ``manifest_text`` writes (the shipped manifests are the
  plugin's);
* ``evaluate`` finds the node report, the locked phases and the saving in a policy's status and
  its reports, and names what is missing; a saving of either sign counts, an unknown one not;
* the text names each of the three with ``ok`` or ``MISSING`` and ends with PASS or FAIL; the
  JSON object carries the same;
* the command on a fake API (``kube`` replaced): namespace, policy, then the pod with the
  DaemonSet's image, port and network (the namespace relabelled ``privileged`` for host
  networking), polling until all three show, then pod, policy and namespace deleted; exit 1
  with what is missing at the timeout, nothing deleted with ``--keep``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rlenergy_kubectl import smoke

from rlenergy.api import signals
from rlenergy.api.v1alpha1 import policy as api_policy
from tests import factories

ROOT = Path(__file__).resolve().parents[3]


def _status(*, locked: bool, saving: float | None) -> dict[str, Any]:
    state = "locked" if locked else "trial"
    return {
        "phases": [
            {"name": "generation", "state": state, "clockMHz": 1155 if locked else None},
            {"name": "training", "state": "warmup", "clockMHz": None},
        ],
        "totals": {"steps": 9, "savingPercent": saving, "savedJoules": 321.0},
    }


def _policy(status: dict[str, Any] | None) -> dict[str, Any]:
    obj = smoke.policy("smoke-ns")
    if status is not None:
        obj["status"] = status
    return obj


def _report() -> dict[str, Any]:
    return factories.report_object(
        smoke.POLICY,
        "gpu-node-1",
        gpus=[{"uuid": "GPU-1", "condition": "ok", "lockedClockMHz": 1155}],
        lastStep=8,
    )


def test_policy_is_valid_and_selects_the_pod() -> None:
    body = smoke.policy("ns")
    spec = api_policy.RLEnergyPolicySpec.model_validate(body["spec"])
    assert spec.controller.mode == "enforce"
    pod = smoke.pod("ns", "img:1")
    assert body["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert body["metadata"] == {"name": smoke.POLICY, "namespace": "ns"}


def test_pod_has_one_gpu_the_token_and_the_endpoint() -> None:
    pod = smoke.pod("ns", "reg/agent@sha256:abc", agent_port=9999, audience="aud")
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert c["image"] == "reg/agent@sha256:abc"
    assert c["command"][:3] == ["python3", "-m", "rlenergy.sdk.smoke"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"  # a quantity: a string
    env = {e["name"]: e for e in c["env"]}
    assert env[signals.HOST_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env[signals.PORT_ENV]["value"] == "9999"
    mount = c["volumeMounts"][0]
    assert env[signals.TOKEN_FILE_ENV]["value"] == f"{mount['mountPath']}/token"
    assert env[signals.CA_FILE_ENV]["value"] == f"{mount['mountPath']}/ca.crt"
    (vol,) = spec["volumes"]
    assert vol["name"] == mount["name"]
    token, ca = vol["projected"]["sources"]
    assert token["serviceAccountToken"]["audience"] == "aud"
    assert ca["configMap"]["name"] == "rlenergy-agent-ca"


def test_pod_meets_restricted_unless_host_network() -> None:
    pod = smoke.pod("ns", "img")
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert "hostNetwork" not in spec
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert all("hostPath" not in v for v in spec["volumes"])
    assert set(smoke.namespace_labels(False).values()) == {"restricted"}
    assert smoke.pod("ns", "img", host_network=True)["spec"]["hostNetwork"] is True
    assert set(smoke.namespace_labels(True).values()) == {"privileged"}


def test_shipped_manifest_is_current() -> None:
    shipped = (ROOT / "deploy" / "smoke" / "smoke.yaml").read_text()
    assert shipped == smoke.manifest_text(), "regenerate: see rlenergy_kubectl.smoke"


def test_evaluate_sees_report_lock_and_saving() -> None:
    result = smoke.evaluate(_policy(_status(locked=True, saving=9.8)), [_report()])
    assert result.ok and result.missing == []
    assert result.locks == {"generation": 1155}
    assert result.reports[0]["node"] == "gpu-node-1"
    assert result.reports[0]["lockedClocksMHz"] == {"GPU-1": 1155}
    assert (result.saving_percent, result.saved_joules, result.steps) == (9.8, 321.0, 9)


def test_evaluate_names_what_is_missing() -> None:
    assert smoke.evaluate(_policy(None), []).missing == ["report", "lock", "saving"]
    unlocked = smoke.evaluate(_policy(_status(locked=False, saving=None)), [_report()])
    assert unlocked.missing == ["lock", "saving"]
    negative = smoke.evaluate(_policy(_status(locked=True, saving=-2.0)), [_report()])
    assert negative.ok  # an idle real GPU: the loop works, the sign is the GPU's


def test_text_and_json() -> None:
    ok = smoke.evaluate(_policy(_status(locked=True, saving=9.8)), [_report()])
    text = smoke.render(ok, namespace="smoke-ns", elapsed_s=41.6)
    lines = text.splitlines()
    assert lines[0] == "smoke test in namespace smoke-ns: 9 steps in 42 s"
    assert [ln.split()[:2] for ln in lines[1:4]] == [
        ["ok", "report"], ["ok", "lock"], ["ok", "saving"],
    ]  # fmt: skip
    assert "generation 1155 MHz" in lines[2] and "9.8 %" in lines[3]
    assert lines[4] == "PASS"
    bad = smoke.evaluate(_policy(None), [])
    text = smoke.render(bad, namespace="n", elapsed_s=300)
    assert [ln.split()[:2] for ln in text.splitlines()[1:4]] == [
        ["MISSING", "report"], ["MISSING", "lock"], ["MISSING", "saving"],
    ]  # fmt: skip
    assert text.splitlines()[-1] == "FAIL: no report, no lock, no saving"
    doc = smoke.to_json(ok, namespace="smoke-ns", elapsed_s=41.6, image="img")
    assert doc["ok"] is True and doc["missing"] == []
    assert doc["locksMHz"] == {"generation": 1155} and doc["savingPercent"] == 9.8
    assert doc["nodeReports"][0]["node"] == "gpu-node-1"


class FakeCluster:
    """The API as ``cli.run_smoke`` sees it through ``kube``: a DaemonSet that appears after
    the policy, a status that fills in after a few reads."""

    def __init__(self, statuses: list[dict[str, Any] | None], *, host_network: bool) -> None:
        self.statuses = statuses
        self.calls: list[tuple[Any, ...]] = []
        self.agent_reads = 0
        self.host_network = host_network
        self.policy: dict[str, Any] | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from rlenergy_kubectl import cli, kube

        def agent_settings(_c: Any) -> kube.AgentSettings | None:
            self.agent_reads += 1
            if self.policy is None or self.agent_reads < 3:
                return None
            return kube.AgentSettings("reg/agent:9", 9555, "aud", self.host_network)

        def ensure_namespace(_c: Any, name: str, labels: dict[str, str]) -> bool:
            self.calls.append(("namespace", name, labels))
            return True

        def apply_policy(_c: Any, obj: dict[str, Any]) -> None:
            self.policy = obj
            self.calls.append(("policy", obj["metadata"]["name"]))

        def get_policy(_c: Any, ns: str, name: str) -> dict[str, Any]:
            status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
            return _policy(status)

        fakes = {
            "connect": lambda *_a: None,
            "agent_settings": agent_settings,
            "ensure_namespace": ensure_namespace,
            "label_namespace": lambda _c, n, labels: self.calls.append(("label", n, labels)),
            "apply_policy": apply_policy,
            "read_pod": lambda *_a: None,
            "create_pod": lambda _c, obj: self.calls.append(("pod", obj)),
            "get_policy": get_policy,
            "list_node_reports": lambda *_a: {smoke.POLICY: [_report()]},
            "delete": lambda _c, kind, ns, name: self.calls.append(("delete", kind, name)),
            "policy_exists": lambda *_a: False,
            "pod_log_tail": lambda *_a: "",
        }
        for name, fn in fakes.items():
            monkeypatch.setattr(kube, name, fn)
        monkeypatch.setattr(cli.time, "sleep", lambda _s: None)


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from rlenergy_kubectl import cli

    code = cli.main(argv)
    return code, capsys.readouterr().out


def test_smoke_command_end_to_end_on_a_fake_api(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeCluster(
        [None, _status(locked=False, saving=None), _status(locked=True, saving=4.5)],
        host_network=True,
    )
    api.install(monkeypatch)
    code, out = _run_cli(["smoke", "-o", "json"], capsys)
    assert code == 0, out
    doc = json.loads(out)
    assert doc["ok"] and doc["image"] == "reg/agent:9" and doc["savingPercent"] == 4.5
    kinds = [c[0] for c in api.calls]
    # namespace first (restricted: no DaemonSet yet), privileged once the agents show hostNetwork
    assert api.calls[0] == ("namespace", smoke.NAMESPACE, smoke.namespace_labels(False))
    assert ("label", smoke.NAMESPACE, smoke.namespace_labels(True)) in api.calls
    assert kinds.index("policy") < kinds.index("label") < kinds.index("pod")
    pod = next(c[1] for c in api.calls if c[0] == "pod")
    assert pod["spec"]["hostNetwork"] is True
    assert pod["spec"]["containers"][0]["image"] == "reg/agent:9"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[signals.PORT_ENV] == "9555"
    # cleaned up: pod, policy, then the namespace it made
    assert [c[1] for c in api.calls if c[0] == "delete"] == ["pod", "policy", "namespace"]


def test_smoke_command_times_out_with_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeCluster([_status(locked=False, saving=None)], host_network=False)
    api.install(monkeypatch)
    code, out = _run_cli(["smoke", "--timeout", "0.05", "--keep"], capsys)
    assert code == 1
    assert out.splitlines()[-1] == "FAIL: no lock, no saving", out
    assert not [c for c in api.calls if c[0] in ("delete", "label")]
