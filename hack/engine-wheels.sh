#!/usr/bin/env bash
# Fetch the pinned inference engines' wheels (vLLM, SGLang) for the adapter source checks
# (tests/unit/sdk/test_engine_source.py reads the routes, methods and payload fields that
# rlenergy/sdk/engines.py uses from the real packages' source). Called by `make engine-wheels`
# (a prerequisite of `make unit` and `make test`).
#
#   pins   pyproject.toml [tool.rlenergy.engines] (one place; the progress sources read the same
#          versions' metric names)
#   fetch  `pip download --no-deps --only-binary=:all:` from PyPI: the wheels only, nothing is
#          installed or imported
#
# Idempotent: a wheel already in the cache is kept (a rerun takes about a second).
# Cache: ${RLENERGY_CACHE:-$HOME/.cache/rl-energy}/engines
set -euo pipefail

PY=${1:-python3}
CACHE=${RLENERGY_CACHE:-$HOME/.cache/rl-energy}/engines
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { printf '[engine-wheels %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

mkdir -p "$CACHE"
pins=$("$PY" -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["tool"]["rlenergy"]["engines"]; print(" ".join(f"{k}=={v}" for k, v in sorted(p.items())))' "$REPO/pyproject.toml")
for pin in $pins; do
  name=${pin%%==*}
  version=${pin##*==}
  if compgen -G "$CACHE/$name-$version-*.whl" >/dev/null; then
    log "$pin: cached"
    continue
  fi
  log "$pin: pip download --no-deps (PyPI)"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$CACHE" "$pin"
done
log "engine wheels in $CACHE"
