"""verl tests (``make test-verl``): the pinned verl from PyPI in ``.venv-verl``, never mocked.

They reuse the agent unit tests' stand-in NVML fixtures (a real node agent behind the real
Unix-socket server). Run in the main venv, they fail with the command that builds theirs.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "agent"))

_VERL = importlib.util.find_spec("verl")
if _VERL is None or _VERL.origin is None:  # no origin: this folder itself (a namespace package)
    pytest.exit(
        "tests/verl need the pinned verl: run them with `make test-verl` (it builds .venv-verl)",
        returncode=4,
    )

_spec = importlib.util.spec_from_file_location(
    "agent_unit_conftest", Path(__file__).resolve().parents[1] / "unit" / "agent" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_agent_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_agent_conftest)
make_driver = _agent_conftest.make_driver
short_tmp = _agent_conftest.short_tmp
standin_lib = _agent_conftest.standin_lib

__all__ = ["cpu_weight_sync", "hooked", "make_driver", "short_tmp", "standin_lib"]

# verl and Ray warn at import (optional engines missing: megatron, mindspeed...; Ray's
# deprecated state-API path) and torch on its nested tensors: third-party noise that the
# project's warnings-are-errors setting must not turn into failures of these tests.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    import verl.trainer.main_ppo  # noqa: F401
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from rlenergy.sdk import verl_hook  # noqa: E402 - after the verl check above


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for category in ("UserWarning", "DeprecationWarning", "FutureWarning"):
            item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}"))


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's classes as ``install`` leaves them (restored after the test)."""
    for cls, names in (
        (ActorRolloutRefWorker, [*verl_hook.TRAINING_METHODS, verl_hook.WEIGHTS_METHOD]),
        (TrainingWorker, list(verl_hook.CRITIC_METHODS)),
        (RayPPOTrainer, ["_update_actor"]),
        (PPOTrainer, ["_update_actor"]),
        (CheckpointEngineWorker, [verl_hook.WEIGHTS_METHOD]),
        (AgentLoopManager, ["generate_sequences"]),
    ):
        for name in names:
            monkeypatch.setattr(cls, name, cls.__dict__[name])
    monkeypatch.setattr(verl_hook, "_HOOK", None)
    monkeypatch.setattr(verl_hook, "_POOL", None)
    monkeypatch.setattr(verl_hook, "_INSTALLED", {})  # install() runs once per process
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # install's import watches
    verl_hook.install()


@pytest.fixture
def cpu_weight_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The GPU-only calls of the colocated weight sync made CPU no-ops; a 1-process gloo group
    for its real ``torch.distributed.barrier``."""
    from rlenergy_dev import verlrank
    from verl.workers import engine_workers

    for name, value in verlrank.CPU_DEVICE.items():
        monkeypatch.setattr(engine_workers, name, value)
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()
