"""Operator unit tests reach no API server: no kopf peering objects (so no other shard layout)."""

from __future__ import annotations

import pytest
from rlenergy_operator import kube


@pytest.fixture(autouse=True)
def _no_peering_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube, "peering_objects", lambda namespaces=(): [])
