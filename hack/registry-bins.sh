#!/usr/bin/env bash
# Build the dev cluster's OCI registry and its push client from the Go module proxy; called by
# `make bins` after hack/node-bins.sh (docs/dev-cluster.md "Registry").
#
#   registry   CNCF Distribution, github.com/distribution/distribution/v3/cmd/registry@$DISTRIBUTION_VERSION
#              (the registry of Docker Hub's `registry` image, the one kind's and k3d's local-registry
#              guides run); the dev cluster starts it on 127.0.0.1:<free port>, plain HTTP,
#              filesystem storage in its workdir (rlenergy_dev/devcluster/registry.py)
#   crane      github.com/google/go-containerregistry/cmd/crane@$CRANE_VERSION: pushes the OCI image
#              layouts `make images` writes (`crane push <layout> <ref>`)
#
# Idempotent: a binary whose version matches is kept (a rerun takes about a second).
# Cache: ${RLENERGY_CACHE:-$HOME/.cache/rl-energy}/k8s-<version>/bin
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
DISTRIBUTION_VERSION=${DISTRIBUTION_VERSION:-v3.1.2}
CRANE_VERSION=${CRANE_VERSION:-v0.22.1}
DISTRIBUTION_MODULE=github.com/distribution/distribution/v3
CRANE_MODULE=github.com/google/go-containerregistry
CACHE=${RLENERGY_CACHE:-$HOME/.cache/rl-energy}
ROOT=$CACHE/k8s-$K8S_VERSION
BIN=${K8S_BIN_DIR:-$ROOT/bin}

log() { printf '[registry-bins %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[registry-bins] ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$BIN"
T0=$SECONDS

# go_install NAME PACKAGE@VERSION LDFLAGS: build one command into $BIN/NAME, timed.
go_install() {
  local name=$1 pkg=$2 ldflags=$3 tmp t0=$SECONDS
  command -v go >/dev/null || die "Go is not installed. Install Go >= 1.26 and rerun 'make bins'."
  log "go install $pkg"
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/rlenergy-$name.XXXXXX")
  GOTOOLCHAIN=local GOFLAGS=-trimpath CGO_ENABLED=0 GOBIN=$tmp \
    nice -n 10 go install -ldflags "-s -w $ldflags" "$pkg" || die "go install $pkg failed"
  mv "$tmp/$(basename "${pkg%@*}")" "$BIN/$name"
  rm -rf "$tmp"
  log "$name built in $((SECONDS - t0)) s"
  echo "$name $((SECONDS - t0))" >>"$ROOT/build-times.txt"
}

registry_version() { "$BIN/registry" --version 2>/dev/null | awk '{print $3}'; }
if [[ ! -x $BIN/registry || $(registry_version) != "$DISTRIBUTION_VERSION" ]]; then
  go_install registry "$DISTRIBUTION_MODULE/cmd/registry@$DISTRIBUTION_VERSION" \
    "-X $DISTRIBUTION_MODULE/version.version=$DISTRIBUTION_VERSION -X $DISTRIBUTION_MODULE/version.mainpkg=$DISTRIBUTION_MODULE"
fi
[[ $(registry_version) == "$DISTRIBUTION_VERSION" ]] \
  || die "$BIN/registry --version does not say $DISTRIBUTION_VERSION; delete it and rerun 'make bins'"
log "registry: $("$BIN/registry" --version)"

crane_version() { "$BIN/crane" version 2>/dev/null; }
if [[ ! -x $BIN/crane || $(crane_version) != "$CRANE_VERSION" ]]; then
  go_install crane "$CRANE_MODULE/cmd/crane@$CRANE_VERSION" \
    "-X $CRANE_MODULE/cmd/crane/cmd.Version=$CRANE_VERSION"
fi
[[ $(crane_version) == "$CRANE_VERSION" ]] \
  || die "$BIN/crane version does not say $CRANE_VERSION; delete it and rerun 'make bins'"
log "crane: $(crane_version)"

cat >"$ROOT/registry-versions.env" <<V
DISTRIBUTION=$("$BIN/registry" --version)
CRANE=$(crane_version)
V
log "registry binaries ready (this run $((SECONDS - T0)) s)"
