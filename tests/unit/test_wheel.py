"""What ships: the wheel of ``pip wheel .`` holds the product only and needs only pydantic and
pyyaml; the simulator's commands say in one line which extra to install."""

from __future__ import annotations

import email.parser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlenergy import cli

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"rlenergy", "rlenergy_operator", "rlenergy_kubectl", "rlenergy_agent"}
CORE = {"pydantic", "pyyaml"}
"""The core dependencies: what the API, control, GPU protocol and SDK import."""
RUNTIME = ("pydantic", "pydantic_core", "typing_extensions", "annotated_types", "typing_inspection")
"""pydantic and its own dependencies (plus ``yaml``): all a core install has besides the wheel."""


def _requirement_name(spec: str) -> str:
    name = spec.split(";")[0]
    for sep in "<>=!~[ ":
        name = name.split(sep)[0]
    return name.strip().lower()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(out)],
        check=True,
        timeout=600,
    )
    (built,) = out.glob("rl_energy_operator-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_the_product_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == PACKAGES, tops
    for forbidden in ("devcluster", "rlenergy_dev", "testing", "nvml_standin", "standin"):
        assert not [n for n in names if forbidden in n], forbidden
    assert "rlenergy/gpu/simulated.py" in names  # the agent's --backend sim ships
    requires = meta.get_all("Requires-Dist") or []
    core = {_requirement_name(r) for r in requires if "extra ==" not in r}
    assert core == CORE, requires
    sim = {_requirement_name(r) for r in requires if "extra == 'sim'" in r.replace('"', "'")}
    assert sim == {"numpy", "matplotlib", "rich"}, requires


@pytest.mark.slow
def test_core_install_runs_and_names_the_sim_extra(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel],
        check=True,
        timeout=300,
    )
    # The core dependencies from this venv, linked in: nothing else is importable (-I -S).
    import pydantic
    import yaml

    site = Path(pydantic.__file__).parents[1]
    for name in (*RUNTIME, "yaml", "_yaml"):
        for entry in site.glob(f"{name}*"):
            if not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    assert Path(yaml.__file__).parents[1] == site

    def rlenergy(*args: str) -> subprocess.CompletedProcess[str]:
        code = f"import sys; sys.path.insert(0, {str(target)!r}); from rlenergy import cli; "
        code += f"sys.exit(cli.main({list(args)!r}))"
        return subprocess.run(
            [sys.executable, "-I", "-S", "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )

    version = rlenergy("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"rlenergy {wheel.name.split('-')[1]}"
    for command in cli.SIM_COMMANDS:
        run = rlenergy(command)
        assert run.returncode == 2, (command, run.stdout, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1, run.stderr
        assert "numpy" in lines[0] and cli.SIM_INSTALL in lines[0], lines[0]


def test_without_the_sim_extra_each_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)  # find_spec -> None: as if not installed
    assert cli.missing_sim_modules() == ["numpy"]
    for command in ("simulate", "rollout-sim", "traces"):
        assert cli.main([command, "--steps", "1"] if command == "simulate" else [command]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"rlenergy: error: `rlenergy {command}` runs the simulator, which needs numpy: "
            f"{cli.SIM_INSTALL}"
        ]
