#!/usr/bin/env bash
# Build Kubernetes' own DRA test driver for the real node; called by `make bins` after
# hack/device-plugin-bin.sh (docs/dev-cluster.md "DRA driver").
#
#   dra-test-driver  k8s.io/kubernetes/test/e2e/dra/test-driver@$K8S_VERSION from the Go module
#                    proxy, through the same wrapper module as the kubelet (hack/k8s-wrapper.sh:
#                    every staging replace of k/k's go.mod pinned to its tag). Its `kubelet-plugin`
#                    subcommand is a DRA kubelet plugin (resource.k8s.io/v1) publishing
#                    --num-devices devices device-00.. of driver test-driver.cdi.k8s.io in a
#                    ResourceSlice of the node and writing a CDI spec per prepared claim; the real
#                    node runs it as a host process next to the kubelet
#                    (rlenergy_dev/devcluster/draplugin.py).
#
# The binary has no --version; a stamp file next to it names the k8s version it was built from,
# and a binary with another (or no) stamp is built again.
# Idempotent: an existing binary with a matching stamp is kept (a rerun takes about a second).
# Cache: ${RLENERGY_CACHE:-$HOME/.cache/rl-energy}/k8s-<version>/bin
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
CACHE=${RLENERGY_CACHE:-$HOME/.cache/rl-energy}
ROOT=$CACHE/k8s-$K8S_VERSION
BIN=${K8S_BIN_DIR:-$ROOT/bin}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NAME=dra-test-driver
STAMP=$BIN/$NAME.version

log() { printf '[dra-driver-bin %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[dra-driver-bin] ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$BIN" "$ROOT"
if [[ ! -x $BIN/$NAME || $(cat "$STAMP" 2>/dev/null) != "$K8S_VERSION" ]]; then
  rm -f "$BIN/$NAME" "$STAMP"
  t0=$SECONDS
  # shellcheck source=hack/k8s-wrapper.sh
  source "$REPO/hack/k8s-wrapper.sh"
  k8s_build "$NAME=test/e2e/dra/test-driver"
  echo "$K8S_VERSION" >"$STAMP"
  log "$NAME built in $((SECONDS - t0)) s (wrapper module included)"
fi
"$BIN/$NAME" kubelet-plugin --help 2>&1 | grep -q -- '--num-devices' \
  || die "$BIN/$NAME kubelet-plugin --help does not list --num-devices; delete it and rerun 'make bins'"
log "$NAME: k8s.io/kubernetes/test/e2e/dra/test-driver@$(cat "$STAMP")"
