"""Agent unit-test fixtures: the stand-in libnvidia-ml.so.1 compiled once per session with gcc,
and a fresh simulated driver per test, loaded by the real pynvml."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_support import DriverFactory, make_uuids
from rlenergy_agent.nvml import lib
from rlenergy_dev import standin

from rlenergy.gpu import models

H100 = models.get_sku("h100-sxm")


@pytest.fixture(scope="session")
def standin_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return standin.build_library(tmp_path_factory.mktemp("nvml-standin-build"))


@pytest.fixture
def make_driver(standin_lib: Path, tmp_path: Path) -> Iterator[DriverFactory]:
    drivers: list[standin.StandinDriver] = []

    def factory(n: int = 2, sku: models.GpuSku = H100, **kw: object) -> standin.StandinDriver:
        drv = standin.StandinDriver(
            tmp_path / f"state{len(drivers)}",
            [(u, sku) for u in make_uuids(n)],
            **kw,  # type: ignore[arg-type]
        )
        standin.preload(standin_lib, drv.path)
        drivers.append(drv)
        return drv

    yield factory
    for _ in range(20):
        try:
            lib.shutdown()
        except lib.NvmlCallError:
            break
    for d in drivers:
        d.close()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder under /tmp with a short path (Unix socket paths are limited to 108 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        yield Path(d)
