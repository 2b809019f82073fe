"""The kubelet PodResources client as real kubelets need it, against a real gRPC server.

We test, each with the fake kubelet (``podmap.serve_fake_kubelet``, the real protocol over a
Unix socket in tmp): a reply over gRPC's 4 MiB default is received; a reply over the client's
limit and an UNAVAILABLE kubelet are counted by code, held (the last listing stays) and shown
in the node report's ``PodResourcesListed`` condition and the metrics; a kubelet restarted
on a new socket file is listed at the next pass (a new channel, no reconnect backoff); an
absent socket is waited for, by the client and by the agent ``build`` makes; the listing's age
bounds what it may do (fresh: attribute; stale: governed pods only; expired: locks reset, the
pods kept); neither one empty reply nor one failed call resets a GPU; a device listed under a
finished pod and its successor is booked once and the finished pod keeps no lock. Without the
fake kubelet, on a real Unix socket: a socket whose server is gone (connection refused) counts
as UNAVAILABLE, and one that accepts but never answers as DEADLINE_EXCEEDED within the call's
deadline; both keep the last listing and leave no channel behind.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
import pytest
from agent_support import LOCKED_PLAN as PLAN
from agent_support import DriverFactory, standin_agent
from rlenergy_agent import identity, metrics, podlife, podmap, pods, service

from rlenergy.api import node as api_node

POD_A = service.PodRef("team-a", "trainer-0", "uid-a")
POD_B = service.PodRef("team-b", "rollout-0", "uid-b")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _caller(pod: service.PodRef) -> identity.Caller:
    return identity.Caller(pod.namespace, pod.name, pod.uid, "node-1", "sa")


def _listed_condition(agent: service.Agent) -> api_node.NodeCondition:
    (cond,) = [c for c in agent.report().conditions if c.type == "PodResourcesListed"]
    return cond


class Kubelet:
    """A fake kubelet on ``sock`` that can fail, restart (a new socket file) and change."""

    def __init__(self, sock: str, alloc: dict[tuple[str, str], dict[str, list[str]]]) -> None:
        self.sock = sock
        self.alloc = alloc
        self.failure: tuple[Any, str] | None = None
        self.calls = 0
        self.server: Any = None

    def _listing(self) -> Any:
        self.calls += 1
        return self.alloc

    def start(self) -> Kubelet:
        self.server = podmap.serve_fake_kubelet(self.sock, self._listing, fail=lambda: self.failure)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(None).wait()
            self.server = None
        if os.path.exists(self.sock):
            os.unlink(self.sock)


@pytest.fixture
def kubelet(short_tmp: Path) -> Any:
    made: list[Kubelet] = []

    def make(alloc: dict[tuple[str, str], dict[str, list[str]]]) -> Kubelet:
        k = Kubelet(str(short_tmp / "kubelet.sock"), alloc).start()
        made.append(k)
        return k

    yield make
    for k in made:
        k.stop()


def test_a_reply_over_grpcs_4_mib_default_is_received(kubelet: Callable[..., Kubelet]) -> None:
    """4,000 pods with long names: a 5.6 MB reply (a busy node); gRPC's default fails it."""
    alloc = {
        ("team-a", f"pod-{i:05d}-" + "x" * 200): {"nvidia.com/gpu": [f"GPU-{i:05d}-" + "y" * 1200]}
        for i in range(4000)
    }
    k = kubelet(alloc)
    client = podmap.PodResourcesClient(k.sock)
    try:
        listed = client.refresh()
        assert len(listed) == 4000 and client.listings == 1 and not client.errors
        assert podmap.MAX_RECEIVE_BYTES >= 16 * 1024 * 1024
    finally:
        client.close()


def test_resource_exhausted_and_unavailable_are_counted_held_and_reported(
    kubelet: Callable[..., Kubelet], make_driver: DriverFactory
) -> None:
    drv = make_driver(2)
    clock = Clock()
    k = kubelet({("team-a", "trainer-0"): {"nvidia.com/gpu": [drv.uuids[0]]}})
    client = podmap.PodResourcesClient(k.sock, clock=clock, max_receive_bytes=64 * 1024)
    agent = standin_agent({}, PLAN, lambda: drv.virtual_s)
    agent.podmap = client
    try:
        client.keep_fresh()
        assert client.state().status == "Fresh" and client.listings == 1
        # a reply over the client's limit: RESOURCE_EXHAUSTED, for real
        k.alloc[("team-a", "big")] = {"nvidia.com/gpu": ["GPU-" + "z" * 100_000]}
        client.keep_fresh()
        assert client.errors == {"RESOURCE_EXHAUSTED": 1}
        assert client.last_error == "RESOURCE_EXHAUSTED"
        assert client.devices_of(POD_A) == (drv.uuids[0],)  # the last listing is held
        k.failure = (grpc.StatusCode.UNAVAILABLE, "kubelet busy")
        clock.t += 20  # past the hold bound
        client.keep_fresh()
        assert client.errors == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 1}
        cond = _listed_condition(agent)
        assert (cond.type, cond.status, cond.reason) == (
            "PodResourcesListed",
            "False",
            "Unavailable",
        )
        assert "kubelet busy" in cond.message and "20 s ago" in cond.message
        text = metrics.render(agent).decode()
        assert (
            'rlenergy_agent_podresources_errors_total{code="RESOURCE_EXHAUSTED",node="node-1"} 1.0'
            in text
        )
        assert (
            'rlenergy_agent_podresources_errors_total{code="UNAVAILABLE",node="node-1"} 1.0' in text
        )
        assert (
            'rlenergy_agent_podresources_listing_state{error="UNAVAILABLE",node="node-1",'
            'state="Stale"} 1.0' in text
        )
        assert 'rlenergy_agent_podresources_listing_age_seconds{node="node-1"} 20.0' in text
        k.failure = None
        del k.alloc[("team-a", "big")]
        client.keep_fresh()
        cond = _listed_condition(agent)
        assert (cond.status, cond.reason) == ("True", "Fresh")
    finally:
        client.close()


def test_a_restarted_kubelet_is_listed_at_the_next_pass(
    kubelet: Callable[..., Kubelet],
) -> None:
    """The kubelet restarts on a new socket file: the client makes a new channel at once.

    Before the restart the old channel failed several times, so gRPC's reconnect backoff
    (1 s, growing) would hold a reused channel in TRANSIENT_FAILURE past the restart.
    """
    alloc = {("team-a", "trainer-0"): {"nvidia.com/gpu": ["GPU-a"]}}
    k = kubelet(alloc)
    client = podmap.PodResourcesClient(k.sock, timeout_s=1.0)
    try:
        client.keep_fresh()
        assert client.listings == 1 and client.channels == 1
        inode = os.stat(k.sock).st_ino
        k.stop()
        for _ in range(3):
            client.keep_fresh()  # no socket
        assert client.errors.get("SocketMissing", 0) == 3
        # the kubelet comes back with the socket recreated (an inode of its own)
        k.alloc[("team-a", "trainer-1")] = {"nvidia.com/gpu": ["GPU-b"]}
        k.start()
        assert os.stat(k.sock).st_ino != inode or client.channels >= 1
        t0 = time.monotonic()
        client.keep_fresh()
        assert client.listings == 2, client.errors
        assert time.monotonic() - t0 < 0.5
        assert client.devices_of(service.PodRef("team-a", "trainer-1")) == ("GPU-b",)
        # a failed call drops the channel: the next call makes a new one, not a backoff wait
        k.failure = (grpc.StatusCode.UNAVAILABLE, "restarting")
        client.keep_fresh()
        k.failure = None
        made = client.channels
        client.keep_fresh()
        assert client.listings == 3 and client.channels == made + 1
    finally:
        client.close()


def test_the_socket_is_waited_for_not_taken_for_no_pods(
    short_tmp: Path, make_driver: DriverFactory
) -> None:
    drv = make_driver(2)
    sock = str(short_tmp / "kubelet.sock")
    client = podmap.PodResourcesClient(sock)
    agent = standin_agent({}, PLAN, lambda: drv.virtual_s)
    agent.podmap = client
    try:
        client.keep_fresh()
        st = client.state()
        assert (st.status, st.age_s, st.error) == ("Waiting", None, "SocketMissing")
        with pytest.raises(identity.AuthError, match="never listed") as info:
            identity.authorize(agent, _caller(POD_A))
        assert info.value.status == 503  # retry: not "holds no GPU"
        k = Kubelet(sock, {("team-a", "trainer-0"): {"nvidia.com/gpu": [drv.uuids[0]]}}).start()
        try:
            client.keep_fresh()  # the node loop's next pass
            assert client.state().status == "Fresh"
            pod = identity.authorize(agent, _caller(POD_A))
            assert pod == POD_A
            agent.phase(pod, "generation", 0)
            assert drv.gpu(drv.uuids[0]).locked
        finally:
            k.stop()
    finally:
        client.close()


def test_the_agent_built_before_the_kubelet_socket_exists_lists_it_later(
    short_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlenergy_agent import __main__ as main
    from rlenergy_agent import config

    sock = short_tmp / "kubelet.sock"
    settings = config.AgentSettings(
        node_name="node-1",
        backend="sim",
        kube=False,
        state_dir=tmp_path,
        podresources_socket=sock,
        sim_gpus=2,
    )
    agent, _ = main.build(settings)
    assert isinstance(agent.podmap, pods.ListedPodMap)
    uuid = sorted(agent.actuator.gpus)[0]
    k = Kubelet(str(sock), {("team-a", "trainer-0"): {"nvidia.com/gpu": [uuid]}}).start()
    try:
        agent.podmap.keep_fresh()
        assert agent.podmap.devices_of(POD_A) == (uuid,)
    finally:
        k.stop()
        agent.podmap.close()  # type: ignore[attr-defined]


def test_the_listings_age_bounds_what_it_may_do(
    kubelet: Callable[..., Kubelet], make_driver: DriverFactory
) -> None:
    """Fresh: attributes. Stale: governed pods go on, new ones wait (503). Expired: the locks
    are reset, the pods kept governed, no pod listed as ended; fresh again: signals lock anew."""
    drv = make_driver(3)
    clock = Clock()
    a, b, c = drv.uuids
    k = kubelet({("team-a", "trainer-0"): {"nvidia.com/gpu": [a, b]}})
    client = podmap.PodResourcesClient(k.sock, clock=clock, hold_after_s=10.0, reset_after_s=120.0)
    agent = standin_agent({}, PLAN, lambda: drv.virtual_s)
    agent.podmap = client
    watch = podlife.PodEndWatch(agent, clock=clock)
    try:
        client.keep_fresh()
        agent.phase(identity.authorize(agent, _caller(POD_A)), "generation", 0)
        assert drv.gpu(a).locked and drv.gpu(b).locked
        k.alloc[("team-b", "rollout-0")] = {"nvidia.com/gpu": [c]}  # listed, but not seen yet
        k.failure = (grpc.StatusCode.UNAVAILABLE, "kubelet down")
        clock.t += 11
        client.keep_fresh()
        assert client.state().status == "Stale"
        assert watch.tick() == []
        assert drv.gpu(a).locked  # held
        pod = identity.authorize(agent, _caller(POD_A))  # governed: goes on
        agent.phase(pod, "training", 0)
        with pytest.raises(identity.AuthError, match="stale") as info:
            identity.authorize(agent, _caller(POD_B))  # new: waits
        assert info.value.status == 503
        clock.t += 110
        client.keep_fresh()
        assert client.state().status == "Expired"
        assert watch.tick() == []
        assert not drv.gpu(a).locked and not drv.gpu(b).locked
        assert not agent.report().ended_pods and POD_A in agent.governed_pods()
        with pytest.raises(identity.AuthError) as info:
            identity.authorize(agent, _caller(POD_A))
        assert info.value.status == 503
        k.failure = None
        client.keep_fresh()
        watch.tick()
        agent.phase(identity.authorize(agent, _caller(POD_A)), "generation", 1)
        assert drv.gpu(a).locked and drv.gpu(b).locked
    finally:
        client.close()


def test_one_empty_reply_or_one_error_resets_nothing(
    kubelet: Callable[..., Kubelet], make_driver: DriverFactory
) -> None:
    drv = make_driver(2)
    clock = Clock()
    a, b = drv.uuids
    full = {
        ("team-a", "trainer-0"): {"nvidia.com/gpu": [a]},
        ("team-b", "rollout-0"): {"nvidia.com/gpu": [b]},
    }
    k = kubelet(dict(full))
    client = podmap.PodResourcesClient(k.sock, clock=clock)
    agent = standin_agent({}, PLAN, lambda: drv.virtual_s)
    agent.podmap = client
    watch = podlife.PodEndWatch(agent, clock=clock)
    try:
        client.keep_fresh()
        for p in (POD_A, POD_B):
            agent.phase(identity.authorize(agent, _caller(p)), "generation", 0)
        assert drv.gpu(a).locked and drv.gpu(b).locked
        k.alloc.clear()  # a restarting kubelet answers an empty list once
        client.keep_fresh()
        assert watch.tick() == []
        clock.t += 1
        k.alloc.update(full)
        client.keep_fresh()
        assert watch.tick() == []
        k.failure = (grpc.StatusCode.UNAVAILABLE, "x")
        clock.t += 1
        client.keep_fresh()
        assert watch.tick() == []
        assert drv.gpu(a).locked and drv.gpu(b).locked
        # every governed pod dropped for good, no API to ask: held up to reset_after_s
        k.failure = None
        k.alloc.clear()
        for _ in range(30):
            clock.t += 1
            client.keep_fresh()
            assert watch.tick() == []
        assert drv.gpu(a).locked and drv.gpu(b).locked
        clock.t += podmap.RESET_AFTER_S
        client.keep_fresh()
        assert sorted(watch.tick(), key=str) == [POD_A, POD_B]
        assert not drv.gpu(a).locked and not drv.gpu(b).locked
    finally:
        client.close()


def test_one_pod_dropped_is_reset_after_two_listings_and_the_api_confirms_an_empty_listing(
    kubelet: Callable[..., Kubelet], make_driver: DriverFactory
) -> None:
    drv = make_driver(2)
    clock = Clock()
    a, b = drv.uuids
    k = kubelet(
        {
            ("team-a", "trainer-0"): {"nvidia.com/gpu": [a]},
            ("team-b", "rollout-0"): {"nvidia.com/gpu": [b]},
        }
    )
    client = podmap.PodResourcesClient(k.sock, clock=clock)
    agent = standin_agent({}, PLAN, lambda: drv.virtual_s)
    agent.podmap = client
    ended: set[service.PodRef] = set()
    forgotten: list[service.PodRef] = []
    watch = podlife.PodEndWatch(
        agent,
        lambda refs: {p for p in refs if p in ended},
        check_s=3.0,
        clock=clock,
        on_end=forgotten.append,
    )
    try:
        client.keep_fresh()
        for p in (POD_A, POD_B):
            agent.phase(identity.authorize(agent, _caller(p)), "generation", 0)
        del k.alloc[("team-a", "trainer-0")]
        client.keep_fresh()
        assert watch.tick() == []  # one listing: not yet
        clock.t += podlife.CONFIRM_S
        client.keep_fresh()
        assert watch.tick() == [POD_A] and forgotten == [POD_A]
        assert not drv.gpu(a).locked and drv.gpu(b).locked
        # the last governed pod dropped: the API's word resets it, without waiting
        k.alloc.clear()
        clock.t += 5
        client.keep_fresh()
        assert watch.tick() == []  # the API says it runs
        ended.add(POD_B)
        clock.t += 3
        client.keep_fresh()
        assert watch.tick() == [POD_B] and not drv.gpu(b).locked
    finally:
        client.close()


def test_a_device_listed_under_a_finished_pod_and_its_successor_is_booked_once(
    kubelet: Callable[..., Kubelet], make_driver: DriverFactory
) -> None:
    """The kubelet lists the finished pod with the device it held next to the running pod it
    was given to: until the running owner signals the device is split (shares sum to 1); once
    it does, it books the whole device; the finished pod keeps no lock."""
    drv = make_driver(1)
    (u,) = drv.uuids
    old = service.PodRef("team-a", "trainer-old", "uid-old")
    new = service.PodRef("team-a", "trainer-new", "uid-new")
    k = kubelet(
        {
            ("team-a", "trainer-old"): {"nvidia.com/gpu": [u]},
            ("team-a", "trainer-new"): {"nvidia.com/gpu": [u]},
        }
    )
    client = podmap.PodResourcesClient(k.sock)
    agent = standin_agent({}, PLAN, lambda: drv.virtual_s)
    agent.podmap = client
    ended = {old}
    watch = podlife.PodEndWatch(agent, lambda refs: {p for p in refs if p in ended})
    try:
        client.keep_fresh()
        from rlenergy_agent import shares

        listing = {(p.namespace, p.name): d for p, d in client.pods().items()}
        split = shares.shares(listing, {}, {})
        assert split[(("team-a", "trainer-old"), u)] + split[(("team-a", "trainer-new"), u)] == 1.0
        # the finished pod had locked the GPU: it is reset although still listed
        agent.phase(old, "generation", 0)
        assert drv.gpu(u).locked
        assert watch.tick() == [old] and not drv.gpu(u).locked
        agent.phase(new, "generation", 0)
        owned = shares.shares(listing, {}, {}, owners={u: ("team-a", "trainer-new")})
        assert owned[(("team-a", "trainer-new"), u)] == 1.0
        assert owned[(("team-a", "trainer-old"), u)] == 0.0
        drv.set_work([u], "generation")
        before = drv.truth_j(u)
        drv.advance(2.0)
        closed = agent.phase(new, "idle", 0).closed
        assert closed is not None and closed.energy_joules is not None
        # the GPU's whole energy of the window, booked once to its running owner
        assert closed.energy_joules == pytest.approx(drv.truth_j(u) - before, rel=1e-3)
    finally:
        client.close()


def test_a_socket_replaced_between_two_passes_gets_a_new_channel_at_once(
    kubelet: Callable[..., Kubelet],
) -> None:
    """The kubelet restarts between two passes (no failed call in between): the socket file
    has a new inode, so the next pass makes a new channel and lists on its first call."""
    k = kubelet({("team-a", "trainer-0"): {"nvidia.com/gpu": ["GPU-a"]}})
    client = podmap.PodResourcesClient(k.sock, timeout_s=1.0)
    try:
        client.keep_fresh()
        assert (client.listings, client.channels) == (1, 1)
        first = os.stat(k.sock).st_ino
        k.stop()
        holder = k.sock + ".keep"  # keeps the old inode alive: the new file gets another
        open(holder, "w").close()
        k.alloc[("team-a", "trainer-1")] = {"nvidia.com/gpu": ["GPU-b"]}
        k.start()
        assert os.stat(k.sock).st_ino != first
        client.keep_fresh()
        assert (client.listings, client.channels) == (2, 2) and not client.errors
        assert client.devices_of(service.PodRef("team-a", "trainer-1")) == ("GPU-b",)
        os.unlink(holder)
    finally:
        client.close()


def test_a_refused_and_a_silent_socket_count_as_unavailable_and_deadline_exceeded(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "kubelet.sock")
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(path)
    gone.close()  # the socket file stays, nobody listens: connection refused
    client = podmap.PodResourcesClient(path, timeout_s=0.5)
    try:
        client.keep_fresh()
        assert client.errors == {"UNAVAILABLE": 1} and client.listings == 0
        assert client.state().status == "Waiting"
        os.unlink(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.bind(path)
            silent.listen(1)  # accepted by the kernel, never answered
            t0 = time.monotonic()
            client.keep_fresh()
            took = time.monotonic() - t0
        assert client.errors == {"UNAVAILABLE": 1, "DEADLINE_EXCEEDED": 1}
        assert 0.4 <= took < 1.6, took  # the call's deadline, not the wait's extra second
        assert client.last_error == "DEADLINE_EXCEEDED" and client.listings == 0
    finally:
        client.close()
