"""Who is signalling: the caller's pod from its projected service-account token, and what it may do.

Why a token and not the socket's peer credentials: the shipped DaemonSet has no ``hostPID``, so
``SO_PEERCRED`` reports pid 0 for a trainer in another PID namespace and no cgroup lookup can
find its pod. Instead the trainer pod mounts a projected, audience-bound
service-account token (``serviceAccountToken`` volume, audience ``rlenergy-agent``; the kubelet
binds it to the pod and rotates it) and the SDK sends it as ``Authorization: Bearer <token>``
with every signal. The agent asks the API server whether the token is valid for its audience
(``TokenReview``, ``rlenergy_agent.kube.TokenReviewer``); the API server's answer names the pod
the token is bound to in ``user.extra``:

* ``authentication.kubernetes.io/pod-name`` and ``pod-uid``: the pod (the namespace is the one
  of the service account, ``system:serviceaccount:<namespace>:<name>``);
* ``authentication.kubernetes.io/node-name``: the node the pod was scheduled to when the token
  was issued.

The pod UID of the review is checked against the API's current pod of that name
(``TokenAuthenticator.current_pod``, ``rlenergy_agent.kube.CurrentPod``; PodResources names
pods without UIDs), so a pod re-created under its old name refuses the old pod's token from
its first use, and a pod being deleted or finished is refused. A token must name exactly one
pod name and one pod UID, else 403 (a legacy token authenticates but names no pod).

A success is cached by the token's SHA-256 for at most ``MAX_TTL_S`` (10 s; never past the
token's ``exp`` claim, read only after the API server accepted the token) and dropped when its
pod ends (``forget_pod``, from the pod-end watch); refusals are cached apart for
``negative_ttl_s``, so junk tokens cannot evict a valid token's success. A token that is not
JWT-shaped is refused without a review, concurrent first uses of one token make one review,
and reviews are rate-limited overall (``REVIEWS_PER_S``): a flood of junk tokens makes a
bounded number of reviews. A review that takes longer than ``REVIEW_TIMEOUT_S`` is a 503
(retryable). A signal's p99 stays in the sub-ms range on cached tokens (``bench/agent.py``).

``authorize`` is the one place that decides what an authenticated pod may do: the token's node
must be this node, the pod must hold GPUs here in the kubelet's allocation (``service.PodMap``,
same UID when the map knows it), and every GPU the signal names must be the pod's own.
Callers: ``rlenergy_agent.server`` (each signal), ``rlenergy_agent.__main__`` (wiring).
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from rlenergy_agent import pods, service

EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"
EXTRA_NODE_NAME = "authentication.kubernetes.io/node-name"
SA_PREFIX = "system:serviceaccount:"
MAX_TTL_S = 10.0
"""Longest a TokenReview success is reused, s: a pod re-created under its name or deleted is
seen within this bound even when no pod-end check tells the cache."""
REVIEW_TIMEOUT_S = 2.0
"""Longest a TokenReview (or the pod check after it) may take, s; past it the caller gets 503
and retries (the SDK's signal deadline is longer)."""
REVIEWS_PER_S = 20.0
"""TokenReviews a second, all callers together, on average [MODEL: a node's trainer pods
rotate their tokens hourly; twenty new tokens a second is a node full of restarting pods]."""
REVIEW_BURST = 40.0
"""TokenReviews at once (every pod of a full node starting together) [MODEL]."""
MAX_TOKEN_BYTES = 16 * 1024
"""A bearer token longer than this is not a service-account token (they are about 1 KiB)."""
_B64URL = re.compile(r"[A-Za-z0-9_-]+")


class AuthError(Exception):
    """The caller is refused.

    Args:
        message: why, and what to change.
        status: HTTP status: 401 no or invalid token, 403 not allowed here, 503 the token could
            not be checked (API server unreachable).
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ReviewUnavailableError(Exception):
    """The TokenReview could not be made (API server unreachable, RBAC missing)."""


@dataclasses.dataclass(frozen=True)
class Review:
    """The API server's verdict on a token (the status of a ``TokenReview``).

    Attributes:
        authenticated: the token is valid for the audiences asked.
        username: ``system:serviceaccount:<ns>:<name>`` for a service-account token.
        extra: ``user.extra``; for a pod-bound token the pod's name, UID and node.
        audiences: audiences the token is valid for (of those asked).
        error: the API server's reason when not authenticated.
    """

    authenticated: bool
    username: str = ""
    extra: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    audiences: Sequence[str] = ()
    error: str = ""


Reviewer = Callable[[str, Sequence[str]], Review]
"""``(token, audiences) -> Review``; raises ``ReviewUnavailableError`` when it cannot ask."""


@dataclasses.dataclass(frozen=True)
class Caller:
    """The pod a valid token is bound to.

    Attributes:
        namespace: the pod's (= its service account's) namespace.
        pod_name: the pod's name.
        pod_uid: the pod's UID.
        node_name: the node in the token (``""``: the pod was not scheduled when issued).
        service_account: the service account's name.
    """

    namespace: str
    pod_name: str
    pod_uid: str
    node_name: str
    service_account: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod_name}"


def token_expiry_s(token: str) -> float | None:
    """The ``exp`` claim of a JWT (Unix time, s), or ``None`` when it has none.

    Only read after the API server validated the token: it bounds the cache, never grants.
    """
    parts = token.split(".")
    if len(parts) != 3:
        return None
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (binascii.Error, ValueError):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    return float(exp) if isinstance(exp, int | float) else None


def jwt_shaped(token: str) -> bool:
    """Whether ``token`` looks like a JWT (a projected service-account token is one).

    Three base64url parts whose first two are JSON objects, the header naming an ``alg``
    (RFC 7519 section 7.2). Decides nothing about validity: what is not shaped so is refused
    without asking the API server.
    """
    if len(token) > MAX_TOKEN_BYTES:
        return False
    parts = token.split(".")
    if len(parts) != 3 or not all(parts) or not all(_B64URL.fullmatch(p) for p in parts):
        return False
    try:
        header, claims = (
            json.loads(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4))) for p in parts[:2]
        )
    except (binascii.Error, ValueError):
        return False
    return isinstance(header, dict) and "alg" in header and isinstance(claims, dict)


def caller_of(review: Review, audience: str) -> Caller:
    """The pod of an accepted review.

    Raises:
        AuthError: 401 when the token is refused or is for another audience; 403 when it is
            valid but not bound to exactly one pod (a legacy or plain service-account token
            names none: it authenticates, it is just not allowed to signal).
    """
    if not review.authenticated:
        raise AuthError(f"token refused by the API server: {review.error or 'invalid'}", 401)
    if audience not in review.audiences:
        raise AuthError(
            f"token is not valid for audience {audience!r} (valid for "
            f"{list(review.audiences)}): project it with that audience",
            401,
        )
    extra = {k: list(v) for k, v in review.extra.items()}
    names = extra.get(EXTRA_POD_NAME) or []
    uids = extra.get(EXTRA_POD_UID) or []
    if (
        not review.username.startswith(SA_PREFIX)
        or len(names) != 1
        or len(uids) != 1
        or not names[0]
        or not uids[0]
    ):
        raise AuthError(
            f"token of {review.username or 'an unknown user'} is not bound to exactly one pod "
            f"({len(names)} pod names, {len(uids)} pod UIDs): mount a projected "
            "serviceAccountToken volume in the trainer pod (docs/agent.md)",
            403,
        )
    ns, _, sa = review.username[len(SA_PREFIX) :].partition(":")
    return Caller(ns, names[0], uids[0], (extra.get(EXTRA_NODE_NAME) or [""])[0], sa)


@dataclasses.dataclass(frozen=True)
class PodFacts:
    """The API's current pod of a name.

    Attributes:
        uid: its UID.
        node_name: ``spec.nodeName`` (``""``: not scheduled).
        deleting: ``metadata.deletionTimestamp`` is set.
        phase: ``status.phase``.
    """

    uid: str
    node_name: str = ""
    deleting: bool = False
    phase: str = ""


CurrentPod = Callable[[str, str], PodFacts | None]
"""``(namespace, name) -> the pod of that name now`` (``None``: none); raises
``ReviewUnavailableError`` when it cannot ask (``rlenergy_agent.kube.CurrentPod``)."""


class TokenBucket:
    """At most ``rate`` events a second on average, ``burst`` at once (a token bucket).

    Args:
        rate: refill, events per s.
        burst: capacity, events.
        clock: monotonic time, s.
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._level = burst
        self._at = clock()

    def take(self) -> bool:
        """Take one event; ``False`` when the bucket is empty (the caller is not served)."""
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now
        if self._level < 1.0:
            return False
        self._level -= 1.0
        return True


class _Flight:
    """One TokenReview in progress; concurrent first uses of its token wait for it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Caller | AuthError | None = None


class TokenAuthenticator:
    """Authenticates ``Authorization: Bearer`` headers by TokenReview, cached.

    * a token that is not JWT-shaped is refused (401) without a review;
    * concurrent first uses of one token make one review (the others wait for it, at most
      ``wait_s``);
    * reviews are rate-limited overall (``reviews_per_s``, ``review_burst``): past it a new
      token gets 503 (retry), so junk tokens cannot make one review each;
    * a review's pod UID is checked against the API's current pod of that name
      (``current_pod``): a pod re-created under the same name refuses the old pod's token
      from its first use; a pod being deleted or finished is refused;
    * a success is reused for at most ``max_ttl_s`` (and never past the token's ``exp``),
      and is dropped when its pod ends (``forget_pod``); refusals are cached apart, for
      ``negative_ttl_s``, in their own bounded cache, so junk cannot evict a valid token.

    Args:
        review: asks the API server (``rlenergy_agent.kube.TokenReviewer.review``).
        audience: the audience the trainer's token must be valid for.
        current_pod: the API's current pod of a name (``None``: the review's UID is trusted;
            tests and runs without the API).
        max_ttl_s: longest a positive review is reused, s (also bounded by the token's expiry).
        negative_ttl_s: how long a refused token stays refused without asking again, s.
        max_entries: tokens cached at most, each cache (oldest dropped).
        reviews_per_s: TokenReviews a second on average, all callers together.
        review_burst: TokenReviews at once.
        wait_s: longest a concurrent first use waits for the review under way, s.
        clock: monotonic time, s; ``wall``: Unix time, s (tests).
    """

    def __init__(
        self,
        review: Reviewer,
        audience: str,
        *,
        current_pod: CurrentPod | None = None,
        max_ttl_s: float = MAX_TTL_S,
        negative_ttl_s: float = 2.0,
        max_entries: int = 1024,
        reviews_per_s: float = REVIEWS_PER_S,
        review_burst: float = REVIEW_BURST,
        wait_s: float = REVIEW_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._review = review
        self.audience = audience
        self.current_pod = current_pod
        self.max_ttl_s = max_ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self.wait_s = wait_s
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._ok: collections.OrderedDict[str, tuple[float, Caller]] = collections.OrderedDict()
        self._no: collections.OrderedDict[str, tuple[float, AuthError]] = collections.OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._bucket = TokenBucket(reviews_per_s, review_burst, clock)
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.reviews = 0
        """TokenReviews made (cache misses that reached the API server)."""
        self.refused_locally = 0
        """Tokens refused without a review (not JWT-shaped)."""
        self.rate_limited = 0
        """New tokens answered 503 because the review rate was spent."""

    def forget_pod(self, pod: pods.PodRef) -> None:
        """``pod`` ended: its tokens' cached successes go (the next use is reviewed again)."""
        with self._lock:
            if pod.uid:
                self._mark_ended(pod.uid)
            for key, (_, c) in list(self._ok.items()):
                if (c.namespace, c.pod_name) == (pod.namespace, pod.name) and (
                    not pod.uid or c.pod_uid == pod.uid
                ):
                    del self._ok[key]

    def forget_uid(self, uid: str) -> None:
        """The pod of ``uid`` ended: its tokens are refused from their next use (403).

        Called when a watch sees the pod's deletion start, its end or its removal: their
        cached successes go, and the review their next use makes is refused for the ended UID.
        """
        if not uid:
            return
        with self._lock:
            self._mark_ended(uid)
            for key in [k for k, (_, c) in self._ok.items() if c.pod_uid == uid]:
                del self._ok[key]

    def keep_uids(self, uids: set[str]) -> None:
        """A fresh listing of the node's pods has ``uids``: other pods' cached successes go.

        Their tokens are reviewed again at their next use; nothing is refused for it.
        """
        with self._lock:
            for key in [k for k, (_, c) in self._ok.items() if c.pod_uid not in uids]:
                del self._ok[key]

    def _mark_ended(self, uid: str) -> None:
        self._ended[uid] = None
        while len(self._ended) > self.max_entries:
            self._ended.popitem(last=False)

    def authenticate(self, authorization: str | None) -> Caller:
        """The pod of a bearer token.

        Args:
            authorization: the request's ``Authorization`` header (``None``: absent).

        Raises:
            AuthError: 401 no/invalid token, 403 a valid token not bound to this pod or to
                one pod, 503 the token could not be checked now (retry).
        """
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError(
                "no bearer token: send 'Authorization: Bearer <token>' with the pod's projected "
                "service-account token (RLENERGY_AGENT_TOKEN_FILE; docs/agent.md)",
                401,
            )
        if not jwt_shaped(token):
            self.refused_locally += 1
            raise AuthError(
                "the bearer token is not a JWT: send the pod's projected service-account token "
                "(RLENERGY_AGENT_TOKEN_FILE; docs/agent.md)",
                401,
            )
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        with self._lock:
            ok = self._ok.get(key)
            if ok is not None and ok[0] > now and ok[1].pod_uid not in self._ended:
                self._ok.move_to_end(key)
                return ok[1]
            no = self._no.get(key)
            if no is not None and no[0] > now:
                raise no[1]
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if not leader:
            if not flight.done.wait(self.wait_s) or flight.result is None:
                raise AuthError("the caller's token is being checked: retry", 503)
            if isinstance(flight.result, AuthError):
                raise flight.result
            return flight.result
        result: Caller | AuthError = AuthError("the caller's token could not be checked", 503)
        try:
            result = self._check(token, key, now)
        except AuthError as exc:
            result = exc
        finally:
            with self._lock:
                self._flights.pop(key, None)
            flight.result = result  # the waiters' answer, whatever ended the check
            flight.done.set()
        if isinstance(result, AuthError):
            raise result
        return result

    def _check(self, token: str, key: str, now: float) -> Caller:
        """Review ``token`` (rate-limited), check its pod, cache the outcome."""
        with self._lock:
            allowed = self._bucket.take()
        if not allowed:
            self.rate_limited += 1
            raise AuthError("too many new tokens to review right now: retry", 503)
        try:
            review = self._review(token, [self.audience])
        except ReviewUnavailableError as exc:
            raise AuthError(f"cannot check the caller's token now: {exc}", 503) from None
        self.reviews += 1
        try:
            caller = caller_of(review, self.audience)
            self._check_pod(caller)
        except AuthError as exc:
            if exc.status != 503:
                self._store(self._no, key, now + self.negative_ttl_s, exc)
            raise
        exp = token_expiry_s(token)
        ttl = self.max_ttl_s if exp is None else min(exp - self._wall(), self.max_ttl_s)
        if ttl > 0:
            self._store(self._ok, key, now + ttl, caller)
        return caller

    def _check_pod(self, caller: Caller) -> None:
        """The caller's pod is the API's current pod of that name, alive.

        Raises:
            AuthError: 403 another UID, deleted, being deleted or finished; 503 the API
                could not be asked.
        """
        with self._lock:
            ended = caller.pod_uid in self._ended
        if ended:
            raise AuthError(f"pod {caller} (UID {caller.pod_uid}) has ended", 403)
        if self.current_pod is None:
            return
        try:
            facts = self.current_pod(caller.namespace, caller.pod_name)
        except ReviewUnavailableError as exc:
            raise AuthError(f"cannot check the caller's pod now: {exc}", 503) from None
        if facts is None:
            raise AuthError(f"pod {caller} no longer exists", 403)
        if facts.uid != caller.pod_uid:
            raise AuthError(
                f"the token belongs to pod {caller} with UID {caller.pod_uid}, but the pod of "
                f"that name now has UID {facts.uid} (re-created): use the new pod's token",
                403,
            )
        if facts.deleting or facts.phase in ("Succeeded", "Failed"):
            why = "is being deleted" if facts.deleting else f"has finished ({facts.phase})"
            raise AuthError(f"pod {caller} {why}", 403)

    def _store(
        self,
        cache: collections.OrderedDict[str, Any],
        key: str,
        until: float,
        value: Caller | AuthError,
    ) -> None:
        with self._lock:
            cache[key] = (until, value)
            cache.move_to_end(key)
            while len(cache) > self.max_entries:
                cache.popitem(last=False)


class WatchedPod(Protocol):
    """What ``PodEndTokens`` reads of a pod event (``annotations.PodEvent``)."""

    @property
    def uid(self) -> str:
        """The pod's UID."""
        ...

    @property
    def deleting(self) -> bool:
        """Its ``metadata.deletionTimestamp`` is set."""
        ...

    @property
    def phase(self) -> str:
        """Its ``status.phase``."""
        ...


class PodEndTokens:
    """The token cache's side of the watch of this node's pods (``annotations.PodPhaseWatch``).

    A cached review success would otherwise stand until the pod-end check's next API listing
    (``podlife.PodEndWatch``, every few seconds): a pod deleted and re-created under its name
    in that time would let the old pod's token act for the new pod (the kubelet's listing names
    pods without UIDs). The watch delivers the start of a deletion (``deletionTimestamp``)
    milliseconds after it is made, and a pod of the same name can be created only once the API
    server removed the old object, so the old pod's token is refused from the first use that
    could reach the new pod. A terminal pod (``Succeeded``, ``Failed``) is refused the same
    way; a relist forgets the cached successes of the pods it no longer has.

    Args:
        auth: the token cache.
    """

    def __init__(self, auth: TokenAuthenticator) -> None:
        self.auth = auth
        self.ended = 0
        """Pod ends passed on to the cache."""

    def handle(self, pod: WatchedPod, received_s: float | None = None) -> list[str]:
        """One pod as the watch delivered it (added or modified).

        Returns:
            ``["ended <uid>"]`` when the pod is being deleted or terminal, else empty.
        """
        if pod.deleting or pod.phase in ("Succeeded", "Failed"):
            self.forget(pod.uid)
            return [f"ended {pod.uid}"]
        return []

    def forget(self, uid: str) -> None:
        """The pod was deleted."""
        self.ended += 1
        self.auth.forget_uid(uid)

    def keep(self, uids: set[str]) -> None:
        """A fresh listing of the node's pods."""
        self.auth.keep_uids(uids)


def _listed(agent: service.Agent, caller: Caller) -> service.PodRef | None:
    return next(
        (
            p
            for p in agent.podmap.pods()
            if (p.namespace, p.name) == (caller.namespace, caller.pod_name)
        ),
        None,
    )


def _unsynced(agent: service.Agent, caller: Caller) -> bool:
    """The listing names no GPU pod while ``caller`` is a pod the agent governs.

    A restarted kubelet lists no pod until it has synced its pods (about 1 s in the real-node
    kubelet-restart e2e); the pod-end watch keeps such a pod's locks (``podlife``), so its
    signals get a retryable 503 meanwhile, not a 403 that a strict trainer takes as final.
    """
    if agent.podmap.pods():
        return False
    ref = service.PodRef(caller.namespace, caller.pod_name, caller.pod_uid)
    return any(pods.same_pod(p, ref) for p in agent.governed_pods())


def _listing_allows(agent: service.Agent, caller: Caller) -> None:
    """The kubelet's listing is young enough to attribute GPUs to ``caller``.

    ``Fresh``: yes. ``Stale``: only to a pod the agent already governs (its locks are held,
    nothing new is attributed). ``Waiting`` and ``Expired``: no.

    Raises:
        AuthError: 503 (retry) with the listing's state and newest error.
    """
    podmap = agent.podmap
    if not isinstance(podmap, pods.ListedPodMap):
        return
    state = podmap.state()
    if state.status == "Fresh":
        return
    ref = service.PodRef(caller.namespace, caller.pod_name, caller.pod_uid)
    if state.status == "Stale" and any(pods.same_pod(p, ref) for p in agent.governed_pods()):
        return
    age = "never listed" if state.age_s is None else f"listed {state.age_s:.0f} s ago"
    raise AuthError(
        f"the kubelet's PodResources listing is {state.status.lower()} ({age}"
        f"{'; ' + state.error + ': ' + state.message if state.error else ''}): no GPU is "
        "attributed to a new caller until the kubelet answers; retry",
        503,
    )


def authorize(agent: service.Agent, caller: Caller, gpus: Sequence[str] = ()) -> service.PodRef:
    """The pod (as the kubelet's allocation names it) that ``caller`` may signal for.

    Args:
        agent: this node's agent (its node name, pod map and MIG parents).
        caller: the authenticated pod (its UID checked against the API's current pod of its
            name by ``TokenAuthenticator``).
        gpus: GPU or MIG UUIDs the signal names (each must be the pod's own).

    Returns:
        The caller's ``PodRef`` with its UID (the pod map lists the pod by name).

    Raises:
        AuthError: 403 when the token's node is another node, the pod holds no GPU here (or a
            pod of the same name with another UID does), or a named GPU is not the pod's (after
            one more listing, at most every ``podmap.RECHECK_S``); 503
            when the kubelet's listing is too old to attribute GPUs (``_listing_allows``).
    """
    if caller.node_name and caller.node_name != agent.node_name:
        agent.refused += 1
        raise AuthError(
            f"pod {caller} runs on node {caller.node_name}, this agent serves node "
            f"{agent.node_name}: signal the agent of your own node",
            403,
        )
    _listing_allows(agent, caller)
    pod = _listed(agent, caller)
    if (pod is None or (pod.uid and pod.uid != caller.pod_uid)) and isinstance(
        agent.podmap, pods.ListedPodMap
    ):
        agent.podmap.recheck()  # a pod started since the node loop's last listing
        pod = _listed(agent, caller)
    if pod is None and _unsynced(agent, caller):
        raise AuthError(
            f"the kubelet's PodResources listing names no GPU pod (a restarted kubelet before "
            f"its pods are synced); pod {caller} keeps its GPUs: retry",
            503,
        )
    if pod is None or (pod.uid and pod.uid != caller.pod_uid):
        agent.refused += 1
        why = (
            f"holds no GPU on node {agent.node_name}"
            if pod is None
            else f"has UID {caller.pod_uid}, but the pod of that name holding GPUs on node "
            f"{agent.node_name} has UID {pod.uid}"
        )
        raise AuthError(f"pod {caller} {why}", 403)
    pod = service.PodRef(pod.namespace, pod.name, caller.pod_uid)
    foreign = _foreign(agent, pod, gpus)
    if foreign and isinstance(agent.podmap, pods.ListedPodMap):
        # A pod re-created under its name may hold other GPUs than the listing's pod of that
        # name (the kubelet allocates afresh): list again before refusing.
        agent.podmap.recheck()
        foreign = _foreign(agent, pod, gpus)
    if foreign:
        agent.refused += 1
        raise AuthError(f"pod {caller} does not hold GPU(s) {', '.join(foreign)}", 403)
    return pod


def _foreign(agent: service.Agent, pod: service.PodRef, gpus: Sequence[str]) -> list[str]:
    """The GPUs (or MIG devices, by their parent) of ``gpus`` that ``pod`` does not hold."""
    if not gpus:
        return []
    own, _devices = agent.gpus_of(pod)
    return [g for g in gpus if agent.mig_parent.get(g, g) not in own]
