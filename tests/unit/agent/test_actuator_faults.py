"""Actuator paths the case tests leave open (found by mutation testing, docs/mutation.md).

Start-up recovery when a stale lock cannot be reset or names a GPU that left the node; clock
lists that cannot be read or hold two clocks; what the trainer's phase answer carries for a
skipped, refused or failed apply (``ApplyResult`` goes to the SDK as ``AppliedClock``); the
write count against the driver's; ``release`` bookkeeping. All over the stand-in NVML.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from agent_support import DriverFactory, standin_actuator
from rlenergy_agent import actuator
from rlenergy_agent.nvml import backend, lib
from rlenergy_dev import standin

LOGGER = "rlenergy_agent.actuator"


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_startup_recovery_goes_past_a_vanished_gpu_and_a_failed_reset(
    make_driver: DriverFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    drv = make_driver(3)
    bad, good, idle = sorted(drv.uuids)  # recovery goes in sorted order: bad before good
    state = tmp_path / "locks.json"
    act = standin_actuator(drv, state)
    act.apply(bad, 1200)
    act.apply(good, 1200)
    del act  # SIGKILL: both locks stay
    lib.shutdown()
    gone = "A-gpu-that-left"  # sorts before every GPU- UUID
    actuator.LockStateFile(state).add(gone)
    drv.gpu(bad).fail_clock_set = standin.UNKNOWN
    caplog.set_level(logging.INFO, logger=LOGGER)
    restarted = standin_actuator(drv, state)
    assert restarted.recovered == [good]
    assert drv.gpu(good).locked == 0 and drv.gpu(bad).locked == 1
    # what could not be reset stays on record, for the next start-up or reset_all
    assert actuator.LockStateFile(state).locked == {bad, gone}
    warnings = _messages(caplog, logging.WARNING)
    assert f"stale lock on GPU {gone}, which is no longer on this node" in warnings
    # docs/troubleshooting.md ("A GPU stays at a low clock ...") tells the operator to look for it
    assert f"recovered stale lock on GPU {good} (left by a previous agent run)" in warnings
    (err,) = [m for m in _messages(caplog, logging.ERROR) if bad in m]
    assert err.startswith(f"could not reset stale lock on {bad}: ")
    assert err.endswith("(NVML error 999)")  # what the driver answered
    assert restarted.controls[idle].condition == "ok"
    # the driver recovers: SIGTERM resets the lock the start-up could not (no lock made by
    # this run, only the record) and leaves the GPU that left the node on record
    drv.gpu(bad).fail_clock_set = 0
    assert restarted.reset_all("SIGTERM") == [bad]
    assert drv.gpu(bad).locked == 0
    assert actuator.LockStateFile(state).locked == {gone}


def test_persistence_mode_off_is_warned_per_gpu_and_unknown_means_on(
    make_driver: DriverFactory, caplog: pytest.LogCaptureFixture
) -> None:
    drv = make_driver(2)
    off, unknown = drv.uuids
    drv.set_work(drv.uuids, "generation")
    found = backend.discover()  # the stand-in reports persistence on for both
    caplog.set_level(logging.WARNING, logger=LOGGER)
    act = actuator.Actuator(found.gpus, actuator.LockStateFile(None))
    act.start(persistence={off: False})  # no answer for the other GPU
    warnings = _messages(caplog, logging.WARNING)
    assert warnings == [
        f"GPU {off}: persistence mode is off; clocks are re-applied at every phase switch "
        "(PersistenceModeOff)"
    ]
    assert act.controls[unknown].persistence is True
    w0 = drv.gpu(unknown).clock_writes
    assert act.apply(unknown, 1200).wrote
    assert not act.apply(unknown, 1200).wrote  # trusted to hold: one write
    assert drv.gpu(unknown).clock_writes == w0 + 1
    assert act.apply(off, 1200).wrote and act.apply(off, 1200).wrote


@pytest.mark.parametrize(
    ("code", "condition", "reason"),
    [
        (standin.GPU_IS_LOST, "lost", "GPULost: "),
        (standin.NOT_SUPPORTED, "measureOnly", "ClockListUnavailable: "),
        (standin.UNKNOWN, "measureOnly", "ClockListUnavailable: "),
    ],
)
def test_an_unreadable_clock_list_marks_that_gpu_and_start_up_goes_on(
    make_driver: DriverFactory, code: int, condition: str, reason: str
) -> None:
    drv = make_driver(2)
    broken, fine = drv.uuids  # the broken GPU comes first in discovery order
    drv.set_work(drv.uuids, "generation")
    drv.gpu(broken).fail_clocks = standin.NOT_SUPPORTED  # no clock list cached at discovery
    found = backend.discover()  # (discovery drops a GPU that is lost already)
    drv.gpu(broken).fail_clocks = code  # what the start-up's clock-list read meets
    act = actuator.Actuator(found.gpus, actuator.LockStateFile(None))
    act.start()
    ctl = act.controls[broken]
    assert ctl.condition == condition and ctl.reason.startswith(reason)
    assert len(ctl.reason) > len(reason)  # the NVML error is named
    r = act.apply(broken, 1200)
    assert (r.uuid, r.requested_mhz, r.target_mhz, r.wrote, r.skipped) == (
        broken,
        1200,
        None,
        False,
        ctl.reason,
    )
    assert act.controls[broken].requested_mhz == 1200  # the report shows what was asked
    assert act.controls[fine].condition == "ok" and act.controls[fine].supported_mhz
    assert act.apply(fine, 1200).wrote


def test_two_supported_clocks_are_enough_and_the_list_is_kept_descending(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(3)
    single, pair, full = drv.uuids
    drv.set_supported_clocks(single, [1410])
    drv.set_supported_clocks(pair, [1005, 1410])
    drv.set_work(drv.uuids, "generation")
    act = standin_actuator(drv)
    assert act.controls[single].condition == "measureOnly"
    assert act.controls[single].reason == "ClockListUnavailable: NVML lists 1 SM clock(s)"
    assert act.controls[pair].condition == "ok"
    assert act.controls[pair].supported_mhz == (1410, 1005)
    clocks = act.controls[full].supported_mhz
    assert len(clocks) > 2 and list(clocks) == sorted(clocks, reverse=True)
    r = act.apply(pair, 1300)
    assert (r.target_mhz, r.wrote) == (1005, True) and drv.gpu(pair).lock_max_mhz == 1005
    assert act.apply(full, 1300).wrote  # the GPU after the single-clock one was probed


def test_skipped_applies_answer_what_was_asked_and_wrote_nothing(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    g = drv.gpu(drv.uuids[0])
    g.mig_mode, g.mig_count = 1, 2
    act = standin_actuator(drv)
    u = drv.uuids[0]
    assert act.apply("GPU-vanished", 1200) == actuator.ApplyResult(
        "GPU-vanished", 1200, None, None, False, skipped="GPUNotFound"
    )
    assert act.apply(u, 1300, owner_uuids=()) == actuator.ApplyResult(
        u, 1300, None, None, False, skipped="SharedMIGDevice"
    )
    assert g.locked == 0
    observe = standin_actuator(drv, enforce=False)
    r = observe.apply(u, 1400)
    assert (r.requested_mhz, r.target_mhz, r.wrote, r.skipped) == (1400, None, False, "observe")
    assert r.wrote is False and r.effective_mhz is not None


def test_a_request_below_every_clock_keeps_the_default_and_says_so(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    u = drv.uuids[0]
    drv.set_work([u], "generation")
    act = standin_actuator(drv)
    lowest = min(act.controls[u].supported_mhz)
    r = act.apply(u, 100)
    assert r.target_mhz is None and r.wrote is False and drv.gpu(u).locked == 0
    assert r.error == (
        f"requested 100 MHz is below the lowest supported clock {lowest} MHz; default governor kept"
    )
    ok = act.apply(u, 1200)
    again = act.apply(u, 1200)
    assert ok.error is None and ok.slowdown is False
    assert (again.wrote, again.error, again.slowdown) == (False, None, False)


@pytest.mark.parametrize(
    ("code", "error_class", "condition", "reason"),
    [
        (
            standin.NO_PERMISSION,
            "GpuNoPermissionError",
            "measureOnly",
            actuator.NO_PERMISSION_REASON,
        ),
        (standin.NOT_SUPPORTED, "GpuNotSupportedError", "measureOnly", "ClocksNotSupported: "),
        (standin.GPU_IS_LOST, "GpuLostError", "lost", "GPULost: "),
        (standin.UNKNOWN, "GpuTransientError", "ok", ""),
    ],
)
def test_a_refused_write_after_start_up_is_answered_and_marks_the_gpu(
    make_driver: DriverFactory,
    caplog: pytest.LogCaptureFixture,
    code: int,
    error_class: str,
    condition: str,
    reason: str,
) -> None:
    drv = make_driver(1)
    u = drv.uuids[0]
    drv.set_work([u], "generation")
    act = standin_actuator(drv)
    drv.gpu(u).fail_clock_set = code  # the driver changes its mind after the probe
    caplog.set_level(logging.WARNING, logger=LOGGER)
    r = act.apply(u, 1200)
    assert r.wrote is True and r.error is not None
    assert r.error.startswith(f"{error_class}: ") and len(r.error) > len(error_class) + 2
    assert r.effective_mhz is not None  # read-back still works
    ctl = act.controls[u]
    assert ctl.condition == condition and ctl.reason.startswith(reason)
    assert ctl.applied_mhz is None and drv.gpu(u).locked == 0
    if condition == "ok":
        (msg,) = [m for m in _messages(caplog, logging.WARNING) if "clock write" in m]
        assert msg.startswith(f"clock write on {u} failed: ") and msg.endswith("(NVML error 999)")
    else:
        assert f"GPU {u}: {condition} ({ctl.reason})" in _messages(caplog, logging.WARNING)


def test_a_lost_read_back_is_the_answer_s_error_when_the_write_worked(
    make_driver: DriverFactory,
) -> None:
    drv = make_driver(1)
    u = drv.uuids[0]
    drv.set_work([u], "generation")
    act = standin_actuator(drv)
    drv.gpu(u).fail_clocks = standin.GPU_IS_LOST
    r = act.apply(u, 1200)
    assert r.wrote and r.error is not None and r.error.startswith("GpuLostError: ")
    assert act.controls[u].condition == "lost"
    assert act.controls[u].reason.startswith("GPULost: ") and len(act.controls[u].reason) > 9


def test_an_unreadable_read_back_reports_no_clock_and_no_slowdown(
    make_driver: DriverFactory, caplog: pytest.LogCaptureFixture
) -> None:
    drv = make_driver(1)
    u = drv.uuids[0]
    drv.set_work([u], "training")
    drv.gpu(u).clock_cap_mhz = 1400  # a slowdown the read-back would see
    act = standin_actuator(drv)
    assert act.apply(u, 1800).slowdown
    drv.gpu(u).fail_clocks = standin.UNKNOWN
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    r = act.apply(u, 1700)
    assert r.wrote and r.error is None and r.uuid == u
    assert r.effective_mhz is None and r.slowdown is False
    assert act.controls[u].effective_mhz is None and act.controls[u].slowdown is False
    assert act.controls[u].condition == "ok"
    (msg,) = _messages(caplog, logging.DEBUG)
    assert msg.startswith(f"read-back on {u} failed: ") and msg.endswith("(NVML error 999)")


def test_writes_count_the_driver_s_clock_writes(make_driver: DriverFactory) -> None:
    drv = make_driver(2)
    drv.set_work(drv.uuids, "generation")
    act = standin_actuator(drv)
    for clock in (1200, 1200, 1305, None, None, 990):
        for u in drv.uuids:
            act.apply(u, clock)
    act.release(drv.uuids[:1], "test")
    for u in drv.uuids:
        assert act.controls[u].writes == drv.gpu(u).clock_writes > 3


def test_release_goes_past_unknown_and_failing_gpus_and_keeps_their_record(
    make_driver: DriverFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    drv = make_driver(4)
    failing, locked, never, other = drv.uuids
    drv.set_work(drv.uuids, "generation")
    state = tmp_path / "locks.json"
    act = standin_actuator(drv, state)
    act.apply(failing, 1200)
    act.apply(locked, 1200)
    act.apply(other, 1305)
    drv.gpu(failing).fail_clock_set = standin.UNKNOWN
    w_never = drv.gpu(never).clock_writes
    caplog.set_level(logging.INFO, logger=LOGGER)
    done = act.release(["GPU-vanished", failing, never, locked, other], "pod end")
    assert done == [locked, other]
    assert drv.gpu(locked).locked == 0 and drv.gpu(failing).locked == 1
    assert drv.gpu(never).clock_writes == w_never  # nothing to reset, nothing written
    assert act.controls[locked].applied_mhz is None
    assert act.controls[failing].applied_mhz == 1200
    assert all(act.controls[u].requested_mhz is None for u in drv.uuids)
    assert act.caps.get(locked).state == "unlocked"
    assert actuator.LockStateFile(state).locked == {failing}
    (err,) = _messages(caplog, logging.ERROR)
    assert err.startswith(f"reset of {failing} on pod end failed: ")
    assert err.endswith("(NVML error 999)")
    assert f"reset locked clocks on {locked}, {other} (pod end)" in _messages(caplog, logging.INFO)
    drv.gpu(failing).fail_clock_set = 0
    act.apply(never, 100)  # below every clock: requested, nothing locked
    assert act.controls[never].requested_mhz == 100
    caplog.clear()
    assert act.reset_all("SIGTERM") == [failing]
    assert actuator.LockStateFile(state).locked == frozenset()
    assert all(act.controls[u].requested_mhz is None for u in drv.uuids)  # nothing asked for
    assert _messages(caplog, logging.INFO) == [f"reset locked clocks on {failing} (SIGTERM)"]
    assert act.reset_all("SIGTERM") == [] and not _messages(caplog, logging.ERROR)


def test_the_lock_record_survives_a_missing_folder_and_a_record_without_locks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "host" / "rlenergy" / "locks.json"
    record = actuator.LockStateFile(path)
    record.add("GPU-b")
    record.add("GPU-a")
    # the on-disk format a later agent version reads from the hostPath
    assert json.loads(path.read_text()) == {"version": 1, "locked": ["GPU-a", "GPU-b"]}
    assert actuator.LockStateFile(path).locked == {"GPU-a", "GPU-b"}
    path.write_text('{"version": 1}')
    assert actuator.LockStateFile(path).locked == frozenset()
    path.write_text("{not json")
    caplog.set_level(logging.ERROR, logger=LOGGER)
    assert actuator.LockStateFile(path).locked == frozenset()
    (msg,) = _messages(caplog, logging.ERROR)
    assert msg.startswith(f"lock state file {path} unreadable (") and msg.endswith(
        "); starting empty"
    )
    assert "Expecting property name" in msg  # the parser's reason


def test_the_cap_watch_goes_past_lost_and_unreadable_gpus_and_warns_once_per_change(
    make_driver: DriverFactory, caplog: pytest.LogCaptureFixture
) -> None:
    drv = make_driver(4)
    lost, failing, silent, idle = sorted(drv.uuids)  # re-read in sorted order
    drv.set_work(drv.uuids, "generation")
    act = standin_actuator(drv)
    drv.gpu(lost).fail_clocks = standin.GPU_IS_LOST
    for u in drv.uuids:
        assert act.apply(u, 1395).wrote
    assert act.controls[lost].condition == "lost"
    drv.gpu(lost).fail_clocks = 0  # reads would work again: a lost GPU stays lost
    drv.gpu(failing).fail_clocks = standin.UNKNOWN
    drv.gpu(silent).clock_cap_mhz = 1005
    drv.gpu(silent).silent_cap = 1
    drv.set_work([idle], "idle")
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    caplog.clear()
    drv.advance(2.0)
    assert act.watch_caps() == [silent]
    assert act.controls[lost].effective_mhz is None
    assert act.caps.get(lost).state == "settling"
    assert act.controls[failing].effective_mhz == 1395  # the apply's read-back stays
    (debug,) = _messages(caplog, logging.DEBUG)
    assert debug.startswith(f"cap re-read on {failing} failed: ") and len(debug) > 60
    eff = act.controls[silent].effective_mhz
    assert eff is not None and eff <= 1005 and act.controls[silent].slowdown is False
    assert act.caps.get(idle).state == "idle"
    assert act.controls[idle].effective_mhz == 1395  # an idle reading is not the lock's effect
    assert _messages(caplog, logging.WARNING) == [
        f"GPU {silent}: locked at 1395 MHz, runs {eff} MHz (no clock-event reason)"
    ]
    caplog.clear()
    drv.gpu(failing).fail_clocks = 0
    drv.gpu(failing).clock_cap_mhz = 1200  # a power cap with its reason
    drv.advance(6.0)
    assert act.watch_caps() == []  # still unexplained: reported once, when it turned
    capped = act.controls[failing]
    assert capped.effective_mhz is not None and capped.effective_mhz <= 1200
    assert capped.slowdown is True and act.controls[silent].slowdown is False
    assert _messages(caplog, logging.WARNING) == [
        f"GPU {failing}: locked at 1395 MHz, runs {capped.effective_mhz} MHz (SwPowerCap)"
    ]
    drv.gpu(silent).clock_cap_mhz = 0  # the shortfall goes: the GPU runs its lock again
    drv.advance(6.0)
    assert act.watch_caps() == []
    assert act.controls[silent].effective_mhz == 1395
    assert act.caps.get(silent).state == "asRequested"
