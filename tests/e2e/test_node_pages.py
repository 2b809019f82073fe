"""The operator's Node lists page through the real API server (``kube.NODE_PAGE`` nodes a
request, then the ``continue`` token), and a paged list holds every node exactly once.

A whole Node list decoded at once cost each operator process tens of MB at 1,000 nodes; the
coverage check and the scheduling check now read a page at a time. With the page set to 2 on
the session cluster's 3 KWOK nodes, each list takes two requests.
"""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest
from e2e_support import get_json
from rlenergy_dev.devcluster import DevCluster
from rlenergy_operator import kube, settings


@pytest.fixture
def pages(dev_cluster: DevCluster, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The operator's client on the session cluster, 2 nodes a page; returns the item count of
    each page the API server answers, in order."""
    client = kubernetes.config.new_client_from_config(str(dev_cluster.kubeconfig))
    monkeypatch.setattr(kube, "_api", lambda: client)
    monkeypatch.setattr(kube, "NODE_PAGE", 2)
    seen: list[int] = []
    real = kube._node_pages

    def counted(**kwargs: Any) -> Any:
        for page in real(**kwargs):
            seen.append(len(page))
            yield page

    monkeypatch.setattr(kube, "_node_pages", counted)
    return seen


def test_every_node_once_over_pages(dev_cluster: DevCluster, pages: list[int]) -> None:
    want = {n["metadata"]["name"]: n for n in get_json(dev_cluster, "nodes")["items"]}
    assert len(want) >= 3, sorted(want)
    got = kube.all_nodes()
    assert sorted(n["metadata"]["name"] for n in got) == sorted(want)
    assert len(pages) >= 2 and all(p <= 2 for p in pages), pages
    for n in got:  # the fields the coverage check reads, as the API server has them
        live = want[n["metadata"]["name"]]
        assert n["metadata"]["labels"] == live["metadata"].get("labels", {})
        assert n["spec"]["taints"] == live["spec"].get("taints", [])
        gpus = live["status"].get("allocatable", {}).get("nvidia.com/gpu")
        assert n["status"]["allocatable"] == ({} if gpus is None else {"nvidia.com/gpu": gpus})


def test_labelled_nodes_page_with_the_selector(dev_cluster: DevCluster, pages: list[int]) -> None:
    label = settings.OperatorConfig().agent_gpu_node_label
    want = sorted(
        n["metadata"]["name"] for n in get_json(dev_cluster, "nodes", "-l", label)["items"]
    )
    assert len(want) >= 3, want  # the session's KWOK GPU nodes carry the GPU label
    got = kube.labelled_nodes(label)
    assert sorted(n["metadata"]["name"] for n in got) == want
    assert len(pages) >= 2, pages
