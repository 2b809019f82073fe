"""Liveness that means it on the real control plane.

The operator (``python -m rlenergy_operator --standalone``, kopf's ``/healthz`` on 127.0.0.1)
reaches the API server through a TCP proxy on 127.0.0.1 that, once frozen, stops relaying bytes
on every connection opened before the freeze while new connections pass: the operator's watch
streams go silent (no event, no bookmark) with nothing closed, as behind a broken middlebox,
while the probe's periodic read (whose stalled pooled connection times out and is replaced)
still reaches the API server. We test these aspects:
* with live watches ``/healthz`` answers 200 for longer than the bound while the policy changes;
* after the freeze, with the policy changing on the API server, ``/healthz`` answers 500
  within the bound plus one read period, one request timeout and kopf's 10 s probe cache, and
  the operator's log names the object the watch never delivered.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from e2e_support import get_json, wait_until
from rlenergy_dev.devcluster import DevCluster

pytestmark = pytest.mark.field

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 15
CHECK_INTERVAL_S = 2
REQUEST_TIMEOUT_S = 5
PROBE_CACHE_S = 10  # kopf's health_reporter answers from results up to 10 s old


class FreezingProxy:
    """TCP relay 127.0.0.1:port -> 127.0.0.1:upstream; ``freeze`` stalls the open connections."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = int(self.server.getsockname()[1])
        self._next = 0
        self._frozen_below = -1
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self.accepted_after_freeze = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        """Connections opened so far stop relaying (their bytes are held); new ones pass."""
        with self._lock:
            self._frozen_below = self._next

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                cid, self._next = self._next, self._next + 1
                self._socks += [down, up]
                if self._frozen_below >= 0:
                    self.accepted_after_freeze += 1
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(cid, src, dst), daemon=True).start()

    def _pump(self, cid: int, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while cid < self._frozen_below:  # frozen: hold the bytes, relay nothing
                    if self._stop.wait(0.2):
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.server.close()
        with self._lock:
            for s in self._socks:
                s.close()


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0  # not serving yet


@pytest.fixture
def proxied_kubeconfig(
    dev_cluster: DevCluster, tmp_path: Path
) -> Iterator[tuple[Path, FreezingProxy]]:
    text = dev_cluster.kubeconfig.read_text()
    server = next(
        line.split("server:", 1)[1].strip() for line in text.splitlines() if "server:" in line
    )
    parts = urlsplit(server)
    assert parts.hostname == "127.0.0.1" and parts.port, server
    proxy = FreezingProxy(parts.port)
    path = tmp_path / "kubeconfig"
    path.write_text(text.replace(server, f"https://127.0.0.1:{proxy.port}"))
    try:
        yield path, proxy
    finally:
        proxy.close()


def test_silent_watches_fail_the_probe_within_the_bound(
    dev_cluster: DevCluster,
    crds: None,
    namespace: str,
    proxied_kubeconfig: tuple[Path, FreezingProxy],
    tmp_path: Path,
) -> None:
    kubeconfig, proxy = proxied_kubeconfig
    health = _free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "RLENERGY_OPERATOR_NAMESPACE": namespace,
        "RLENERGY_OPERATOR_RECONCILE_INTERVAL_S": "1",
        "RLENERGY_OPERATOR_RETRY_DELAY_S": "1",
        "RLENERGY_OPERATOR_WATCH_ECHO_BOUND_S": str(BOUND_S),
        "RLENERGY_OPERATOR_WATCH_CHECK_INTERVAL_S": str(CHECK_INTERVAL_S),
        "RLENERGY_OPERATOR_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
        "RLENERGY_OPERATOR_RESET_DEADLINE_S": "5",
    }
    log = tmp_path / "operator.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlenergy_operator",
                "--standalone",
                "--all-namespaces",
                f"--liveness=http://127.0.0.1:{health}/healthz",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )
    try:
        body = {
            "apiVersion": "rlenergy.io/v1alpha1",
            "kind": "RLEnergyPolicy",
            "metadata": {"name": "live"},
            "spec": {"selector": {"matchLabels": {"app": "live"}}},
        }
        dev_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
        wait_until(
            lambda: (
                (get_json(dev_cluster, "rlep", "live", "-n", namespace).get("status") or {}).get(
                    "observedGeneration"
                )
                == 1
            ),
            timeout=90,
            what="policy live reconciled",
        )
        wait_until(lambda: _healthz(health) == 200, timeout=30, what="/healthz 200")

        def touch(i: int) -> None:  # a new resourceVersion on the API server
            dev_cluster.kubectl(
                "annotate", "--overwrite", "rlep", "live", "-n", namespace, f"t={i}"
            )

        # Live watches: 200 for longer than the bound while the policy keeps changing.
        end = time.monotonic() + BOUND_S + PROBE_CACHE_S + 5
        i = 0
        while time.monotonic() < end:
            touch(i := i + 1)
            assert _healthz(health) == 200, log.read_text(errors="replace")[-3000:]
            time.sleep(1)

        proxy.freeze()
        frozen_at = time.monotonic()
        limit_s = BOUND_S + CHECK_INTERVAL_S + REQUEST_TIMEOUT_S + PROBE_CACHE_S + 15
        code = 200
        while code != 500 and time.monotonic() - frozen_at < limit_s:
            touch(i := i + 1)
            code = _healthz(health)
            time.sleep(1)
        took_s = time.monotonic() - frozen_at
        text = log.read_text(errors="replace")
        assert code == 500, f"/healthz still {code} {took_s:.0f} s after the freeze\n{text[-4000:]}"
        print(f"/healthz 500 {took_s:.1f} s after the watches went silent (bound {BOUND_S} s)")
        assert "watches silent" in text and f"rlenergypolicies {namespace}/live" in text, text[
            -4000:
        ]
        assert proxy.accepted_after_freeze > 0  # the read went through a new connection
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        dev_cluster.kubectl("delete", "rlep", "--all", "-n", namespace, "--wait=false", check=False)
        dev_cluster.kubectl(
            "patch",
            "rlep",
            "live",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )
