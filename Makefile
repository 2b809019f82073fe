# rl-energy-operator developer entry points.
# The two set-up commands for a fresh machine are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TRACE ?= verl-gpg-qwen2-7b-fsdp-8gpu
GPU ?= h100-sxm
MODE ?= sync
MUTATION_JOBS ?= 2

.PHONY: help demo demo-sim test lint unit e2e bins bench-energy bench-rollout bench-agent crds docs clean venv
.PHONY: images images-lock test-images
.PHONY: bench-scale test-chaos test-field test-privilege mutation test-realnode
.PHONY: bench-peers bench-phases test-peers engine-wheels venv-verl test-verl

## Every target with what it does (the `##` comments above the targets in this Makefile).
help:
	@awk '/^## /{doc = doc substr($$0, 4) "\n"; next} \
	  /^[a-z][a-z0-9-]*:/ && doc != "" {split($$1, t, ":"); n = split(doc, l, "\n"); \
	    printf "make %-15s %s\n", t[1], l[1]; for (i = 2; i < n; i++) printf "%-20s %s\n", "", l[i]} \
	  !/^## / && !/^(ifeq|else|endif)/{doc = ""}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,operator,agent]'
	@touch $@

## The project's venv (.venv: the package editable with its dev, operator and agent extras).
venv: $(STAMP)

VERL_VENV ?= .venv-verl
VERL_STAMP := $(VERL_VENV)/.verl-stamp
$(VERL_STAMP): $(STAMP) hack/verl-venv.sh hack/verl-requirements.txt
	bash hack/verl-venv.sh $(VERL_VENV) $(VENV) $(PYTHON)
	@touch $@

## The pinned verl (PyPI verl==0.9.1, --no-deps + the packages its imported modules need, PyPI's
## torch) in its own venv layered over .venv (hack/verl-venv.sh); cached: rebuilt only when the
## list changes.
venv-verl: $(VERL_STAMP)

## The verl integration's tests alone (tests/verl, in .venv-verl; also in `make test`): the hook
## through verl's real classes, valid tokens from a real DataProto, the docs' one setting.
test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest -q tests/verl

## The full stack on this machine (no GPU, no Docker): dev cluster + helm install + operator and
## 3 node agents on the stand-in NVML + a verl trace through the SDK; `make demo SIM_ONLY=1` or
## `make demo-sim` runs only the embedded simulator.
ifeq ($(SIM_ONLY),1)
demo: demo-sim
else
demo: $(STAMP) $(VERL_STAMP)
	@mkdir -p out
	$(PY) -m rlenergy_dev.demo --trace $(TRACE) --plot out/demo.png
endif

## The main job on the embedded simulator only (no cluster, no GPU).
demo-sim: $(STAMP)
	@mkdir -p out
	$(VENV)/bin/rlenergy simulate --trace $(TRACE) --gpu $(GPU) --mode $(MODE) --plot out/demo-sim.png

## Control-plane binaries (etcd, kube-apiserver, KCM, scheduler, kwok, helm) into ~/.cache/rl-energy,
## Debian's prometheus (apt-get download; for the Prometheus e2e test) and the KubeRay operator
## (Go module proxy; for the RayJob e2e test) into the same bin dir, the real node's kubelet,
## containerd + runc (apt, root) and pause image (hack/node-bins.sh), and the dev cluster's OCI
## registry (Distribution) and crane (hack/registry-bins.sh), and NVIDIA's device plugin for the real
## node (hack/device-plugin-bin.sh), and Kubernetes' DRA test driver (hack/dra-driver-bin.sh).
bins:
	bash hack/controlplane-bins.sh
	bash hack/prometheus-bin.sh
	bash hack/kuberay-bin.sh
	bash hack/node-bins.sh
	bash hack/registry-bins.sh
	bash hack/device-plugin-bin.sh
	bash hack/dra-driver-bin.sh

## The pinned vLLM / SGLang wheels (pyproject [tool.rlenergy.engines]) for the adapter source
## checks; cached, never installed (hack/engine-wheels.sh).
engine-wheels: $(STAMP)
	bash hack/engine-wheels.sh $(PY)

## Ruff, mypy (strict), import-linter contracts and the docs site (mkdocs build --strict).
lint: $(STAMP)
	$(VENV)/bin/ruff check rlenergy operator agent dev tests bench hack
	$(VENV)/bin/ruff format --check rlenergy operator agent dev tests bench hack
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

## The full test suite: lint, unit, end-to-end against the real control plane, then the chaos
## suite (tests/chaos: its own dev cluster, fault injection; also alone as `make test-chaos`).
test: $(STAMP) $(VERL_STAMP) bins images engine-wheels lint
	$(PY) -m pytest -q
	$(VERL_VENV)/bin/python -m pytest -q tests/verl
	$(PY) -m pytest -q -m chaos tests/chaos

## The tests that need no control-plane binaries (pytest -m 'not e2e').
unit: $(STAMP) engine-wheels
	$(PY) -m pytest -q -m 'not e2e'

## EE-RL vs the default governor, the oracle and the oracle held at the controller's margin,
## at 200 and 1,000 steps, both physics families, seeds 0-2 (bench/energy.py).
bench-energy: $(STAMP)
	$(PY) bench/energy.py

## What naming verl's training sub-phases as phases adds, and an idle-gap lock at the lowest
## clock, on the traces that log sub-phase times (bench/phases.py; sync, both families, seed 0).
bench-phases: $(STAMP)
	$(PY) bench/phases.py

PEERS_STAMP := $(VENV)/.peers-stamp
$(PEERS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[dev,operator,agent,peers]'
	@touch $@

## EE-RL beside Zeus's power-limit optimizer, a static-clock sweep and hindsight bounds
## (bench/peers.py; installs the `peers` extra, real zeus from PyPI, into the venv once).
bench-peers: $(PEERS_STAMP)
	$(PY) bench/peers.py

## The Zeus peer's tests on the simulator (tests/peers; the `peers` extra, as bench-peers).
test-peers: $(PEERS_STAMP)
	$(PY) -m pytest -q -m peers tests/peers

## FlexFloor MoE rollout: verl-style baseline vs FlexFloor on every shipped trace.
bench-rollout: $(STAMP)
	$(PY) bench/rollout.py

## Node agent on the stand-in NVML (gcc builds it into build/) with the real caller check (TokenReview
## against a dev cluster started by the bench): signal->clock latency, RSS, energy error.
bench-agent: $(STAMP) bins
	$(PY) bench/agent.py

## Operator at scale: 250 and 1,000 KWOK GPU nodes x 8 GPUs, 20 policies, simulated agents
## (RSS, status lag, API requests/s, conflicts; docs/scale-and-chaos.md). ~15 min on 2 cores.
bench-scale: $(STAMP) bins
	$(PY) bench/scale.py

## The field tests alone (marker `field`; they run in `make test` too): promtool on the
## agent's metrics and the chart's alerts, the Prometheus e2e, the chart for real clusters.
test-field: $(STAMP) bins
	$(PY) -m pytest -q -m field

## Least privilege on the real API server alone (tests/e2e/test_privilege.py; also in `make test`):
## node-scoped report writes with pod-bound tokens, the RBAC matrix, no confused deputy, the
## namespaced install.
test-privilege: $(STAMP) bins
	$(PY) -m pytest -q tests/e2e/test_privilege.py

## Mutation testing of the core with mutmut (hack/mutation.py; docs/mutation.md): each module
## against its unit tests, in build/mutation/; MUTATION_MODULES=... MUTATION_JOBS=2. Slow (an hour
## or more on 2 cores): not part of `make test`.
mutation: $(STAMP)
	$(PY) hack/mutation.py run --jobs $(MUTATION_JOBS) $(MUTATION_MODULES)

## The real-node e2e tests alone (tests/e2e/test_real_node.py, and test_runbook.py: install.md's
## runbook as written, smoke test and uninstall; test_restricted_trainer.py: a Pod Security
## restricted trainer pod on a bridge pod network in the test's own network namespace): the chart
## with the real images on a real kubelet + containerd node, fake GPUs from the device plugin
## (docs/dev-cluster.md). Root.
test-realnode: $(STAMP) $(VERL_STAMP) bins images
	$(PY) -m pytest -q -m realnode tests/e2e/test_real_node.py tests/e2e/test_real_node_day_two.py \
		tests/e2e/test_runbook.py tests/e2e/test_restricted_trainer.py

## Chaos tests (tests/chaos): API server/etcd restarts, operator/agent kills, NVML faults.
test-chaos: $(STAMP) bins
	$(PY) -m pytest -q -m chaos tests/chaos

## OCI image archives of the operator and the node agent, no container engine (docs/images.md):
## build/images/rl-energy-{operator,agent}.oci.tar; cached, reproducible; needs root. FORCE=1 rebuilds.
images: $(STAMP)
	PYTHON=$(PY) bash hack/build-images.sh build

## Re-pin the images' dependencies (hack/images/requirements-*.txt) from PyPI.
images-lock: $(STAMP)
	PYTHON=$(PY) bash hack/build-images.sh lock

## Smoke test of the image archives in a chroot (not part of `make test`: the build takes minutes).
test-images: images
	$(PY) -m pytest -q -m images tests/images

## The generated CRDs (crds/, copied into helm/rl-energy/crds/) and their reference page
## (docs/reference/crds.md) from rlenergy.api (rlenergy.api.crdgen).
crds: $(STAMP)
	$(PY) -m rlenergy.api.crdgen
	cp crds/*.yaml helm/rl-energy/crds/

## The generated reference pages: CRDs, chart values and metrics (hack/docgen.py).
docs: crds
	$(PY) hack/docgen.py

## The tests marked e2e alone: those that need the control-plane binaries (also in `make test`).
e2e: $(STAMP) bins
	$(PY) -m pytest -q -m e2e

## Remove the venvs, out/ and the tool caches (not the binaries in ~/.cache/rl-energy).
clean:
	rm -rf $(VENV) $(VERL_VENV) out .mypy_cache .ruff_cache .pytest_cache
