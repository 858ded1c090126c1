# servelm: two commands do all set-up on a fresh machine.
#   make serve   create .venv, install, prepare the default model, serve it on 127.0.0.1:8000
#   make test    create .venv, install with test extras, run the fast test suite

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch; pip takes it from a local wheel cache where one exists, else from PyPI.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?= -m "not slow"

.PHONY: install install-test serve test test-all lint fmt bench clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	touch $@

$(VENV)/.torch: $(VENV)/.created
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q torch
	touch $@

install: $(VENV)/.torch
	$(PIP) install -q -e .

install-test: $(VENV)/.torch
	$(PIP) install -q -e ".[test]"

serve: install
	$(VENV)/bin/servelm fetch
	$(PY) -m servelm.kernels.build
	$(VENV)/bin/servelm serve --host $(HOST) --port $(PORT)

test: install-test
	$(VENV)/bin/servelm fetch
	sh deploy/tools/install-prometheus.sh
	bash deploy/tools/install-helm.sh
	sh deploy/tools/install-chromium.sh
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-all:
	$(MAKE) test PYTEST_ARGS=""

lint: install-test
	$(VENV)/bin/ruff check servelm tests benchmarks

fmt: install-test
	$(VENV)/bin/ruff format servelm tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
