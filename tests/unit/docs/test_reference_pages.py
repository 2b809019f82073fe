"""The generated reference pages (hack/docgen.py): chart values and metrics.

We test these aspects:
* docs/reference/values.md and docs/reference/metrics.md regenerate with no diff, and
  ``--check`` reports a stale page;
* every value of values.yaml has a row with its default and the schema's type, and a value
  without a ``# --`` comment is refused with its path;
* the metric definitions read from the code are the ones the operator's registry really holds
  (name, type, help, labels); the agent's are checked against its real exposition in
  tests/unit/agent/test_metrics_reference.py;
* a label list given as a variable resolves to its literal, and a definition the generator
  cannot read is refused with its place.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from docs_support import ROOT, load_docgen

docgen = load_docgen()
VALUES_TEXT = (ROOT / "helm" / "rl-energy" / "values.yaml").read_text()
SCHEMA = json.loads((ROOT / "helm" / "rl-energy" / "values.schema.json").read_text())


def test_values_page_regenerates_without_diff() -> None:
    page = ROOT / "docs" / "reference" / "values.md"
    assert page.read_text() == docgen.render_values(), "run: python hack/docgen.py"


def test_metrics_page_regenerates_without_diff() -> None:
    page = ROOT / "docs" / "reference" / "metrics.md"
    assert page.read_text() == docgen.render_metrics(), "run: python hack/docgen.py"


def test_check_reports_a_stale_page(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stale = tmp_path / "values.md"
    stale.write_text(docgen.render_values().replace("Override", "Overwrite", 1))
    fresh = tmp_path / "metrics.md"
    fresh.write_text(docgen.render_metrics())
    monkeypatch.setattr(docgen, "VALUES_PAGE", stale)
    monkeypatch.setattr(docgen, "METRICS_PAGE", fresh)
    assert docgen.main(["--check"]) == 1
    assert docgen.main([]) == 0
    assert docgen.main(["--check"]) == 0


def _leaf_values(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict) and tree:
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(_leaf_values(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: tree}


def test_every_value_has_a_row_with_its_default_and_schema_type() -> None:
    rows, _ = docgen.value_rows(VALUES_TEXT, SCHEMA)
    by_path = {r.path: r for r in rows}
    tree = yaml.safe_load(VALUES_TEXT)
    for leaf, value in _leaf_values(tree).items():
        owner = next(p for p in by_path if leaf == p or leaf.startswith(p + "."))
        default = json.loads(by_path[owner].default)
        node = default
        for part in leaf[len(owner) :].strip(".").split(".") if leaf != owner else []:
            node = node[part]
        assert node == value, leaf
        assert by_path[owner].description, owner
    assert by_path["agent.metricsPort"].type == "integer"
    assert by_path["operator.image.pullPolicy"].type == "string: Always, IfNotPresent, Never"
    assert by_path["rbac.watchNamespaces"].type == "array of string"


def test_a_value_without_a_description_is_refused_with_its_path() -> None:
    text = VALUES_TEXT.replace("  # -- Port of the agent's /metrics, /healthz and /readyz.\n", "")
    assert text != VALUES_TEXT
    with pytest.raises(docgen.DocgenError, match=r"agent\.metricsPort"):
        docgen.value_rows(text, SCHEMA)


def test_a_documented_map_covers_its_keys_and_a_plain_comment_is_a_section() -> None:
    text = (
        "# -- Resources.\nresources:\n  requests: {cpu: 1}\n"
        "# The group.\ngroup:\n  # -- A.\n  a: 1\n"
    )
    rows, sections = docgen.value_rows(text, {})
    assert [(r.path, r.type, r.default) for r in rows] == [
        ("resources", "object", '{"requests":{"cpu":1}}'),
        ("group.a", "integer", "1"),
    ]
    assert sections == {"group": ["The group."]}


def test_operator_metrics_match_its_registry() -> None:
    from rlenergy_operator import metrics

    rows = {
        r.name: r
        for r in docgen.metric_rows(
            (ROOT / "operator/rlenergy_operator/metrics.py").read_text(), "operator"
        )
    }
    real = {}
    for collector in list(metrics.REGISTRY._collector_to_names):  # noqa: SLF001 - the truth
        for family in collector.describe():
            real[family.name] = (family.type, family.documentation, tuple(collector._labelnames))  # noqa: SLF001
    assert real, "the operator registry holds no metric"
    assert {n: (r.type, r.help, r.labels) for n, r in rows.items()} == real


def test_label_variables_resolve_and_unreadable_definitions_are_refused() -> None:
    src = (
        "LABELS = ['a']\n"
        "def f():\n"
        "    labels = ['gpu_uuid', 'node']\n"
        "    x = GaugeMetricFamily('m_one', 'One.', labels=labels)\n"
        "    y = CounterMetricFamily('m_two', 'Two, count.', labels=LABELS)\n"
        "    z = HistogramMetricFamily('m_three', 'Three, s.', labels=['node'])\n"
    )
    rows = docgen.metric_rows(src, "m.py")
    assert [(r.name, r.type, r.labels, r.samples) for r in rows] == [
        ("m_one", "gauge", ("gpu_uuid", "node"), ("m_one",)),
        ("m_two", "counter", ("a",), ("m_two_total",)),
        ("m_three", "histogram", ("node",), ("m_three_bucket", "m_three_sum", "m_three_count")),
    ]
    with pytest.raises(docgen.DocgenError, match=r"m\.py:1: labels"):
        docgen.metric_rows("Gauge('m', 'M.', labels=make_labels())\n", "m.py")
    with pytest.raises(docgen.DocgenError, match=r"m\.py:1: the metric name"):
        docgen.metric_rows("Gauge(NAME, 'M.')\n", "m.py")
