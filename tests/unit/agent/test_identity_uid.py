"""Caller identity by pod UID, and a token cache that a flood cannot break.

We test: the review's pod UID is checked against the API's current pod of that name (a pod
re-created under its name refuses the old pod's token from its first use and takes the new
pod's, with a kubelet listing that names pods without UIDs; a pod being deleted or finished is
refused; the pod check unreachable is 503); a success is reused at most 10 s and dropped when
its pod ends (the node's pod watch: a deletion's start or a terminal pod refuses the old token
before any pod-end check, so a pod re-created under its name never takes it; a relist drops
the successes of pods it lacks); exactly one pod name and one pod UID or 403; concurrent first uses of a token
make one review; a review slower than 2 s is 503 (``kube.TokenReviewer`` against a slow HTTP
server on 127.0.0.1); the flood (non-JWT tokens refused without a review, JWT-shaped junk
rate-limited, refusals cached apart so the valid token keeps its cached success);
``kube.CurrentPod`` against a local HTTP server; the SDK keeps its last token when a re-read
fails.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_support import AUDIENCE, DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import annotations, identity, kube, kubeapi, podlife, service

from rlenergy.api import node as api_node
from rlenergy.sdk import trainer

OLD = service.PodRef("team-a", "trainer-0", "uid-old")
NEW = service.PodRef("team-a", "trainer-0", "uid-new")
PLAN = api_node.ClockPlan(
    step=0, phases=[api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked")]
)


def _jwt(claims: dict[str, Any]) -> str:
    import base64

    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return f"eyJhbGciOiJSUzI1NiJ9.{body}.c2ln"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Pods:
    """The API's current pods by name (what ``kube.CurrentPod`` answers)."""

    def __init__(self, *pods: service.PodRef) -> None:
        self.now: dict[tuple[str, str], identity.PodFacts] = {
            (p.namespace, p.name): identity.PodFacts(p.uid, "node-1") for p in pods
        }
        self.calls = 0
        self.down = False

    def __call__(self, namespace: str, name: str) -> identity.PodFacts | None:
        self.calls += 1
        if self.down:
            raise identity.ReviewUnavailableError("connection refused")
        return self.now.get((namespace, name))


def test_a_pod_recreated_under_its_name_refuses_the_old_token_and_takes_the_new(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    # the kubelet's listing names the pod without a UID
    agent = standin_agent(
        {service.PodRef(OLD.namespace, OLD.name): list(drv.uuids)}, PLAN, lambda: drv.virtual_s
    )
    reviews, current = FakeReviews(), Pods(OLD)
    auth = reviews.authenticator(current_pod=current)
    old_token, new_token = reviews.issue(OLD), reviews.issue(NEW)
    pod = identity.authorize(agent, auth.authenticate(f"Bearer {old_token}"))
    assert pod == OLD
    agent.phase(pod, "generation", 0)
    # deleted and re-created under the same name: the old token's cached success is dropped
    # by the pod-end watch (the API says the governed UID is gone)
    current.now[(OLD.namespace, OLD.name)] = identity.PodFacts(NEW.uid, "node-1")
    watch = podlife.PodEndWatch(
        agent, lambda refs: {p for p in refs if p.uid == OLD.uid}, on_end=auth.forget_pod
    )
    assert watch.tick() == [OLD]
    with pytest.raises(identity.AuthError, match="has ended|re-created") as info:
        auth.authenticate(f"Bearer {old_token}")
    assert info.value.status == 403
    # the new pod's first signal is taken, with its own UID
    caller = auth.authenticate(f"Bearer {new_token}")
    assert identity.authorize(agent, caller) == NEW


def _seen(pod: service.PodRef, *, deleting: bool = False, phase: str = "Running") -> Any:
    return annotations.PodEvent(
        pod.namespace, pod.name, pod.uid, "node-1", "trainer", {}, deleting=deleting, phase=phase
    )


def test_a_watched_deletion_refuses_the_old_token_before_any_pod_end_check(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    agent = standin_agent(
        {service.PodRef(OLD.namespace, OLD.name): list(drv.uuids)}, PLAN, lambda: drv.virtual_s
    )
    reviews, current = FakeReviews(), Pods(OLD)
    auth = reviews.authenticator(current_pod=current)
    old_token = reviews.issue(OLD)
    agent.phase(
        identity.authorize(agent, auth.authenticate(f"Bearer {old_token}")), "generation", 0
    )
    ends = identity.PodEndTokens(auth)
    # The node's pod watch: a running pod changes nothing, the old token stays cached.
    assert ends.handle(_seen(OLD)) == []
    auth.authenticate(f"Bearer {old_token}")
    assert reviews.calls == 1
    # Its deletion starts; the pod is then re-created under its name. No pod-end check (the
    # API listing every few seconds) has run: the watch alone refuses the old token.
    assert ends.handle(_seen(OLD, deleting=True)) == [f"ended {OLD.uid}"]
    current.now[(OLD.namespace, OLD.name)] = identity.PodFacts(NEW.uid, "node-1")
    with pytest.raises(identity.AuthError, match="has ended") as info:
        identity.authorize(agent, auth.authenticate(f"Bearer {old_token}"), gpus=list(drv.uuids))
    assert info.value.status == 403
    assert identity.authorize(agent, auth.authenticate(f"Bearer {reviews.issue(NEW)}")) == NEW


def test_a_terminal_pod_is_refused_and_a_relist_drops_pods_gone_meanwhile() -> None:
    reviews, current = FakeReviews(), Pods(OLD)
    auth = reviews.authenticator(current_pod=current)
    ends = identity.PodEndTokens(auth)
    token = reviews.issue(OLD)
    auth.authenticate(f"Bearer {token}")
    ends.keep({OLD.uid})  # a relist that has the pod keeps its cached success
    auth.authenticate(f"Bearer {token}")
    assert reviews.calls == 1
    ends.keep({NEW.uid})  # a relist without it: reviewed again at the next use, not refused
    auth.authenticate(f"Bearer {token}")
    assert reviews.calls == 2
    assert ends.handle(_seen(OLD, phase="Succeeded")) == [f"ended {OLD.uid}"]
    with pytest.raises(identity.AuthError, match="has ended") as info:
        auth.authenticate(f"Bearer {token}")
    assert info.value.status == 403
    other = reviews.issue(NEW)
    current.now[(NEW.namespace, NEW.name)] = identity.PodFacts(NEW.uid, "node-1")
    auth.authenticate(f"Bearer {other}")
    ends.forget(NEW.uid)  # the watch's DELETED event
    with pytest.raises(identity.AuthError, match="has ended"):
        auth.authenticate(f"Bearer {other}")
    assert ends.ended == 2


def test_the_old_token_is_refused_on_first_use_after_recreation_without_any_cache() -> None:
    reviews, current = FakeReviews(), Pods(NEW)  # re-created before the old token's first use
    auth = reviews.authenticator(current_pod=current)
    with pytest.raises(identity.AuthError, match="uid-new") as info:
        auth.authenticate(f"Bearer {reviews.issue(OLD)}")
    assert info.value.status == 403


@pytest.mark.parametrize(
    ("facts", "match"),
    [
        (None, "no longer exists"),
        (identity.PodFacts("uid-old", "node-1", deleting=True), "being deleted"),
        (identity.PodFacts("uid-old", "node-1", phase="Succeeded"), "finished"),
        (identity.PodFacts("uid-old", "node-1", phase="Failed"), "finished"),
    ],
)
def test_a_pod_gone_being_deleted_or_finished_is_refused(
    facts: identity.PodFacts | None, match: str
) -> None:
    reviews = FakeReviews()
    auth = reviews.authenticator(current_pod=lambda ns, n: facts)
    with pytest.raises(identity.AuthError, match=match) as info:
        auth.authenticate(f"Bearer {reviews.issue(OLD)}")
    assert info.value.status == 403


def test_the_pod_check_unreachable_is_503_and_not_cached() -> None:
    reviews, current = FakeReviews(), Pods(OLD)
    auth = reviews.authenticator(current_pod=current)
    token = reviews.issue(OLD)
    current.down = True
    with pytest.raises(identity.AuthError, match="cannot check the caller's pod") as info:
        auth.authenticate(f"Bearer {token}")
    assert info.value.status == 503
    current.down = False
    assert auth.authenticate(f"Bearer {token}").pod_uid == OLD.uid


def test_a_success_is_reused_at_most_10_s_and_never_past_the_pods_end() -> None:
    reviews, current, mono = FakeReviews(), Pods(OLD), Clock()
    auth = reviews.authenticator(current_pod=current, clock=mono)
    assert auth.max_ttl_s <= 10.0
    token = reviews.issue(OLD)
    auth.authenticate(f"Bearer {token}")
    mono.t += 9.9
    auth.authenticate(f"Bearer {token}")
    assert reviews.calls == 1
    mono.t += 0.2
    auth.authenticate(f"Bearer {token}")
    assert reviews.calls == 2
    auth.forget_pod(OLD)  # the pod-end watch: its pod ended
    with pytest.raises(identity.AuthError, match="has ended") as info:
        auth.authenticate(f"Bearer {token}")
    assert info.value.status == 403


def test_settings_cap_the_success_cache_at_10_s() -> None:
    from pydantic import ValidationError
    from rlenergy_agent import config

    assert config.AgentSettings().token_cache_max_s <= 10.0
    with pytest.raises(ValidationError):
        config.AgentSettings(token_cache_max_s=600.0)


def test_exactly_one_pod_name_and_uid_or_403() -> None:
    sa = "system:serviceaccount:a:default"
    two_names = {identity.EXTRA_POD_NAME: ["p", "q"], identity.EXTRA_POD_UID: ["u"]}
    two_uids = {identity.EXTRA_POD_NAME: ["p"], identity.EXTRA_POD_UID: ["u", "v"]}
    empty = {identity.EXTRA_POD_NAME: [""], identity.EXTRA_POD_UID: ["u"]}
    for extra in (two_names, two_uids, empty, {}):
        with pytest.raises(identity.AuthError, match="exactly one pod") as info:
            identity.caller_of(identity.Review(True, sa, extra, [AUDIENCE]), AUDIENCE)
        assert info.value.status == 403


def test_a_legacy_token_without_pod_claims_is_403_through_the_authenticator() -> None:
    reviews = FakeReviews()
    legacy = reviews.issue(OLD)

    def review(token: str, audiences: Any) -> identity.Review:
        reviews.calls += 1
        return identity.Review(True, "system:serviceaccount:team-a:default", {}, [AUDIENCE])

    auth = identity.TokenAuthenticator(review, AUDIENCE)
    with pytest.raises(identity.AuthError, match="not bound to exactly one pod") as info:
        auth.authenticate(f"Bearer {legacy}")
    assert info.value.status == 403


def test_concurrent_first_uses_of_one_token_make_one_review() -> None:
    reviews = FakeReviews()
    token = reviews.issue(OLD)
    gate = threading.Event()

    def slow(token: str, audiences: Any) -> identity.Review:
        gate.wait(5)
        return reviews.review(token, audiences)

    auth = identity.TokenAuthenticator(slow, AUDIENCE)
    results: list[Any] = []

    def use() -> None:
        try:
            results.append(auth.authenticate(f"Bearer {token}"))
        except identity.AuthError as exc:
            results.append(exc)

    threads = [threading.Thread(target=use) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(5)
    assert reviews.calls == 1 and auth.reviews == 1
    assert len(results) == 8 and all(isinstance(r, identity.Caller) for r in results)


class _Slow(http.server.BaseHTTPRequestHandler):
    delay_s = 3.0
    body = b"{}"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        time.sleep(self.delay_s)
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass


class _Quiet(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the client gave up (the timeout under test): nothing to report


@pytest.fixture
def http_server() -> Iterator[Any]:
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(handler: type[http.server.BaseHTTPRequestHandler]) -> str:
        srv = _Quiet(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _api_client(host: str) -> kubeapi.ApiClient:
    return kubeapi.ApiClient(kubeapi.Config(host))


def test_a_review_slower_than_2_s_is_503(http_server: Any) -> None:
    host = http_server(_Slow)
    reviewer = kube.TokenReviewer(_api_client(host))
    assert reviewer.timeout_s <= 2.0
    auth = identity.TokenAuthenticator(reviewer.review, AUDIENCE)
    t0 = time.monotonic()
    with pytest.raises(identity.AuthError, match="cannot check") as info:
        auth.authenticate(f"Bearer {FakeReviews().issue(OLD)}")
    assert info.value.status == 503
    assert time.monotonic() - t0 < 2.8


def test_current_pod_reads_the_apis_pod_of_that_name(http_server: Any) -> None:
    seen: list[str] = []

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.path)
            pod = {
                "metadata": {"name": "trainer-0", "uid": "uid-new", "deletionTimestamp": "x"},
                "spec": {"nodeName": "node-1"},
                "status": {"phase": "Running"},
            }
            body = json.dumps({"items": [pod] if "trainer-0" in self.path else []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    current = kube.CurrentPod(_api_client(http_server(Api)))
    assert current("team-a", "trainer-0") == identity.PodFacts(
        "uid-new", "node-1", deleting=True, phase="Running"
    )
    assert current("team-a", "other") is None
    assert seen[0].startswith("/api/v1/namespaces/team-a/pods?")
    assert "fieldSelector=metadata.name%3Dtrainer-0" in seen[0]
    with pytest.raises(identity.ReviewUnavailableError):
        kube.CurrentPod(_api_client("http://127.0.0.1:9"))("team-a", "trainer-0")


def test_a_token_flood_is_bounded_and_the_valid_token_keeps_working() -> None:
    reviews, mono = FakeReviews(), Clock()
    auth = reviews.authenticator(clock=mono, max_entries=64)
    valid = reviews.issue(OLD)
    assert auth.authenticate(f"Bearer {valid}").pod_uid == OLD.uid
    # 3,000 tokens that are not JWTs: refused here, no review
    for i in range(3000):
        with pytest.raises(identity.AuthError, match="not a JWT") as info:
            auth.authenticate(f"Bearer junk-{i}")
        assert info.value.status == 401
    assert reviews.calls == 1 and auth.refused_locally == 3000
    # 3,000 JWT-shaped junk tokens within one second: at most the burst is reviewed
    statuses = []
    for i in range(3000):
        junk = _jwt({"exp": 2_000_000_000, "junk": i})
        with pytest.raises(identity.AuthError) as info:
            auth.authenticate(f"Bearer {junk}")
        statuses.append(info.value.status)
    assert reviews.calls - 1 <= identity.REVIEW_BURST
    assert statuses.count(503) >= 3000 - identity.REVIEW_BURST
    # the valid token still answers from its cached success: no review, not evicted
    before = reviews.calls
    assert auth.authenticate(f"Bearer {valid}").pod_uid == OLD.uid
    assert reviews.calls == before
    # the bucket refills: a new valid token is reviewed a moment later
    mono.t += 1.0
    assert auth.authenticate(f"Bearer {reviews.issue(NEW)}").pod_uid == NEW.uid


def test_sdk_keeps_the_last_token_when_a_reread_fails(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("tok-1\n")
    token = trainer.BearerToken(str(path))
    assert token.header() == "Bearer tok-1"
    path.unlink()  # the kubelet swapping the projected volume
    assert token.header() == "Bearer tok-1"
    assert token.header(reload=True) == "Bearer tok-1"
    path.write_text("")  # an empty read mid-swap
    assert token.header(reload=True) == "Bearer tok-1"
    path.write_text("tok-2")
    assert token.header(reload=True) == "Bearer tok-2"
