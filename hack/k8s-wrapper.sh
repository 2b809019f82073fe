#!/usr/bin/env bash
# Sourced by hack/controlplane-bins.sh and hack/node-bins.sh: build k8s.io/kubernetes commands
# from the Go module proxy through a throw-away wrapper module.
#
#   k8s_build CMD...   builds k8s.io/kubernetes/cmd/CMD@$K8S_VERSION into $BIN/CMD (skips a CMD
#                      already there), version-stamped; needs K8S_VERSION, BIN, ROOT, log, die.
#                      A CMD written NAME=PATH builds k8s.io/kubernetes/PATH into $BIN/NAME (a
#                      command outside cmd/, e.g. the DRA test driver); only cmd/ ones are checked
#                      with --version.
#
# Every `k8s.io/x => ./staging/src/k8s.io/x` replace of k/k's go.mod becomes
# `k8s.io/x => k8s.io/x <staging tag>`; the godebug settings of k/k's go.mod are copied.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-trimpath GO111MODULE=on

_k8s_path() { if [[ $1 == *=* ]]; then echo "${1#*=}"; else echo "cmd/$1"; fi; }

k8s_build() {
  local w staging minor kgomod ldf now c pkgs=()
  command -v go >/dev/null || die "Go is not installed. Install Go >= 1.26 and rerun 'make bins'."
  staging=v0.${K8S_VERSION#v1.}; minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  for c in "$@"; do pkgs+=("k8s.io/kubernetes/$(_k8s_path "$c")@$K8S_VERSION"); done
  log "k8s: wrapper module for k8s.io/kubernetes@$K8S_VERSION (staging modules @ $staging): $*"
  w=$(mktemp -d "${TMPDIR:-/tmp}/rlenergy-k8sbins.XXXXXX")
  (
    set -e
    cd "$w"
    go mod init rlenergy.local/k8sbins >/dev/null 2>&1
    kgomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
             | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    python3 - "$kgomod" "$staging" >edits.sh <<'PY'
import re, shlex, sys
text = open(sys.argv[1]).read()
staging = sys.argv[2]
mods = sorted(set(re.findall(r"^\s*(k8s\.io/[A-Za-z0-9._-]+)\s+=>\s+\./staging/", text, re.M)))
if not mods:
    sys.exit("no staging replaces found in k/k go.mod")
for m in mods:
    print(f"go mod edit -replace={shlex.quote(m + '=' + m + '@' + staging)}")
gd = re.findall(r"^godebug\s+([^\s(][^\n]*)$", text, re.M)
for block in re.findall(r"^godebug\s*\((.*?)^\)", text, re.M | re.S):
    gd += [ln.split("//")[0].strip() for ln in block.splitlines() if ln.split("//")[0].strip()]
for g in gd:
    print(f"go mod edit -godebug={shlex.quote(g.strip())}")
print(f"# {len(mods)} staging modules", file=sys.stderr)
PY
    bash edits.sh
    go get "${pkgs[@]}"
    now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    ldf="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ldf+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
      ldf+=" -X $p.gitTreeState=clean -X $p.buildDate=$now"
    done
    for c in "$@"; do
      local name=${c%%=*}
      [[ -x $BIN/$name ]] && continue
      log "k8s: go build $name"
      local t0=$SECONDS
      nice -n 10 go build -mod=mod -ldflags "$ldf" -o "$BIN/$name.tmp" "k8s.io/kubernetes/$(_k8s_path "$c")"
      mv "$BIN/$name.tmp" "$BIN/$name"
      log "k8s: $name built in $((SECONDS - t0)) s"
      echo "$name $((SECONDS - t0))" >>"$ROOT/build-times.txt"
    done
  ) || die "building $* of k8s $K8S_VERSION failed (see above; wrapper kept in $w). As a fallback try: K8S_VERSION=v1.35.4 make bins"
  rm -rf "$w"
  for c in "$@"; do
    [[ $c == *=* ]] && continue
    local got; got=$("$BIN/$c" --version)
    [[ $got == "Kubernetes $K8S_VERSION" ]] || die "$c --version says '$got', expected 'Kubernetes $K8S_VERSION' (version stamping failed)"
  done
}
