"""A policy spec read into EE-RL settings (``rlenergy.control.freq.config``), as the operator and
the simulator CLI both read it."""

from __future__ import annotations

from typing import Any

import pytest

from rlenergy import errors
from rlenergy.api.v1alpha1 import policy as api_policy
from rlenergy.control.freq import config

SUPPORTED = [1980, 1200, 1500, 1800, 1350, 1650]  # any order, 150 MHz apart


def _spec(**kw: Any) -> api_policy.RLEnergyPolicySpec:
    body: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "rl"}},
        "phases": [
            {
                "name": "generation",
                "minThroughputRatio": 0.95,
                "clockCandidatesMHz": [1200, 1500, 1980],
            },
            {
                "name": "training",
                "minThroughputRatio": 0.97,
                "clockRangeMHz": {"minClockMHz": 1350, "maxClockMHz": 1800},
                "stepMHz": 150,
            },
        ],
    }
    body.update(kw)
    return api_policy.RLEnergyPolicySpec.model_validate(body)


def test_controller_settings_follow_the_spec() -> None:
    spec = _spec(
        mode="async",
        phaseSource="annotation",
        controller={
            "mode": "observe",
            "warmupSteps": 3,
            "trialSteps": 5,
            "driftThreshold": 0.2,
            "maxTrialFraction": 0.1,
        },
    )
    s = config.controller_settings(spec)
    assert (s.enforce, s.warmup_steps, s.trial_steps) == (False, 3, 5)
    assert (s.drift_threshold, s.max_trial_fraction) == (0.2, 0.1)
    assert (s.async_mode, s.in_phase_probes) == (True, False)
    d = config.controller_settings(_spec(controller={"mode": "enforce"}))
    assert (d.enforce, d.async_mode, d.in_phase_probes) == (True, False, True)


def test_phase_settings_check_candidates_against_the_gpu() -> None:
    gen, train = config.phase_settings(_spec(), SUPPORTED)
    supported = (1980, 1800, 1650, 1500, 1350, 1200)
    assert (gen.name, gen.min_throughput_ratio) == ("generation", 0.95)
    assert (gen.supported_mhz, gen.max_clock_mhz) == (supported, 1980)
    # Explicit candidates: the max clock is the default governor's own, so it is dropped.
    assert gen.candidates_mhz == (1500, 1200) and gen.allowed_mhz == (1500, 1200)
    # A range: its candidates on the step grid, every supported clock inside it allowed.
    assert (train.name, train.min_throughput_ratio) == ("training", 0.97)
    assert set(train.candidates_mhz) <= {1800, 1650, 1500, 1350}
    assert train.allowed_mhz == (1800, 1650, 1500, 1350)
    controller = config.build_controller(_spec(), SUPPORTED)
    assert set(controller.phases) == {"generation", "training"}
    assert controller.phases["generation"].settings == gen


def test_only_the_max_clock_as_a_candidate_is_kept() -> None:
    spec = _spec(
        phases=[{"name": "generation", "minThroughputRatio": 0.9, "clockCandidatesMHz": [1980]}]
    )
    (gen,) = config.phase_settings(spec, SUPPORTED)
    assert gen.candidates_mhz == (1980,)


def test_without_candidates_every_clock_from_the_lowest_candidate_up_is_allowed() -> None:
    spec = _spec(phases=[{"name": "generation", "minThroughputRatio": 0.9}])
    (gen,) = config.phase_settings(spec, SUPPORTED)
    assert gen.candidates_mhz and max(gen.candidates_mhz) < 1980
    assert gen.allowed_mhz == tuple(c for c in gen.supported_mhz if c >= min(gen.candidates_mhz))


def test_an_unsupported_candidate_names_the_phase_field() -> None:
    spec = _spec(
        phases=[
            {"name": "generation", "minThroughputRatio": 0.95},
            {"name": "training", "minThroughputRatio": 0.97, "clockCandidatesMHz": [1400]},
        ]
    )
    with pytest.raises(errors.InvalidInputError) as info:
        config.phase_settings(spec, SUPPORTED)
    assert info.value.field == "spec.phases[1].clockCandidatesMHz"
    assert (
        info.value.reason
        == "[1400] not supported by the GPU; allowed: 1200-1980 MHz in 150 MHz steps"
    )
