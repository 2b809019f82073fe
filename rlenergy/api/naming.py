"""Wire names of the API models: snake_case field names to camelCase with units kept.

Every model in ``rlenergy.api`` is populated by field name in Python (``clock_mhz=1410``) and
read or written by alias on the wire (``clockMHz``): its config sets ``populate_by_name`` and
``alias_generator=camel``. A field whose wire name is not ``camel(name)`` (``min_mhz`` is
``minClockMHz``) keeps an explicit ``alias``.
"""

from __future__ import annotations

UNIT_WORDS = {"mhz": "MHz"}
"""Name parts that are not capitalised but spelled as the unit's symbol (``clockMHz``, as the
Kubernetes API conventions spell units: ``supportedClocksMHz``, not ``supportedClocksMhz``)."""


def camel(name: str) -> str:
    """``probe_clocks_mhz`` -> ``probeClocksMHz``; ``energy_joules`` -> ``energyJoules``."""
    first, *rest = name.split("_")
    return first + "".join(UNIT_WORDS.get(p, p[:1].upper() + p[1:]) for p in rest)
