#!/usr/bin/env bash
# Fetch Debian's `prometheus` server binary and its `promtool` for the Prometheus end-to-end
# tests (tests/e2e/test_prometheus.py; `promtool check metrics|rules` and `promtool test rules`
# in tests/e2e/test_promtool.py) into the control-plane bin dir; called by `make bins`.
#
# `apt-get download` fetches the .deb of the apt candidate (no root, no install, no dependencies:
# the Go binaries link only libc) and `dpkg-deb` extracts usr/bin/prometheus and
# usr/bin/promtool. Idempotent: working binaries in the bin dir are kept (a rerun takes well
# under a second).
# Bin dir: ${K8S_BIN_DIR:-${RLENERGY_CACHE:-$HOME/.cache/rl-energy}/k8s-<version>/bin}
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
CACHE=${RLENERGY_CACHE:-$HOME/.cache/rl-energy}
BIN=${K8S_BIN_DIR:-$CACHE/k8s-$K8S_VERSION/bin}
PACKAGE=${PROMETHEUS_DEB:-prometheus}   # e.g. PROMETHEUS_DEB=prometheus=2.42.0+ds-5+deb12u1

log() { printf '[bins %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[bins] ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$BIN"
works() { [[ -x $BIN/$1 ]] && "$BIN/$1" --version >/dev/null 2>&1; }
if works prometheus && works promtool; then
  log "prometheus: cached ($("$BIN/prometheus" --version 2>&1 | sed -n 1p)), promtool too"
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
deb=$(compgen -G "$tmp/prometheus_*.deb" | sed -n 1p) \
  || die "apt-get download $PACKAGE failed (no package lists? run 'apt-get update' as root, then rerun 'make bins')."
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp" ./usr/bin/prometheus ./usr/bin/promtool \
  || die "usr/bin/prometheus or usr/bin/promtool not found in $deb"
for tool in prometheus promtool; do
  install -m 0755 "$tmp/usr/bin/$tool" "$BIN/$tool.tmp.$$"
  mv "$BIN/$tool.tmp.$$" "$BIN/$tool"
  log "$tool: $("$BIN/$tool" --version 2>&1 | sed -n 1p) from $(basename "$deb")"
done
