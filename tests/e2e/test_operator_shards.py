"""Operator shards on the real control plane, with kopf's real peering.

We test these aspects:
* two shards (``RLENERGY_OPERATOR_SHARDS=2``) split two policies between them: each shard
  reconciles its own policy (``observedGeneration``, the first plan) and never the other's;
* a node report, labelled by the agent's own report writer with its policy's bucket, reaches
  only the shard of its policy (each shard's report watch selects its buckets);
* the hand-over from one operator to two shards: while the unsharded operator's peer is alive
  in its KopfPeering, both shards wait (their handlers retry with "shard hand-over: waiting")
  and a spec change is reconciled by the unsharded operator alone; once it exits (kopf removes
  its peer), each shard serves its policy.

The operators run as subprocesses (``python -m rlenergy_operator --namespace=<ns>``) with kopf
peering in the test's namespace (KopfPeering objects of a name only this test uses); nothing
dials anything but 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from e2e_support import get_json, wait_until
from rlenergy_agent import kube as agent_kube
from rlenergy_dev.devcluster import DevCluster
from rlenergy_operator import shards

from tests import factories

ROOT = Path(__file__).resolve().parents[2]


class _Operator:
    def __init__(self, cluster: DevCluster, ns: str, peering: str, log: Path, **env: str) -> None:
        self.log = log
        full = {
            **os.environ,
            "KUBECONFIG": str(cluster.kubeconfig),
            "RLENERGY_OPERATOR_NAMESPACE": ns,
            "RLENERGY_OPERATOR_WATCH_NAMESPACES": ns,
            "RLENERGY_OPERATOR_PEERING_NAME": peering,
            "RLENERGY_OPERATOR_RECONCILE_INTERVAL_S": "1",
            "RLENERGY_OPERATOR_RETRY_DELAY_S": "1",
            "RLENERGY_OPERATOR_HANDOVER_CHECK_INTERVAL_S": "1",
            "RLENERGY_OPERATOR_RESET_DEADLINE_S": "5",
            **env,
        }
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlenergy_operator", f"--namespace={ns}"],
                env=full,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # kopf removes its peer from the peering object on exit
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def _apply(cluster: DevCluster, ns: str, body: dict[str, Any]) -> None:
    body["metadata"]["namespace"] = ns
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def _policy(name: str, warmup: int) -> dict[str, Any]:
    return {
        "apiVersion": "rlenergy.io/v1alpha1",
        "kind": "RLEnergyPolicy",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "controller": {"warmupSteps": warmup},
        },
    }


def _observed(cluster: DevCluster, ns: str, name: str) -> tuple[int, int]:
    obj = get_json(cluster, "rlep", name, "-n", ns)
    return int(obj["metadata"]["generation"]), int(
        (obj.get("status") or {}).get("observedGeneration") or 0
    )


def _reconciled(cluster: DevCluster, ns: str, name: str, generation: int) -> bool:
    return _observed(cluster, ns, name) == (generation, generation)


def _wait_reconciled(
    cluster: DevCluster, ns: str, names: list[str], generation: int, who: str, timeout: int
) -> None:
    for name in names:
        wait_until(
            lambda n=name: _reconciled(cluster, ns, n, generation),
            timeout=timeout,
            what=f"{name} generation {generation} {who}",
        )


def _finalizers(cluster: DevCluster, ns: str, name: str) -> list[str]:
    return list(get_json(cluster, "rlep", name, "-n", ns)["metadata"].get("finalizers") or [])


def _handled(log: str, ns: str, name: str) -> int:
    """How many times kopf logged ``policy_reconcile`` done for ``ns/name`` in ``log``."""
    return sum(
        1
        for line in log.splitlines()
        if f"[{ns}/{name}]" in line and "Handler 'policy_reconcile" in line and "succeeded" in line
    )


def test_two_shards_split_the_policies_and_wait_for_the_old_layout(
    dev_cluster: DevCluster, crds: None, namespace: str, tmp_path: Path
) -> None:
    ns = namespace
    dev_cluster.kubectl(
        "apply", "--server-side", "-f", str(ROOT / "crds" / "kopf.dev_peerings.yaml")
    )
    dev_cluster.wait_crds_established("kopfpeerings.kopf.dev")
    base = f"shards-{uuid.uuid4().hex[:6]}"
    layout = [shards.Layout(2, 0), shards.Layout(2, 1)]
    for name in (base, *(lay.named(base) for lay in layout)):
        _apply(
            dev_cluster,
            ns,
            {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name}},
        )
    # one policy per shard
    names = [next(f"job-{i}" for i in range(100) if lay.owns(ns, f"job-{i}")) for lay in layout]
    for name in names:
        _apply(dev_cluster, ns, _policy(name, 2))

    ops: list[_Operator] = []
    try:
        old = _Operator(
            dev_cluster, ns, base, tmp_path / "unsharded.log", RLENERGY_OPERATOR_PRIORITY="100"
        )
        ops.append(old)
        _wait_reconciled(dev_cluster, ns, names, 1, "by the unsharded operator", 90)
        new = [
            _Operator(
                dev_cluster,
                ns,
                base,
                tmp_path / f"shard-{lay.index}.log",
                RLENERGY_OPERATOR_SHARDS="2",
                RLENERGY_OPERATOR_SHARD_INDEX=str(lay.index),
                RLENERGY_OPERATOR_PRIORITY="100",
            )  # fmt: skip
            for lay in layout
        ]
        ops += new
        for op in new:
            wait_until(
                lambda o=op: (
                    "shard hand-over: waiting for the pods of another shard layout" in o.output()
                ),  # type: ignore[misc]
                timeout=90,
                what="the shard waiting for the unsharded operator",
            )
        # While the old layout lives, it alone reconciles a change.
        for name in names:
            _apply(dev_cluster, ns, _policy(name, 3))
        _wait_reconciled(dev_cluster, ns, names, 2, "by the unsharded operator", 60)
        for op in new:
            for name in names:
                assert _handled(op.output(), ns, name) == 0, op.output()[-3000:]
        # The old layout exits: each shard serves its own policy, and only it.
        old.stop()
        for op, lay in zip(new, layout, strict=True):
            wait_until(
                lambda o=op, k=lay.index: f"serving shard {k} of 2" in o.output(),  # type: ignore[misc]
                timeout=60,
                what=f"shard {lay.index} serving",
            )
        for lay, name in zip(layout, names, strict=True):  # the old layout's finalizer handed over
            own = f"rlenergy.io/reset-clocks-2-{lay.index}"
            wait_until(
                lambda n=name, f=own: _finalizers(dev_cluster, ns, n) == [f],  # type: ignore[misc]
                timeout=30,
                what=f"{name}'s finalizer {own} alone",
            )
        for name in names:
            _apply(dev_cluster, ns, _policy(name, 4))
        _wait_reconciled(dev_cluster, ns, names, 3, "by its shard", 60)
        # A node report reaches only its policy's shard: the agent labels it with the policy's
        # bucket and each shard's watch selects its buckets (the API server filters).
        api = agent_kube.load_api(str(dev_cluster.kubeconfig))
        for name in names:
            node = f"node-of-{name}"
            writer = agent_kube.ReportWriter(api, ns, name, node)
            writer.write(factories.node_report(node, policy=name))
        for op, mine in zip(new, names, strict=True):
            wait_until(
                lambda o=op, n=mine: f"ignoring the node reports of node-of-{n}" in o.output(),  # type: ignore[misc]
                timeout=30,
                what=f"the shard of {mine} reading its report",
            )
        for op, mine, theirs in ((new[0], names[0], names[1]), (new[1], names[1], names[0])):
            log = op.output()
            assert _handled(log, ns, mine) >= 1, log[-3000:]
            assert f"[{ns}/{theirs}]" not in log, log[-3000:]
            assert f"node-of-{theirs}" not in log, log[-3000:]
        for op in ops:
            assert "Traceback (most recent call last)" not in op.output(), op.output()[-3000:]
        # Each shard lifts its own finalizer once the (agent-less) reset deadline has passed.
        dev_cluster.kubectl("delete", "rlep", "--all", "-n", ns, "--timeout=60s")
    finally:
        dev_cluster.kubectl("delete", "rlep", "--all", "-n", ns, "--wait=false", check=False)
        for op in ops:
            op.stop()
