"""Tenants on one node: signals bound to the serving policy, bounded fields, bounded state.

We test these aspects: a pod the serving policy does not select is refused (403) once a
discovery begun after its first signal has not selected it either (503 until then), and a pod
that had just started is served on its first signal, the node loop woken to discover it; a
stopping agent, one that has not yet discovered its policy, or one whose discovery missed a pod it
governs answers 503 (retry) instead; another tenant's policy selecting a co-located pod of its
own leaves the governed job's policy, locks and signals alone; extreme numbers and far steps are refused; phase names,
metric series and per-pod energy stay bounded; replica holders cannot lock a shared GPU; report
names are hashed.

Every test talks to the agent's real signal server (``server.SignalServer`` on a Unix socket)
over the stand-in NVML, with tokens a fake TokenReview binds to pods (``FakeReviews``). Raw
HTTP is sent where the SDK would refuse the body itself (numbers it cannot produce).
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_support import LOCKED_PLAN, DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import metrics, nodeloop, server, service, state

from rlenergy.api import selector

TEAM_A = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
TEAM_A_ROLLOUT = service.PodRef("team-a", "rollout-0", "22222222-3333-4444-5555-666666666666")
TEAM_B = service.PodRef("team-b", "spoiler-0", "66666666-7777-8888-9999-000000000000")


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=10)
        self._path = str(path)

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(self._path)
        self.sock = s


def post(sock: Path, path: str, token: str, body: str | bytes) -> tuple[int, dict[str, Any]]:
    """POST raw ``body`` to the agent; returns (status, JSON answer)."""
    conn = _Unix(sock)
    try:
        data = body.encode() if isinstance(body, str) else body
        conn.request(
            "POST",
            path,
            body=data,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


class _Finder:
    """``kube.PolicyDiscovery`` on fixed labels: team-a's policy selects ``app=rl``."""

    def __init__(self, labels: dict[tuple[str, str], dict[str, str]]) -> None:
        self.labels = labels

    def discover(self, gpu_pods: Any) -> selector.Discovery:
        pods = [selector.PodLabels(ns, n, self.labels.get((ns, n), {})) for ns, n in gpu_pods]
        pol = selector.PolicySelector(
            selector.PolicyRef("team-a", "pol"), {"matchLabels": {"app": "rl"}}
        )
        return selector.discover(pods, [pol])


@pytest.fixture
def node(make_driver: DriverFactory, short_tmp: Path) -> Iterator[tuple[Any, ...]]:
    """Four GPUs: team-a's trainer 0-1, team-a's rollout worker 2, team-b's pod 3."""
    drv = make_driver(4)
    u = list(drv.uuids)
    pods = {TEAM_A: u[:2], TEAM_A_ROLLOUT: [u[2]], TEAM_B: [u[3]]}
    agent = standin_agent(pods, LOCKED_PLAN, lambda: drv.virtual_s)
    reviews = FakeReviews()
    sock = short_tmp / "agent.sock"
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        yield drv, agent, reviews, sock
    finally:
        srv.stop()


@pytest.fixture(autouse=True)
def _short_miss_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """No node loop runs here (but in the test that starts one): a miss waits 0.05 s, not 3."""
    monkeypatch.setattr(state, "MISS_WAIT_S", 0.05)


def _discover(agent: service.Agent) -> None:
    labels = {("team-a", "trainer-0"): {"app": "rl"}, ("team-a", "rollout-0"): {"app": "rl"}}
    found = nodeloop.rediscover(_Finder(labels), agent, None)  # type: ignore[arg-type]
    assert found is not None and found.reason == "Matched"


def test_a_pod_the_policy_does_not_select_cannot_dispatch_or_signal(
    node: tuple[Any, ...],
) -> None:
    drv, agent, reviews, sock = node
    _discover(agent)
    spoiler = reviews.issue(TEAM_B)
    dispatch = {"step": 5, "activeWorkers": 2, "nextStepWorkers": 4000}
    status, answer = post(sock, "/v1/rollout", spoiler, json.dumps(dispatch))
    assert status == 503 and "discovering again" in answer["error"], answer
    assert agent.discovery_due and agent.loop_wake.is_set()  # the node loop looks again
    assert agent.dispatch is None and agent.report().rollout is None
    _discover(agent)  # the discovery that may have been running at the miss
    assert post(sock, "/v1/rollout", spoiler, json.dumps(dispatch))[0] == 503
    _discover(agent)  # one begun after the miss: still not selected, refused for good
    status, answer = post(sock, "/v1/rollout", spoiler, json.dumps(dispatch))
    assert status == 403, answer
    assert "team-b/spoiler-0 is not selected" in answer["error"]
    assert agent.dispatch is None and agent.report().rollout is None
    status, answer = post(sock, "/v1/phase", spoiler, '{"phase": "generation", "step": 0}')
    assert status == 403, answer
    assert agent.actuator.controls[drv.uuids[3]].applied_mhz is None
    # team-a's own dispatcher and trainer are served
    own = reviews.issue(TEAM_A)
    status, _ = post(sock, "/v1/rollout", own, json.dumps({**dispatch, "nextStepWorkers": 2}))
    assert status == 200
    status, _ = post(sock, "/v1/phase", own, '{"phase": "generation", "step": 5}')
    assert status == 200
    assert agent.actuator.controls[drv.uuids[0]].applied_mhz == 1395


def test_no_policy_governing_the_node_refuses_every_pod(node: tuple[Any, ...]) -> None:
    _drv, agent, reviews, sock = node
    found = nodeloop.rediscover(_Finder({}), agent, None)  # type: ignore[arg-type]
    assert found is not None and found.reason == "NoMatch"
    own = reviews.issue(TEAM_A)
    assert post(sock, "/v1/phase", own, '{"phase":"idle","step":0}')[0] == 503
    for _ in range(2):
        nodeloop.rediscover(_Finder({}), agent, None)  # type: ignore[arg-type]
    status, answer = post(sock, "/v1/phase", own, '{"phase":"idle","step":0}')
    assert status == 403, answer


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/phase", '{"phase": "generation", "step": 18446744073709551617}'),
        ("/v1/phase", '{"phase": "generation", "step": 4611686018427387904}'),
        ("/v1/park", '{"step": 4611686018427387904}'),
        ("/v1/rollout", '{"step": 4611686018427387904, "activeWorkers": 1}'),
        ("/v1/rollout", '{"step": 1, "activeWorkers": 1, "nextStepWorkers": 1e309}'),
        ("/v1/rollout", '{"step": 1, "activeWorkers": 100000}'),
        (
            "/v1/rollout",
            '{"step": 1, "activeWorkers": 1, "reloadedExperts": [18446744073709551617]}',
        ),
        ("/v1/rollout", '{"step": 1, "activeWorkers": 1, "workerPods": ["' + "x" * 400 + '"]}'),
        ("/v1/progress", '{"total": 1e309}'),
        ("/v1/progress", '{"total": NaN}'),
        ("/v1/progress", '{"amount": 1, "inFlight": 18446744073709551617}'),
        (
            "/v1/step",
            '{"step": 1, "workload": {"samples": 1, "responseTokens": 1, "promptTokens": 1, '
            '"validTokens": 1e309, "meanContextTokens": 1}}',
        ),
        (
            "/v1/step",
            '{"step": 1, "workload": {"samples": 1, "responseTokens": -Infinity, '
            '"promptTokens": 1, "validTokens": 1, "meanContextTokens": 1}}',
        ),
    ],
)
def test_extreme_numbers_are_refused(node: tuple[Any, ...], path: str, body: str) -> None:
    _drv, agent, reviews, sock = node
    status, answer = post(sock, path, reviews.issue(TEAM_A), body)
    assert status == 400, answer
    assert agent.valid_tokens_total == 0.0 and agent.dispatch is None
    assert agent.report().model_dump_json()  # the report stays valid


def test_a_step_far_past_the_newest_is_refused(node: tuple[Any, ...]) -> None:
    drv, agent, reviews, sock = node
    token = reviews.issue(TEAM_A)
    assert post(sock, "/v1/phase", token, '{"phase": "generation", "step": 3}')[0] == 200
    far = 3 + state.STEP_WINDOW + 1
    for path, body in [
        ("/v1/phase", f'{{"phase": "training", "step": {far}}}'),
        ("/v1/park", f'{{"step": {far}}}'),
        ("/v1/rollout", f'{{"step": {far}, "activeWorkers": 1}}'),
    ]:
        status, answer = post(sock, path, token, body)
        assert status == 409, (path, answer)
        assert f"more than {state.STEP_WINDOW} steps past the newest step 3" in answer["error"]
    assert not agent.parked and agent.dispatch is None
    near = 3 + state.STEP_WINDOW
    assert post(sock, "/v1/phase", token, f'{{"phase": "training", "step": {near}}}')[0] == 200
    assert agent.actuator.controls[drv.uuids[0]].applied_mhz == 1755


def test_phase_names_come_from_the_plan_and_series_stay_bounded(node: tuple[Any, ...]) -> None:
    _drv, agent, reviews, sock = node
    token = reviews.issue(TEAM_A)
    assert post(sock, "/v1/phase", token, '{"phase": "generation", "step": 0}')[0] == 200
    before = len(metrics.render(agent))
    refused = 0
    for i in range(5000):
        name = f"p{i:04d}-" + "x" * 240
        status, answer = post(sock, "/v1/phase", token, json.dumps({"phase": name, "step": 0}))
        refused += status == 400
    assert refused == 5000
    assert "not a phase of the policy's plan" in answer["error"]
    assert post(sock, "/v1/phase", token, '{"phase": "training", "step": 0}')[0] == 200
    assert post(sock, "/v1/phase", token, '{"phase": "idle", "step": 1}')[0] == 200
    after = metrics.render(agent)
    series = [ln for ln in after.decode().splitlines() if ln.startswith("rlenergy_agent_gpu_phase")]
    phases = {ln.split('phase="')[1].split('"')[0] for ln in series if 'phase="' in ln}
    assert phases <= {"generation", "training", "idle"}
    assert len(after) < before + 4096
    report = agent.report()
    assert {w.phase for s in report.steps for w in s.phases} <= {"generation", "training"}
    assert len(report.model_dump_json()) < 64 * 1024


def test_phase_counters_fold_names_past_the_cap(
    make_driver: DriverFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    drv = make_driver(1)
    agent = standin_agent({TEAM_A: list(drv.uuids)}, LOCKED_PLAN, lambda: drv.virtual_s)
    monkeypatch.setattr(state, "DEFAULT_PHASES", frozenset())
    plan = LOCKED_PLAN.model_copy(
        update={
            "phases": [
                LOCKED_PLAN.phases[0].model_copy(update={"phase": f"ph{i}"})
                for i in range(state.MAX_PHASE_SERIES + 10)
            ]
        }
    )
    agent.set_plan(plan)
    for i in range(state.MAX_PHASE_SERIES + 10):
        drv.advance(1.0)
        agent.phase(TEAM_A, f"ph{i}", 0)
    agent.phase(TEAM_A, "idle", 0)
    names = {p for _u, p in agent.phase_energy_j}
    assert len(names) <= state.MAX_PHASE_SERIES + 1
    assert state.OTHER_PHASE in names


def test_per_pod_energy_is_trimmed_with_the_steps(make_driver: DriverFactory) -> None:
    drv = make_driver(1)
    agent = standin_agent({TEAM_A: list(drv.uuids)}, LOCKED_PLAN, lambda: drv.virtual_s)
    for step in range(300):  # a pod that never ends its steps
        agent.phase(TEAM_A, "generation", step)
        agent.phase(TEAM_A, "training", step)
    agent.phase(TEAM_A, "idle", 300)
    assert len(agent.steps) <= state.MAX_STEPS_KEPT
    assert len(agent.pod_energy) <= state.MAX_STEPS_KEPT
    assert min(s for _p, s in agent.pod_energy) >= min(agent.steps)
    assert len(agent.idle_j) <= state.MAX_STEPS_KEPT


# ----- shared GPUs ---------------------------------------------------------------------------


@pytest.fixture
def replicas(make_driver: DriverFactory, short_tmp: Path) -> Iterator[tuple[Any, ...]]:
    """GPU 0 time-sliced: replica 0 team-a's trainer, replica 1 another pod; GPU 1 whole."""
    drv = make_driver(2)
    g0, g1 = drv.uuids
    pods = {TEAM_A: [f"{g0}::0", g1], TEAM_A_ROLLOUT: [f"{g0}::1"]}
    agent = standin_agent(pods, LOCKED_PLAN, lambda: drv.virtual_s)
    reviews = FakeReviews()
    sock = short_tmp / "agent.sock"
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        yield drv, agent, reviews, sock
    finally:
        srv.stop()


def test_a_replica_holder_cannot_park_or_lock_the_whole_gpu(replicas: tuple[Any, ...]) -> None:
    drv, agent, reviews, sock = replicas
    g0, g1 = drv.uuids
    token = reviews.issue(TEAM_A)
    status, answer = post(sock, "/v1/phase", token, '{"phase": "generation", "step": 0}')
    assert status == 200, answer
    assert answer["applied"][g0]["skipped"] == "SharedGPU"
    assert not drv.gpu(g0).locked
    assert drv.gpu(g1).locked and drv.gpu(g1).lock_max_mhz == 1395  # its whole GPU
    status, answer = post(sock, "/v1/park", token, '{"step": 0}')
    assert status == 200, answer
    assert g0 not in answer["parked"] and "shared with device(s)" in answer["applied"][g0]["error"]
    assert g0 not in agent.parked and not drv.gpu(g0).locked
    assert g1 in agent.parked  # the whole GPU is parked
    assert drv.gpu(g1).lock_max_mhz == min(agent.actuator.controls[g1].supported_mhz)


def test_a_pod_holding_every_replica_locks_and_a_new_sharer_ends_the_lock(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    (g0,) = drv.uuids
    pods: dict[service.PodRef, list[str]] = {TEAM_A: [f"{g0}::0", f"{g0}::1"]}
    agent = standin_agent(pods, LOCKED_PLAN, lambda: drv.virtual_s)
    agent.phase(TEAM_A, "generation", 0)
    assert drv.gpu(g0).locked and drv.gpu(g0).lock_max_mhz == 1395
    # the device plugin hands replica 1 to another pod: the next lock request resets instead
    pods[TEAM_A] = [f"{g0}::0"]
    pods[TEAM_A_ROLLOUT] = [f"{g0}::1"]
    agent.podmap = service.StaticPodMap(pods)
    result = agent.phase(TEAM_A, "training", 0)
    assert result.applied[g0].skipped == "SharedGPU"
    assert not drv.gpu(g0).locked


def test_parks_end_with_their_step(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    g0, g1 = drv.uuids
    agent = standin_agent({TEAM_A: [g0], TEAM_A_ROLLOUT: [g1]}, LOCKED_PLAN, lambda: drv.virtual_s)
    agent.phase(TEAM_A, "generation", 3)
    agent.park(TEAM_A_ROLLOUT, 3)
    assert g1 in agent.parked and drv.gpu(g1).locked
    agent.phase(TEAM_A, "training", 3)  # the same step: the park holds
    assert g1 in agent.parked
    agent.phase(TEAM_A, "generation", 4)  # the trainer moved on: the park of step 3 ends
    assert not agent.parked and not drv.gpu(g1).locked
    assert agent.released_gpu_seconds(g1) >= 0.0


# ----- report names ---------------------------------------------------------------------------


class _Reports:
    """The CustomObjectsApi calls of ``kube.ReportWriter``, on a dict of objects."""

    def __init__(self, objects: dict[str, dict[str, Any]]) -> None:
        self.objects = objects

    def patch_namespaced_custom_object(self, *args: Any) -> dict[str, Any]:
        from rlenergy_agent.kubeapi import ApiException

        name, body = args[4], args[5]
        if name not in self.objects:
            raise ApiException(status=404)
        obj = self.objects[name]
        for key, value in (body.get("metadata") or {}).get("labels", {}).items():
            if value is None:
                obj["metadata"]["labels"].pop(key, None)
            else:
                obj["metadata"]["labels"][key] = value
        if "spec" in body:
            obj["spec"] = body["spec"]
        return obj

    def create_namespaced_custom_object(self, *args: Any) -> dict[str, Any]:
        body = args[4]
        self.objects[body["metadata"]["name"]] = body
        return body


def test_the_report_gets_a_hashed_name_and_the_old_named_one_is_unlabelled(
    make_driver: DriverFactory,
) -> None:
    from rlenergy_agent import kube

    drv = make_driver(1)
    agent = standin_agent({TEAM_A: list(drv.uuids)}, LOCKED_PLAN, lambda: drv.virtual_s)
    old = {
        "metadata": {
            "name": "a-b-c",
            "labels": {"rlenergy.io/policy": "a", "rlenergy.io/node": "b-c"},
        },
        "spec": {},
    }
    api = _Reports({"a-b-c": old})
    kube.ReportWriter(api, "team-a", "a", "b-c").write(agent.report())
    kube.ReportWriter(api, "team-a", "a-b", "c").write(agent.report())
    names = set(api.objects)
    assert len(names) == 3  # the two pairs no longer share an object
    assert "rlenergy.io/policy" not in old["metadata"]["labels"]  # no longer listed
    assert all(
        o["metadata"]["labels"]["rlenergy.io/policy"] in ("a", "a-b")
        for n, o in api.objects.items()
        if n != "a-b-c"
    )


def test_an_unselected_caller_makes_the_node_loop_discover_at_once(node: tuple[Any, ...]) -> None:
    from rlenergy_agent import config, podlife

    _drv, agent, reviews, sock = node
    calls: list[int] = []

    class Counting(_Finder):
        def discover(self, gpu_pods: Any) -> selector.Discovery:
            calls.append(1)
            labels = {("team-a", "trainer-0"): {"app": "rl"}}
            if len(calls) > 1:  # the new pod got its labels since
                labels[("team-a", "rollout-0")] = {"app": "rl"}
            self.labels = labels
            return super().discover(gpu_pods)

    settings = config.AgentSettings(node_name="node-1", kube=False, plan_poll_s=60.0)
    loop = nodeloop.NodeLoop(settings, agent, podlife.PodEndWatch(agent), None, discover=True)
    finder = Counting({})
    loop.finder = finder  # type: ignore[assignment]
    loop._discover(0.0, finder)  # noqa: SLF001 - the first discovery, as tick makes it
    loop.close()  # no API here: discovery only (the plan watch it started ends)
    loop.writer = loop.watcher = None
    assert ("team-a", "rollout-0") not in (agent.selected or ())
    status, _ = post(sock, "/v1/phase", reviews.issue(TEAM_A_ROLLOUT), '{"phase":"idle","step":0}')
    assert status == 503 and agent.discovery_due and agent.loop_wake.is_set()
    loop.tick(1.0)  # long before the next plan poll (60 s): discovery runs because it is due
    assert len(calls) == 2 and not agent.discovery_due
    status, _ = post(sock, "/v1/phase", reviews.issue(TEAM_A_ROLLOUT), '{"phase":"idle","step":0}')
    assert status == 200


def test_a_parked_pods_next_step_goes_straight_to_the_plan_clock(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    (g0,) = drv.uuids
    agent = standin_agent({TEAM_A: [g0]}, LOCKED_PLAN, lambda: drv.virtual_s)
    agent.phase(TEAM_A, "generation", 3)
    agent.park(TEAM_A, 3)
    writes = agent.actuator.controls[g0].writes
    agent.phase(TEAM_A, "generation", 4)  # its park ends with step 3; one write: the plan's
    assert not agent.parked and drv.gpu(g0).lock_max_mhz == 1395
    assert agent.actuator.controls[g0].writes == writes + 1


def test_a_stopping_agent_answers_retry_not_forbidden(node: tuple[Any, ...]) -> None:
    drv, agent, reviews, sock = node
    _discover(agent)
    own = reviews.issue(TEAM_A)
    assert post(sock, "/v1/phase", own, '{"phase": "generation", "step": 1}')[0] == 200
    assert agent.actuator.controls[drv.uuids[0]].applied_mhz == 1395
    refused, reviewed = agent.refused, reviews.calls
    agent.stopping = True  # what the agent's SIGTERM handler sets before it resets its clocks
    for token in (own, reviews.issue(TEAM_B), "not-a-token"):
        status, answer = post(sock, "/v1/phase", token, '{"phase": "training", "step": 1}')
        assert status == 503, answer
        assert "the node agent is stopping" in answer["error"] and "retry" in answer["error"]
    assert reviews.calls == reviewed  # answered before any TokenReview
    assert agent.actuator.controls[drv.uuids[0]].applied_mhz == 1395  # not the training clock
    assert agent.refused == refused


def test_signals_wait_for_the_first_policy_discovery(node: tuple[Any, ...]) -> None:
    drv, agent, reviews, sock = node
    agent.discovery_pending = True  # the agent discovers its policy (main), none found yet
    own = reviews.issue(TEAM_A)
    status, answer = post(sock, "/v1/phase", own, '{"phase": "generation", "step": 1}')
    assert status == 503 and "not yet discovered the policy" in answer["error"], answer
    status, answer = post(sock, "/v1/phase", reviews.issue(TEAM_B), '{"phase":"idle","step":1}')
    assert status == 503, answer  # not let through while nothing is known (selected is None)
    assert agent.actuator.controls[drv.uuids[3]].applied_mhz is None
    _discover(agent)
    assert not agent.discovery_pending
    assert post(sock, "/v1/phase", own, '{"phase": "generation", "step": 1}')[0] == 200
    spoiler = reviews.issue(TEAM_B)
    assert post(sock, "/v1/phase", spoiler, '{"phase":"idle","step":1}')[0] == 503
    _discover(agent)
    _discover(agent)
    assert post(sock, "/v1/phase", spoiler, '{"phase":"idle","step":1}')[0] == 403


def test_a_governed_pod_a_discovery_misses_gets_retry(node: tuple[Any, ...]) -> None:
    drv, agent, reviews, sock = node
    _discover(agent)
    own = reviews.issue(TEAM_A)
    assert post(sock, "/v1/phase", own, '{"phase": "generation", "step": 1}')[0] == 200
    # a discovery over a listing that misses the trainer (a restarted kubelet's partial list)
    found = nodeloop.rediscover(
        _Finder({("team-a", "rollout-0"): {"app": "rl"}}),
        agent,
        None,  # type: ignore[arg-type]
    )
    assert found is not None and found.reason == "Matched"
    assert ("team-a", "trainer-0") not in (agent.selected or ())
    status, answer = post(sock, "/v1/phase", own, '{"phase": "training", "step": 1}')
    assert status == 503 and "governed here" in answer["error"], answer
    assert agent.actuator.controls[drv.uuids[0]].applied_mhz == 1395  # its lock is kept
    # once its clocks are reset (the pod ended, or the node left the policy): 403
    agent.pod_gone(TEAM_A)
    status, answer = post(sock, "/v1/phase", own, '{"phase": "training", "step": 1}')
    assert status == 503 and "discovering again" in answer["error"], answer
    for _ in range(2):
        nodeloop.rediscover(
            _Finder({("team-a", "rollout-0"): {"app": "rl"}}),
            agent,
            None,  # type: ignore[arg-type]
        )
    status, answer = post(sock, "/v1/phase", own, '{"phase": "training", "step": 1}')
    assert status == 403 and "is not selected" in answer["error"], answer


class _TwoTenants(_Finder):
    """team-a's policy selects ``app=rl``; team-b's selects ``app=spoil`` in team-b."""

    def discover(self, gpu_pods: Any) -> selector.Discovery:
        pods = [selector.PodLabels(ns, n, self.labels.get((ns, n), {})) for ns, n in gpu_pods]
        return selector.discover(
            pods,
            [
                selector.PolicySelector(
                    selector.PolicyRef("team-a", "pol"), {"matchLabels": {"app": "rl"}}
                ),
                selector.PolicySelector(
                    selector.PolicyRef("team-b", "spoiler"), {"matchLabels": {"app": "spoil"}}
                ),
            ],
        )


def test_another_tenants_policy_does_not_reset_the_governed_job(node: tuple[Any, ...]) -> None:
    drv, agent, reviews, sock = node
    labels = {("team-a", "trainer-0"): {"app": "rl"}, ("team-a", "rollout-0"): {"app": "rl"}}
    first = nodeloop.rediscover(_TwoTenants(labels), agent, None)  # type: ignore[arg-type]
    assert first is not None and first.reason == "Matched"
    own = reviews.issue(TEAM_A)
    assert post(sock, "/v1/phase", own, '{"phase": "generation", "step": 1}')[0] == 200
    # team-b labels its pod on this node for a policy of its own
    labels[("team-b", "spoiler-0")] = {"app": "spoil"}
    found = nodeloop.rediscover(_TwoTenants(labels), agent, first)  # type: ignore[arg-type]
    assert found is not None and found.reason == "Matched"
    assert found.policy == selector.PolicyRef("team-a", "pol")
    assert found.ungoverned == ("team-b/spoiler-0",)
    assert agent.discovery == ("Matched", "team-a/pol")
    # team-a's job keeps its lock and goes on signalling; team-b's pod is not governed here
    assert agent.actuator.controls[drv.uuids[0]].applied_mhz == 1395
    assert post(sock, "/v1/phase", own, '{"phase": "training", "step": 1}')[0] == 200
    spoiler = reviews.issue(TEAM_B)
    assert post(sock, "/v1/phase", spoiler, '{"phase":"idle","step":1}')[0] == 503
    last = found
    for _ in range(2):
        again_found = nodeloop.rediscover(_TwoTenants(labels), agent, last)  # type: ignore[arg-type]
        assert again_found is not None
        last = again_found
    status, answer = post(sock, "/v1/phase", spoiler, '{"phase":"idle","step":1}')
    assert status == 403 and "not selected" in answer["error"], answer
    # a fresh agent (no current policy) still sees the conflict and governs none
    again = nodeloop.rediscover(_TwoTenants(labels), agent, None)  # type: ignore[arg-type]
    assert again is not None and again.reason == "Conflict"


def test_a_pod_that_just_started_is_served_on_its_first_signal(
    node: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its signal arrives before the discovery that selects it: the node loop is woken, the
    signal waits for that discovery and is served (a re-created pod's first signal)."""
    import threading

    monkeypatch.setattr(state, "MISS_WAIT_S", 10.0)
    drv, agent, reviews, sock = node
    labels = {("team-a", "rollout-0"): {"app": "rl"}}
    _found = nodeloop.rediscover(_Finder(dict(labels)), agent, None)  # type: ignore[arg-type]
    assert ("team-a", "trainer-0") not in (agent.selected or ())
    labels[("team-a", "trainer-0")] = {"app": "rl"}  # the API now lists the new pod's labels
    stop = threading.Event()
    passes: list[float] = []

    def loop() -> None:  # the node loop: a discovery each time a miss wakes it
        while not stop.is_set():
            if agent.loop_wake.wait(0.05):
                agent.loop_wake.clear()
                nodeloop.rediscover(_Finder(labels), agent, None)  # type: ignore[arg-type]
                passes.append(1.0)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        status, answer = post(
            sock, "/v1/phase", reviews.issue(TEAM_A), '{"phase": "generation", "step": 1}'
        )
    finally:
        stop.set()
        t.join()
    assert status == 200, answer
    assert passes  # woken by the miss, not by its interval
    assert agent.actuator.controls[drv.uuids[0]].applied_mhz == 1395
    assert not agent.selection_misses
