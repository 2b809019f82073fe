"""Agent settings: environment variables ``RLENERGY_AGENT_*``, CLI overrides.

Each setting documents its unit, default and reason. Callers: ``rlenergy_agent.__main__``.

The settings are a pydantic model that reads its own variables (``from_environ``): every
setting is a scalar (text, number, bool, path), so a variable's text goes to pydantic's
validation as it is, which converts and checks it as ``pydantic-settings`` does for such fields
(names matched case-insensitively, defaults validated, other variables ignored;
``tests/unit/agent/test_agent_settings.py`` holds the two side by side). ``pydantic-settings``
itself is not imported: its sources, ``dotenv`` and command-line parser held 1.2 MiB of the
agent's resident set, which has to stay under 60 MB (docs/agent.md, "Footprint").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ENV_PREFIX = "RLENERGY_AGENT_"
"""Prefix of the settings' environment variables (``RLENERGY_AGENT_NODE_NAME``, ...)."""


def from_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings ``environ`` names: ``{field: text}`` for each ``RLENERGY_AGENT_<FIELD>``.

    Names match case-insensitively; variables that name no setting are left out.
    """
    prefix = ENV_PREFIX.lower()
    out: dict[str, str] = {}
    for key, value in environ.items():
        name = key.lower()
        if name.startswith(prefix) and name[len(prefix) :] in AgentSettings.model_fields:
            out[name[len(prefix) :]] = value
    return out


class AgentSettings(BaseModel):
    """Node agent configuration: keyword arguments over ``RLENERGY_AGENT_*`` variables.

    Raises:
        pydantic.ValidationError: a value (argument or variable) that is not valid.
    """

    model_config = ConfigDict(extra="ignore", validate_default=True)

    def __init__(self, /, **values: Any) -> None:
        super().__init__(**{**from_environ(os.environ), **values})

    node_name: str = Field("", description="This node (downward API NODE_NAME); required.")
    backend: Literal["nvml", "sim"] = Field(
        "nvml",
        description="nvml: real GPUs through pynvml (rlenergy_agent.nvml); sim: simulated GPUs "
        "(rlenergy_agent.simulated: demos, benchmarks, the image smoke test).",
    )
    policy_name: str = Field(
        "",
        description="RLEnergyPolicy this agent reports for. Empty (the DaemonSet): discover it "
        "at every plan poll from the node's GPU pods and the policies' selectors; without the "
        "API (kube off) an empty name means 'default'.",
    )
    namespace: str = Field(
        "default", description="Namespace of the policy named by policy_name (not discovery)."
    )
    enforce: bool = Field(
        True, description="False: observe mode, never writes a clock (the plan can also say so)."
    )
    socket_path: Path = Field(
        Path("/var/run/rlenergy/agent.sock"),
        description="Unix socket trainers signal phases on (mounted into trainer pods).",
    )
    tls_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the TLS signal endpoint on the node's IP (trainer pods reach "
        "it at their status.hostIP, no hostPath needed); 0: off, signals on the socket only.",
    )
    tls_host: str = Field(
        "0.0.0.0",  # noqa: S104 - the node's IPs (hostNetwork) or the pod's (hostPort)
        description="Address the TLS signal endpoint listens on.",
    )
    tls_cert_file: Path | None = Field(
        None,
        description="A serving certificate chain (PEM) issued elsewhere (cert-manager, local "
        "runs); with tls_key_file it replaces the operator-signed one, re-read when it changes.",
    )
    tls_key_file: Path | None = Field(None, description="The key of tls_cert_file (PEM).")
    node_ip: str = Field(
        "",
        description="The node's IP (downward API status.hostIP): the serving certificate's "
        "address, the one trainer pods dial.",
    )
    state_dir: Path = Field(
        Path("/var/lib/rlenergy"),
        description="hostPath for the lock record and energy totals (survive agent restarts).",
    )
    metrics_host: str = Field("127.0.0.1", description="Address of /metrics, /healthz, /readyz.")
    metrics_port: int = Field(9464, ge=0, le=65535, description="Port of /metrics (0: any).")
    sample_interval_s: float = Field(
        1.0,
        gt=0,
        description="Energy sampling period, s; counters need little, and frequent NVML polling "
        "raises idle power. Phase boundaries are always sampled at once.",
    )
    report_interval_s: float = Field(
        5.0, gt=0, description="Longest wait before a finished step is written to the report, s."
    )
    podresources_socket: Path = Field(
        Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        description="Kubelet PodResources v1 socket (mounted read-only).",
    )
    dra_index_drivers: str = Field(
        "",
        description="DRA drivers whose device names end in the GPU's NVML index, comma-"
        "separated (gpu-<N>: NVIDIA's GPU DRA driver; device-<NN>: Kubernetes' DRA test "
        "driver); a claimed device of such a driver without a uuid attribute in its "
        "ResourceSlice is that GPU. Empty (default): DRA devices map by that attribute only "
        "(rlenergy_agent.dra).",
    )
    static_pods: str = Field(
        "",
        description='Local runs without a kubelet: JSON {"ns/name/uid": ["GPU-..."]}.',
    )
    kube: bool = Field(
        True,
        description="Talk to the API server (report, plan, pod UIDs); off for local runs.",
    )
    plan_poll_s: float = Field(2.0, gt=0, description="Policy status.plan poll period, s.")
    report_file: Path | None = Field(
        None, description="Local runs: also write the node report JSON here after each step."
    )
    token_audience: str = Field(
        "rlenergy-agent",
        min_length=1,
        description="Audience the trainer pods' projected service-account tokens must be valid "
        "for (chart value agent.tokenAudience); checked by TokenReview.",
    )
    token_cache_max_s: float = Field(
        10.0,
        gt=0,
        le=10.0,
        description="Longest a token's TokenReview success is reused, s (also bounded by the "
        "token's expiry and dropped when its pod ends): a pod re-created or deleted is seen "
        "within it.",
    )
    pod_check_s: float = Field(
        3.0,
        gt=0,
        description="Period of the API check that a governed pod still runs, s (one pod listing "
        "of this node, only while some pod is governed); with the kubelet's listing (every "
        "sample) a pod's end resets its GPUs within 10 s.",
    )
    stall_after_s: float = Field(
        60.0,
        gt=0,
        description="Progress frozen this long, with requests in flight and power below the "
        "SKU's stall band, is a stalled rollout, s (rlenergy_agent.stalls).",
    )
    sim_gpus: int = Field(8, ge=1, le=16, description="GPUs of the sim backend.")
    sim_sku: str = Field("h100-sxm", description="SKU of the sim backend (rlenergy.gpu.models).")
