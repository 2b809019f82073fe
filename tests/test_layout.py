"""The layout keeps the standard library's ``operator`` module importable (STYLE.md section 6)."""

import importlib
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_operator_is_the_standard_library() -> None:
    import operator

    assert operator.add(2, 3) == 5
    # The standard library's own operator.py, not a package of this repository shadowing it.
    assert Path(operator.__file__ or "").parent == Path(sysconfig.get_paths()["stdlib"])
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_import_operator_from_repo_root_in_a_fresh_interpreter() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import operator, sys; print(operator.__file__); print(hasattr(operator, 'itemgetter'))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    path, has_itemgetter = out.stdout.split()
    assert has_itemgetter == "True"
    assert not path.startswith(str(ROOT / "operator"))


def test_component_packages_import_from_this_checkout() -> None:
    # The editable install resolves each component to its folder in this repository.
    homes = {
        "rlenergy": ROOT / "rlenergy",
        "rlenergy_operator": ROOT / "operator" / "rlenergy_operator",
        "rlenergy_agent": ROOT / "agent" / "rlenergy_agent",
        "rlenergy_dev": ROOT / "dev" / "rlenergy_dev",
    }
    for name, home in homes.items():
        module = importlib.import_module(name)
        assert Path(module.__file__ or "").parent == home, (name, module.__file__)


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by basename (no packages under tests/): two files of one
    name stop collection ("import file mismatch") for the whole run."""
    tests = Path(__file__).resolve().parent
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {n: p for n, p in seen.items() if len(p) > 1} == {}
