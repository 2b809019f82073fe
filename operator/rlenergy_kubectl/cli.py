"""``kubectl-rlenergy`` command line: ``kubectl rlenergy status|smoke``.

* ``status POLICY``: one policy in detail: conditions, job totals (saving, throughput ratio,
  step accounting), per-phase clocks, plan, throughput ratio against the threshold, saving and
  energy per valid token, and per-node health from the policy's ``RLEnergyNodeReport`` objects.
* ``status``: one summary row per policy of the namespace (``-A``: every namespace).
* ``smoke``: the smoke test (``rlenergy_kubectl.smoke``): a policy and a one-GPU pod that
  signals phases through the SDK, until a node report, a lock and a saving show, then removed.

``-o json`` prints the objects (``status``: each policy with its node reports) or the smoke
result as one JSON object instead of the tables.

Exit codes: 0 shown (smoke: passed); 1 a read or write failed (the message on stderr says what
was searched and what to do: no such policy, CRDs not installed, API server unreachable,
forbidden), or the smoke test did not see all three within its timeout; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

from rich.console import Console

from rlenergy_kubectl import kube, smoke, view

WIDTH_WITHOUT_TERMINAL = 200
"""Columns when stdout is not a terminal and ``$COLUMNS`` is unset (pipes, tests)."""
POLL_S = 2.0
"""How often ``smoke`` reads the policy status, s."""
AGENT_WAIT_S = 120.0
"""How long ``smoke`` waits for the operator to create the node-agent DaemonSet, s."""
CLEANUP_WAIT_S = 90.0
"""How long ``smoke`` waits for its policy's finalizer (clocks reset) when it cleans up, s."""


def _connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (default: the current context)")
    p.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="output format"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubectl rlenergy",
        description="Show what the rl-energy operator chose and measured.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = sub.add_parser(
        "status",
        help="per-phase clocks, savings, throughput ratio and per-node health",
        description=(
            "With POLICY: that policy in detail. Without: one row per policy of the namespace."
        ),
    )
    status.add_argument("policy", nargs="?", help="RLEnergyPolicy name (default: all)")
    scope = status.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", help="namespace (default: the context's namespace, else default)"
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="policies of every namespace"
    )
    _connection_args(status)
    sm = sub.add_parser(
        "smoke",
        help="signal a few phases from a one-GPU pod: see a report, a lock and a saving",
        description=(
            "Apply a policy and a one-GPU pod that signals RL phases through the SDK, wait until "
            "the policy status shows a node report, a locked clock and a saving, print them and "
            "remove what it made."
        ),
    )
    sm.add_argument(
        "-n", "--namespace", default=smoke.NAMESPACE,
        help=f"namespace (default {smoke.NAMESPACE}; created if missing, deleted after if so)",
    )  # fmt: skip
    sm.add_argument(
        "--image", help="image with the rlenergy SDK (default: the node-agent DaemonSet's image)"
    )
    sm.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for all three (default 300)"
    )
    sm.add_argument("--keep", action="store_true", help="leave the policy and the pod in place")
    _connection_args(sm)
    return parser


def _console() -> Console:
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=WIDTH_WITHOUT_TERMINAL)


def status(args: argparse.Namespace, out: Console) -> int:
    """Run ``status``; raises ``kube.PluginError`` on read failures."""
    cluster = kube.connect(args.kubeconfig, args.context)
    namespace = None if args.all_namespaces else (args.namespace or cluster.namespace)
    if args.policy is not None:
        assert namespace is not None  # -A with a name is refused by main()
        obj = kube.get_policy(cluster, namespace, args.policy)
        reports = kube.list_node_reports(cluster, namespace).get(args.policy, [])
        if args.output == "json":
            print(json.dumps({"policy": obj, "nodeReports": reports}, indent=2))
            return 0
        out.print(view.render_policy(view.parse_policy(obj), view.parse_reports(reports)))
        return 0
    policies = kube.list_policies(cluster, namespace)
    if args.output == "json":
        items = []
        for obj in policies:
            ns, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
            reports = kube.list_node_reports(cluster, ns).get(name, [])
            items.append({"policy": obj, "nodeReports": reports})
        print(json.dumps({"items": items}, indent=2))
        return 0
    if not policies:
        where = "any namespace" if namespace is None else f'namespace "{namespace}"'
        out.print(f"No RLEnergyPolicy found in {where} (context {cluster.context}).")
        return 0
    by_ns: dict[str, dict[str, list[dict[str, object]]]] = {}
    rows = []
    for obj in policies:
        pv = view.parse_policy(obj)
        if pv.namespace not in by_ns:
            by_ns[pv.namespace] = kube.list_node_reports(cluster, pv.namespace)
        rows.append((pv, view.parse_reports(by_ns[pv.namespace].get(pv.name, []))))
    out.print(view.summary_table(rows))
    return 0


def _smoke_setup(args: argparse.Namespace, cluster: kube.Cluster) -> tuple[str, bool]:
    """Apply the policy, wait for the agent DaemonSet, start the pod; (image, namespace made)."""
    agent = kube.agent_settings(cluster)
    created = kube.ensure_namespace(
        cluster, args.namespace, smoke.namespace_labels(bool(agent and agent.host_network))
    )
    kube.apply_policy(cluster, smoke.policy(args.namespace))
    deadline = time.monotonic() + AGENT_WAIT_S
    while agent is None and time.monotonic() < deadline:
        time.sleep(POLL_S)  # the operator creates the DaemonSet with the first policy
        agent = kube.agent_settings(cluster)
        if created and agent is not None and agent.host_network:
            kube.label_namespace(cluster, args.namespace, smoke.namespace_labels(True))
    if agent is None and args.image is None:
        raise kube.PluginError(
            f"no node-agent DaemonSet ({kube.AGENT_SELECTOR}) {AGENT_WAIT_S:.0f} s after the "
            "smoke policy was applied: is the operator running? (kubectl get pods -n "
            "rl-energy-system); or give --image"
        )
    image = args.image or (agent.image if agent else smoke.DEFAULT_IMAGE)
    if kube.read_pod(cluster, args.namespace, smoke.POD) is not None:
        kube.delete(cluster, "pod", args.namespace, smoke.POD)
        _wait(lambda: kube.read_pod(cluster, args.namespace, smoke.POD) is None, 60.0)
    kube.create_pod(
        cluster,
        smoke.pod(
            args.namespace,
            image,
            agent_port=(agent.tls_port if agent and agent.tls_port else 9403),
            audience=agent.audience if agent else "rlenergy-agent",
            host_network=bool(agent and agent.host_network),
        ),
    )
    return image, created


def _wait(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def run_smoke(args: argparse.Namespace, out: Console) -> int:
    """Run ``smoke``; raises ``kube.PluginError`` on read or write failures."""
    cluster = kube.connect(args.kubeconfig, args.context)
    t0 = time.monotonic()
    image, created = _smoke_setup(args, cluster)
    ns = args.namespace
    result = smoke.evaluate(smoke.policy(ns), [])
    failed = ""
    try:
        while time.monotonic() - t0 < args.timeout:
            time.sleep(POLL_S)
            obj = kube.get_policy(cluster, ns, smoke.POLICY)
            reports = kube.list_node_reports(cluster, ns).get(smoke.POLICY, [])
            result = smoke.evaluate(obj, reports)
            if result.ok:
                break
            pod = kube.read_pod(cluster, ns, smoke.POD) or {}
            if (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                failed = kube.pod_log_tail(cluster, ns, smoke.POD)
                break
    finally:
        if not args.keep:
            kube.delete(cluster, "pod", ns, smoke.POD)
            kube.delete(cluster, "policy", ns, smoke.POLICY)
            _wait(lambda: not kube.policy_exists(cluster, ns, smoke.POLICY), CLEANUP_WAIT_S)
            if created:
                kube.delete(cluster, "namespace", "", ns)
    elapsed = time.monotonic() - t0
    if args.output == "json":
        doc = smoke.to_json(result, namespace=ns, elapsed_s=elapsed, image=image)
        doc["podLog"] = failed
        print(json.dumps(doc, indent=2))
    else:
        out.print(
            smoke.render(result, namespace=ns, elapsed_s=elapsed), highlight=False, markup=False
        )
        if failed:
            out.print(
                f"the smoke pod ended early; its log:\n{failed}", highlight=False, markup=False
            )
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kubectl-rlenergy``; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "status" and args.policy is not None and args.all_namespaces:
        parser.error("a policy name needs one namespace: use -n NAMESPACE, not -A")
    try:
        if args.command == "smoke":
            return run_smoke(args, _console())
        return status(args, _console())
    except kube.PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
