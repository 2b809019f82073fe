"""Who is signalling: the caller's pod from its projected service-account token, and what it may do.

Why a token and not the socket's peer credentials: the shipped DaemonSet has no ``hostPID``, so
``SO_PEERCRED`` reports pid 0 for a trainer in another PID namespace and no cgroup lookup can
find its pod (issue #14). Instead the trainer pod mounts a projected, audience-bound
service-account token (``serviceAccountToken`` volume, audience ``rlenergy-agent``; the kubelet
binds it to the pod and rotates it) and the SDK sends it as ``Authorization: Bearer <token>``
with every signal. The agent asks the API server whether the token is valid for its audience
(``TokenReview``, ``rlenergy_agent.kube.TokenReviewer``); the API server's answer names the pod
the token is bound to in ``user.extra``:

* ``authentication.kubernetes.io/pod-name`` and ``pod-uid``: the pod (the namespace is the one
  of the service account, ``system:serviceaccount:<namespace>:<name>``);
* ``authentication.kubernetes.io/node-name``: the node the pod was scheduled to when the token
  was issued.

A review is cached by the token's SHA-256 until the token expires (its ``exp`` claim, read only
after the API server accepted the token) and at most ``max_ttl_s``; refusals are cached for
``negative_ttl_s`` so a caller retrying a bad token cannot flood the API server; the cache holds
at most ``max_entries`` tokens (oldest dropped). So one TokenReview is paid per token (an hour
by default, the kubelet rotates at 80 % of that) and a signal's p99 stays in the sub-ms range
(``bench/agent.py``).

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
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from rlenergy_agent import pods, service

EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"
EXTRA_NODE_NAME = "authentication.kubernetes.io/node-name"
SA_PREFIX = "system:serviceaccount:"


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


def caller_of(review: Review, audience: str) -> Caller:
    """The pod of an accepted review.

    Raises:
        AuthError: 401 when the token is refused, is for another audience, or is not bound to
            a pod (a plain service-account token names no pod).
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
    name = (extra.get(EXTRA_POD_NAME) or [""])[0]
    uid = (extra.get(EXTRA_POD_UID) or [""])[0]
    if not review.username.startswith(SA_PREFIX) or not name or not uid:
        raise AuthError(
            f"token of {review.username or 'an unknown user'} is not bound to a pod: mount a "
            "projected serviceAccountToken volume in the trainer pod (docs/agent.md)",
            401,
        )
    ns, _, sa = review.username[len(SA_PREFIX) :].partition(":")
    return Caller(ns, name, uid, (extra.get(EXTRA_NODE_NAME) or [""])[0], sa)


class TokenAuthenticator:
    """Authenticates ``Authorization: Bearer`` headers by TokenReview, cached.

    Args:
        review: asks the API server (``rlenergy_agent.kube.TokenReviewer.review``).
        audience: the audience the trainer's token must be valid for.
        max_ttl_s: longest a positive review is reused, s (also bounded by the token's expiry).
        negative_ttl_s: how long a refused token stays refused without asking again, s.
        max_entries: tokens cached at most (oldest dropped).
        clock: monotonic time, s; ``wall``: Unix time, s (tests).
    """

    def __init__(
        self,
        review: Reviewer,
        audience: str,
        *,
        max_ttl_s: float = 600.0,
        negative_ttl_s: float = 2.0,
        max_entries: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._review = review
        self.audience = audience
        self.max_ttl_s = max_ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, tuple[float, Caller | AuthError]] = (
            collections.OrderedDict()
        )
        self.reviews = 0
        """TokenReviews made (cache misses that reached the API server)."""

    def authenticate(self, authorization: str | None) -> Caller:
        """The pod of a bearer token.

        Args:
            authorization: the request's ``Authorization`` header (``None``: absent).

        Raises:
            AuthError: 401 no/invalid token, 503 the API server could not be asked.
        """
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError(
                "no bearer token: send 'Authorization: Bearer <token>' with the pod's projected "
                "service-account token (RLENERGY_AGENT_TOKEN_FILE; docs/agent.md)",
                401,
            )
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                self._cache.move_to_end(key)
                if isinstance(hit[1], AuthError):
                    raise hit[1]
                return hit[1]
        try:
            review = self._review(token, [self.audience])
        except ReviewUnavailableError as exc:
            raise AuthError(f"cannot check the caller's token now: {exc}", 503) from None
        self.reviews += 1
        result: Caller | AuthError
        try:
            result = caller_of(review, self.audience)
            exp = token_expiry_s(token)
            ttl = self.max_ttl_s if exp is None else min(exp - self._wall(), self.max_ttl_s)
        except AuthError as exc:
            result, ttl = exc, self.negative_ttl_s
        with self._lock:
            if ttl > 0:
                self._cache[key] = (now + ttl, result)
                self._cache.move_to_end(key)
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
        if isinstance(result, AuthError):
            raise result
        return result


def _listed(agent: service.Agent, caller: Caller) -> service.PodRef | None:
    return next(
        (
            p
            for p in agent.podmap.pods()
            if (p.namespace, p.name) == (caller.namespace, caller.pod_name)
        ),
        None,
    )


def authorize(agent: service.Agent, caller: Caller, gpus: Sequence[str] = ()) -> service.PodRef:
    """The pod (as the kubelet's allocation names it) that ``caller`` may signal for.

    Args:
        agent: this node's agent (its node name, pod map and MIG parents).
        caller: the authenticated pod.
        gpus: GPU or MIG UUIDs the signal names (each must be the pod's own).

    Returns:
        The pod map's ``PodRef`` of the caller.

    Raises:
        AuthError: 403 when the token's node is another node, the pod holds no GPU here (or a
            pod of the same name with another UID does), or a named GPU is not the pod's.
    """
    if caller.node_name and caller.node_name != agent.node_name:
        agent.refused += 1
        raise AuthError(
            f"pod {caller} runs on node {caller.node_name}, this agent serves node "
            f"{agent.node_name}: signal the agent of your own node",
            403,
        )
    pod = _listed(agent, caller)
    if (pod is None or (pod.uid and pod.uid != caller.pod_uid)) and isinstance(
        agent.podmap, pods.ListedPodMap
    ):
        agent.podmap.recheck()  # a pod started since the node loop's last listing
        pod = _listed(agent, caller)
    if pod is None or (pod.uid and pod.uid != caller.pod_uid):
        agent.refused += 1
        why = (
            f"holds no GPU on node {agent.node_name}"
            if pod is None
            else f"has UID {caller.pod_uid}, but the pod of that name holding GPUs on node "
            f"{agent.node_name} has UID {pod.uid}"
        )
        raise AuthError(f"pod {caller} {why}", 403)
    if gpus:
        own, _devices = agent.gpus_of(pod)
        foreign = [g for g in gpus if agent.mig_parent.get(g, g) not in own]
        if foreign:
            agent.refused += 1
            raise AuthError(f"pod {caller} does not hold GPU(s) {', '.join(foreign)}", 403)
    return pod
