"""The operator's Prometheus metrics (``/metrics`` on ``metrics_port``; the chart's 8081).

The only operator module importing ``prometheus_client``. One registry per process; the handlers
call the small recorders below (no metric objects in handler code):

* ``rlenergy_operator_policy_agents{namespace, policy, state}``: node agents serving the policy
  (``state="reporting"``: a node report exists; ``"ready"``: it measures energy on some GPU);
* ``rlenergy_operator_agents{state}``: the agent DaemonSet's ``desired`` and ``ready`` pods, and
  ``rlenergy_operator_gpu_nodes_without_agent`` (``coverage``: GPU nodes without the GPU label,
  or that the agents cannot schedule on);
* ``rlenergy_operator_reconcile_errors_total{handler}``: handler passes that failed;
* ``rlenergy_operator_policy_status_lag_steps{namespace, policy}``: newest step a node reported
  minus the step the status accounts through; ``..._last_pass_timestamp_seconds``: when the
  job loop last finished a pass (alert on ``time() - x``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
POLICY_AGENTS = Gauge(
    "rlenergy_operator_policy_agents",
    "Node agents serving the policy: reporting (a node report exists) and ready (it measures "
    "energy on some GPU).",
    ["namespace", "policy", "state"],
    registry=REGISTRY,
)
AGENTS = Gauge(
    "rlenergy_operator_agents",
    "Pods of the node-agent DaemonSet: desired (GPU nodes it schedules on) and ready.",
    ["state"],
    registry=REGISTRY,
)
WITHOUT_AGENT = Gauge(
    "rlenergy_operator_gpu_nodes_without_agent",
    "GPU nodes with no node agent: without the GPU node label, or blocked (taint, nodeSelector).",
    ["cause"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "rlenergy_operator_reconcile_errors",
    "Handler passes that raised (API errors, retries), count.",
    ["handler"],
    registry=REGISTRY,
)
LAG_STEPS = Gauge(
    "rlenergy_operator_policy_status_lag_steps",
    "Newest RL step a node reported minus the step the policy status accounts through.",
    ["namespace", "policy"],
    registry=REGISTRY,
)
LAST_PASS = Gauge(
    "rlenergy_operator_policy_last_pass_timestamp_seconds",
    "Unix time the job loop last finished a pass for the policy, s.",
    ["namespace", "policy"],
    registry=REGISTRY,
)

F = TypeVar("F", bound=Callable[..., Any])


def counted(handler: str) -> Callable[[F], F]:
    """Count the exceptions of a handler in ``rlenergy_operator_reconcile_errors_total``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception:
                ERRORS.labels(handler).inc()
                raise

        ERRORS.labels(handler)  # the series exists from the start, at 0
        return inner  # type: ignore[return-value]

    return wrap


def policy_pass(
    namespace: str, name: str, reporting: int, ready: int, newest_step: int, through_step: int
) -> None:
    """Record one finished job-loop pass of a policy."""
    POLICY_AGENTS.labels(namespace, name, "reporting").set(reporting)
    POLICY_AGENTS.labels(namespace, name, "ready").set(ready)
    LAG_STEPS.labels(namespace, name).set(max(newest_step - through_step, 0))
    LAST_PASS.labels(namespace, name).set(time.time())


def policy_gone(namespace: str, name: str) -> None:
    """Drop a deleted policy's series."""
    for gauge, label_sets in (
        (POLICY_AGENTS, [(namespace, name, s) for s in ("reporting", "ready")]),
        (LAG_STEPS, [(namespace, name)]),
        (LAST_PASS, [(namespace, name)]),
    ):
        for labels in label_sets:
            try:
                gauge.remove(*labels)
            except KeyError:
                pass


def daemonset(status: dict[str, Any] | None) -> None:
    """Record the agent DaemonSet's desired and ready pods (``None``: no DaemonSet)."""
    st = status or {}
    AGENTS.labels("desired").set(int(st.get("desiredNumberScheduled") or 0))
    AGENTS.labels("ready").set(int(st.get("numberReady") or 0))


def coverage(unlabelled: int, blocked: int) -> None:
    """Record the GPU nodes without a node agent, by cause."""
    WITHOUT_AGENT.labels("unlabelled").set(unlabelled)
    WITHOUT_AGENT.labels("blocked").set(blocked)


def serve(port: int, host: str = "0.0.0.0") -> None:  # noqa: S104 - scraped in-cluster
    """Serve ``/metrics`` on ``host:port`` in a daemon thread (``port`` 0: not at all).

    A port that cannot be bound is logged, not raised: metrics never stop the operator.
    """
    if not port:
        return
    try:
        start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as exc:
        log.error("operator metrics not served on %s:%d: %s", host, port, exc)
        return
    log.info("metrics on %s:%d/metrics", host, port)
