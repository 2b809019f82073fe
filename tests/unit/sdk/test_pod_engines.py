"""The pod's engine folder: rollout servers publish their ``/metrics``, the signalling worker sums
them (``rlenergy.sdk.pod_engines``), with vLLM 0.33.0's and SGLang 0.5.23's real metric names
served by prometheus-client on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import prometheus_client
import pytest

from rlenergy.sdk import pod_engines, progress


class Served:
    """One engine's exposition on 127.0.0.1 (its counter and request gauges)."""

    def __init__(self, engine: str) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        counter = progress.ENGINES[engine]
        labels = sorted({"model_name", *counter.match})
        values = [counter.match.get(k, "m") for k in labels]
        self.tokens = prometheus_client.Counter(
            counter.family, "Tokens.", labels, registry=self.registry
        ).labels(*values)
        self.gauges = [
            prometheus_client.Gauge(g, "Held.", ["model_name"], registry=self.registry).labels("m")
            for g in counter.busy
        ]
        self.server, _ = prometheus_client.start_http_server(
            0, addr="127.0.0.1", registry=self.registry
        )
        self.url = pod_engines.metrics_url("127.0.0.1", self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served() -> Iterator[list[Served]]:
    made: list[Served] = []
    yield made
    for s in made:
        s.close()


def test_the_pods_engines_are_summed(tmp_path: Path, served: list[Served]) -> None:
    vllm, sglang = Served("vllm"), Served("sglang")
    served += [vllm, sglang]
    with pytest.raises(progress.ProgressUnavailable, match="no inference engine published"):
        pod_engines.PodEngines(tmp_path).total()
    pod_engines.publish("vllm", vllm.url, directory=tmp_path)
    pod_engines.publish("sglang", sglang.url, directory=tmp_path)
    vllm.tokens.inc(100)
    sglang.tokens.inc(23)
    vllm.gauges[0].set(3)
    sglang.gauges[1].set(2)
    engines = pod_engines.PodEngines(tmp_path)
    assert engines.total() == 123
    assert engines.activity() == (5, 123)
    sglang.close()  # one engine unreadable: no partial (falling) sum
    served.remove(sglang)
    with pytest.raises(progress.ProgressUnavailable):
        engines.total()


def test_a_dead_processs_entry_is_skipped_and_bad_input_refused(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    (tmp_path / "1-0.json").write_text(
        json.dumps({"engine": "vllm", "url": "http://127.0.0.1:1/metrics", "pid": int(dead.stdout)})
    )
    (tmp_path / "2-0.json").write_text("not json")
    # this very pid, but another start time: a process that reused the pid
    (tmp_path / "3-0.json").write_text(
        json.dumps(
            {
                "engine": "vllm",
                "url": "http://127.0.0.1:3/metrics",
                "pid": os.getpid(),
                "started": "1",
            }
        )
    )
    assert pod_engines.published(tmp_path) == []
    with pytest.raises(ValueError, match="no token counter known for engine 'trtllm'"):
        pod_engines.publish("trtllm", "http://127.0.0.1:1/metrics", directory=tmp_path)
    path = pod_engines.publish("vllm", "http://127.0.0.1:2/metrics", directory=tmp_path)
    assert [e.url for e in pod_engines.published(tmp_path)] == ["http://127.0.0.1:2/metrics"]
    assert path.name.endswith("-0.json")
    assert pod_engines.metrics_url("::1", 8000) == "http://[::1]:8000/metrics"


def test_the_folder_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pod_engines.ENGINE_DIR_ENV, raising=False)
    assert pod_engines.engine_dir() == Path("/tmp/rlenergy-engines")
    monkeypatch.setenv(pod_engines.ENGINE_DIR_ENV, "/x/y")
    assert pod_engines.engine_dir() == Path("/x/y")
