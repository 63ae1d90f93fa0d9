# Two commands do everything on a fresh Debian machine with Python 3.11:
#   make run    set up .venv, train the tiny default config as 8 local CPU processes (gloo)
#   make test   set up .venv, bring up the local SLURM cluster (as root), run the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nanotrain-installed

.PHONY: run test test-full lint venv cluster-up cluster-down clean bench

venv: $(STAMP)

# torch==2.13.0 is the machine's local CPU wheel; any other torch request downloads gigabytes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $@

run: venv
	$(PY) submit.py configs/tiny_cpu.yaml --local

cluster-up:
	@if [ "$$(id -u)" = 0 ]; then slurm/local-cluster.sh up; \
	elif [ "$$CI" = true ]; then echo "make test: CI needs root to start the SLURM cluster" >&2; exit 1; \
	else echo "make test: not root, SLURM tests use an existing cluster or are skipped"; fi

cluster-down:
	slurm/local-cluster.sh down

# ruff (pyproject.toml): lint, import order and the formatter (`ruff format .` applies it);
# `make test` runs it first and fails on an error or an unformatted file.
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Two pytest-xdist workers (tests/conftest.py GroupScheduling keeps the SLURM tests, and the tests
# of the shared reference runs, each on one worker, and deals out the rest a module at a time);
# local ranks fork from one fork server (nanotrain/launch/forkserver.py). Measured 2026-12-02 on
# 2 cores, fresh clones: 2 workers 1975 s -> 1583 s with the fork server -> 995-1342 s (three
# runs) with module scopes and no `datasets` import in ranks (serial, before all three: 2070 s).
# PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 2
test: venv lint cluster-up
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n $(PYTEST_WORKERS) --no-loadscope-reorder -m "not full" $(PYTEST_ARGS)

# `make test` plus the larger grids marked `full` (the 8B- and 70B-shaped memory-estimate and
# traffic checks against --rehearse, tests/test_estimate_rehearsed.py).
test-full: venv lint cluster-up
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n $(PYTEST_WORKERS) --no-loadscope-reorder $(PYTEST_ARGS)

# nanotrain vs PyTorch-native parallelism, side by side (< 20 min on 2 cores; QUICK=1: < 4 min).
# Writes benchmarks/results/latest.json and latest.md and prints the table.
bench: venv
	$(PY) benchmarks/vs_native.py $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) build *.egg-info
