# Quick start:  make demo   (set up + run the main job on the embedded sample data)
#               make test   (set up + run the whole test suite)
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= cpu
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions

.PHONY: setup system-packages demo test lint bench
setup:
	@VENV=$(VENV) scripts/setup_env.sh

# Slurm and a C compiler for the tests: installed when run as root, else one line says how.
system-packages:
	@if [ "$$(id -u)" = 0 ]; then .ci/install_system_packages.sh; else .ci/install_system_packages.sh || true; fi

demo: setup
	$(PY) -m megatron_lev demo

# Two pytest-xdist workers (CI has two cores), tests dealt out one by one.
TEST_WORKERS ?= 2
test: setup system-packages
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist load

LINT_PATHS := megatron_lev studies tests tools pretrain benchmarks
lint: setup
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

bench: setup
	$(PY) benchmarks/run_all.py
