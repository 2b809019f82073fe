"""``rlenergy-operator`` / ``python -m rlenergy_operator``: ``kopf run -m rlenergy_operator``.

Extra arguments go to ``kopf run`` (``--standalone``, ``--namespace``, ``--all-namespaces``,
``--peering``, ``--liveness``, ``--verbose``). Without a namespace flag it serves the
namespaces of ``RLENERGY_OPERATOR_WATCH_NAMESPACES`` (a namespaced install), else every one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the operator until SIGTERM."""
    from kopf import cli

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(
        a in ("-A", "--all-namespaces") or a.startswith(("-n", "--namespace")) for a in args
    ):
        from rlenergy_operator import settings

        served = settings.OperatorConfig().served_namespaces
        args[:0] = [f"--namespace={n}" for n in served] or ["--all-namespaces"]
    cli.main(["run", "-m", "rlenergy_operator", *args], standalone_mode=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
