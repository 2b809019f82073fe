"""``rlenergy-agent``: build the services from settings, run until SIGTERM, reset clocks on exit.

Order: GPUs (NVML or simulated) -> capability probe -> actuator start-up (stale-lock recovery)
-> energy meter (restored totals) -> pod map -> Kubernetes API -> signal socket (callers
authenticated by their pod's token, TokenReview) and ops port -> sampling loop (which also
resets the GPUs of governed pods that ended, ``podlife``).
On SIGTERM/SIGINT every lock the agent made is reset before exit (case #4a).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rlenergy.api import selector
from rlenergy.gpu import base, errors
from rlenergy_agent import actuator, config, energy, identity, podlife, server, service
from rlenergy_agent.nvml import backend, lib

if TYPE_CHECKING:
    from rlenergy_agent import kube as kube_t

log = logging.getLogger("rlenergy_agent")


def parse_static_pods(text: str) -> dict[service.PodRef, list[str]]:
    """Parse ``{"ns/name/uid": ["GPU-..."]}`` (local runs without a kubelet).

    Raises:
        ValueError: malformed JSON or keys.
    """
    if not text:
        return {}
    raw = json.loads(text)
    out: dict[service.PodRef, list[str]] = {}
    for key, devices in raw.items():
        parts = key.split("/")
        if len(parts) not in (2, 3):
            raise ValueError(f"static pod key {key!r} must be ns/name[/uid]")
        out[service.PodRef(parts[0], parts[1], parts[2] if len(parts) == 3 else "")] = list(devices)
    return out


def _gpus(settings: config.AgentSettings) -> tuple[dict[str, base.Gpu], dict[str, object]]:
    if settings.backend == "sim":
        from rlenergy_agent.testing import simgpus

        return simgpus.simulated_gpus(settings.node_name, settings.sim_sku, settings.sim_gpus), {}
    found = backend.discover()
    for index, why in found.lost.items():
        log.error("GPU at NVML index %d skipped: %s", index, why)
    return dict(found.gpus), {u: g.probe() for u, g in found.gpus.items()}


def build(settings: config.AgentSettings) -> tuple[service.Agent, dict[str, object]]:
    """Build the agent from settings (no listeners yet).

    Raises:
        rlenergy_agent.nvml.lib.NvmlUnavailableError: NVML cannot start (message says why).
    """
    gpus, caps = _gpus(settings)
    state_dir = settings.state_dir / settings.node_name
    acts = actuator.Actuator(
        gpus, actuator.LockStateFile(state_dir / "locks.json"), enforce=settings.enforce
    )
    acts.start(
        persistence={u: getattr(c, "persistence", True) for u, c in caps.items()},
        mig_uuids={u: getattr(gpus[u], "mig_uuids", ()) for u in gpus},
    )
    sources: dict[str, energy.EnergySource] = {}
    for u in gpus:
        c = caps.get(u)
        sources[u] = (
            energy.source_for(c.energy_counter, c.instant_power, c.power_usage)  # type: ignore[attr-defined]
            if c is not None
            else "counter"
        )
    meter = energy.EnergyMeter(gpus, sources, totals_path=state_dir / "energy-totals.json")
    meter.sample()
    pods: service.PodMap = service.StaticPodMap(parse_static_pods(settings.static_pods))
    if not settings.static_pods and settings.podresources_socket.exists():
        from rlenergy_agent import kube, podmap

        pods = podmap.PodResourcesClient(
            str(settings.podresources_socket),
            uid_of=kube.pod_uid_lookup(settings.node_name) if settings.kube else None,
        )
    mig_parent = {m: u for u in gpus for m in getattr(gpus[u], "mig_uuids", ())}
    agent = service.Agent(
        settings.node_name, settings.policy_name, acts, meter, pods, mig_parent=mig_parent
    )
    return agent, dict(caps)


def _no_api_review(token: str, audiences: Sequence[str]) -> identity.Review:
    """Without the Kubernetes API no caller can be checked: every signal gets 503."""
    raise identity.ReviewUnavailableError(
        "the agent runs without the Kubernetes API (RLENERGY_AGENT_KUBE=false or no cluster "
        "configuration), so no caller's token can be reviewed"
    )


def nvml_healthy(agent: service.Agent) -> bool:
    """False when every GPU fails (NVML lost in the container, case #11a)."""
    if not agent.actuator.gpus:
        return False
    for gpu in agent.actuator.gpus.values():
        try:
            gpu.power_limit_mw()
            return True
        except errors.GpuNotSupportedError:
            return True
        except errors.GpuError:
            continue
    return False


def rediscover(
    finder: kube_t.PolicyDiscovery, agent: service.Agent, last: selector.Discovery | None
) -> selector.Discovery | None:
    """The policy governing the node's GPU pods now; ``None`` when the API failed.

    The caller then keeps its current policy. A changed outcome is logged: a conflict as an
    error (the node governs nothing until one selector is narrowed), else at info.
    """
    try:
        found = finder.discover((p.namespace, p.name) for p in agent.podmap.pods())
    except Exception as exc:  # noqa: BLE001 - keep the current policy on API errors
        log.warning("policy discovery failed, keeping the current policy: %s", exc)
        return None
    if last is None or (found.reason, found.policy, found.message) != (
        last.reason,
        last.policy,
        last.message,
    ):
        level = logging.ERROR if found.reason == "Conflict" else logging.INFO
        log.log(level, "policy discovery: %s: %s", found.reason, found.message)
    agent.discovery = (found.reason, "" if found.policy is None else str(found.policy))
    return found


def leave_policy(agent: service.Agent, writer: kube_t.ReportWriter | None, new: str) -> None:
    """Reset every clock of the current policy, then serve ``new`` (``""``: none).

    The old policy's operator gets a last report with the resets acknowledged; the new one
    starts from a clean slate.
    """
    agent.set_plan(None)
    if writer is not None:
        try:
            writer.write(agent.report())
        except Exception as exc:  # noqa: BLE001 - the clocks are reset either way
            log.warning("last report for %s failed: %s", writer.policy, exc)
        log.info("left policy %s/%s: clocks reset", writer.namespace, writer.policy)
    agent.switch_policy(new)


def write_report(path: Path, agent: service.Agent) -> None:
    """Write the node report as JSON (atomic replace; local runs and benchmarks)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(agent.report().model_dump_json(by_alias=True))
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT; returns the exit code."""
    parser = argparse.ArgumentParser(prog="rlenergy-agent", description=__doc__)
    parser.add_argument("--node", help="node name (env RLENERGY_AGENT_NODE_NAME)")
    parser.add_argument("--backend", choices=["nvml", "sim"], help="GPU backend")
    parser.add_argument("--policy", help="RLEnergyPolicy name")
    parser.add_argument("--socket", type=Path, help="signal socket path")
    parser.add_argument("--state-dir", type=Path, help="lock record and totals folder")
    parser.add_argument("--metrics-port", type=int, help="port of /metrics (0: any)")
    parser.add_argument("--observe", action="store_true", help="never write clocks")
    parser.add_argument(
        "--plan",
        type=Path,
        help="a ClockPlan JSON/YAML file (local runs and benchmarks: no policy plan is polled "
        "and no node report object written; the API still checks callers and pod ends)",
    )
    parser.add_argument("--report-file", type=Path, help="also write the report JSON here")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    overrides: Mapping[str, object] = {
        k: v
        for k, v in {
            "node_name": args.node,
            "backend": args.backend,
            "policy_name": args.policy,
            "socket_path": args.socket,
            "state_dir": args.state_dir,
            "metrics_port": args.metrics_port,
            "enforce": False if args.observe else None,
            "report_file": args.report_file,
        }.items()
        if v is not None
    }
    settings = config.AgentSettings(**overrides)  # type: ignore[arg-type]
    if not settings.node_name:
        parser.error("--node or RLENERGY_AGENT_NODE_NAME is required")
    discover = settings.kube and not settings.policy_name and args.plan is None
    if not settings.policy_name and not discover:
        settings.policy_name = "default"  # local runs without the API or with a plan file
    try:
        agent, _caps = build(settings)
    except lib.NvmlUnavailableError as exc:
        log.error("NVML unavailable, clock control disabled: %s", exc)
        return 3
    if args.plan is not None:
        import yaml

        from rlenergy.api import node as api_node

        agent.set_plan(api_node.ClockPlan.model_validate(yaml.safe_load(args.plan.read_text())))
    stop = threading.Event()
    api = None
    reviewer: identity.Reviewer = _no_api_review
    ended_in_api: podlife.EndedInApi | None = None
    if settings.kube:
        from rlenergy_agent import kube

        try:
            api = kube.load_api()
            reviewer = kube.TokenReviewer().review
            ended_in_api = kube.ended_pods(settings.node_name)
        except Exception as exc:  # noqa: BLE001 - no cluster config: run locally
            log.error(
                "no Kubernetes API (%s); reports, plan updates and caller checks disabled "
                "(every signal is refused with 503)",
                exc,
            )
    auth = identity.TokenAuthenticator(
        reviewer, settings.token_audience, max_ttl_s=settings.token_cache_max_s
    )
    pod_ends = podlife.PodEndWatch(agent, ended_in_api, check_s=settings.pod_check_s)
    signals = server.SignalServer(settings.socket_path, agent, auth)
    ops = server.OpsServer(
        settings.metrics_host,
        settings.metrics_port,
        agent,
        health=lambda: nvml_healthy(agent),
        ready=lambda: bool(agent.actuator.gpus),
    )

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: resetting clocks and stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.start_prober()
    signals.start()
    ops.start()
    log.info(
        "agent up on %s: %d GPU(s), signals on %s, ops on %s:%d",
        settings.node_name,
        len(agent.actuator.gpus),
        settings.socket_path,
        settings.metrics_host,
        ops.port,
    )
    print(json.dumps({"ready": True, "metricsPort": ops.port}), flush=True)
    writer = watcher = finder = None
    if api is not None and args.plan is None:  # a plan file: no policy plan, no report object
        if discover:
            finder = kube.PolicyDiscovery(api, settings.node_name)
        else:
            writer = kube.ReportWriter(
                api, settings.namespace, settings.policy_name, settings.node_name
            )
            watcher = kube.PlanWatcher(api, settings.namespace, settings.policy_name)
    last_poll = last_write = 0.0
    discovered: selector.Discovery | None = None
    # The first report goes out at once (the operator needs the GPUs' clock tables before the
    # first step), and again whenever the plan changes (reset acknowledgements on deletion).
    state_changed = True
    try:
        while not stop.wait(settings.sample_interval_s):
            now = time.monotonic()
            pod_ends.tick()  # reset on pod end, before this pass's report
            if finder is not None and now - last_poll >= settings.plan_poll_s:
                found = rediscover(finder, agent, discovered)
                if found is not None:
                    discovered = found
                    current = None if watcher is None else (watcher.namespace, watcher.policy)
                    ref = found.policy
                    if (None if ref is None else (ref.namespace, ref.name)) != current:
                        leave_policy(agent, writer, "" if ref is None else ref.name)
                        writer = watcher = None
                        if ref is not None:
                            writer = kube.ReportWriter(
                                api, ref.namespace, ref.name, agent.node_name
                            )
                            watcher = kube.PlanWatcher(api, ref.namespace, ref.name)
                        state_changed = True
                if watcher is None:  # nothing to poll: next discovery in plan_poll_s
                    last_poll = now
            if watcher is not None and now - last_poll >= settings.plan_poll_s:
                last_poll = now
                try:
                    exists, plan = watcher.poll()
                    agent.saving_ratio = watcher.saving_ratio
                    if not exists or plan != agent.plan:
                        enforced = agent.plan is not None and agent.plan.enforce
                        agent.set_plan(plan)
                        state_changed = state_changed or enforced != bool(plan and plan.enforce)
                except Exception as exc:  # noqa: BLE001 - keep the last plan on API errors
                    log.warning("plan poll failed: %s", exc)
            # Only finished steps count (a running step's record still changes); the set is
            # taken before the report is built, so a step that finishes during the write
            # stays dirty for the next one.
            pending = agent.finished_dirty_steps() if writer is not None else set()
            if agent.report_due:  # a park or a dispatcher publication (FlexFloor)
                agent.report_due = False
                state_changed = True
            if writer is not None and (
                state_changed
                or (
                    pending and (now - last_write >= settings.report_interval_s or len(pending) > 1)
                )
            ):
                last_write = now
                try:
                    writer.write(agent.report())
                    agent.dirty_steps.difference_update(pending)
                    state_changed = False
                except Exception as exc:  # noqa: BLE001 - retried at the next step
                    log.warning("report write failed: %s", exc)
            agent.meter.sample()
            agent.observe()
            agent.meter.save()
            if settings.report_file is not None and agent.dirty_steps:
                if writer is None:
                    agent.dirty_steps.clear()
                write_report(settings.report_file, agent)
    finally:
        signals.stop()
        ops.stop()
        agent.stop_prober()
        agent.actuator.reset_all("agent shutdown")
        agent.meter.sample()
        agent.meter.save()
        if settings.report_file is not None:
            write_report(settings.report_file, agent)
        if settings.backend == "nvml":
            backend.shutdown()
        time.sleep(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
