"""Operator shards: which policies one operator serves, and when a new shard layout may start.

One operator process folds every node report of every policy it serves; its CPU and memory grow
with the nodes (docs/scale-and-chaos.md: about 10 ms of CPU per node report write and 0.3 MB of
peak RSS per node at 1,000 nodes). A cluster past what one process holds runs ``count`` shards:
shard ``index`` serves the policies whose ``shard_of`` is ``index``, every other shard leaves
them alone. Each shard has its own kopf peering object (``Layout.named``), so the replicas of
one shard stand by for each other exactly as the replicas of an unsharded operator do.

The assignment is a function of the policy's namespace and name and of ``count`` only (its
bucket, ``naming.policy_bucket``: CRC-32, the same in every process and Python version, unlike
``hash``): any replica of any shard agrees on it without talking to the others. Every node
report carries its policy's bucket as a label, so a shard's report watch asks the API server
for its own buckets only (``Layout.report_selector``). A new ``count`` moves most policies to
another shard. While the pods of the old layout still run (a rolling upgrade), a policy would
have two owners; ``Handover`` makes the newer layout wait until no peer of another layout is
alive in its peering objects (kopf removes a peer that exits and lets a crashed one expire after
its lifetime, 60 s by default), and the older layout, which was serving already, carries on.

Nothing here does I/O: the handlers hand in the peering objects they read.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlenergy.api import naming


def shard_of(namespace: str, name: str, count: int) -> int:
    """The shard in ``[0, count)`` that serves the policy ``namespace/name``.

    Its bucket (``naming.policy_bucket``, which every node report of the policy carries as a
    label) modulo ``count``.

    Raises:
        ValueError: ``count`` is below 1 or above ``naming.POLICY_BUCKETS``.
    """
    if not 1 <= count <= naming.POLICY_BUCKETS:
        raise ValueError(f"shard count must be 1..{naming.POLICY_BUCKETS}, got {count}")
    return naming.policy_bucket(namespace, name) % count


@dataclasses.dataclass(frozen=True)
class Layout:
    """This process's shard: ``index`` of ``count`` (``count`` 1: one operator serves all).

    Raises:
        ValueError: ``count`` below 1 or ``index`` outside ``[0, count)``.
    """

    count: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.count <= naming.POLICY_BUCKETS or not 0 <= self.index < self.count:
            raise ValueError(
                f"shard index {self.index} is outside 0..{self.count - 1} for {self.count} "
                "shards: set the index below the count (RLENERGY_OPERATOR_SHARD_INDEX)"
            )

    def owns(self, namespace: str, name: str) -> bool:
        """Whether this shard serves the policy ``namespace/name``."""
        return self.count == 1 or shard_of(namespace, name, self.count) == self.index

    def report_selector(self) -> str | None:
        """The label selector of this shard's node reports; None unsharded (every report).

        ``naming.POLICY_BUCKET_LABEL in (...)``: the API server sends this shard's watch only
        its policies' reports, so its memory and the CPU of its watch grow with its share of
        the nodes, not with all of them. A report without the label (written by an agent older
        than the label) is no shard's until its agent writes it again.
        """
        if self.count == 1:
            return None
        buckets = [str(b) for b in range(naming.POLICY_BUCKETS) if b % self.count == self.index]
        return f"{naming.POLICY_BUCKET_LABEL} in ({','.join(buckets)})"

    def named(self, base: str) -> str:
        """This shard's name of ``base``: ``base`` unsharded, else ``<base>-<count>-<index>``.

        The count tells layouts apart (``layout_of`` and ``_family`` read it back).
        """
        return base if self.count == 1 else f"{base}-{self.count}-{self.index}"

    def layout_of(self, base: str, peering: str) -> int | None:
        """The shard count a peering object named ``peering`` belongs to, None if not ours."""
        if peering == base:
            return 1
        if not _family(base, peering):
            return None
        count, index = (int(x) for x in peering[len(base) + 1 :].split("-"))
        return count if index < count else None


def when_owned(layout: Layout) -> Callable[..., bool]:
    """The kopf ``when`` filter of the policy timers: ``layout``'s policies.

    kopf then neither runs nor keeps a finalizer for the other shards' policies. The timers
    themselves do nothing until this process serves (``serving``): a timer kopf did not start
    when it listed a policy starts only with the policy's next watch event, which may not come.
    """

    def owned(namespace: str | None = None, name: str = "", **_: Any) -> bool:
        return layout.owns(str(namespace), name)

    return owned


def serving(memo: Any) -> bool:
    """Whether this process serves its shard (``memo["handover"]``, set at start-up)."""
    handover = (memo or {}).get("handover")
    return bool(handover and handover.established)


def when_served(layout: Layout) -> Callable[..., bool]:
    """The kopf ``when`` filter of the policy change handlers (create, update, resume, delete).

    ``layout``'s policies once this process serves (``Handover.established``). While it waits
    for another layout's pods, kopf records no progress of these handlers, which that layout's
    kopf keeps in the same ``status.kopf``. A change it missed is reconciled by the job loop's
    catch-up (``handlers.policy_loop``: a generation unrecorded for
    ``reconcile_catchup_s``).
    """

    def served(namespace: str | None = None, name: str = "", memo: Any = None, **_: Any) -> bool:
        return serving(memo) and layout.owns(str(namespace), name)

    return served


def when_first(layout: Layout) -> Callable[..., bool]:
    """A kopf ``when`` filter for cluster-wide work one shard does for all: shard 0, serving."""

    def first(memo: Any = None, **_: Any) -> bool:
        return serving(memo) and layout.index == 0

    return first


def finalizer_of(base: str, layout: Layout) -> str:
    """The finalizer this shard puts on its policies: ``base``, or ``<base>-<count>-<index>``.

    Each shard needs its own: kopf removes its finalizer from any object it watches on which no
    handler of its own requires one (``kopf/_core/reactor/processing.py``), so a shard sharing
    the name would strip it from every other shard's policies.
    """
    return layout.named(base)


def adoption_patch(finalizers: Iterable[str], base: str, own: str) -> list[dict[str, Any]]:
    """JSON Patch ops that hand a policy's finalizer from a gone layout to this shard.

    Every finalizer of ``base``'s family (``base`` or ``base-<count>-<index>``) other than
    ``own`` belongs to a layout whose pods have exited (the caller is established): the first
    is replaced by ``own`` (or removed when ``own`` is there already), the rest removed, each op
    guarded by a ``test`` of its index so a concurrent change makes the patch fail instead of
    removing someone else's finalizer. So the policy is never without a reset-clocks finalizer.

    Returns:
        The ops, empty when there is nothing to hand over.
    """
    names = list(finalizers)
    family = [i for i, f in enumerate(names) if f != own and (f == base or _family(base, f))]
    ops: list[dict[str, Any]] = []
    have_own = own in names
    for i in reversed(family):  # from the end: earlier indexes stay valid
        ops.append({"op": "test", "path": f"/metadata/finalizers/{i}", "value": names[i]})
        if i == family[0] and not have_own:
            ops.append({"op": "replace", "path": f"/metadata/finalizers/{i}", "value": own})
        else:
            ops.append({"op": "remove", "path": f"/metadata/finalizers/{i}"})
    return ops


def _family(base: str, name: str) -> bool:
    head, _, rest = name.partition(f"{base}-")
    count, _, index = rest.partition("-")
    return not head and count.isdigit() and index.isdigit()


def live_peers(status: Mapping[str, Any] | None, now: datetime.datetime) -> list[str]:
    """The peers a kopf peering object's status holds alive at ``now`` (UTC, aware).

    kopf keeps one entry per peer, ``{"priority", "lifetime" (s), "lastseen" (ISO 8601)}``, and
    removes it when the peer exits (``kopf/_core/engines/peering.py``); an entry whose
    ``lastseen + lifetime`` has passed belongs to a peer that died without cleaning up.
    """
    alive = []
    for peer, entry in (status or {}).items():
        if not isinstance(entry, Mapping) or "lastseen" not in entry:
            continue  # kopf's own bookkeeping, not a peer
        try:
            seen = datetime.datetime.fromisoformat(str(entry["lastseen"]).replace("Z", "+00:00"))
            lifetime_s = float(entry.get("lifetime", 60))
        except (TypeError, ValueError):
            continue
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=datetime.UTC)
        if now < seen + datetime.timedelta(seconds=lifetime_s):
            alive.append(str(peer))
    return alive


def other_layouts(
    layout: Layout, base: str, peerings: Iterable[Mapping[str, Any]], now: datetime.datetime
) -> list[str]:
    """Peering objects of another shard layout (another count) that have a live peer.

    Args:
        layout: this process's shard.
        base: the peering name the layouts share (``OperatorConfig.peering_name``).
        peerings: KopfPeering / ClusterKopfPeering objects (``metadata.name``, ``status``).
        now: the time the objects were read (UTC, aware).

    Returns:
        Their names, sorted.
    """
    found = set()
    for obj in peerings:
        name = str((obj.get("metadata") or {}).get("name") or "")
        count = layout.layout_of(base, name)
        if count is None or count == layout.count:
            continue
        if live_peers(obj.get("status"), now):
            found.add(name)
    return sorted(found)


@dataclasses.dataclass
class Handover:
    """Whether this process may serve its shard yet (a new layout waits for the old one).

    The first ``observe`` decides who is new: a process that finds no live peer of another
    layout when it first looks is established and serves from then on, whatever appears later
    (a newer layout waits for it, not the other way round); a process that finds one waits
    until a later ``observe`` finds none, then is established. So in a rolling upgrade the two
    layouts do not serve at once, and the one that served first is never paused by the
    newcomer. Two layouts that both wait (a second change of the count before the first one
    finished) would wait for each other for ever, so a wait ends after ``timeout_s`` anyway.

    Attributes:
        timeout_s: the longest wait, s.
        established: this process serves its shard.
        waiting_for: the other layout's peering objects it waits for (empty once established).
        timed_out: it serves because the wait ran out, not because the other layout left.
    """

    timeout_s: float = 120.0
    established: bool = False
    waiting_for: tuple[str, ...] = ()
    timed_out: bool = False
    _since_s: float | None = None

    def observe(self, others: Iterable[str], now_s: float) -> bool:
        """Record one read (at monotonic ``now_s``) of the other layouts' live peering objects.

        Returns:
            Whether this process serves.
        """
        if not self.established:
            names = tuple(sorted(others))
            if self._since_s is None:
                self._since_s = now_s
            self.timed_out = bool(names) and now_s - self._since_s >= self.timeout_s
            self.established = not names or self.timed_out
            self.waiting_for = () if self.established else names
        return self.established
