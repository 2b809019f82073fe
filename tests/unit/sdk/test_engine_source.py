"""The elastic-EP adapters (``rlenergy.sdk.engines``) against the pinned engines' real source.

The versions are pinned once, in ``pyproject.toml`` ``[tool.rlenergy.engines]``; ``make
engine-wheels`` (``hack/engine-wheels.sh``, a prerequisite of ``make unit`` and ``make test``)
fetches the two wheels into the cache. This test downloads nothing and installs nothing: it
reads the modules out of the wheels (zip files) and parses them with ``ast``. We check:
* vLLM: ``/scale_elastic_ep`` is a POST route that reads every field the adapter sends
  (``new_data_parallel_size``, ``drain_timeout``) and answers 408 on a drain timeout;
  ``/is_scaling_elastic_ep`` is a route of the adapter's method whose reply carries
  ``is_scaling_elastic_ep`` and the adapter's error field;
* the progress sources (``rlenergy.sdk.progress.ENGINES``) name the same versions;
* SGLang: the same routes with SGLang's methods (the status route is a GET) and body field
  (``new_ep_size``); ``TokenizerManager.get_elastic_ep_state`` returns the fields the
  adapter reads; the scheduler refuses a ``new_ep_size`` not above the current size (so the
  adapter must refuse every release: if SGLang learns to shrink, this fails and the adapter
  must follow).
"""

from __future__ import annotations

import ast
import os
import tomllib
import zipfile
from pathlib import Path

import pytest

from rlenergy.sdk import engines, progress

ROOT = Path(__file__).resolve().parents[3]
PINS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["rlenergy"]["engines"]
CACHE = Path(os.environ.get("RLENERGY_CACHE", Path.home() / ".cache" / "rl-energy")) / "engines"


def _source(engine: str, module: str) -> ast.Module:
    """``module`` (a path inside the wheel) of the pinned ``engine``, parsed."""
    wheels = sorted(CACHE.glob(f"{engine}-{PINS[engine]}-*.whl"))
    if not wheels:
        pytest.fail(
            f"no {engine}=={PINS[engine]} wheel in {CACHE}: run `make engine-wheels` "
            "(hack/engine-wheels.sh fetches the pinned wheels from PyPI, once)"
        )
    with zipfile.ZipFile(wheels[0]) as whl:
        return ast.parse(whl.read(module).decode(), filename=f"{wheels[0].name}:{module}")


def _routes(tree: ast.Module) -> dict[tuple[str, str], ast.AsyncFunctionDef | ast.FunctionDef]:
    """``(METHOD, path) -> handler`` for every ``@router.<method>("<path>", ...)``."""
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for dec in node.decorator_list:
            if (
                isinstance(dec, ast.Call)
                and isinstance(dec.func, ast.Attribute)
                and isinstance(dec.func.value, ast.Name)
                and dec.func.value.id == "router"
                and dec.args
                and isinstance(dec.args[0], ast.Constant)
            ):
                out[(dec.func.attr.upper(), str(dec.args[0].value))] = node
    return out


def _body_fields(handler: ast.AST) -> set[str]:
    """Keys the handler reads with ``body.get("<key>", ...)``."""
    return {
        str(n.args[0].value)
        for n in ast.walk(handler)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "get"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "body"
        and n.args
        and isinstance(n.args[0], ast.Constant)
    }


def _dict_keys(node: ast.AST) -> set[str]:
    """String keys of every dict literal under ``node``."""
    return {
        str(k.value)
        for d in ast.walk(node)
        if isinstance(d, ast.Dict)
        for k in d.keys
        if isinstance(k, ast.Constant)
    }


def _function(tree: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name:
            return n
    raise AssertionError(f"no function {name}")


def _sent(cls: type[engines._HttpEngine]) -> set[str]:
    eng = cls("http://127.0.0.1:1", ranks=4)
    return set(eng._scale_body(2))


def test_vllm_routes_methods_and_fields():
    assert PINS["vllm"] == "0.33.0"
    tree = _source("vllm", "vllm/entrypoints/serve/elastic_ep/api_router.py")
    routes = _routes(tree)
    cls = engines.VllmElasticEngine
    scale = routes[("POST", cls.scale_path)]
    assert _sent(cls) == {"new_data_parallel_size", "drain_timeout"}
    assert _sent(cls) <= _body_fields(scale)
    codes = {
        kw.value.value
        for n in ast.walk(scale)
        if isinstance(n, ast.Call)
        for kw in n.keywords
        if kw.arg == "status_code" and isinstance(kw.value, ast.Constant)
    }
    assert {400, 408, 500} <= codes  # bad body, drain timed out (before any change), failed
    status = routes[(cls.status_method, cls.status_path)]
    assert {"is_scaling_elastic_ep", cls.error_field} <= _dict_keys(status)


def test_sglang_routes_methods_fields_and_scale_up_only():
    assert PINS["sglang"] == "0.5.23"
    tree = _source("sglang", "sglang/srt/entrypoints/elastic_ep.py")
    routes = _routes(tree)
    cls = engines.SglangElasticEngine
    assert cls.status_method == "GET" and ("POST", cls.status_path) not in routes
    scale = routes[("POST", cls.scale_path)]
    assert _sent(cls) == {"new_ep_size"} and _sent(cls) <= _body_fields(scale)
    assert (cls.status_method, cls.status_path) in routes
    manager = _source("sglang", "sglang/srt/managers/tokenizer_manager.py")
    state = _dict_keys(_function(manager, "get_elastic_ep_state"))
    assert {"is_scaling_elastic_ep", cls.error_field, "effective_ep_size"} <= state
    scheduler = _source("sglang", "sglang/srt/managers/scheduler.py")
    handler = _function(scheduler, "handle_scale_elastic_ep")
    refuses_shrink = any(
        isinstance(n, ast.Compare)
        and isinstance(n.left, ast.Name)
        and n.left.id == "new_ep_size"
        and isinstance(n.ops[0], ast.LtE)
        for n in ast.walk(handler)
    )
    # The refusal itself is tested in tests/unit/sdk/test_sdk_engines.py.
    assert refuses_shrink, "SGLang can shrink now: SglangElasticEngine must stop refusing"


def test_one_pin_for_adapters_and_progress_sources():
    # The progress sources' metric names were read from the same versions (rlenergy.sdk.progress).
    assert {name: c.version for name, c in progress.ENGINES.items()} == PINS


def _text(engine: str, module: str) -> str:
    return ast.unparse(_source(engine, module))


def test_what_the_adapters_probe_and_read_back_is_in_the_pinned_source():
    # vLLM: the probe's routes and parallel_config fields, the EPLB floor, the terminal text.
    info = _routes(_source("vllm", "vllm/entrypoints/serve/dev/server_info/api_router.py"))
    assert ("GET", "/server_info") in info
    basic = _routes(_source("vllm", "vllm/entrypoints/serve/instrumentator/basic.py"))
    assert ("GET", "/version") in basic
    parallel = _text("vllm", "vllm/config/parallel.py")
    for field in (
        "data_parallel_size",
        "tensor_parallel_size",
        "prefill_context_parallel_size",
        "data_parallel_external_lb",
        "data_parallel_hybrid_lb",
        "enable_elastic_ep",
    ):
        assert f"{field}:" in parallel, field
    assert "EPLB requires tensor, prefill-context, or data parallelism" in parallel
    core = _text("vllm", "vllm/v1/engine/core.py")
    assert "Elastic EP reconfiguration is already active" in core
    assert any(
        m in "Elastic EP reconfiguration is already active" for m in engines.TERMINAL_MARKERS
    )
    # SGLang: the phase the grow-back waits for, and the 409 of a pending scale.
    manager = _source("sglang", "sglang/srt/managers/tokenizer_manager.py")
    assert "scale_phase" in _dict_keys(_function(manager, "get_elastic_ep_state"))
    assert "'serving_expanded'" in ast.unparse(manager)
    route = _text("sglang", "sglang/srt/entrypoints/elastic_ep.py")
    assert "HTTPStatus.CONFLICT" in route
    assert "has not completed yet" in ast.unparse(manager)
