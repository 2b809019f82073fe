"""The error vocabulary survives pickling, as it must to cross a process pool."""

from __future__ import annotations

import pickle

import pytest

from rlenergy import errors


@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidInputError("--traces", "unknown trace 'x'; shipped: a, b"),
        errors.RetryableError("API server busy", delay_s=2.5),
        errors.InFlightError("resize sent, outcome unknown", delay_s=4.0),
        errors.PermanentError("policy names no phase"),
    ],
)
def test_errors_pickle_with_their_fields(error: errors.RLEnergyError) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert vars(back) == vars(error)
