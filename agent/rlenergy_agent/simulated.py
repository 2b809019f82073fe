"""The ``--backend sim`` GPU backend: simulated devices for local runs, benches, image smoke tests.

The devices are ``rlenergy.gpu.simulated.SimulatedGpu`` (standard library only), so the backend
ships with the agent and runs in its image; the agent never imports the simulator
(``rlenergy.sim``, the ``pyproject.toml`` import contracts). ``rlenergy_agent.__main__`` picks
this backend when the setting ``backend`` is ``"sim"`` and the NVML one
(``rlenergy_agent.nvml``) otherwise.
"""

from __future__ import annotations

from rlenergy.gpu import base, models
from rlenergy.gpu import simulated as sim_gpu


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
