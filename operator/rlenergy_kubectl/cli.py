"""``kubectl-rlenergy`` command line: ``kubectl rlenergy status [POLICY] [-n NS | -A]``.

* ``status POLICY``: one policy in detail: conditions, job totals (saving, throughput ratio,
  step accounting), per-phase clocks, plan, throughput ratio against the threshold, saving and
  energy per valid token, and per-node health from the policy's ``RLEnergyNodeReport`` objects.
* ``status``: one summary row per policy of the namespace (``-A``: every namespace).

Exit codes: 0 shown; 1 a read failed (the message on stderr says what was searched and what to
do: no such policy, CRDs not installed, API server unreachable, forbidden); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rich.console import Console

from rlenergy_kubectl import kube, view

WIDTH_WITHOUT_TERMINAL = 200
"""Columns when stdout is not a terminal and ``$COLUMNS`` is unset (pipes, tests)."""


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
    status.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)"
    )
    status.add_argument("--context", help="kubeconfig context (default: the current context)")
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
        out.print(view.render_policy(view.parse_policy(obj), view.parse_reports(reports)))
        return 0
    policies = kube.list_policies(cluster, namespace)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kubectl-rlenergy``; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "status" and args.policy is not None and args.all_namespaces:
        parser.error("a policy name needs one namespace: use -n NAMESPACE, not -A")
    try:
        return status(args, _console())
    except kube.PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
