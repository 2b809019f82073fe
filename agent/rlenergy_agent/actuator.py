"""Applies the plan's SM clock to GPUs the moment a phase starts; resets locks it made.

Safety rules (docs/agent.md "Clocks"; docs/troubleshooting.md "Clocks"):

* idempotent: a write happens only when the target differs from what the agent applied, except
  on GPUs with persistence mode off, where a set done earlier may have silently reverted
  and every phase switch re-applies;
* every apply reads back the SM clock and the clock-event reasons and reports requested vs
  effective clock ("lock accepted but effective clock lower" shows as ``slowdown``);
* requested clocks snap to the highest supported clock at or below the request; a
  list of one clock or none means clock control is unavailable on that GPU;
* observe mode (``enforce=False``) never writes;
* a GPU that answers NO_PERMISSION or NOT_SUPPORTED turns measure-only with a reason, a lost GPU
  is skipped; other GPUs carry on;
* a MIG-enabled GPU is clocked only when every instance belongs to the caller;
* locks are recorded in a node-local state file before they are made, so an agent that was
  SIGKILLed resets them at its next start-up, and ``reset_all`` undoes them on
  SIGTERM, pod end and policy removal.

Callers: ``rlenergy_agent.service``. Not thread safe: the service serialises calls.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from rlenergy.api import node as api_node
from rlenergy.gpu import base, errors
from rlenergy_agent import caps

log = logging.getLogger(__name__)

NO_PERMISSION_REASON = "NoPermission (agent needs CAP_SYS_ADMIN)"
REINIT_RETRY_S = 5.0
"""Shortest time between two NVML re-initialisations while a GPU stays lost, s [MODEL: a
GPU reset takes seconds; five sampling passes between tries keep a GPU that never returns
from costing a re-initialisation every pass]."""
DRIVER_CHECK_S = 10.0
"""How often the driver version is read again, s (one cheap NVML call; a driver upgrade
drains the node over minutes)."""


class GpuLibrary(Protocol):
    """The GPU library's lifecycle (``rlenergy_agent.nvml.backend.NvmlSession``)."""

    version: str

    def driver_version(self) -> str:
        """The driver version now (raises ``rlenergy.gpu.errors.GpuError`` when unreadable)."""
        ...

    def reinit(self) -> Mapping[str, bool]:
        """Initialise the library again; per UUID whether the GPU answers."""
        ...


@dataclasses.dataclass(frozen=True)
class LifeEvent:
    """Something that made a GPU's state unknown.

    Attributes:
        uuid: the GPU.
        reason: ``GpuLost`` (lost, or its handle invalid), ``LockLost`` (it runs off the
            agent's lock with no clock-event reason that explains it: a GPU reset clears locked
            clocks) or ``DriverChanged``.
        message: what was seen.
    """

    uuid: str
    reason: str
    message: str


def snap_clock_mhz(request_mhz: int, supported_mhz: Sequence[int]) -> int | None:
    """The highest supported clock at or below ``request_mhz``.

    Args:
        request_mhz: the requested SM clock, MHz.
        supported_mhz: supported SM clocks in any order, MHz.

    Returns:
        The snapped clock, or ``None`` when the request is below every supported clock.
    """
    below = [c for c in supported_mhz if c <= request_mhz]
    return max(below) if below else None


@dataclasses.dataclass
class GpuControl:
    """What the actuator knows about one GPU.

    Attributes:
        uuid: GPU UUID.
        condition: ``ok``, ``measureOnly``, ``degraded`` or ``lost`` (``GpuStatus.condition``).
        reason: why the condition is not ok (for status and logs).
        supported_mhz: supported SM clocks, descending, MHz.
        applied_mhz: the lock the agent made (``None``: default governor).
        requested_mhz: the last clock the plan asked for (``None``: default governor).
        effective_mhz: the last read-back SM clock, MHz.
        slowdown: a power or thermal reason held the clock below the lock at the last read-back.
        persistence: persistence mode (``None``: unknown); off means re-apply every switch.
        mig_uuids: MIG instance UUIDs when MIG is on (clocks shared by all of them).
        writes: clock writes issued to this GPU.
    """

    uuid: str
    condition: api_node.GpuCondition = "ok"
    reason: str = ""
    supported_mhz: tuple[int, ...] = ()
    applied_mhz: int | None = None
    requested_mhz: int | None = None
    effective_mhz: int | None = None
    slowdown: bool = False
    persistence: bool | None = True
    mig_uuids: tuple[str, ...] = ()
    writes: int = 0


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    """Outcome of one apply on one GPU.

    Attributes:
        uuid: GPU UUID.
        requested_mhz: what the plan asked for (``None``: default governor).
        target_mhz: the snapped lock the agent aimed at (``None``: default governor).
        effective_mhz: the read-back SM clock, MHz (``None``: unreadable).
        wrote: a clock write was issued.
        slowdown: a power/thermal clock-event reason held the clock down.
        skipped: why nothing was attempted (observe, measure-only, lost, MIG shared).
        error: the GPU error, when the write failed.
    """

    uuid: str
    requested_mhz: int | None
    target_mhz: int | None
    effective_mhz: int | None
    wrote: bool
    slowdown: bool = False
    skipped: str | None = None
    error: str | None = None


class LockStateFile:
    """Node-local record of the GPUs the agent may have locked (hostPath).

    Args:
        path: the JSON file; ``None`` keeps the record in memory only (tests, observe mode).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._locked: set[str] = set()
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                self._locked = set(data.get("locked", []))
            except (OSError, ValueError) as exc:
                log.error("lock state file %s unreadable (%s); starting empty", path, exc)

    @property
    def locked(self) -> frozenset[str]:
        """UUIDs that may carry a lock made by this agent."""
        return frozenset(self._locked)

    def add(self, uuid: str) -> None:
        """Record ``uuid`` before locking it (write-ahead, fsynced)."""
        if uuid not in self._locked:
            self._locked.add(uuid)
            self._write()

    def discard(self, uuids: Iterable[str]) -> None:
        """Forget ``uuids`` after their locks were reset."""
        before = len(self._locked)
        self._locked.difference_update(uuids)
        if len(self._locked) != before:
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump({"version": 1, "locked": sorted(self._locked)}, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)


class Actuator:
    """Clock control over a node's GPUs.

    Args:
        gpus: the node's GPUs keyed by UUID.
        state: the lock record (see ``LockStateFile``).
        enforce: ``False`` is observe mode: never write a clock.
        probe_writes: at start-up, probe clock control with a reset of the locked clocks (the
            agent owns SM clock locks on its node; an administrator's manual lock is cleared).
        clock: monotonic time source, s.
        library: the GPU library's lifecycle (NVML); ``None``: a lost GPU stays lost (the
            simulated backend).
    """

    def __init__(
        self,
        gpus: Mapping[str, base.Gpu],
        state: LockStateFile,
        *,
        enforce: bool = True,
        probe_writes: bool = True,
        clock: Callable[[], float] = time.monotonic,
        library: GpuLibrary | None = None,
    ) -> None:
        self.gpus = dict(gpus)
        self.library = library
        self.unsettled: dict[str, tuple[LifeEvent, float]] = {}
        """GPUs whose state is unknown since an event, with the event and when it came; a
        pass that finds nothing new on a GPU that answers settles it."""
        self.life_events: dict[tuple[str, str], int] = {}
        """Events per (GPU, reason) since start (a counter for /metrics)."""
        self.returned: list[str] = []
        """GPUs that answer again after a re-initialisation, until the caller takes them
        (the energy meter starts their counters afresh)."""
        self.pending: list[LifeEvent] = []
        """Events found outside ``lifecycle`` (a signal's read-back), counted at its next pass."""
        self._reinit_at = -1e18
        self._driver_at = clock()
        self._reapplied: dict[str, int] = {}
        self.state = state
        self.enforce = enforce
        self.probe_writes = probe_writes
        self._clock = clock
        self.controls: dict[str, GpuControl] = {u: GpuControl(u) for u in self.gpus}
        self.recovered: list[str] = []
        self.caps = caps.CapWatch()
        """Locks as caps: what each locked GPU runs after the lock settled (``watch_caps``)."""
        self.sharers: Callable[[str], Collection[str]] | None = None
        """GPU UUID -> every device ID of it that any pod holds (``shares.sharers``; the agent
        sets it): a lock needs the caller to hold them all. ``None``: no pod map, no check."""

    # ----- start-up --------------------------------------------------------------------------
    def start(
        self,
        persistence: Mapping[str, bool | None] | None = None,
        mig_uuids: Mapping[str, Sequence[str]] | None = None,
    ) -> list[str]:
        """Recover stale locks, then probe clock control on every GPU.

        Args:
            persistence: persistence mode per UUID from the capability probe.
            mig_uuids: MIG instance UUIDs per MIG-enabled GPU.

        Returns:
            UUIDs whose stale lock (made by a previous agent run) was reset.
        """
        stale = set(self.state.locked)
        recovered: list[str] = []
        for uuid in sorted(stale):
            gpu = self.gpus.get(uuid)
            if gpu is None:
                log.warning("stale lock on GPU %s, which is no longer on this node", uuid)
                continue
            try:
                gpu.reset_locked_sm_clocks()
            except errors.GpuError as exc:
                log.error("could not reset stale lock on %s: %s", uuid, exc)
                continue
            log.warning("recovered stale lock on GPU %s (left by a previous agent run)", uuid)
            recovered.append(uuid)
        self.state.discard(recovered)
        for uuid, gpu in self.gpus.items():
            ctl = self.controls[uuid]
            ctl.persistence = (persistence or {}).get(uuid, True)
            ctl.mig_uuids = tuple((mig_uuids or {}).get(uuid, ()))
            if ctl.persistence is False:
                log.warning(
                    "GPU %s: persistence mode is off; clocks are re-applied at every phase "
                    "switch (PersistenceModeOff)",
                    uuid,
                )
            try:
                ctl.supported_mhz = tuple(sorted(set(gpu.supported_sm_clocks_mhz()), reverse=True))
            except errors.GpuLostError as exc:
                self._mark(ctl, "lost", f"GPULost: {exc}")
                continue
            except errors.GpuError as exc:
                self._mark(ctl, "measureOnly", f"ClockListUnavailable: {exc}")
                continue
            if len(ctl.supported_mhz) <= 1:
                self._mark(
                    ctl,
                    "measureOnly",
                    f"ClockListUnavailable: NVML lists {len(ctl.supported_mhz)} SM clock(s)",
                )
                continue
            if self.enforce and self.probe_writes and uuid not in recovered:
                self._write(ctl, gpu, None)
        self.recovered = recovered
        return recovered

    # ----- apply ------------------------------------------------------------------------------
    def apply(
        self, uuid: str, clock_mhz: int | None, *, owner_uuids: Iterable[str] = ()
    ) -> ApplyResult:
        """Run ``uuid`` at ``clock_mhz`` (``None``: default governor) from now on.

        Args:
            uuid: the GPU.
            clock_mhz: the requested SM clock, MHz.
            owner_uuids: device IDs the caller's pod holds; on a MIG GPU every instance must be
                among them, or the GPU is skipped (``SharedMIGDevice``); a lock also needs every
                device of the GPU that any pod holds (``sharers``: time-slicing and MPS
                replicas, MIG instances), or it is skipped (``SharedGPU``) and a lock made
                before the GPU was shared is reset. A reset to the default governor is never
                held back by sharing (it only returns the GPU to its default).

        Returns:
            What happened; errors are reported in the result, never raised.
        """
        ctl = self.controls.get(uuid)
        if ctl is None:
            return ApplyResult(uuid, clock_mhz, None, None, False, skipped="GPUNotFound")
        ctl.requested_mhz = clock_mhz
        if ctl.condition in ("lost", "measureOnly"):
            return ApplyResult(uuid, clock_mhz, None, None, False, skipped=ctl.reason)
        if not self.enforce:
            return self._readback(ctl, clock_mhz, None, wrote=False, skipped="observe")
        owners = set(owner_uuids)
        if ctl.mig_uuids and not set(ctl.mig_uuids) <= owners:
            return ApplyResult(uuid, clock_mhz, None, None, False, skipped="SharedMIGDevice")
        if clock_mhz is not None and self.sharers is not None:
            others = set(self.sharers(uuid)) - owners
            if others:
                if ctl.applied_mhz is not None:  # locked while whole; shared since
                    self._write(ctl, self.gpus[uuid], None)
                return ApplyResult(uuid, clock_mhz, None, None, False, skipped="SharedGPU")
        target = None
        error = None
        if clock_mhz is not None:
            target = snap_clock_mhz(clock_mhz, ctl.supported_mhz)
            if target is None:
                error = (
                    f"requested {clock_mhz} MHz is below the lowest supported clock "
                    f"{min(ctl.supported_mhz)} MHz; default governor kept"
                )
        wrote = False
        if target != ctl.applied_mhz or ctl.persistence is False:
            wrote = True
            err = self._write(ctl, self.gpus[uuid], target)
            error = error or err
        result = self._readback(ctl, clock_mhz, target, wrote=wrote, error=error)
        eff = result.effective_mhz
        if (
            not wrote
            and target is not None
            and eff is not None
            and eff > target + caps.TOLERANCE_MHZ
        ):
            # Above the lock nothing was written for: the lock is gone (a GPU reset). Made
            # again now rather than at the next pass's read-back (``verify_locks``).
            message = f"locked at {target} MHz, runs {eff} MHz: lock made again at a signal"
            log.warning("GPU %s: %s", uuid, message)
            self.pending.append(LifeEvent(uuid, "LockLost", message))
            err = self._write(ctl, self.gpus[uuid], target)
            result = self._readback(ctl, clock_mhz, target, wrote=True, error=error or err)
        return result

    def _write(self, ctl: GpuControl, gpu: base.Gpu, target: int | None) -> str | None:
        try:
            if target is None:
                gpu.reset_locked_sm_clocks()
            else:
                self.state.add(ctl.uuid)
                gpu.set_locked_sm_clocks(target, target)
        except errors.GpuNoPermissionError as exc:
            self._mark(ctl, "measureOnly", NO_PERMISSION_REASON)
            return f"{type(exc).__name__}: {exc}"
        except errors.GpuNotSupportedError as exc:
            self._mark(ctl, "measureOnly", f"ClocksNotSupported: {exc}")
            return f"{type(exc).__name__}: {exc}"
        except errors.GpuLostError as exc:
            self._mark(ctl, "lost", f"GPULost: {exc}")
            return f"{type(exc).__name__}: {exc}"
        except errors.GpuError as exc:
            log.warning("clock write on %s failed: %s", ctl.uuid, exc)
            return f"{type(exc).__name__}: {exc}"
        ctl.writes += 1
        ctl.applied_mhz = target
        self.caps.locked(ctl.uuid, target, self._clock())
        return None

    def watch_caps(self) -> list[str]:
        """Re-read the SM clock and clock-event reasons of the locked GPUs that are due.

        Called by the sampling loop: each lock is read ``caps.SETTLE_S`` after it was made and
        every ``caps.INTERVAL_S`` while it holds (``caps.CapWatch``), so a power or thermal cap
        that arrives after the apply, or a shortfall with no reason, shows in the node report
        and the metrics. The reading also becomes the GPU's ``effective_mhz``.

        Returns:
            UUIDs whose reading turned ``unexplained`` (below the lock, no reason) just now.
        """
        now = self._clock()
        turned: list[str] = []
        for uuid in self.caps.due(now):
            ctl = self.controls[uuid]
            if ctl.condition == "lost":
                continue
            gpu = self.gpus[uuid]
            try:
                effective = gpu.sm_clock_mhz()
                reasons = gpu.clock_event_reasons()
            except errors.GpuError as exc:
                log.debug("cap re-read on %s failed: %s", uuid, exc)
                continue
            before = self.caps.get(uuid).state
            cap = self.caps.record(uuid, effective, reasons, now)
            if cap.state in ("asRequested", "capped", "unexplained"):
                ctl.effective_mhz = effective
                ctl.slowdown = cap.state == "capped"
            if cap.state != before and cap.state in ("capped", "unexplained"):
                log.warning(
                    "GPU %s: locked at %s MHz, runs %s MHz (%s)",
                    uuid,
                    cap.lock_mhz,
                    effective,
                    cap.limit or "no clock-event reason",
                )
                if cap.state == "unexplained":
                    turned.append(uuid)
        return turned

    def _readback(
        self,
        ctl: GpuControl,
        requested: int | None,
        target: int | None,
        *,
        wrote: bool,
        skipped: str | None = None,
        error: str | None = None,
    ) -> ApplyResult:
        gpu = self.gpus[ctl.uuid]
        effective = None
        slowdown = False
        try:
            effective = gpu.sm_clock_mhz()
            slowdown = bool(gpu.clock_event_reasons() & base.SLOWDOWN_REASONS)
        except errors.GpuLostError as exc:
            self._mark(ctl, "lost", f"GPULost: {exc}")
            error = error or f"{type(exc).__name__}: {exc}"
        except errors.GpuError as exc:
            log.debug("read-back on %s failed: %s", ctl.uuid, exc)
        ctl.effective_mhz = effective
        ctl.slowdown = slowdown
        return ApplyResult(
            ctl.uuid, requested, target, effective, wrote, slowdown, skipped=skipped, error=error
        )

    def _mark(self, ctl: GpuControl, condition: api_node.GpuCondition, reason: str) -> None:
        if ctl.condition != condition or ctl.reason != reason:
            log.warning("GPU %s: %s (%s)", ctl.uuid, condition, reason)
        ctl.condition = condition
        ctl.reason = reason

    # ----- lifecycle: GPU resets, lost GPUs, driver changes ------------------------------------
    @staticmethod
    def off_lock(
        lock_mhz: int, effective_mhz: int, reasons: frozenset[base.ClockEventReason]
    ) -> bool:
        """Whether a GPU locked at ``lock_mhz`` runs off its lock with nothing explaining it.

        Above the lock (beyond one clock step, ``caps.TOLERANCE_MHZ``) is never explained: a
        locked GPU cannot exceed its lock, so the lock is gone (a GPU reset clears locked
        clocks). Below it, a slowdown reason (power or thermal cap) or an idle GPU explains
        it; with no reason at all the lock may be gone too.
        """
        if effective_mhz > lock_mhz + caps.TOLERANCE_MHZ:
            return True
        explained = bool(reasons & base.SLOWDOWN_REASONS) or (
            base.ClockEventReason.GPU_IDLE in reasons
        )
        return effective_mhz < lock_mhz - caps.TOLERANCE_MHZ and not explained

    def verify_locks(self) -> list[LifeEvent]:
        """Read back every locked GPU and re-apply a lock it runs off (every pass).

        A GPU above its lock gets the lock again at once (a reset cleared it). One below its
        lock with no reason gets it again once per lock: a lock that still does not hold
        after that is a cap that names no reason (``caps``: ``unexplained``), not a lost
        lock. A GPU that answers GPU_IS_LOST or an invalid handle turns ``lost``.
        """
        found: list[LifeEvent] = []
        if not self.enforce:
            return found
        for uuid, ctl in self.controls.items():
            lock = ctl.applied_mhz
            if lock is None or ctl.condition != "ok":
                continue
            gpu = self.gpus[uuid]
            try:
                effective = gpu.sm_clock_mhz()
                reasons = gpu.clock_event_reasons()
            except errors.GpuLostError as exc:
                self._mark(ctl, "lost", f"GPULost: {exc}")
                found.append(LifeEvent(uuid, "GpuLost", str(exc)))
                continue
            except errors.GpuError as exc:
                log.debug("lock read-back on %s failed: %s", uuid, exc)
                continue
            if not self.off_lock(lock, effective, reasons):
                continue
            above = effective > lock
            if not above and self._reapplied.get(uuid) == lock:
                continue  # re-applied once already: a cap without a reason
            self._reapplied[uuid] = lock
            message = (
                f"locked at {lock} MHz, runs {effective} MHz with no clock-event reason that "
                "explains it: lock made again"
            )
            log.warning("GPU %s: %s", uuid, message)
            found.append(LifeEvent(uuid, "LockLost", message))
            self._write(ctl, gpu, lock)
        return found

    def _reapply(self, ctl: GpuControl) -> None:
        """Make the lock the plan wants on a GPU whose state is unknown (a write either way)."""
        if not self.enforce or ctl.condition != "ok":
            return
        target = None
        if ctl.requested_mhz is not None:
            target = snap_clock_mhz(ctl.requested_mhz, ctl.supported_mhz)
        self._write(ctl, self.gpus[ctl.uuid], target)

    def _reinit(self, library: GpuLibrary, now: float) -> None:
        """Initialise the library again; every GPU's state is unknown, so each is re-read."""
        self._reinit_at = now
        old = library.version
        back = library.reinit()
        if library.version != old:
            log.warning("GPU driver version %s -> %s", old or "?", library.version)
        for uuid, ok in back.items():
            ctl = self.controls.get(uuid)
            if ctl is None:
                continue
            if not ok:
                self._mark(ctl, "lost", "GPULost: not found after NVML re-initialisation")
                continue
            gpu = self.gpus[uuid]
            try:
                ctl.supported_mhz = tuple(sorted(set(gpu.supported_sm_clocks_mhz()), reverse=True))
            except errors.GpuError as exc:
                self._mark(ctl, "measureOnly", f"ClockListUnavailable: {exc}")
                continue
            ctl.mig_uuids = tuple(getattr(gpu, "mig_uuids", ctl.mig_uuids))
            if ctl.condition == "lost":
                self._mark(ctl, "ok", "")
                self.returned.append(uuid)
            self._reapplied.pop(uuid, None)
            self._reapply(ctl)

    def lifecycle(self, lost: Iterable[str] = ()) -> list[LifeEvent]:
        """One pass over the GPUs' lifecycle (the sampling loop, every pass).

        Reads the driver version (every ``DRIVER_CHECK_S``), verifies the locks
        (``verify_locks``), initialises the library again after a lost GPU or a changed
        driver (at most every ``REINIT_RETRY_S``) and re-reads every GPU then, re-applying
        the clock the plan wants on each. A GPU with an event is ``unsettled`` until a pass
        finds nothing new on it and it answers.

        Args:
            lost: GPUs another reader (the energy meter) found lost.

        Returns:
            The events found in this pass.
        """
        now = self._clock()
        found: list[LifeEvent] = self.pending
        self.pending = []
        for uuid in lost:
            ctl = self.controls.get(uuid)
            if ctl is not None and ctl.condition != "lost":
                self._mark(ctl, "lost", "GPULost: energy reading lost")
        for uuid, ctl in self.controls.items():
            if ctl.condition == "lost" and uuid not in self.unsettled:
                found.append(LifeEvent(uuid, "GpuLost", ctl.reason))
        changed = False
        library = self.library
        if library is not None and now - self._driver_at >= DRIVER_CHECK_S:
            self._driver_at = now
            try:
                version = library.driver_version()
            except errors.GpuError as exc:
                version = None
                found += [LifeEvent(u, "GpuLost", str(exc)) for u in self.controls]
                changed = True
            if version is not None and version != library.version:
                message = f"driver version {library.version or '?'} -> {version}"
                found += [LifeEvent(u, "DriverChanged", message) for u in self.controls]
                changed = True
        found += self.verify_locks()
        lost_now = any(c.condition == "lost" for c in self.controls.values())
        if (
            library is not None
            and (changed or lost_now)
            and now - self._reinit_at >= REINIT_RETRY_S
        ):
            self._reinit(library, now)
        for e in found:
            self.life_events[(e.uuid, e.reason)] = self.life_events.get((e.uuid, e.reason), 0) + 1
            if e.uuid not in self.unsettled:
                self.unsettled[e.uuid] = (e, now)
        fresh = {e.uuid for e in found}
        for uuid in [u for u in self.unsettled if u not in fresh]:
            if self.controls[uuid].condition != "lost" and self._since(uuid) < now:
                event, since = self.unsettled.pop(uuid)
                log.info("GPU %s settled again after %s (%.0f s)", uuid, event.reason, now - since)
        return found

    def _since(self, uuid: str) -> float:
        return self.unsettled[uuid][1]

    # ----- reset ------------------------------------------------------------------------------
    def release(self, uuids: Iterable[str], reason: str) -> list[str]:
        """Return ``uuids`` to the default governor (pod end, policy removal).

        Args:
            uuids: the GPUs.
            reason: for the log.

        Returns:
            UUIDs whose lock was reset.
        """
        done: list[str] = []
        for uuid in uuids:
            ctl = self.controls.get(uuid)
            if ctl is None:
                continue
            ctl.requested_mhz = None
            if ctl.applied_mhz is None and uuid not in self.state.locked:
                continue
            try:
                self.gpus[uuid].reset_locked_sm_clocks()
            except errors.GpuError as exc:
                log.error("reset of %s on %s failed: %s", uuid, reason, exc)
                continue
            ctl.applied_mhz = None
            ctl.writes += 1
            self.caps.locked(uuid, None, self._clock())
            done.append(uuid)
        self.state.discard(done)
        if done:
            log.info("reset locked clocks on %s (%s)", ", ".join(done), reason)
        return done

    def reset_all(self, reason: str) -> list[str]:
        """Reset every lock the agent made (SIGTERM, shutdown)."""
        return self.release(sorted(set(self.controls) | set(self.state.locked)), reason)
