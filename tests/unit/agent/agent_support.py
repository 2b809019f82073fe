"""Shared helpers of the agent unit tests (imported as a top-level module, like e2e_support)."""

from __future__ import annotations

import random
from collections.abc import Callable

from rlenergy_agent.testing import standin

DriverFactory = Callable[..., standin.StandinDriver]


def make_uuids(n: int, seed: int = 7) -> list[str]:
    """``n`` random-looking GPU UUIDs (never index-shaped)."""
    rng = random.Random(seed)
    return [f"GPU-{rng.getrandbits(64):016x}-{i}" for i in range(n)]
