"""Typed GPU errors: a small tree that both the NVML backend and the simulator raise.

Callers decide by type: ``GpuNotSupportedError`` means "this GPU cannot do that, use a
fallback", ``GpuNoPermissionError`` means "the agent lacks CAP_SYS_ADMIN or the driver refuses
clock changes", ``GpuLostError`` means "the device fell off the bus; degrade this GPU only",
``GpuTransientError`` means "try again". Source of the split: NVML return codes
NVML_ERROR_NOT_SUPPORTED / NO_PERMISSION / GPU_IS_LOST (NVML API reference), as zeus maps them.
"""

from __future__ import annotations

from rlenergy import errors


class GpuError(errors.RLEnergyError):
    """Base of all GPU errors.

    Args:
        message: what failed.
        uuid: the GPU's UUID when known.
    """

    def __init__(self, message: str, uuid: str | None = None) -> None:
        super().__init__(f"{uuid}: {message}" if uuid else message)
        self.uuid = uuid


class GpuNotSupportedError(GpuError):
    """The GPU or driver does not support the operation (NVML_ERROR_NOT_SUPPORTED)."""


class GpuNoPermissionError(GpuError):
    """The caller may not perform the operation (NVML_ERROR_NO_PERMISSION)."""


class GpuLostError(GpuError):
    """The GPU is gone or unusable (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_UNINITIALIZED after loss)."""


class GpuTransientError(GpuError):
    """Any other failure; retrying may help."""
