#!/usr/bin/env bash
# The pinned verl from PyPI in its own venv (.venv-verl) for tests/verl (`make test-verl`).
#
# verl 0.9.1's wheel is pure Python; its declared dependencies (ray[default], wandb, datasets,
# tensorboard, transformers, peft, accelerate, pandas, pyarrow, ...) are for running whole jobs.
# The modules tests/verl import (verl.protocol, verl.workers.engine_workers,
# verl.trainer.ppo.ray_trainer, verl.workers.utils.padding) need only the list below (measured:
# each package here is imported at module level by one of them), so verl is installed with
# --no-deps plus that list; torch is PyPI's (the CUDA build; its nvidia-* libraries are needed
# for `import torch` even on a CPU). The project itself and its agent/dev extras come from the
# main venv (.venv), layered in by a .pth file: no second copy.
#
# Usage: hack/verl-venv.sh VERL_VENV MAIN_VENV PYTHON. Idempotent (pip skips what is there).
set -euo pipefail
venv=${1:?verl venv}; main=${2:?main venv}; python=${3:-python3.11}
here=$(cd "$(dirname "$0")" && pwd)
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --no-deps 'verl==0.9.1'
"$venv/bin/python" -m pip install -q -r "$here/verl-requirements.txt"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
main_site=$(cd "$main" && "$PWD/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# After the verl venv's own site-packages: the main venv's (with its editable install's .pth).
echo "import site; site.addsitedir('$main_site')" > "$site/zz-rlenergy-main-venv.pth"
"$venv/bin/python" -W ignore -c 'import verl, verl.workers.engine_workers, verl.trainer.ppo.ray_trainer, verl.trainer.main_ppo, rlenergy_agent, rlenergy.sdk.verl_hook; print("verl", verl.__version__)'
