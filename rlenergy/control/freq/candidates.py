"""Candidate SM clocks for EE-RL trials (step 1 of the ``rlenergy.control.freq.eerl`` docstring)."""

from __future__ import annotations

from collections.abc import Sequence

from rlenergy import errors

DEFAULT_CANDIDATES = 7
"""About 6-8 points between max and about half of max [MODEL]."""
LOWEST_FRACTION = 0.5
"""Lowest candidate as a fraction of the max clock [MODEL]."""


def thin_candidates(
    supported_mhz: Sequence[int],
    *,
    count: int = DEFAULT_CANDIDATES,
    lowest_fraction: float = LOWEST_FRACTION,
) -> tuple[int, ...]:
    """Pick ``count`` clocks, evenly spread, from max down to ``lowest_fraction`` x max.

    Args:
        supported_mhz: supported SM clocks (any order), MHz.
        count: number of candidates (the max clock is the reference, not a candidate).
        lowest_fraction: lowest candidate relative to the max clock.

    Returns:
        Candidates in descending order, each a supported clock, max excluded.

    Raises:
        InvalidInputError: empty clock list or count < 1.
    """
    if not supported_mhz:
        raise errors.InvalidInputError("supportedClocksMHz", "the GPU reports no supported clocks")
    if count < 1:
        raise errors.InvalidInputError("candidates", "need at least one candidate")
    clocks = sorted(set(supported_mhz), reverse=True)
    top = clocks[0]
    floor = top * lowest_fraction
    usable = [c for c in clocks[1:] if c >= floor] or clocks[1:2]
    if len(usable) <= count:
        return tuple(usable)
    picked: list[int] = []
    for i in range(count):
        target = top - (top - floor) * (i + 1) / count
        best = min(usable, key=lambda c: abs(c - target))
        if best not in picked:
            picked.append(best)
    return tuple(sorted(picked, reverse=True))


def from_range(
    supported_mhz: Sequence[int], min_mhz: int, max_mhz: int, step_mhz: int | None = None
) -> tuple[int, ...]:
    """Candidates inside ``[min_mhz, max_mhz]``, descending.

    Every ``step_mhz`` from the range's top clock, or without a step thinned as
    ``thin_candidates`` from the max clock down to the range's lowest clock.

    Raises:
        InvalidInputError: an empty intersection with the supported clocks.
    """
    inside = sorted((c for c in set(supported_mhz) if min_mhz <= c <= max_mhz), reverse=True)
    if not inside:
        raise errors.InvalidInputError(
            "clockRangeMHz",
            f"no supported clock in {min_mhz}-{max_mhz} MHz; supported: "
            f"{min(supported_mhz)}-{max(supported_mhz)} MHz",
        )
    if step_mhz is None:
        # Spread from the max clock down to the range's lowest clock (a floor of 0 spread the
        # targets down to 0 MHz, so those below the range all snapped to its lowest clock: a
        # 1000-2000 MHz range on a 100 MHz grid got 4 candidates instead of 7).
        top = max(supported_mhz)
        return thin_candidates([top, *inside], lowest_fraction=inside[-1] / top)
    picked = [c for c in inside if (inside[0] - c) % step_mhz == 0]
    return tuple(picked)


def validate_explicit(
    supported_mhz: Sequence[int], candidates_mhz: Sequence[int]
) -> tuple[int, ...]:
    """Check explicit candidates against the GPU's supported clocks.

    Raises:
        InvalidInputError: a candidate the GPU does not support; names the range and step.
    """
    supported = set(supported_mhz)
    bad = [c for c in candidates_mhz if c not in supported]
    if bad:
        lo, hi = min(supported), max(supported)
        ordered = sorted(supported)
        step = ordered[1] - ordered[0] if len(ordered) > 1 else 0
        raise errors.InvalidInputError(
            "clockCandidatesMHz",
            f"{bad} not supported by the GPU; allowed: {lo}-{hi} MHz in {step} MHz steps",
        )
    return tuple(sorted(set(candidates_mhz), reverse=True))
