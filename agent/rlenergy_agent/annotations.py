"""Phase signals from pod annotations (``phaseSource: annotation``), through a watch.

For a policy with ``spec.phaseSource: annotation`` the trainer does not call the agent's
socket: it annotates its own pod (``rlenergy.sdk.annotate``) with ``rlenergy.io/phase`` and
``rlenergy.io/step`` (one JSON merge patch) and, at a step's end, ``rlenergy.io/workload`` (a
``StepRequest`` as JSON). ``PodPhaseWatch`` follows the pods of this node with one Kubernetes
watch (``fieldSelector spec.nodeName=<node>``): it lists them once, then watches from the
list's ``resourceVersion`` with bookmarks, resumes a watch that ended from the newest
resourceVersion seen (bookmarks included), and lists again after ``410 Gone`` or any error
(exponential backoff). ``PodAnnotations.handle`` turns each pod event into the same calls the
socket's signals make (``service.Agent.end_step``, ``service.Agent.phase``) after the same
decision (``identity.authorize``): the annotated pod must be on this node and hold GPUs in the
kubelet's allocation (PodResources, same UID), and it drives only those GPUs. Only a change
of a pod's annotated values is a signal: a relist, a bookmark, or any other change of the pod
object (status, labels) signals nothing.

Latency: annotation patch -> clocks applied is an API round trip (the patch, written to etcd)
plus the watch's delivery, measured on the real API server by
``tests/e2e/test_phase_annotations.py`` (docs/agent.md gives the figures), against about 1 ms
on the socket. Good for whole phases; EE-RL's in-phase probe slices need the socket, so a
policy with ``phaseSource: annotation`` trials whole steps (``eerl.ControllerSettings
.in_phase_probes``).

RBAC: ``pods`` ``list`` and ``watch`` (cluster-wide; the agent's ClusterRole in the chart).
Callers: ``rlenergy_agent.nodeloop`` (started and stopped with the policy's phaseSource).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rlenergy.api import signals
from rlenergy_agent import identity, kubeapi, service
from rlenergy_agent.kubeapi import ApiException

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PodEvent:
    """What ``PodAnnotations.handle`` needs of one pod object.

    Attributes:
        namespace: the pod's namespace.
        name: the pod's name.
        uid: the pod's UID.
        node_name: ``spec.nodeName``.
        service_account: ``spec.serviceAccountName``.
        annotations: ``metadata.annotations``.
        deleting: ``metadata.deletionTimestamp`` is set.
        phase: ``status.phase``.
    """

    namespace: str
    name: str
    uid: str
    node_name: str
    service_account: str
    annotations: Mapping[str, str]
    deleting: bool = False
    phase: str = ""

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> PodEvent:
        """From a pod object as JSON (a watch event's ``object``)."""
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        return cls(
            str(meta.get("namespace") or ""),
            str(meta.get("name") or ""),
            str(meta.get("uid") or ""),
            str(spec.get("nodeName") or ""),
            str(spec.get("serviceAccountName") or "default"),
            {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
            meta.get("deletionTimestamp") is not None,
            str((obj.get("status") or {}).get("phase") or ""),
        )


@dataclasses.dataclass
class _Seen:
    phase: tuple[str, int] | None = None
    workload: str | None = None
    refused: str = ""


class PodAnnotations:
    """Turns annotation changes of this node's pods into phase and step signals.

    Args:
        agent: this node's agent.
        clock: monotonic time, s (the signals' received time, for the latency histogram).
    """

    def __init__(
        self, agent: service.Agent, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.agent = agent
        self._clock = clock
        self._seen: dict[str, _Seen] = {}
        self.signals = 0
        """Phase and step signals made (annotation changes acted on)."""
        self.refused = 0
        """Annotation changes refused (bad values, a pod without GPUs here, another node)."""

    def forget(self, uid: str) -> None:
        """The pod was deleted: its next incarnation starts unseen."""
        self._seen.pop(uid, None)

    def keep(self, uids: set[str]) -> None:
        """A fresh listing: forget the pods it no longer has (deleted while unwatched)."""
        for uid in [u for u in self._seen if u not in uids]:
            del self._seen[uid]

    def handle(self, pod: PodEvent, received_s: float | None = None) -> list[str]:
        """Act on the annotations of one pod as the watch delivered it.

        Args:
            pod: the pod.
            received_s: when the event arrived (monotonic), s.

        Returns:
            What was done, in order (``"step N"``, ``"phase P N"``; empty: nothing changed).
            A refusal is logged once per value and counted (``refused``), never raised: one
            pod's bad annotation must not stop the watch of the others.
        """
        t0 = self._clock() if received_s is None else received_s
        seen = self._seen.setdefault(pod.uid, _Seen())
        raw_workload = pod.annotations.get(signals.WORKLOAD_ANNOTATION)
        try:
            phase = signals.annotated_phase(dict(pod.annotations))
            key = None if phase is None else (phase.phase, phase.step)
            new_workload = raw_workload is not None and raw_workload != seen.workload
            new_phase = key is not None and key != seen.phase
            if not new_workload and not new_phase:
                return []
            workload = signals.annotated_workload(dict(pod.annotations)) if new_workload else None
            ref = identity.authorize(
                self.agent,
                identity.Caller(
                    pod.namespace, pod.name, pod.uid, pod.node_name, pod.service_account
                ),
                (),
            )
            self.agent.check_selected(ref)
        except (ValueError, identity.AuthError, service.SignalRefused) as exc:
            self._refuse(pod, seen, str(exc))
            return []
        done: list[str] = []
        try:
            # A step's end comes first: a patch that ends step N and starts N+1 closes N's
            # window before the new phase opens the next one (as the socket's order would).
            if workload is not None:
                self.agent.end_step(ref, workload.step, workload.workload)
                done.append(f"step {workload.step}")
            seen.workload = raw_workload
            if phase is not None and new_phase:
                self.agent.phase(ref, phase.phase, phase.step, received_s=t0)
                done.append(f"phase {phase.phase} {phase.step}")
                seen.phase = key
        except service.SignalRefused as exc:
            self._refuse(pod, seen, str(exc))
            return done
        seen.refused = ""
        self.signals += len(done)
        return done

    def _refuse(self, pod: PodEvent, seen: _Seen, why: str) -> None:
        self.refused += 1
        if why != seen.refused:  # once per reason, not at every event of the pod
            log.warning("annotations of pod %s/%s ignored: %s", pod.namespace, pod.name, why)
        seen.refused = why


class NodePodStream:
    """``GET /api/v1/pods`` (list, or ``watch=True``: a watch) through a ``kubeapi.ApiClient``.

    The shape of the ``kubernetes`` client's ``CoreV1Api.list_pod_for_all_namespaces`` with
    ``_preload_content=False`` (the unread urllib3 response), so ``kubeapi.Watch`` drives it,
    with no model classes (``kube.NodePods`` lists the same way).

    Args:
        api_client: a ``kubeapi.ApiClient`` (default: the process-wide one, taken at the first
            request).
    """

    def __init__(self, api_client: kubeapi.ApiClient | None = None) -> None:
        self._client = api_client

    def list_pod_for_all_namespaces(
        self,
        *,
        field_selector: str,
        resource_version: str | None = None,
        allow_watch_bookmarks: bool | None = None,
        timeout_seconds: int | None = None,
        watch: bool | None = None,
        _preload_content: bool = False,
        _request_timeout: Any = None,
    ) -> Any:
        """The pods of the field selector (a ``PodList``) or, with ``watch``, their events.

        Raises:
            ApiException: the API server answered an error (410 Gone for a resourceVersion
                too old).
            OSError, urllib3 errors: it could not be reached.
        """
        if self._client is None:
            self._client = kubeapi.default_client()
        query: list[tuple[str, Any]] = [("fieldSelector", field_selector)]
        for key, value in (
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", allow_watch_bookmarks),
            ("timeoutSeconds", timeout_seconds),
            ("watch", watch),
        ):
            if value is not None and value != "":
                query.append((key, value))
        resp = self._client.request(
            "GET", "/api/v1/pods", query=query, timeout=_request_timeout, preload=False
        )
        if not 200 <= resp.status <= 299:
            resp.read()
            exc = ApiException.of(resp)
            resp.release_conn()
            raise exc
        return resp


class PodHandler(Protocol):
    """What a ``PodPhaseWatch`` feeds (``PodAnnotations``, ``identity.PodEndTokens``)."""

    def handle(self, pod: PodEvent, received_s: float | None = None) -> list[str]:
        """A pod added or modified (also each pod of a listing)."""
        ...

    def forget(self, uid: str) -> None:
        """A pod deleted."""
        ...

    def keep(self, uids: set[str]) -> None:
        """A fresh listing has these pods only."""
        ...


class PodPhaseWatch:
    """Follows this node's pods by a watch and feeds them to a handler.

    The handler is ``PodAnnotations`` (phase signals from annotations) by default; the agent
    also runs one with ``identity.PodEndTokens`` (its token cache forgets ended pods).

    Args:
        agent: this node's agent.
        node: this node (field selector ``spec.nodeName``).
        core: what lists and watches pods, ``list_pod_for_all_namespaces`` (default:
            ``NodePodStream``, no ``CoreV1Api``).
        watch_timeout_s: ``timeout_seconds`` of one watch request, s.
        retry_max_s: longest wait between attempts after errors, s.
        handler: what the pods are fed to (default: ``PodAnnotations(agent)``).
        name: the thread's and the log's name for the watch.
    """

    WATCH_TIMEOUT_S = 300.0

    def __init__(
        self,
        agent: service.Agent,
        node: str,
        core: Any | None = None,
        *,
        watch_timeout_s: float | None = None,
        retry_max_s: float = 10.0,
        handler: PodHandler | None = None,
        name: str = "pod annotation watch",
    ) -> None:
        self.node = node
        self.name = name
        self.core: Any = core if core is not None else NodePodStream()
        self.handler: PodHandler = handler if handler is not None else PodAnnotations(agent)
        self.watch_timeout_s = self.WATCH_TIMEOUT_S if watch_timeout_s is None else watch_timeout_s
        self.retry_max_s = retry_max_s
        self.lists = 0
        """Listings made: the first, and one after each 410 Gone or error."""
        self.version = ""
        """The newest resourceVersion seen (list, event or bookmark)."""
        self._stopped = threading.Event()
        self._watch: kubeapi.Watch | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"{name.replace(' ', '-')}-{node}", daemon=True
        )

    @property
    def selector(self) -> str:
        """The field selector: the pods of this node."""
        return f"spec.nodeName={self.node}"

    def start(self) -> None:
        """Watch on a thread."""
        self._thread.start()

    def stop(self) -> None:
        """End the watch (the thread exits at once: the stream's socket is shut down)."""
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the thread to end (after ``stop``)."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _list(self) -> str:
        resp = self.core.list_pod_for_all_namespaces(
            field_selector=self.selector, _preload_content=False, _request_timeout=30.0
        )
        try:
            listing = json.loads(resp.data)
        finally:
            getattr(resp, "release_conn", lambda: None)()
        self.lists += 1
        now = time.monotonic()
        pods = [PodEvent.of(obj) for obj in listing.get("items") or ()]
        self.handler.keep({p.uid for p in pods})
        for pod in pods:
            self.handler.handle(pod, now)
        return str((listing.get("metadata") or {}).get("resourceVersion") or "")

    def _follow(self, version: str) -> str:
        """One watch request from ``version``; returns the newest resourceVersion seen."""
        # Events as JSON, no model class: a model per event would cost milliseconds of CPU
        # under the GIL the signals share.
        self._watch = watch = kubeapi.Watch()
        for event in watch.stream(
            self.core.list_pod_for_all_namespaces,
            field_selector=self.selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=int(self.watch_timeout_s),
            _request_timeout=(10.0, self.watch_timeout_s + 30.0),
        ):
            received = time.monotonic()
            kind, obj = event.get("type"), event["object"]
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            self.version = version
            if kind in ("ADDED", "MODIFIED"):
                self.handler.handle(PodEvent.of(obj), received)
            elif kind == "DELETED":
                self.handler.forget(PodEvent.of(obj).uid)
            if self._stopped.is_set():
                break
        return version

    def _run(self) -> None:
        version, backoff = "", 0.5
        while not self._stopped.is_set():
            try:
                if not version:
                    version = self.version = self._list()
                version = self._follow(version)
                backoff = 0.5
            except ApiException as exc:
                version = ""  # 410 Gone (too old) or any API error: list again
                if exc.status != 410 and not self._stopped.is_set():
                    log.warning("%s on %s: %s %s", self.name, self.node, exc.status, exc.reason)
                    self._stopped.wait(backoff)
                    backoff = min(backoff * 2, self.retry_max_s)
            except Exception as exc:  # noqa: BLE001 - connection loss: list again after a pause
                version = ""
                if not self._stopped.is_set():
                    log.warning("%s on %s: %s", self.name, self.node, exc)
                    self._stopped.wait(backoff)
                    backoff = min(backoff * 2, self.retry_max_s)
