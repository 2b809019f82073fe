"""The dev cluster's private network namespace (rlenergy_dev.devcluster.netns).

We test these aspects:

* the calling thread, and what it starts, moves into a new namespace with ``lo`` up and the pod
  network's bridge holding its gateway; other threads of the process stay where they were;
* on exit the thread is back in its own namespace, also when the body raises;
* the ``ip`` commands that make the bridge.
"""

from __future__ import annotations

import subprocess
import threading

import pytest
from rlenergy_dev.devcluster import netns
from rlenergy_dev.devcluster.realnode import PodNetwork

NET = PodNetwork(bridge="rle0", subnet="10.88.0.0/24", gateway="10.88.0.1")


def _addresses() -> str:
    return subprocess.run(
        ["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout


def test_the_thread_and_its_children_move_other_threads_stay() -> None:
    host = netns.current_namespace()
    seen: dict[str, str] = {}
    ask, told = threading.Event(), threading.Event()

    def before() -> None:  # a thread that exists before the switch
        ask.wait(10)
        seen["before"] = netns.current_namespace()
        told.set()

    earlier = threading.Thread(target=before)
    earlier.start()
    with netns.private_network(NET) as own:
        ask.set()
        assert told.wait(10)
        assert seen["before"] == host  # the process's other threads stay home
        assert own != host and netns.current_namespace() == own
        child = subprocess.Popen(["sleep", "5"])
        try:
            assert netns.namespace_of(child.pid) == own
        finally:
            child.kill()
            child.wait()
        addrs = _addresses()
        assert "lo" in addrs and "127.0.0.1/8" in addrs
        assert f"{NET.bridge}" in addrs and f"{NET.gateway}/24" in addrs
        started_inside = threading.Thread(target=lambda: seen.update(t=netns.current_namespace()))
        started_inside.start()
        started_inside.join()
        assert seen["t"] == own  # a thread it creates inherits its namespace
    earlier.join()
    assert netns.current_namespace() == host
    assert f"{NET.gateway}/24" not in _addresses()


def test_back_home_when_the_body_raises() -> None:
    host = netns.current_namespace()
    with pytest.raises(RuntimeError, match="boom"), netns.private_network():
        assert netns.current_namespace() != host
        raise RuntimeError("boom")
    assert netns.current_namespace() == host


def test_bridge_commands() -> None:
    assert netns.bridge_commands(NET) == [
        ("link", "add", "rle0", "type", "bridge"),
        ("addr", "add", "10.88.0.1/24", "dev", "rle0"),
        ("link", "set", "rle0", "up"),
    ]
