"""The trainer ranks' per-step record check (podtrainer.step_record_mismatches).

We test these aspects:
* a record that counts what its replay step holds has no mismatch;
* each wrong figure (a kept dropped group, valid tokens, the aborted sample, generated tokens,
  energy per valid token, verl's own loss key, DAPO's eviction) is named.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from rlenergy_dev import podtrainer

SPEC: dict[str, Any] = {
    "batch": {"dropped_uid": "g3", "valid_tokens": 1000, "trained_samples": 31},
    "phases": {"generation": {"tokens": 5000.0}},
}
KEPT = [f"g{i}" for i in range(podtrainer.GROUPS) if i != 3]


def _record() -> dict[str, Any]:
    return {
        "kept_uids": KEPT[: podtrainer.GROUPS - 1],
        "metrics": {
            "training/filter_groups/evicted_samples": 4,
            "rlenergy/valid_tokens": 1000,
            "rlenergy/trained_samples": 31,
            "rlenergy/aborted_samples": 1,
            "actor/pg_loss": 0.1,
            "rlenergy/generated_tokens": 5000.0,
            "rlenergy/energy/generation_j": 30.0,
            "rlenergy/energy/training_j": 20.0,
            "rlenergy/energy_per_valid_token_j": 0.05,
        },
    }


def test_a_right_record_has_no_mismatch():
    assert podtrainer.step_record_mismatches(_record(), SPEC) == []


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("rlenergy/valid_tokens", 1001, "rlenergy/valid_tokens"),
        ("rlenergy/trained_samples", 32, "rlenergy/trained_samples"),
        ("rlenergy/aborted_samples", 0, "rlenergy/aborted_samples"),
        ("rlenergy/generated_tokens", 5001.0, "rlenergy/generated_tokens"),
        ("rlenergy/energy_per_valid_token_j", 0.06, "energy_per_valid_token_j"),
        ("rlenergy/energy/training_j", 0.0, "phase energies"),
        ("training/filter_groups/evicted_samples", 0, "evicted no sample"),
        ("actor/pg_loss", None, "actor/pg_loss"),
    ],
)
def test_each_wrong_figure_is_named(key: str, value: Any, named: str):
    record = copy.deepcopy(_record())
    if value is None:
        del record["metrics"][key]
    else:
        record["metrics"][key] = value
    wrong = podtrainer.step_record_mismatches(record, SPEC)
    assert any(named in line for line in wrong), wrong


def test_the_dropped_group_kept_is_named_and_legacy_needs_no_eviction():
    record = copy.deepcopy(_record())
    record["kept_uids"] = ["g3", *KEPT[: podtrainer.GROUPS - 2]]
    assert "dropped g3" in podtrainer.step_record_mismatches(record, SPEC)[0]
    legacy = copy.deepcopy(_record())
    del legacy["metrics"]["training/filter_groups/evicted_samples"]
    assert podtrainer.step_record_mismatches(legacy, SPEC, dapo_evicts=False) == []
