"""Engine sleeps: a sleep's saving is claimed only after the GPUs show it.

A colocated rollout engine is put to sleep between generation and training (verl's
``sleep_replicas``: vLLM's sleep mode offloads the weights and frees the KV cache; SGLang's
``release_memory_occupation`` does the same). The trainer signals the sleep twice
(``/v1/sleep``: ``begin`` before the call, ``end`` after it returned); at each the agent reads
every GPU of the pod: framebuffer memory in use (NVML ``nvmlDeviceGetMemoryInfo``) and power
(the instant power field where the GPU has one, else NVML's 1 s average). The check
(:func:`judge`) is ``Verified`` only when memory and power both dropped on every GPU; then the
power freed is the sleep's saving (``SleepCheck.saved_watts``). A sleep that was signalled but
left memory or power where it was (the engine did not release, or kept working) is a
``Mismatch``: logged, listed in the node report (``sleepChecks``) and counted in
``rlenergy_agent_sleep_checks{result}``; nothing is claimed. A reading that failed is
``Unknown``, claimed neither.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Mapping

from rlenergy.api import node as api_node
from rlenergy.gpu import base, errors
from rlenergy_agent.pods import PodRef
from rlenergy_agent.state import AgentState, SignalRefused

log = logging.getLogger("rlenergy_agent.service")

MEMORY_DROP_MIN_FRACTION = 0.5
"""Share of the memory in use at the sleep's start that must be freed [MODEL]: vLLM's sleep
level 1 offloads the weights and discards the KV cache, which hold nearly all of an engine's
memory at verl's ``gpu_memory_utilization`` (0.5 to 0.9); an engine that released less than
half did not sleep."""
POWER_DROP_MIN_W = 5.0
"""Smallest power drop taken as a drop, W: the accuracy of the board's power reading
(nvidia-smi's manual, "Power Draw": accurate to within +/- 5 W)."""
SLEEPS_KEPT = 64
"""Sleep checks kept for the node report (newest last; ``NodeReport.sleep_checks``)."""


@dataclasses.dataclass(frozen=True)
class Reading:
    """One GPU at one instant: memory in use (bytes) and power (W); ``None``: unread."""

    memory_bytes: int | None
    power_w: float | None


def read(gpu: object) -> Reading:
    """Read ``gpu``'s memory in use and power; a failed or unsupported read is ``None``."""
    memory: int | None = None
    power: float | None = None
    if isinstance(gpu, base.MemoryReading):
        try:
            memory = gpu.memory_used_bytes()
        except errors.GpuError:
            memory = None
    if isinstance(gpu, base.Gpu):
        try:
            power = gpu.instant_power_mw() / 1000.0
        except errors.GpuError:
            try:
                power = gpu.power_usage_mw() / 1000.0
            except errors.GpuError:
                power = None
    return Reading(memory, power)


def judge(
    before: Mapping[str, Reading], after: Mapping[str, Reading]
) -> tuple[api_node.SleepResult, str, float | None]:
    """Whether a sleep freed memory and power on every GPU.

    Args:
        before: GPU UUID -> reading at the sleep's start.
        after: GPU UUID -> reading after the sleep returned (same GPUs).

    Returns:
        ``(result, reason, saved_watts)``: ``saved_watts`` (the power drop summed over the
        GPUs, W) only when ``Verified``; ``reason`` names each GPU and what did not drop.
    """
    missing: list[str] = []
    kept: list[str] = []
    saved = 0.0
    for uuid, b in before.items():
        a = after.get(uuid, Reading(None, None))
        if None in (b.memory_bytes, a.memory_bytes, b.power_w, a.power_w):
            missing.append(uuid)
            continue
        assert b.memory_bytes is not None and a.memory_bytes is not None
        assert b.power_w is not None and a.power_w is not None
        what = []
        if a.memory_bytes > b.memory_bytes * (1.0 - MEMORY_DROP_MIN_FRACTION):
            what.append(f"memory {b.memory_bytes / 2**30:.1f} -> {a.memory_bytes / 2**30:.1f} GiB")
        if b.power_w - a.power_w < POWER_DROP_MIN_W:
            what.append(f"power {b.power_w:.0f} -> {a.power_w:.0f} W")
        if what:
            kept.append(f"{uuid}: {', '.join(what)}")
        saved += max(b.power_w - a.power_w, 0.0)
    if kept:
        return "Mismatch", "did not drop: " + "; ".join(kept), None
    if missing or not before:
        return "Unknown", "unread: " + (", ".join(missing) or "no GPU"), None
    return "Verified", "", round(saved, 3)


class SleepChecks(AgentState):
    """Engine sleep checks of ``service.Agent`` (a mixin over ``state.AgentState``)."""

    def _init_sleeps(self) -> None:
        self.sleeping: dict[PodRef, tuple[int, dict[str, Reading]]] = {}
        """Per pod, the step and readings of its sleep's ``begin``."""
        self.sleep_checks: collections.deque[api_node.SleepCheck] = collections.deque(
            maxlen=SLEEPS_KEPT
        )
        self.sleep_results: dict[str, int] = {}
        """Checks per result (a counter for /metrics)."""

    def _read_pod(self, pod: PodRef) -> dict[str, Reading]:
        gpus, _ = self.gpus_of(pod)
        if not gpus:
            self.refused += 1
            raise SignalRefused(f"pod {pod} holds no GPU on node {self.node_name}", 404)
        return {u: read(self.actuator.gpus[u]) for u in gpus}

    def sleep(self, pod: PodRef, step: int, stage: str) -> api_node.SleepCheck | None:
        """Read the pod's GPUs at a sleep's ``begin``; at its ``end``, read again and judge.

        Returns:
            The check at ``end`` (also kept for the node report); ``None`` at ``begin``.

        Raises:
            SignalRefused: the pod holds no GPU here (404), or ``end`` came without a
                ``begin`` of the same step (409).
        """
        with self._lock:
            readings = self._read_pod(pod)
            if stage == "begin":
                self.sleeping[pod] = (step, readings)
                return None
            began = self.sleeping.pop(pod, None)
            if began is None or began[0] != step:
                raise SignalRefused(f"sleep end of step {step} without its begin", 409)
            result, reason, saved = judge(began[1], readings)
            check = api_node.SleepCheck(
                pod=f"{pod.namespace}/{pod.name}",
                step=step,
                result=result,
                reason=reason[:1024],
                saved_watts=saved,
                gpus=[
                    api_node.SleepGpuReading(
                        gpu=u,
                        memory_before_bytes=b.memory_bytes,
                        memory_after_bytes=readings[u].memory_bytes,
                        power_before_watts=b.power_w,
                        power_after_watts=readings[u].power_w,
                    )
                    for u, b in began[1].items()
                    if u in readings
                ],
            )
            self.sleep_checks.append(check)
            self.sleep_results[result] = self.sleep_results.get(result, 0) + 1
            self.report_due = True
        if result == "Mismatch":
            log.warning(
                "sleep of pod %s (step %d) signalled but not seen on its GPUs, no saving "
                "claimed: %s",
                check.pod,
                step,
                reason,
            )
        return check
