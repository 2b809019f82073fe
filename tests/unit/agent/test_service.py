"""Agent core end to end on the stand-in: SDK -> Unix socket (bearer token) -> clocks,
phase energy vs truth, report, metrics, pod-resources map, report writer."""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from agent_support import DriverFactory, FakeReviews, standin_agent
from rlenergy_agent import identity, kube, metrics, podmap, pods, server, service
from rlenergy_agent.kubeapi import ApiException
from rlenergy_dev import standin

from rlenergy.api import node as api_node
from rlenergy.sdk import trainer, verl, verl_hook

POD_A = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
POD_B = service.PodRef("team-b", "rollout-0", "66666666-7777-8888-9999-000000000000")

PLAN = api_node.ClockPlan(
    step=0,
    phases=[
        api_node.PhasePlan(phase="generation", clockMHz=1395, state="locked"),
        api_node.PhasePlan(phase="training", clockMHz=None, state="locked"),
    ],
)


def _agent(drv: standin.StandinDriver, pods: dict[service.PodRef, list[str]]) -> service.Agent:
    return standin_agent(pods, PLAN, lambda: drv.virtual_s)


def test_sdk_signals_apply_clocks_and_meter_phases_within_1_percent(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    drv = make_driver(4)
    a_gpus, b_gpus = list(drv.uuids[:2]), list(drv.uuids[2:])
    agent = _agent(drv, {POD_A: a_gpus, POD_B: b_gpus})
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        client = reviews.client(sock, POD_A, short_tmp, strict=True)
        cb = verl.RLEnergyVerlCallback(client)
        step_metrics: dict[int, dict[str, float]] = {}
        for step in range(2):
            cb.on_generation_start(step)
            assert all(drv.gpu(u).locked and drv.gpu(u).lock_max_mhz == 1395 for u in a_gpus)
            assert not any(drv.gpu(u).locked for u in b_gpus)  # not the caller's GPUs
            drv.set_work(a_gpus, "generation", f"gen-{step}")
            for _ in range(100):
                drv.advance(0.1)
                agent.meter.sample()
                agent.observe()
            cb.on_generation_progress(1000.0)
            cb.on_training_start(step)
            assert not any(drv.gpu(u).locked for u in a_gpus)  # training: default governor
            drv.set_work(a_gpus, "training", f"train-{step}")
            for _ in range(60):
                drv.advance(0.1)
                agent.meter.sample()
            drv.set_work(a_gpus, "idle", "idle")
            step_metrics[step] = cb.on_step_end(
                step,
                verl_hook.TrainedBatch(
                    samples=8,
                    aborted_samples=0,
                    valid_tokens=800.0,
                    response_tokens=800.0,
                    prompt_tokens=400.0,
                ),
            )
        report = agent.report()
        assert [s.step for s in report.steps] == [0, 1]
        for rec in report.steps:
            by = {p.phase: p for p in rec.phases}
            gen_truth = sum(drv.truth_j(u, f"gen-{rec.step}") for u in a_gpus)
            train_truth = sum(drv.truth_j(u, f"train-{rec.step}") for u in a_gpus)
            assert by["generation"].energy_joules == pytest.approx(gen_truth, rel=0.01)
            assert by["training"].energy_joules == pytest.approx(train_truth, rel=0.01)
            assert by["generation"].requested_clock_mhz == 1395
            assert by["generation"].applied_clock_mhz == 1395
            assert by["generation"].energy_source == "counter"
            assert rec.workload.valid_tokens == 800.0
            # the step's answer carries the same energy back to the trainer (rlenergy/* keys)
            m = step_metrics[rec.step]
            assert m["rlenergy/energy/generation_j"] == by["generation"].energy_joules
            assert m["rlenergy/energy/training_j"] == by["training"].energy_joules
            assert m["rlenergy/valid_tokens"] == 800.0
            assert m["rlenergy/energy_per_valid_token_j"] == pytest.approx(
                (by["generation"].energy_joules + by["training"].energy_joules) / 800.0
            )
        assert report.steps[0].phases[0].progress == 1000.0
        # energy of GPUs no pod holds is not dropped: POD_B holds its GPUs here,
        # so nothing is unattributed; the totals cover every GPU
        assert report.measured_joules_total > 0
        # a pod signalling another pod's GPU is refused
        intruder = reviews.client(sock, POD_A, short_tmp, strict=True, gpus=[b_gpus[0]])
        with pytest.raises(trainer.AgentRefusedError, match="does not hold GPU") as info:
            intruder.phase("generation", step=2)
        assert info.value.status == 403
        client.close()
        assert not any(drv.gpu(u).locked for u in b_gpus)
    finally:
        srv.stop()


def test_unknown_caller_is_refused(make_driver: DriverFactory, short_tmp: Path) -> None:
    drv = make_driver(2)
    agent = _agent(drv, {POD_A: list(drv.uuids)})
    sock = short_tmp / "agent.sock"
    reviews = FakeReviews()
    srv = server.SignalServer(sock, agent, reviews.authenticator())
    srv.start()
    try:
        # no token file at all: 401, and the message says what to mount
        stranger = trainer.RLEnergyClient(
            str(sock), strict=True, token_file=str(short_tmp / "absent")
        )
        with pytest.raises(trainer.AgentRefusedError, match="Bearer") as info:
            stranger.phase("generation", step=0)
        assert info.value.status == 401
        # a token that is not even JWT-shaped: 401 without asking the API server
        (short_tmp / "forged").write_text("eyJ.eyJ.forged")
        forged = trainer.RLEnergyClient(
            str(sock), strict=True, token_file=str(short_tmp / "forged")
        )
        with pytest.raises(trainer.AgentRefusedError, match="not a JWT") as info:
            forged.phase("generation", step=0)
        assert info.value.status == 401 and reviews.calls == 0
        # a valid token of a pod that holds no GPU here: 403
        other = reviews.client(sock, POD_B, short_tmp, strict=True)
        with pytest.raises(trainer.AgentRefusedError, match="holds no GPU") as info:
            other.phase("generation", step=0)
        assert info.value.status == 403
        assert not any(drv.gpu(u).locked for u in drv.uuids)
        assert agent.refused == 5  # each 401 is retried once after re-reading the token
    finally:
        srv.stop()


def test_sdk_without_agent_carries_on(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    absent = str(short_tmp / "absent.sock")
    client = trainer.RLEnergyClient(absent)
    with caplog.at_level(logging.WARNING, logger=trainer.__name__):
        client.phase("generation", step=0)  # never raises
        client.progress(5)
        assert client.park(0) == {}  # an unreachable agent answers nothing
        client.end_step(0, samples=1, response_tokens=1, prompt_tokens=1, valid_tokens=1)
    client.close()
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1, [r.getMessage() for r in caplog.records]  # logs once
    assert absent in unreachable[0].getMessage()
    assert client.last_response == {}
    # The same call in strict mode raises: the lenient client really swallowed an error.
    with pytest.raises(OSError):
        trainer.RLEnergyClient(absent, strict=True).phase("generation", step=0)


def test_case22_unattributed_bucket_and_clocks_only_on_allocated_gpus(
    make_driver: DriverFactory,
) -> None:
    # A privileged pod sees all 8 GPUs but the kubelet allocated 1: only that one is clocked;
    # energy of GPUs no pod holds goes to the unattributed bucket, never dropped.
    drv = make_driver(8)
    agent = _agent(drv, {POD_A: [drv.uuids[5]]})
    agent.phase(POD_A, "generation", 0)
    assert [u for u in drv.uuids if drv.gpu(u).locked] == [drv.uuids[5]]
    drv.advance(10.0)
    agent.meter.sample()
    report = agent.report()
    per_gpu = {g.uuid: g.energy_joules_total for g in report.gpus}
    assert report.unattributed_joules_total == pytest.approx(
        sum(j for u, j in per_gpu.items() if u != drv.uuids[5])
    )
    assert report.unattributed_joules_total > 0
    with pytest.raises(service.SignalRefused):
        agent.phase(POD_B, "generation", 0)  # holds no GPU here


def test_case27_declared_generation_at_zero_utilisation_stays_generation(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    agent = _agent(drv, {POD_A: list(drv.uuids)})
    agent.phase(POD_A, "generation", 0)
    drv.set_work(drv.uuids, "idle")  # 0 % utilisation for 120 s
    for _ in range(120):
        drv.advance(1.0)
        agent.meter.sample()
    assert all(agent.phase_of[u] == "generation" for u in drv.uuids)
    assert all(drv.gpu(u).lock_max_mhz == 1395 for u in drv.uuids)
    text = metrics.render(agent).decode()
    assert (
        f'rlenergy_agent_gpu_phase_info{{gpu_uuid="{drv.uuids[0]}",namespace="team-a",node="node-1",phase="generation",pod="trainer-0",policy="pol"}} 1.0'
        in text
    )


def test_metrics_and_ops_endpoints(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    agent = _agent(drv, {POD_A: list(drv.uuids)})
    agent.phase(POD_A, "generation", 0)
    drv.advance(5.0)
    agent.phase(POD_A, "training", 0)
    healthy = [True]
    ops = server.OpsServer("127.0.0.1", 0, agent, lambda: healthy[0], lambda: True)
    ops.start()
    try:
        base = f"http://127.0.0.1:{ops.port}"
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert "rlenergy_agent_gpu_phase_energy_joules_total{" in text
        assert "rlenergy_agent_gpu_phase_seconds_total{" in text
        assert (
            f'rlenergy_agent_gpu_sm_clock_hertz{{gpu_uuid="{drv.uuids[0]}",kind="requested",node="node-1"}}'
            not in text
        )  # training: default
        assert 'rlenergy_agent_nvml_up{node="node-1"} 1.0' in text
        assert "rlenergy_agent_energy_samples_rejected_total" in text
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as resp:
            assert resp.status == 200
        healthy[0] = False
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{base}/healthz", timeout=5)
        assert info.value.code == 503
        info.value.close()
    finally:
        ops.stop()


def test_case11a_all_gpus_unknown_fails_liveness(make_driver: DriverFactory) -> None:
    from rlenergy_agent import __main__ as main

    drv = make_driver(2)
    agent = _agent(drv, {POD_A: list(drv.uuids)})
    assert main.nvml_healthy(agent)
    drv.state.fail_all = standin.UNKNOWN
    assert not main.nvml_healthy(agent)
    assert (
        'rlenergy_agent_nvml_up{node="node-1"} 0.0'
        in metrics.render(agent, lambda: main.nvml_healthy(agent)).decode()
    )


def test_pod_end_and_policy_removal_reset_clocks(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    agent = _agent(drv, {POD_A: [drv.uuids[0]], POD_B: [drv.uuids[1]]})
    agent.phase(POD_A, "generation", 0)
    agent.phase(POD_B, "generation", 0)
    agent.pod_gone(POD_A)
    assert not drv.gpu(drv.uuids[0]).locked and drv.gpu(drv.uuids[1]).locked
    agent.set_plan(None)
    assert not drv.gpu(drv.uuids[1]).locked
    assert all(g.reset_acknowledged for g in agent.report().gpus)


def test_podresources_client_against_a_fake_kubelet(short_tmp: Path) -> None:
    sock = str(short_tmp / "kubelet.sock")
    alloc = {
        ("team-a", "trainer-0"): {"nvidia.com/gpu": ["GPU-b", "GPU-a"]},
        ("team-a", "cpu-only"): {"example.com/foo": ["x"]},
        ("team-b", "mig-user"): {"nvidia.com/mig-1g.10gb": ["MIG-GPU-c-0"]},
    }
    srv = podmap.serve_fake_kubelet(sock, lambda: alloc)
    try:
        client = podmap.PodResourcesClient(sock)
        listed = client.refresh()
        assert listed == {
            service.PodRef("team-a", "trainer-0"): ("GPU-b", "GPU-a"),
            service.PodRef("team-b", "mig-user"): ("MIG-GPU-c-0",),
        }
        assert client.devices_of(service.PodRef("team-a", "trainer-0")) == ("GPU-b", "GPU-a")
        assert client.devices_of(service.PodRef("team-a", "cpu-only")) == ()
        client.close()
    finally:
        srv.stop(None)


def test_signals_read_the_kubelet_listing_the_node_loop_keeps_fresh(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    """The signal path makes no kubelet call: the node loop lists (``keep_fresh``).

    A caller the listing does not know yet (started since) has it listed again at once; such
    rechecks come at most every ``RECHECK_S``.
    """
    drv = make_driver(2)
    sock = str(short_tmp / "kubelet.sock")
    alloc = {("team-a", "trainer-0"): {"nvidia.com/gpu": [drv.uuids[0]]}}
    lists: list[int] = []

    def listing() -> dict[tuple[str, str], dict[str, list[str]]]:
        lists.append(1)
        return alloc

    srv = podmap.serve_fake_kubelet(sock, listing)
    client = podmap.PodResourcesClient(sock, max_age_s=60.0)
    try:
        agent = standin_agent({}, PLAN, lambda: drv.virtual_s)
        agent.podmap = client
        assert isinstance(client, pods.ListedPodMap)
        client.keep_fresh()
        assert len(lists) == 1
        caller = identity.Caller("team-a", "trainer-0", "uid-trainer-0", "node-1", "sa")
        for step in range(5):
            pod = identity.authorize(agent, caller)
            agent.phase(pod, "generation", step)
        assert len(lists) == 1  # five signals, no kubelet call
        alloc[("team-a", "trainer-1")] = {"nvidia.com/gpu": [drv.uuids[1]]}
        late = identity.Caller("team-a", "trainer-1", "uid-trainer-1", "node-1", "sa")
        assert identity.authorize(agent, late).name == "trainer-1"  # listed again at once
        assert len(lists) == 2
        ghost = identity.Caller("team-a", "ghost", "uid-ghost", "node-1", "sa")
        with pytest.raises(identity.AuthError, match="holds no GPU"):
            identity.authorize(agent, ghost)
        assert len(lists) == 2  # within RECHECK_S of the last recheck: not listed again
        client.keep_fresh()
        assert len(lists) == 3
    finally:
        client.close()
        srv.stop(None)


def test_a_pod_recreated_under_its_name_with_other_gpus_is_listed_again(
    make_driver: DriverFactory, short_tmp: Path
) -> None:
    """The kubelet allocates a re-created pod afresh: its GPUs may differ from the listing's
    pod of that name. The agent lists again before it refuses a GPU as foreign."""
    drv = make_driver(2)
    sock = str(short_tmp / "kubelet.sock")
    alloc = {("team-a", "trainer-0"): {"nvidia.com/gpu": [drv.uuids[0]]}}
    now = [0.0]
    srv = podmap.serve_fake_kubelet(sock, lambda: alloc)
    client = podmap.PodResourcesClient(sock, max_age_s=60.0, clock=lambda: now[0])
    try:
        agent = standin_agent({}, PLAN, lambda: drv.virtual_s)
        agent.podmap = client
        client.keep_fresh()
        old = identity.Caller("team-a", "trainer-0", "uid-old", "node-1", "sa")
        assert identity.authorize(agent, old, [drv.uuids[0]]).name == "trainer-0"
        # Deleted and created again under its name; the kubelet gave it the other GPU.
        alloc[("team-a", "trainer-0")] = {"nvidia.com/gpu": [drv.uuids[1]]}
        new = identity.Caller("team-a", "trainer-0", "uid-new", "node-1", "sa")
        listings = client.listings
        assert identity.authorize(agent, new, [drv.uuids[1]]).uid == "uid-new"
        assert client.listings == listings + 1
        with pytest.raises(identity.AuthError, match="does not hold GPU") as err:
            identity.authorize(agent, new, [drv.uuids[0]])  # its old GPU: not its own now
        assert err.value.status == 403
        assert client.listings == listings + 1  # within RECHECK_S: not listed again
    finally:
        client.close()
        srv.stop(None)


def test_a_step_record_is_built_again_only_when_its_inputs_change(
    make_driver: DriverFactory,
) -> None:
    """``report()`` reuses a finished step's record until a window, its workload, its idle
    energy and time or a park's released time of that step changes; a policy switch drops them
    all."""
    drv = make_driver(2)
    agent = _agent(drv, {POD_A: list(drv.uuids)})
    work = api_node.TokenWorkloadReport(
        samples=1, response_tokens=10, prompt_tokens=5, valid_tokens=10, mean_context_tokens=8
    )
    for step in (0, 1):
        for phase in ("generation", "training", "idle"):
            agent.phase(POD_A, phase, step)
            drv.advance(0.5)
        agent.end_step(POD_A, step, work)
    first = {r.step: r for r in agent.report().steps}
    again = {r.step: r for r in agent.report().steps}
    assert all(again[s] is first[s] for s in (0, 1))  # nothing changed: reused
    agent.end_step(POD_A, 0, work.model_copy(update={"valid_tokens": 20}))
    agent.phase(POD_A, "training", 1)  # a late window of step 1
    drv.advance(0.5)
    agent.phase(POD_A, "idle", 1)
    drv.advance(0.5)
    agent.end_step(POD_A, 1, work)
    now = {r.step: r for r in agent.report().steps}
    assert now[0] is not first[0] and now[0].workload.valid_tokens == 20
    assert now[1] is not first[1]
    train = {p.phase: p for p in now[1].phases}["training"]
    assert train.gpu_seconds == pytest.approx(
        2 * {p.phase: p for p in first[1].phases}["training"].gpu_seconds
    )
    assert now[1].idle_energy_joules > first[1].idle_energy_joules
    # Idle time over the GPUs: each idle window 0.5 s on 2 GPUs; step 1 has two after the
    # late window.
    assert first[0].idle_gpu_seconds == first[1].idle_gpu_seconds == pytest.approx(2 * 0.5)
    assert now[1].idle_gpu_seconds == pytest.approx(2 * 2 * 0.5)
    assert now == {r.step: r for r in agent.report().steps}
    agent.switch_policy("other")
    assert agent.record_cache == {} and agent.report().steps == []


class _FakeCustomObjects:
    """Records calls with the CustomObjectsApi signature; fails as told."""

    def __init__(self, failures: list[int]) -> None:
        self.failures = failures
        self.objects: dict[tuple[str, str, str, str, str], dict[str, Any]] = {}
        self.calls: list[str] = []

    def _fail(self) -> None:
        if self.failures:
            raise ApiException(status=self.failures.pop(0))

    def patch_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        self.calls.append("patch")
        self._fail()
        key = (group, version, namespace, plural, name)
        if key not in self.objects:
            raise ApiException(status=404)
        self.objects[key]["spec"] = body["spec"]
        return self.objects[key]

    def create_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        self.calls.append("create")
        self._fail()
        self.objects[(group, version, namespace, plural, body["metadata"]["name"])] = body
        return body


def test_report_writer_creates_then_patches_with_backoff(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    agent = _agent(drv, {POD_A: list(drv.uuids)})
    api = _FakeCustomObjects([])
    sleeps: list[float] = []
    writer = kube.ReportWriter(api, "team-a", "pol", "node-1", sleep=sleeps.append)
    writer.write(agent.report())
    key = ("rlenergy.io", "v1alpha1", "team-a", "rlenergynodereports", "pol-node-1-71c16b01b4")
    assert api.calls == ["patch", "create", "patch"]  # the last: the old-named report, retired
    obj = api.objects[key]
    assert obj["kind"] == "RLEnergyNodeReport" and obj["apiVersion"] == "rlenergy.io/v1alpha1"
    assert obj["spec"]["nodeName"] == "node-1" and obj["spec"]["policyName"] == "pol"
    api.failures = [503, 429]
    writer.write(agent.report())
    assert api.calls[-3:] == ["patch", "patch", "patch"] and sleeps == [0.5, 1.0]
    api.failures = [403]
    with pytest.raises(ApiException):
        writer.write(agent.report())
    assert writer.writes == 2


def test_metrics_count_idle_energy_and_tokens_past_the_kept_records(
    make_driver: DriverFactory,
) -> None:
    """Phase energies (idle windows included) add up to the GPUs' whole energy, and the valid
    token counter keeps counting when old step records are trimmed from the report."""
    from prometheus_client.parser import text_string_to_metric_families

    drv = make_driver(2)
    agent = _agent(drv, {POD_A: list(drv.uuids)})
    steps = service.MAX_STEPS_KEPT + 8
    tokens = api_node.TokenWorkloadReport(
        samples=8, responseTokens=800, promptTokens=80, validTokens=700, meanContextTokens=110
    )
    for step in range(steps):
        for phase, seconds in (("generation", 2.0), ("idle", 0.5), ("training", 3.0)):
            agent.phase(POD_A, phase, step)
            drv.advance(seconds)
            agent.meter.sample()
        agent.phase(POD_A, "idle", step)
        drv.advance(0.25)
        agent.end_step(POD_A, step, tokens)
    agent.end_step(POD_A, steps - 1, tokens)  # a repeated end of a step is not counted twice
    agent.saving_ratio = kube.saving_ratios(
        {
            "phases": [
                {"name": "generation", "saving": {"percent": 12.5}},
                {"name": "training", "saving": {}},
            ],
            "totals": {"savingPercent": -1.25},
        }
    )
    assert len(agent.report().steps) <= service.MAX_STEPS_KEPT < steps
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(metrics.render(agent).decode())
        for s in f.samples
    }
    energy_by_phase: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "rlenergy_agent_gpu_phase_energy_joules_total":
            phase = dict(labels)["phase"]
            energy_by_phase[phase] = energy_by_phase.get(phase, 0.0) + value
    assert set(energy_by_phase) == {"generation", "idle", "training"}
    whole = sum(t for u in drv.uuids if (t := agent.meter.total_j(u)) is not None)
    assert sum(energy_by_phase.values()) == pytest.approx(whole, rel=1e-9)
    job = (("node", "node-1"), ("policy", "pol"))
    assert samples[("rlenergy_agent_valid_tokens_total", job)] == steps * 700
    gen = (("node", "node-1"), ("phase", "generation"), ("policy", "pol"))
    assert samples[("rlenergy_agent_saving_ratio", gen)] == 0.125
    assert not any(
        n == "rlenergy_agent_saving_ratio" and ("phase", "training") in labels
        for n, labels in samples
    )
    assert samples[("rlenergy_agent_job_saving_ratio", job)] == -0.0125
