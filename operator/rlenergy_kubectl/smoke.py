"""``kubectl rlenergy smoke``, pure: the smoke policy and pod, and what the status shows.

The smoke test puts a policy (``POLICY``, enforce mode, short warm-up and trials) and one pod of
one GPU (``POD``, the agent's own image running ``python3 -m rlenergy.sdk.smoke``: RL steps of a
``generation`` and a ``training`` phase signalled through the SDK) into a namespace, and reads
back, from the policy's status and its ``RLEnergyNodeReport`` objects, the three things a working
install shows (:func:`evaluate`): a node **report** from the pod's node, a **lock** (a phase the
controller locked at a clock) and a **saving** (``status.totals.savingPercent``, measured energy
against the predicted default governor). The smoke pod runs no GPU kernel, so the saving is the
GPUs' power at the locked clock against the default governor's for the same time: positive where
the GPUs are busy (the dev cluster's stand-in GPUs run a steady load), and near zero or negative
on an idle real GPU, which the default governor already runs at its lowest clock. Its sign
therefore does not decide the result; its presence shows the whole loop (agent metering,
operator accounting) works.

The pod carries what the operator's webhook would inject (the projected token for the agents'
audience, the CA bundle ConfigMap, the agent endpoint), so it works with ``webhook.enabled=false``
too, and passes Pod Security ``restricted`` unless ``host_network`` (for clusters whose nodes
have no pod network, chart value ``hostNetwork: true``; the namespace then needs
``privileged``). ``docs/kubectl-plugin.md`` shows the output. The same manifests are shipped as
``deploy/smoke/smoke.yaml`` (:func:`manifest_text`, checked equal by a test).

Callers: ``rlenergy_kubectl.cli``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from rlenergy.api import signals
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy_kubectl import view

NAMESPACE = "rlenergy-smoke"
"""Namespace the smoke test uses by default (created when missing, deleted after if so)."""
POLICY = "rlenergy-smoke"
"""Name of the smoke policy."""
POD = "rlenergy-smoke"
"""Name of the smoke pod."""
APP_LABEL = {"app.kubernetes.io/name": "rlenergy-smoke"}
"""The pod's label, which the smoke policy selects."""
DEFAULT_IMAGE = "ghcr.io/rl-energy/rl-energy-agent:0.1.0"
"""The image of the shipped manifest (the chart's default ``agent.image``); the plugin uses the
image the cluster's agent DaemonSet runs."""
STEPS = 240
"""RL steps the pod runs at most (the plugin deletes it once the result is in): 8 minutes."""
PHASE_S = 1.0
"""Length of each smoke phase, s (long enough for 8 in-phase probe slices at the progress
cadence a busy node's TLS round trip allows: ``rlenergy.sdk.smoke.PROGRESS_EVERY_S``)."""
WARMUP_STEPS = 2
"""Default-governor steps before the controller's first trial."""
TRIAL_STEPS = 4
"""Most trial steps per selection round."""
TOKEN_MOUNT = "/var/run/secrets/rlenergy"
"""Where the token and CA bundle are mounted (the SDK's defaults; the webhook's path)."""
CA_CONFIGMAP = "rlenergy-agent-ca"
"""The CA bundle ConfigMap the operator publishes in every namespace a policy lives in."""
TOKEN_EXPIRATION_S = 3600
"""Lifetime of the projected token, s (the kubelet rotates it)."""
PSA_LABELS = (
    "pod-security.kubernetes.io/enforce",
    "pod-security.kubernetes.io/warn",
    "pod-security.kubernetes.io/audit",
)


def policy(namespace: str) -> dict[str, Any]:
    """The smoke ``RLEnergyPolicy`` (enforce, ``WARMUP_STEPS``, ``TRIAL_STEPS``).

    ``maxTrialFraction: 1``: trials may run on every step, so the first lock comes within tens
    of steps (with the default 0.25 the trial budget spreads them over about 100 steps).
    """
    return {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": POLICY, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(APP_LABEL)},
            "controller": {
                "mode": "enforce",
                "warmupSteps": WARMUP_STEPS,
                "trialSteps": TRIAL_STEPS,
                "maxTrialFraction": 1.0,
            },
        },
    }


def pod(
    namespace: str,
    image: str,
    *,
    agent_port: int = signals.DEFAULT_TLS_PORT,
    audience: str = signals.TOKEN_AUDIENCE,
    host_network: bool = False,
) -> dict[str, Any]:
    """The smoke pod: one GPU, ``python3 -m rlenergy.sdk.smoke``, the agent token and CA mounted.

    Args:
        namespace: where it runs.
        image: an image with the ``rlenergy`` package (the agent's).
        agent_port: the agents' TLS port (chart value ``agent.tlsPort``).
        audience: the agents' token audience (chart value ``agent.tokenAudience``).
        host_network: run in the node's network namespace (nodes without a pod network).
    """
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65534,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "smoke",
                "image": image,
                "command": [
                    "python3",
                    "-m",
                    "rlenergy.sdk.smoke",
                    "--steps",
                    str(STEPS),
                    "--phase-s",
                    str(PHASE_S),
                ],  # fmt: skip
                "env": [
                    {
                        "name": signals.HOST_ENV,
                        "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}},
                    },
                    {"name": signals.PORT_ENV, "value": str(agent_port)},
                    {"name": signals.TOKEN_FILE_ENV, "value": f"{TOKEN_MOUNT}/token"},
                    {"name": signals.CA_FILE_ENV, "value": f"{TOKEN_MOUNT}/ca.crt"},
                ],
                "resources": {
                    "limits": {"nvidia.com/gpu": "1", "cpu": "200m", "memory": "128Mi"},
                    "requests": {"cpu": "50m", "memory": "64Mi"},
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [
                    {"name": "rlenergy-agent", "mountPath": TOKEN_MOUNT, "readOnly": True}
                ],
            }
        ],
        "volumes": [
            {
                "name": "rlenergy-agent",
                "projected": {
                    "defaultMode": 0o444,
                    "sources": [
                        {
                            "serviceAccountToken": {
                                "audience": audience,
                                "expirationSeconds": TOKEN_EXPIRATION_S,
                                "path": "token",
                            }
                        },
                        {
                            "configMap": {
                                "name": CA_CONFIGMAP,
                                "items": [{"key": "ca.crt", "path": "ca.crt"}],
                            }
                        },
                    ],
                },
            }
        ],
    }
    if host_network:
        spec["hostNetwork"] = True
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD, "namespace": namespace, "labels": dict(APP_LABEL)},
        "spec": spec,
    }


def namespace_labels(host_network: bool) -> dict[str, str]:
    """Pod Security labels of a namespace the smoke test creates.

    ``restricted``, or ``privileged`` for a host-network pod (no lower level admits
    ``hostNetwork``).
    """
    level = "privileged" if host_network else "restricted"
    return dict.fromkeys(PSA_LABELS, level)


def manifest_text(namespace: str = NAMESPACE, image: str = DEFAULT_IMAGE) -> str:
    """``deploy/smoke/smoke.yaml``: the namespace, the policy and the pod as YAML documents."""
    ns = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": namespace, "labels": namespace_labels(False)},
    }
    head = (
        "# The smoke test as plain manifests (what `kubectl rlenergy smoke` applies; "
        "docs/kubectl-plugin.md).\n# Set the pod's image to your chart's agent.image. "
        "Generated by rlenergy_kubectl.smoke.manifest_text;\n# a test checks it is current.\n"
    )
    docs = [ns, policy(namespace), pod(namespace, image)]
    return head + "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs)


@dataclasses.dataclass(frozen=True)
class Result:
    """What the smoke test saw.

    Attributes:
        reports: per node report of the policy: node, GPU conditions, locked clocks per GPU
            (MHz, ``None``: default governor), newest step.
        locks: phase -> clock (MHz) for each phase in state ``locked``.
        saving_percent: ``status.totals.savingPercent`` (``None``: not yet known).
        saved_joules: ``status.totals.savedJoules``, J.
        steps: ``status.totals.steps``: complete RL steps accounted.
        phases: phase -> state (warmup, trial, locked, ...).
    """

    reports: tuple[dict[str, Any], ...]
    locks: dict[str, int]
    saving_percent: float | None
    saved_joules: float
    steps: int
    phases: dict[str, str]

    @property
    def missing(self) -> list[str]:
        """What is not seen yet, of ``report``, ``lock`` and ``saving``.

        A saving is a measured saving figure, of either sign (see the module docstring).
        """
        out = []
        if not self.reports:
            out.append("report")
        if not self.locks:
            out.append("lock")
        if self.saving_percent is None:
            out.append("saving")
        return out

    @property
    def ok(self) -> bool:
        """A report, a lock and a saving were all seen."""
        return not self.missing


def evaluate(policy_obj: Mapping[str, Any], reports: Sequence[Mapping[str, Any]]) -> Result:
    """Read the smoke policy's status and its node reports (dicts as the API returns them)."""
    pv = view.parse_policy(policy_obj)
    rv = view.parse_reports(reports)
    st = pv.status
    totals = st.totals or api_status.Totals()
    locks = {
        p.name: p.clock_mhz for p in st.phases if p.state == "locked" and p.clock_mhz is not None
    }
    return Result(
        reports=tuple(
            {
                "node": r.node_name,
                "gpus": {g.uuid: g.condition for g in r.gpus},
                "lockedClocksMHz": {g.uuid: g.locked_clock_mhz for g in r.gpus},
                "lastStep": r.last_step,
            }
            for r in rv.reports
        ),
        locks=locks,
        saving_percent=totals.saving_percent,
        saved_joules=totals.saved_joules,
        steps=totals.steps,
        phases={p.name: p.state for p in st.phases},
    )


def to_json(result: Result, *, namespace: str, elapsed_s: float, image: str) -> dict[str, Any]:
    """The ``-o json`` object of a smoke run."""
    return {
        "ok": result.ok,
        "missing": result.missing,
        "namespace": namespace,
        "policy": POLICY,
        "pod": POD,
        "image": image,
        "elapsedSeconds": round(elapsed_s, 1),
        "steps": result.steps,
        "phases": result.phases,
        "locksMHz": result.locks,
        "savingPercent": result.saving_percent,
        "savedJoules": result.saved_joules,
        "nodeReports": list(result.reports),
    }


def render(result: Result, *, namespace: str, elapsed_s: float) -> str:
    """The text a person reads: one line each for the report, the lock and the saving."""

    def mark(seen: bool) -> str:
        return "ok  " if seen else "MISSING"

    lines = [f"smoke test in namespace {namespace}: {result.steps} steps in {elapsed_s:.0f} s"]
    nodes = ", ".join(
        f"{r['node']} (GPUs {', '.join(sorted(set(r['gpus'].values()))) or 'none'}, "
        f"step {r['lastStep']})"
        for r in result.reports
    )
    lines.append(f"{mark(bool(result.reports))} report  {nodes or 'no node report yet'}")
    locks = ", ".join(f"{ph} {view.fmt_clock(mhz)}" for ph, mhz in sorted(result.locks.items()))
    states = ", ".join(f"{ph} {s}" for ph, s in sorted(result.phases.items()))
    lines.append(f"{mark(bool(result.locks))} lock    {locks or 'none yet'} ({states or '-'})")
    saving = view.UNKNOWN if result.saving_percent is None else f"{result.saving_percent:.1f} %"
    lines.append(
        f"{mark('saving' not in result.missing)} saving  {saving} "
        f"({result.saved_joules:.0f} J against the default governor)"
    )
    lines.append("PASS" if result.ok else f"FAIL: no {', no '.join(result.missing)}")
    return "\n".join(lines)
