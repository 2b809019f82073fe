"""docs/verl.md's one setting, as written, through verl 0.9.1's own Hydra config and
``run_ppo``: the hook arrives in ``ray.init``'s runtime env, and Ray runs it in a worker
process, which then holds verl's patched classes."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import ray
import verl
from hydra import compose, initialize_config_dir
from verl.trainer import main_ppo

from rlenergy.sdk import verl_hook

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"


def _doc_overrides() -> list[str]:
    """The Hydra overrides of the doc's ``python3 -m verl.trainer.main_ppo`` command."""
    text = DOC.read_text()
    block = re.search(r"```bash\n(python3 -m verl\.trainer\.main_ppo.*?)```", text, re.S)
    assert block, "docs/verl.md lost its verl command line"
    words = shlex.split(block.group(1).replace("\\\n", " "))
    return [w for w in words if "=" in w]


class _Stop(Exception):
    pass


def _doc_config() -> Any:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=_doc_overrides())


def _ray_init_kwargs(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    config = _doc_config()
    assert config.trainer.use_v1 is True  # verl's default: main() runs the v1 TaskRunnerV1
    seen: dict[str, Any] = {}

    def init(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(_Stop):
        main_ppo.run_ppo(config, task_runner_class=None)
    return seen


def test_the_docs_setting_reaches_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = _ray_init_kwargs(monkeypatch)
    hook = kwargs["runtime_env"]["worker_process_setup_hook"]
    assert hook == "rlenergy.sdk.verl_hook.install"
    module, _, name = hook.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))
    assert "env_vars" in kwargs["runtime_env"]  # verl's own runtime env is kept, merged


def test_the_docs_command_turns_on_vllms_token_counter() -> None:
    """verl 0.9.1 starts vLLM with ``disable_log_stats: True`` by default, which leaves out
    vLLM's Prometheus stat logger (and its ``vllm:generation_tokens`` counter)."""
    assert _doc_config().actor_rollout_ref.rollout.disable_log_stats is False


@pytest.mark.slow
def test_ray_runs_the_hook_in_a_worker_process_before_its_tasks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime_env = _ray_init_kwargs(monkeypatch)["runtime_env"]
    monkeypatch.undo()  # the real ray.init again
    ray.init(num_cpus=1, include_dashboard=False, runtime_env=runtime_env, log_to_driver=False)
    try:

        @ray.remote
        def patched() -> dict[str, bool]:
            from verl.trainer.ppo.ray_trainer import RayPPOTrainer
            from verl.workers.engine_workers import ActorRolloutRefWorker

            names = ["compute_log_prob", "compute_ref_log_prob", "update_actor", "update_weights"]
            out = {
                n: getattr(ActorRolloutRefWorker.__dict__[n], "__rlenergy_patched__", False)
                for n in names
            }
            out["_update_actor"] = getattr(
                RayPPOTrainer.__dict__["_update_actor"], "__rlenergy_patched__", False
            )
            from verl.trainer.ppo.v1.trainer_base import PPOTrainer  # patched on this import

            out["v1 PPOTrainer._update_actor"] = getattr(
                PPOTrainer.__dict__["_update_actor"], "__rlenergy_patched__", False
            )
            from verl.checkpoint_engine.base import CheckpointEngineWorker

            out["CheckpointEngineWorker.update_weights"] = getattr(
                CheckpointEngineWorker.__dict__["update_weights"], "__rlenergy_patched__", False
            )
            import sys

            watched = {getattr(f, "name", None) for f in sys.meta_path}
            out["engine servers watched"] = {m for m, _ in verl_hook.ENGINE_SERVERS} <= watched
            return out

        got = ray.get(patched.remote(), timeout=300)
        assert all(got.values()), [k for k, v in got.items() if not v]
    finally:
        ray.shutdown()


CHILD = """
import json, os, sys
import ray
ray.init(address=os.environ["RLENERGY_TEST_GCS"], runtime_env=json.loads(sys.argv[1]),
         log_to_driver=False)

@ray.remote
def patched():
    from verl.workers.engine_workers import ActorRolloutRefWorker
    return getattr(ActorRolloutRefWorker.__dict__["update_actor"], "__rlenergy_patched__", False)

print(json.dumps(ray.get(patched.remote(), timeout=300)))
"""


@pytest.mark.slow
def test_a_child_of_a_hooked_worker_calls_ray_init_with_the_jobs_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a KubeRay RayJob's driver and vLLM's Ray executor do: a process started from a
    hooked Ray worker calls ``ray.init`` again with the job's runtime env (the hook already
    turned into Ray's reserved variable). The pinned Ray accepts the same hook again
    (``verl_hook.RAY_NESTED_INIT``) and the child's tasks are hooked; a different hook is
    refused by Ray with a message naming both."""
    runtime_env = _ray_init_kwargs(monkeypatch)["runtime_env"]
    monkeypatch.undo()
    assert verl_hook.ray_version_problem(ray.__version__) is None
    assert "upgrade to Ray >= 2.55.0" in (verl_hook.ray_version_problem("2.54.1") or "")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env, log_to_driver=False)
    try:

        @ray.remote
        def nested(hook: str) -> tuple[int, str, str]:
            import json
            import os
            import subprocess
            import sys

            env = dict(ray.get_runtime_context().runtime_env)
            env["worker_process_setup_hook"] = hook
            child_env = {**os.environ, "RLENERGY_TEST_GCS": ray.get_runtime_context().gcs_address}
            done = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(env)],
                env=child_env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            return done.returncode, done.stdout, done.stderr

        same = ray.get(nested.remote("rlenergy.sdk.verl_hook.install"), timeout=300)
        assert same[0] == 0 and same[1].strip() == "true", same[2][-2000:]
        other = ray.get(nested.remote("other.module.setup"), timeout=300)
        assert other[0] != 0 and "Conflicting worker_process_setup_hook" in other[2]
    finally:
        ray.shutdown()
