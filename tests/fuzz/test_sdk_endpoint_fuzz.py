"""Fuzzing the agent's SDK endpoint (the trainer signal socket) with hypothesis.

The real ``SignalServer`` over a Unix socket in front of a real ``service.Agent`` on simulated
GPUs (``rlenergy_agent.__main__.build`` with the sim backend). The caller is one pod holding
two of the node's GPUs: a real pod object on a KWOK node of the dev cluster, whose token the
API server bound to it (``rlenergy_dev.devcluster.trainers``); the server checks it by a real
TokenReview (``rlenergy_agent.kube.TokenReviewer``, cached). Properties:

* random JSON bodies, malformed bytes, wrong types, wrong step order, unknown paths: the server
  always answers (never a dropped connection or a 5xx), every refusal is 4xx with an ``error``
  that names what is wrong, and the agent keeps working (a valid signal is served afterwards
  and its node report still validates);
* oversized bodies are refused with 413 naming the limit, without reading them;
* a pod naming GPUs that are not its own gets 403 naming those GPUs; nothing is clocked;
* random or missing ``Authorization`` headers get 401 (never a 5xx), nothing is clocked.
"""

from __future__ import annotations

import http.client
import json
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rlenergy_agent import __main__ as agent_main
from rlenergy_agent import config, identity, kube, kubeapi, server, service
from rlenergy_dev.devcluster import DevCluster, nodes, trainers

from rlenergy.api import node as api_node
from rlenergy.api import signals

pytestmark = pytest.mark.e2e  # needs the control plane (the trainer's token, TokenReview)

NODE = nodes.node_name(0)
PATHS = ["/v1/phase", "/v1/progress", "/v1/step", "/v1/park", "/v1/unpark", "/v1/rollout"]


class _Conn(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.unix_path)


class Harness:
    def __init__(self, work: Path, cluster: DevCluster, namespace: str) -> None:
        self.pod = trainers.create_trainer(cluster.kubectl, namespace, "trainer", NODE, work)
        self.auth = f"Bearer {self.pod.token_file.read_text().strip()}"
        uuids = [f"GPU-sim-{NODE}-{i:02d}" for i in range(4)]
        self.mine, self.others = uuids[:2], uuids[2:]
        settings_ = config.AgentSettings(
            node_name=NODE,
            backend="sim",
            sim_gpus=4,
            state_dir=work / "state",
            socket_path=work / "a.sock",
            kube=False,
            static_pods=json.dumps({self.pod.static_key: self.mine}),
        )
        self.agent, _ = agent_main.build(settings_)
        self.agent.set_plan(
            api_node.ClockPlan.model_validate(
                {
                    "step": 0,
                    "phases": [{"phase": "generation", "clockMHz": 1200, "state": "locked"}],
                }
            )
        )
        self.path = str(work / "a.sock")
        api = kubeapi.ApiClient(kubeapi.from_kubeconfig(cluster.kubeconfig))
        self.authenticator = identity.TokenAuthenticator(
            kube.TokenReviewer(api).review, signals.TOKEN_AUDIENCE
        )
        self.server = server.SignalServer(Path(self.path), self.agent, self.authenticator)
        self.server.start()

    def post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        conn = _Conn(self.path)
        try:
            conn.request(
                "POST",
                path,
                body=body,
                headers={"Authorization": self.auth} if headers is None else headers,
            )
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, json.loads(data) if data else None
        finally:
            conn.close()

    def locked_others(self) -> list[str]:
        return [
            u for u in self.others if self.agent.actuator.gpus[u].locked_sm_clocks_mhz is not None
        ]


@pytest.fixture(scope="module")
def harness(dev_cluster: DevCluster) -> Iterator[Harness]:
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rlfuzz-"))
    ns = f"fuzz-{uuid.uuid4().hex[:6]}"
    dev_cluster.kubectl("create", "namespace", ns)
    h = Harness(work, dev_cluster, ns)
    yield h
    h.server.stop()
    dev_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _still_works(h: Harness) -> None:
    status, body = h.post("/v1/phase", json.dumps({"phase": "generation", "step": 1}).encode())
    assert status == 200, body
    assert set(body["gpus"]) == set(h.mine)
    api_node.NodeReport.model_validate(h.agent.report().model_dump(by_alias=True))
    assert h.locked_others() == []


def _check_answer(status: int, body: Any) -> None:
    assert 200 <= status < 500, (status, body)
    if status >= 400:
        assert isinstance(body, dict) and isinstance(body.get("error"), str), body
        assert len(body["error"]) > 10, body  # says what is wrong, not just "bad"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "phase": st.one_of(st.sampled_from(["generation", "training", "idle", ""]), json_values),
        "step": st.one_of(st.integers(-5, 10**20), json_values),
        "gpus": st.one_of(
            st.lists(st.sampled_from([f"GPU-sim-{NODE}-00", "GPU-x", ""]), max_size=3),
            json_values,
        ),
        "amount": st.one_of(st.floats(allow_nan=True, allow_infinity=True), json_values),
        "workload": st.one_of(
            st.fixed_dictionaries(
                {
                    "samples": st.integers(-3, 100),
                    "responseTokens": st.floats(-1, 1e6),
                    "promptTokens": st.floats(0, 1e6),
                    "validTokens": st.floats(-1, 1e6),
                    "meanContextTokens": st.floats(0, 1e4),
                }
            ),
            json_values,
        ),
    },
)

FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(path=st.sampled_from([*PATHS, "/v1/nope", "/"]), body=bodies)
def test_random_json_messages_never_crash_and_refusals_say_why(
    harness: Harness, path: str, body: dict[str, Any]
):
    status, answer = harness.post(path, json.dumps(body).encode())
    _check_answer(status, answer)
    _still_works(harness)


@FUZZ
@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=300))
def test_malformed_bytes_are_refused_with_a_reason(harness: Harness, path: str, raw: bytes):
    status, answer = harness.post(path, raw)
    _check_answer(status, answer)
    if status >= 400:
        assert "bad request" in answer["error"] or "no endpoint" in answer["error"]
    _still_works(harness)


@FUZZ
@given(
    steps=st.lists(st.tuples(st.sampled_from(["phase", "step"]), st.integers(-2, 40)), max_size=12)
)
def test_wrong_step_order_never_corrupts_the_report(harness: Harness, steps: list[tuple[str, int]]):
    wl = {
        "samples": 1,
        "responseTokens": 10.0,
        "promptTokens": 1.0,
        "validTokens": 9.0,
        "meanContextTokens": 5.0,
    }
    for kind, s in steps:
        if kind == "phase":
            status, answer = harness.post(
                "/v1/phase", json.dumps({"phase": "training", "step": s}).encode()
            )
        else:
            status, answer = harness.post(
                "/v1/step", json.dumps({"step": s, "workload": wl}).encode()
            )
        _check_answer(status, answer)
        if s < 0:
            assert status == 400 and "step" in answer["error"], answer
    report = harness.agent.report()
    api_node.NodeReport.model_validate(report.model_dump(by_alias=True))
    assert len(report.steps) <= service.MAX_STEPS_KEPT
    _still_works(harness)


@FUZZ
@given(
    foreign=st.lists(
        st.sampled_from([f"GPU-sim-{NODE}-02", f"GPU-sim-{NODE}-03", "GPU-elsewhere"]),
        min_size=1,
        max_size=3,
    )
)
def test_a_pod_cannot_signal_for_gpus_not_its_own(harness: Harness, foreign: list[str]):
    status, answer = harness.post(
        "/v1/phase",
        json.dumps(
            {"phase": "generation", "step": 2, "gpus": [harness.mine[0], *foreign]}
        ).encode(),
    )
    assert status == 403, answer
    assert all(g in answer["error"] for g in foreign), answer
    assert harness.locked_others() == []
    _still_works(harness)


def _raw(h: Harness, head: bytes, body: bytes) -> tuple[int, Any]:
    """Send a request's head and the first bytes of its body; read the answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(h.path)
    try:
        head = head.replace(b"Host: x\r\n", f"Host: x\r\nAuthorization: {h.auth}\r\n".encode())
        s.sendall(head + body)
        resp = http.client.HTTPResponse(s)
        resp.begin()
        return resp.status, json.loads(resp.read())
    finally:
        s.close()


@pytest.mark.parametrize("length", [4 << 20, 10**12])
def test_an_oversized_body_is_refused_without_reading_it(harness: Harness, length: int):
    head = f"POST /v1/phase HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()
    status, answer = _raw(harness, head, b'{"phase": "generation", "step": 1, "pad": "xxxx')
    assert status == 413, answer
    assert "too large" in answer["error"] and str(server.MAX_BODY_BYTES) in answer["error"], answer
    _still_works(harness)


@pytest.mark.parametrize("length", ["-1", "12abc"])
def test_a_bad_content_length_is_refused(harness: Harness, length: str):
    head = f"POST /v1/phase HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()
    status, answer = _raw(harness, head, b"{}")
    assert status == 400 and "Content-Length" in answer["error"], answer
    _still_works(harness)


def test_a_lying_content_length_does_not_block_other_callers(harness: Harness):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(harness.path)
    try:
        s.sendall(
            b"POST /v1/phase HTTP/1.1\r\nHost: x\r\nAuthorization: "
            + harness.auth.encode()
            + b'\r\nContent-Length: 500\r\n\r\n{"phase":'
        )
        _still_works(harness)  # served on another thread while that caller stalls
    finally:
        s.close()


@FUZZ
@given(
    header=st.one_of(
        st.none(),
        st.text(max_size=60).filter(lambda t: "\r" not in t and "\n" not in t),
        st.builds(lambda t: f"Bearer {t}", st.text(min_size=1, max_size=80)),
        st.sampled_from(["Bearer", "Bearer ", "bearer x.y.z", "Basic dXNlcjpwYXNz"]),
    ),
    path=st.sampled_from(PATHS),
)
def test_random_authorization_headers_are_401_and_clock_nothing(
    harness: Harness, header: str | None, path: str
):
    headers = {} if header is None else {"Authorization": header}
    try:
        status, answer = harness.post(
            path, json.dumps({"phase": "generation", "step": 1}).encode(), headers
        )
    except (UnicodeEncodeError, ValueError):
        return  # http.client refuses to send that header: nothing reached the agent
    assert status == 401, answer
    assert "token" in answer["error"], answer
    assert harness.locked_others() == []
    _still_works(harness)


def test_one_token_review_serves_every_signal(harness: Harness):
    before = harness.authenticator.reviews
    for _ in range(20):
        _still_works(harness)
    assert harness.authenticator.reviews == before
