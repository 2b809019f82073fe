"""Units used across the project.

Python names carry their unit as a suffix (``_mhz``, ``_mw``, ``_mj``, ``_w``, ``_j``, ``_s``);
these helpers convert between NVML's integer units (mW, mJ) and SI floats (W, J).
"""

from __future__ import annotations

from typing import NewType

MHz = NewType("MHz", int)
"""SM or memory clock in megahertz (NVML reports integers)."""

MilliWatts = NewType("MilliWatts", int)
"""Power in milliwatts (NVML ``nvmlDeviceGetPowerUsage`` unit)."""

MilliJoules = NewType("MilliJoules", int)
"""Energy in millijoules (NVML ``nvmlDeviceGetTotalEnergyConsumption`` unit)."""


def mw_to_w(power_mw: float) -> float:
    """Convert milliwatts to watts."""
    return power_mw / 1000.0


def w_to_mw(power_w: float) -> int:
    """Convert watts to integer milliwatts (rounded to nearest)."""
    return int(round(power_w * 1000.0))


def mj_to_j(energy_mj: float) -> float:
    """Convert millijoules to joules."""
    return energy_mj / 1000.0


def j_to_mj(energy_j: float) -> int:
    """Convert joules to integer millijoules (floored, as a counter would)."""
    return int(energy_j * 1000.0)
