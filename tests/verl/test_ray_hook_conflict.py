"""The hook's setup-hook check in real Ray worker processes (the pinned Ray, verl 0.9.1).

We test these aspects:
* the job's hook, ``rlenergy.sdk.verl_hook.install``, at job level: a worker reads Ray's
  reserved variable and the job's declared hook (the two inputs of ``setup_hook_conflict``)
  inside the setup hook without crashing, finds one hook and is patched;
* the documented fallback, the user's own hook at job level calling ``install()``: the reserved
  variable and the declared hook both name the user's hook, no conflict, verl's classes
  patched, and the worker process lives (Ray's runtime context read in a setup hook kills it);
* a Ray actor that is restarted: the new process runs the hook again and is patched; a
  second ``install()`` in it adds no import watch and changes nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from rlenergy.sdk import verl_hook

USER_HOOK = """
from rlenergy.sdk import verl_hook

def setup():
    verl_hook.install()
"""


def _state() -> dict[str, Any]:
    """What a worker process holds after its setup hook (runs inside the worker)."""
    import sys

    from verl.workers.engine_workers import ActorRolloutRefWorker

    from rlenergy.sdk import verl_hook as hook

    return {
        "pid": os.getpid(),
        "reserved": os.environ.get(hook.RESERVED_HOOK_VAR),
        "declared": hook._declared_hook(),
        "conflict": hook.setup_hook_conflict(
            os.environ.get(hook.RESERVED_HOOK_VAR), hook._declared_hook()
        ),
        "installed": bool(hook._INSTALLED),
        "patched": getattr(
            ActorRolloutRefWorker.__dict__["update_actor"], "__rlenergy_patched__", False
        ),
        "watches": len(sys.meta_path),
    }


@ray.remote
def state() -> dict[str, Any]:
    return _state()


@ray.remote(max_restarts=1, max_task_retries=3)
class Rank:
    def state(self) -> dict[str, Any]:
        return _state()

    def install_again(self) -> int:
        import sys

        verl_hook.install()
        return len(sys.meta_path)


def _init(tmp_path: Path, hook: str) -> None:
    (tmp_path / "team_hooks.py").write_text(USER_HOOK)
    # the user's hook module, and this module (its remote functions are pickled by reference)
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join([str(tmp_path), here, os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": hook, "env_vars": {"PYTHONPATH": path}},
    )


@pytest.mark.slow
def test_the_jobs_hook_is_one_hook_and_a_restarted_actor_installs_once(tmp_path: Path) -> None:
    _init(tmp_path, verl_hook.HOOK_PATH)
    try:
        got = ray.get(state.remote(), timeout=300)
        assert got["reserved"] == got["declared"] == verl_hook.HOOK_PATH, got
        assert got["conflict"] is None and got["installed"] and got["patched"], got

        rank = Rank.remote()  # type: ignore[attr-defined]
        first = ray.get(rank.state.remote(), timeout=300)
        ray.kill(rank, no_restart=False)  # asynchronous: a call may still reach the old process
        deadline = time.monotonic() + 300
        again = first
        while again["pid"] == first["pid"] and time.monotonic() < deadline:
            time.sleep(0.5)
            again = ray.get(rank.state.remote(), timeout=300)
        assert again["pid"] != first["pid"], (first, again)
        assert again["patched"] and again["installed"] and again["conflict"] is None
        assert ray.get(rank.install_again.remote(), timeout=120) == again["watches"]
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_the_users_own_hook_calling_install_is_one_hook(tmp_path: Path) -> None:
    _init(tmp_path, "team_hooks.setup")
    try:
        got = ray.get(state.remote(), timeout=300)
        assert got["reserved"] == got["declared"] == "team_hooks.setup", got
        assert got["conflict"] is None and got["installed"] and got["patched"], got
    finally:
        ray.shutdown()
