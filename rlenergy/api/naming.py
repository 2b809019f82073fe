"""Names and text on the wire: camelCase field names, node report names, printable text.

Every model in ``rlenergy.api`` is populated by field name in Python (``clock_mhz=1410``) and
read or written by alias on the wire (``clockMHz``): its config sets ``populate_by_name`` and
``alias_generator=camel``. A field whose wire name is not ``camel(name)`` (``min_mhz`` is
``minClockMHz``) keeps an explicit ``alias``. ``report_name`` names a policy's report of one
node; ``printable`` strips control characters from text a node agent wrote.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from typing import Any

UNIT_WORDS = {"mhz": "MHz"}
"""Name parts that are not capitalised but spelled as the unit's symbol (``clockMHz``, as the
Kubernetes API conventions spell units: ``supportedClocksMHz``, not ``supportedClocksMhz``)."""


def camel(name: str) -> str:
    """``probe_clocks_mhz`` -> ``probeClocksMHz``; ``energy_joules`` -> ``energyJoules``."""
    first, *rest = name.split("_")
    return first + "".join(UNIT_WORDS.get(p, p[:1].upper() + p[1:]) for p in rest)


REPORT_NAME_MAX = 253
"""Longest object name (a DNS subdomain)."""
REPORT_HASH_CHARS = 10
"""Hex characters of the report name's hash suffix (40 bits: a collision needs about a million
policy-node pairs in one namespace)."""


def report_name(policy: str, node: str) -> str:
    """Object name of the ``RLEnergyNodeReport`` of ``policy`` on ``node``.

    ``<policy>-<node>-<hash>``, lower case, at most 253 characters: the hash (SHA-256 of the
    policy and node names with a separator no name contains) makes the name of policy ``a-b``
    on node ``c`` differ from that of policy ``a`` on node ``b-c``, and keeps names distinct
    where the readable part is cut to fit.
    """
    digest = hashlib.sha256(f"{policy}/{node}".encode()).hexdigest()[:REPORT_HASH_CHARS]
    readable = f"{policy}-{node}".lower()[: REPORT_NAME_MAX - REPORT_HASH_CHARS - 1]
    return f"{readable}-{digest}"


def legacy_report_name(policy: str, node: str) -> str:
    """The report name agents used before the hash suffix (``<policy>-<node>``): retired."""
    return f"{policy}-{node}".lower()[:REPORT_NAME_MAX]


POLICY_BUCKET_LABEL = "rlenergy.io/policy-bucket"
"""Label of every node report: its policy's bucket (``policy_bucket``), so an operator shard
watches only its own policies' reports (a label selector, filtered by the API server)."""

POLICY_BUCKETS = 64
"""Buckets a policy falls in; operator shard ``k`` of ``n`` serves buckets ``b % n == k``, so
at most 64 shards."""


def policy_bucket(namespace: str, policy: str) -> int:
    """The bucket of the policy ``namespace/policy``.

    CRC-32 of ``namespace/policy`` modulo ``POLICY_BUCKETS`` (the same in every process and
    Python version, unlike ``hash``).
    """
    return zlib.crc32(f"{namespace}/{policy}".encode()) % POLICY_BUCKETS


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""C0 and C1 control characters but tab and line breaks (ESC starts terminal escape sequences)
and the Unicode bidirectional overrides, which reorder what a terminal shows."""
_BREAK = re.compile("[\r\n]+")


def printable(text: str) -> str:
    """``text`` on one line, without control characters or bidirectional overrides.

    Line breaks become one space (a forged line in ``kubectl describe`` reads as the
    operator's own); tabs stay.

    Report text written by a node agent (an error, a failure message, a pod name) reaches
    conditions, Events and the kubectl plugin; a compromised agent must not be able to move
    a reader's cursor, recolour or hide lines, or set a terminal's title through it.
    """
    return _CONTROL.sub("", _BREAK.sub(" ", text))


def printable_tree(value: Any) -> Any:
    """``value`` (JSON-shaped: dicts, lists, strings, numbers) with every string ``printable``.

    Dictionary keys are cleaned too (per-GPU maps are keyed by UUIDs from the report).
    """
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_tree(v) for v in value]
    return value
