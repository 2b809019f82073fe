"""The metrics reference (docs/reference/metrics.md, hack/docgen.py) against the agent's real
exposition: every family a busy agent exports (phases metered, a GPU parked, discovery on) is in
the reference with the same type, help and labels, and the reference names no family the agent
does not export.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from agent_support import DriverFactory
from prometheus_client.parser import text_string_to_metric_families
from test_metrics_exposition import _busy_agent

ROOT = Path(__file__).resolve().parents[3]


def _docgen():  # type: ignore[no-untyped-def]
    name = "rlenergy_hack_docgen"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "hack" / "docgen.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_reference_matches_the_agents_exposition(make_driver: DriverFactory) -> None:
    docgen = _docgen()
    src = ROOT / "agent" / "rlenergy_agent" / "metrics.py"
    documented = {
        r.name.removesuffix("_total"): r for r in docgen.metric_rows(src.read_text(), "a")
    }
    _, text = _busy_agent(make_driver)
    exported = {f.name: f for f in text_string_to_metric_families(text.decode())}
    # Families only an agent on a real node exports: the kubelet listing's (a ListedPodMap,
    # tests/unit/agent/test_podresources.py) and NVML's re-initialisations (an NvmlSession,
    # tests/unit/agent/test_gpu_lifecycle.py); the busy agent here has neither.
    real_node_only = {
        "rlenergy_agent_podresources_listing_state",
        "rlenergy_agent_podresources_listing_age_seconds",
        "rlenergy_agent_podresources_errors",
        "rlenergy_agent_nvml_reinits",
    }
    assert set(exported) == set(documented) - real_node_only
    for name, family in exported.items():
        row = documented[name]
        assert (family.type, family.documentation) == (row.type, row.help), name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(row.labels), (name, sample)
            assert sample.name in row.samples, (name, sample.name)
