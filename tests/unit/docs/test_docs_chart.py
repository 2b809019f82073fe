"""What the docs and the chart's NOTES.txt tell a user to run, held to what the chart renders.

The chart is rendered by the pinned helm (``make bins``; these tests are marked ``e2e`` for
that reason, no cluster is started) for the release and namespace the docs use
(``rl-energy`` in ``rl-energy-system``) and, for NOTES.txt, for another release with changed
values. We test these aspects:
* every RBAC object name a page cites (``--clusterrole=``, ``kubectl create token``,
  ``--serviceaccount=``, a backticked ``rl-energy-*`` name) is one the chart renders, and no page
  writes ``<release>-...`` names, which the chart's name helper does not produce for the docs'
  release;
* every port a page cites is one the chart renders (agent metrics from the operator's
  ConfigMap, operator health and metrics from its Deployment), and the agent's metrics port is
  ``agent.metricsPort``;
* every chart value path a page cites exists in values.yaml, and each default a page gives for
  one is values.yaml's;
* the runbook: no ``helm install --create-namespace`` anywhere; install.md creates and labels
  the release namespace (Pod Security ``privileged``) before ``helm install``, and applies
  ``observe-only.yaml`` before it switches to enforce;
* uninstall and CRD upgrades touch only this chart's own CRDs (``rlenergy.io``), never the
  ``helm/rl-energy/crds/`` folder as a whole, which holds kopf's shared peering CRDs;
* NOTES.txt, rendered: the namespace label, observe first, the GPU node label, the agent port and
  the trainer-annotations ClusterRole name of the release and values given;
* every repository file path a page cites exists, and README/CONTRIBUTING links resolve.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from docs_support import (
    NAMESPACE,
    PAGES,
    RELEASE,
    ROOT,
    commands,
    render,
    render_notes,
)

CRD_DIR = ROOT / "helm" / "rl-energy" / "crds"
VALUES = yaml.safe_load((ROOT / "helm" / "rl-energy" / "values.yaml").read_text())
NEEDS_HELM = pytest.mark.e2e  # the pinned helm from the control-plane bin dir

ALL_FEATURES = (
    "--set", "metrics.serviceMonitor.enabled=true",
    "--set", "metrics.podMonitor.enabled=true",
    "--set", "metrics.prometheusRule.enabled=true",
    "--set", "rbac.watchNamespaces={team-a,team-b}",
)  # fmt: skip

OTHER_PORTS = {8000: "an inference server's /metrics in docs/progress.md, not the chart's"}


def _text(page: Path) -> str:
    return page.read_text() if page.is_file() else ""


def _names(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for d in docs:
        out.setdefault(d["metadata"]["name"], set()).add(d["kind"])
    return out


def _cited_names(text: str) -> set[str]:
    found = set(re.findall(r"--clusterrole=([\w.-]+)", text))
    found |= set(re.findall(r"kubectl create token ([\w.-]+)", text))
    found |= set(re.findall(r"--serviceaccount=[\w<>.-]+:([\w.-]+)", text))
    found |= set(re.findall(r"`(rl-energy(?:-[a-z0-9]+)*)`", text))
    return {n for n in found if "<" not in n}


TRAINER_OBJECTS = {"ClusterRole", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
"""The trainer-annotations role and the admission policy that limits it to the caller's pod."""


@NEEDS_HELM
def test_rbac_names_the_pages_cite_are_rendered() -> None:
    rendered = _names(render(*ALL_FEATURES))
    not_objects = {NAMESPACE}  # the namespace the docs install into
    cited: dict[str, set[str]] = {}
    for page in PAGES:
        for name in _cited_names(_text(page)):
            cited.setdefault(name, set()).add(page.name)
    unknown = {n: sorted(p) for n, p in cited.items() if n not in rendered and n not in not_objects}
    assert not unknown, f"names the chart does not render for release {RELEASE}: {unknown}"
    assert rendered["rl-energy-trainer-annotations"] == TRAINER_OBJECTS
    assert rendered["rl-energy-agent"] >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    assert {"rl-energy-trainer-annotations", "rl-energy-agent"} <= set(cited)


def test_no_page_writes_release_prefixed_names() -> None:
    for page in PAGES:
        assert "<release>-" not in _text(page), (
            f"{page.name}: the chart's name helper gives `rl-energy-...` for the release "
            "`rl-energy`, not `<release>-rl-energy-...`; cite the rendered name"
        )


def _chart_ports() -> dict[str, int]:
    docs = render()
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")
    )
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    ports = {
        p["name"]: p["containerPort"]
        for p in deploy["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    return {
        "agent": int(config["data"]["RLENERGY_OPERATOR_AGENT_METRICS_PORT"]),
        **{f"operator-{k}": v for k, v in ports.items()},
    }


@NEEDS_HELM
def test_ports_the_pages_cite_are_the_charts() -> None:
    ports = _chart_ports()
    assert ports["agent"] == VALUES["agent"]["metricsPort"]
    pattern = re.compile(r"\b[Pp]ort (\d{4,5})\b|:(\d{4,5})/|default (\d{4,5})\b")
    for page in PAGES:
        for m in pattern.finditer(_text(page)):
            port = int(next(g for g in m.groups() if g))
            assert port in ports.values() or port in OTHER_PORTS, (
                f"{page.name}: port {port} is none of the chart's ports {ports}"
            )
    agent_md = _text(ROOT / "docs" / "agent.md")
    section = agent_md[agent_md.index("## Metrics") :]
    cited = int(re.search(r"port (\d+)", section).group(1))  # type: ignore[union-attr]
    assert cited == ports["agent"]


def _exists(path: str) -> bool:
    node: Any = VALUES
    for part in path.split("."):
        if isinstance(node, dict) and not node:  # a free-form map: any key
            return True
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _value(path: str) -> Any:
    node: Any = VALUES
    for part in path.split("."):
        node = node[part]
    return node


def _yamlish(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_value_paths_and_defaults_the_pages_cite_exist() -> None:
    tops = "|".join(k for k, v in VALUES.items() if isinstance(v, dict))
    path_re = re.compile(rf"`((?:{tops})(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:=[^`]*)?`")
    default_re = re.compile(
        rf"`((?:{tops})(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`,?\s+\(?default:?\s+`?([^`\s,;)]+)"
    )
    checked = 0
    for page in PAGES:
        text = _text(page)
        for m in path_re.finditer(text):
            if m.group(1).rsplit(".", 1)[1] in ("py", "md", "yaml", "json", "txt", "sh"):
                continue  # a file name such as `metrics.py`
            assert _exists(m.group(1)), f"{page.name}: `{m.group(1)}` is no chart value"
        for m in default_re.finditer(text):
            assert _yamlish(_value(m.group(1))) == m.group(2), (page.name, m.group(0))
            checked += 1
    assert checked >= 4


def _all_commands() -> list[tuple[str, str]]:
    return [(page.name, c) for page in PAGES for c in commands(_text(page))]


def test_no_helm_install_creates_the_namespace_without_its_label() -> None:
    for where, cmd in _all_commands():
        assert not ("helm install" in cmd and "--create-namespace" in cmd), (where, cmd)


def test_install_runbook_labels_the_namespace_first_and_observes_before_enforcing() -> None:
    cmds = commands(_text(ROOT / "docs" / "install.md"))
    create = cmds.index(f"kubectl create namespace {NAMESPACE}")
    label = next(
        i for i, c in enumerate(cmds)
        if c.startswith(f"kubectl label namespace {NAMESPACE}")
        and "pod-security.kubernetes.io/enforce=privileged" in c
    )  # fmt: skip
    install = next(i for i, c in enumerate(cmds) if c.startswith(f"helm install {RELEASE} "))
    assert create < label < install
    assert f"-n {NAMESPACE}" in cmds[install]
    observe = next(i for i, c in enumerate(cmds) if "observe-only.yaml" in c)
    enforce = next(i for i, c in enumerate(cmds) if '"mode":"enforce"' in c)
    assert install < observe < enforce
    assert not any("sync-job.yaml" in c for c in cmds[:observe])
    name = yaml.safe_load((ROOT / "crds" / "samples" / "observe-only.yaml").read_text())
    assert f"kubectl patch rlep {name['metadata']['name']} " in cmds[enforce]


def _crds() -> dict[str, str]:
    """CRD name -> group, for every CRD the chart ships."""
    out = {}
    for f in CRD_DIR.glob("*.yaml"):
        for d in yaml.safe_load_all(f.read_text()):
            if d:
                out[d["metadata"]["name"]] = d["spec"]["group"]
    return out


def _check_crd_commands(where: str, cmds: list[str]) -> set[str]:
    crds = _crds()
    deleted: set[str] = set()
    for cmd in cmds:
        words = cmd.split()
        for i, w in enumerate(words):
            if w == "-f" and i + 1 < len(words):
                target = words[i + 1].rstrip("/")
                assert target != "helm/rl-energy/crds" and target != "./helm/rl-energy/crds", (
                    f"{where}: `{cmd}` reaches kopf's shared peering CRDs "
                    f"({sorted(n for n, g in crds.items() if g == 'kopf.dev')})"
                )
        if cmd.startswith("kubectl delete crd"):
            for name in words[3:]:
                if name.startswith("-"):
                    continue
                assert name in crds, f"{where}: {name} is no CRD of the chart"
                assert crds[name] == "rlenergy.io", f"{where}: `{cmd}` deletes {name}"
                deleted.add(name)
    return deleted


def test_uninstall_and_upgrade_touch_only_the_charts_own_crds() -> None:
    own = {n for n, g in _crds().items() if g == "rlenergy.io"}
    assert {n for n, g in _crds().items() if g == "kopf.dev"}, "kopf's CRDs moved: update me"
    for page in PAGES:
        _check_crd_commands(page.name, commands(_text(page)))
    install = commands(_text(ROOT / "docs" / "install.md"))
    assert _check_crd_commands("install.md", install) == own
    applied = [c for c in install if c.startswith("kubectl apply --server-side")]
    assert applied and all(f"{n.split('.')[0]}.yaml" in applied[0] for n in own)


@NEEDS_HELM
def test_notes_for_the_docs_release() -> None:
    notes = render_notes()
    rendered = _names(render())
    cmds = commands(notes)
    assert any(
        c.startswith(f"kubectl label namespace {NAMESPACE}")
        and "pod-security.kubernetes.io/enforce=privileged" in c
        for c in cmds
    ), notes
    observe = next(i for i, c in enumerate(cmds) if "observe-only.yaml" in c)
    enforce = next(i for i, c in enumerate(cmds) if '"mode":"enforce"' in c)
    assert observe < enforce and not any("sync-job.yaml" in c for c in cmds[:observe])
    assert f"labelled {VALUES['agent']['gpuNodeLabel']}." in notes
    assert f"port {VALUES['agent']['metricsPort']}." in notes
    roles = set(re.findall(r"--clusterrole=([\w.-]+)", notes))
    assert roles == {"rl-energy-trainer-annotations"}
    assert rendered["rl-energy-trainer-annotations"] == TRAINER_OBJECTS
    assert _check_crd_commands("NOTES.txt", cmds) == {
        n for n, g in _crds().items() if g == "rlenergy.io"
    }
    assert f"helm uninstall {RELEASE} -n {NAMESPACE}" in cmds
    assert "WARNING" not in notes


@NEEDS_HELM
def test_notes_follow_the_release_and_values_given() -> None:
    args = (
        "--set", "agent.gpuNodeLabel=example.com/accelerator",
        "--set", "agent.metricsPort=9500",
        "--set", "agent.tolerateGpuTaint=false",
    )  # fmt: skip
    notes = render_notes(*args, release="prod", namespace="ml-ops")
    rendered = _names(render(*args, release="prod", namespace="ml-ops"))
    assert "labelled example.com/accelerator (any value)." in notes
    assert "nvidia.com/gpu.present" not in notes
    assert "port 9500." in notes
    assert any(c.startswith("kubectl label namespace ml-ops") for c in commands(notes))
    roles = set(re.findall(r"--clusterrole=([\w.-]+)", notes))
    assert roles == {"prod-rl-energy-trainer-annotations"}
    assert rendered["prod-rl-energy-trainer-annotations"] == TRAINER_OBJECTS
    assert "helm uninstall prod -n ml-ops" in commands(notes)
    assert "WARNING: agent.tolerateGpuTaint=false" in notes


_REPO_DIRS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} - {
    "build", "out",
}  # fmt: skip
_FILE = re.compile(
    r"^(?:\./)?((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\."
    r"(?:py|md|yaml|yml|sh|txt|json|lua|tpl|c|toml|proto|tar))$"
)


def test_file_paths_the_pages_cite_exist() -> None:
    missing: dict[str, set[str]] = {}
    checked = 0
    for page in PAGES:
        text = _text(page)
        for m in re.finditer(r"`([^`\n]+)`", text):
            token = m.group(1).strip().split(" ")[0]
            token = re.split(r"::|:(?=[A-Za-z_0-9])", token)[0]
            f = _FILE.match(token)
            if not f or f.group(1).split("/")[0] not in _REPO_DIRS:
                continue
            checked += 1
            if not (ROOT / f.group(1)).exists():
                missing.setdefault(page.name, set()).add(f.group(1))
        if page.parent == ROOT:  # README, CONTRIBUTING: GitHub renders their relative links
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
                if "://" in target:
                    continue
                checked += 1
                if not (ROOT / target).exists():
                    missing.setdefault(page.name, set()).add(target)
    assert not missing, missing
    assert checked > 100
