"""The verl hook's ``install()`` under Ray's setup-hook variable, without verl or Ray.

We test these aspects:
* ``setup_hook_conflict``: one hook governs a job when Ray's reserved variable is unset,
  names this hook, or names the hook the runtime env declares (a user's own hook that calls
  ``install()``, module path or callable); a reserved variable that names another hook than
  the one declared is a conflict, said in one line naming both and what to change;
* ``install()`` under a conflict logs that one line, installs nothing (no import watch) and
  raises nothing into the job; without one it installs; a runtime env it cannot read is no
  conflict and never raises;
* the declared hook of a submitted job's driver comes from its job config;
* idempotence: a second ``install()`` in the same process (a user's hook that calls it after
  Ray ran it, a restarted actor's next task) changes nothing and logs nothing.
"""

from __future__ import annotations

import json
import logging
import sys

import pytest

from rlenergy.sdk import verl_hook

VAR = verl_hook.RESERVED_HOOK_VAR
OURS = verl_hook.HOOK_PATH


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process where ``install()`` has not run; its import watches are dropped after."""
    monkeypatch.setattr(verl_hook, "_INSTALLED", {})
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv(VAR, raising=False)


@pytest.mark.parametrize(
    ("reserved", "declared"),
    [
        (None, None),
        (None, OURS),
        (OURS, OURS),
        (OURS, None),
        ("team.hooks.setup", "team.hooks.setup"),  # the user's hook calls install()
        ("team.hooks.setup", None),
        ("ray_runtime_env_func::AAEC", "setup"),  # a callable hook keeps only its __name__
    ],
)
def test_one_hook_per_job_is_no_conflict(reserved: str | None, declared: str | None) -> None:
    assert verl_hook.setup_hook_conflict(reserved, declared) is None


@pytest.mark.parametrize(
    ("reserved", "declared", "shown"),
    [
        ("team.hooks.setup", OURS, "'team.hooks.setup'"),
        ("team.hooks.setup", "other.setup", "'team.hooks.setup'"),
        ("ray_runtime_env_func::AAEC", OURS, "a callable"),
    ],
)
def test_a_reserved_variable_naming_another_hook_is_one_line(
    reserved: str, declared: str, shown: str
) -> None:
    line = verl_hook.setup_hook_conflict(reserved, declared)
    assert line is not None and "\n" not in line
    assert f"{VAR} already names {shown}" in line
    assert f"worker_process_setup_hook {declared!r}" in line
    assert "RayJob.spec.runtimeEnvYAML" in line and f"{OURS}()" in line


def test_install_under_two_hooks_logs_one_line_and_installs_nothing(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(VAR, "team.hooks.setup")
    monkeypatch.setattr(verl_hook, "_declared_hook", lambda: OURS)
    watches = len(sys.meta_path)
    with caplog.at_level(logging.WARNING, logger=verl_hook.__name__):
        verl_hook.install()
        verl_hook.install()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "two setup hooks in one job" in lines[0], lines
    assert len(sys.meta_path) == watches  # nothing installed: no import watch


def test_install_without_a_conflict_installs_once(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(VAR, "team.hooks.setup")
    monkeypatch.setattr(verl_hook, "_declared_hook", lambda: "team.hooks.setup")
    watches = len(sys.meta_path)
    with caplog.at_level(logging.WARNING, logger=verl_hook.__name__):
        verl_hook.install()
    first = len(caplog.records)
    installed = len(sys.meta_path)
    assert installed > watches  # the v1 trainer's, the router's and the engines' watches
    with caplog.at_level(logging.WARNING, logger=verl_hook.__name__):
        verl_hook.install()
    assert len(sys.meta_path) == installed
    assert len(caplog.records) == first  # the second call logs nothing


def test_an_unreadable_runtime_env_is_no_conflict(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> object:
        raise RuntimeError("no runtime context")

    monkeypatch.setenv(VAR, "team.hooks.setup")
    monkeypatch.setattr(verl_hook, "_declared_hook", broken)
    watches = len(sys.meta_path)
    verl_hook.install()
    assert len(sys.meta_path) > watches


def test_a_submitted_jobs_driver_reads_the_declared_hook_from_its_job_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ray job submit`` and KubeRay's submitter give the driver ``{"runtime_env": ...}``."""
    config = {"runtime_env": {"worker_process_setup_hook": "team.hooks.setup"}}
    monkeypatch.setenv(verl_hook.JOB_CONFIG_VAR, json.dumps(config))
    assert verl_hook._declared_hook() == "team.hooks.setup"
    monkeypatch.setenv(verl_hook.JOB_CONFIG_VAR, json.dumps({"runtime_env": None}))
    assert verl_hook._declared_hook() is None
    monkeypatch.delenv(verl_hook.JOB_CONFIG_VAR)
    assert verl_hook._declared_hook() is None  # no Ray worker in this process
