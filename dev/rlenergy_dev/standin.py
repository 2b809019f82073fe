"""Driver of the stand-in ``libnvidia-ml.so.1``: simulated GPU physics behind the real pynvml.

The C library (``dev/nvml_standin/standin.c``) answers the NVML calls the agent
makes from a memory-mapped state file; this module creates that file, writes the simulated
physics into it (energy counter in mJ, trailing-average and instant power, the clock each GPU
would run unlocked) from the SKU models of ``rlenergy.gpu.models``, keeps the ground truth, and
injects faults (NO_PERMISSION, NOT_SUPPORTED, GPU_IS_LOST, counter reset, "lock accepted but
effective clock lower", set ``clock_cap_mhz`` at any time, also after the lock; with
``silent_cap`` the cap shows no clock-event reason; a GPU reset that clears the locks, a GPU
lost and back, a changed driver version). Callers: the agent's tests,
``bench/agent.py`` and the local integration runs (``rlenergy-agent --backend nvml`` with the
environment of ``env()``).

Time is either virtual (``advance``: deterministic tests) or real (``start``: a thread that
advances by the elapsed wall time every tick, like the driver's counter updates).
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlenergy.gpu import models

MAGIC = 0x524C4E56
VERSION = 2
MAX_GPUS = 16
MAX_CLOCKS = 160
MAX_MIG = 7
STATE_ENV = "RLENERGY_NVML_STANDIN_STATE"
VISIBLE_ENV_PREFIX = "RLENERGY_NVML_STANDIN_GPU_"
"""With any ``<prefix><n>=<uuid>`` set at ``nvmlInit``, the library enumerates only the GPUs
named (a container's GPUs, given by their CDI devices); standin.c says more."""
SOURCE_DIR = Path(__file__).resolve().parents[1] / "nvml_standin"
"""Where ``standin.c`` lives in a source checkout (dev/nvml_standin)."""

# NVML return codes the tests inject (NVML API reference).
NOT_SUPPORTED = 3
NO_PERMISSION = 4
GPU_IS_LOST = 15
LIB_RM_VERSION_MISMATCH = 18
NOT_READY = 27
UNKNOWN = 999

FROZEN_POWER_FACTOR = 1.2
"""Power of a frozen engine's GPU over the SKU's idle power (``StandinDriver.freeze``) [MODEL]."""

MEMORY_TOTAL_BYTES = {"h100-sxm": 80 * 2**30, "h200": 141 * 10**9, "b200": 180 * 10**9}
"""Framebuffer memory per SKU key, bytes (the products' data sheets: H100 SXM 80 GB, H200
141 GB, B200 180 GB); another SKU gets 80 GiB."""
MEMORY_BASE_BYTES = 512 * 2**20
"""Memory a GPU shows used with no process on it (driver context), bytes [MODEL]."""

ARCH_PASCAL = 6
ARCH_VOLTA = 7
ARCH_AMPERE = 8
ARCH_HOPPER = 9


class GpuState(ctypes.Structure):
    """Mirror of ``standin_gpu_t`` (standin.h); field meanings are documented there."""

    _fields_ = [
        ("uuid", ctypes.c_char * 96),
        ("name", ctypes.c_char * 96),
        ("mig_mode", ctypes.c_uint32),
        ("mig_count", ctypes.c_uint32),
        ("persistence_mode", ctypes.c_uint32),
        ("architecture", ctypes.c_uint32),
        ("mem_clock_mhz", ctypes.c_uint32),
        ("n_sm_clocks", ctypes.c_uint32),
        ("sm_clocks_mhz", ctypes.c_uint32 * MAX_CLOCKS),
        ("max_sm_clock_mhz", ctypes.c_uint32),
        ("power_limit_mw", ctypes.c_uint32),
        ("locked", ctypes.c_uint32),
        ("lock_min_mhz", ctypes.c_uint32),
        ("lock_max_mhz", ctypes.c_uint32),
        ("mem_locked", ctypes.c_uint32),
        ("clock_writes", ctypes.c_uint64),
        ("nvml_calls", ctypes.c_uint64),
        ("energy_mj", ctypes.c_uint64),
        ("power_avg_mw", ctypes.c_uint32),
        ("power_instant_mw", ctypes.c_uint32),
        ("natural_clock_mhz", ctypes.c_uint32),
        ("idle", ctypes.c_uint32),
        ("extra_reasons", ctypes.c_uint64),
        ("util_gpu", ctypes.c_uint32),
        ("util_mem", ctypes.c_uint32),
        ("fail_all", ctypes.c_int32),
        ("fail_clock_set", ctypes.c_int32),
        ("fail_mem_lock", ctypes.c_int32),
        ("fail_energy", ctypes.c_int32),
        ("fail_power", ctypes.c_int32),
        ("fail_instant", ctypes.c_int32),
        ("fail_clocks", ctypes.c_int32),
        ("fail_once", ctypes.c_int32),
        ("clock_cap_mhz", ctypes.c_uint32),
        ("call_delay_us", ctypes.c_uint32),
        ("silent_cap", ctypes.c_uint32),
        ("min_power_limit_mw", ctypes.c_uint32),
        ("mig_slices", ctypes.c_uint32 * MAX_MIG),
        ("power_unlocked_mw", ctypes.c_uint32),
        ("power_at_lock_mw", ctypes.c_uint32 * MAX_CLOCKS),
        ("memory_total_bytes", ctypes.c_uint64),
        ("memory_used_bytes", ctypes.c_uint64),
        ("fail_memory", ctypes.c_int32),
        ("pad_memory", ctypes.c_uint32),
    ]


class State(ctypes.Structure):
    """Mirror of ``standin_state_t``."""

    _fields_ = [
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("n_gpus", ctypes.c_uint32),
        ("init_error", ctypes.c_int32),
        ("fail_all", ctypes.c_int32),
        ("init_count", ctypes.c_uint32),
        ("driver_version", ctypes.c_char * 80),
        ("gpus", GpuState * MAX_GPUS),
    ]


def read_uuids(path: Path) -> tuple[str, ...]:
    """UUIDs of the GPUs in a state file, in NVML index order (e.g. for the device plugin).

    Raises:
        ValueError: the file is not a stand-in state file.
    """
    data = path.read_bytes()
    if len(data) < ctypes.sizeof(State):
        raise ValueError(f"{path} is too short for a stand-in state file")
    state = State.from_buffer_copy(data[: ctypes.sizeof(State)])
    if state.magic != MAGIC:
        raise ValueError(f"{path} is not a stand-in state file (magic {state.magic:#x})")
    return tuple(state.gpus[i].uuid.decode() for i in range(state.n_gpus))


def build_library(build_dir: Path, *, cc: str = "gcc") -> Path:
    """Compile the stand-in into ``build_dir/libnvidia-ml.so.1`` (skipped when up to date).

    Args:
        build_dir: output folder (created); never inside a committed path.
        cc: the C compiler.

    Returns:
        The folder holding ``libnvidia-ml.so.1``: put it on ``LD_LIBRARY_PATH``.

    Raises:
        FileNotFoundError: the C source or the compiler is missing.
        subprocess.CalledProcessError: the compiler failed.
    """
    src = SOURCE_DIR / "standin.c"
    header = SOURCE_DIR / "standin.h"
    if not src.exists():
        raise FileNotFoundError(f"stand-in source not found at {src}")
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"C compiler {cc!r} not found; install gcc")
    build_dir.mkdir(parents=True, exist_ok=True)
    out = build_dir / "libnvidia-ml.so.1"
    newest = max(src.stat().st_mtime, header.stat().st_mtime)
    if not out.exists() or out.stat().st_mtime < newest:
        tmp = build_dir / f".libnvidia-ml.{os.getpid()}.tmp"
        subprocess.run(
            [
                cc,
                "-shared",
                "-fPIC",
                "-O2",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-Wl,-soname,libnvidia-ml.so.1",
                "-o",
                str(tmp),
                str(src),
            ],
            check=True,
            capture_output=True,
        )
        tmp.replace(out)
    lib = ctypes.CDLL(str(out))
    lib.rlenergy_standin_state_size.restype = ctypes.c_size_t
    size = lib.rlenergy_standin_state_size()
    if size != ctypes.sizeof(State):
        raise RuntimeError(
            f"stand-in layout mismatch: C {size} bytes, Python {ctypes.sizeof(State)} bytes"
        )
    return build_dir


def build_cuda_library(build_dir: Path, *, cc: str = "gcc") -> Path:
    """Compile the stand-in CUDA driver library into ``build_dir/libcuda.so.1`` (when stale).

    A driver root holds it next to the stand-in NVML (``rlenergy_dev.devcluster.nvidiaplugin``); its
    ``cuInit`` answers CUDA_ERROR_NO_DEVICE (dev/nvml_standin/cuda_standin.c). Keep
    ``build_dir`` off any library path that CUDA programs search.

    Args:
        build_dir: output folder (created); never inside a committed path.
        cc: the C compiler.

    Returns:
        The path of ``libcuda.so.1``.

    Raises:
        FileNotFoundError: the C source or the compiler is missing.
        subprocess.CalledProcessError: the compiler failed.
    """
    src = SOURCE_DIR / "cuda_standin.c"
    if not src.exists():
        raise FileNotFoundError(f"stand-in CUDA source not found at {src}")
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"C compiler {cc!r} not found; install gcc")
    build_dir.mkdir(parents=True, exist_ok=True)
    out = build_dir / "libcuda.so.1"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        tmp = build_dir / f".libcuda.{os.getpid()}.tmp"
        flags = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"]
        subprocess.run(
            [cc, *flags, "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(src)],
            check=True,
            capture_output=True,
        )
        tmp.replace(out)
    return out


@dataclasses.dataclass
class _Sim:
    """Per-GPU simulation state (truth)."""

    sku: models.GpuSku
    spread: float
    kind: models.PhaseKind = "idle"
    label: str = "idle"
    truth_j: float = 0.0
    since_reset_j: float = 0.0
    offset_mj: int = 0
    avg_w: float = 0.0
    power_w: float = 0.0
    counter_gain: float = 1.0
    frozen: bool = False
    table_key: tuple[object, ...] = ()
    """What ``power_at_lock_mw`` was last written for (work, frozen, spread, cap, clocks)."""
    by_label_j: dict[str, float] = dataclasses.field(default_factory=dict)


class StandinDriver:
    """Owns the state file and plays the simulated GPUs behind the stand-in library.

    Args:
        path: the state file to create (its folder must exist).
        gpus: ``(uuid, SKU)`` per GPU, in NVML index order.
        power_spread: optional per-UUID power multiplier (part-to-part spread).
        driver_version: what ``nvmlSystemGetDriverVersion`` returns.
        counter_offset_mj: initial counter value per GPU (energy "since driver load"), mJ.

    Raises:
        ValueError: more than 16 GPUs, or a UUID longer than 95 bytes.
    """

    def __init__(
        self,
        path: Path,
        gpus: Sequence[tuple[str, models.GpuSku]],
        *,
        power_spread: Mapping[str, float] | None = None,
        driver_version: str = "550.54.15",
        counter_offset_mj: int = 123_456_789,
    ) -> None:
        if len(gpus) > MAX_GPUS:
            raise ValueError(f"at most {MAX_GPUS} GPUs")
        self.path = path
        with open(path, "wb") as f:
            f.write(b"\0" * ctypes.sizeof(State))
        self._file = open(path, "r+b")  # noqa: SIM115 - kept open for the mapping's lifetime
        self._map = mmap.mmap(self._file.fileno(), ctypes.sizeof(State))
        self.state = State.from_buffer(self._map)
        self._lock = threading.RLock()
        self._sims: dict[str, _Sim] = {}
        self._index: dict[str, int] = {}
        self.state.n_gpus = len(gpus)
        self.state.driver_version = driver_version.encode()
        for i, (uuid, sku) in enumerate(gpus):
            if len(uuid.encode()) > 95:
                raise ValueError(f"UUID too long: {uuid}")
            g = self.state.gpus[i]
            g.uuid = uuid.encode()
            g.name = sku.nvml_name.encode()
            g.persistence_mode = 1
            g.architecture = ARCH_HOPPER
            g.mem_clock_mhz = sku.memory_clock_mhz
            clocks = sku.supported_sm_clocks_mhz()[:MAX_CLOCKS]
            g.n_sm_clocks = len(clocks)
            for j, c in enumerate(clocks):
                g.sm_clocks_mhz[j] = c
            g.max_sm_clock_mhz = sku.max_sm_clock_mhz
            g.power_limit_mw = int(sku.power_limit_w * 1000)
            g.min_power_limit_mw = int(sku.min_power_limit_w * 1000)
            g.idle = 1
            g.memory_total_bytes = MEMORY_TOTAL_BYTES.get(sku.key, 80 * 2**30)
            g.memory_used_bytes = MEMORY_BASE_BYTES
            sim = _Sim(sku, (power_spread or {}).get(uuid, 1.0), offset_mj=counter_offset_mj)
            sim.avg_w = sim.power_w = sku.idle_power_w * sim.spread
            self._sims[uuid] = sim
            self._index[uuid] = i
            self._write_sensors(g, sim)
        self.state.version = VERSION
        self.state.magic = MAGIC
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.virtual_s = 0.0

    # ----- faults and configuration -----------------------------------------------------
    def gpu(self, uuid: str) -> GpuState:
        """The shared state of one GPU (set ``fail_*``, ``clock_cap_mhz`` etc. directly)."""
        gpu: GpuState = self.state.gpus[self._index[uuid]]
        return gpu

    @property
    def uuids(self) -> tuple[str, ...]:
        """GPU UUIDs in NVML index order."""
        return tuple(self._index)

    def set_supported_clocks(self, uuid: str, clocks_mhz: Sequence[int]) -> None:
        """Replace a GPU's supported SM clock list (irregular or degenerate lists)."""
        g = self.gpu(uuid)
        g.n_sm_clocks = len(clocks_mhz)
        for j, c in enumerate(clocks_mhz[:MAX_CLOCKS]):
            g.sm_clocks_mhz[j] = c
        if clocks_mhz:
            g.max_sm_clock_mhz = max(clocks_mhz)

    def set_power_spread(self, uuid: str, factor: float) -> None:
        """Part-to-part power spread of one GPU from now on (power x ``factor``)."""
        with self._lock:
            self._sims[uuid].spread = factor

    def set_counter_gain(self, uuid: str, gain: float) -> None:
        """From now on one GPU's energy counter advances ``gain`` x the true energy.

        Power readings stay true: a board whose counter and power sensor disagree.
        """
        with self._lock:
            self._sims[uuid].counter_gain = gain

    def reset_counter(self, uuid: str, to_mj: int = 0) -> None:
        """Simulate a driver reload: the energy counter restarts at ``to_mj``."""
        with self._lock:
            sim = self._sims[uuid]
            sim.since_reset_j = 0.0
            sim.offset_mj = to_mj
            self._write_sensors(self.gpu(uuid), sim)

    def reset_gpu(self, uuid: str) -> None:
        """A GPU reset (``nvidia-smi --gpu-reset``, or the driver recovering the GPU).

        What NVML documents for it: locked GPU and memory clocks are not persistent across a
        GPU reset, so the GPU comes back on the default governor (``locked`` cleared, no
        clock write counted: the agent did not make it); the rest of the state (energy
        counter, power) carries on. Pair with ``lose``/``recover`` for the time it is gone.
        """
        with self._lock:
            g = self.gpu(uuid)
            g.locked = 0  # first: a read racing the reset sees the default governor
            g.lock_min_mhz = g.lock_max_mhz = 0
            g.mem_locked = 0

    def lose(self, uuid: str) -> None:
        """The GPU falls off the bus.

        Every device call answers NVML_ERROR_GPU_IS_LOST (the handle look-ups too), as NVML
        documents for a lost GPU.
        """
        self.gpu(uuid).fail_all = GPU_IS_LOST

    def recover(self, uuid: str) -> None:
        """A lost GPU comes back.

        It comes back through a GPU reset (locks cleared, ``reset_gpu``); then its calls
        answer again.
        """
        self.reset_gpu(uuid)
        self.gpu(uuid).fail_all = 0

    def set_driver_version(self, version: str) -> None:
        """What ``nvmlSystemGetDriverVersion`` answers from now on (a driver upgrade)."""
        self.state.driver_version = version.encode()

    # ----- work and physics --------------------------------------------------------------
    def set_work(self, uuids: Sequence[str], kind: models.PhaseKind, label: str = "") -> None:
        """From now on ``uuids`` run ``kind``; truth is booked under ``label`` (default: kind)."""
        with self._lock:
            for u in uuids:
                sim = self._sims[u]
                sim.kind = kind
                sim.label = label or kind
                self._write_sensors(self.gpu(u), sim)

    def set_memory_used(self, uuids: Sequence[str], used_bytes: int | None = None) -> None:
        """``uuids`` show ``used_bytes`` of framebuffer memory in use from now on.

        ``None``: what no process holds (``MEMORY_BASE_BYTES``); an engine that allocated
        its weights and KV cache shows most of ``memory_total_bytes``, one put to sleep
        (weights offloaded, KV cache freed) drops back near the base.
        """
        with self._lock:
            for u in uuids:
                self.gpu(u).memory_used_bytes = (
                    MEMORY_BASE_BYTES if used_bytes is None else int(used_bytes)
                )

    def freeze(self, uuids: Sequence[str], frozen: bool = True) -> None:
        """A hung engine on ``uuids`` from now on (``frozen=False``: it recovers).

        The GPUs busy-wait: utilisation 100 %, not idle (no GPU_IDLE reason), power
        ``FROZEN_POWER_FACTOR`` x the SKU's idle power [MODEL: a spinning wait kernel, e.g. a
        collective waiting on a dead peer, keeps the SMs polling at near-idle power].
        """
        with self._lock:
            for u in uuids:
                self._sims[u].frozen = frozen
                self._write_sensors(self.gpu(u), self._sims[u])

    def clock_mhz(self, uuid: str) -> float:
        """Truth: the SM clock the GPU runs its current work at, MHz."""
        g = self.gpu(uuid)
        # A reset clears ``locked`` before the lock values: a read racing it can see
        # ``locked`` with a zero lock, which means the default governor.
        max_lock = int(g.lock_max_mhz)
        return self._clock_at(
            g, self._sims[uuid], float(max_lock) if g.locked and max_lock else None
        )

    @staticmethod
    def _clock_at(g: GpuState, sim: _Sim, lock: float | None) -> float:
        if sim.kind == "idle":
            return float(sim.sku.min_sm_clock_mhz)
        clock = sim.sku.effective_clock_mhz(sim.kind, lock)
        if g.clock_cap_mhz:
            clock = min(clock, float(g.clock_cap_mhz))
        return clock

    def _power_w(self, g: GpuState, sim: _Sim, lock: float | None) -> float:
        """Power of ``sim``'s current work under ``lock`` (None: unlocked), W."""
        if sim.frozen:
            return sim.sku.idle_power_w * FROZEN_POWER_FACTOR * sim.spread
        return sim.sku.power_w(sim.kind, self._clock_at(g, sim, lock)) * sim.spread

    def advance(self, dt_s: float) -> None:
        """Advance virtual time by ``dt_s`` seconds; the counter updates once at the end."""
        if dt_s < 0:
            raise ValueError("dt_s must be >= 0")
        with self._lock:
            self.virtual_s += dt_s
            for uuid, sim in self._sims.items():
                g = self.gpu(uuid)
                max_lock = int(g.lock_max_mhz)
                power = self._power_w(g, sim, float(max_lock) if g.locked and max_lock else None)
                energy = power * dt_s
                sim.power_w = power
                sim.truth_j += energy
                sim.since_reset_j += energy * sim.counter_gain
                sim.by_label_j[sim.label] = sim.by_label_j.get(sim.label, 0.0) + energy
                alpha = min(dt_s / 1.0, 1.0)  # 1 s trailing average (NVML docs, Ampere+)
                sim.avg_w += alpha * (power - sim.avg_w)
                self._write_sensors(g, sim)

    def _write_sensors(self, g: GpuState, sim: _Sim) -> None:
        g.energy_mj = sim.offset_mj + int(sim.since_reset_j * 1000.0)
        g.power_instant_mw = int(sim.power_w * 1000.0)
        g.power_avg_mw = int(sim.avg_w * 1000.0)
        n = min(int(g.n_sm_clocks), MAX_CLOCKS)
        key = (sim.kind, sim.frozen, sim.spread, int(g.clock_cap_mhz), tuple(g.sm_clocks_mhz[:n]))
        if sim.table_key != key:  # the table changes with the work, not every update
            sim.table_key = key
            g.power_unlocked_mw = int(self._power_w(g, sim, None) * 1000.0)
            for j in range(n):
                g.power_at_lock_mw[j] = int(
                    self._power_w(g, sim, float(g.sm_clocks_mhz[j])) * 1000.0
                )
        # The library reads these fields with no lock: write them in the order that never
        # shows a torn state (a busy GPU at its idle clock would read as capped: a clock below
        # the lock with SW_POWER_CAP). Going idle, the flag first; going busy, the clock first.
        idle = 1 if sim.kind == "idle" and not sim.frozen else 0
        if idle:
            g.idle = 1
        if sim.frozen:
            g.util_gpu, g.util_mem = 100, 0
        elif sim.kind == "idle":
            g.natural_clock_mhz = sim.sku.min_sm_clock_mhz
            g.util_gpu = g.util_mem = 0
        else:
            g.natural_clock_mhz = int(sim.sku.power_capped_clock_mhz(sim.kind))
            g.util_gpu = 95 if sim.kind == "training" else 40
            g.util_mem = 30 if sim.kind == "training" else 85
        g.idle = idle

    def rebook(self, uuid: str, src: str, dst: str, joules: float) -> None:
        """Move ``joules`` of a GPU's truth from label ``src`` to label ``dst``.

        The counters and the whole truth stay: only the work the energy is booked to changes.
        """
        with self._lock:
            by = self._sims[uuid].by_label_j
            by[src] = by.get(src, 0.0) - joules
            by[dst] = by.get(dst, 0.0) + joules

    def truth_j(self, uuid: str, label: str | None = None) -> float:
        """Truth: joules a GPU used since creation (or under one work label)."""
        with self._lock:
            sim = self._sims[uuid]
            return sim.truth_j if label is None else sim.by_label_j.get(label, 0.0)

    def start(self, tick_s: float = 0.02) -> None:
        """Advance in real time on a thread, one counter update every ``tick_s`` seconds."""
        if self._thread is not None:
            return
        self._stop.clear()

        def run() -> None:
            last = time.monotonic()
            while not self._stop.wait(tick_s):
                now = time.monotonic()
                self.advance(now - last)
                last = now

        self._thread = threading.Thread(target=run, name="nvml-standin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the real-time thread."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def env(self, lib_dir: Path) -> dict[str, str]:
        """Environment for a process that should load the stand-in through pynvml."""
        old = os.environ.get("LD_LIBRARY_PATH", "")
        return {
            STATE_ENV: str(self.path),
            "LD_LIBRARY_PATH": f"{lib_dir}:{old}" if old else str(lib_dir),
        }

    def close(self) -> None:
        """Stop and unmap (the file stays for post-mortems)."""
        self.stop()
        del self.state
        self._map.close()
        self._file.close()

    def __enter__(self) -> StandinDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def preload(lib_dir: Path, state_path: Path) -> None:
    """Make this process's pynvml use the stand-in (in-process tests).

    ``LD_LIBRARY_PATH`` is read by the loader at process start only, so a running test
    process loads the library by full path first; pynvml's ``CDLL("libnvidia-ml.so.1")`` then
    finds the object already loaded under that soname. Child processes get ``env()``.
    """
    os.environ[STATE_ENV] = str(state_path)
    ctypes.CDLL(str(lib_dir / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)


def agent_argv(
    node: str, socket_path: Path, state_dir: Path, *extra: str, python: str | None = None
) -> list[str]:
    """The command line of an agent process on the stand-in NVML (``--backend nvml``).

    Args:
        node: the node it serves (the trainer pods' tokens must name it).
        socket_path: its signal socket.
        state_dir: its lock record and energy totals folder.
        *extra: more arguments (``--plan``, ``--report-file``, ``--log-level``, ...).
        python: the interpreter (default: this one).
    """
    import sys

    return [
        python or sys.executable, "-m", "rlenergy_agent", "--node", node, "--backend", "nvml",
        "--socket", str(socket_path), "--state-dir", str(state_dir), "--metrics-port", "0",
        *extra,
    ]  # fmt: skip
