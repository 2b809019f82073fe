"""Counter windows: wrap, reset and absurd jumps."""

from hypothesis import given
from hypothesis import strategies as st

from rlenergy.gpu import energy


def test_plain_delta() -> None:
    d = energy.counter_delta(1_000, 3_500, 1.0)
    assert d.energy_mj == 2_500 and not d.reset_detected


def test_wrap_of_the_64_bit_counter_is_unwrapped() -> None:
    d = energy.counter_delta(2**64 - 100, 400, 1.0)
    assert d.energy_mj == 500 and not d.reset_detected


def test_reset_counts_only_the_energy_after_it_and_says_so() -> None:
    d = energy.counter_delta(5_000_000, 20_000, 1.0)
    assert d.energy_mj == 20_000 and d.reset_detected


def test_absurd_jump_is_unknown_not_a_number() -> None:
    d = energy.counter_delta(0, 10**12, 1.0)
    assert d.energy_mj is None and d.rejected


@given(
    start=st.integers(min_value=0, max_value=2**64 - 1),
    delta=st.integers(min_value=0, max_value=2_000_000),
    duration=st.floats(min_value=1.0, max_value=100.0),
)
def test_deltas_are_never_negative_and_exact_when_plausible(
    start: int, delta: int, duration: float
) -> None:
    end = (start + delta) % 2**64
    d = energy.counter_delta(start, end, duration)
    assert d.energy_mj is None or d.energy_mj >= 0
    if end >= start or start > 2**63:
        assert d.energy_mj == delta
