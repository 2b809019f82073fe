"""Shared GPUs are booked once, through the real agent over the stand-in.

A MIG GPU split 3g + 2g + 1g + 1g (profile sizes from NVML's ``nvmlDeviceGetAttributes``) with
two pods of one job holding the 3g and a 1g, and the 2g instance, and a time-sliced GPU (device
plugin replicas ``<uuid>::0``, ``<uuid>::1``) held by two pods: every pod's window books its
share of the physical GPU's energy, proportional to its instances' slices, so the step's energy
and the per-GPU metrics count each GPU once (the MIG job 6/7 of it: the unheld 1g instance
stays unbooked; with equal weights it would be 3/4).
"""

from __future__ import annotations

import pytest
from agent_support import DriverFactory, energy_sources
from prometheus_client.parser import text_string_to_metric_families
from rlenergy_agent import actuator, energy, metrics, service, shares
from rlenergy_agent.nvml import backend

from rlenergy.api import node as api_node

pytestmark = pytest.mark.field

PLAN = api_node.ClockPlan(step=0, phases=[api_node.PhasePlan(phase="generation", state="locked")])


def _pod(name: str) -> service.PodRef:
    return service.PodRef("team-a", name, f"uid-{name}")


def test_mig_and_time_sliced_gpus_count_once(make_driver: DriverFactory):
    drv = make_driver(2)
    mig_gpu, sliced_gpu = drv.uuids
    g = drv.gpu(mig_gpu)
    g.mig_mode, g.mig_count = 1, 4
    for i, n in enumerate((3, 2, 1, 1)):  # 3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb
        g.mig_slices[i] = n
    found = backend.discover()
    caps = {u: gpu.probe() for u, gpu in found.gpus.items()}
    migs = found.gpus[mig_gpu].mig_uuids
    assert len(migs) == 4
    assert [found.gpus[mig_gpu].mig_slices[m] for m in migs] == [3, 2, 1, 1]
    act = actuator.Actuator(found.gpus, actuator.LockStateFile(None), clock=lambda: drv.virtual_s)
    act.start(mig_uuids={u: gpu.mig_uuids for u, gpu in found.gpus.items()})
    meter = energy.EnergyMeter(found.gpus, energy_sources(caps), clock=lambda: drv.virtual_s)
    meter.sample()
    a, b, c, d = (_pod(n) for n in ("rank-0", "rank-1", "slice-0", "slice-1"))
    pods = service.StaticPodMap(
        {
            a: [migs[0], migs[3]],  # 3g + 1g: 4 of 7 slices
            b: [migs[1]],  # 2g: 2 of 7
            c: [f"{sliced_gpu}::0"],
            d: [f"{sliced_gpu}::1"],
        }
    )
    mig_parent = {m: mig_gpu for m in migs}
    agent = service.Agent(
        "gpu-a", "pol", act, meter, pods, mig_parent=mig_parent, clock=lambda: drv.virtual_s
    )
    agent.set_plan(PLAN)
    drv.set_work(drv.uuids, "generation")
    start = {u: drv.truth_j(u) for u in drv.uuids}
    for p in (a, b, c, d):
        agent.phase(p, "generation", 0)
    drv.advance(10.0)
    agent.meter.sample()
    for p in (a, b, c, d):
        agent.phase(p, "idle", 0)
    used = {u: drv.truth_j(u) - start[u] for u in drv.uuids}
    (gen,) = [w for w in agent.step_record(0).phases if w.phase == "generation"]
    want = used[mig_gpu] * 6 / 7 + used[sliced_gpu]
    assert gen.energy_joules == pytest.approx(want, rel=0.01)  # not 2x, nor 3/4 by count
    # per-GPU metrics: each physical GPU's generation energy at most once
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render(agent).decode())}
    per_gpu: dict[str, float] = {}
    for s in fams["rlenergy_agent_gpu_phase_energy_joules"].samples:
        if s.labels["phase"] == "generation":
            per_gpu[s.labels["gpu_uuid"]] = per_gpu.get(s.labels["gpu_uuid"], 0.0) + s.value
    assert per_gpu[mig_gpu] == pytest.approx(used[mig_gpu] * 6 / 7, rel=0.01)
    assert per_gpu[sliced_gpu] == pytest.approx(used[sliced_gpu], rel=0.01)
    # the time-sliced replicas resolve to the physical GPU (signals and clocks)
    assert agent.gpus_of(c)[0] == (sliced_gpu,)


def test_share_rules():
    mig = {"MIG-1": "GPU-a", "MIG-2": "GPU-a", "MIG-3": "GPU-a"}
    inst = {"GPU-a": ["MIG-1", "MIG-2", "MIG-3"]}
    got = shares.shares(
        {"p": ["MIG-1", "MIG-2"], "q": ["GPU-b::0"], "r": ["GPU-b::1", "GPU-b::2"], "s": ["GPU-c"]},
        mig,
        inst,
    )
    assert got == {
        ("p", "GPU-a"): pytest.approx(2 / 3),
        ("q", "GPU-b"): pytest.approx(1 / 3),
        ("r", "GPU-b"): pytest.approx(2 / 3),
        ("s", "GPU-c"): 1.0,
    }
    # profile sizes weigh the MIG instances: p holds 2 + 1 of 2 + 1 + 4 slices
    weighted = shares.shares({"p": ["MIG-1", "MIG-2"]}, mig, inst, {"MIG-1": 2, "MIG-3": 4})
    assert weighted == {("p", "GPU-a"): pytest.approx(3 / 7)}
    assert shares.physical("GPU-b::12", {}) == "GPU-b"
    assert shares.physical("GPU-b::x", {}) == "GPU-b::x"
    assert shares.physical("MIG-2", mig) == "GPU-a"
