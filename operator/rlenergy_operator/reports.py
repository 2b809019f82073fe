"""Reading a policy's node reports cheaply, pass after pass.

The job loop needs, per pass, every node report of its policy, but only the step records it has
not folded yet (``totals.throughStep`` is the checkpoint). Listing and parsing whole reports
every pass cost O(nodes x kept steps x probe slices) per policy and made the operator CPU bound
at 1,000 nodes (docs/scale-and-chaos.md). ``ReportCache`` instead

* lists only the reports' metadata (name and ``resourceVersion``),
* GETs a report only when its ``resourceVersion`` changed (about once per node per RL step),
* parses only the records the loop still needs (``trim_steps``), and
* keeps the parsed, trimmed reports for the next pass.

Where the reports come from: a watch (the kopf index ``handlers.policy_node_reports``) keeps
every report's latest version in memory as an ``IndexedReport`` (compressed JSON, trimmed to the
policy's checkpoint when it was indexed), so a pass sends no read request; at 1,000 nodes the
per-pass metadata LIST and the GETs were most of the operator's reads and each pass waited for
them on a busy API server. kopf runs no handler before the first listing is indexed, but only at
start-up: a replica resumed by peering runs passes while its index is still being refilled, so a
policy's first pass in a replica, and a pass whose index dropped a report, compare the index
with the API server's list (``ReportCache._complete``). A report whose indexed copy lacks
records the pass needs (a restore after a new spec generation replays every record,
``after_step=-1``) is read from the API server; after an operator restart the index holds whole
reports (no checkpoint known yet), so the restore reads only the reports' metadata: one list,
which finds the reports the index does not hold yet (``ReportCache._complete``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import pydantic

from rlenergy.api import naming
from rlenergy.api import node as api_node


def trim_steps(spec: Mapping[str, Any], after_step: int) -> dict[str, Any]:
    """A report spec (wire form, camelCase) without the records the loop no longer needs.

    Keeps every record with ``step > after_step`` and the report's oldest record: the oldest one
    keeps the report's step window (``aggregate.step_state`` tells a skipped step, LOST, from a
    step before the window by the window's first step) exactly as in the full report. An oldest
    record at or before ``after_step`` is folded already: only its step number matters, so its
    phase windows (probe slices: most of a record's size) are dropped.

    Args:
        spec: ``RLEnergyNodeReport.spec`` as read from the API server.
        after_step: the newest folded step (``totals.throughStep``); -1 keeps everything.

    Returns:
        A shallow copy of ``spec`` with a shorter ``steps`` list (records in their order).
    """
    steps = spec.get("steps") or []
    if after_step < 0 or not steps:
        return dict(spec)
    kept = _kept(steps, lambda r: int(r.get("step", 0)), lambda r: {**r, "phases": []}, after_step)
    return {**spec, "steps": kept}


def _retrim(report: api_node.NodeReport, after_step: int) -> api_node.NodeReport:
    """``report`` (parsed) trimmed as ``trim_steps`` trims its wire form."""
    if after_step < 0 or not report.steps:
        return report
    kept = _kept(
        report.steps, lambda r: r.step, lambda r: r.model_copy(update={"phases": []}), after_step
    )
    return report.model_copy(update={"steps": kept})


_R = TypeVar("_R")


def _kept(
    records: Sequence[_R], step_of: Callable[[_R], int], strip: Callable[[_R], _R], after: int
) -> list[_R]:
    """The records ``trim_steps`` keeps, in their order.

    Records after ``after``, and the oldest record, stripped of its windows when it is at or
    before ``after``.
    """
    oldest = min(range(len(records)), key=lambda i: step_of(records[i]))
    return [
        r if step_of(r) > after else strip(r)
        for i, r in enumerate(records)
        if step_of(r) > after or i == oldest
    ]


@dataclasses.dataclass(frozen=True)
class IndexedReport:
    """One node report as the watch last delivered it (a kopf index value).

    Attributes:
        name: the report's name.
        resource_version: its ``metadata.resourceVersion``.
        after_step: records up to this step (except the oldest) were dropped when indexed;
            -1: all records kept.
        blob: the trimmed spec as compact JSON, zlib-compressed (step records repeat their
            keys; a full report of 32 steps shrinks several times, which bounds the index
            after a restart, before checkpoints are known).
    """

    name: str
    resource_version: str
    after_step: int
    blob: bytes

    @classmethod
    def from_spec(
        cls, name: str, resource_version: str, spec: Mapping[str, Any], after_step: int
    ) -> IndexedReport:
        """Index ``spec`` keeping the records ``trim_steps(spec, after_step)`` keeps."""
        raw = json.dumps(trim_steps(spec, after_step), separators=(",", ":"))
        return cls(name, resource_version, after_step, zlib.compress(raw.encode(), 1))

    def spec(self) -> dict[str, Any]:
        """The (trimmed) spec, wire form."""
        out: dict[str, Any] = json.loads(zlib.decompress(self.blob))
        return out


@dataclasses.dataclass(frozen=True)
class _Entry:
    resource_version: str
    after_step: int
    report: api_node.NodeReport | None  # None: malformed (logged once per version)


class ReportCache:
    """Parsed node reports of one policy, refreshed by resourceVersion.

    Args:
        list_versions: ``(namespace, policy) -> {report name: resourceVersion}``.
        get_report: ``(namespace, name) -> (resourceVersion, spec)`` of one report, None when
            it is gone (404).
    """

    def __init__(
        self,
        list_versions: Callable[[str, str], dict[str, str]],
        get_report: Callable[[str, str], tuple[str, Mapping[str, Any]] | None],
    ) -> None:
        self._list_versions = list_versions
        self._get_report = get_report
        self._entries: dict[str, _Entry] = {}
        self.fetched = 0
        """Reports fetched and parsed so far (for tests and logs)."""
        self.completed = 0
        """Reports the index lacked and the API server listed (``_complete``), so far."""
        self._listed = False  # whether an index-fed pass has listed the API server's reports

    def refresh(
        self,
        namespace: str,
        policy: str,
        after_step: int,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        indexed: Iterable[IndexedReport] | None = None,
    ) -> list[api_node.NodeReport]:
        """The policy's reports, records after ``after_step`` (plus each report's oldest).

        Args:
            namespace: the policy's namespace.
            policy: the policy's name.
            after_step: the newest folded step; -1 asks for every record.
            logger: where malformed reports are reported.
            indexed: the watch's view of the policy's reports (``IndexedReport``); None reads
                from the API server instead (list, then GET what changed). An indexed copy
                trimmed past ``after_step`` is read from the API server.

        Raises:
            Whatever ``list_versions`` and ``get_report`` raise (API errors); the cache keeps its
            entries, so the next pass retries only what is missing.
        """
        get_report = self._get_report
        if indexed is not None:
            by_name = {e.name: e for e in indexed}
            versions = {n: e.resource_version for n, e in by_name.items()}
            if not self._listed or any(n not in by_name for n in self._entries):
                # The index may lack reports the API server has (``_complete``).
                versions = self._complete(namespace, policy, by_name)

            def get_report(ns: str, name: str) -> tuple[str, Mapping[str, Any]] | None:
                e = by_name.get(name)
                if e is None or e.after_step > after_step or e.resource_version != versions[name]:
                    return self._get_report(ns, name)
                return e.resource_version, e.spec()

        else:
            versions = self._list_versions(namespace, policy)
        for name in [n for n in self._entries if n not in versions]:
            del self._entries[name]
        out: list[api_node.NodeReport] = []
        for name in sorted(versions):
            rv = versions[name]
            entry = self._entries.get(name)
            if entry is None or entry.resource_version != rv or entry.after_step > after_step:
                got = get_report(namespace, name)
                if got is None:
                    self._entries.pop(name, None)
                    continue
                self.fetched += 1
                # The GET may be newer than the listing: keep the version it returned.
                entry = _Entry(got[0], after_step, self._parse(name, got[1], after_step, logger))
                self._entries[name] = entry
            elif entry.after_step < after_step and entry.report is not None:
                # The records folded since this entry was parsed are not needed again.
                entry = _Entry(
                    entry.resource_version, after_step, _retrim(entry.report, after_step)
                )
                self._entries[name] = entry
            if entry.report is not None:
                out.append(entry.report)
        return out

    def _complete(
        self, namespace: str, policy: str, by_name: Mapping[str, IndexedReport]
    ) -> dict[str, str]:
        """The API server's report versions, where the index may not hold every report.

        A job step is complete when every node report that exists has it (``aggregate``), so a
        view that lacks a report folds the step over the other nodes alone and books less
        energy than the nodes measured, for good. The index can lack one: a replica resumed by
        peering lists each kind again, each in its own watch stream, and kopf holds handlers
        back for the indexes only until they were filled once, at start-up (``watcher`` in
        ``kopf/_core/reactor/queueing.py``), so the resumed replica's first passes run while the
        reports' listing is still being indexed. So the cache's first index-fed pass and any
        pass whose index dropped a report this cache holds list the reports' metadata (one
        request); a report the index lacks, or holds at another version, is read from the API
        server. Once listed, a report created later reaches the pass through the index alone,
        as in any pass: the listing is not repeated while a new job waits for its first
        fold (at 1,000 nodes, a list per pass of 20 policies took 0.46 s each on the API
        server and held the first step's accounting back by up to 44 s; bench/scale.py).

        Returns:
            Name -> ``resourceVersion`` of every report the API server lists.
        """
        listed = self._list_versions(namespace, policy)
        self.completed += sum(1 for n in listed if n not in by_name)
        self._listed = True
        return listed

    @staticmethod
    def _parse(
        name: str,
        spec: Mapping[str, Any],
        after_step: int,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> api_node.NodeReport | None:
        try:
            # Text a node agent wrote reaches conditions, Events and kubectl: printable only.
            clean = naming.printable_tree(trim_steps(spec, after_step))
            return api_node.NodeReport.model_validate(clean)
        except pydantic.ValidationError as exc:
            logger.warning("skipping malformed node report %s: %s", name, exc.errors()[0]["msg"])
            return None
