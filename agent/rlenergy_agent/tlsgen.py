"""``python -m rlenergy_agent.tlsgen FOLDER NODE IP...``: a new key and its certificate request.

Run as a short-lived child of the agent (``tlsserve.make_in_child``): it writes the new private
key to ``FOLDER/tls.key.new`` (mode 0600) and prints the PEM request for ``NODE`` and the IPs on
stdout. The agent itself never imports ``cryptography``: its extension module adds about 17 MB
to a process for good, against the agent's 96 MiB limit; the child needs about 30 MB for a
fraction of a second, once per renewal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rlenergy.api import tls


def main(argv: Sequence[str] | None = None) -> int:
    """Write the key, print the request; 2 on bad arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3:
        print("usage: python -m rlenergy_agent.tlsgen FOLDER NODE IP...", file=sys.stderr)
        return 2
    folder, node, ips = Path(args[0]), args[1], args[2:]
    key = tls.new_key()
    csr = tls.make_csr(key, node, ips)
    path = folder / "tls.key.new"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    sys.stdout.write(csr.decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
