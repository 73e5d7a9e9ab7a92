# Set-up is part of every target: a fresh machine needs only Python 3.11, pip and gcc.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.grstack-installed
# The CPU build of torch; a bare "torch" requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# -P: never put the working directory on sys.path, where the repo's operator/ would shadow the stdlib module.
PYP := $(PY) -P

.PHONY: setup demo test lint bench-kernels bench-quality clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PYP) -m pip install --quiet --upgrade pip
	$(PYP) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYP) -m pip install --quiet -e ".[test,serve,operator]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/grstack demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PYP) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench-kernels: $(STAMP)
	$(VENV)/bin/grstack bench kernels --quick --json

clean:
	rm -rf $(VENV) runs .pytest_cache
