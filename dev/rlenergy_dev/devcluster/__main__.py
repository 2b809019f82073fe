"""``python -m rlenergy_dev.devcluster up|down|kubeconfig|status``."""

from __future__ import annotations

import sys

from rlenergy_dev.devcluster.cli import main

if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # e.g. `... status | head`
        sys.stderr.close()
        sys.exit(1)
