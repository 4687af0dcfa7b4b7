# Quick start: `make train` runs the main job, `make test` the tests. Each builds what it needs on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without CUDA take the CPU build of torch; a bare `torch` requirement pulls a multi-GB CUDA build.
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -r requirements.txt -r requirements-dev.txt
	touch $@

.PHONY: venv train test
venv: $(VENV)/.installed

train: $(VENV)/.installed
	bash runs/cpu.sh

test: $(VENV)/.installed
	$(PY) -m pytest -q
