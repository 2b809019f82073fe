"""Caller identity: bearer token -> TokenReview (cached) -> pod -> what it may signal.

We test: the review cache (one TokenReview per token, reused until the token's expiry and at
most ``max_ttl_s``, bounded in size, refusals cached briefly, 503 when the API cannot be
asked); the checks on the review (audience, pod binding); ``authorize`` (other node, other
UID, other pod's GPUs, MIG instances; a governed pod a restarted kubelet does not list yet is
told to retry, 503); the SDK's token file (re-read on rotation and after a
401); the Kubernetes side (``kube.TokenReviewer`` through a real ``kubeapi.ApiClient`` against a local
HTTP server: the review's JSON, the answers read, 403 and a refused connection). The real TokenReview
against a real API server runs in the e2e, chaos and bench harnesses.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from agent_support import AUDIENCE, DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import identity, kube, kubeapi, pods, server, service

from rlenergy.api import node as api_node
from rlenergy.sdk import trainer

POD_A = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
POD_B = service.PodRef("team-b", "rollout-0", "66666666-7777-8888-9999-000000000000")
PLAN = api_node.ClockPlan(
    step=0, phases=[api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked")]
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_one_review_per_token_until_its_expiry_bounded_by_max_ttl() -> None:
    reviews, mono, wall = FakeReviews(), Clock(), Clock()
    wall.t = 1_700_000_000.0
    auth = reviews.authenticator(max_ttl_s=60.0, clock=mono, wall=wall)
    short = reviews.issue(POD_A, exp_s=wall.t + 10)
    long = reviews.issue(POD_A, exp_s=wall.t + 3600)
    for _ in range(100):
        caller = auth.authenticate(f"Bearer {short}")
    assert reviews.calls == 1 and auth.reviews == 1
    assert (caller.namespace, caller.pod_name, caller.pod_uid) == (
        POD_A.namespace,
        POD_A.name,
        POD_A.uid,
    )
    assert caller.node_name == "node-1" and caller.service_account == "default"
    mono.t += 11  # past the token's exp: asked again
    auth.authenticate(f"Bearer {short}")
    assert reviews.calls == 2
    auth.authenticate(f"Bearer {long}")
    mono.t += 59
    auth.authenticate(f"Bearer {long}")
    assert reviews.calls == 3
    mono.t += 2  # past max_ttl_s although the token is valid for an hour
    auth.authenticate(f"Bearer {long}")
    assert reviews.calls == 4


def test_refusals_are_cached_briefly_and_the_cache_is_bounded() -> None:
    reviews, mono = FakeReviews(), Clock()
    auth = reviews.authenticator(negative_ttl_s=2.0, max_entries=3, clock=mono)
    unknown = _jwt({"n": -1})  # JWT-shaped, but no API server issued it
    for _ in range(10):
        with pytest.raises(identity.AuthError, match="refused by the API server") as info:
            auth.authenticate(f"Bearer {unknown}")
        assert info.value.status == 401
    assert reviews.calls == 1
    mono.t += 2.5
    with pytest.raises(identity.AuthError):
        auth.authenticate(f"Bearer {unknown}")
    assert reviews.calls == 2
    tokens = [reviews.issue(POD_A) for _ in range(5)]
    for t in tokens:
        auth.authenticate(f"Bearer {t}")
    assert len(auth._ok) == 3  # noqa: SLF001 - the bound is the point
    auth.authenticate(f"Bearer {tokens[-1]}")  # newest: still cached
    calls = reviews.calls
    auth.authenticate(f"Bearer {tokens[0]}")  # oldest: dropped, asked again
    assert reviews.calls == calls + 1


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer  ", "Basic dXNlcjpwYXNz"])
def test_missing_token_is_401_naming_what_to_send(header: str | None) -> None:
    auth = FakeReviews().authenticator()
    with pytest.raises(identity.AuthError, match="Authorization: Bearer") as info:
        auth.authenticate(header)
    assert info.value.status == 401


def test_api_unreachable_is_503_and_not_cached() -> None:
    reviews = FakeReviews()
    auth = reviews.authenticator()
    token = reviews.issue(POD_A)
    reviews.down = True
    with pytest.raises(identity.AuthError, match="cannot check") as info:
        auth.authenticate(f"Bearer {token}")
    assert info.value.status == 503
    reviews.down = False
    assert auth.authenticate(f"Bearer {token}").pod_name == POD_A.name


def test_wrong_audience_is_401_and_a_token_bound_to_no_pod_is_403() -> None:
    reviews = FakeReviews()
    auth = reviews.authenticator()
    with pytest.raises(identity.AuthError, match="refused") as info:
        auth.authenticate(f"Bearer {reviews.issue(POD_A, audience='https://kubernetes.default')}")
    assert info.value.status == 401
    # accepted, but the API server's answer names another audience only
    review = identity.Review(True, "system:serviceaccount:a:default", {}, ["other"])
    with pytest.raises(identity.AuthError, match="not valid for audience"):
        identity.caller_of(review, AUDIENCE)
    # a plain (legacy) service-account token names no pod: valid, but not allowed
    review = identity.Review(True, "system:serviceaccount:a:default", {}, [AUDIENCE])
    with pytest.raises(identity.AuthError, match="not bound to exactly one pod") as info:
        identity.caller_of(review, AUDIENCE)
    assert info.value.status == 403
    review = identity.Review(True, "alice", {identity.EXTRA_POD_NAME: ["p"]}, [AUDIENCE])
    with pytest.raises(identity.AuthError, match="alice is not bound"):
        identity.caller_of(review, AUDIENCE)


def test_token_expiry_parsing() -> None:
    token = FakeReviews().issue(POD_A, exp_s=1234.0)
    assert identity.token_expiry_s(token) == 1234.0
    for bad in ("abc", "a.b", "a.!!!.c", "a.bnVsbA.c"):
        assert identity.token_expiry_s(bad) is None


def _caller(pod: service.PodRef, node: str = "node-1", uid: str | None = None) -> identity.Caller:
    return identity.Caller(pod.namespace, pod.name, pod.uid if uid is None else uid, node, "sa")


def test_authorize_node_uid_and_gpus(make_driver: DriverFactory) -> None:
    drv = make_driver(4)
    agent = standin_agent(
        {POD_A: list(drv.uuids[:2]), POD_B: list(drv.uuids[2:])}, PLAN, lambda: drv.virtual_s
    )
    assert identity.authorize(agent, _caller(POD_A)) == POD_A
    assert identity.authorize(agent, _caller(POD_A, node="")) == POD_A  # unscheduled when issued
    assert identity.authorize(agent, _caller(POD_A), list(drv.uuids[:2])) == POD_A
    cases: list[tuple[identity.Caller, list[str], str]] = [
        (_caller(POD_A, node="node-7"), [], "runs on node node-7, this agent serves node node-1"),
        (_caller(POD_A, uid="99999999-0000-0000-0000-000000000000"), [], "has UID"),
        (_caller(service.PodRef("team-a", "ghost", "u")), [], "holds no GPU on node node-1"),
        (_caller(POD_A), [drv.uuids[0], drv.uuids[2]], f"does not hold GPU(s) {drv.uuids[2]}"),
    ]
    for caller, gpus, message in cases:
        with pytest.raises(identity.AuthError, match=re.escape(message)) as info:
            identity.authorize(agent, caller, gpus)
        assert info.value.status == 403
    assert agent.refused == len(cases)
    # a MIG instance of the pod's own GPU is the pod's
    agent.mig_parent["MIG-aaaa"] = drv.uuids[0]
    assert identity.authorize(agent, _caller(POD_A), ["MIG-aaaa"]) == POD_A


def test_a_governed_pod_unlisted_by_a_restarted_kubelet_gets_503(
    make_driver: DriverFactory,
) -> None:
    """A listing with no GPU pod (a restarted kubelet before its pods are synced): the pods
    the agent governs are told to retry (503), any other caller is refused (403)."""
    drv = make_driver(4)
    agent = standin_agent(
        {POD_A: list(drv.uuids[:2]), POD_B: list(drv.uuids[2:])}, PLAN, lambda: drv.virtual_s
    )
    agent.phase(POD_A, "generation", 0)  # POD_A governed, its GPUs locked
    agent.podmap = pods.StaticPodMap({})
    with pytest.raises(identity.AuthError, match="retry") as info:
        identity.authorize(agent, _caller(POD_A))
    assert info.value.status == 503
    assert all(drv.gpu(u).locked for u in drv.uuids[:2])
    with pytest.raises(identity.AuthError, match="holds no GPU") as info:
        identity.authorize(agent, _caller(POD_B))
    assert info.value.status == 403
    # the listing names a GPU pod again: an unlisted governed caller is refused as before
    agent.podmap = pods.StaticPodMap({POD_B: list(drv.uuids[2:])})
    with pytest.raises(identity.AuthError, match="holds no GPU") as info:
        identity.authorize(agent, _caller(POD_A))
    assert info.value.status == 403


def test_sdk_rereads_a_rotated_token_and_retries_once_after_401(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    drv = make_driver(2)
    agent = standin_agent({POD_A: list(drv.uuids)}, PLAN, lambda: drv.virtual_s)
    reviews = FakeReviews()
    sock = short_tmp / "agent.sock"
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        # the kubelet's projected volume: token -> ..data/token, ..data swapped on rotation
        vol = short_tmp / "vol"
        (vol / "v1").mkdir(parents=True)
        (vol / "v1" / "token").write_text(reviews.issue(POD_A) + "\n")
        (vol / "..data").symlink_to("v1")
        (vol / "token").symlink_to("..data/token")
        client = trainer.RLEnergyClient(str(sock), strict=True, token_file=str(vol / "token"))
        client.phase("generation", step=0)
        assert client.last_response["pod"] == str(POD_A)
        first = client.token.header()
        (vol / "v2").mkdir()
        (vol / "v2" / "token").write_text(reviews.issue(POD_A))
        (vol / "..data.tmp").symlink_to("v2")
        os.replace(vol / "..data.tmp", vol / "..data")
        client.phase("training", step=0)
        assert client.token.header() != first
        assert reviews.calls == 2
        # a token replaced in place without a visible stat change: the 401 makes it re-read
        client.token._header = "Bearer revoked"  # noqa: SLF001 - what a cached old token does
        client.phase("idle", step=0)
        assert client.last_response["pod"] == str(POD_A)
        client.close()
    finally:
        srv.stop()


class _Reviews(http.server.BaseHTTPRequestHandler):
    """An API server's TokenReview endpoint: answers ``answers`` in turn, records the bodies."""

    answers: list[tuple[int, dict[str, Any]]] = []
    asked: list[tuple[str, dict[str, Any]]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        self.asked.append((self.path, json.loads(self.rfile.read(length))))
        status, body = self.answers.pop(0)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args: Any) -> None:
        pass


def _review(answer: tuple[int, dict[str, Any]] | None, host: str = "") -> identity.Review:
    """``kube.TokenReviewer`` through a real ``kubeapi.ApiClient`` against ``_Reviews`` (or ``host``)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Reviews)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Reviews.answers = [answer] if answer is not None else []
    cfg = kubeapi.Config(host or f"http://127.0.0.1:{srv.server_address[1]}", token="t")
    try:
        return kube.TokenReviewer(kubeapi.ApiClient(cfg)).review("tok", [AUDIENCE])
    finally:
        srv.shutdown()
        srv.server_close()


def test_token_reviewer_posts_the_review_and_reads_the_answer_as_json() -> None:
    extra = {identity.EXTRA_POD_NAME: ["trainer-0"], identity.EXTRA_POD_UID: [POD_A.uid]}
    user = {"username": "system:serviceaccount:team-a:default", "extra": extra}
    ok = {"status": {"authenticated": True, "audiences": [AUDIENCE], "user": user}}
    _Reviews.asked = []
    review = _review((201, ok))
    path, body = _Reviews.asked[0]
    assert path == kube.TOKEN_REVIEWS
    assert body == {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": "tok", "audiences": [AUDIENCE]},
    }
    assert identity.caller_of(review, AUDIENCE) == identity.Caller(
        "team-a", "trainer-0", POD_A.uid, "", "default"
    )
    no = {"status": {"authenticated": False, "error": "token has expired"}}
    assert _review((201, no)) == identity.Review(False, error="token has expired")
    assert _review((201, {})) == identity.Review(False, error="not authenticated")
    with pytest.raises(identity.ReviewUnavailableError, match="tokenreviews create"):
        _review((403, {"kind": "Status", "reason": "Forbidden"}))
    with pytest.raises(identity.ReviewUnavailableError, match="TokenReview failed"):
        _review(None, host="http://127.0.0.1:1")  # nothing listens: connection refused


def _jwt(claims: dict[str, Any]) -> str:
    import base64
    import json

    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return f"eyJhbGciOiJSUzI1NiJ9.{body}.c2ln"


def test_expiry_of_every_unpadded_payload_length() -> None:
    """base64url drops its padding: payloads of each length mod 4 must still parse."""
    seen = set()
    for pad in range(6):
        token = _jwt({"exp": 1234, "p": "x" * pad})
        seen.add(len(token.split(".")[1]) % 4)
        assert identity.token_expiry_s(token) == 1234.0, token
    assert seen == {0, 2, 3}


def test_each_missing_pod_binding_is_refused_with_403() -> None:
    sa = "system:serviceaccount:a:default"
    bound = {identity.EXTRA_POD_NAME: ["p"], identity.EXTRA_POD_UID: ["u"]}
    cases = [
        identity.Review(True, sa, {identity.EXTRA_POD_NAME: ["p"]}, [AUDIENCE]),  # no UID
        identity.Review(True, sa, {identity.EXTRA_POD_UID: ["u"]}, [AUDIENCE]),  # no name
        identity.Review(True, "alice", bound, [AUDIENCE]),  # not a service account
    ]
    for review in cases:
        with pytest.raises(identity.AuthError, match="is not bound to exactly one pod") as info:
            identity.caller_of(review, AUDIENCE)
        assert info.value.status == 403, review
    with pytest.raises(identity.AuthError, match="an unknown user is not bound"):
        identity.caller_of(identity.Review(True, "", bound, [AUDIENCE]), AUDIENCE)
    with pytest.raises(identity.AuthError, match="not valid for audience") as info:
        identity.caller_of(identity.Review(True, sa, bound, ["other"]), AUDIENCE)
    assert info.value.status == 401
    with pytest.raises(identity.AuthError, match=r"API server: invalid$") as info:
        identity.caller_of(identity.Review(False), AUDIENCE)
    assert info.value.status == 401
    assert identity.caller_of(identity.Review(True, sa, bound, [AUDIENCE]), AUDIENCE) == (
        identity.Caller("a", "p", "u", "", "default")
    )


def test_cache_lifetimes_at_their_edges() -> None:
    """Reused strictly before its expiry; a token without ``exp`` for ``max_ttl_s``; a token
    with under a second left still cached, one already expired never."""
    reviews, mono, wall = FakeReviews(), Clock(), Clock()
    wall.t = 1_700_000_000.0
    auth = reviews.authenticator(max_ttl_s=60.0, clock=mono, wall=wall)
    token = reviews.issue(POD_A, exp_s=wall.t + 10)
    auth.authenticate(f"Bearer {token}")
    mono.t += 10  # exactly at the expiry: asked again
    auth.authenticate(f"Bearer {token}")
    assert reviews.calls == 2 and auth.reviews == 2
    half = reviews.issue(POD_A, exp_s=wall.t + 0.5)
    # issue() rounds exp to whole seconds: build the half-second token's claim by hand
    half_token = _jwt({"exp": wall.t + 0.5, "n": 99})
    reviews.bound[half_token] = reviews.bound.pop(half)
    auth.authenticate(f"Bearer {half_token}")
    auth.authenticate(f"Bearer {half_token}")
    assert reviews.calls == 3  # 0.5 s left: cached
    expired = _jwt({"exp": wall.t, "n": 100})
    reviews.bound[expired] = (POD_A, "node-1", AUDIENCE)
    auth.authenticate(f"Bearer {expired}")
    auth.authenticate(f"Bearer {expired}")
    assert reviews.calls == 5  # no time left: never cached
    no_exp = _jwt({"n": 101})
    reviews.bound[no_exp] = (POD_A, "node-1", AUDIENCE)
    auth.authenticate(f"Bearer {no_exp}")
    mono.t += 59
    auth.authenticate(f"Bearer {no_exp}")
    assert reviews.calls == 6  # no exp claim: max_ttl_s
    mono.t += 1
    auth.authenticate(f"Bearer {no_exp}")
    assert reviews.calls == 7


def test_refusal_counter_and_every_foreign_gpu_named(make_driver: DriverFactory) -> None:
    drv = make_driver(4)
    agent = standin_agent(
        {POD_A: list(drv.uuids[:2]), POD_B: list(drv.uuids[2:])}, PLAN, lambda: drv.virtual_s
    )
    with pytest.raises(identity.AuthError, match=re.escape(", ".join(drv.uuids[2:]))):
        identity.authorize(agent, _caller(POD_A), list(drv.uuids[2:]))
    with pytest.raises(identity.AuthError, match="holds no GPU"):
        identity.authorize(agent, _caller(service.PodRef("team-a", "ghost", "u")))
    with pytest.raises(identity.AuthError, match="this agent serves node"):
        identity.authorize(agent, _caller(POD_A, node="node-7"))
    assert agent.refused == 3
