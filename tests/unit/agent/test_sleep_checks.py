"""Engine sleeps checked against the GPUs' memory and power, on the stand-in NVML.

SDK -> Unix socket (a pod's token) -> agent -> NVML (``nvmlDeviceGetMemoryInfo`` and the
instant power field of the stand-in ``libnvidia-ml.so.1``). We test these aspects:
* ``judge``: memory and power both dropped on every GPU is ``Verified`` with the power freed
  as the saving; memory kept, or power kept (an engine still decoding), is a ``Mismatch``
  naming the GPU and what stayed, with no saving; a failed read is ``Unknown``;
* a sleep the engine performed (memory freed, decode stopped) between ``sleep_begin`` and
  ``sleep_end``: ``Verified`` in the answer, the node report's ``sleepChecks`` and
  ``rlenergy_agent_sleep_checks{result="Verified"}``, with the readings NVML gave;
* a sleep signalled while the engine kept its memory and kept decoding: ``Mismatch``, no
  ``savedWatts``, a warning line, counted; a sleep whose memory read fails (NVML
  NOT_SUPPORTED) is ``Unknown``;
* ``sleep_end`` without its ``sleep_begin`` is refused (409) and nothing is booked.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from agent_support import DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import metrics, server, service, sleeps
from rlenergy_dev import standin

from rlenergy.api import node as api_node
from rlenergy.sdk import trainer

POD = service.PodRef("team-a", "rollout-0", "11111111-2222-3333-4444-555555555555")
PLAN = api_node.ClockPlan(
    step=0, phases=[api_node.PhasePlan(phase="generation", clockMHz=None, state="locked")]
)
GIB = 2**30
R = sleeps.Reading


def test_memory_and_power_dropped_on_every_gpu_is_verified() -> None:
    before = {"a": R(70 * GIB, 420.0), "b": R(68 * GIB, 400.0)}
    after = {"a": R(2 * GIB, 90.0), "b": R(3 * GIB, 95.0)}
    assert sleeps.judge(before, after) == ("Verified", "", 635.0)


@pytest.mark.parametrize(
    ("after_b", "what"),
    [
        (R(60 * GIB, 95.0), "b: memory 68.0 -> 60.0 GiB"),  # the engine kept its memory
        (R(3 * GIB, 398.0), "b: power 400 -> 398 W"),  # the engine kept decoding
    ],
)
def test_memory_or_power_kept_is_a_mismatch_with_no_saving(
    after_b: sleeps.Reading, what: str
) -> None:
    before = {"a": R(70 * GIB, 420.0), "b": R(68 * GIB, 400.0)}
    result, reason, saved = sleeps.judge(before, {"a": R(2 * GIB, 90.0), "b": after_b})
    assert (result, saved) == ("Mismatch", None)
    assert reason == f"did not drop: {what}"


def test_a_failed_read_is_unknown_and_claims_nothing() -> None:
    before = {"a": R(70 * GIB, 420.0)}
    assert sleeps.judge(before, {"a": R(None, 90.0)}) == ("Unknown", "unread: a", None)
    assert sleeps.judge({}, {}) == ("Unknown", "unread: no GPU", None)


def _metric(text: str, result: str) -> float | None:
    m = re.search(
        rf'^rlenergy_agent_sleep_checks_total{{[^}}]*result="{result}"}} (\S+)$', text, re.M
    )
    return float(m.group(1)) if m else None


def _serve(
    drv: standin.StandinDriver, short_tmp: Path
) -> tuple[service.Agent, server.SignalServer, trainer.RLEnergyClient]:
    agent = standin_agent({POD: list(drv.uuids)}, PLAN, lambda: drv.virtual_s)
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    return agent, srv, reviews.client(sock, POD, short_tmp, strict=True)


def _awake(drv: standin.StandinDriver) -> None:
    """The engine holds its weights and KV cache and decodes on every GPU."""
    drv.set_memory_used(drv.uuids, 70 * GIB)
    drv.set_work(drv.uuids, "generation", "gen-0")
    drv.advance(2.0)


def test_a_sleep_the_gpus_show_is_verified_and_reported(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    drv = make_driver(2)
    agent, srv, client = _serve(drv, short_tmp)
    try:
        _awake(drv)
        client.sleep_begin(0)
        drv.set_memory_used(drv.uuids)  # vLLM's sleep: weights offloaded, KV cache freed
        drv.set_work(drv.uuids, "idle")
        drv.advance(2.0)
        check = client.sleep_end(0)
    finally:
        srv.stop()
    assert check["result"] == "Verified" and check["savedWatts"] > 2 * sleeps.POWER_DROP_MIN_W
    assert check["reason"] == "" and [g["gpu"] for g in check["gpus"]] == list(drv.uuids)
    for g in check["gpus"]:
        assert g["memoryBeforeBytes"] == 70 * GIB
        assert g["memoryAfterBytes"] == standin.MEMORY_BASE_BYTES
        assert g["powerAfterWatts"] < g["powerBeforeWatts"]
    (reported,) = agent.report().sleep_checks
    assert reported.result == "Verified" and reported.saved_watts == check["savedWatts"]
    assert (reported.pod, reported.step) == ("team-a/rollout-0", 0)
    text = metrics.render(agent).decode()
    assert _metric(text, "Verified") == 1.0 and _metric(text, "Mismatch") is None


def test_a_sleep_the_gpus_do_not_show_is_flagged_and_claims_nothing(
    make_driver: DriverFactory, short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    drv = make_driver(2)
    agent, srv, client = _serve(drv, short_tmp)
    try:
        _awake(drv)
        client.sleep_begin(0)
        drv.advance(2.0)  # the engine's sleep did nothing: memory held, still decoding
        with caplog.at_level(logging.WARNING, logger="rlenergy_agent.service"):
            check = client.sleep_end(0)
        client.sleep_begin(1)
        drv.gpu(drv.uuids[0]).fail_memory = standin.NOT_SUPPORTED  # NVML cannot tell
        drv.set_memory_used(drv.uuids)
        drv.set_work(drv.uuids, "idle")
        drv.advance(2.0)
        unknown = client.sleep_end(1)
    finally:
        srv.stop()
    assert check["result"] == "Mismatch" and check.get("savedWatts") is None
    assert "memory 70.0 -> 70.0 GiB" in check["reason"] and " W" in check["reason"]
    assert any("no saving claimed" in r.getMessage() for r in caplog.records)
    assert unknown["result"] == "Unknown" and unknown.get("savedWatts") is None
    assert unknown["reason"] == f"unread: {drv.uuids[0]}"
    assert [c.result for c in agent.report().sleep_checks] == ["Mismatch", "Unknown"]
    text = metrics.render(agent).decode()
    assert _metric(text, "Mismatch") == 1.0 and _metric(text, "Unknown") == 1.0


def test_an_end_without_its_begin_is_refused(make_driver: DriverFactory, short_tmp: Path) -> None:
    drv = make_driver(1)
    agent, srv, client = _serve(drv, short_tmp)
    try:
        with pytest.raises(trainer.AgentRefusedError, match="409"):
            client.sleep_end(3)
        client.sleep_begin(3)
        with pytest.raises(trainer.AgentRefusedError, match="409"):
            client.sleep_end(4)
    finally:
        srv.stop()
    assert agent.report().sleep_checks == []
