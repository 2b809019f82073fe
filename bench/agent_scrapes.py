"""Phase signal round trip while concurrent scrapers read /metrics (stand-in NVML, in-process).

Starts the agent's real signal server and ops server over 8 stand-in GPUs held by one pod,
with ``--series`` extra phase series in the counters (10,000: what 5,000 phase names made when
any name was accepted), runs ``--scrapers`` threads that GET /metrics in a loop, and sends
``--signals`` phase signals through the trainer SDK, timing each round trip. Prints p50/p99
and how many scrapes the ops port answered 503 (its connection cap,
``server.MAX_OPS_CONNECTIONS``); a scraper answered 503 scrapes again.
``SRC`` (default: this checkout) is the source tree to measure, so a baseline tree (``git
worktree add /tmp/base <commit>``) is measured the same way on the same machine.

    python bench/agent_scrapes.py [SRC] [--series 0] [--scrapers 8] [--signals 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def main() -> int:
    """Run the measurement; prints one line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--series", type=int, default=0)
    parser.add_argument("--scrapers", type=int, default=8)
    parser.add_argument("--signals", type=int, default=300)
    args = parser.parse_args()
    tree = Path(args.src)
    sys.path[:0] = [str(tree / p) for p in (".", "agent", "operator", "tests/unit/agent")]
    from agent_support import LOCKED_PLAN, FakeReviews, make_uuids, standin_agent
    from rlenergy_agent import server, service
    from rlenergy_dev import standin

    from rlenergy.gpu import models

    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rlscr-"))
    lib = standin.build_library(work / "build")
    drv = standin.StandinDriver(
        work / "state", [(u, models.get_sku("h100-sxm")) for u in make_uuids(8)]
    )
    standin.preload(lib, drv.path)
    drv.start()
    pod = service.PodRef("team-a", "trainer-0", "11111111-2222-3333-4444-555555555555")
    agent = standin_agent({pod: list(drv.uuids)}, LOCKED_PLAN, time.monotonic)
    for i in range(args.series // 8):
        for u in drv.uuids:
            agent.phase_energy_j[(u, f"phase-{i:05d}")] = 1.0
            agent.phase_seconds[(u, f"phase-{i:05d}")] = 1.0
    reviews = FakeReviews()
    sock = work / "a.sock"
    signals = server.SignalServer(sock, agent, reviews.authenticator())
    ops = server.OpsServer("127.0.0.1", 0, agent, health=lambda: True, ready=lambda: True)
    signals.start()
    ops.start()
    stop = threading.Event()
    scrapes = [0]
    busy = [0]

    def scrape() -> None:
        url = f"http://127.0.0.1:{ops.port}/metrics"
        while not stop.is_set():
            try:
                with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 - loopback
                    resp.read()
            except urllib.error.HTTPError as exc:  # 503: every ops slot taken; scrape again
                exc.close()
                if exc.code != 503:
                    raise
                busy[0] += 1
                continue
            scrapes[0] += 1

    threads = [threading.Thread(target=scrape, daemon=True) for _ in range(args.scrapers)]
    for t in threads:
        t.start()
    client = reviews.client(sock, pod, work, strict=True)
    time.sleep(0.5)
    lat: list[float] = []
    for i in range(args.signals):
        t0 = time.perf_counter()
        client.phase("generation" if i % 2 == 0 else "training", step=i // 2)
        lat.append(time.perf_counter() - t0)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    client.close()
    signals.stop()
    ops.stop()
    drv.close()
    lat.sort()
    p99 = lat[max(int(0.99 * len(lat)) - 1, 0)]
    print(
        f"{tree}: series={args.series} scrapers={args.scrapers} scrapes={scrapes[0]} "
        f"scrapes answered 503={busy[0]} "
        f"signal p50={statistics.median(lat) * 1e3:.2f} ms p99={p99 * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
