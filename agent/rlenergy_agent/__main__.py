"""``rlenergy-agent``: build the services from settings, run until SIGTERM, reset clocks on exit.

Order: GPUs (NVML or simulated) -> capability probe -> actuator start-up (stale-lock recovery)
-> energy meter (restored totals) -> pod map -> Kubernetes API -> signal socket (callers
authenticated by their pod's token, TokenReview) and ops port -> sampling loop (which also
resets the GPUs of governed pods that ended, ``podlife``).
On SIGTERM/SIGINT every lock the agent made is reset before exit.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlenergy.api import node as api_node
from rlenergy.gpu import base, errors
from rlenergy_agent import (
    actuator,
    config,
    dra,
    endpoint,
    energy,
    identity,
    nodeloop,
    podlife,
    server,
    service,
)
from rlenergy_agent.nodeloop import leave_policy as leave_policy
from rlenergy_agent.nodeloop import rediscover as rediscover
from rlenergy_agent.nodeloop import write_report as write_report
from rlenergy_agent.nvml import backend, lib

log = logging.getLogger("rlenergy_agent")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


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


def _gpus(
    settings: config.AgentSettings,
) -> tuple[dict[str, base.Gpu], dict[str, object], backend.NvmlSession | None]:
    if settings.backend == "sim":
        from rlenergy_agent import simulated

        gpus = simulated.simulated_gpus(settings.node_name, settings.sim_sku, settings.sim_gpus)
        return gpus, {}, None
    found = backend.discover()
    for index, why in found.lost.items():
        log.error("GPU at NVML index %d skipped: %s", index, why)
    session = backend.NvmlSession(found.gpus, found.driver_version, found.indices)
    return dict(found.gpus), {u: g.probe() for u, g in found.gpus.items()}, session


def build(settings: config.AgentSettings) -> tuple[service.Agent, dict[str, object]]:
    """Build the agent from settings (no listeners yet).

    Raises:
        rlenergy_agent.nvml.lib.NvmlUnavailableError: NVML cannot start (message says why).
    """
    gpus, caps, session = _gpus(settings)
    state_dir = settings.state_dir / settings.node_name
    acts = actuator.Actuator(
        gpus,
        actuator.LockStateFile(state_dir / "locks.json"),
        enforce=settings.enforce,
        library=session,
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
    if not settings.static_pods:
        from rlenergy_agent import podmap

        # A socket that does not exist yet (the kubelet starts after the agent) is waited
        # for: the node loop lists again every pass, and no GPU is attributed until it answers.
        pods = podmap.PodResourcesClient(
            str(settings.podresources_socket), dra_resolver=_dra_resolver(settings, gpus, session)
        )
    mig_parent = {m: u for u in gpus for m in getattr(gpus[u], "mig_uuids", ())}
    agent = service.Agent(
        settings.node_name,
        settings.policy_name,
        acts,
        meter,
        pods,
        mig_parent=mig_parent,
        stall_after_s=settings.stall_after_s,
    )
    return agent, dict(caps)


def _dra_resolver(
    settings: config.AgentSettings, gpus: Mapping[str, object], session: Any
) -> dra.DraResolver:
    """DRA devices to GPUs: the node's ResourceSlices (with the API), then the index rule."""
    slices = None
    if settings.kube:
        from rlenergy_agent import kube

        slices = kube.NodeResourceSlices(settings.node_name)
    indices = session.indices if session is not None else dict(enumerate(gpus))
    return dra.DraResolver(slices, indices, dra.parse_drivers(settings.dra_index_drivers))


TERMINATION_LOG = Path("/dev/termination-log")
"""The kubelet's default ``terminationMessagePath``: what it writes there becomes the container's
``state.terminated.message`` (``kubectl describe pod``)."""


def nvml_unavailable(
    settings: config.AgentSettings,
    exc: lib.NvmlUnavailableError,
    *,
    discover: bool,
    termination_log: Path = TERMINATION_LOG,
    api: Any = None,
    list_pods: Any = None,
) -> str:
    """Say why this node's GPUs are not governed: NVML cannot load (the fix is in ``exc``).

    One log line; the same line as the pod's termination message (when the kubelet made
    ``termination_log``); and, with the Kubernetes API, the ``nvmlError`` of the node report of
    each policy that governs this node (the configured one, or the one governing the node's
    pods that request ``nvidia.com/gpu``), so the operator sets the policy's ``Degraded``
    condition (reason ``NVMLUnavailable``). An existing report keeps its step records and
    lists no GPU. API failures are logged, never raised: the agent exits either way.

    Args:
        settings: the agent's settings.
        exc: what ``nvml.lib.init`` raised.
        discover: find the governing policy from the node's pods (no policy configured).
        termination_log: the termination-message file.
        api: a ``CustomObjectsApi`` (default: ``kube.load_api()`` when ``settings.kube``).
        list_pods: lists the node's pods (default: ``kube.NodePods``).

    Returns:
        The line (at most 1,024 characters, the report field's bound).
    """
    line = f"NVML unavailable, this node's GPUs are not governed: {exc}"[:1024]
    log.error("%s", line)
    if termination_log.exists():
        try:
            termination_log.write_text(line)
        except OSError as err:
            log.warning("could not write the termination message: %s", err)
    if settings.kube or api is not None:
        try:
            _report_nvml_error(settings, line, discover, api, list_pods)
        except Exception as err:  # noqa: BLE001 - the agent exits either way
            log.warning("could not report the NVML error to the policy: %s", err)
    return line


def _report_nvml_error(
    settings: config.AgentSettings, line: str, discover: bool, api: Any, list_pods: Any
) -> None:
    from rlenergy_agent import kube

    if api is None:
        api = kube.load_api()
    if not discover:
        refs = [(settings.namespace, settings.policy_name)]
    else:
        listed = (list_pods or kube.NodePods(settings.node_name))()
        gpu_pods = [
            (str(p["metadata"]["namespace"]), str(p["metadata"]["name"]))
            for p in listed
            if _requests_gpu(p)
        ]
        finder = kube.PolicyDiscovery(api, settings.node_name, list_pods=lambda: listed)
        found = finder.discover(gpu_pods).policy
        refs = [] if found is None else [(found.namespace, found.name)]
    for ns, name in refs:
        writer = kube.ReportWriter(api, ns, name, settings.node_name)
        try:
            api.patch_namespaced_custom_object(
                kube.GROUP, kube.VERSION, ns, kube.REPORT_PLURAL, writer.name,
                {"spec": {"gpus": [], "nvmlError": line}},
            )  # fmt: skip
        except kube.ApiException as err:
            if err.status != 404:
                raise
            report = api_node.NodeReport(
                policy_name=name, node_name=settings.node_name, nvml_error=line
            )
            api.create_namespaced_custom_object(
                kube.GROUP, kube.VERSION, ns, kube.REPORT_PLURAL, writer.body(report)
            )
        log.info("NVML error reported in %s/%s", ns, writer.name)


def _requests_gpu(pod: Mapping[str, Any]) -> bool:
    """Whether a running or pending pod asks for ``nvidia.com/gpu`` in a container."""
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return False
    for c in (pod.get("spec") or {}).get("containers") or ():
        res = c.get("resources") or {}
        if "nvidia.com/gpu" in (res.get("limits") or {}) or "nvidia.com/gpu" in (
            res.get("requests") or {}
        ):
            return True
    return False


def _no_api_review(token: str, audiences: Sequence[str]) -> identity.Review:
    """Without the Kubernetes API no caller can be checked: every signal gets 503."""
    raise identity.ReviewUnavailableError(
        "the agent runs without the Kubernetes API (RLENERGY_AGENT_KUBE=false or no cluster "
        "configuration), so no caller's token can be reviewed"
    )


def nvml_healthy(agent: service.Agent) -> bool:
    """False when every GPU fails (NVML lost in the container)."""
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


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--dra-index-drivers",
        help="DRA drivers whose device names end in the GPU's NVML index, comma-separated "
        "(env RLENERGY_AGENT_DRA_INDEX_DRIVERS; default none)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def _settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> config.AgentSettings:
    """Settings from the environment, overridden by the command line."""
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
            "dra_index_drivers": args.dra_index_drivers,
        }.items()
        if v is not None
    }
    settings = config.AgentSettings(**overrides)
    if not settings.node_name:
        parser.error("--node or RLENERGY_AGENT_NODE_NAME is required")
    return settings


def _plan_file(path: Path) -> api_node.ClockPlan:
    import yaml

    return api_node.ClockPlan.model_validate(yaml.safe_load(path.read_text()))


def _cluster(
    settings: config.AgentSettings,
) -> tuple[Any, identity.Reviewer, podlife.EndedInApi | None, identity.CurrentPod | None]:
    """(CustomObjectsApi or None, token reviewer, pod-end lister, current pod lookup)."""
    if settings.kube:
        from rlenergy_agent import kube

        try:
            api = kube.load_api()
            auth = kube.start_clients()
            return (
                api,
                kube.TokenReviewer(auth).review,
                kube.ended_pods(settings.node_name),
                kube.CurrentPod(),
            )
        except Exception as exc:  # noqa: BLE001 - no cluster config: run locally
            log.error(
                "no Kubernetes API (%s); reports, plan updates and caller checks disabled "
                "(every signal is refused with 503)",
                exc,
            )
    return None, _no_api_review, None, None


def _shutdown(
    settings: config.AgentSettings,
    agent: service.Agent,
    signals: server.SignalServer,
    ops: server.OpsServer,
    tls_signals: server.TlsSignalServer | None = None,
) -> None:
    """Stop the servers and the prober, reset every lock, save the energy totals."""
    signals.stop()
    if tls_signals is not None:
        tls_signals.stop()
    ops.stop()
    agent.stop_prober()
    agent.actuator.reset_all("agent shutdown")
    agent.meter.sample()
    agent.meter.save()
    if settings.report_file is not None:
        nodeloop.write_report(settings.report_file, agent)
    if settings.backend == "nvml":
        backend.shutdown()
    time.sleep(0)


def freeze_startup_objects() -> None:
    """Collect, then freeze what is left for the garbage collector (before serving).

    Start-up objects (modules, API clients, pydantic schemas: about 121,000 with the Kubernetes
    client) never become garbage; frozen, a full collection, which runs on whichever thread
    allocates (a signal's, too), no longer walks them: 76-93 ms of CPU on the development
    machine, 0.00 ms frozen (``bench/agent.py`` prints both).
    """
    gc.collect()
    gc.freeze()


def _callers(
    settings: config.AgentSettings, agent: service.Agent
) -> tuple[Any, identity.TokenAuthenticator, podlife.PodEndWatch]:
    """The API client, the callers' token check and the pod-end watch.

    The pod-end watch forgets an ended pod's cached token reviews; with the API, a watch of
    the node's pods makes the token cache forget a pod as soon as its deletion starts
    (``identity.PodEndTokens``), before a pod of its name can be created again.
    """
    api, reviewer, ended_in_api, current_pod = _cluster(settings)
    auth = identity.TokenAuthenticator(
        reviewer,
        settings.token_audience,
        current_pod=current_pod,
        max_ttl_s=settings.token_cache_max_s,
    )
    pod_ends = podlife.PodEndWatch(
        agent, ended_in_api, check_s=settings.pod_check_s, on_end=auth.forget_pod
    )
    if ended_in_api is not None:
        from rlenergy_agent import annotations

        annotations.PodPhaseWatch(
            agent, settings.node_name, handler=identity.PodEndTokens(auth), name="pod end watch"
        ).start()
    return api, auth, pod_ends


def _tls_listener(
    settings: config.AgentSettings, agent: service.Agent, auth: identity.TokenAuthenticator
) -> server.TlsSignalServer | None:
    """The TLS signal listener and its certificate keeper, when ``tls_port`` is set.

    With ``tls_cert_file`` and ``tls_key_file`` the listener serves those files; otherwise the
    node's certificate is asked of the operator (``tlsserve``), which needs the Kubernetes API
    and the node's IP (without them: logged, off).
    """
    if not settings.tls_port:
        return None
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        certificate = endpoint.ServingCertificate(settings.tls_cert_file, settings.tls_key_file)
        return server.TlsSignalServer(
            settings.tls_host, settings.tls_port, agent, auth, certificate
        )
    if not settings.kube or not settings.node_ip:
        log.error(
            "TLS signal port %d off: it needs the Kubernetes API and RLENERGY_AGENT_NODE_IP "
            "(downward API status.hostIP) for its serving certificate",
            settings.tls_port,
        )
        return None
    from rlenergy_agent import kube, tlsserve

    keeper = tlsserve.ServingCertKeeper(
        settings.node_name,
        [settings.node_ip],
        settings.state_dir / settings.node_name / "tls",
        kube.CertificateRequester().request,
    )
    keeper.start()
    certificate = endpoint.ServingCertificate(keeper.cert_file, keeper.key_file)
    return server.TlsSignalServer(settings.tls_host, settings.tls_port, agent, auth, certificate)


def _start(
    settings: config.AgentSettings,
    agent: service.Agent,
    signals: server.SignalServer,
    tls_signals: server.TlsSignalServer | None,
    ops: server.OpsServer,
) -> None:
    """Start the prober and the listeners; say so in the log and in one JSON line on stdout."""
    freeze_startup_objects()
    agent.start_prober()
    signals.start()
    if tls_signals is not None:
        tls_signals.start()
    ops.start()
    log.info(
        "agent up on %s: %d GPU(s), signals on %s, ops on %s:%d",
        settings.node_name,
        len(agent.actuator.gpus),
        settings.socket_path,
        settings.metrics_host,
        ops.port,
    )
    ready = {"ready": True, "metricsPort": ops.port}
    if tls_signals is not None:
        ready["tlsPort"] = tls_signals.port
    print(json.dumps(ready), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    settings = _settings(parser, args)
    discover = settings.kube and not settings.policy_name and args.plan is None
    if not settings.policy_name and not discover:
        settings.policy_name = "default"  # local runs without the API or with a plan file
    try:
        agent, _caps = build(settings)
    except lib.NvmlUnavailableError as exc:
        nvml_unavailable(settings, exc, discover=discover)
        return 3
    if args.plan is not None:
        agent.set_plan(_plan_file(args.plan))
    stop = threading.Event()
    agent.discovery_pending = discover  # 503 to every signal until the first discovery
    api, auth, pod_ends = _callers(settings, agent)
    try:
        signals = server.SignalServer(settings.socket_path, agent, auth)
    except endpoint.SocketPathError as exc:
        log.error("%s", exc)
        return 2
    tls_signals = _tls_listener(settings, agent, auth)
    ops = server.OpsServer(
        settings.metrics_host,
        settings.metrics_port,
        agent,
        health=lambda: nvml_healthy(agent),
        ready=lambda: bool(agent.actuator.gpus) and signals.intact(),
    )

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: resetting clocks and stopping", signum)
        agent.stopping = True  # 503 (retry) to signals from here on, not 403
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _start(settings, agent, signals, tls_signals, ops)
    follow = api if args.plan is None else None  # a plan file: no policy plan, no report
    loop = nodeloop.NodeLoop(settings, agent, pod_ends, follow, discover=discover, stop=stop)
    try:
        loop.run()
    finally:
        loop.close()
        _shutdown(settings, agent, signals, ops, tls_signals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
