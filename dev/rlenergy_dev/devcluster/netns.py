"""A network namespace of the calling thread's own, for a dev cluster with a pod network.

Linux keeps a network namespace per thread: ``unshare(CLONE_NEWNET)`` moves only the calling
thread into a new, empty namespace (unshare(2)), and whatever it starts afterwards (processes
it forks, threads it creates, sockets it opens) lives there too, while the process's other
threads stay where they were. :func:`private_network` does that in the calling thread, brings
``lo`` up and, with a :class:`~rlenergy_dev.devcluster.realnode.PodNetwork`, adds its bridge
with the gateway address; on exit it moves the thread back (``setns`` to the namespace it left)
and the new namespace goes away with the last process in it.

So a dev cluster started in that thread after the switch (API server, etcd, kubelet,
containerd, helm, kubectl, ...) listens and dials only inside the namespace: its 127.0.0.1 is
not the machine's, and its pods' addresses in a private range (the bridge's subnet) exist only
there. Needs ``CAP_SYS_ADMIN`` (root) and the ``ip`` command (iproute2).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from rlenergy_dev.devcluster.errors import DevClusterError
from rlenergy_dev.devcluster.realnode import PodNetwork

CLONE_NEWNET = 0x40000000
"""``unshare``/``setns`` flag of a network namespace (linux/sched.h)."""


def _libc_call(name: str, *args: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise DevClusterError(f"{name}(CLONE_NEWNET) failed: {os.strerror(err)} (errno {err})")


def current_namespace() -> str:
    """The calling thread's network namespace, as its ``/proc`` link reads (``net:[<inode>]``)."""
    return os.readlink("/proc/thread-self/ns/net")


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if res.returncode != 0:
        raise DevClusterError(f"ip {' '.join(args)} failed ({res.returncode}): {res.stderr}")


def bridge_commands(net: PodNetwork) -> list[Sequence[str]]:
    """The ``ip`` commands (arguments) that make ``net``'s bridge with its gateway address, up."""
    return [
        ("link", "add", net.bridge, "type", "bridge"),
        ("addr", "add", f"{net.gateway}/{net.prefix_len}", "dev", net.bridge),
        ("link", "set", net.bridge, "up"),
    ]


@contextlib.contextmanager
def private_network(net: PodNetwork | None = None) -> Iterator[str]:
    """Run the calling thread (and what it starts) in a new network namespace until exit.

    Args:
        net: A pod network whose bridge to add (with ``net.gateway`` on it); ``None``: only
            ``lo``.

    Yields:
        The new namespace's ``/proc`` link text (``net:[<inode>]``).

    Raises:
        DevClusterError: ``unshare`` or ``setns`` failed (not root), or an ``ip`` command did.
    """
    saved = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _libc_call("unshare", CLONE_NEWNET)
        try:
            _ip("link", "set", "lo", "up")
            for args in bridge_commands(net) if net is not None else ():
                _ip(*args)
            yield current_namespace()
        finally:
            _libc_call("setns", saved, CLONE_NEWNET)
    finally:
        os.close(saved)


def namespace_of(pid: int) -> str:
    """Network namespace of process ``pid`` (``net:[<inode>]``).

    Raises:
        OSError: No such process (or not ours to read).
    """
    return os.readlink(Path("/proc") / str(pid) / "ns" / "net")
