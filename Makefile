# cachefleet — the two entry points of the README: `make demo` and `make test`.
# Both create .venv/ (editable install) and install Debian's redis-server,
# prometheus, nginx and wrk when they are missing.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEBS    := redis-server:redis-server prometheus:prometheus promtool:prometheus nginx:nginx-light wrk:wrk

.PHONY: demo test lint unit integration bench crds deps venv clean image

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

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,demo]'
	@touch $(STAMP)

venv: $(STAMP)

demo: deps venv
	$(BIN)/cachefleet demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy operator/cachefleet_operator sidecar/cachefleet_sidecar e2e/cachefleet_e2e router/cachefleet_router
	$(BIN)/lint-imports

crds: venv
	$(BIN)/cachefleet crds

test: deps venv lint
	$(BIN)/pytest -q

# The container image, tagged localhost/cachefleet:<version> (IMAGE=... to change) in the
# local store of docker, podman or buildah, whichever is here (buildah and mmdebstrap are
# installed with apt when none is); BASE=... picks the base image. See scripts/build-image.sh.
image: venv
	./scripts/build-image.sh

bench: deps venv
	$(BIN)/cachefleet bench all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
