"""The pod map's types: which pod holds which devices, as the kubelet allocated them.

``PodRef`` names a pod, ``PodMap`` is what the agent asks (``rlenergy_agent.podmap`` reads the
kubelet's PodResources API; ``StaticPodMap`` serves local runs and tests). No agent module
below imports this one's users: the core (``service``), the pod-resources client, the caller
checks and the pod-end watch all import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class PodRef:
    """A pod, as the kubelet knows it."""

    namespace: str
    name: str
    uid: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def same_pod(a: PodRef, b: PodRef) -> bool:
    """Same namespace and name, and the same UID where both know it."""
    return (a.namespace, a.name) == (b.namespace, b.name) and (
        not a.uid or not b.uid or a.uid == b.uid
    )


ListingStatus = Literal["Waiting", "Fresh", "Stale", "Expired"]


@dataclasses.dataclass(frozen=True)
class ListingState:
    """What a listed pod map may be used for now.

    Attributes:
        status: ``Waiting`` (never listed: the kubelet socket is missing or does not answer),
            ``Fresh`` (attributes GPUs), ``Stale`` (holds the locks made, attributes nothing
            new), ``Expired`` (locks it can no longer attribute are reset).
        age_s: time since the last successful listing, s (``None``: never listed).
        error: the newest failure's code (``RESOURCE_EXHAUSTED``, ``UNAVAILABLE``,
            ``DEADLINE_EXCEEDED``, ``SocketMissing``...); ``""`` when the last call worked.
        message: the failure's text.
    """

    status: ListingStatus
    age_s: float | None
    error: str = ""
    message: str = ""


class PodMap(Protocol):
    """Which device IDs (GPU or MIG UUIDs) the kubelet allocated to which pod."""

    def devices_of(self, pod: PodRef) -> tuple[str, ...]:
        """Device IDs allocated to ``pod`` (empty: none or unknown pod)."""
        ...

    def pods(self) -> Mapping[PodRef, tuple[str, ...]]:
        """Every pod with allocated GPUs."""
        ...


@runtime_checkable
class ListedPodMap(Protocol):
    """A pod map read from a listing that goes stale (the kubelet's PodResources).

    The node loop lists again every pass (``keep_fresh``), so a signal's thread reads the cache
    and makes no call to the kubelet or the API server; a caller the cache does not know (a pod
    that started since the last pass) has the listing made again at once (``recheck``).
    """

    def keep_fresh(self) -> None:
        """List now (the node loop, every pass)."""
        ...

    def recheck(self) -> None:
        """List now unless the listing is younger than a short bound (a caller not listed)."""
        ...

    def state(self) -> ListingState:
        """The listing's age and the newest failure."""
        ...


class StaticPodMap:
    """A fixed pod map (the ``sim`` backend and tests)."""

    def __init__(self, allocations: Mapping[PodRef, Sequence[str]]) -> None:
        self.allocations = {p: tuple(d) for p, d in allocations.items()}

    def devices_of(self, pod: PodRef) -> tuple[str, ...]:
        """Device IDs of ``pod`` (``same_pod``: a UID only one side knows still matches)."""
        hit = self.allocations.get(pod)
        if hit is not None:
            return hit
        return next((d for p, d in self.allocations.items() if same_pod(p, pod)), ())

    def pods(self) -> Mapping[PodRef, tuple[str, ...]]:
        """All allocations."""
        return dict(self.allocations)
