"""The only module outside kopf that talks to the Kubernetes API (the official client).

Synchronous calls, used from kopf's sync handlers (kopf runs them in a thread pool). Every
function names the object it touches; API errors other than the expected ones propagate and
the handler turns them into ``kopf.TemporaryError``.
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar, cast

import kubernetes
import urllib3
from kubernetes.client import exceptions as k8s_errors

from rlenergy.api.v1alpha1 import nodereport as api_nodereport
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy_operator import builders

ApiError = k8s_errors.ApiException
"""What every function here raises on an API failure (``.status``, ``.reason``); an API server
that cannot be reached (restart, network) is one too, with status 0."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _unreachable_is_api_error(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Turn transport errors into ``ApiError(status=0)``.

    Connection refused or reset while the API server restarts: handlers then retry them like
    any API failure (a TemporaryError, no traceback).
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiError(status=0, reason=f"API server unreachable: {exc}") from exc

    return wrapper


@functools.cache
def _api() -> kubernetes.client.ApiClient:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def _unless_missing(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``; None when the API server answers 404 (the object or its kind is gone)."""
    try:
        return call(*args)
    except k8s_errors.ApiException as exc:
        if exc.status == 404:
            return None
        raise


APPLY_PATCH = "application/apply-patch+yaml"
"""Content type of a server-side apply (JSON is YAML, so the client sends the body as JSON)."""


@_unreachable_is_api_error
def ensure_daemonset(body: dict[str, Any]) -> str:
    """Server-side apply the DaemonSet ``body``: ``created``, ``updated`` or ``unchanged``.

    Applied as ``builders.FIELD_MANAGER`` with ``force`` (the operator owns every field it
    renders; a conflicting value another manager set is taken back): a field the operator set
    before and ``body`` leaves out is removed, a field only another manager owns (a label
    someone added) stays. A DaemonSet the operator wrote before it applied server-side first
    has its legacy field manager's fields moved to the apply's (``upgrade_managed_fields``).
    One GET before the apply tells created, updated and unchanged apart: unchanged when the
    object's content (``builders.apply_body``: metadata labels and annotations, ``spec``) is
    the same before and after. Not the ``resourceVersion``: the DaemonSet controller's status
    writes move it between the GET and the apply.
    """
    apps = kubernetes.client.AppsV1Api(_api())
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    before = _read_and_upgrade(ns, name)
    applied = apps.patch_namespaced_daemon_set(
        name,
        ns,
        cast(Any, builders.apply_body(body)),  # a plain dict body
        field_manager=builders.FIELD_MANAGER,
        force=True,
        _content_type=APPLY_PATCH,
    )
    if before is None:
        return "created"
    after = builders.apply_body(_api().sanitize_for_serialization(applied))
    return "unchanged" if after == builders.apply_body(before) else "updated"


UPGRADE_ATTEMPTS = 5
"""Reads of a DaemonSet whose managed-fields upgrade lost the race to another writer (the
DaemonSet controller writes ``status`` right after a create) before the error propagates."""


def _read_and_upgrade(namespace: str, name: str) -> dict[str, Any] | None:
    """The live DaemonSet as read (a plain dict); its managed fields upgraded.

    None when the DaemonSet does not exist. An upgrade refused because the object changed since
    the read (422, the JSON patch's ``test`` failed; 409) reads again, up to
    ``UPGRADE_ATTEMPTS`` times; the last refusal propagates as an ``ApiError``.
    """
    apps = kubernetes.client.AppsV1Api(_api())
    for attempt in range(UPGRADE_ATTEMPTS):
        current = _unless_missing(apps.read_namespaced_daemon_set, name, namespace)
        if current is None:
            return None
        live: dict[str, Any] = _api().sanitize_for_serialization(current)
        try:
            upgrade_managed_fields(live)
        except k8s_errors.ApiException as exc:
            if exc.status not in (409, 422) or attempt == UPGRADE_ATTEMPTS - 1:
                raise
            continue
        return live
    raise AssertionError("unreachable")  # pragma: no cover


def upgrade_managed_fields(live: dict[str, Any]) -> bool:
    """Give the operator's apply the fields its pre-apply writes own (``builders``).

    A JSON patch of ``metadata.managedFields`` that first tests the object's
    ``resourceVersion``: an object changed since it was read is refused (an ``ApiError``;
    ``ensure_daemonset`` reads again). Only the main resource is patched (apps/v1 DaemonSet).

    Returns:
        Whether a patch was sent (False: no legacy entry).
    """
    meta = live.get("metadata") or {}
    upgraded = builders.upgraded_managed_fields(
        meta.get("managedFields") or [], str(live.get("apiVersion") or "apps/v1")
    )
    if upgraded is None:
        return False
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
        {"op": "replace", "path": "/metadata/managedFields", "value": upgraded},
    ]
    kubernetes.client.AppsV1Api(_api()).patch_namespaced_daemon_set(
        meta["name"], meta["namespace"], ops, _content_type="application/json-patch+json"
    )
    return True


@_unreachable_is_api_error
def delete_daemonset(namespace: str, name: str) -> bool:
    """Delete the DaemonSet; False when it was already gone."""
    apps = kubernetes.client.AppsV1Api(_api())
    try:
        apps.delete_namespaced_daemon_set(name, namespace)
    except k8s_errors.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


@_unreachable_is_api_error
def read_daemonset(namespace: str, name: str) -> dict[str, Any] | None:
    """The DaemonSet as a plain dict (``metadata``, ``spec``, ``status``); None when missing."""
    apps = kubernetes.client.AppsV1Api(_api())
    ds = _unless_missing(apps.read_namespaced_daemon_set, name, namespace)
    if ds is None:
        return None
    out: dict[str, Any] = _api().sanitize_for_serialization(ds)
    return out


NODE_PAGE = 250
"""Nodes per page of a Node list (``limit``; the API server's ``continue`` token fetches the
next). The list of ``bench/scale.py``'s 1,000 KWOK nodes is 4.1 MB of JSON, and reading and
decoding it whole raised a Python process's peak RSS by 22.7 MB, so a whole list would cost
each operator process (each shard) about 230 MB at 10,000 nodes; a page costs a quarter of
the 1,000-node figure at any cluster size."""


def _node_pages(**kwargs: Any) -> Iterator[list[dict[str, Any]]]:
    """The cluster's nodes, one page (``NODE_PAGE``) of raw JSON items at a time.

    Raw JSON, not client models: a 1,000-node listing as models cost ~100 MB of operator RSS.
    ``kwargs`` go to ``list_node`` (``label_selector``). An expired ``continue`` token (410
    Gone) raises as any other API error; the caller keeps its last finding.
    """
    core = kubernetes.client.CoreV1Api(_api())
    token: str | None = None
    while True:
        resp = core.list_node(limit=NODE_PAGE, _continue=token, _preload_content=False, **kwargs)
        body = json.loads(cast(Any, resp).data)  # urllib3 response
        yield body.get("items") or []
        token = (body.get("metadata") or {}).get("continue") or None
        if token is None:
            return


@_unreachable_is_api_error
def labelled_nodes(selector: str) -> list[dict[str, Any]]:
    """The nodes matching the label ``selector`` as plain dicts (``metadata``, ``spec``)."""
    return [
        {
            "metadata": {"name": (n.get("metadata") or {}).get("name", "")},
            "spec": {"taints": (n.get("spec") or {}).get("taints") or []},
        }
        for n in itertools.chain.from_iterable(_node_pages(label_selector=selector))
    ]


@_unreachable_is_api_error
def all_nodes() -> list[dict[str, Any]]:
    """Every node as a plain dict, for the agent coverage check.

    Keeps ``metadata`` (name, labels), ``spec.taints`` and the ``nvidia.com/gpu`` entry of
    ``status.allocatable``.
    """
    out = []
    for n in itertools.chain.from_iterable(_node_pages()):
        meta = n.get("metadata") or {}
        gpus = ((n.get("status") or {}).get("allocatable") or {}).get("nvidia.com/gpu")
        out.append(
            {
                "metadata": {"name": meta.get("name", ""), "labels": meta.get("labels") or {}},
                "spec": {"taints": (n.get("spec") or {}).get("taints") or []},
                "status": {"allocatable": {} if gpus is None else {"nvidia.com/gpu": gpus}},
            }
        )
    return out


@_unreachable_is_api_error
def live_policies(namespaces: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every RLEnergyPolicy that is not being deleted: cluster-wide, or in ``namespaces``.

    Args:
        namespaces: the namespaces the operator serves (a namespaced install: one list per
            namespace, Roles only); empty: one cluster-wide list.
    """
    api = kubernetes.client.CustomObjectsApi(_api())
    g, v, plural = api_policy.GROUP, api_policy.VERSION, api_policy.PLURAL
    listings = [
        cast(dict[str, Any], listing)
        for listing in (
            [api.list_namespaced_custom_object(g, v, ns, plural) for ns in namespaces]
            if namespaces
            else [api.list_cluster_custom_object(g, v, plural)]
        )
    ]
    return [
        item
        for listing in listings
        for item in listing.get("items", [])
        if not item.get("metadata", {}).get("deletionTimestamp")
    ]


@_unreachable_is_api_error
def node_reports(namespace: str, policy_name: str) -> list[dict[str, Any]]:
    """The RLEnergyNodeReports of one policy (selected on ``spec.policyName``)."""
    api = kubernetes.client.CustomObjectsApi(_api())
    listing = cast(
        dict[str, Any],
        api.list_namespaced_custom_object(
            api_nodereport.GROUP,
            api_nodereport.VERSION,
            namespace,
            api_nodereport.PLURAL,
            field_selector=f"spec.policyName={policy_name}",
        ),
    )
    items: list[dict[str, Any]] = listing.get("items", [])
    return items


@_unreachable_is_api_error
def json_patch_policy(namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
    """Apply JSON Patch ``ops`` to an RLEnergyPolicy (its metadata: ``shards.adoption_patch``).

    A failed ``test`` op is a 422 ``ApiError``: nothing was changed.
    """
    api = kubernetes.client.CustomObjectsApi(_api())
    g, v, plural = api_policy.GROUP, api_policy.VERSION, api_policy.PLURAL
    api.patch_namespaced_custom_object(
        g, v, namespace, plural, name, ops, _content_type="application/json-patch+json"
    )


@_unreachable_is_api_error
def peering_objects(namespaces: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The kopf peering objects: ClusterKopfPeerings, or the KopfPeerings of ``namespaces``.

    What ``shards.other_layouts`` reads (names and statuses). A cluster without kopf's peering
    CRDs (an operator run with ``--standalone``) has none: 404 is an empty list.
    """
    api = kubernetes.client.CustomObjectsApi(_api())
    g, v = "kopf.dev", "v1"
    listings = (
        [_unless_missing(api.list_namespaced_custom_object, g, v, ns, "kopfpeerings")
         for ns in namespaces]
        if namespaces
        else [_unless_missing(api.list_cluster_custom_object, g, v, "clusterkopfpeerings")]
    )  # fmt: skip
    return [item for listing in listings for item in (listing or {}).get("items") or []]


_METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


@_unreachable_is_api_error
def node_report_versions(namespace: str, policy_name: str) -> dict[str, str]:
    """Name -> ``resourceVersion`` of a policy's RLEnergyNodeReports (metadata only).

    The API server answers with ``PartialObjectMetadataList`` (no specs), so a pass that finds
    nothing changed costs one small request instead of every report's step records.
    """
    api = kubernetes.client.CustomObjectsApi(_api())
    listing = cast(
        dict[str, Any],
        api.list_namespaced_custom_object(
            api_nodereport.GROUP,
            api_nodereport.VERSION,
            namespace,
            api_nodereport.PLURAL,
            field_selector=f"spec.policyName={policy_name}",
            _headers={"Accept": _METADATA_LIST},
        ),
    )
    return {
        str(item["metadata"]["name"]): str(item["metadata"]["resourceVersion"])
        for item in (listing or {}).get("items") or []  # an empty metadata list says null
    }


@_unreachable_is_api_error
def node_report(namespace: str, name: str) -> tuple[str, dict[str, Any]] | None:
    """``(resourceVersion, spec)`` of one RLEnergyNodeReport; None when it does not exist."""
    api = kubernetes.client.CustomObjectsApi(_api())
    obj = _unless_missing(
        api.get_namespaced_custom_object,
        api_nodereport.GROUP,
        api_nodereport.VERSION,
        namespace,
        api_nodereport.PLURAL,
        name,
    )
    if obj is None:
        return None
    return str(obj["metadata"]["resourceVersion"]), dict(obj.get("spec") or {})


SCALE_RESOURCES: dict[str, tuple[str, str, str]] = {
    "StatefulSet": ("apps", "v1", "statefulsets"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
}
"""Worker-set kinds resized through their ``/scale`` subresource: (group, version, plural)."""


_METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


@_unreachable_is_api_error
def worker_set_annotations(kind: str, namespace: str, name: str) -> dict[str, str] | None:
    """``metadata.annotations`` of a worker set (the opt-in, ``optin.ANNOTATION``).

    A metadata-only GET (``PartialObjectMetadata``: no pod template). RBAC: ``get`` on the
    kind (the ``/scale`` subresource carries no annotations).

    Args:
        kind: a key of ``SCALE_RESOURCES``.
        namespace: the worker set's namespace (the policy's).
        name: its name.

    Returns:
        The annotations (empty when it has none); ``None`` when the object (or its kind) does
        not exist (404).
    """
    group, version, plural = SCALE_RESOURCES[kind]
    api = kubernetes.client.CustomObjectsApi(_api())
    obj = _unless_missing(
        functools.partial(api.get_namespaced_custom_object, _headers={"Accept": _METADATA}),
        group,
        version,
        namespace,
        plural,
        name,
    )
    if obj is None:
        return None
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return {str(k): str(v) for k, v in annotations.items()}


@_unreachable_is_api_error
def scale_replicas(kind: str, namespace: str, name: str) -> int | None:
    """``spec.replicas`` of a worker set read through its ``/scale`` subresource.

    Args:
        kind: a key of ``SCALE_RESOURCES``.
        namespace: the worker set's namespace (the policy's).
        name: its name.

    Returns:
        The replicas, workers; ``None`` when the object (or its kind) does not exist (404).
    """
    group, version, plural = SCALE_RESOURCES[kind]
    api = kubernetes.client.CustomObjectsApi(_api())
    obj = _unless_missing(
        api.get_namespaced_custom_object_scale, group, version, namespace, plural, name
    )
    if obj is None:
        return None
    return int(((obj or {}).get("spec") or {}).get("replicas") or 0)


@_unreachable_is_api_error
def set_scale_replicas(kind: str, namespace: str, name: str, replicas: int) -> None:
    """Set ``spec.replicas`` of a worker set through its ``/scale`` subresource (merge patch)."""
    group, version, plural = SCALE_RESOURCES[kind]
    api = kubernetes.client.CustomObjectsApi(_api())
    api.patch_namespaced_custom_object_scale(
        group, version, namespace, plural, name, {"spec": {"replicas": int(replicas)}}
    )


RAY_CLUSTER = ("ray.io", "v1", "rayclusters")
"""KubeRay's RayCluster: (group, version, plural); its worker groups have no ``/scale``."""


@_unreachable_is_api_error
def ray_cluster(namespace: str, name: str) -> dict[str, Any] | None:
    """A RayCluster object; ``None`` when it (or the kind) does not exist (404)."""
    group, version, plural = RAY_CLUSTER
    api = kubernetes.client.CustomObjectsApi(_api())
    obj = _unless_missing(api.get_namespaced_custom_object, group, version, namespace, plural, name)
    return None if obj is None else dict(obj)


@_unreachable_is_api_error
def patch_ray_worker_group(
    namespace: str,
    name: str,
    resource_version: str,
    index: int,
    group_name: str,
    replicas: int,
    scale_strategy: dict[str, Any],
) -> None:
    """Set ``replicas`` and ``scaleStrategy`` of ``spec.workerGroupSpecs[index]`` (JSON patch).

    The patch first tests the object's ``resourceVersion`` and the group's ``groupName``, so a
    RayCluster changed since it was read (groups reordered, replicas edited) is refused by the
    API server (an ``ApiError``; the caller retries with a fresh read) instead of patched blind.
    """
    group, version, plural = RAY_CLUSTER
    at = f"/spec/workerGroupSpecs/{int(index)}"
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
        {"op": "test", "path": f"{at}/groupName", "value": group_name},
        {"op": "add", "path": f"{at}/replicas", "value": int(replicas)},
        {"op": "add", "path": f"{at}/scaleStrategy", "value": scale_strategy},
    ]
    api = kubernetes.client.CustomObjectsApi(_api())
    api.patch_namespaced_custom_object(
        group, version, namespace, plural, name, ops, _content_type="application/json-patch+json"
    )


@_unreachable_is_api_error
def watched_versions(
    namespaces: Sequence[str] = (), timeout_s: float = 30.0, report_selector: str | None = None
) -> dict[tuple[str, str, str], str]:
    """``(plural, namespace, name) -> resourceVersion`` of every RLEnergyPolicy and node report.

    Only the reports ``report_selector`` selects, when given (a shard's: what its watch gets).

    Metadata-only lists (``PartialObjectMetadataList``, no specs or statuses), cluster-wide or
    one per namespace in ``namespaces``: what the operator's watches should have delivered
    (``liveness.WatchLag``). Served from the API server's watch cache (``resourceVersion=0``),
    the source the watches are fed from, so a read costs the API server no etcd read and no
    decoding of every report; a cache a moment behind only lists a version the next read
    corrects. Each request gives up after ``timeout_s`` seconds (a connection that stopped
    answering is dropped; the next read opens a new one).
    """
    api = kubernetes.client.CustomObjectsApi(_api())
    out: dict[tuple[str, str, str], str] = {}
    kw: dict[str, Any] = {
        "_headers": {"Accept": _METADATA_LIST},
        "_request_timeout": timeout_s,
        "resource_version": "0",
    }
    for group, version, plural, selector in (
        (api_policy.GROUP, api_policy.VERSION, api_policy.PLURAL, None),
        (api_nodereport.GROUP, api_nodereport.VERSION, api_nodereport.PLURAL, report_selector),
    ):
        args = kw | ({"label_selector": selector} if selector else {})
        listings = (
            [
                api.list_namespaced_custom_object(group, version, ns, plural, **args)
                for ns in namespaces
            ]
            if namespaces
            else [api.list_cluster_custom_object(group, version, plural, **args)]
        )
        for listing in listings:
            for item in (cast(dict[str, Any], listing) or {}).get("items") or []:
                meta = item["metadata"]
                key = (plural, str(meta.get("namespace") or ""), str(meta["name"]))
                out[key] = str(meta["resourceVersion"])
    return out


def _plain(obj: Any) -> dict[str, Any]:
    return cast(dict[str, Any], _api().sanitize_for_serialization(obj))


@_unreachable_is_api_error
def ensure_ca_secret(
    namespace: str, name: str, make: Callable[[], tuple[bytes, bytes]]
) -> dict[str, bytes]:
    """The CA in Secret ``namespace/name``, made and stored if absent.

    Returns:
        The Secret's data, decoded: ``tls.crt``, ``tls.key`` and, while a replaced CA is still
        trusted, ``previous.crt``.

    Two replicas starting together both try to create it; the loser reads the winner's (409).

    Args:
        namespace: the operator's namespace.
        name: the Secret's name.
        make: a new (certificate PEM, key PEM), called only when the Secret is absent.
    """
    core = kubernetes.client.CoreV1Api(_api())

    def read() -> dict[str, bytes] | None:
        secret = _unless_missing(core.read_namespaced_secret, name, namespace)
        if secret is None:
            return None
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    found = read()
    if found is not None:
        return found
    cert, key = make()
    body = {
        "metadata": {"name": name, "namespace": namespace},
        "type": "kubernetes.io/tls",
        "data": {
            "tls.crt": base64.b64encode(cert).decode(),
            "tls.key": base64.b64encode(key).decode(),
        },
    }
    try:
        core.create_namespaced_secret(namespace, cast(Any, body))
    except k8s_errors.ApiException as exc:
        if exc.status != 409:
            raise
        again = read()
        if again is None:
            raise
        return again
    return {"tls.crt": cert, "tls.key": key}


@_unreachable_is_api_error
def ensure_configmap(namespace: str, name: str, data: dict[str, str]) -> str:
    """Create ConfigMap ``namespace/name`` with ``data``, or replace its data when it differs.

    Returns:
        ``created``, ``updated`` or ``unchanged``.
    """
    core = kubernetes.client.CoreV1Api(_api())
    live = _unless_missing(core.read_namespaced_config_map, name, namespace)
    if live is None:
        body = {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/managed-by": "rlenergy-operator"},
            },
            "data": data,
        }
        try:
            core.create_namespaced_config_map(namespace, cast(Any, body))
        except k8s_errors.ApiException as exc:
            if exc.status != 409:
                raise
            return "unchanged"
        return "created"
    if dict(live.data or {}) == data:
        return "unchanged"
    core.patch_namespaced_config_map(name, namespace, {"data": data})
    return "updated"


@_unreachable_is_api_error
def pods(namespace: str, label_selector: str) -> list[dict[str, Any]]:
    """The pods of ``namespace`` matching ``label_selector`` (plain dicts)."""
    core = kubernetes.client.CoreV1Api(_api())
    listing = core.list_namespaced_pod(namespace, label_selector=label_selector)
    return [_plain(p) for p in listing.items]


@_unreachable_is_api_error
def read_node(name: str) -> dict[str, Any] | None:
    """Node ``name`` (a plain dict), or None when it does not exist."""
    core = kubernetes.client.CoreV1Api(_api())
    node = _unless_missing(core.read_node, name)
    return None if node is None else _plain(node)


@_unreachable_is_api_error
def decide_csr(name: str, approve: bool, reason: str, message: str) -> None:
    """Approve or deny CertificateSigningRequest ``name`` (its ``/approval`` subresource)."""
    certs = kubernetes.client.CertificatesV1Api(_api())
    condition = {
        "type": "Approved" if approve else "Denied",
        "status": "True",
        "reason": reason,
        "message": message,
    }
    certs.patch_certificate_signing_request_approval(name, {"status": {"conditions": [condition]}})


@_unreachable_is_api_error
def sign_csr(name: str, certificate_b64: str) -> None:
    """Write the issued certificate (base64 PEM) into ``status.certificate`` of ``name``."""
    certs = kubernetes.client.CertificatesV1Api(_api())
    certs.patch_certificate_signing_request_status(
        name, {"status": {"certificate": certificate_b64}}
    )


@_unreachable_is_api_error
def set_webhook_ca_bundle(name: str, bundle_pem: bytes, *, unless_trusts: bytes = b"") -> bool:
    """Set ``caBundle`` of every webhook of MutatingWebhookConfiguration ``name``.

    Args:
        name: the configuration.
        bundle_pem: the PEM bundle to set.
        unless_trusts: a PEM certificate; when every webhook's bundle already holds it, the
            configuration is left as it is (another operator replica may have set a bundle
            with one more CA in it, during a CA rotation).

    Returns:
        Whether it changed (False: already equal or trusting, or no such configuration).
    """
    adm = kubernetes.client.AdmissionregistrationV1Api(_api())
    live = _unless_missing(adm.read_mutating_webhook_configuration, name)
    if live is None:
        return False
    want = base64.b64encode(bundle_pem).decode()
    hooks = _plain(live).get("webhooks") or []
    bundles = [(h.get("clientConfig") or {}).get("caBundle") or "" for h in hooks]
    if all(b == want for b in bundles):
        return False
    if unless_trusts and all(unless_trusts.strip() in base64.b64decode(b) for b in bundles):
        return False
    patch = [
        {
            "op": "replace" if "caBundle" in (h.get("clientConfig") or {}) else "add",
            "path": f"/webhooks/{i}/clientConfig/caBundle",
            "value": want,
        }
        for i, h in enumerate(hooks)
    ]
    adm.patch_mutating_webhook_configuration(name, patch)
    return True
