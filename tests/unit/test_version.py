"""One version source: ``project.version`` of pyproject.toml. The chart, its image tags, the
image build and the installed package agree with it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import rlenergy_dev
import yaml
from rlenergy_operator import settings

import rlenergy

ROOT = rlenergy_dev.CHECKOUT
CHART = ROOT / "helm" / "rl-energy"


def _load_build() -> object:
    spec = importlib.util.spec_from_file_location("images_build", ROOT / "hack/images/build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_chart_and_its_image_tags_carry_the_project_version() -> None:
    version = rlenergy_dev.project_version()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["version"] == version
    assert chart["appVersion"] == version
    assert values["operator"]["image"]["tag"] == version
    assert values["agent"]["image"]["tag"] == version


def test_the_images_and_package_carry_the_project_version() -> None:
    version = rlenergy_dev.project_version()
    assert _load_build().project_version() == version  # type: ignore[attr-defined]
    assert rlenergy.__version__ == version  # the installed metadata (re-install after a bump)
    default_image = settings.OperatorConfig.model_fields["agent_image"].default
    assert default_image == f"ghcr.io/rl-energy/rl-energy-agent:{version}"


def test_the_version_is_written_once_in_the_sources() -> None:
    version = rlenergy_dev.project_version()
    quoted = (f'"{version}"', f"'{version}'")
    for path in (ROOT / "rlenergy", ROOT / "operator", ROOT / "agent", ROOT / "dev"):
        for source in Path(path).rglob("*.py"):
            text = source.read_text()
            assert not any(q in text for q in quoted), f"{source} copies the version {version}"
