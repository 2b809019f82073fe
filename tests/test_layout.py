"""The layout keeps the standard library's ``operator`` module importable (STYLE.md section 6)."""

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_operator_is_the_standard_library() -> None:
    import operator

    assert operator.add(2, 3) == 5
    assert "site-packages" not in (operator.__file__ or "") or "lib/python" in (
        operator.__file__ or ""
    )
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


def test_component_packages_import() -> None:
    for name in ("rlenergy", "rlenergy_operator", "rlenergy_agent"):
        assert importlib.import_module(name) is not None
