"""What the simulator benches share: rows run in worker processes, in order, and their JSON.

``bench/energy.py`` and ``bench/phases.py`` import it as a sibling module (a bench script's own
folder is first on ``sys.path``).
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

Row = dict[str, Any]


def run_in_order(
    fn: Callable[[Any], Row | None],
    runs: Sequence[Any],
    jobs: int,
    progress: Callable[[Any, Row | None], str],
) -> tuple[list[Row], float]:
    """Run ``fn`` over ``runs`` in ``jobs`` worker processes.

    Each result, in the order of ``runs``, prints ``progress(run, row)`` to stderr as it
    arrives; a ``None`` row is left out of the rows.

    Returns:
        The rows and the wall time, s.
    """
    t0 = time.perf_counter()
    rows: list[Row] = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(jobs, 1)) as pool:
        for run, row in zip(runs, pool.map(fn, runs), strict=True):
            print(progress(run, row), file=sys.stderr, flush=True)
            if row is not None:
                rows.append(row)
    return rows, time.perf_counter() - t0


def print_json(rows: list[Row], elapsed_s: float) -> None:
    """The bench's ``--json`` output on stdout: ``{"rows": [...], "elapsed_s": s}`` alone."""
    print(json.dumps({"rows": rows, "elapsed_s": elapsed_s}, indent=2))
