"""What the mutating webhook adds to a trainer pod, pure: token, CA bundle, agent endpoint.

A pod opts in with the label ``rlenergy.io/inject: "true"``; it is changed only when, in
addition, an ``RLEnergyPolicy`` of its namespace selects it (``spec.selector``) and its
namespace is not the operator's own. Then each container (init containers too) gets:

* the volume ``rlenergy-agent`` (projected, so Pod Security ``restricted`` admits it): the
  pod's service-account token for the agents' audience (``token``, one hour, rotated by the
  kubelet) and the CA bundle that signs the agents' serving certificates (``ca.crt``, from the
  ConfigMap the operator publishes in the namespace), mounted read-only at
  ``/var/run/secrets/rlenergy``;
* the environment ``RLENERGY_AGENT_HOST`` (downward API ``status.hostIP``),
  ``RLENERGY_AGENT_PORT``, ``RLENERGY_AGENT_TOKEN_FILE``, ``RLENERGY_AGENT_CA_FILE``.

What the user wrote wins and is never changed: a volume of that name, a container that already
mounts something at that path, an environment variable already set (``env`` entries; ``envFrom``
is left as it is) stay. So injecting twice (a reinvoked webhook, a pod that already has the
volume) adds nothing the second time. No hostPath, no capability, no security context: the
injected spec passes Pod Security ``restricted``.

Callers: ``rlenergy_operator.handlers`` (the admission handler, the CA bundle publication).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from rlenergy.api import selector as api_selector
from rlenergy.api import signals

LABEL = "rlenergy.io/inject"
"""The opt-in label of a pod (value ``"true"``)."""
VOLUME = "rlenergy-agent"
"""Name of the injected projected volume."""
MOUNT_PATH = "/var/run/secrets/rlenergy"
"""Where the volume is mounted (the SDK's default token and CA paths are in it)."""
CA_CONFIGMAP = "rlenergy-agent-ca"
"""ConfigMap the operator publishes in every namespace a policy lives in: ``ca.crt``."""
CA_KEY = "ca.crt"
"""Key of the CA bundle in ``CA_CONFIGMAP`` and its file name in the volume."""
TOKEN_EXPIRATION_S = 3600
"""Lifetime of the projected token, s (the kubelet rotates it at 80 %)."""


@dataclasses.dataclass(frozen=True)
class InjectConfig:
    """What the operator injects and where it never does.

    Attributes:
        operator_namespace: the operator's namespace (its own pods are never changed).
        audience: the agents' token audience (chart value ``agent.tokenAudience``).
        port: the agents' TLS port (chart value ``agent.tlsPort``).
    """

    operator_namespace: str
    audience: str = signals.TOKEN_AUDIENCE
    port: int = signals.DEFAULT_TLS_PORT


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether a pod gets the injection, the policies that select it and why not."""

    inject: bool
    reason: str
    policies: tuple[str, ...] = ()


def decide(
    pod: Mapping[str, Any],
    namespace: str,
    policies: Iterable[tuple[str, Mapping[str, Any] | None]],
    cfg: InjectConfig,
) -> Decision:
    """Whether ``pod`` (in ``namespace``) gets the injection.

    Args:
        pod: the pod as admitted (``metadata.labels`` read).
        namespace: the pod's namespace (the admission request's).
        policies: ``(name, spec.selector)`` of the policies in ``namespace``.
        cfg: the injection settings.

    Returns:
        ``inject`` only for a pod labelled ``rlenergy.io/inject: "true"`` outside the operator's
        namespace that at least one policy selects; ``reason``: ``Selected``, ``NotOptedIn``,
        ``OperatorNamespace`` or ``NoPolicy``. A selector that cannot be evaluated selects
        nothing (the policy reports it as invalid itself).
    """
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(LABEL) != "true":
        return Decision(False, "NotOptedIn")
    if namespace == cfg.operator_namespace:
        return Decision(False, "OperatorNamespace")
    chosen: list[str] = []
    for name, sel in policies:
        try:
            if api_selector.matches(sel, labels):
                chosen.append(name)
        except api_selector.InvalidSelectorError:
            continue
    if not chosen:
        return Decision(False, "NoPolicy")
    return Decision(True, "Selected", tuple(sorted(chosen)))


def volume(cfg: InjectConfig) -> dict[str, Any]:
    """The projected volume: the pod's token for the agents and the CA bundle."""
    return {
        "name": VOLUME,
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {
                    "serviceAccountToken": {
                        "audience": cfg.audience,
                        "expirationSeconds": TOKEN_EXPIRATION_S,
                        "path": "token",
                    }
                },
                {
                    "configMap": {
                        "name": CA_CONFIGMAP,
                        "items": [{"key": CA_KEY, "path": CA_KEY}],
                    }
                },
            ],
        },
    }


def env(cfg: InjectConfig) -> list[dict[str, Any]]:
    """The container environment that points the SDK at the node's agent."""
    return [
        {"name": signals.HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": signals.PORT_ENV, "value": str(cfg.port)},
        {"name": signals.TOKEN_FILE_ENV, "value": f"{MOUNT_PATH}/token"},
        {"name": signals.CA_FILE_ENV, "value": f"{MOUNT_PATH}/{CA_KEY}"},
    ]


def inject_into(pod: MutableMapping[str, Any], cfg: InjectConfig) -> list[str]:
    """Add the volume, mounts and environment to ``pod`` in place, keeping what is there.

    Args:
        pod: the pod object (``spec`` changed in place).
        cfg: the injection settings.

    Returns:
        What was added (``volume``, ``mount:<container>``, ``env:<container>:<NAME>``); empty
        when the pod already had everything (a second injection).
    """
    spec = pod.setdefault("spec", {})
    added: list[str] = []
    volumes = spec.get("volumes") or []
    has_volume = any(v.get("name") == VOLUME for v in volumes)
    wanted = env(cfg)
    mounted_by_us = False
    for kind in ("initContainers", "containers"):
        for c in spec.get(kind) or []:
            mounts = c.get("volumeMounts") or []
            taken = any(m.get("mountPath") == MOUNT_PATH for m in mounts) or any(
                m.get("name") == VOLUME for m in mounts
            )
            if not taken:
                c["volumeMounts"] = [
                    *mounts,
                    {"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": True},
                ]
                added.append(f"mount:{c.get('name')}")
                mounted_by_us = True
            present = {e.get("name") for e in c.get("env") or []}
            missing = [copy.deepcopy(e) for e in wanted if e["name"] not in present]
            if missing:
                c["env"] = [*(c.get("env") or []), *missing]
                added.extend(f"env:{c.get('name')}:{e['name']}" for e in missing)
    if not has_volume and mounted_by_us:
        spec["volumes"] = [*volumes, volume(cfg)]
        added.insert(0, "volume")
    return added


def injected(pod: Mapping[str, Any], cfg: InjectConfig) -> dict[str, Any]:
    """A copy of ``pod`` with the injection (``inject_into``); ``pod`` is left unchanged."""
    out = copy.deepcopy(dict(pod))
    inject_into(out, cfg)
    return out


def is_injected(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` carries the injected volume.

    A pod admitted while the webhook was down does not: it has no token, so it runs ungoverned.
    """
    return any(v.get("name") == VOLUME for v in (pod.get("spec") or {}).get("volumes") or [])


def ungoverned(pods: Iterable[Mapping[str, Any]], selector: Mapping[str, Any] | None) -> list[str]:
    """Names of the opted-in pods ``selector`` selects that lack the injected volume, sorted."""
    out: list[str] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(LABEL) != "true" or is_injected(pod):
            continue
        try:
            if api_selector.matches(selector, labels):
                out.append(str(meta.get("name", "")))
        except api_selector.InvalidSelectorError:
            return []
    return sorted(out)
