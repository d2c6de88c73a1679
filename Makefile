# moeexp Makefile. `make help` lists the targets.
# TORCH=keep : use the torch already installed (e.g. a CUDA build): the venv sees system
#              site-packages and torch is left out of the pins, so pip never replaces it.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH ?= pin
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moeexp-installed
CONSTRAINTS := requirements/constraints.txt
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false
# The embedded model is tiny: one intra-op thread is faster than several and avoids OpenMP
# spinning on shared CPUs (17x slower with 2 threads on a loaded 2-core machine). Override
# with `make run OMP_NUM_THREADS=8` on a big idle machine or for real models.
THREADS ?= 1
# `make test` and `make test-slow` run across this many processes (pytest-xdist): `auto` =
# one per core. TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= auto
# `make run` runs its sweep's jobs across this many processes (hydra/launcher=local: joblib,
# one torch thread each; the trace cache is shared and locked, so concurrent jobs record
# each prompt sample once). 3 = one per prompt sample of the default sweep: its three
# traces are recorded at once (on 2 cores too: recording is most of the run, and the third
# process keeps both cores busy). RUN_JOBS=1 runs them one after another in one process.
RUN_JOBS ?= 3

.DEFAULT_GOAL := help
.PHONY: help install run test test-slow bench bench-gpu lint tiny-model figures clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  \033[36m%-12s\033[0m %s\n",$$1,$$2}'

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@if [ "$(TORCH)" = "keep" ]; then \
	  [ -x $(PY) ] || $(PYTHON) -m venv --system-site-packages $(VENV); \
	  grep -v '^torch==' $(CONSTRAINTS) > $(VENV)/constraints.txt; \
	else \
	  [ -x $(PY) ] || $(PYTHON) -m venv $(VENV); \
	  cp $(CONSTRAINTS) $(VENV)/constraints.txt; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install the pinned stack + moeexp (editable); TORCH=keep keeps your torch

run: $(STAMP) ## the default comparison on the embedded defaults (tiny model, ShareGPT)
	OMP_NUM_THREADS=$(THREADS) $(PY) -m moeexp +experiment=finemoe_vs_moeinfinity \
	  $(if $(filter-out 1,$(RUN_JOBS)),hydra/launcher=local hydra.launcher.n_jobs=$(RUN_JOBS))

test: $(STAMP) ## the default test suite (CPU, offline; all but the `slow` end-to-end tests), across TEST_WORKERS processes (pytest-xdist; default: one per core)
	OMP_NUM_THREADS=$(THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=10 -m "not bench and not slow"

test-slow: $(STAMP) ## the `slow` end-to-end tests (the default experiment, the wheel, launchers, lm-eval's CLI, ...); CI runs them after `make test`
	OMP_NUM_THREADS=$(THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=10 -m "slow and not bench"

bench: $(STAMP) ## benchmarks: writes results/bench/*.json and prints a table
	OMP_NUM_THREADS=$(THREADS) $(PY) -m moeexp.bench

bench-gpu: $(STAMP) ## CUDA checks in one pass: GPU tests, sim_vs_engine on CUDA, engine benchmarks (outputs in GPU_CHECK_DIR=dir or results/gpu_check/<time>)
	PY=$(PY) bash scripts/gpu_check.sh

.PHONY: bench-real-scale
bench-real-scale: $(STAMP) ## issue 15 on a GPU (<=10 min, H200): random-weight gpt-oss-20b driven by the real trace's routing, engine vs simulator (REAL_SCALE_DIR=dir or results/real_scale/<time>; DRY_RUN=1: CPU check)
	OMP_NUM_THREADS=$(if $(DRY_RUN),$(THREADS),8) $(PY) -m moeexp.bench.real_scale $(if $(DRY_RUN),--dry-run) $(if $(REAL_SCALE_DIR),--out $(REAL_SCALE_DIR))

lint: $(STAMP) ## ruff + mypy on src/
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy src/moeexp

tiny-model: $(STAMP) ## retrain the embedded tiny model + tokenizer deterministically (~17 min on one idle core; 25 min measured on a loaded 2-core machine)
	$(PY) -m moeexp.models.tiny.train

figures: $(STAMP) ## paper figures from results/ into results/figures/; SWEEP=dir: the figures of that sweep (any --multirun) into dir/figures
	$(PY) -m moeexp.figures $(if $(SWEEP),--sweep $(SWEEP))

.PHONY: reproduction
reproduction: $(STAMP) ## FineMoE's claims vs ours: SWEEPS="sweep dirs" -> the table in experiments/README.md
	$(PY) -m moeexp.tracking.reproduction $(SWEEPS) --out experiments/README.md

clean: ## remove caches (keeps .venv and results/)
	rm -rf .pytest_cache .mypy_cache .ruff_cache
