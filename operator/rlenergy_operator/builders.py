"""Pure desired-state builders: the node-agent DaemonSet, conditions, status patches.

No kopf, no Kubernetes client: every function takes plain data and returns plain data, so the
handlers stay thin and everything here is unit-tested without a cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import pydantic

from rlenergy.api import naming
from rlenergy.api import node as api_node
from rlenergy.api.v1alpha1 import status as api_status
from rlenergy.control.freq import aggregate
from rlenergy_operator import settings

AGENT_LABELS = {
    "app.kubernetes.io/name": "rlenergy-node-agent",
    "app.kubernetes.io/part-of": "rl-energy",
    "app.kubernetes.io/managed-by": "rlenergy-operator",
}
GPU_TAINT_KEY = "nvidia.com/gpu"
CLOCK_SHORTFALL = "ClockShortfallUnexplained"
"""Node error and Degraded reason: a locked GPU runs below its lock with no clock-event reason
(the agent re-reads locks while they hold, ``rlenergy_agent.caps``)."""
NVML_UNAVAILABLE = "NVMLUnavailable"
"""Node error and Degraded reason: the node's agent cannot load NVML (``NodeReport.nvmlError``
says why and what to change, usually the agent pod's runtime class); it governs no GPU."""
AGENT_SOCKET_MOUNT = "/var/run/rlenergy"
"""Where the agent container sees the socket folder (the SDK's default socket folder, so
trainer pods mount the same hostPath at the same place)."""


def gpu_node_requirement(label: str) -> dict[str, Any]:
    """The node-selector requirement of the GPU node label ``key=value`` or ``key``.

    ``key=value`` becomes ``key In [value]``, a bare ``key`` becomes ``key Exists``.
    """
    key, eq, value = label.partition("=")
    if eq:
        return {"key": key, "operator": "In", "values": [value]}
    return {"key": key, "operator": "Exists"}


def agent_affinity(cfg: settings.OperatorConfig) -> dict[str, Any]:
    """The agent pods' affinity: the user's, with the GPU node label in every required term.

    Kubernetes ORs the required node-affinity terms and ANDs the expressions within one, so
    the GPU label requirement is appended to each term (one term of its own when there is none).
    """
    gpu = gpu_node_requirement(cfg.agent_gpu_node_label)
    affinity = copy.deepcopy(dict(cfg.agent_affinity))
    node = dict(affinity.get("nodeAffinity") or {})
    required = dict(node.get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = [dict(t) for t in required.get("nodeSelectorTerms") or []] or [{}]
    for term in terms:
        term["matchExpressions"] = [*(term.get("matchExpressions") or []), gpu]
    required["nodeSelectorTerms"] = terms
    node["requiredDuringSchedulingIgnoredDuringExecution"] = required
    affinity["nodeAffinity"] = node
    return affinity


def _api_server_env(cfg: settings.OperatorConfig) -> list[dict[str, str]]:
    """``KUBERNETES_SERVICE_HOST/PORT`` overrides (container env wins over the kubelet's)."""
    if not cfg.agent_api_server_host:
        return []
    env = [{"name": "KUBERNETES_SERVICE_HOST", "value": cfg.agent_api_server_host}]
    if cfg.agent_api_server_port:
        env.append({"name": "KUBERNETES_SERVICE_PORT", "value": cfg.agent_api_server_port})
    return env


def _dra_env(cfg: settings.OperatorConfig) -> list[dict[str, Any]]:
    """The agents' DRA index rule (chart value ``agent.draIndexDrivers``), only when set."""
    if not cfg.agent_dra_index_drivers:
        return []
    return [{"name": "RLENERGY_AGENT_DRA_INDEX_DRIVERS", "value": cfg.agent_dra_index_drivers}]


def _tls_env(cfg: settings.OperatorConfig) -> list[dict[str, Any]]:
    """The TLS signal port and the node's IP (its serving certificate's address)."""
    if not cfg.agent_tls_port:
        return []
    return [
        {"name": "RLENERGY_AGENT_TLS_PORT", "value": str(cfg.agent_tls_port)},
        {
            "name": "RLENERGY_AGENT_NODE_IP",
            "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}},
        },
    ]


def _tls_ports(cfg: settings.OperatorConfig) -> list[dict[str, Any]]:
    """The TLS signal port on the node's IP.

    With hostNetwork the node's own port; otherwise a ``hostPort`` (the CNI's port mapping
    forwards the node's port to the agent).
    """
    if not cfg.agent_tls_port:
        return []
    return [
        {
            "name": "signals-tls",
            "containerPort": cfg.agent_tls_port,
            "hostPort": cfg.agent_tls_port,
            "protocol": "TCP",
        }
    ]


def _agent_security_context(cfg: settings.OperatorConfig) -> dict[str, Any]:
    """The agent container's securityContext.

    ``CAP_SYS_ADMIN`` alone (NVML's clock writes), the runtime's default seccomp profile, and
    ``cfg.agent_apparmor_profile`` when set.
    ``RuntimeDefault`` seccomp (containerd's and CRI-O's default profile) still refuses, among
    others, ``keyctl``, ``add_key``, ``kexec_load`` and module loading; with ``CAP_SYS_ADMIN``
    it allows ``mount``, ``unshare``, ``setns`` and ``bpf``, which only a node-local profile
    (``Localhost``) could refuse.
    """
    ctx: dict[str, Any] = {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    profile = cfg.agent_apparmor_profile
    if profile.startswith("localhost/"):
        ctx["appArmorProfile"] = {
            "type": "Localhost",
            "localhostProfile": profile.removeprefix("localhost/"),
        }
    elif profile:
        ctx["appArmorProfile"] = {"type": profile}
    return ctx


def agent_daemonset(cfg: settings.OperatorConfig) -> dict[str, Any]:
    """The cluster's single node-agent DaemonSet (one writer per GPU).

    Scheduled only on nodes with the GPU node label (``agent_gpu_node_label``, default
    ``nvidia.com/gpu.present=true``) and matching the configured nodeSelector and affinity,
    tolerating the ``nvidia.com/gpu`` taint and the configured tolerations, with the
    configured runtimeClassName, imagePullSecrets and priorityClassName; the container gets
    CAP_SYS_ADMIN (clock writes through NVML) and nothing else: not
    privileged, all other capabilities dropped, no privilege escalation, read-only root
    filesystem. hostPaths: the state folder, the kubelet's
    pod-resources folder (read-only) and the signal-socket folder shared with trainer pods. With
    ``agent_tls_port`` the agent also serves signals over TLS on that port of the node's IP
    (``hostPort``; with hostNetwork the same port of the node). No policy is set: each agent
    discovers the policy that governs its node's GPU pods.
    """
    container: dict[str, Any] = {
        "name": "agent",
        "image": cfg.agent_image,
        "imagePullPolicy": cfg.agent_image_pull_policy,
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {
                "name": "RLENERGY_AGENT_NODE_NAME",
                "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
            },
            {"name": "RLENERGY_AGENT_METRICS_HOST", "value": "0.0.0.0"},  # noqa: S104 - probes
            {"name": "RLENERGY_AGENT_METRICS_PORT", "value": str(cfg.agent_metrics_port)},
            {"name": "RLENERGY_AGENT_STATE_DIR", "value": "/var/lib/rlenergy"},
            {"name": "RLENERGY_AGENT_SOCKET_PATH", "value": f"{AGENT_SOCKET_MOUNT}/agent.sock"},
            {"name": "RLENERGY_AGENT_TOKEN_AUDIENCE", "value": cfg.agent_token_audience},
            *_dra_env(cfg),
            *_tls_env(cfg),
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
            *_api_server_env(cfg),
            *cfg.agent_extra_env,
        ],
        "ports": [{"name": "metrics", "containerPort": cfg.agent_metrics_port}, *_tls_ports(cfg)],
        # An agent that cannot start (no NVML: the pod's runtime class) writes why, with the
        # fix, to /dev/termination-log; a crash with no message falls back to the log's tail.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "periodSeconds": 10,
        },
        # /healthz fails only when NVML answers on no GPU (lost after a host
        # `systemctl daemon-reload`); it runs on the ops thread, never waits on a phase, so a
        # long phase cannot fail it. Generous timeout: NVML calls take seconds with persistence
        # mode off; restart after about a minute of failures.
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "initialDelaySeconds": 30,
            "periodSeconds": 20,
            "timeoutSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": {
            "requests": {"cpu": cfg.agent_cpu_request, "memory": cfg.agent_memory_request},
            "limits": {"memory": cfg.agent_memory_limit},
        },
        "securityContext": _agent_security_context(cfg),
        "volumeMounts": [
            {
                "name": "pod-resources",
                "mountPath": "/var/lib/kubelet/pod-resources",
                "readOnly": True,
            },
            {"name": "state", "mountPath": "/var/lib/rlenergy"},
            {"name": "socket", "mountPath": AGENT_SOCKET_MOUNT},
            *cfg.agent_extra_volume_mounts,
        ],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": cfg.agent_service_account,
        "affinity": agent_affinity(cfg),
        "tolerations": (
            [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
            if cfg.agent_tolerate_gpu_taint
            else []
        )
        + [dict(t) for t in cfg.agent_tolerations],
        "containers": [container],
        "volumes": [
            {
                "name": "pod-resources",
                "hostPath": {"path": cfg.agent_pod_resources_dir, "type": "Directory"},
            },
            {
                "name": "state",
                "hostPath": {"path": cfg.agent_state_dir, "type": "DirectoryOrCreate"},
            },
            {
                "name": "socket",
                "hostPath": {"path": cfg.agent_socket_dir, "type": "DirectoryOrCreate"},
            },
            *cfg.agent_extra_volumes,
        ],
        "terminationGracePeriodSeconds": 30,
    }
    if cfg.agent_priority_class:
        pod_spec["priorityClassName"] = cfg.agent_priority_class
    if cfg.agent_node_selector:
        pod_spec["nodeSelector"] = dict(cfg.agent_node_selector)
    if cfg.agent_runtime_class:
        pod_spec["runtimeClassName"] = cfg.agent_runtime_class
    if cfg.agent_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in cfg.agent_image_pull_secrets]
    if cfg.agent_host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": cfg.agent_daemonset_name,
            "namespace": cfg.namespace,
            "labels": dict(AGENT_LABELS),
        },
        "spec": {
            "selector": {
                "matchLabels": {"app.kubernetes.io/name": AGENT_LABELS["app.kubernetes.io/name"]}
            },
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {"metadata": {"labels": dict(AGENT_LABELS)}, "spec": pod_spec},
        },
    }


FIELD_MANAGER = "rlenergy-operator"
"""The field manager of every server-side apply of the operator (``kube.apply_daemonset``)."""
LEGACY_MANAGERS = frozenset({"OpenAPI-Generator"})
"""Field managers of the operator's writes before it applied server-side: the Kubernetes Python
client's default User-Agent up to its first ``/``, which the API server takes as the manager of
a create or patch that names none."""


def apply_body(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The server-side apply configuration of an object the operator owns.

    The whole desired object as the builders give it (``apiVersion``, ``kind``, ``metadata``
    name, namespace and labels, ``spec``): under server-side apply a field the operator applied
    before and leaves out now (a nodeSelector key, ``runtimeClassName`` the user unset) is
    removed, and fields other managers own are left alone. Server-owned metadata
    (``resourceVersion``, ``uid``, ``managedFields``, ...) and ``status`` are dropped: an apply
    configuration must not carry them.

    Raises:
        ValueError: ``obj`` lacks ``apiVersion``, ``kind`` or ``metadata.name``.
    """
    meta = dict(obj.get("metadata") or {})
    if not (obj.get("apiVersion") and obj.get("kind") and meta.get("name")):
        raise ValueError("an apply configuration needs apiVersion, kind and metadata.name")
    kept_meta = {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta}
    out = {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("metadata", "status")}
    out["metadata"] = copy.deepcopy(kept_meta)
    return out


def _union_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """The union of two ``fieldsV1`` sets (nested maps of ``f:``/``k:``/``v:``/``.`` keys)."""
    out = {k: copy.deepcopy(v) for k, v in a.items()}
    for k, v in b.items():
        out[k] = _union_fields(out[k], v) if k in out else copy.deepcopy(v)
    return out


def upgraded_managed_fields(
    entries: Sequence[Mapping[str, Any]], api_version: str
) -> list[dict[str, Any]] | None:
    """``metadata.managedFields`` with the operator's pre-apply writes owned by its apply.

    The operator created and merge-patched its objects before it applied them server-side;
    those fields belong to an ``Update`` entry of ``LEGACY_MANAGERS``, and a field the apply
    leaves out stays while that entry owns it. As client-go's ``csaupgrade`` does, the legacy
    entries' fields move into ``FIELD_MANAGER``'s ``Apply`` entry, so the next apply removes
    what it no longer sets.

    Args:
        entries: the object's ``metadata.managedFields`` (wire form).
        api_version: the object's ``apiVersion`` (for a new ``Apply`` entry).

    Returns:
        The new list (the legacy main-resource ``Update`` entries removed, their fields in the
        ``Apply`` entry); None when there is no legacy entry to upgrade.
    """

    def legacy(e: Mapping[str, Any]) -> bool:
        return (
            e.get("manager") in LEGACY_MANAGERS
            and e.get("operation") == "Update"
            and not e.get("subresource")
        )

    old = [e for e in entries if legacy(e)]
    if not old:
        return None
    fields: dict[str, Any] = {}
    for e in old:
        fields = _union_fields(fields, e.get("fieldsV1") or {})
    out: list[dict[str, Any]] = []
    applied = False
    for e in entries:
        if legacy(e):
            continue
        entry = copy.deepcopy(dict(e))
        if e.get("manager") == FIELD_MANAGER and e.get("operation") == "Apply":
            entry["fieldsV1"] = _union_fields(entry.get("fieldsV1") or {}, fields)
            applied = True
        out.append(entry)
    if not applied:
        out.append(
            {
                "manager": FIELD_MANAGER,
                "operation": "Apply",
                "apiVersion": api_version,
                "fieldsType": "FieldsV1",
                "fieldsV1": fields,
            }
        )
    return out


def condition(
    type_: api_status.ConditionType,
    status: bool,
    reason: str,
    message: str,
    *,
    generation: int,
    now: str,
    previous: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """A condition; ``lastTransitionTime`` moves only when ``status`` changes."""
    value: Literal["True", "False"] = "True" if status else "False"
    old = next((c for c in previous if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == value else now
    cond = api_status.Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )
    return cond.model_dump(by_alias=True, exclude_none=True)


def merge_conditions(
    previous: Sequence[Mapping[str, Any]], updates: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``previous`` with ``updates`` replacing conditions of the same type, in a fixed order."""
    by_type = {c["type"]: dict(c) for c in previous}
    by_type.update({c["type"]: dict(c) for c in updates})
    order = list(api_status.CONDITION_TYPES)
    return [by_type[t] for t in sorted(by_type, key=lambda t: order.index(t) if t in order else 99)]


def merge_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """JSON merge patch (RFC 7386) that turns ``old`` into ``new`` for the keys of ``new``.

    Keys of ``old`` missing from ``new`` become ``None`` (deleted) when ``new`` manages the
    parent object; lists are replaced whole. Returns ``{}`` when nothing changes.
    """
    old = old or {}
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = merge_patch(before, value)
            for gone in set(before) - set(value):
                sub[gone] = None
            if sub:
                patch[key] = sub
        elif before != value:
            patch[key] = value
    return patch


def plan_changed(old: Mapping[str, Any] | None, new: api_node.ClockPlan) -> bool:
    """Whether any phase's clock or state differs from the published plan."""
    if not old:
        return True
    before = api_node.ClockPlan.model_validate(old)
    pairs = {(p.phase, p.clock_mhz, p.state) for p in before.phases}
    return pairs != {(p.phase, p.clock_mhz, p.state) for p in new.phases}


def describe_plan(plan: api_node.ClockPlan) -> str:
    """One line for an Event: ``step 12: generation 1410 MHz (locked), training default (…)``."""
    parts = []
    for p in plan.phases:
        clock = f"{p.clock_mhz} MHz" if p.clock_mhz is not None else "default"
        probe = f" probing {len(p.probe_clocks_mhz)} clocks" if p.probe_clocks_mhz else ""
        parts.append(f"{p.phase} {clock} ({p.state}{probe})")
    mode = "" if plan.enforce else " [observe: clocks untouched]"
    return f"step {plan.step}: " + ", ".join(parts) + mode


def node_summary(reports: Sequence[api_node.NodeReport]) -> api_status.NodesStatus:
    """Ready/total nodes and their GPU errors (at most 64)."""
    errors: list[api_status.NodeError] = []
    for rep in sorted(reports, key=lambda r: r.node_name):
        for gpu in rep.gpus:
            if gpu.condition in ("degraded", "lost"):
                errors.append(
                    api_status.NodeError(
                        node=rep.node_name,
                        gpu=gpu.uuid,
                        reason="GPULost" if gpu.condition == "lost" else "GPUDegraded",
                        message=gpu.reason,
                    )
                )
            elif gpu.clock_state == "unexplained":
                errors.append(
                    api_status.NodeError(
                        node=rep.node_name,
                        gpu=gpu.uuid,
                        reason=CLOCK_SHORTFALL,
                        message=f"locked {gpu.locked_clock_mhz} MHz, runs "
                        f"{gpu.effective_clock_mhz} MHz with no clock-event reason (the "
                        "driver holds it down unexplained: trials and savings assume a clock "
                        "it does not run)",
                    )
                )
        if rep.nvml_error:
            errors.append(
                api_status.NodeError(
                    node=rep.node_name, reason=NVML_UNAVAILABLE, message=rep.nvml_error
                )
            )
        elif not aggregate.node_ready(rep):
            errors.append(
                api_status.NodeError(
                    node=rep.node_name, reason="NoUsableGPU", message="no GPU measures energy"
                )
            )
    return api_status.NodesStatus(
        ready=sum(1 for r in reports if aggregate.node_ready(r)),
        total=len(reports),
        errors=errors[:64],
    )


class Finding(NamedTuple):
    """A condition a check found: its status, reason (CamelCase) and message.

    What the pure checks (``scheduling``, ``coverage``, ``rollout``, the condition builders
    here) hand to the pass that sets the condition and posts the Event.
    """

    status: bool
    reason: str
    message: str


class Event(NamedTuple):
    """A Kubernetes Event a pure step asks the handler to post."""

    type: str
    """``Normal`` or ``Warning``."""
    reason: str
    message: str


def stall_condition(reports: Sequence[api_node.NodeReport]) -> Finding:
    """(status, reason, message) of RolloutStalled from the agents' per-GPU stall state.

    True while some GPU's phase is stalled (``GpuStatus.stalledSeconds``: progress frozen with
    requests in flight at power below the SKU's band, ``rlenergy_agent.stalls``); the message
    names the nodes, pods and GPUs. The agents hold the clocks and keep the stalled time out of
    the savings; the condition is for whoever must restart the engine.
    """
    stalled = [
        (rep.node_name, g)
        for rep in sorted(reports, key=lambda r: r.node_name)
        for g in rep.gpus
        if g.stalled_seconds is not None
    ]
    if not stalled:
        return Finding(False, "Progressing", "no stalled rollout")
    longest = max(g.stalled_seconds or 0.0 for _, g in stalled)
    where = sorted({f"{node} {g.pod or '?'} ({g.phase or '?'})" for node, g in stalled})
    gpus = ", ".join(f"{node}/{g.uuid}" for node, g in stalled[:8])
    return Finding(
        True,
        "ProgressFrozen",
        f"{len(stalled)} GPU(s) show requests in flight, no progress and power below the "
        f"stall band for up to {longest:.0f} s: {'; '.join(where)}; GPUs {gpus}. Clocks are "
        "held and the stalled time is kept out of savings; restart the hung engine.",
    )


def progress_condition(phases: Sequence[api_status.PhaseStatus]) -> Finding:
    """(status, reason, message) of Progressing from the phase states."""
    states = {p.name: p.state for p in phases}
    busy = sorted(n for n, s in states.items() if s in ("warmup", "trial"))
    if busy:
        which = ", ".join(f"{n} {states[n]}" for n in busy)
        return Finding(True, "SelectingClocks", f"selecting clocks: {which}")
    if states and all(s == "observe" for s in states.values()):
        return Finding(False, "Observing", "observe mode: measuring, clocks untouched")
    if any(s == "fallback" for s in states.values()):
        return Finding(False, "Fallback", "a phase runs the default governor after an error")
    return Finding(False, "ClocksLocked", "every phase runs its selected clock")


def degraded_condition(
    nodes: api_status.NodesStatus, has_clock_table: bool, has_reports: bool
) -> Finding:
    """(status, reason, message) of Degraded."""
    nvml = [e for e in nodes.errors if e.reason == NVML_UNAVAILABLE]
    if nvml:
        return Finding(
            True,
            NVML_UNAVAILABLE,
            f"{len(nvml)} node agent(s) cannot load NVML, first: {nvml[0].node}: {nvml[0].message}",
        )
    if nodes.errors:
        first = nodes.errors[0]
        if all(e.reason == CLOCK_SHORTFALL for e in nodes.errors):
            return Finding(
                True,
                CLOCK_SHORTFALL,
                f"{len(nodes.errors)} GPU(s) run below their locked clock with no clock-event "
                f"reason, first: {first.node} {first.gpu}: {first.message}",
            )
        return Finding(
            True,
            "NodeErrors",
            f"{len(nodes.errors)} node/GPU errors, first: {first.node} {first.reason}",
        )
    if has_reports and not has_clock_table:
        return Finding(True, "NoClockTable", "no node reported the GPUs' supported clocks")
    return Finding(False, "AsExpected", "no errors")


def unacknowledged_resets(items: Sequence[Mapping[str, Any]]) -> list[str]:
    """``node/GPU-uuid`` of every GPU whose clock reset is not acknowledged yet.

    Args:
        items: the policy's RLEnergyNodeReport objects as listed (a spec that does not parse
            is skipped: its agent cannot acknowledge anything).
    """
    pending: list[str] = []
    for item in items:
        try:
            rep = api_node.NodeReport.model_validate(naming.printable_tree(item.get("spec") or {}))
        except pydantic.ValidationError:
            continue
        pending += [f"{rep.node_name}/{g.uuid}" for g in rep.gpus if not g.reset_acknowledged]
    return pending


def reset_wait_message(pending: int, waited_s: float, deadline_s: float) -> str:
    """Progressing's message while the deletion waits for reset acknowledgements."""
    return (
        f"waiting for {pending} GPUs to acknowledge the clock reset "
        f"({waited_s:.0f}/{deadline_s:.0f} s)"
    )


def reset_deadline_message(pending: Sequence[str], deadline_s: float) -> str:
    """Degraded's message when the reset deadline passed with GPUs unacknowledged."""
    return (
        f"reset deadline {deadline_s:.0f} s passed; {len(pending)} GPUs never "
        f"acknowledged the reset (first: {pending[0]}); the finalizer is lifted anyway"
    )
