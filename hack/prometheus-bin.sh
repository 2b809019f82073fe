#!/usr/bin/env bash
# Fetch Debian's `prometheus` server binary for the Prometheus end-to-end test
# (tests/e2e/test_prometheus.py) into the control-plane bin dir; called by `make bins`.
#
# `apt-get download` fetches the .deb of the apt candidate (no root, no install, no dependencies:
# the Go binary links only libc) and `dpkg-deb` extracts usr/bin/prometheus. Idempotent: a
# working binary in the bin dir is kept (a rerun takes well under a second).
# Bin dir: ${K8S_BIN_DIR:-${RLENERGY_CACHE:-$HOME/.cache/rl-energy}/k8s-<version>/bin}
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
CACHE=${RLENERGY_CACHE:-$HOME/.cache/rl-energy}
BIN=${K8S_BIN_DIR:-$CACHE/k8s-$K8S_VERSION/bin}
PACKAGE=${PROMETHEUS_DEB:-prometheus}   # e.g. PROMETHEUS_DEB=prometheus=2.42.0+ds-5+deb12u1

log() { printf '[bins %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[bins] ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$BIN"
if [[ -x $BIN/prometheus ]] && "$BIN/prometheus" --version >/dev/null 2>&1; then
  log "prometheus: cached ($("$BIN/prometheus" --version 2>&1 | head -1))"
  exit 0
fi
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null \
  || die "apt-get/dpkg-deb not found: the Prometheus e2e test uses Debian's prometheus package. On another OS put a prometheus 2.x binary at $BIN/prometheus."

tmp=$(mktemp -d "${TMPDIR:-/tmp}/rlenergy-prometheus.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
download() {  # the root-only "unsandboxed" warning is noise here
  (cd "$tmp" && apt-get download -q "$PACKAGE") 2>&1 | { grep -v 'Download is performed unsandboxed' || true; }
}
log "prometheus: apt-get download $PACKAGE"
if ! download || ! compgen -G "$tmp/prometheus_*.deb" >/dev/null; then
  if [[ $(id -u) == 0 ]]; then
    log "prometheus: apt-get update, then retry"
    apt-get update -q >/dev/null
    download || true
  fi
fi
deb=$(compgen -G "$tmp/prometheus_*.deb" | head -1) \
  || die "apt-get download $PACKAGE failed (no package lists? run 'apt-get update' as root, then rerun 'make bins')."
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp" ./usr/bin/prometheus \
  || die "usr/bin/prometheus not found in $deb"
install -m 0755 "$tmp/usr/bin/prometheus" "$BIN/prometheus.tmp"
mv "$BIN/prometheus.tmp" "$BIN/prometheus"
log "prometheus: $("$BIN/prometheus" --version 2>&1 | head -1) from $(basename "$deb")"
