# Set-up is part of every target: a fresh machine needs only Python 3.11, pip and gcc.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.grstack-installed
# The CPU build of torch; a bare "torch" requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# TorchRec for the embedding comparison in `grstack bench train` and its tests (fbgemm's CPU build; --no-deps
# because TorchRec names the CUDA fbgemm package, which the CPU build replaces).
TORCHREC_SPEC ?= torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 tensordict==0.15.3 torchmetrics==1.0.3 \
	pyre-extensions==0.0.32 typing-inspect==0.9.0 mypy-extensions==1.1.0
# -P: never put the working directory on sys.path, where the repo's operator/ would shadow the stdlib module.
PYP := $(PY) -P

.PHONY: setup demo test test-unit lint bench-kernels bench-quality clean image

# Images (the Dockerfile's targets). The repository and version have one source: the chart
# (charts/grstack/values.yaml image.repository, Chart.yaml appVersion); tags are VERSION-TARGET.
IMAGE_REPOSITORY ?= $(shell sed -n 's/^  repository: *//p' charts/grstack/values.yaml | head -n 1)
IMAGE_VERSION ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}/\1/p' charts/grstack/Chart.yaml)
IMAGE_TARGETS ?= cpu cuda ascend operator
# docker, podman or buildah; empty = the first of them found on PATH.
IMAGE_BUILDER ?=
PUSH ?= 0

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PYP) -m pip install --quiet --upgrade pip
	$(PYP) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYP) -m pip install --quiet -e ".[test,all]"
	$(PYP) -m pip install --quiet --no-deps $(TORCHREC_SPEC)
	$(PYP) -m pip install --quiet cloudpickle pyvers==0.2.3
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/grstack demo

# Every test (unit, integration, e2e; see tests/conftest.py), after the linters; -rs lists each skip and why.
test: lint
	$(PYP) -m pytest -q -rs

# The fast layer only: in-process tests (under 2 minutes on 2 cores).
test-unit: $(STAMP)
	$(PYP) -m pytest -q -rs -m unit

# The packages mypy checks ([tool.mypy] in pyproject.toml); the rest of grstack is read for types only.
MYPY_PACKAGES ?= grstack.operator grstack.runtime.serve grstack.runtime.data

# ruff, the import contracts in pyproject.toml ([tool.importlinter]), then mypy. import-linter and mypy cannot
# follow the editable install's package-dir mapping, so they read a plain (non-editable) install of a copy of
# the sources, built in a temporary directory that is removed afterwards (nothing is written into the repo;
# mypy's cache lives in the venv). mypy's paths (from this or, cached, an earlier build) are rewritten back to
# the repository's files.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && mkdir "$$tmp/src" && \
	tar -c --exclude=__pycache__ pyproject.toml setup.py README.md LICENSE operator runtime kernels configs \
	    | tar -x -C "$$tmp/src" && \
	if ! $(PYP) -m pip install --quiet --no-deps --no-build-isolation --no-compile --target "$$tmp/site" \
	    "$$tmp/src" >"$$tmp/pip.log" 2>&1; then cat "$$tmp/pip.log"; exit 1; fi && \
	PYTHONPATH="$$tmp/site" $(VENV)/bin/lint-imports --no-cache --no-logo pyproject.toml || exit $$?; \
	rc=0; MYPYPATH="$$tmp/site" $(VENV)/bin/mypy --config-file pyproject.toml --cache-dir $(VENV)/.mypy_cache \
	    $(foreach p,$(MYPY_PACKAGES),-p $(p)) >"$$tmp/mypy.log" 2>&1 || rc=$$?; \
	sed -E 's#^[^:]*/site/grstack/##' "$$tmp/mypy.log"; exit $$rc

bench-kernels: $(STAMP)
	$(VENV)/bin/grstack bench kernels --quick --json

# Builds every IMAGE_TARGETS image as IMAGE_REPOSITORY:IMAGE_VERSION-TARGET (PUSH=1 pushes them too).
image:
	@builder="$(IMAGE_BUILDER)"; \
	if [ -z "$$builder" ]; then \
	  for b in docker podman buildah; do if command -v $$b >/dev/null 2>&1; then builder=$$b; break; fi; done; \
	fi; \
	if [ -z "$$builder" ] || ! command -v "$$builder" >/dev/null 2>&1; then \
	  echo "error: make image needs a container builder: none of docker, podman or buildah is on PATH$${builder:+ ($$builder not found)}." >&2; \
	  echo "Install one, or set IMAGE_BUILDER=/path/to/docker|podman|buildah." >&2; \
	  exit 2; \
	fi; \
	case "$$(basename $$builder)" in buildah) build="$$builder bud";; *) build="$$builder build";; esac; \
	for target in $(IMAGE_TARGETS); do \
	  tag="$(IMAGE_REPOSITORY):$(IMAGE_VERSION)-$$target"; \
	  echo "$$build --target $$target -t $$tag ."; \
	  $$build --target $$target -t "$$tag" . || exit 1; \
	  if [ "$(PUSH)" = 1 ]; then $$builder push "$$tag" || exit 1; fi; \
	done

clean:
	rm -rf $(VENV) runs .pytest_cache
