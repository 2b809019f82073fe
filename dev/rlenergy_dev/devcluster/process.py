"""Child-process handling: spawn in own process groups, stop with SIGTERM then SIGKILL.

Every component runs in its own session (so its process group id equals its pid). A
process is recorded as ``(pid, start time)``; the start time (``/proc/<pid>/stat`` field 22)
guards against pid reuse when a different shell stops the cluster from a state file.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessRecord:
    """What a state file remembers about one component process."""

    name: str
    pid: int
    start_ticks: int
    argv: list[str]
    log: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessRecord:
        """Inverse of :meth:`to_json`."""
        return cls(
            name=str(data["name"]),
            pid=int(data["pid"]),
            start_ticks=int(data["start_ticks"]),
            argv=[str(a) for a in data["argv"]],
            log=str(data["log"]),
        )


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 if the process is gone)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else 0


def is_alive(record: ProcessRecord) -> bool:
    """Whether the recorded process still runs (zombies and reused pids count as gone)."""
    fields = _stat_fields(record.pid)
    if fields is None:
        return False
    state, ticks = fields[0], int(fields[19])
    return state not in ("Z", "X") and ticks == record.start_ticks


def memory_kib(pid: int) -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of ``pid`` in KiB, ``(0, 0)`` if unknown."""
    rss = hwm = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return rss, hwm


def _die_with_parent() -> Callable[[], None]:
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:  # runs in the child between fork and exec
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    die_with_parent: bool = True,
) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Start ``argv`` in a new session, stdout and stderr appended to ``log_path``.

    Args:
        name: Component name (for messages and the state file).
        argv: Command line.
        log_path: Log file.
        env: Environment (default: inherited).
        die_with_parent: Ask the kernel to SIGKILL the child when this process dies
            (``PR_SET_PDEATHSIG``), so a killed test run leaves nothing behind.

    Returns:
        The Popen handle and the record for the state file.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            close_fds=True,
            preexec_fn=_die_with_parent() if die_with_parent else None,
        )
    record = ProcessRecord(name, proc.pid, start_ticks(proc.pid), list(argv), str(log_path))
    return proc, record


def _signal_group(record: ProcessRecord, sig: signal.Signals) -> None:
    if not is_alive(record):
        return
    try:
        os.killpg(record.pid, sig)  # start_new_session: pgid == pid
    except ProcessLookupError:
        return
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, sig)


def terminate(
    records: Sequence[ProcessRecord],
    popens: dict[int, subprocess.Popen[bytes]] | None = None,
    *,
    grace: float = 10.0,
) -> list[str]:
    """SIGTERM every process group, wait up to ``grace`` seconds, then SIGKILL the rest.

    Args:
        records: The processes (in start order; they are signalled in reverse order).
        popens: Popen handles of our own children, so they are reaped (no zombies).
        grace: Seconds between SIGTERM and SIGKILL.

    Returns:
        Names of the components that needed SIGKILL.
    """
    popens = popens or {}
    for rec in reversed(records):
        _signal_group(rec, signal.SIGTERM)
    deadline = time.monotonic() + grace
    killed: list[str] = []
    pending = list(records)
    while pending:
        for rec in list(pending):
            proc = popens.get(rec.pid)
            if proc is not None and proc.poll() is not None:
                pending.remove(rec)
            elif proc is None and not is_alive(rec):
                pending.remove(rec)
        if not pending:
            break
        if time.monotonic() >= deadline:
            for rec in pending:
                killed.append(rec.name)
                _signal_group(rec, signal.SIGKILL)
            for rec in pending:
                proc = popens.get(rec.pid)
                if proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)
            break
        time.sleep(0.1)
    # Anything left in the components' process groups (none expected) goes too.
    for rec in records:
        for pid in _group_members(rec):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return killed


def _group_members(record: ProcessRecord) -> list[int]:
    """Live pids in the process group led by ``record`` that started after it."""
    members: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None or fields[0] in ("Z", "X"):
            continue
        if int(fields[2]) == record.pid and int(fields[19]) >= record.start_ticks:
            members.append(int(entry.name))
    return members


def wait_ready(
    name: str,
    popen: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    *,
    log: Path,
    timeout_s: float,
    not_ready: str,
) -> None:
    """Wait until ``ready()`` while the host process ``popen`` (``name``, logging to ``log``) runs.

    Raises:
        RuntimeError: it exited, or ``ready()`` stayed false for ``timeout_s`` s (``not_ready``
            says what it did not do); the message ends with its log's last 40 lines. The
            caller stops the process.
    """
    deadline = time.monotonic() + timeout_s
    while not ready():
        if popen.poll() is not None or time.monotonic() > deadline:
            why = "exited" if popen.poll() is not None else not_ready
            raise RuntimeError(f"{name} {why}; its log:\n{tail(log, 40)}")
        time.sleep(0.1)


def tail(path: str | Path, lines: int = 25) -> str:
    """Last ``lines`` lines of a log file (empty if unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            data = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])
