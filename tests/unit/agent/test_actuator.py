"""Actuator: idempotent writes, read-back, observe mode, faults, stale-lock recovery."""

from __future__ import annotations

from pathlib import Path

from agent_support import DriverFactory, standin_actuator
from rlenergy_agent import actuator
from rlenergy_agent.nvml import lib
from rlenergy_dev import standin


def test_apply_is_idempotent_and_reads_back(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    drv.set_work(drv.uuids, "generation")
    act = standin_actuator(drv)
    u = drv.uuids[0]
    writes0 = drv.gpu(u).clock_writes
    r = act.apply(u, 1200)
    assert r.wrote and r.target_mhz == 1200 and r.effective_mhz == 1200 and r.error is None
    for _ in range(5):
        assert not act.apply(u, 1200).wrote
    assert drv.gpu(u).clock_writes == writes0 + 1
    r = act.apply(u, None)
    assert r.wrote and drv.gpu(u).locked == 0
    assert drv.gpu(drv.uuids[1]).locked == 0  # the other GPU was never touched


def test_observe_mode_never_writes(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    act = standin_actuator(drv, enforce=False)
    for u in drv.uuids:
        r = act.apply(u, 1200)
        assert r.skipped == "observe" and not r.wrote
        assert act.release([u], "test") == []
    assert all(drv.gpu(u).clock_writes == 0 for u in drv.uuids)
    assert act.reset_all("sigterm") == []
    assert all(drv.gpu(u).clock_writes == 0 for u in drv.uuids)


def test_case1_no_permission_turns_measure_only_with_a_visible_reason(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    bad, good = drv.uuids
    drv.gpu(bad).fail_clock_set = standin.NO_PERMISSION
    act = standin_actuator(drv)
    assert act.controls[bad].condition == "measureOnly"
    assert act.controls[bad].reason == "NoPermission (agent needs CAP_SYS_ADMIN)"
    r = act.apply(bad, 1410)
    assert r.skipped and not r.wrote and drv.gpu(bad).locked == 0
    assert act.apply(good, 1410).effective_mhz is not None
    assert drv.gpu(good).locked == 1
    # reads still work on the measure-only GPU
    assert act.gpus[bad].total_energy_mj() > 0


def test_case3_locked_clocks_not_supported_degrades_that_gpu_only(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(2)
    drv.gpu(drv.uuids[0]).fail_clock_set = standin.NOT_SUPPORTED
    act = standin_actuator(drv)
    assert act.controls[drv.uuids[0]].condition == "measureOnly"
    assert act.controls[drv.uuids[0]].reason.startswith("ClocksNotSupported")
    assert act.apply(drv.uuids[1], 1200).wrote
    # memory locks are off by default: the actuator never locks the memory clock
    assert all(drv.gpu(u).mem_locked == 0 for u in drv.uuids)


def test_case3_lock_accepted_but_effective_clock_lower(make_driver: DriverFactory) -> None:
    drv = make_driver(1)
    u = drv.uuids[0]
    drv.set_work([u], "training")
    drv.gpu(u).clock_cap_mhz = 1400
    act = standin_actuator(drv)
    r = act.apply(u, 1800)
    assert r.wrote and r.target_mhz == 1800
    assert r.effective_mhz == 1395 and r.slowdown


def test_case4_sigkill_then_restart_resets_the_stale_lock(
    make_driver: DriverFactory, tmp_path: Path
) -> None:
    drv = make_driver(2)
    drv.set_work(drv.uuids, "generation")
    state = tmp_path / "locks.json"
    act = standin_actuator(drv, state)
    act.apply(drv.uuids[1], 1100)
    assert drv.gpu(drv.uuids[1]).locked == 1
    assert drv.uuids[1] in state.read_text()
    del act  # SIGKILL: nothing reset
    lib.shutdown()
    restarted = standin_actuator(drv, state)
    assert restarted.recovered == [drv.uuids[1]]
    assert drv.gpu(drv.uuids[1]).locked == 0
    assert actuator.LockStateFile(state).locked == frozenset()


def test_case4_reset_all_on_sigterm_resets_every_lock(
    make_driver: DriverFactory, tmp_path: Path
) -> None:
    drv = make_driver(3)
    act = standin_actuator(drv, tmp_path / "locks.json")
    for u in drv.uuids:
        act.apply(u, 1500)
    assert all(drv.gpu(u).locked for u in drv.uuids)
    assert sorted(act.reset_all("SIGTERM")) == sorted(drv.uuids)
    assert not any(drv.gpu(u).locked for u in drv.uuids)
    assert actuator.LockStateFile(tmp_path / "locks.json").locked == frozenset()


def test_case5_persistence_off_reapplies_at_every_phase_switch(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    u = drv.uuids[0]
    drv.gpu(u).persistence_mode = 0
    drv.gpu(u).call_delay_us = 2000
    act = standin_actuator(drv)
    w0 = drv.gpu(u).clock_writes
    for _ in range(3):
        assert act.apply(u, 1200).wrote
    assert drv.gpu(u).clock_writes == w0 + 3
    stat = lib.CALL_STATS["nvmlDeviceSetGpuLockedClocks"]
    assert stat.max_s >= 0.002  # NVML call latency is measured (exported as a metric)


def test_case6_snapping_and_degenerate_lists(make_driver: DriverFactory) -> None:
    assert actuator.snap_clock_mhz(900, [937, 924, 912, 899, 887, 886, 873, 861]) == 899
    assert actuator.snap_clock_mhz(800, [937, 861]) is None
    drv = make_driver(2)
    irregular, single = drv.uuids
    drv.set_supported_clocks(irregular, [937, 924, 912, 899, 887, 886, 873, 861])
    drv.set_supported_clocks(single, [1380])
    drv.set_work(drv.uuids, "generation")
    act = standin_actuator(drv)
    r = act.apply(irregular, 900)
    assert (r.requested_mhz, r.target_mhz) == (900, 899)
    assert drv.gpu(irregular).lock_max_mhz == 899
    assert act.controls[single].condition == "measureOnly"
    assert act.controls[single].reason.startswith("ClockListUnavailable")
    assert act.apply(single, 1380).skipped and drv.gpu(single).locked == 0


def test_case7_mig_gpu_is_clocked_only_when_the_job_owns_every_instance(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    g = drv.gpu(drv.uuids[0])
    g.mig_mode, g.mig_count = 1, 7
    act = standin_actuator(drv)
    migs = act.controls[drv.uuids[0]].mig_uuids
    r = act.apply(drv.uuids[0], 1200, owner_uuids=migs[:2])
    assert r.skipped == "SharedMIGDevice" and g.locked == 0
    assert act.apply(drv.uuids[0], 1200, owner_uuids=migs).wrote and g.locked == 1


def test_case10_lost_gpu_skips_clock_actions(make_driver: DriverFactory) -> None:
    drv = make_driver(8)
    act = standin_actuator(drv)
    drv.gpu(drv.uuids[3]).fail_all = standin.GPU_IS_LOST
    r = act.apply(drv.uuids[3], 1200)
    assert r.error and "GpuLostError" in r.error
    assert act.controls[drv.uuids[3]].condition == "lost"
    assert act.apply(drv.uuids[3], 1300).skipped
    for u in drv.uuids[:3] + drv.uuids[4:]:
        assert act.apply(u, 1200).wrote


def test_case15_unknown_uuid_is_a_condition_not_a_crash(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    act = standin_actuator(drv)
    assert act.apply("GPU-vanished", 1200).skipped == "GPUNotFound"
