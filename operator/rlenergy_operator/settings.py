"""Operator configuration from the environment (``RLENERGY_OPERATOR_*``) and kopf tuning.

``OperatorConfig`` is read once at start-up; the Helm chart sets the variables. Each field
documents its unit and default. ``configure_kopf`` applies the kopf settings this operator
relies on (see docs/operator.md and the field cases in the comments).
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Iterable
from typing import Any

import kopf
import pydantic
import pydantic_settings

from rlenergy import __version__
from rlenergy.api import naming
from rlenergy.api.v1alpha1 import nodereport as api_nodereport
from rlenergy_operator import shards as op_shards

FINALIZER = "rlenergy.io/reset-clocks"
"""The one finalizer the operator puts on a policy: held until the agents reset the clocks."""


class OperatorConfig(pydantic_settings.BaseSettings):
    """Environment configuration; variable = ``RLENERGY_OPERATOR_`` + upper-case field name."""

    model_config = pydantic_settings.SettingsConfigDict(
        env_prefix="RLENERGY_OPERATOR_", extra="ignore", frozen=True
    )

    namespace: str = pydantic.Field("rl-energy-system", min_length=1)
    """Namespace of the node-agent DaemonSet (the operator's own). Default rl-energy-system."""
    agent_daemonset_name: str = pydantic.Field("rlenergy-node-agent", min_length=1)
    """Name of the single node-agent DaemonSet of the cluster. Default rlenergy-node-agent."""
    agent_image: str = f"ghcr.io/rl-energy/rl-energy-agent:{__version__}"
    """Node-agent container image (the Helm chart passes its own). Default the image of this
    version (``rlenergy.__version__``)."""
    agent_image_pull_policy: str = "IfNotPresent"
    """imagePullPolicy of the agent container. Default IfNotPresent."""
    agent_service_account: str = "rlenergy-node-agent"
    """ServiceAccount of the agent pods (RBAC: write its reports, read policies)."""
    agent_priority_class: str = ""
    """priorityClassName of the agent pods; empty = none. Default empty (the Helm chart sets
    ``system-node-critical``: a GPU node's agent must not be preempted while it holds locks)."""
    agent_tolerations: list[dict[str, Any]] = []
    """Extra tolerations of the agent pods (Kubernetes ``Toleration`` objects, JSON in the
    environment), on top of the GPU taint's (``agent_tolerate_gpu_taint``). Default none."""
    agent_node_selector: dict[str, str] = {}
    """nodeSelector of the agent pods (JSON). Default none: the GPU node label alone decides."""
    agent_affinity: dict[str, Any] = {}
    """Affinity of the agent pods (JSON). Its required node-affinity terms are each ANDed with
    the GPU node label; pod (anti-)affinity and preferred terms pass through. Default none."""
    agent_runtime_class: str = ""
    """runtimeClassName of the agent pods (e.g. ``nvidia`` where the NVIDIA runtime is not the
    default); empty = the node's default runtime. Default empty."""
    agent_image_pull_secrets: list[str] = []
    """Names of the imagePullSecrets of the agent pods (JSON list, Secrets in ``namespace``).
    Default none."""
    agent_gpu_node_label: str = pydantic.Field(
        "nvidia.com/gpu.present=true", pattern=r"^[A-Za-z0-9./_-]+(=[A-Za-z0-9._-]*)?$"
    )
    """The label of the GPU nodes the agents run on: ``key=value`` (node label equal) or
    ``key`` (label present). Default ``nvidia.com/gpu.present=true`` (NVIDIA GPU operator /
    GPU feature discovery)."""
    agent_metrics_port: int = pydantic.Field(9402, ge=1, le=65535)
    """Container port of the agent's /metrics and /healthz. Default 9402."""
    agent_tolerate_gpu_taint: bool = True
    """Tolerate the ``nvidia.com/gpu`` NoSchedule taint of GPU nodes. Default true; without it
    no agent schedules on tainted GPU nodes (the policy reports it as Degraded)."""
    agent_state_dir: str = pydantic.Field("/var/lib/rlenergy", min_length=1)
    """hostPath of the agent's lock record and energy totals. Default /var/lib/rlenergy."""
    agent_pod_resources_dir: str = pydantic.Field("/var/lib/kubelet/pod-resources", min_length=1)
    """hostPath of the kubelet's pod-resources socket folder (mounted read-only)."""
    agent_socket_dir: str = pydantic.Field("/var/run/rlenergy", pattern=r"^/")
    """hostPath of the folder holding the agent's signal socket ``agent.sock``; trainer pods
    mount the same host folder at ``/var/run/rlenergy`` (docs/verl.md). Default
    /var/run/rlenergy."""
    agent_token_audience: str = pydantic.Field("rlenergy-agent", min_length=1)
    """Audience the trainer pods' projected service-account tokens are issued for; the agents
    accept only tokens valid for it (TokenReview). Default rlenergy-agent."""
    agent_dra_index_drivers: str = pydantic.Field("", pattern=r"^[A-Za-z0-9.,_-]*$")
    """DRA drivers (comma-separated) whose device names end in the GPU's NVML index; the
    agents get it as ``RLENERGY_AGENT_DRA_INDEX_DRIVERS`` (rlenergy_agent/dra.py). Default
    empty: DRA devices map by their ResourceSlice's ``uuid`` attribute only."""
    agent_tls_port: int = pydantic.Field(9403, ge=0, le=65535)
    """Port of the agents' TLS signal endpoint on the node's IP (trainer pods reach it at their
    ``status.hostIP``; the webhook injects it as ``RLENERGY_AGENT_PORT``); 0: off, signals
    only on the socket. Default 9403."""
    webhook_port: int = pydantic.Field(0, ge=0, le=65535)
    """Port of the operator's mutating admission webhook (HTTPS); 0: no webhook. Default 0
    (the Helm chart sets ``webhook.port``, 9443)."""
    webhook_service: str = ""
    """DNS name the API server calls the webhook at (``<service>.<namespace>.svc``), the
    serving certificate's name. Default empty (the chart sets it)."""
    webhook_configuration: str = ""
    """Name of the chart's MutatingWebhookConfiguration whose ``caBundle`` the operator keeps
    equal to its CA. Default empty: not patched."""
    ca_secret: str = pydantic.Field("rlenergy-ca", min_length=1)
    """Secret in ``namespace`` holding the operator's CA (``tls.crt``, ``tls.key``; created
    when missing). Default rlenergy-ca."""
    agent_apparmor_profile: str = pydantic.Field(
        "", pattern=r"^(|RuntimeDefault|Unconfined|localhost/[A-Za-z0-9._/-]+)$"
    )
    """AppArmor profile of the agent container (``securityContext.appArmorProfile``):
    ``RuntimeDefault``, ``Unconfined`` or ``localhost/<profile loaded on the node>``; empty:
    the field is left out and the runtime decides (containerd applies its default profile on
    hosts with AppArmor, none elsewhere). Default empty."""
    agent_host_network: bool = False
    """Run the agent pods in the node's network namespace (``hostNetwork``): for nodes without
    a pod network, like the dev cluster's real node (docs/dev-cluster.md). Default false."""
    agent_api_server_host: str = ""
    """API server address the agent pods dial instead of the ``kubernetes`` Service (set as
    ``KUBERNETES_SERVICE_HOST``), for clusters whose pods cannot reach the Service IP. Empty:
    the Service. Default empty."""
    agent_api_server_port: str = ""
    """Port that goes with ``agent_api_server_host`` (``KUBERNETES_SERVICE_PORT``)."""
    agent_extra_env: list[dict[str, Any]] = pydantic.Field(default_factory=list)
    """More env entries of the agent container (Kubernetes ``EnvVar`` objects, JSON)."""
    agent_extra_volumes: list[dict[str, Any]] = pydantic.Field(default_factory=list)
    """More volumes of the agent pods (Kubernetes ``Volume`` objects, JSON): e.g. a hostPath
    with the NVML library where no NVIDIA container toolkit injects it (docs/dev-cluster.md)."""
    agent_extra_volume_mounts: list[dict[str, Any]] = pydantic.Field(default_factory=list)
    """More volumeMounts of the agent container (Kubernetes ``VolumeMount`` objects, JSON)."""
    agent_cpu_request: str = "10m"
    """CPU request of the agent container. Default 10m."""
    agent_memory_request: str = "96Mi"
    """Memory request of the agent container: the agent's resident set on eight GPUs (69 MiB on
    the stand-in NVML, tests/integration/agent/test_agent_memory.py) with headroom. Default
    96Mi."""
    agent_memory_limit: str = "192Mi"
    """Memory limit of the agent container: twice the request, room for a real driver's
    libnvidia-ml and large listings. Default 192Mi."""
    agent_check_interval_s: float = pydantic.Field(10.0, gt=0)
    """Seconds between checks, per policy, that the node agents can schedule: one read of the
    DaemonSet; the GPU nodes' taints only when it schedules no agent. Default 10 s."""
    agent_coverage_interval_s: float = pydantic.Field(60.0, gt=0)
    """Seconds between checks that every GPU node has a node agent: one list of all nodes
    (their GPU label, taints, allocatable GPUs) for all policies. Default 60 s."""
    watch_echo_bound_s: float = pydantic.Field(180.0, gt=0)
    """Seconds a status write may wait for the policy watch to bring it back, and an object
    the API server lists may wait for its watch to deliver that version, before the liveness
    probe fails (``rlenergy_operator.liveness``). Default 180 s."""
    watch_check_interval_s: float = pydantic.Field(30.0, gt=0)
    """Seconds between reads of the watched objects' versions from the API server (one
    metadata-only list per kind, for all policies) that the liveness probe compares with
    what the watches delivered. Default 30 s."""
    metrics_port: int = pydantic.Field(0, ge=0, le=65535)
    """Port of the operator's Prometheus ``/metrics`` on all addresses; 0: off. Default 0 (the
    Helm chart sets ``operator.metricsPort``, 8081)."""
    reconcile_interval_s: float = pydantic.Field(2.0, gt=0)
    """Seconds between job-loop passes per policy (reads node reports, writes status).
    Default 2 s, so status lags the reports by at most about 2 s plus one API round trip."""
    reconcile_catchup_s: float = pydantic.Field(10.0, gt=0)
    """Seconds the job loop waits for ``policy_reconcile`` to record a policy's generation
    before it reconciles the policy itself. A policy created while two replicas start
    together (the chart's default) can reach the active replica with no change handler run
    for it (seen in tests/chaos: the peer paused by peering, the active replica never ran
    ``policy_reconcile``); without this it stayed unreconciled. Default 10 s (five loop
    passes; a healthy change handler is done long before)."""
    reset_deadline_s: float = pydantic.Field(60.0, ge=0)
    """Seconds a deleted policy waits for every node report to acknowledge the GPU reset
    before the finalizer is lifted anyway (with a Degraded event). Default 60 s."""
    retry_delay_s: float = pydantic.Field(5.0, gt=0)
    """Seconds before a failed handler is retried. Default 5 s."""
    peering_name: str = "rlenergy-operator"
    """kopf peering object name (not kopf's ``default``); with shards, each shard's is
    ``<peering_name>-<shards>-<shard_index>`` (``shards.Layout.named``)."""
    shards: int = pydantic.Field(1, ge=1, le=naming.POLICY_BUCKETS)
    """How many operator shards serve the cluster's policies; each serves the policies whose
    ``shards.shard_of`` is its ``shard_index`` (chart value ``operator.shards``: one Deployment
    per shard). Default 1: one operator serves every policy."""
    shard_index: int = pydantic.Field(0, ge=0)
    """This process's shard, below ``shards``. Default 0."""
    handover_check_interval_s: float = pydantic.Field(5.0, gt=0)
    """Seconds between reads of the peering objects while this process waits for the pods of
    another shard layout to exit (``shards.Handover``). Default 5 s."""
    handover_timeout_s: float = pydantic.Field(120.0, ge=0)
    """The longest wait for another shard layout's pods, s; then this process serves anyway,
    with a warning (``shards.Handover``). Default 120 s."""
    priority: int = 0
    """kopf peering priority of this replica; the lower-priority replica pauses. Default 0:
    derived from the pod name (``HOSTNAME``), so the replicas of one Deployment differ."""
    request_timeout_s: float = pydantic.Field(30.0, gt=0)
    """Timeout of one API request, s. Default 30 s."""
    watch_server_timeout_s: int = pydantic.Field(300, gt=0)
    """Server-side watch timeout, s (the watch reconnects after it). Default 300 s."""
    handler_workers: int = pydantic.Field(16, ge=1, le=256)
    """Threads that run handlers (kopf ``execution.max_workers``). Each policy's job-loop pass
    waits on the API (report GETs, the status patch), so 20 policies need more threads than
    kopf's default of CPUs + 4. Default 16."""
    post_events: bool = True
    """Post Kubernetes Events for plan changes and errors. Default true."""
    watch_namespaces: str = pydantic.Field("", pattern=r"^[a-z0-9,-]*$")
    """Comma-separated namespaces the operator serves (a namespaced install, chart value
    ``rbac.watchNamespaces``; pass the same as ``--namespace`` flags). Empty, the default:
    every namespace. When set, kopf's cluster scan of CRDs and namespaces is off (those grants
    are cluster-wide) and policies are listed per namespace."""

    @pydantic.model_validator(mode="after")
    def _shard_below_count(self) -> OperatorConfig:
        op_shards.Layout(self.shards, self.shard_index)  # ValueError naming the fix
        return self

    @property
    def layout(self) -> op_shards.Layout:
        """This process's shard (``shard_index`` of ``shards``).

        Raises:
            ValueError: ``shard_index`` is not below ``shards``.
        """
        return op_shards.Layout(self.shards, self.shard_index)

    @property
    def served_namespaces(self) -> tuple[str, ...]:
        """``watch_namespaces`` as a tuple; empty: every namespace."""
        return tuple(n for n in self.watch_namespaces.split(",") if n)


def peering_priority(pod_name: str) -> int:
    """A stable kopf peering priority in [100, 1099] derived from the pod name.

    Replicas of one Deployment get different priorities, so exactly one is active (with equal
    priorities kopf only warns and both would run).
    """
    return 100 + zlib.crc32(pod_name.encode()) % 1000


class PolicyDiffBaseStorage(kopf.StatusDiffBaseStorage):
    """kopf's diff-base in ``status.kopf``, built only for objects with change handlers.

    kopf builds an object's diff-base essence (a deep copy of the body without metadata and
    status, then a second copy to clear progress fields) on every watch event of every watched
    resource, also for a resource that only feeds an index. A node report's spec holds up to
    32 step records with probe slices; profiling the operator in ``bench/scale.py`` (py-spy, 250
    nodes, 20 policies) showed these copies as the operator's largest CPU cost (230 of 1,019
    samples). Node reports have no change handlers, so their essence is never compared: it is
    left empty.
    """

    def build(
        self,
        *,
        body: kopf.Body,
        extra_fields: Iterable[str | tuple[str, ...] | list[str] | None] | None = None,
    ) -> kopf.BodyEssence:
        """The essence kopf compares; empty for an RLEnergyNodeReport (never compared)."""
        if body.get("kind") == api_nodereport.KIND:
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)


def configure_kopf(settings: kopf.OperatorSettings, cfg: OperatorConfig) -> None:
    """Apply the kopf settings the operator relies on."""
    # One finalizer with our name instead of kopf's generic marker.
    settings.persistence.finalizer = op_shards.finalizer_of(FINALIZER, cfg.layout)
    # A shard watches only its own policies' node reports (the API server filters them).
    selector = cfg.layout.report_selector()
    if selector is not None:
        plural = (api_nodereport.GROUP, api_nodereport.PLURAL)
        settings.watching.label_selectors[plural] = selector
    # GitOps: never write annotations (Argo CD / Flux see them as drift); kopf keeps its
    # progress and last-handled spec in status.kopf, declared in the CRD with
    # x-kubernetes-preserve-unknown-fields (nothing is silently pruned).
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    settings.persistence.diffbase_storage = PolicyDiffBaseStorage(
        field="status.kopf.lastHandledConfiguration"
    )
    # Peering: our own name and an explicit priority.
    settings.peering.name = cfg.layout.named(cfg.peering_name)
    settings.peering.priority = cfg.priority or peering_priority(os.environ.get("HOSTNAME", ""))
    # Short retries instead of kopf's 60 s default.
    settings.execution.default_backoff = cfg.retry_delay_s
    settings.networking.request_timeout = cfg.request_timeout_s
    settings.networking.connect_timeout = 5
    # Watches end server-side and reconnect: never unset (a watch with no timeouts can hang on
    # a half-open connection; tests/unit/operator/test_liveness.py holds them). 410 Gone:
    # kopf's relist, in kopf/_cogs/clients/watching.py: continuous_watch() returns on an ERROR
    # event with code 410, and infinite_watch() calls it again, which lists before it watches
    # (fetching.fetch_objs); we hold no resourceVersion of our own across kopf's watches.
    settings.watching.server_timeout = cfg.watch_server_timeout_s
    settings.watching.client_timeout = cfg.watch_server_timeout_s + 30
    settings.watching.connect_timeout = 5
    settings.execution.max_workers = cfg.handler_workers
    settings.posting.enabled = cfg.post_events
    # A timer still running when its policy is deleted (the job loop runs every few seconds)
    # held the finalizer for kopf's cancellation polling, 60 s by default: wait up to 5 s for
    # it to end (handlers take well under a second), then poll every 2 s.
    settings.background.instant_exit_timeout = 5.0
    settings.background.cancellation_polling = 2.0
    # Logger records become Events only from WARNING up; plan changes are posted explicitly.
    settings.posting.level = logging.WARNING
    # A namespaced install has Roles only: no cluster-wide CRD/namespace watches (kopf then
    # serves exactly the --namespace names, docs/operations.md "Privilege").
    settings.scanning.disabled = bool(cfg.served_namespaces)
