"""Kubernetes I/O of the agent: the node report writer and the plan watcher.

Requests go through the agent's own transport (``rlenergy_agent.kubeapi``: urllib3, no
``kubernetes`` package). The writer owns one
``RLEnergyNodeReport`` per policy and node (``<policy>-<node>``; no two writers share an
object), writes at most once per RL step (finished steps are batched) and retries transient API
errors (429, 5xx, connection loss) with exponential backoff. The watcher follows the policy's
``status.plan`` by a watch with bookmarks (one long request per agent instead of a GET every
plan-poll period; it lists again after 410 Gone and API server restarts); a deleted policy
yields ``None`` so the agent resets clocks. ``PolicyDiscovery`` finds the policy that
governs the node's GPU pods when none is configured. ``TokenReviewer`` checks the trainer
pods' bearer tokens and ``CurrentPod`` their pod's UID (``rlenergy_agent.identity``);
``ended_pods`` tells which governed pods
ended (reset on pod end). Callers: ``rlenergy_agent.__main__``, ``rlenergy_agent.nodeloop``.

A report write carries what changed since the last one: once the writer knows the stored
object (the API server's answer to its previous write), it sends a JSON Patch (RFC 6902) of the
changed fields, the new step records appended and the records that left the report removed
(those the operator folded: ``api_node.unfolded_steps``), guarded by a ``test`` of the
object's ``resourceVersion``; a report of 8 GPUs then sends a few kB per RL step instead of the
whole report (``docs/scale-and-chaos.md``). When the stored
object is not the one the patch was made against (409 or 422: another writer, a lost answer) or
the writer knows none (start-up, an error), it writes the whole report as a JSON merge patch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rlenergy.api import naming, selector
from rlenergy.api import node as api_node
from rlenergy_agent import identity, kubeapi, pods
from rlenergy_agent.kubeapi import ApiException as ApiException

log = logging.getLogger(__name__)

GROUP = "rlenergy.io"
VERSION = "v1alpha1"
REPORT_PLURAL = "rlenergynodereports"
REPORT_KIND = "RLEnergyNodeReport"
POLICY_PLURAL = "rlenergypolicies"
RETRYABLE = frozenset({409, 429, 500, 502, 503, 504})
JSON_PATCH = "application/json-patch+json"
STALE_BASE = frozenset({409, 422})
"""Answers to a JSON Patch whose ``resourceVersion`` test failed (422) or that conflicted (409):
the stored report is not the one the patch was made against."""


def report_name(policy: str, node: str) -> str:
    """Object name of a node's report (``rlenergy.api.naming.report_name``: hashed)."""
    return naming.report_name(policy, node)


def load_api(
    kubeconfig: str | None = None, *, pool_maxsize: int = kubeapi.DEFAULT_POOL_MAXSIZE
) -> CustomObjects:
    """The custom object calls (``CustomObjects``) from the in-cluster config, else the kubeconfig.

    Without ``kubeconfig`` the client made becomes the process-wide one
    (``kubeapi.default_client``) that the other classes here use by default.

    Args:
        kubeconfig: a kubeconfig file to use instead (local runs, tests, benchmarks); its own
            client, the process-wide one is left alone.
        pool_maxsize: connections kept open to the API server (``kubeapi.ApiClient``).

    Raises:
        kubeapi.ConfigError: no usable configuration.
    """
    if kubeconfig is not None:
        config = kubeapi.from_kubeconfig(kubeconfig)
        return CustomObjects(kubeapi.ApiClient(config, pool_maxsize=pool_maxsize))
    client = kubeapi.ApiClient(kubeapi.load(), pool_maxsize=pool_maxsize)
    kubeapi.set_default(client)
    return CustomObjects(client)


class CustomObjects:
    """The ``CustomObjectsApi`` calls the agent makes, through a ``kubeapi.ApiClient``.

    The methods, arguments and answers of the ``kubernetes`` client's ``CustomObjectsApi`` for
    the calls the agent makes (JSON as dicts, ``ApiException`` on an error status, the unread
    urllib3 response with ``_preload_content=False`` for a ``kubeapi.Watch``), so code written
    against either runs on both.

    Args:
        api_client: a ``kubeapi.ApiClient`` (default: the process-wide one,
            ``kubeapi.default_client``, taken at the first call).
    """

    def __init__(self, api_client: Any | None = None) -> None:
        self._client = api_client

    @property
    def api_client(self) -> Any:
        """The ``kubeapi.ApiClient`` the calls go through."""
        if self._client is None:
            self._client = kubeapi.default_client()
        return self._client

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str | None = None,
        preload: bool = True,
        timeout: Any = None,
    ) -> Any:
        return call_json(
            self.api_client, method, path, query=query, body=body,
            content_type=content_type, preload=preload, timeout=timeout,
        )  # fmt: skip

    @staticmethod
    def _path(group: str, version: str, namespace: str, plural: str, name: str = "") -> str:
        return f"/apis/{group}/{version}/namespaces/{namespace}/{plural}" + (
            f"/{name}" if name else ""
        )

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str,
        _request_timeout: Any = None,
    ) -> Any:  # fmt: skip
        """``GET`` one object (a dict).

        Raises:
            ApiException: an error status (404: no such object).
        """
        path = self._path(group, version, namespace, plural, name)
        return self._call("GET", path, timeout=_request_timeout)

    def list_namespaced_custom_object(
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        resource_version: str | None = None,
        allow_watch_bookmarks: bool | None = None,
        timeout_seconds: int | None = None,
        watch: bool | None = None,
        _preload_content: bool = True,
        _request_timeout: Any = None,
    ) -> Any:
        """``LIST`` (a dict) or, with ``watch``, ``WATCH`` (the open urllib3 response).

        Raises:
            ApiException: an error status.

        :rtype: object
        """
        query = [
            (key, str(value).lower() if isinstance(value, bool) else str(value))
            for key, value in (
                ("fieldSelector", field_selector),
                ("labelSelector", label_selector),
                ("resourceVersion", resource_version),
                ("allowWatchBookmarks", allow_watch_bookmarks),
                ("timeoutSeconds", timeout_seconds),
                ("watch", watch),
            )
            if value is not None
        ]
        path = self._path(group, version, namespace, plural)
        return self._call(
            "GET", path, query=query, preload=_preload_content, timeout=_request_timeout
        )

    def patch_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, body: Any,
        _content_type: str | None = None, _request_timeout: Any = None,
    ) -> Any:  # fmt: skip
        """``PATCH`` one object: a JSON merge patch (a dict), or ``_content_type``.

        Raises:
            ApiException: an error status.
        """
        path = self._path(group, version, namespace, plural, name)
        return self._call(
            "PATCH", path, body=body, content_type=_content_type, timeout=_request_timeout
        )

    def create_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, body: Any,
        _request_timeout: Any = None,
    ) -> Any:  # fmt: skip
        """``POST`` one object.

        Raises:
            ApiException: an error status (409: it exists).
        """
        path = self._path(group, version, namespace, plural)
        return self._call("POST", path, body=body, timeout=_request_timeout)


def start_clients() -> kubeapi.ApiClient:
    """The process-wide ``kubeapi.ApiClient``, made at start-up (after ``load_api``).

    Call before the signal socket serves, so no configuration is read, and nothing imported,
    in the node loop while trainers signal (work there takes the GIL from every signal: each of
    a signal's NVML calls releases it and waits up to the interpreter's 5 ms switch interval to
    get it back).

    Raises:
        kubeapi.ConfigError: no usable configuration.
    """
    return kubeapi.default_client()


class NodeList:
    """One kind of object of one node as the API server's JSON, through a ``kubeapi.ApiClient``.

    One ``GET <path>`` with the field selector ``spec.nodeName=<node>``, no model class: the
    agent reads a few fields. The kinds the agent lists are ``NodePods`` and
    ``NodeResourceSlices``.

    Args:
        node: the node.
        api_client: a ``kubeapi.ApiClient`` (default: the process-wide one, taken at the
            first listing).
        timeout_s: per listing deadline, s.
    """

    PATH = ""
    """The list's path (a class attribute of each kind)."""

    def __init__(
        self, node: str, api_client: Any | None = None, *, timeout_s: float = 10.0
    ) -> None:
        self.node = node
        self._client = api_client
        self.timeout_s = timeout_s

    def __call__(self) -> list[dict[str, Any]]:
        """The objects (the list's ``items``).

        Raises:
            ApiException: the API server answered an error (for
                ResourceSlices, 404: no ``resource.k8s.io/v1``; 403: no RBAC).
            OSError, urllib3 errors: it could not be reached.
        """
        if self._client is None:
            self._client = kubeapi.default_client()
        return list_pods(self._client, self.PATH, f"spec.nodeName={self.node}", self.timeout_s)


class NodePods(NodeList):
    """The pods on one node (``NodeList`` of ``/api/v1/pods``).

    RBAC: pods ``list`` (cluster-wide).
    """

    PATH = "/api/v1/pods"


class NodeResourceSlices(NodeList):
    """The DRA ResourceSlices of one node, for ``rlenergy_agent.dra``.

    The API server supports the ``spec.nodeName`` selector for them. RBAC: resourceslices
    ``list`` (cluster-scoped, read-only). Listed only while a pod of the node holds a DRA device.
    """

    PATH = "/apis/resource.k8s.io/v1/resourceslices"


def call_json(
    client: kubeapi.ApiClient,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: Any = None,
    content_type: str | None = None,
    preload: bool = True,
    timeout: Any = None,
) -> Any:
    """One request through ``client`` with a JSON answer, no model class.

    The client's configuration, bearer token and TLS serve it. Callers: ``CustomObjects``,
    ``list_pods``, ``TokenReviewer``, ``CertificateRequester``.

    Args:
        client: the ``kubeapi.ApiClient``.
        method: the HTTP method.
        path: the resource path (``/apis/...``, ``/api/v1/...``).
        query: query parameters.
        body: the request body (a dict or list), or None.
        content_type: the body's type (default: JSON merge patch for PATCH, else JSON).
        preload: False returns the urllib3 response unread (a watch's stream for
            ``kubeapi.Watch``, which checks its status).
        timeout: the request's timeout (s, or a (connect, read) pair, s).

    Returns:
        The decoded JSON answer (``{}`` for an empty one), or the unread response.

    Raises:
        ApiException: the API server answered an error status.
        OSError, urllib3 errors: it could not be reached.
    """
    resp = client.request(
        method, path, query=query, body=body, content_type=content_type, timeout=timeout,
        preload=preload,
    )  # fmt: skip
    if not preload:
        return resp
    if not 200 <= resp.status <= 299:
        raise ApiException.of(resp)
    return json.loads(resp.data or b"{}")


def list_pods(
    client: kubeapi.ApiClient, path: str, field_selector: str, timeout_s: float
) -> list[dict[str, Any]]:
    """``GET`` a pod list (or any list) through ``client`` (a ``kubeapi.ApiClient``), no models.

    Args:
        client: the ``kubeapi.ApiClient`` (its configuration, auth, TLS).
        path: ``/api/v1/pods`` or ``/api/v1/namespaces/<ns>/pods``.
        field_selector: the list's ``fieldSelector``.
        timeout_s: the request's timeout, s.

    Returns:
        The ``items`` of the ``PodList`` (dicts).

    Raises:
        ApiException: the API server answered an error status.
        OSError, urllib3 errors: it could not be reached.
    """
    answer = call_json(
        client, "GET", path, query=[("fieldSelector", field_selector)], timeout=timeout_s
    )
    items = answer.get("items") if isinstance(answer, dict) else None
    return [p for p in items or () if isinstance(p, dict)]


def _meta(pod: dict[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata")
    return meta if isinstance(meta, dict) else {}


class ReportWriter:
    """Creates or patches the node's ``RLEnergyNodeReport``.

    Args:
        api: a ``CustomObjects`` (or a stand-in with its methods, raising its ``ApiException``).
        namespace: the policy's namespace.
        policy: policy name.
        node: node name.
        max_retries: attempts per write.
        backoff_s: first retry delay, s (doubles each time).
        sleep: sleep function (tests).
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        policy: str,
        node: str,
        *,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = report_name(policy, node)
        self.policy = policy
        self.node = node
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._sleep = sleep
        self.writes = 0
        self.last_body_bytes = 0
        """The request body of the newest write that succeeded, bytes as the client sends it
        (``json.dumps``): the JSON Patch, or the whole report."""
        self.patched = 0
        """Writes sent as a JSON Patch of the changes (the rest sent the whole report)."""
        self._exists: bool | None = None
        # (resourceVersion, the wire-form spec last written: a fresh dict nothing mutates)
        self._base: tuple[str, dict[str, Any]] | None = None

    def body(self, report: api_node.NodeReport) -> dict[str, Any]:
        """The whole object for ``report``, its spec in wire form (``api_node.wire_form``)."""
        return self._body(api_node.wire_form(report))

    def _body(self, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": REPORT_KIND,
            "metadata": {"name": self.name, "namespace": self.namespace, "labels": self._labels()},
            "spec": spec,
        }

    def _labels(self) -> dict[str, str]:
        return {
            "rlenergy.io/policy": self.policy,
            "rlenergy.io/node": self.node,
            # the operator shard serving the policy watches its buckets only
            naming.POLICY_BUCKET_LABEL: str(naming.policy_bucket(self.namespace, self.policy)),
        }

    def write(self, report: api_node.NodeReport) -> None:
        """Create or patch the report, retrying transient errors.

        Raises:
            ApiException: a permanent error, or retries exhausted.
        """
        delay = self.backoff_s
        for attempt in range(self.max_retries):
            try:
                self._write_once(report)
                self.writes += 1
                return
            except ApiException as exc:
                if exc.status not in RETRYABLE or attempt == self.max_retries - 1:
                    raise
                log.warning("report write failed (%s), retrying in %.1f s", exc.status, delay)
            except OSError as exc:
                if attempt == self.max_retries - 1:
                    raise
                log.warning("report write failed (%s), retrying in %.1f s", exc, delay)
            self._sleep(delay)
            delay *= 2

    def _write_once(self, report: api_node.NodeReport) -> None:
        spec = api_node.wire_form(report)
        if self._exists is not False and self._patch_changes(spec):
            return
        if self._exists is not False:
            # A merge patch keeps what it does not name: the whole dump, nulls and defaults
            # included, so a member back at its default or null leaves the stored object.
            whole = {
                "spec": report.model_dump(by_alias=True, mode="json"),
                "metadata": {"labels": self._labels()},
            }
            try:
                stored = self.api.patch_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, REPORT_PLURAL, self.name, whole
                )
                self._exists = True
                self._stored(stored, whole, spec)
                return
            except ApiException as exc:
                if exc.status != 404:
                    raise
                self._exists = False
        body = self._body(spec)
        stored = self.api.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, REPORT_PLURAL, body
        )
        self._exists = True
        self._stored(stored, body, spec)
        self._retire_legacy()

    def _patch_changes(self, spec: dict[str, Any]) -> bool:
        """Send only what changed since the stored report; whether that write was made.

        False (the caller writes the whole report) when the stored object is unknown, or is not
        the one the patch was made against (``STALE_BASE``) or is gone (404).

        Raises:
            ApiException: any other API error (the stored object
                is unknown after it: the retry writes the whole report).
        """
        base, self._base = self._base, None  # known again only from this write's answer
        if base is None:
            return False
        version, stored = base
        ops = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": version},
            *json_patch(stored, spec, "/spec"),
        ]
        try:
            answer = self.api.patch_namespaced_custom_object(
                GROUP, VERSION, self.namespace, REPORT_PLURAL, self.name, ops,
                _content_type=JSON_PATCH,
            )  # fmt: skip
        except ApiException as exc:
            if exc.status in STALE_BASE or exc.status == 404:
                log.info("report %s changed since the last write (%s)", self.name, exc.status)
                return False
            raise
        self.patched += 1
        self._stored(answer, ops, spec)
        return True

    def _stored(self, answer: Any, sent: Any, spec: dict[str, Any]) -> None:
        """Keep the written spec (wire form) at the answered version: the next patch's base.

        The stored object is ``spec`` with the CRD's defaults filled in (``api_node.wire_form``)
        and any member this agent does not know left as it was: a patch made against ``spec``
        touches neither, and one whose path the stored object lacks fails (422) and is
        followed by a whole write.
        """
        self.last_body_bytes = len(kubeapi.encode(sent))
        meta = answer.get("metadata") if isinstance(answer, dict) else None
        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if isinstance(version, str) and version:
            self._base = (version, spec)

    def _retire_legacy(self) -> None:
        """Unlabel this node's report under the name agents used before the hash suffix.

        The operator lists a policy's reports by the ``rlenergy.io/policy`` label; the old
        object (left by the agent this one replaced) would count as a second, stale report of
        this node. Its label is removed (the agent may patch only its node's reports, and may
        not delete); the policy's deletion still garbage-collects it. Errors are logged only.
        """
        legacy = naming.legacy_report_name(self.policy, self.node)
        if legacy == self.name:
            return
        try:
            self.api.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                self.namespace,
                REPORT_PLURAL,
                legacy,
                {"metadata": {"labels": {"rlenergy.io/policy": None}}},
            )
            log.info("retired the old-named report %s/%s", self.namespace, legacy)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("could not retire old report %s: %s", legacy, exc.reason)
        except OSError as exc:
            log.warning("could not retire old report %s: %s", legacy, exc)


def json_patch(old: Any, new: Any, path: str = "") -> list[dict[str, Any]]:
    """RFC 6902 operations that turn the JSON value ``old`` into ``new`` (at ``path``).

    Objects are compared key by key (``add``, ``remove``, and the changed values); a list
    whose tail is the head of the new list (the report's window of step records moved on by
    records dropped at the front and appended at the end) becomes that many ``remove`` of
    index 0 and an ``add`` per new element at the end (``-``); another list of the same length
    is compared element by element, and any other change replaces the value. Applying the
    operations to ``old`` gives ``new`` (``tests/unit/agent/test_report_patch.py`` checks it
    with ``jsonpatch.apply_patch``).

    Args:
        old: the stored value (JSON types).
        new: the value to write.
        path: the JSON Pointer (RFC 6901) of both.
    """
    if old == new and type(old) is type(new):
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        ops: list[dict[str, Any]] = []
        for key in old:
            if key not in new:
                ops.append({"op": "remove", "path": f"{path}/{_pointer(key)}"})
        for key, value in new.items():
            if key not in old:
                ops.append({"op": "add", "path": f"{path}/{_pointer(key)}", "value": value})
            else:
                ops.extend(json_patch(old[key], value, f"{path}/{_pointer(key)}"))
        return ops
    if isinstance(old, list) and isinstance(new, list) and old:
        for dropped in range(len(old)):
            kept = len(old) - dropped
            if kept <= len(new) and old[dropped:] == new[:kept]:
                return [{"op": "remove", "path": f"{path}/0"}] * dropped + [
                    {"op": "add", "path": f"{path}/-", "value": v} for v in new[kept:]
                ]
        if len(old) == len(new):
            return [op for i, (a, b) in enumerate(zip(old, new, strict=True))
                    for op in json_patch(a, b, f"{path}/{i}")]  # fmt: skip
    if isinstance(old, bool | int | float) and isinstance(new, bool | int | float):
        if old == new and isinstance(old, bool) == isinstance(new, bool):
            return []  # 5 and 5.0: the API server answers integral floats as integers
    return [{"op": "replace", "path": path, "value": new}]


def _pointer(key: str) -> str:
    """A key as a JSON Pointer reference token (RFC 6901: ``~`` -> ``~0``, ``/`` -> ``~1``)."""
    return str(key).replace("~", "~0").replace("/", "~1")


class PlanWatcher:
    """Follows ``RLEnergyPolicy.status.plan`` by a watch on the one policy object.

    A background thread lists the policy (``metadata.name`` field selector: one object), then
    watches from the list's ``resourceVersion`` with bookmarks, so the API server sends the
    policy's changes (and a bookmark about once a minute) on one long request instead of a GET
    per agent every plan-poll period. A watch that ends (its ``timeout_seconds``) resumes from
    the newest resourceVersion seen, bookmarks included; ``410 Gone`` (too old) or any other
    error lists again, after an exponential backoff on errors (API server restarts).
    ``poll`` reads what the watch delivered last and sends no request.

    Args:
        api: a ``CustomObjectsApi``.
        namespace: the policy's namespace.
        policy: policy name.
        watch_timeout_s: ``timeout_seconds`` of one watch request, s (None: ``WATCH_TIMEOUT_S``).
        retry_max_s: longest wait between attempts after errors, s.
    """

    WATCH_TIMEOUT_S = 300.0
    """Default length of one watch request, s (the API server ends it; the watcher resumes)."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        policy: str,
        *,
        watch_timeout_s: float | None = None,
        retry_max_s: float = 10.0,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.policy = policy
        self.saving_ratio: dict[str, float] = {}
        """From the last poll: the status' saving / 100 per phase, ``""`` for the job's total."""
        self.lost_workers: list[str] = []
        """From the last poll: ``status.rollout.failure.lostWorkers`` (rollout worker pods the
        operator found lost mid-rollout), relayed to the dispatcher (``/v1/rollout/lost``)."""
        self.phase_source = "socket"
        """From the last poll: ``spec.phaseSource`` (``annotation``: ``annotations`` watch)."""
        self.folded_through_step = -1
        """From the last poll: ``status.totals.throughStep``, the newest step the operator
        folded into the status (``folded_through_step``; -1: none, or the policy is gone). The
        watch delivers a status the API server stored, so the report may leave out the records
        up to it (``api_node.unfolded_steps``); a late watch only delays that."""
        self.watch_timeout_s = self.WATCH_TIMEOUT_S if watch_timeout_s is None else watch_timeout_s
        self.retry_max_s = retry_max_s
        self.first_list_wait_s = 10.0
        self._lock = threading.Lock()
        self._seen: dict[str, Any] | None = None  # the policy object; {} deleted; None: unknown
        self._error: Exception | None = None
        self._stopped = threading.Event()
        self._watch: kubeapi.Watch | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"plan-watch-{namespace}/{policy}", daemon=True
        )
        self._thread.start()

    def poll(self) -> tuple[bool, api_node.ClockPlan | None]:
        """(policy exists, its plan or ``None``) as last delivered.

        Updates ``saving_ratio``, ``lost_workers``, ``phase_source`` and
        ``folded_through_step``. Sends no request. Until the first listing succeeded (the
        first call waits up to ``first_list_wait_s`` for it) it raises the listing's error, so
        the caller keeps its plan.

        Raises:
            ApiException: the first listing failed (any error).
            TimeoutError: the first listing has not answered yet.
        """
        self.wait_listed(self.first_list_wait_s)  # the first poll waits like a GET would
        with self._lock:
            seen, error = self._seen, self._error
        if seen is None:
            raise error or TimeoutError(f"policy {self.namespace}/{self.policy} not listed yet")
        if not seen:
            self.saving_ratio = {}
            self.lost_workers = []
            self.phase_source = "socket"
            self.folded_through_step = -1
            return False, None
        status = seen.get("status") or {}
        self.folded_through_step = folded_through_step(status)
        self.phase_source = str((seen.get("spec") or {}).get("phaseSource") or "socket")
        self.saving_ratio = saving_ratios(status)
        failure = (status.get("rollout") or {}).get("failure") or {}
        self.lost_workers = [str(p) for p in failure.get("lostWorkers") or []]
        plan = status.get("plan")
        return True, api_node.ClockPlan.model_validate(plan) if plan else None

    def wait_listed(self, timeout_s: float) -> bool:
        """Whether the first listing answered (or failed) within ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._seen is not None or self._error is not None:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def stop(self) -> None:
        """End the watch (the thread exits at the next event, bookmark or watch timeout)."""
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()

    def _set(self, seen: dict[str, Any] | None, error: Exception | None = None) -> None:
        with self._lock:
            if seen is not None:
                self._seen = seen
            self._error = error

    def _list(self) -> str:
        """List the policy; returns the list's resourceVersion."""
        listing = self.api.list_namespaced_custom_object(
            GROUP,
            VERSION,
            self.namespace,
            POLICY_PLURAL,
            field_selector=f"metadata.name={self.policy}",
        )
        items = listing.get("items") or []
        self._set(dict(items[0]) if items else {})
        return str((listing.get("metadata") or {}).get("resourceVersion") or "")

    def _follow(self, version: str) -> str:
        """One watch request from ``version``; returns the newest resourceVersion seen."""
        self._watch = watch = kubeapi.Watch()
        for event in watch.stream(
            self.api.list_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            POLICY_PLURAL,
            field_selector=f"metadata.name={self.policy}",
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=int(self.watch_timeout_s),
            _request_timeout=(10.0, self.watch_timeout_s + 30.0),
        ):
            kind, obj = event.get("type"), event["object"]
            if kind in ("ADDED", "MODIFIED"):
                self._set(dict(obj))
            elif kind == "DELETED":
                self._set({})
            if self._stopped.is_set():
                break
        return str(watch.resource_version or version)

    def _run(self) -> None:
        version, backoff = "", 0.5
        while not self._stopped.is_set():
            try:
                if not version:
                    version = self._list()
                version = self._follow(version)
                backoff = 0.5
            except ApiException as exc:
                version = ""  # 410 Gone or any API error: list again
                if self._stopped.is_set():
                    return  # stopped: what ended the watch is no news
                if exc.status != 410:
                    self._set(None, exc)
                    log.warning("plan watch %s/%s: %s", self.namespace, self.policy, exc.reason)
                    self._stopped.wait(backoff)
                    backoff = min(backoff * 2, self.retry_max_s)
            except Exception as exc:  # noqa: BLE001 - connection loss: list again after a pause
                version = ""
                if self._stopped.is_set():
                    return
                self._set(None, exc)
                log.warning("plan watch %s/%s: %s", self.namespace, self.policy, exc)
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, self.retry_max_s)


def folded_through_step(status: dict[str, Any]) -> int:
    """The newest step a policy status folded for good; -1: none.

    ``totals.throughStep``, and no later than ``rollout.throughStep`` where the status has a
    rollout (FlexFloor's sums fold the same records in the same status write).
    """
    marks: list[int] = []
    sources = [status.get("totals") or {}]
    if isinstance(status.get("rollout"), dict):
        sources.append(status["rollout"])
    for source in sources:
        mark = source.get("throughStep", -1)
        if type(mark) is not int:
            return -1
        marks.append(mark)
    return max(min(marks), -1)


def saving_ratios(status: dict[str, Any]) -> dict[str, float]:
    """The saving ratios of a policy status: phase -> ``saving.percent`` / 100.

    ``""`` -> ``totals.savingPercent`` / 100; what the status leaves out (not computable yet)
    is left out.
    """
    out: dict[str, float] = {}
    for p in status.get("phases") or []:
        percent = (p.get("saving") or {}).get("percent")
        if p.get("name") and isinstance(percent, int | float):
            out[str(p["name"])] = float(percent) / 100.0
    total = (status.get("totals") or {}).get("savingPercent")
    if isinstance(total, int | float):
        out[""] = float(total) / 100.0
    return out


class CurrentPod:
    """The API's current pod of a name: ``(namespace, name) -> identity.PodFacts | None``.

    One ``GET /api/v1/namespaces/<ns>/pods`` with the field selector ``metadata.name=<name>``
    (RBAC: pods ``list``, which the agent already has; no cache: each call asks, and the
    token cache calls it once per reviewed token). ``TokenAuthenticator`` compares the
    TokenReview's pod UID with it.

    Args:
        api_client: a ``kubeapi.ApiClient`` (default: the process-wide one, taken at the
            first call).
        timeout_s: per call deadline, s.
    """

    def __init__(
        self, api_client: Any | None = None, *, timeout_s: float = identity.REVIEW_TIMEOUT_S
    ) -> None:
        self._client = api_client
        self.timeout_s = timeout_s

    def __call__(self, namespace: str, name: str) -> identity.PodFacts | None:
        """The pod now (``None``: no pod of that name).

        Raises:
            identity.ReviewUnavailableError: the API server could not be asked.
        """
        if self._client is None:
            self._client = kubeapi.default_client()
        try:
            items = list_pods(
                self._client,
                f"/api/v1/namespaces/{namespace}/pods",
                f"metadata.name={name}",
                self.timeout_s,
            )
        except ApiException as exc:
            raise identity.ReviewUnavailableError(f"pod lookup failed: HTTP {exc.status}") from None
        except Exception as exc:  # noqa: BLE001 - urllib3 and socket errors: API unreachable
            raise identity.ReviewUnavailableError(f"pod lookup failed: {exc}") from None
        for p in items:
            meta = _meta(p)
            if meta.get("name") == name:
                return identity.PodFacts(
                    uid=str(meta.get("uid") or ""),
                    node_name=str((p.get("spec") or {}).get("nodeName") or ""),
                    deleting=meta.get("deletionTimestamp") is not None,
                    phase=str((p.get("status") or {}).get("phase") or ""),
                )
        return None


class PolicyDiscovery:
    """Finds the policy that governs this node's GPU pods (``rlenergy.api.selector``).

    Reads the labels of the pods on the node (one listing, field selector ``spec.nodeName``)
    and the policies of the GPU pods' namespaces; the choice itself is pure. RBAC: list pods
    (cluster-wide), list policies (cluster-wide, or a Role in each served namespace of a
    namespaced install: a namespace that answers 403 has no policy for this agent).

    Args:
        api: a ``CustomObjectsApi``.
        node: this node.
        list_pods: lists the node's pods (default: ``NodePods(node)``).
    """

    def __init__(
        self, api: Any, node: str, list_pods: Callable[[], list[dict[str, Any]]] | None = None
    ) -> None:
        self.api = api
        self.node = node
        self.list_pods = list_pods if list_pods is not None else NodePods(node)

    def discover(self, gpu_pods: Iterable[tuple[str, str]]) -> selector.Discovery:
        """The governing policy of the GPU pods ``(namespace, name)``.

        Raises:
            ApiException, OSError: the API could not be read (the
                caller keeps its current policy).
        """
        wanted = set(gpu_pods)
        if not wanted:
            return selector.discover((), ())
        labels: dict[tuple[str, str], dict[str, str]] = {}
        for p in self.list_pods():
            meta = _meta(p)
            if meta.get("namespace") and meta.get("name"):
                key = (str(meta["namespace"]), str(meta["name"]))
                labels[key] = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        pods = [selector.PodLabels(ns, name, labels.get((ns, name), {})) for ns, name in wanted]
        policies: list[selector.PolicySelector] = []
        for ns in sorted({ns for ns, _ in wanted}):
            try:
                objs = self.api.list_namespaced_custom_object(GROUP, VERSION, ns, POLICY_PLURAL)
            except ApiException as exc:
                if exc.status != 403:
                    raise
                # A namespaced install (chart rbac.watchNamespaces) grants the policies of the
                # served namespaces only: a GPU pod elsewhere is governed by no policy of ours.
                continue
            for obj in objs.get("items") or ():
                # a policy being deleted stays matched: its reset plan is acknowledged as usual
                meta = obj.get("metadata") or {}
                policies.append(
                    selector.PolicySelector(
                        selector.PolicyRef(ns, str(meta.get("name", ""))),
                        (obj.get("spec") or {}).get("selector"),
                    )
                )
        return selector.discover(pods, policies)


TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"


class TokenReviewer:
    """Asks the API server whether a bearer token is valid (``TokenReview``).

    ``authentication.k8s.io/v1``; RBAC: ``tokenreviews`` ``create``. The review goes through the
    ``kubeapi.ApiClient`` as JSON (its configuration, token and TLS), no model classes.

    Args:
        api_client: a ``kubeapi.ApiClient`` (default: the process-wide one, taken at the
            first review, after ``load_api``).
        timeout_s: per review deadline, s (``identity.REVIEW_TIMEOUT_S``: past it the
            caller gets 503 and retries).
    """

    def __init__(
        self, api_client: Any | None = None, *, timeout_s: float = identity.REVIEW_TIMEOUT_S
    ) -> None:
        self._client = api_client
        self.timeout_s = timeout_s

    def _create(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST`` the review; the API server's answer as JSON.

        Raises:
            ApiException: an error status.
            OSError, urllib3 errors: the API server could not be reached.
        """
        if self._client is None:
            self._client = kubeapi.default_client()
        answer = call_json(self._client, "POST", TOKEN_REVIEWS, body=body, timeout=self.timeout_s)
        return answer if isinstance(answer, dict) else {}

    def review(self, token: str, audiences: Sequence[str]) -> identity.Review:
        """The API server's verdict on ``token`` for ``audiences``.

        Raises:
            identity.ReviewUnavailableError: the review could not be made (API unreachable,
                403 without the RBAC); the message says which.
        """
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": list(audiences)},
        }
        try:
            res = self._create(body)
        except ApiException as exc:
            hint = (
                " (the agent's ClusterRole needs tokenreviews create)" if exc.status == 403 else ""
            )
            raise identity.ReviewUnavailableError(
                f"TokenReview failed: {exc.status} {exc.reason}{hint}"
            ) from None
        except Exception as exc:  # noqa: BLE001 - urllib3 and socket errors: API unreachable
            raise identity.ReviewUnavailableError(f"TokenReview failed: {exc}") from None
        st = res.get("status")
        st = st if isinstance(st, dict) else {}
        user = st.get("user")
        if not st.get("authenticated") or not isinstance(user, dict):
            return identity.Review(False, error=str(st.get("error") or "not authenticated"))
        extra = user.get("extra")
        return identity.Review(
            True,
            username=str(user.get("username") or ""),
            extra={
                str(k): [str(x) for x in v or ()]
                for k, v in (extra if isinstance(extra, dict) else {}).items()
            },
            audiences=tuple(str(a) for a in st.get("audiences") or ()),
        )


TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def ended_pods(
    node: str, list_pods: Callable[[], list[dict[str, Any]]] | None = None
) -> Callable[[Iterable[pods.PodRef]], set[pods.PodRef]]:
    """``pods -> those of them that ended``, from one listing of the pods on ``node``.

    A pod ended when it is no longer in the API, is being deleted (``deletionTimestamp``), is
    terminal (``Succeeded``/``Failed``: completed, evicted, OOM-killed without restart) or was
    replaced by a pod of the same name with another UID. RBAC: ``pods`` ``list`` (as discovery).

    Args:
        node: this node (field selector ``spec.nodeName``).
        list_pods: lists the node's pods (default: ``NodePods(node)``).

    Raises (from the returned function):
        ApiException, OSError: the listing failed (the caller
            tries again at the next check).
    """
    listing = list_pods if list_pods is not None else NodePods(node)

    def ended(refs: Iterable[pods.PodRef]) -> set[pods.PodRef]:
        live: dict[tuple[str, str], str] = {}
        for p in listing():
            meta = _meta(p)
            if meta.get("deletionTimestamp") is not None:
                continue
            if (p.get("status") or {}).get("phase") in TERMINAL_PHASES:
                continue
            live[(str(meta.get("namespace")), str(meta.get("name")))] = str(meta.get("uid") or "")
        out = set()
        for pod in refs:
            uid = live.get((pod.namespace, pod.name))
            if uid is None or (uid and pod.uid and uid != pod.uid):
                out.add(pod)
        return out

    return ended


CSR_SIGNER = "rlenergy.io/agent-serving"
"""signerName of the agent's serving-certificate requests (the operator signs them)."""


class CertificateRequester:
    """Asks for a serving certificate with a ``CertificateSigningRequest`` and waits for it.

    ``certificates.k8s.io/v1`` through a ``kubeapi.ApiClient`` (no model classes). RBAC:
    ``certificatesigningrequests`` ``create``, ``get`` (cluster-wide). The operator
    approves and signs requests of ``CSR_SIGNER`` from the agents' service account for the
    requesting pod's own node (``rlenergy_operator.certs``).

    Args:
        api_client: a ``kubeapi.ApiClient`` (default: the process-wide one).
        timeout_s: per request deadline, s.
    """

    def __init__(self, api_client: Any | None = None, *, timeout_s: float = 10.0) -> None:
        self._client = api_client
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        if self._client is None:
            self._client = kubeapi.default_client()
        return dict(call_json(self._client, method, path, body=body, timeout=self.timeout_s))

    def request(self, name: str, csr_pem: bytes, wait_s: float = 60.0) -> bytes:
        """Submit ``csr_pem`` as CSR ``name`` and return the issued chain, PEM.

        The API server's CSR cleaner removes it later (an hour after it is decided).

        Raises:
            ApiException: the API server refused the request (e.g. 403 without the RBAC).
            RuntimeError: the operator denied it (its message) or did not sign within
                ``wait_s``.
        """
        import base64

        path = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
        body = {
            "apiVersion": "certificates.k8s.io/v1",
            "kind": "CertificateSigningRequest",
            "metadata": {"name": name},
            "spec": {
                "signerName": CSR_SIGNER,
                "request": base64.b64encode(csr_pem).decode(),
                "usages": ["digital signature", "server auth"],
                "expirationSeconds": 30 * 86400,
            },
        }
        self._call("POST", path, body)
        deadline = time.monotonic() + wait_s
        while True:
            status = self._call("GET", f"{path}/{name}").get("status") or {}
            cert = status.get("certificate")
            if cert:
                return base64.b64decode(cert)
            for c in status.get("conditions") or []:
                if c.get("type") in ("Denied", "Failed"):
                    raise RuntimeError(
                        f"serving certificate request {name} {c['type'].lower()}: "
                        f"{c.get('message', '')}"
                    )
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"serving certificate request {name} not signed within {wait_s:.0f} s "
                    "(is the operator running, with the agent TLS port on?)"
                )
            time.sleep(1.0)
