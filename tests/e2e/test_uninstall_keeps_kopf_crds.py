"""install.md's install and uninstall steps, as written, leave kopf's shared CRDs in place.

Another kopf operator runs on the cluster before ours: it installed kopf's peering CRDs
(``clusterkopfpeerings.kopf.dev``, ``kopfpeerings.kopf.dev``, the same file the chart ships)
and keeps its peering objects in them. On a control plane of its own (the CRDs are
cluster-wide, so not the session's; no node: nothing here needs a pod to run), the commands of
install.md's steps 1 and 2 and of its uninstall section are run by ``bash -c`` from the
checkout, as the page writes them (``runbook_support``), with the pinned ``kubectl`` and
``helm``. We test these aspects:

* every command exits 0;
* after the uninstall, the chart's own CRDs are gone, kopf's two CRDs are still there and so are
  the other operator's ``ClusterKopfPeering`` and ``KopfPeering`` objects (deleting the CRDs
  would have deleted them).

``tests/e2e/test_runbook.py`` runs the whole runbook, smoke test included, on the real node;
this test needs only the control-plane binaries, so it runs with the other e2e tests.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import get_json
from rlenergy_dev.devcluster import DevCluster
from runbook_support import runbook

ROOT = Path(__file__).resolve().parents[2]
KOPF_CRDS = ROOT / "helm" / "rl-energy" / "crds" / "kopf.dev_peerings.yaml"
OTHER_NS = "other-operator"
OWN_CRDS = {"rlenergypolicies.rlenergy.io", "rlenergynodereports.rlenergy.io"}
KOPF_CRD_NAMES = {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[DevCluster]:
    c = DevCluster(startup_timeout=180)
    c.start(nodes=0)
    with c:
        yield c


def _run(cmd: str, env: dict[str, str]) -> None:
    res = subprocess.run(
        ["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, f"`{cmd}` exited {res.returncode}:\n{res.stdout}\n{res.stderr}"


def test_documented_uninstall_keeps_kopfs_crds_and_their_objects(
    cluster: DevCluster, tmp_path: Path
) -> None:
    # The other kopf operator: its CRDs and its peering objects.
    cluster.kubectl("apply", "--server-side", "-f", str(KOPF_CRDS))
    cluster.wait_crds_established(*sorted(KOPF_CRD_NAMES))
    cluster.kubectl("create", "namespace", OTHER_NS)
    peerings = [
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
         "metadata": {"name": "other-operator"}},
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
         "metadata": {"name": "other-operator", "namespace": OTHER_NS}},
    ]  # fmt: skip
    for obj in peerings:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").symlink_to(cluster.binaries.kubectl)
    (bin_dir / "helm").symlink_to(cluster.binaries.helm)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', os.defpath)}"
    env["KUBECONFIG"] = str(cluster.kubeconfig)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(tmp_path / "helm" / var.lower())
    steps = {s.name: s for s in runbook((ROOT / "docs" / "install.md").read_text())}
    for name in ("1", "2", "uninstall"):
        for cmd in steps[name].commands:
            _run(cmd, env)

    crds = {d["metadata"]["name"] for d in get_json(cluster, "crd")["items"]}
    assert KOPF_CRD_NAMES <= crds, crds
    assert not OWN_CRDS & crds, crds
    get_json(cluster, "clusterkopfpeerings.kopf.dev", "other-operator")
    get_json(cluster, "kopfpeerings.kopf.dev", "other-operator", "-n", OTHER_NS)
