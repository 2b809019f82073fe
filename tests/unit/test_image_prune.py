"""The images keep only the Kubernetes client's API modules the components use.

``hack/images/build.py`` removes every module of ``kubernetes/client/api`` that is not in
``KUBERNETES_APIS``. A component that starts using another API class (say ``BatchV1Api``)
would raise ``AttributeError``/``ImportError`` in the shipped image only, where the client
resolves the class lazily; this test fails first, naming the class and the module to keep.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import kubernetes.client

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = (
    ROOT / "rlenergy",
    ROOT / "operator" / "rlenergy_operator",
    ROOT / "agent" / "rlenergy_agent",
)
API_NAME = re.compile(r"\b([A-Z][A-Za-z0-9]*Api)\b")


def _build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("images_build", ROOT / "hack/images/build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def _used_api_modules() -> dict[str, str]:
    """API class -> its module's file stem, for every client API class the shipped code names."""
    used: dict[str, str] = {}
    for root in COMPONENTS:
        for path in root.rglob("*.py"):
            if "testing" in path.relative_to(root).parts:
                continue  # test support code never runs in the images
            for name in API_NAME.findall(path.read_text()):
                cls = getattr(kubernetes.client, name, None)
                if isinstance(cls, type) and cls.__module__.startswith("kubernetes.client.api."):
                    used[name] = cls.__module__.rsplit(".", 1)[1]
    return used


def test_every_api_class_the_components_use_is_kept_in_the_images() -> None:
    kept = set(_build().KUBERNETES_APIS)
    used = _used_api_modules()
    assert {"CustomObjectsApi", "CoreV1Api"} <= used.keys()  # the scan finds real uses
    missing = {name: mod for name, mod in used.items() if mod not in kept}
    assert not missing, (
        f"the components use {sorted(missing)}, whose modules the images remove: add "
        f"{sorted(set(missing.values()))} to KUBERNETES_APIS in hack/images/build.py"
    )


def test_every_kept_module_exists_in_the_pinned_client() -> None:
    api_dir = Path(kubernetes.client.__file__).parent / "api"
    for stem in _build().KUBERNETES_APIS:
        assert (api_dir / f"{stem}.py").is_file(), (
            f"kubernetes/client/api/{stem}.py not in the client"
        )
