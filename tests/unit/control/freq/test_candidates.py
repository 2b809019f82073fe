"""Candidate clocks and policy validation against the GPU's supported clocks."""

import pytest

from rlenergy import errors
from rlenergy.api.v1alpha1 import policy
from rlenergy.control.freq import candidates, config
from rlenergy.gpu import models

H100 = models.get_sku("h100-sxm").supported_sm_clocks_mhz()


def test_thinned_candidates_span_max_to_half_max() -> None:
    cands = candidates.thin_candidates(H100)
    assert 6 <= len(cands) <= 8
    assert list(cands) == sorted(cands, reverse=True)
    assert max(cands) < 1980 and min(cands) >= 990
    assert all(c in H100 for c in cands)


def test_unsupported_explicit_candidate_names_the_field_and_range() -> None:
    spec = policy.RLEnergyPolicySpec.model_validate(
        {"phases": [{"name": "generation", "clockCandidatesMHz": [1403]}]}
    )
    with pytest.raises(errors.InvalidInputError) as exc:
        config.phase_settings(spec, H100)
    assert exc.value.field == "spec.phases[0].clockCandidatesMHz"
    assert "345-1980 MHz in 15 MHz steps" in str(exc.value)


def test_range_and_step() -> None:
    spec = policy.RLEnergyPolicySpec.model_validate(
        {
            "phases": [
                {
                    "name": "generation",
                    "clockRangeMHz": {"minClockMHz": 1200, "maxClockMHz": 1800},
                    "stepMHz": 150,
                }
            ]
        }
    )
    (ph,) = config.phase_settings(spec, H100)
    assert ph.candidates_mhz == (1800, 1650, 1500, 1350, 1200)
    assert min(ph.allowed_mhz) == 1200 and max(ph.allowed_mhz) == 1800
