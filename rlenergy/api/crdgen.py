"""Generate the CustomResourceDefinitions in ``crds/`` from the pydantic models.

The models in ``rlenergy.api`` are the single source; this module turns their JSON schema into
structural OpenAPI v3 schemas the API server accepts: ``$ref``s inlined, titles dropped,
``anyOf [X, null]`` turned into an optional ``X`` (``nullable`` only where null has a meaning:
array items, and fields whose default is not null), JSON-Schema-2020 ``exclusiveMinimum: n``
into OpenAPI's ``minimum: n, exclusiveMinimum: true``, ``const`` into a one-value ``enum``,
and pydantic's ``additionalProperties: false`` dropped (structural pruning plus kubectl's
strict field validation refuse unknown fields instead). CEL rules come from the models'
``x-kubernetes-validations``.

Usage::

    python -m rlenergy.api.crdgen            # write crds/*.yaml and docs/reference/crds.md
    python -m rlenergy.api.crdgen --check    # exit 1 when either differs (CI, unit test)

With the default ``--out crds`` it also writes the CRD reference page
(``rlenergy.api.docgen``), so one command keeps the CRDs and their docs in step; ``--docs PATH``
picks another page, ``--no-docs`` skips it.

Also the ``rlenergy-crdgen`` console script. Callers: developers, CI, ``tests/unit/api``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rlenergy.api import crds, docgen


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or ``--check``) the generated CRDs."""
    parser = argparse.ArgumentParser(prog="rlenergy-crdgen", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="crds", help="output directory (default: crds)")
    parser.add_argument("--check", action="store_true", help="exit 1 when files are out of date")
    parser.add_argument(
        "--docs",
        default=None,
        help="CRD reference page to write too (default: docs/reference/crds.md with --out crds)",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not write the reference page")
    args = parser.parse_args(argv)
    out = Path(args.out)
    docs: Path | None = None
    if not args.no_docs and (args.docs is not None or args.out == "crds"):
        docs = Path(args.docs or "docs/reference/crds.md")
    if args.check:
        stale = [str(out / name) for name in crds.drift(out)]
        if docs is not None and docgen.drift(docs):
            stale.append(str(docs))
        for path in stale:
            print(f"rlenergy-crdgen: {path} is out of date; run python -m rlenergy.api.crdgen")
        return 1 if stale else 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in crds.render().items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")
    if docs is not None:
        docs.parent.mkdir(parents=True, exist_ok=True)
        docs.write_text(docgen.render())
        print(f"wrote {docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
