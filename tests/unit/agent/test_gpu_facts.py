"""hack/gpu-facts on the stand-in NVML: read-only, and it reports what the stand-in holds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from rlenergy_dev import standin

from rlenergy.gpu import models

SCRIPT = Path(__file__).resolve().parents[3] / "hack" / "gpu-facts"
H100 = models.get_sku("h100-sxm")


def _run(drv: standin.StandinDriver, lib_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **drv.env(lib_dir)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--sample-s", "0.4", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_the_script_calls_no_nvml_setter() -> None:
    source = SCRIPT.read_text()
    assert re.findall(r"nvml\w*(?:Set|Reset|Clear)\w*", source) == []
    assert "nvmlDeviceGet" in source


def test_facts_match_the_standin_and_nothing_is_written(standin_lib: Path, tmp_path: Path) -> None:
    with standin.StandinDriver(tmp_path / "state", [("GPU-facts-0", H100)]) as drv:
        drv.start(tick_s=0.02)
        facts = json.loads(_run(drv, standin_lib, "--json").stdout)
        g = drv.gpu("GPU-facts-0")
        written = (g.clock_writes, g.locked, g.mem_locked)
        del g  # the mapping cannot close while a view of it lives
    assert written == (0, 0, 0)
    (gpu,) = facts["gpus"]
    assert gpu["name"] == H100.nvml_name
    clocks = H100.supported_sm_clocks_mhz()
    assert gpu["sm_clocks"] == {
        "count": len(clocks),
        "max_mhz": clocks[0],
        "min_mhz": clocks[-1],
        "steps_mhz": [H100.clock_step_mhz],
    }
    assert gpu["memory_clocks_mhz"] == [H100.memory_clock_mhz]
    assert gpu["power_limit_constraints_mw"] == [200_000, 700_000]
    assert gpu["power_limit_default_mw"] == gpu["power_limit_enforced_mw"] == 700_000
    assert gpu["idle_power_mw"] == int(H100.idle_power_w * 1000)
    # The driver thread updates the counter every 20 ms (plus scheduling delay).
    update = gpu["energy_counter_update"]
    assert update["changes"] >= 3 and 15 <= update["period_ms"] <= 100


def test_the_table_puts_gpu_model_and_standin_side_by_side(
    standin_lib: Path, tmp_path: Path
) -> None:
    with standin.StandinDriver(tmp_path / "state", [("GPU-facts-0", H100)]) as drv:
        drv.start(tick_s=0.02)
        out = _run(drv, standin_lib).stdout
    assert "model: h100-sxm" in out
    row = next(line for line in out.splitlines() if line.startswith("power_limit_constraints_mw"))
    assert row.count("[200000, 700000]") == 3
    row = next(line for line in out.splitlines() if line.startswith("max_sm_clock_mhz"))
    assert [c.strip() for c in row.split("|")[1:]] == ["1980"] * 3
