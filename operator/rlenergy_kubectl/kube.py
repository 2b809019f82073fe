"""The plugin's API reads (official Kubernetes client), with errors a person can act on.

Reads ``RLEnergyPolicy`` objects (one, a namespace's, or all) and the ``RLEnergyNodeReport``
objects of their namespaces; for ``smoke`` only, also reads the node-agent DaemonSet and writes
the smoke test's namespace, policy and pod (and deletes them after). The client is built from
the kubeconfig the way kubectl builds it: ``--kubeconfig``, else ``$KUBECONFIG``
(colon-separated files are merged), else ``~/.kube/config``; ``--context`` or the current
context; the namespace is ``-n``, else the context's namespace (in a pod: the pod's), else
``default``. Every failure
becomes a ``PluginError`` whose message names what was searched and what to do.

Callers: ``rlenergy_kubectl.cli``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

import kubernetes
import urllib3
from kubernetes.client import exceptions as k8s_errors

from rlenergy.api.v1alpha1 import nodereport as api_nodereport
from rlenergy.api.v1alpha1 import policy as api_policy

REQUEST_TIMEOUT_S = 15.0
"""Per request timeout, s (connect and read)."""

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
"""Where a pod finds its own namespace (the default namespace in-cluster, as for kubectl)."""

INSTALL_HINT = (
    "install the chart (docs/install.md: the labelled namespace, then helm install rl-energy "
    "./helm/rl-energy -n rl-energy-system), or apply the CRDs (kubectl apply --server-side -f "
    "crds/)"
)

_T = TypeVar("_T")


class PluginError(Exception):
    """A read failed; ``str(error)`` is the one-line message for the user (exit code 1)."""


@dataclasses.dataclass
class Cluster:
    """A connected API client and where it points.

    Attributes:
        api: the Kubernetes API client.
        context: the kubeconfig context in use (``in-cluster`` for a service account).
        namespace: the context's namespace (``default`` when it sets none).
        server: the API server URL.
    """

    api: kubernetes.client.ApiClient
    context: str
    namespace: str
    server: str


def connect(kubeconfig: str | None = None, context: str | None = None) -> Cluster:
    """Build a client from the kubeconfig (see the module docstring for the lookup order).

    Raises:
        PluginError: no kubeconfig, an unknown context, or an unreadable file.
    """
    env = os.environ.get("KUBECONFIG", "")
    default_file = os.path.expanduser("~/.kube/config")
    if kubeconfig is None and not env and not os.path.exists(default_file):
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            cfg = kubernetes.client.Configuration()
            kubernetes.config.load_incluster_config(client_configuration=cfg)
            try:
                with open(SERVICE_ACCOUNT_NAMESPACE) as fh:
                    namespace = fh.read().strip() or "default"
            except OSError:
                namespace = "default"
            return Cluster(kubernetes.client.ApiClient(cfg), "in-cluster", namespace, cfg.host)
        raise PluginError(
            f"no kubeconfig: {default_file} does not exist and KUBECONFIG is not set "
            "(give --kubeconfig PATH)"
        )
    source = kubeconfig or env or default_file
    try:
        contexts, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
        if context is not None:
            chosen = next((c for c in contexts or [] if c.get("name") == context), None)
            if chosen is None:
                names = ", ".join(sorted(c.get("name", "") for c in contexts or [])) or "none"
                raise PluginError(
                    f'context "{context}" not found in kubeconfig {source} (contexts: {names})'
                )
        else:
            chosen = active
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(
            config_file=kubeconfig, context=context, client_configuration=cfg
        )
    except kubernetes.config.ConfigException as exc:
        raise PluginError(f"kubeconfig {source}: {exc}") from None
    except OSError as exc:
        raise PluginError(f"kubeconfig {source}: {exc}") from None
    namespace = str((chosen or {}).get("context", {}).get("namespace") or "default")
    name = str((chosen or {}).get("name", ""))
    return Cluster(kubernetes.client.ApiClient(cfg), name, namespace, str(cfg.host))


def _call(cluster: Cluster, what: str, fn: Callable[[], _T]) -> _T:
    try:
        return fn()
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise PluginError(
            f"cannot reach the API server {cluster.server} (context {cluster.context}) "
            f"while {what}: {exc}"
        ) from None
    except k8s_errors.ApiException as exc:
        if exc.status in (401, 403):
            raise PluginError(
                f"{'unauthorized' if exc.status == 401 else 'forbidden'} while {what} "
                f"(context {cluster.context}): {_message(exc)}"
            ) from None
        raise


def _message(exc: k8s_errors.ApiException) -> str:
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        body = {}
    return str(body.get("message") or exc.reason or exc.status)


def missing_crds(cluster: Cluster) -> list[str]:
    """Plural names of our resources the API server is missing (empty: all served)."""
    api = kubernetes.client.CustomObjectsApi(cluster.api)

    def read() -> Any:
        return api.get_api_resources(
            api_policy.GROUP, api_policy.VERSION, _request_timeout=REQUEST_TIMEOUT_S
        )

    try:
        listing = _call(cluster, f"discovering {api_policy.GROUP}/{api_policy.VERSION}", read)
    except k8s_errors.ApiException as exc:
        if exc.status == 404:
            return [api_policy.PLURAL, api_nodereport.PLURAL]
        raise PluginError(f"discovering {api_policy.GROUP}: {_message(exc)}") from None
    served = {r.name for r in (listing.resources or [])}
    return [p for p in (api_policy.PLURAL, api_nodereport.PLURAL) if p not in served]


def _require_crds(cluster: Cluster) -> None:
    missing = missing_crds(cluster)
    if missing:
        names = ", ".join(f"{p}.{api_policy.GROUP}" for p in missing)
        raise PluginError(
            f"the API server at {cluster.server} (context {cluster.context}) does not serve "
            f"{names}: the rl-energy CRDs are not installed; {INSTALL_HINT}"
        )


def get_policy(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    """The policy ``namespace/name``.

    Raises:
        PluginError: the CRD is not installed, or no such policy in ``namespace``.
    """
    api = kubernetes.client.CustomObjectsApi(cluster.api)

    def read() -> Any:
        return api.get_namespaced_custom_object(
            api_policy.GROUP,
            api_policy.VERSION,
            namespace,
            api_policy.PLURAL,
            name,
            _request_timeout=REQUEST_TIMEOUT_S,
        )

    try:
        obj: dict[str, Any] = _call(cluster, f"reading {api_policy.KIND} {namespace}/{name}", read)
    except k8s_errors.ApiException as exc:
        if exc.status != 404:
            raise PluginError(f"reading {namespace}/{name}: {_message(exc)}") from None
        _require_crds(cluster)
        raise PluginError(
            f'{api_policy.KIND} "{name}" not found in namespace "{namespace}" '
            f"(context {cluster.context}); `kubectl rlenergy status -A` lists the policies of "
            "every namespace"
        ) from None
    return obj


def list_policies(cluster: Cluster, namespace: str | None) -> list[dict[str, Any]]:
    """Policies of ``namespace`` (``None``: every namespace), sorted by namespace and name.

    Raises:
        PluginError: the CRD is not installed, or the API cannot be read.
    """
    api = kubernetes.client.CustomObjectsApi(cluster.api)

    def read() -> Any:
        if namespace is None:
            return api.list_cluster_custom_object(
                api_policy.GROUP,
                api_policy.VERSION,
                api_policy.PLURAL,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        return api.list_namespaced_custom_object(
            api_policy.GROUP,
            api_policy.VERSION,
            namespace,
            api_policy.PLURAL,
            _request_timeout=REQUEST_TIMEOUT_S,
        )

    where = "all namespaces" if namespace is None else f"namespace {namespace}"
    try:
        listing = _call(cluster, f"listing {api_policy.PLURAL} in {where}", read)
    except k8s_errors.ApiException as exc:
        if exc.status == 404:
            _require_crds(cluster)
        raise PluginError(f"listing {api_policy.PLURAL} in {where}: {_message(exc)}") from None
    items: list[dict[str, Any]] = listing.get("items", [])
    return sorted(
        items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"].get("name", ""))
    )


def list_node_reports(cluster: Cluster, namespace: str) -> dict[str, list[dict[str, Any]]]:
    """The ``RLEnergyNodeReport`` objects of ``namespace``, grouped by ``spec.policyName``.

    Raises:
        PluginError: the CRD is not installed, or the API cannot be read.
    """
    api = kubernetes.client.CustomObjectsApi(cluster.api)

    def read() -> Any:
        return api.list_namespaced_custom_object(
            api_nodereport.GROUP,
            api_nodereport.VERSION,
            namespace,
            api_nodereport.PLURAL,
            _request_timeout=REQUEST_TIMEOUT_S,
        )

    what = f"listing {api_nodereport.PLURAL} in namespace {namespace}"
    try:
        listing = _call(cluster, what, read)
    except k8s_errors.ApiException as exc:
        if exc.status == 404:
            _require_crds(cluster)
        raise PluginError(f"{what}: {_message(exc)}") from None
    grouped: dict[str, list[dict[str, Any]]] = {}
    for item in listing.get("items", []):
        policy = str((item.get("spec") or {}).get("policyName", ""))
        grouped.setdefault(policy, []).append(item)
    return grouped


# ----- the smoke test's writes (``kubectl rlenergy smoke``) ---------------------------------------
AGENT_SELECTOR = "app.kubernetes.io/name=rlenergy-node-agent"
"""Label of the operator's node-agent DaemonSet (``rlenergy_operator.builders``)."""


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """What the smoke pod copies from the cluster's node-agent DaemonSet.

    Attributes:
        image: the agent container's image (it holds the ``rlenergy`` SDK).
        tls_port: the agents' TLS signal port (``RLENERGY_AGENT_TLS_PORT``; 0: none).
        audience: the agents' token audience (``RLENERGY_AGENT_TOKEN_AUDIENCE``).
        host_network: the agents run in the nodes' network namespace (chart ``hostNetwork``).
    """

    image: str
    tls_port: int
    audience: str
    host_network: bool


def agent_settings(cluster: Cluster) -> AgentSettings | None:
    """The node-agent DaemonSet's settings, from any namespace (``None``: no DaemonSet yet).

    Raises:
        PluginError: the DaemonSets cannot be listed.
    """
    apps = kubernetes.client.AppsV1Api(cluster.api)
    listing = _write(
        cluster,
        "listing the node-agent DaemonSet",
        lambda: apps.list_daemon_set_for_all_namespaces(
            label_selector=AGENT_SELECTOR, _request_timeout=REQUEST_TIMEOUT_S
        ),
    )
    for item in listing.items or []:
        ds: dict[str, Any] = cluster.api.sanitize_for_serialization(item)
        spec = ds["spec"]["template"]["spec"]
        container = spec["containers"][0]
        env = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
        return AgentSettings(
            image=str(container["image"]),
            tls_port=int(env.get("RLENERGY_AGENT_TLS_PORT") or 0),
            audience=str(env.get("RLENERGY_AGENT_TOKEN_AUDIENCE") or "rlenergy-agent"),
            host_network=bool(spec.get("hostNetwork")),
        )
    return None


def _write(cluster: Cluster, what: str, fn: Callable[[], _T]) -> _T:
    try:
        return _call(cluster, what, fn)
    except k8s_errors.ApiException as exc:
        raise PluginError(f"{what}: {_message(exc)}") from None


def ensure_namespace(cluster: Cluster, name: str, labels: dict[str, str]) -> bool:
    """Create namespace ``name`` with ``labels`` unless it exists; returns whether it created it.

    Raises:
        PluginError: it could not be read or created.
    """
    core = kubernetes.client.CoreV1Api(cluster.api)
    try:
        _call(
            cluster,
            f"reading namespace {name}",
            lambda: core.read_namespace(name, _request_timeout=REQUEST_TIMEOUT_S),
        )
        return False
    except k8s_errors.ApiException as exc:
        if exc.status != 404:
            raise PluginError(f"reading namespace {name}: {_message(exc)}") from None
    body = kubernetes.client.V1Namespace(
        metadata=kubernetes.client.V1ObjectMeta(name=name, labels=labels)
    )
    _write(
        cluster,
        f"creating namespace {name}",
        lambda: core.create_namespace(body, _request_timeout=REQUEST_TIMEOUT_S),
    )
    return True


def apply_policy(cluster: Cluster, obj: dict[str, Any]) -> None:
    """Create the policy, or replace the spec of the one of that name (server-side apply).

    Raises:
        PluginError: the CRD is not installed or the write failed.
    """
    _require_crds(cluster)
    api = kubernetes.client.CustomObjectsApi(cluster.api)
    meta = obj["metadata"]
    _write(
        cluster,
        f"applying {api_policy.KIND} {meta['namespace']}/{meta['name']}",
        lambda: api.patch_namespaced_custom_object(
            api_policy.GROUP, api_policy.VERSION, meta["namespace"], api_policy.PLURAL,
            meta["name"], obj, field_manager="kubectl-rlenergy", force=True,
            _content_type="application/apply-patch+yaml", _request_timeout=REQUEST_TIMEOUT_S,
        ),
    )  # fmt: skip


def read_pod(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The pod as a dict (``None``: not found).

    Raises:
        PluginError: it could not be read.
    """
    core = kubernetes.client.CoreV1Api(cluster.api)
    try:
        pod = _call(
            cluster,
            f"reading pod {namespace}/{name}",
            lambda: core.read_namespaced_pod(name, namespace, _request_timeout=REQUEST_TIMEOUT_S),
        )
    except k8s_errors.ApiException as exc:
        if exc.status == 404:
            return None
        raise PluginError(f"reading pod {namespace}/{name}: {_message(exc)}") from None
    out: dict[str, Any] = cluster.api.sanitize_for_serialization(pod)
    return out


def create_pod(cluster: Cluster, obj: dict[str, Any]) -> None:
    """Create the pod.

    Raises:
        PluginError: the write failed (409: a pod of that name exists).
    """
    core = kubernetes.client.CoreV1Api(cluster.api)
    meta = obj["metadata"]
    _write(
        cluster,
        f"creating pod {meta['namespace']}/{meta['name']}",
        lambda: core.create_namespaced_pod(
            meta["namespace"],
            obj,  # type: ignore[arg-type]  # the client serialises a dict body as it is
            _request_timeout=REQUEST_TIMEOUT_S,
        ),
    )


def pod_log_tail(cluster: Cluster, namespace: str, name: str, lines: int = 20) -> str:
    """The last ``lines`` of the pod's log ("" when it cannot be read)."""
    core = kubernetes.client.CoreV1Api(cluster.api)
    try:
        return str(
            core.read_namespaced_pod_log(
                name, namespace, tail_lines=lines, _request_timeout=REQUEST_TIMEOUT_S
            )
        )
    except (k8s_errors.ApiException, urllib3.exceptions.HTTPError, OSError):
        return ""


def delete(cluster: Cluster, kind: str, namespace: str, name: str) -> None:
    """Delete a ``pod``, ``policy`` or ``namespace`` (``namespace`` unused); gone is fine.

    Raises:
        PluginError: the delete failed otherwise.
    """
    core = kubernetes.client.CoreV1Api(cluster.api)
    custom = kubernetes.client.CustomObjectsApi(cluster.api)
    t = REQUEST_TIMEOUT_S
    calls: dict[str, Callable[[], Any]] = {
        "pod": lambda: core.delete_namespaced_pod(name, namespace, _request_timeout=t),
        "policy": lambda: custom.delete_namespaced_custom_object(
            api_policy.GROUP,
            api_policy.VERSION,
            namespace,
            api_policy.PLURAL,
            name,
            _request_timeout=t,
        ),  # fmt: skip
        "namespace": lambda: core.delete_namespace(name, _request_timeout=t),
    }
    try:
        _call(cluster, f"deleting {kind} {name}", calls[kind])
    except k8s_errors.ApiException as exc:
        if exc.status != 404:
            raise PluginError(f"deleting {kind} {name}: {_message(exc)}") from None


def policy_exists(cluster: Cluster, namespace: str, name: str) -> bool:
    """Whether the policy is still there (its finalizer is lifted once the clocks are reset)."""
    try:
        get_policy(cluster, namespace, name)
    except PluginError:
        return False
    return True


def label_namespace(cluster: Cluster, name: str, labels: dict[str, str]) -> None:
    """Set ``labels`` on namespace ``name`` (a merge patch).

    Raises:
        PluginError: the write failed.
    """
    core = kubernetes.client.CoreV1Api(cluster.api)
    body = {"metadata": {"labels": labels}}
    _write(
        cluster,
        f"labelling namespace {name}",
        lambda: core.patch_namespace(name, body, _request_timeout=REQUEST_TIMEOUT_S),
    )
