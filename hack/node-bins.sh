#!/usr/bin/env bash
# Build/install what the dev cluster's one *real* node needs (`python -m rlenergy_dev.devcluster up --real-node`,
# docs/dev-cluster.md "Real node"); called by `make bins` after hack/controlplane-bins.sh.
#
#   kubelet           k8s.io/kubernetes/cmd/kubelet@$K8S_VERSION from the Go module proxy, through
#                     the same wrapper module as the control plane (hack/k8s-wrapper.sh), its own
#                     cached step: an existing $BIN/kubelet is kept
#   nvidia-container-runtime
#                     NVIDIA Container Toolkit's OCI runtime, ...cmd/nvidia-container-runtime@$NCT_VERSION
#                     from the Go module proxy (cgo: it dlopens libcuda/libnvidia-ml through
#                     go-nvml), cached like the kubelet; the real node's containerd runs it as
#                     the runtime handler `nvidia` in CDI mode (rlenergy/devcluster/realnode.py)
#   containerd        github.com/containerd/containerd/v2 cmd/{containerd,containerd-shim-runc-v2,ctr}
#                     @$CONTAINERD_VERSION from the Go module proxy (CGO_ENABLED=0, so without the
#                     btrfs/devmapper/zfs snapshotters; overlayfs is used), version-stamped as
#                     containerd's Makefile does, cached like the kubelet
#   runc              Debian's package (apt-get install, root), plus containernetworking-plugins
#                     (the CNI `loopback` binary the CRI plugin calls for every pod sandbox)
#   pause image       a static C binary (hack/images/pause.c, gcc -static) packed as an OCI archive
#                     by hack/images/pause.py into $BIN/../images/pause.oci.tar (no registry)
#
# Idempotent: whatever is already there is skipped (a rerun takes about a second).
# Cache: ${RLENERGY_CACHE:-$HOME/.cache/rl-energy}/k8s-<version>/{bin,images}
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
NCT_VERSION=${NCT_VERSION:-v1.20.2}
CONTAINERD_VERSION=${CONTAINERD_VERSION:-v2.4.2}
CONTAINERD_MODULE=github.com/containerd/containerd/v2
CONTAINERD_CMDS=(containerd containerd-shim-runc-v2 ctr)
NCT_MODULE=github.com/NVIDIA/nvidia-container-toolkit
CACHE=${RLENERGY_CACHE:-$HOME/.cache/rl-energy}
ROOT=$CACHE/k8s-$K8S_VERSION
BIN=${K8S_BIN_DIR:-$ROOT/bin}
IMAGES=$(dirname "$BIN")/images
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NODE_DEBS=(runc containernetworking-plugins)

log() { printf '[node-bins %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[node-bins] ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$BIN" "$IMAGES"
T0=$SECONDS

# ---------------------------------------------------------------- runc + CNI plugins (Debian)
runtime_ok() { command -v runc >/dev/null && [[ -x /usr/lib/cni/loopback ]]; }
if ! runtime_ok; then
  [[ $(id -u) == 0 ]] || die "runc/containernetworking-plugins are not installed and this is not root: run 'sudo apt-get install ${NODE_DEBS[*]}' (or 'make bins' as root)."
  command -v apt-get >/dev/null || die "apt-get not found: install runc and the CNI plugins (loopback in /usr/lib/cni) with your OS's packages."
  log "apt-get install ${NODE_DEBS[*]}"
  t0=$SECONDS
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${NODE_DEBS[@]}" >/dev/null; then
    log "apt-get update, then retry"
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${NODE_DEBS[@]}" >/dev/null
  fi
  runtime_ok || die "runc or /usr/lib/cni/loopback still missing after apt-get install ${NODE_DEBS[*]}"
  log "runtime installed in $((SECONDS - t0)) s"
  echo "node-runtime-apt $((SECONDS - t0))" >>"$ROOT/build-times.txt"
fi
log "$(runc --version | sed -n 1p)"

# ---------------------------------------------------------------- containerd 2.x (Go module proxy)
ctd_version() { "$BIN/containerd" --version 2>/dev/null | awk '{print $3}'; }
ctd_ok() {
  local c
  for c in "${CONTAINERD_CMDS[@]}"; do [[ -x $BIN/$c ]] || return 1; done
  [[ $(ctd_version) == "${CONTAINERD_VERSION#v}" ]]
}
if ! ctd_ok; then
  command -v go >/dev/null || die "Go is not installed. Install Go >= 1.26 and rerun 'make bins'."
  pkgs=()
  for c in "${CONTAINERD_CMDS[@]}"; do pkgs+=("$CONTAINERD_MODULE/cmd/$c@$CONTAINERD_VERSION"); done
  log "go install ${pkgs[*]}"
  t0=$SECONDS
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/rlenergy-containerd.XXXXXX")
  GOTOOLCHAIN=local GOFLAGS=-trimpath CGO_ENABLED=0 GOBIN=$tmp \
    go install -tags "urfave_cli_no_docs no_btrfs no_devmapper no_zfs" \
    -ldflags "-s -w -X $CONTAINERD_MODULE/version.Version=${CONTAINERD_VERSION#v} -X $CONTAINERD_MODULE/version.Package=$CONTAINERD_MODULE" \
    "${pkgs[@]}" || die "go install of containerd $CONTAINERD_VERSION failed"
  for c in "${CONTAINERD_CMDS[@]}"; do mv "$tmp/$c" "$BIN/$c"; done
  rm -rf "$tmp"
  log "containerd built in $((SECONDS - t0)) s"
  echo "containerd $((SECONDS - t0))" >>"$ROOT/build-times.txt"
fi
ctd_ok || die "$BIN/containerd --version does not say ${CONTAINERD_VERSION#v}; delete $BIN/containerd and rerun 'make bins'"
log "$("$BIN/containerd" --version)"

# ---------------------------------------------------------------- kubelet (Go module proxy)
if [[ ! -x $BIN/kubelet ]]; then
  # shellcheck source=hack/k8s-wrapper.sh
  source "$REPO/hack/k8s-wrapper.sh"
  k8s_build kubelet
fi
got=$("$BIN/kubelet" --version)
[[ $got == "Kubernetes $K8S_VERSION" ]] || die "kubelet --version says '$got', expected 'Kubernetes $K8S_VERSION'; delete $BIN/kubelet and rerun 'make bins'"
log "kubelet: $got"

# ---------------------------------------------------------------- NVIDIA Container Toolkit runtime
nct_version() { "$BIN/nvidia-container-runtime" --version 2>/dev/null | sed -n 's/^NVIDIA Container Runtime version //p'; }
if [[ ! -x $BIN/nvidia-container-runtime || $(nct_version) != "${NCT_VERSION#v}" ]]; then
  command -v go >/dev/null || die "Go is not installed. Install Go >= 1.26 and rerun 'make bins'."
  command -v gcc >/dev/null || die "gcc not found (nvidia-container-runtime needs cgo): apt-get install gcc libc6-dev"
  log "go install $NCT_MODULE/cmd/nvidia-container-runtime@$NCT_VERSION"
  t0=$SECONDS
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/rlenergy-nct.XXXXXX")
  GOTOOLCHAIN=local GOFLAGS=-trimpath CGO_ENABLED=1 GOBIN=$tmp \
    go install -ldflags "-s -w -X $NCT_MODULE/internal/info.version=${NCT_VERSION#v}" \
    "$NCT_MODULE/cmd/nvidia-container-runtime@$NCT_VERSION" \
    || die "go install $NCT_MODULE/cmd/nvidia-container-runtime@$NCT_VERSION failed"
  mv "$tmp/nvidia-container-runtime" "$BIN/nvidia-container-runtime"
  rm -rf "$tmp"
  log "nvidia-container-runtime built in $((SECONDS - t0)) s"
  echo "nvidia-container-runtime $((SECONDS - t0))" >>"$ROOT/build-times.txt"
fi
[[ $(nct_version) == "${NCT_VERSION#v}" ]] || die "$BIN/nvidia-container-runtime --version does not say ${NCT_VERSION#v}; delete it and rerun 'make bins'"
log "nvidia-container-runtime: $(nct_version)"

# ---------------------------------------------------------------- pause image (local, no registry)
if [[ ! -f $IMAGES/pause.oci.tar || $REPO/hack/images/pause.c -nt $IMAGES/pause.oci.tar \
      || $REPO/hack/images/pause.py -nt $IMAGES/pause.oci.tar ]]; then
  command -v gcc >/dev/null || die "gcc not found (builds the static pause binary): apt-get install gcc libc6-dev"
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/rlenergy-pause.XXXXXX")
  gcc -static -Os -Wall -Werror -o "$tmp/pause" "$REPO/hack/images/pause.c" \
    || die "gcc -static failed (needs libc6-dev's libc.a)"
  strip "$tmp/pause"
  python3 "$REPO/hack/images/pause.py" "$tmp/pause" "$IMAGES/pause.oci.tar.tmp"
  mv "$IMAGES/pause.oci.tar.tmp" "$IMAGES/pause.oci.tar"
  rm -rf "$tmp"
  log "pause image: $IMAGES/pause.oci.tar ($(stat -c %s "$IMAGES/pause.oci.tar") bytes)"
fi

cat >"$ROOT/node-versions.env" <<V
KUBELET=$("$BIN/kubelet" --version)
CONTAINERD=$("$BIN/containerd" --version)
RUNC=$(runc --version | sed -n 1p)
NVIDIA_CONTAINER_RUNTIME=$(nct_version)
CNI_PLUGINS=$(dpkg-query -W -f '${Version}' containernetworking-plugins 2>/dev/null || echo unknown)
V
log "node binaries ready (this run $((SECONDS - T0)) s)"
