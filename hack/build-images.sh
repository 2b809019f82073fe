#!/usr/bin/env bash
# Build the operator and node-agent OCI image archives without a container engine.
# Installs the Debian tools it needs when they are missing (mmdebstrap, umoci, skopeo), then runs
# hack/images/build.py with the given arguments (default: build both images into build/images/).
# Needs root: mmdebstrap --mode=root, chroot and file ownership in the image.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if [[ $EUID -ne 0 ]]; then
  echo "hack/build-images.sh: run as root (mmdebstrap --mode=root, chroot)" >&2
  exit 2
fi
missing=()
for tool in mmdebstrap umoci skopeo; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  echo "hack/build-images.sh: installing ${missing[*]} from Debian's archive" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
exec "$PYTHON" hack/images/build.py "$@"
