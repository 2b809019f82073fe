"""Zeus's device abstraction pointed at the simulator, and a driver for its power-limit optimizer.

The real ``zeus`` package (pinned in pyproject's ``peers`` extra) runs unchanged: its
``GlobalPowerLimitOptimizer`` and ``ZeusMonitor`` see the simulated GPUs through
``zeus.device.gpu.common.GPU`` / ``GPUs`` subclasses (``SimZeusGPU``), installed as the
singleton that ``zeus.device.get_gpus()`` returns. Zeus calls, as on a real node,
get/set power limit, power-limit constraints, persistence mode and the energy counter; a power
limit caps the default governor as ``rlenergy.gpu.models.GpuSku.power_capped_clock_mhz`` models
it.

Three framework hooks are bound to the simulated job, which plays the training framework:
``sync_execution`` is a no-op (the simulator is synchronous), ``is_distributed`` is False and
``all_reduce`` returns its input (one process drives every GPU of the job, as the single-node
non-distributed case of Zeus's docs), and ``time`` is the simulator's virtual clock (the end of
the last simulated step). Zeus's own code otherwise runs as released.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zeus.device.gpu as zeus_gpu
import zeus.monitor.energy as zeus_energy
import zeus.optimizer.power_limit as zeus_pl
from zeus.device.gpu.common import GPU, GPUs, ZeusGPUNotSupportedError

from rlenergy.control.freq import base
from rlenergy.gpu import simulated as sim_gpu

ZEUS_VERSION = "0.16.0"


class SimZeusGPU(GPU):
    """One simulated GPU behind Zeus's GPU interface (units as Zeus's: mW, mJ, MHz)."""

    def __init__(self, gpu_index: int, gpu: sim_gpu.SimulatedGpu) -> None:
        super().__init__(gpu_index)
        self.sim = gpu
        self._disable_sys_admin_warning = True
        self.persistence = False
        self.power_limit_calls: list[int] = []

    @property
    def supports_nonblocking_setters(self) -> bool:
        return False

    def get_name(self) -> str:
        return self.sim.name

    def get_power_management_limit_constraints(self) -> tuple[int, int]:
        return self.sim.power_limit_constraints_mw()

    def get_power_management_limit(self) -> int:
        return self.sim.power_limit_mw()

    def set_power_management_limit(self, power_limit_mw: int, block: bool = True) -> None:
        self.power_limit_calls.append(power_limit_mw)
        self.sim.set_power_limit_mw(power_limit_mw)

    def reset_power_management_limit(self, block: bool = True) -> None:
        self.sim.set_power_limit_mw(self.sim.default_power_limit_mw())

    def set_persistence_mode(self, enabled: bool, block: bool = True) -> None:
        self.persistence = enabled

    def get_persistence_mode(self) -> bool:
        return self.persistence

    def get_supported_memory_clocks(self) -> list[int]:
        return [self.sim.sku.memory_clock_mhz]

    def set_memory_locked_clocks(
        self, min_clock_mhz: int, max_clock_mhz: int, block: bool = True
    ) -> None:
        raise ZeusGPUNotSupportedError("the simulator does not lock memory clocks")

    def reset_memory_locked_clocks(self, block: bool = True) -> None:
        raise ZeusGPUNotSupportedError("the simulator does not lock memory clocks")

    def get_supported_graphics_clocks(self, memory_clock_mhz: int | None = None) -> list[int]:
        return list(self.sim.supported_sm_clocks_mhz())

    def set_gpu_locked_clocks(
        self, min_clock_mhz: int, max_clock_mhz: int, block: bool = True
    ) -> None:
        self.sim.set_locked_sm_clocks(min_clock_mhz, max_clock_mhz)

    def reset_gpu_locked_clocks(self, block: bool = True) -> None:
        self.sim.reset_locked_sm_clocks()

    def get_average_power_usage(self) -> int:
        return self.sim.power_usage_mw()

    def get_instant_power_usage(self) -> int:
        return self.sim.instant_power_mw()

    def get_average_memory_power_usage(self) -> int:
        raise ZeusGPUNotSupportedError("no memory power sensor in the simulator")

    def supports_get_total_energy_consumption(self) -> bool:
        return True

    def get_total_energy_consumption(self) -> int:
        return self.sim.total_energy_mj()

    def get_gpu_temperature(self) -> int:
        raise ZeusGPUNotSupportedError("no temperature sensor in the simulator")


class SimZeusGPUs(GPUs):
    """The job's simulated GPUs as Zeus's GPU collection (index = the job's GPU index)."""

    def __init__(
        self, gpus: Sequence[sim_gpu.SimulatedGpu] = (), ensure_homogeneous: bool = False
    ) -> None:
        self._gpus = [SimZeusGPU(i, g) for i, g in enumerate(gpus)]
        if ensure_homogeneous:
            self._ensure_homogeneous()

    def __del__(self) -> None:
        pass

    @property
    def gpus(self) -> Sequence[GPU]:
        return self._gpus


class _VirtualClock:
    def __init__(self) -> None:
        self.gpus: Sequence[sim_gpu.SimulatedGpu] = ()

    def __call__(self) -> float:
        return max((g.now_s for g in self.gpus), default=0.0)


_CLOCK = _VirtualClock()


def _bind_framework() -> None:
    zeus_energy.time = _CLOCK  # type: ignore[assignment]
    zeus_energy.sync_execution_fn = lambda *a, **k: None
    zeus_pl.is_distributed = lambda: False
    zeus_pl.all_reduce = lambda obj, operation: obj


class ZeusPowerLimitPeer:
    """Zeus's ``GlobalPowerLimitOptimizer`` as a ``FrequencyPolicy`` for ``run_job``.

    Pass ``bind`` as ``run_job(..., on_start=peer.bind)``. Every step's ``decide`` calls the
    optimizer's ``on_step_begin`` (Zeus's per-iteration hook) and leaves every phase to the
    default governor, which the power limit Zeus sets then caps.

    Args:
        phases: phase names of the job.
        selector: Zeus's optimum selector (None: its stock ``ZeusCost(eta=0.5)``).
        kwargs: further ``GlobalPowerLimitOptimizer`` arguments (stock when empty).
    """

    def __init__(
        self, phases: Sequence[str], selector: zeus_pl.OptimumSelector | None = None, **kwargs: Any
    ) -> None:
        self.phases = tuple(phases)
        self.selector = selector
        self.kwargs = kwargs
        self.optimizer: zeus_pl.GlobalPowerLimitOptimizer | None = None
        self.devices: SimZeusGPUs | None = None

    def bind(self, gpus: Sequence[sim_gpu.SimulatedGpu]) -> None:
        """Point Zeus at ``gpus`` and build the optimizer (it sets the top limit at once)."""
        _bind_framework()
        _CLOCK.gpus = gpus
        self.devices = SimZeusGPUs(gpus)
        zeus_gpu._gpus = self.devices
        monitor = zeus_energy.ZeusMonitor(gpu_indices=list(range(len(gpus))), cpu_indices=[])
        self.optimizer = zeus_pl.GlobalPowerLimitOptimizer(
            monitor, optimum_selector=self.selector, **self.kwargs
        )

    @property
    def state(self) -> str:
        """Zeus's state machine state and, when done, the chosen limit."""
        if self.optimizer is None:
            return "unbound"
        st = self.optimizer.state
        if isinstance(st, zeus_pl.Done):
            return f"Done({st.optimal_power_limit // 1000} W)"
        return type(st).__name__

    def decide(self, step: int) -> base.Plan:
        """Zeus's step hook, then the default governor (under Zeus's limit) on every phase."""
        if self.optimizer is None:
            raise RuntimeError("ZeusPowerLimitPeer.bind was not called (run_job on_start)")
        self.optimizer.on_step_begin()
        return base.Plan(
            step,
            {
                p: base.PhaseDecision(None, base.PhaseState.OBSERVE, reason="zeus power limit")
                for p in self.phases
            },
        )

    def observe(self, observation: base.StepObservation) -> None:
        """Zeus measures through its own monitor; nothing to take here."""
