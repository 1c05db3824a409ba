# Quick start:  make demo   (set up + run the main job on the embedded sample data)
#               make test   (set up + run the whole test suite)
#               make test-quick   (the unit tests only: no multiprocess, Slurm or slow test; a few minutes)
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
# DeepSpeed's accelerator: CPU on a machine without an NVIDIA GPU; on a GPU node it is left to
# DeepSpeed (CUDA), so `make demo` there trains on the GPUs. The tests always run on the CPU.
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_GPU),)
export DS_ACCELERATOR ?= cpu
endif
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions

.PHONY: setup system-packages demo test test-quick lint bench accelerator
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
	DS_ACCELERATOR=cpu $(PY) -m pytest tests -n $(TEST_WORKERS) --dist load

# The quick tier, on one process: leaves out the tests marked multiprocess (gloo process groups),
# slurm (the Slurm daemons) and slow (trainings and subprocess pipelines: tests/conftest.py).
QUICK_MARKERS := not multiprocess and not slurm and not slow
test-quick: setup system-packages
	DS_ACCELERATOR=cpu $(PY) -m pytest tests -m "$(QUICK_MARKERS)" -q

LINT_PATHS := megatron_lev studies tests tools pretrain benchmarks
lint: setup
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

bench: setup
	$(PY) benchmarks/run_all.py

# what the targets above give DeepSpeed as its accelerator on this machine
accelerator:
	@echo "DS_ACCELERATOR=$${DS_ACCELERATOR:-unset (DeepSpeed chooses: CUDA on a GPU node)}"
