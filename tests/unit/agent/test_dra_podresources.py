"""GPUs allocated through DRA (ResourceClaims), as the kubelet's PodResources lists them.

We test these aspects: a ``List`` reply encoded by hand with the field numbers of the kubelet's
api.proto (``ContainerResources.dynamic_resources`` = 5, ``DynamicResource`` 2/3/4,
``ClaimResource`` 1-4, ``CDIDevice.name`` = 1) parses into the devices it names; a claimed device
maps to its GPU by the ``uuid`` attribute of its ResourceSlice (plain and driver-qualified),
and else by the index rule only for a driver the user named (``gpu-<N>``, ``device-<NN>``; a
MIG device name never matches); without either it attributes nothing; a pod holding GPUs both
ways (device plugin and DRA) gets the union; the node's slices are listed only while a DRA
device is held, again for an unknown device at most every ``relist_s``, and a failed listing
leaves the index rule; a second pod's signal naming another pod's DRA GPU is refused (403) like
a device-plugin GPU, and the holder's own signal is accepted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from agent_support import LOCKED_PLAN as PLAN
from agent_support import DriverFactory, standin_agent
from rlenergy_agent import dra, identity, podmap, service

DRIVER = "test-driver.cdi.k8s.io"
NVIDIA = "gpu.nvidia.com"
NODE = "node-1"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes | str) -> bytes:
    """One length-delimited field (wire type 2), encoded by hand."""
    data = payload.encode() if isinstance(payload, str) else payload
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _kubelet_reply(pod: str, namespace: str, claims: Sequence[tuple[str, str, str, str]]) -> bytes:
    """A ``ListPodResourcesResponse`` with one pod whose container holds ``claims``.

    Each claim is ``(claim_name, driver, pool, device)``; numbers from
    k8s.io/kubelet/pkg/apis/podresources/v1/api.proto.
    """
    container = _field(1, "main")
    for claim, driver, pool, device in claims:
        resource = (
            _field(1, _field(1, f"{driver}/test={device}"))  # cdi_devices { name }
            + _field(2, driver)
            + _field(3, pool)
            + _field(4, device)
        )
        dynamic = _field(2, claim) + _field(3, namespace) + _field(4, resource)
        container += _field(5, dynamic)
    pod_msg = _field(1, pod) + _field(2, namespace) + _field(3, container)
    return _field(1, pod_msg)


def _slice(driver: str, pool: str, devices: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A ``resource.k8s.io/v1`` ResourceSlice as the API server's JSON."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "spec": {
            "driver": driver,
            "nodeName": NODE,
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": n, "attributes": dict(a)} for n, a in devices.items()],
        },
    }


class Slices:
    """A slice lister counting its calls; ``fail`` makes it raise."""

    def __init__(self, slices: list[dict[str, Any]]) -> None:
        self.slices = slices
        self.calls = 0
        self.fail: Exception | None = None

    def __call__(self) -> list[dict[str, Any]]:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return self.slices


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_reply_encoded_with_the_kubelets_field_numbers_parses_into_its_claims() -> None:
    raw = _kubelet_reply("trainer-0", "team-a", [("gpus", DRIVER, NODE, "device-01")])
    resp = podmap.ListResponse.FromString(raw)
    (pod,) = resp.pod_resources
    (container,) = pod.containers
    (claim,) = container.dynamic_resources
    assert (claim.claim_name, claim.claim_namespace) == ("gpus", "team-a")
    (res,) = claim.claim_resources
    assert (res.driver_name, res.pool_name, res.device_name) == (DRIVER, NODE, "device-01")
    assert [c.name for c in res.cdi_devices] == [f"{DRIVER}/test=device-01"]


def test_uuid_attribute_plain_and_qualified_index_rule_only_when_named() -> None:
    slices = Slices(
        [
            _slice(NVIDIA, NODE, {"gpu-0": {"uuid": {"string": "GPU-aaa"}, "index": {"int": 0}}}),
            _slice("x.example.com", NODE, {"gpu-1": {"x.example.com/uuid": {"string": "GPU-bbb"}}}),
            _slice(DRIVER, NODE, {"device-02": {}}),
        ]
    )
    indices = {0: "GPU-aaa", 1: "GPU-bbb", 2: "GPU-ccc", 3: "GPU-ddd"}
    asked = [
        dra.DraDevice(NVIDIA, NODE, "gpu-0"),
        dra.DraDevice("x.example.com", NODE, "gpu-1"),
        dra.DraDevice(DRIVER, NODE, "device-02"),
        dra.DraDevice(NVIDIA, NODE, "gpu-3-mig-9-4-3"),
        dra.DraDevice("nic.example.com", NODE, "eth-3"),
    ]
    off = dra.DraResolver(slices, indices).resolve(asked)
    assert off == {asked[0]: "GPU-aaa", asked[1]: "GPU-bbb"}
    on = dra.DraResolver(slices, indices, (DRIVER, NVIDIA)).resolve(asked)
    assert on == {asked[0]: "GPU-aaa", asked[1]: "GPU-bbb", asked[2]: "GPU-ccc"}
    assert dra.index_of("gpu-3") == 3 and dra.index_of("device-07") == 7
    assert dra.index_of("gpu-0-mig-9-4-3") is None and dra.index_of("device") is None
    assert dra.parse_drivers(f" {DRIVER}, ,{NVIDIA},{DRIVER}") == (DRIVER, NVIDIA)


def test_slices_listed_only_for_dra_devices_relisted_rate_limited_failure_leaves_rule() -> None:
    clock = Clock()
    slices = Slices([_slice(NVIDIA, NODE, {"gpu-0": {"uuid": {"string": "GPU-aaa"}}})])
    r = dra.DraResolver(slices, {1: "GPU-bbb"}, (DRIVER,), clock=clock, relist_s=10.0)
    assert r.resolve([]) == {} and slices.calls == 0  # no DRA device: no API call
    gpu0 = dra.DraDevice(NVIDIA, NODE, "gpu-0")
    assert r.resolve([gpu0]) == {gpu0: "GPU-aaa"} and slices.calls == 1
    assert r.resolve([gpu0]) == {gpu0: "GPU-aaa"} and slices.calls == 1  # known: cached
    gpu5 = dra.DraDevice(NVIDIA, NODE, "gpu-5")
    assert r.resolve([gpu5]) == {} and slices.calls == 1  # unknown, but listed < 10 s ago
    clock.t += 11
    slices.slices.append(_slice(NVIDIA, "p2", {"gpu-5": {"uuid": {"string": "GPU-fff"}}}))
    r.resolve([gpu5])  # a new listing; its pool differs: still unknown under NODE
    assert slices.calls == 2
    clock.t += 11
    slices.slices[1]["spec"]["pool"]["name"] = NODE
    assert r.resolve([gpu5]) == {gpu5: "GPU-fff"} and slices.calls == 3
    slices.fail = PermissionError("403 resourceslices is forbidden")
    clock.t += dra.MAX_AGE_S
    dev1 = dra.DraDevice(DRIVER, NODE, "device-01")
    assert r.resolve([dev1]) == {dev1: "GPU-bbb"} and r.errors == 1
    assert dra.DraResolver(None, {1: "GPU-bbb"}, (DRIVER,)).resolve([dev1]) == {dev1: "GPU-bbb"}


@pytest.fixture
def kubelet(short_tmp: Path) -> Iterator[Callable[[Any], str]]:
    servers: list[Any] = []
    sock = str(short_tmp / "kubelet.sock")

    def start(alloc: Any) -> str:
        servers.append(podmap.serve_fake_kubelet(sock, lambda: alloc))
        return sock

    yield start
    for s in servers:
        s.stop(None).wait()
    if os.path.exists(sock):
        os.unlink(sock)


def test_dra_and_device_plugin_gpus_of_one_pod_are_the_union(
    kubelet: Callable[[Any], str],
) -> None:
    slices = Slices([_slice(NVIDIA, NODE, {"gpu-2": {"uuid": {"string": "GPU-ccc"}}})])
    alloc = {
        ("team-a", "both"): {
            "nvidia.com/gpu": ["GPU-aaa"],
            podmap.DYNAMIC: [f"{NVIDIA}/{NODE}/gpu-2", f"{DRIVER}/{NODE}/device-01"],
        },
        ("team-a", "nic-only"): {podmap.DYNAMIC: [f"nic.example.com/{NODE}/eth-0"]},
    }
    sock = kubelet(alloc)
    resolver = dra.DraResolver(slices, {0: "GPU-aaa", 1: "GPU-bbb", 2: "GPU-ccc"}, (DRIVER,))
    with_dra = podmap.PodResourcesClient(sock, dra_resolver=resolver)
    without = podmap.PodResourcesClient(sock)
    try:
        got = with_dra.refresh()
        assert got == {service.PodRef("team-a", "both"): ("GPU-aaa", "GPU-ccc", "GPU-bbb")}
        assert slices.calls == 1  # one listing for every DRA device of the reply
        assert without.refresh() == {service.PodRef("team-a", "both"): ("GPU-aaa",)}
    finally:
        with_dra.close()
        without.close()


def test_a_second_pods_signal_for_anothers_dra_gpu_is_refused(
    kubelet: Callable[[Any], str], make_driver: DriverFactory
) -> None:
    drv = make_driver(4)
    holder = service.PodRef("team-a", "dra-trainer", "uid-a")
    other = service.PodRef("team-b", "intruder", "uid-b")
    sock = kubelet(
        {
            (holder.namespace, holder.name): {podmap.DYNAMIC: [f"{DRIVER}/{NODE}/device-01"]},
            (other.namespace, other.name): {"nvidia.com/gpu": [drv.uuids[3]]},
        }
    )
    indices = dict(enumerate(drv.uuids))
    client = podmap.PodResourcesClient(sock, dra_resolver=dra.DraResolver(None, indices, (DRIVER,)))
    agent = standin_agent({}, PLAN, lambda: drv.virtual_s, node=NODE)
    agent.podmap = client
    try:
        client.keep_fresh()
        mine = identity.Caller(holder.namespace, holder.name, holder.uid, NODE, "sa")
        assert identity.authorize(agent, mine, [drv.uuids[1]]) == holder
        theirs = identity.Caller(other.namespace, other.name, other.uid, NODE, "sa")
        with pytest.raises(identity.AuthError) as refused:
            identity.authorize(agent, theirs, [drv.uuids[1]])
        assert refused.value.status == 403
        assert identity.authorize(agent, theirs, [drv.uuids[3]]) == other
    finally:
        client.close()
