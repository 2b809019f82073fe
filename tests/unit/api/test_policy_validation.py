"""RLEnergyPolicy spec validation in Python (the operator, ``rlenergy simulate``).

We test these aspects:
* every sample in crds/samples parses, with the selector required;
* every invalid spec of invalid_specs.yaml (the e2e admission test sends the same ones to the
  API server) is refused with an error naming the field;
* specs without a selector still parse for the simulator;
* the label selector renders as a Kubernetes query.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from api_invalid_specs import invalid_cases

from rlenergy import errors
from rlenergy.api.v1alpha1 import policy

SAMPLES = sorted((Path(__file__).resolve().parents[3] / "crds" / "samples").glob("*.yaml"))
CASES = invalid_cases()


def test_there_are_four_samples_and_at_least_15_invalid_kinds():
    assert {p.stem for p in SAMPLES} >= {"sync-job", "async-job", "moe-job", "observe-only"}
    assert len(CASES) >= 15


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_samples_parse(path: Path):
    spec = policy.parse_policy(yaml.safe_load(path.read_text()), require_selector=True)
    assert spec.selector is not None and spec.selector.to_query()
    assert {p.name for p in spec.phases} >= {"generation", "training"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["id"])
def test_invalid_spec_is_refused_naming_the_field(case: dict):
    with pytest.raises(errors.InvalidInputError) as info:
        policy.parse_policy({"spec": case["doc"]}, require_selector=True)
    message = str(info.value)
    assert message.startswith("spec")
    wanted = case["field"].split(".")[-1].split("[")[0]
    assert wanted in message, message


def test_spec_without_selector_parses_for_the_simulator():
    spec = policy.parse_policy({"controller": {"mode": "observe"}})
    assert spec.selector is None and spec.controller.mode == "observe"
    assert [p.name for p in spec.phases] == ["generation", "training"]


def test_selector_query():
    sel = policy.LabelSelector.model_validate(
        {
            "matchLabels": {"b": "2", "a": "1"},
            "matchExpressions": [
                {"key": "x", "operator": "In", "values": ["p", "q"]},
                {"key": "y", "operator": "DoesNotExist"},
                {"key": "z", "operator": "Exists"},
                {"key": "w", "operator": "NotIn", "values": ["r"]},
            ],
        }
    )
    assert sel.to_query() == "a=1,b=2,x in (p,q),!y,z,w notin (r)"


def test_step_dividing_the_range_is_accepted():
    ph = policy.PhaseSpec.model_validate(
        {
            "name": "training",
            "clockRangeMHz": {"minClockMHz": 1200, "maxClockMHz": 1980},
            "stepMHz": 60,
        }
    )
    assert ph.step_mhz == 60
