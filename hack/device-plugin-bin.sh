#!/usr/bin/env bash
# Build NVIDIA's Kubernetes device plugin from the Go module proxy; called by `make bins` after
# hack/registry-bins.sh (docs/dev-cluster.md "Real node").
#
#   nvidia-device-plugin  github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin@$DEVICE_PLUGIN_VERSION
#                         (the device plugin of NVIDIA's GPU Operator); the real node runs it as a
#                         host process over the stand-in NVML with --device-list-strategy=cdi-cri
#                         (rlenergy_dev/devcluster/nvidiaplugin.py). cgo: it dlopens libnvidia-ml.so.1 through
#                         go-nvml, so gcc is needed.
#
# Idempotent: a binary whose version matches is kept (a rerun takes about a second).
# Cache: ${RLENERGY_CACHE:-$HOME/.cache/rl-energy}/k8s-<version>/bin
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
DEVICE_PLUGIN_VERSION=${DEVICE_PLUGIN_VERSION:-v0.17.4}
DEVICE_PLUGIN_MODULE=github.com/NVIDIA/k8s-device-plugin
CACHE=${RLENERGY_CACHE:-$HOME/.cache/rl-energy}
ROOT=$CACHE/k8s-$K8S_VERSION
BIN=${K8S_BIN_DIR:-$ROOT/bin}

log() { printf '[device-plugin-bin %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[device-plugin-bin] ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$BIN"

plugin_version() { "$BIN/nvidia-device-plugin" --version 2>/dev/null | sed -n 's/^NVIDIA Device Plugin version //p'; }
if [[ ! -x $BIN/nvidia-device-plugin || $(plugin_version) != "$DEVICE_PLUGIN_VERSION" ]]; then
  command -v go >/dev/null || die "Go is not installed. Install Go >= 1.26 and rerun 'make bins'."
  command -v gcc >/dev/null || die "gcc not found (nvidia-device-plugin needs cgo): apt-get install gcc libc6-dev"
  log "go install $DEVICE_PLUGIN_MODULE/cmd/nvidia-device-plugin@$DEVICE_PLUGIN_VERSION"
  t0=$SECONDS
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/rlenergy-device-plugin.XXXXXX")
  GOTOOLCHAIN=local GOFLAGS=-trimpath CGO_ENABLED=1 GOBIN=$tmp \
    nice -n 10 go install -ldflags "-s -w -X $DEVICE_PLUGIN_MODULE/internal/info.version=$DEVICE_PLUGIN_VERSION" \
    "$DEVICE_PLUGIN_MODULE/cmd/nvidia-device-plugin@$DEVICE_PLUGIN_VERSION" \
    || die "go install $DEVICE_PLUGIN_MODULE/cmd/nvidia-device-plugin@$DEVICE_PLUGIN_VERSION failed"
  mv "$tmp/nvidia-device-plugin" "$BIN/nvidia-device-plugin"
  rm -rf "$tmp"
  log "nvidia-device-plugin built in $((SECONDS - t0)) s"
  echo "nvidia-device-plugin $((SECONDS - t0))" >>"$ROOT/build-times.txt"
fi
[[ $(plugin_version) == "$DEVICE_PLUGIN_VERSION" ]] \
  || die "$BIN/nvidia-device-plugin --version does not say $DEVICE_PLUGIN_VERSION; delete it and rerun 'make bins'"
log "nvidia-device-plugin: $(plugin_version)"
