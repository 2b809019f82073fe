"""The ``--backend sim`` GPUs: simulated devices for local runs, benchmarks and image smoke tests.

Testing code: the agent itself never imports the simulator (``pyproject.toml`` import
contracts); ``rlenergy_agent.__main__`` imports this module only when ``backend == "sim"``.
"""

from __future__ import annotations

from rlenergy.gpu import base, models
from rlenergy.sim import gpu as sim_gpu


def simulated_gpus(node_name: str, sku_name: str, count: int) -> dict[str, base.Gpu]:
    """``count`` simulated GPUs of SKU ``sku_name``, keyed by UUID ``GPU-sim-<node>-<i>``.

    Raises:
        KeyError: unknown SKU (``rlenergy.gpu.models.get_sku``); the message lists the known ones.
    """
    sku = models.get_sku(sku_name)
    return {
        f"GPU-sim-{node_name}-{i:02d}": sim_gpu.SimulatedGpu(
            sku, f"GPU-sim-{node_name}-{i:02d}", seed=i
        )
        for i in range(count)
    }
