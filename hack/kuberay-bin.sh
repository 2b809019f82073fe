#!/usr/bin/env bash
# Build the KubeRay operator (github.com/ray-project/kuberay/ray-operator, Go) from the Go module
# proxy into the control-plane bin dir, for the RayJob end-to-end test
# (tests/e2e/test_kuberay_rayjob.py runs it against the dev cluster with KubeRay's CRDs from
# tests/e2e/testdata/kuberay-<version>). About 10 minutes on 2 cores the first time (it compiles
# client-go and controller-runtime); idempotent: an existing binary is kept.
set -euo pipefail

KUBERAY_VERSION=${KUBERAY_VERSION:-v1.5.0}   # the tag the vendored CRDs come from
K8S_VERSION=${K8S_VERSION:-v1.36.3}
CACHE=${RLENERGY_CACHE:-$HOME/.cache/rl-energy}
BIN=${K8S_BIN_DIR:-$CACHE/k8s-$K8S_VERSION/bin}

log() { printf '[kuberay %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

mkdir -p "$BIN"
if [[ -x $BIN/ray-operator ]]; then
  log "ray-operator already in $BIN"
  exit 0
fi
command -v go >/dev/null || { echo "[kuberay] ERROR: Go is not installed (see 'make bins')" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-trimpath GO111MODULE=on
log "building github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION"
t0=$SECONDS
tmp=$(mktemp -d)
GOBIN=$tmp nice -n 10 go install -ldflags "-s -w" "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION"
mv "$tmp/ray-operator" "$BIN/ray-operator"
rmdir "$tmp"
log "ray-operator built in $((SECONDS - t0)) s"
