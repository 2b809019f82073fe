"""The agent's settings read from ``RLENERGY_AGENT_*`` variables as ``pydantic-settings`` reads them.

The agent reads its variables itself (``rlenergy_agent.config.from_environ``) and leaves
converting and checking them to pydantic, so that its process does not load
``pydantic-settings``. We test these aspects:

* the same environments give the same settings as a ``pydantic-settings`` class with the same
  fields and prefix (the library the operator still uses), for valid values of every kind of
  field, case-insensitive names, variables that name no setting, and keyword arguments over
  variables; and both refuse the same invalid values;
* an invalid variable's error names the setting;
* importing the agent's entry point does not import ``pydantic_settings``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pydantic
import pydantic_settings
import pytest
from rlenergy_agent import config

REFERENCE = pydantic.create_model(
    "ReferenceSettings",
    __base__=pydantic_settings.BaseSettings,
    **{name: (f.annotation, f) for name, f in config.AgentSettings.model_fields.items()},
)
REFERENCE.model_config.update(env_prefix=config.ENV_PREFIX, extra="ignore")

VALID: list[dict[str, str]] = [
    {},
    {"RLENERGY_AGENT_NODE_NAME": "gpu-node-1", "RLENERGY_AGENT_KUBE": "false"},
    {"rlenergy_agent_backend": "sim", "Rlenergy_Agent_Sim_Gpus": "4"},
    {
        "RLENERGY_AGENT_SAMPLE_INTERVAL_S": "0.25",
        "RLENERGY_AGENT_TLS_PORT": "9403",
        "RLENERGY_AGENT_ENFORCE": "0",
        "RLENERGY_AGENT_STATE_DIR": "/var/lib/rl",
        "RLENERGY_AGENT_TLS_CERT_FILE": "/etc/tls/tls.crt",
        "RLENERGY_AGENT_REPORT_FILE": "",
        "RLENERGY_AGENT_UNKNOWN_THING": "x",
        "OTHER": "y",
    },
    {"RLENERGY_AGENT_STATIC_PODS": '{"ns/pod": ["GPU-1"]}', "RLENERGY_AGENT_ENFORCE": "yes"},
]
INVALID: list[dict[str, str]] = [
    {"RLENERGY_AGENT_BACKEND": "cuda"},
    {"RLENERGY_AGENT_TLS_PORT": "70000"},
    {"RLENERGY_AGENT_SAMPLE_INTERVAL_S": "0"},
    {"RLENERGY_AGENT_KUBE": "maybe"},
    {"RLENERGY_AGENT_TOKEN_CACHE_MAX_S": "11"},
    {"RLENERGY_AGENT_TOKEN_AUDIENCE": ""},
]


def _both(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], **kw: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    for key in [k for k in list(os.environ) if k.upper().startswith("RLENERGY_")]:
        monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    return config.AgentSettings(**kw).model_dump(), REFERENCE(**kw).model_dump()


@pytest.mark.parametrize("environ", VALID)
def test_valid_environments_give_what_pydantic_settings_gives(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str]
) -> None:
    ours, reference = _both(monkeypatch, environ)
    assert ours == reference
    assert ours["node_name"] == environ.get("RLENERGY_AGENT_NODE_NAME", "")


def test_keyword_arguments_win_over_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"RLENERGY_AGENT_NODE_NAME": "from-env", "RLENERGY_AGENT_METRICS_PORT": "1234"}
    ours, reference = _both(monkeypatch, environ, node_name="from-cli")
    assert ours == reference
    assert (ours["node_name"], ours["metrics_port"]) == ("from-cli", 1234)


@pytest.mark.parametrize("environ", INVALID)
def test_invalid_values_are_refused_by_both_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str]
) -> None:
    with pytest.raises(pydantic.ValidationError) as ours:
        _both(monkeypatch, environ)
    with pytest.raises(pydantic.ValidationError):
        REFERENCE()
    field = next(iter(environ)).lower().removeprefix("rlenergy_agent_")
    assert ours.value.errors()[0]["loc"] == (field,)


def test_the_agent_process_does_not_load_pydantic_settings() -> None:
    code = "import sys, rlenergy_agent.__main__; print('pydantic_settings' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"
