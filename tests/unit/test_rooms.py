"""Room sizes, so that new features do not pile back into a few units.

* ruff holds every package to a complexity limit (``C901`` with ``max-complexity`` 15 and
  ``PLR0915`` with ``max-statements`` 60, pyproject's ``[tool.ruff.lint]``); only tests and
  bench drivers are exempt;
* every function in the operator's ``handlers.py`` is at most 40 lines (kopf handlers stay
  thin: the work is in pure modules such as ``jobloop``);
* the agent's ``service.py`` is under 500 lines (one module per concern beside it);
* the agent's ``__main__.main`` is under 60 lines (the node loop is its own object).

ruff has no rule for a function's or a module's length in lines, so those three stay here.
Lines are counted from the ``def`` line to the function's last line (decorators excluded), as
``ast`` reports them. A failure names the function and says where its work should go.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HANDLERS = ROOT / "operator" / "rlenergy_operator" / "handlers.py"
SERVICE = ROOT / "agent" / "rlenergy_agent" / "service.py"
AGENT_MAIN = ROOT / "agent" / "rlenergy_agent" / "__main__.py"


def _functions(path: Path) -> dict[str, int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        node.name: (node.end_lineno or node.lineno) - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def test_every_handler_function_is_at_most_40_lines():
    long = {name: n for name, n in _functions(HANDLERS).items() if n > 40}
    assert not long, (
        f"{HANDLERS.relative_to(ROOT)}: {long} lines; move the work into a pure function "
        "(jobloop.py, conditions.py, or a new module) and keep the kopf handler thin"
    )


def test_the_agent_service_module_is_under_500_lines():
    n = len(SERVICE.read_text().splitlines())
    assert n < 500, (
        f"{SERVICE.relative_to(ROOT)} has {n} lines; put the new concern in its own module "
        "(as probes.py, parks.py, records.py, stalls.py are) and delegate from Agent"
    )


def test_the_agent_main_is_under_60_lines():
    n = _functions(AGENT_MAIN)["main"]
    assert n < 60, (
        f"{AGENT_MAIN.relative_to(ROOT)}: main is {n} lines; the node loop belongs in its own "
        "object (nodeloop.py), main only wires"
    )


def test_ruff_limits_the_complexity_of_every_package():
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert {"C901", "PLR0915"} <= set(lint["select"])
    assert lint["mccabe"]["max-complexity"] <= 15
    assert lint["pylint"]["max-statements"] <= 60
    exempt = {
        pattern
        for pattern, rules in lint.get("per-file-ignores", {}).items()
        if {"C901", "PLR0915"} & set(rules)
    }
    assert exempt <= {"tests/**", "bench/**"}, (
        f"{sorted(exempt)} escape the complexity limit; split the function into named steps, "
        "or justify one line with '# noqa: C901 - <reason>'"
    )
