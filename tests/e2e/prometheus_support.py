"""A throw-away Prometheus server for the e2e tests (Debian's binary, fetched by ``make bins``).

``PrometheusServer`` writes a config with static targets, runs ``prometheus`` on 127.0.0.1 (a
free port, TSDB in a temporary folder, 1 s scrape interval) and answers instant queries through
the HTTP API. It is a context manager: the process never outlives the ``with`` block (nor
the test process: it gets SIGKILL when its parent dies).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import pytest
import yaml
from rlenergy_dev.devcluster import process
from rlenergy_dev.devcluster.binaries import default_bin_dir
from rlenergy_dev.devcluster.cluster import free_port

SCRAPE_INTERVAL_S = 1.0


def find_prometheus() -> Path:
    """``$PROMETHEUS``, the control-plane bin dir (``make bins``), then ``PATH``."""
    candidates = [Path(p) for p in (os.environ.get("PROMETHEUS"),) if p]
    candidates.append(default_bin_dir() / "prometheus")
    if found := shutil.which("prometheus"):
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    pytest.fail(
        f"prometheus not found (looked at {', '.join(map(str, candidates))}): run `make bins` "
        "(hack/prometheus-bin.sh fetches Debian's prometheus with apt-get download)",
        pytrace=False,
    )


class PrometheusServer:
    """Prometheus scraping ``targets`` (``host:port`` on 127.0.0.1) every second.

    Args:
        targets: static scrape targets.
        workdir: folder for the config, the TSDB and the log.
        job: the scrape job's name.
        target_labels: labels Prometheus adds to every scraped series (as the Prometheus
            Operator adds ``namespace``, ``pod``, ``container``, ``service``, ``endpoint`` from
            service discovery).
        honor_labels: on a clash keep the scraped label (``honor_labels: true``) instead of
            renaming it ``exported_<name>``.
    """

    def __init__(
        self,
        targets: Sequence[str],
        workdir: Path,
        job: str = "rlenergy-agents",
        *,
        target_labels: dict[str, str] | None = None,
        honor_labels: bool = False,
    ):
        self.targets = list(targets)
        self.workdir = workdir
        self.job = job
        self.target_labels = dict(target_labels or {})
        self.honor_labels = honor_labels
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "prometheus.log"
        self._log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> None:
        """Start the server; returns once it scraped every target (successfully or not) once."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S:g}s",
                "scrape_timeout": f"{SCRAPE_INTERVAL_S:g}s",
                "evaluation_interval": f"{SCRAPE_INTERVAL_S:g}s",
            },
            "scrape_configs": [
                {
                    "job_name": self.job,
                    "honor_labels": self.honor_labels,
                    "static_configs": [{"targets": self.targets, "labels": self.target_labels}],
                }
            ],
        }
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self._log_file = self.log.open("ab")
        self.proc = subprocess.Popen(
            [
                str(find_prometheus()),
                f"--config.file={cfg}",
                f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            # SIGKILLed with the test process, should it die before ``stop`` (pytest killed).
            preexec_fn=process._die_with_parent(),  # noqa: SLF001 - the dev cluster's own guard
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                pool = self.api("targets")["activeTargets"]
                if len(pool) == len(self.targets) and all(t["health"] != "unknown" for t in pool):
                    return
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {timeout_s} s:\n{self.logs()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``; the ``data`` of a successful answer."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as resp:  # noqa: S310 - loopback
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Instant query at now: label set (sorted, without ``__name__``) -> value."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return {(): float(data["result"][1])}
        return {
            tuple(sorted((k, v) for k, v in r["metric"].items() if k != "__name__")): float(
                r["value"][1]
            )
            for r in data["result"]
        }

    def value(self, expr: str) -> float:
        """The single value of ``expr`` (fails unless exactly one series answers)."""
        res = self.query(expr)
        assert len(res) == 1, f"{expr}: {res}"
        return next(iter(res.values()))

    def scraped_since(self, wall_s: float) -> bool:
        """Whether every target was scraped successfully after ``wall_s`` (``time.time()``)."""
        targets = self.api("targets")["activeTargets"]
        return len(targets) == len(self.targets) and all(
            t["health"] == "up" and _rfc3339_s(t["lastScrape"]) > wall_s for t in targets
        )


def _rfc3339_s(stamp: str) -> float:
    """Seconds since the epoch of an RFC 3339 timestamp with up to nanosecond fractions."""
    m = re.fullmatch(r"(.+T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    if m is None:
        raise ValueError(f"not an RFC 3339 time: {stamp}")
    tz = "+00:00" if m[3] == "Z" else m[3]
    return datetime.datetime.fromisoformat(m[1] + tz).timestamp() + float(m[2] or 0.0)
