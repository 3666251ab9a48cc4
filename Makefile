# One entry point for set-up, demo, tests and docs. The venv is created on first use;
# torch is installed first and pinned so pip never pulls a CUDA build.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ckptfs-installed
TORCH := torch==2.13.0
# torchtitan for tests/test_torchtitan.py, without the training stack it declares (datasets,
# wandb, tensorboard, torch_checkpointing): what its checkpointer, optimizer and config modules import
TITAN := torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring-parser typeguard shtab
# pytest-xdist workers for `make test` (the suite waits on disks, sockets and spawned ranks
# part of the time: with two workers on 2 cores the run kept the cores 84% busy)
TEST_WORKERS ?= 3
# how the workers share the tests: one at a time in the order tests/conftest.py gives (longest
# modules first), except that the tests sharing a module-scoped fixture of their module stay on
# one worker (conftest marks them xdist_group), so that fixture (often a spawned world) runs once
TEST_DIST := --dist loadgroup --no-loadscope-reorder
# The checkout's bytecode, written once before the tests: every spawned rank, writer process and
# docs block imports ckptfs and the test modules, and where PYTHONDONTWRITEBYTECODE is set each
# of those processes would compile them again
COMPILE := $(BIN)/python -m compileall -q -j 0 ckptfs tests bench examples tools_dev > /dev/null

.PHONY: venv demo test check-lint check-docs check-types check-tests test-fast lint docs wheel-check bench bench-async bench-perf bench-venvs mutate \
	fuzz soak clean interop interop-strategies bench-megatron megatron-venvs megatron-fixtures crash-trials chaos test-diff-large \
	test-two-node test-extended titan-trainer

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml examples/npy_plugin/pyproject.toml examples/store_plugin/pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test,dev]" $(TORCH)
	$(BIN)/pip install -q --no-deps -e examples/npy_plugin
	$(BIN)/pip install -q --no-deps -e examples/store_plugin
	$(BIN)/pip install -q --no-deps $(TITAN)
	# Azurite (the Azure Blob emulator tests/test_azure.py starts), from npm where node is present
	if command -v npm > /dev/null; then npm install -s --no-fund --no-audit --prefix $(VENV)/node azurite@3.37.0; fi
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m ckptfs.demo

# The lint, the docs build and the type check run beside the tests (each its own job, its output
# kept together): the tests leave a core idle part of the time, and any one failing fails the run
test: $(STAMP)
	$(MAKE) --no-print-directory -j 4 --output-sync=target check-lint check-docs check-types check-tests

check-lint: $(STAMP)
	$(BIN)/ruff check ckptfs tests bench examples tools_dev

check-docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

check-types: $(STAMP)
	$(BIN)/mypy

check-tests: $(STAMP)
	$(COMPILE)
	$(BIN)/python -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) $(TEST_DIST) -m "not extended"

# The longer run `make test` leaves out (marker `extended`): the conformance suite from an
# installed wheel (the same suite runs in-process in `make test`)
test-extended: $(STAMP)
	$(COMPILE)
	$(BIN)/python -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) $(TEST_DIST) -m extended

# The fast lane: the tests that start no processes and no servers (`pytest -m "not slow"`).
# A test that spawns ranks, runs a program in a subprocess or starts moto is marked
# `@pytest.mark.slow` (a module that only has such tests: `pytestmark = pytest.mark.slow`); tests
# using the S3 fixtures are marked by tests/conftest.py. In this lane, starting a process or moto
# fails the test with a message naming the marker it lacks. `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=10 -m "not slow" -n $(TEST_WORKERS) $(TEST_DIST)

lint: $(STAMP)
	$(BIN)/ruff check ckptfs tests bench examples tools_dev
	$(BIN)/mypy

# the documentation site (mkdocs.yml, docs/), warnings as errors; `make test` builds it too
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

# the wheel from a clean clone, installed in a fresh venv with torch alone (tests/test_packaging.py
# builds and checks it in `make test`; this also installs it and runs the quick start)
wheel-check: $(STAMP)
	$(BIN)/python -m tools_dev.wheel_check --python $(PY)

bench: $(STAMP)
	$(BIN)/python -m bench.run

bench-async: $(STAMP)
	$(BIN)/python -m bench.async_save
	$(BIN)/python -m bench.python_bound
	$(BIN)/python -m bench.host_memory

# The performance bench (bench/perf.py): every case against the floors measured in the same run
# and every peer. DCP runs in .venv; OLMo-core and Megatron-Core run in their own venvs when they
# exist (`make bench-venvs`), else they are skipped with a line. BENCH_ARGS: e.g. --gb 0.3 --reps 1
BENCH_STAMP := $(VENV)/.ckptfs-bench-installed
BENCH_ARGS ?=
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[bench]" $(TORCH)
	touch $(BENCH_STAMP)

bench-perf: $(BENCH_STAMP)
	MEGATRON_VENV=$(abspath $(MEGATRON_VENV)) OLMO_VENV=$(abspath $(OLMO_VENV)) \
		$(BIN)/python -m bench.perf $(BENCH_ARGS)

# Recovery tiers, full set: two torchrun agents as two nodes (a replaced node, a restart on one
# node, a spoiled last copy, a node killed mid-copy) and the same scenarios on spawned ranks;
# `make test` runs the first
test-two-node: $(STAMP)
	CKPTFS_TWO_NODE_FULL=1 $(BIN)/python -m pytest -q -x -n 0 tests/test_two_node.py tests/test_recovery_tiers.py

# ckptfs.diff's tests at 10^8 elements per checkpoint (400 MB each; `make test` runs 10^7)
test-diff-large: $(STAMP)
	CKPTFS_DIFF_ELEMENTS=100000000 $(BIN)/python -m pytest -q -x -n 0 tests/test_diff.py

# SIGKILLed saves, full count (tests/crash_trials.py; make test runs a reduced count in
# tests/test_crash.py): every writable backend, local files and moto S3
CRASH_TRIALS ?= 40
crash-trials: $(STAMP)
	$(BIN)/python -m tests.crash_trials --trials $(CRASH_TRIALS)

# Delta steps SIGKILLed at random moments of the manager's save and retention
# (tests/delta_chaos.py; make test runs a few cycles in tests/test_delta_chaos.py): local
# files and moto S3, CHAOS_CYCLES cycles each
CHAOS_CYCLES ?= 30
chaos: $(STAMP)
	$(BIN)/python -m tests.delta_chaos --cycles $(CHAOS_CYCLES)

# Megatron-Core interop (tests/interop/megatron_live.py), outside `make test`: two venvs of their
# own (megatron-core pins numpy/zarr differently from ckptfs). megatron-core 0.19.2 needs Python
# >= 3.12 by its metadata, but its wheel imports on 3.11; it imports triton and psutil undeclared.
# The 0.19.2 venv also gets ckptfs's dependencies (ckptfs itself comes from PYTHONPATH).
MEGATRON_VENV ?= .venv-megatron
MEGATRON015_VENV ?= .venv-megatron015
CKPTFS_DEPS := numpy fsspec s3fs obstore safetensors "zarr>=3.1.3" "numcodecs>=0.16" google-crc32c isal \
	ml_dtypes tqdm xxhash

$(MEGATRON_VENV)/.installed:
	$(PY) -m venv $(MEGATRON_VENV)
	$(MEGATRON_VENV)/bin/pip install -q $(TORCH)
	$(MEGATRON_VENV)/bin/pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2
	$(MEGATRON_VENV)/bin/pip install -q $(TORCH) triton psutil packaging $(CKPTFS_DEPS)
	touch $@

$(MEGATRON015_VENV)/.installed:
	$(PY) -m venv $(MEGATRON015_VENV)
	$(MEGATRON015_VENV)/bin/pip install -q $(TORCH)
	$(MEGATRON015_VENV)/bin/pip install -q --no-deps --ignore-requires-python megatron-core==0.15.3
	$(MEGATRON015_VENV)/bin/pip install -q $(TORCH) triton psutil packaging "numpy<2" "zarr<3" tensorstore \
		google-crc32c tqdm xxhash
	touch $@

megatron-venvs: $(MEGATRON_VENV)/.installed $(MEGATRON015_VENV)/.installed

# OLMo-core for the bench (torch pinned first, so pip keeps the CPU wheel); ckptfs from PYTHONPATH
OLMO_VENV ?= .venv-olmo
$(OLMO_VENV)/.installed:
	$(PY) -m venv $(OLMO_VENV)
	$(OLMO_VENV)/bin/pip install -q $(TORCH)
	$(OLMO_VENV)/bin/pip install -q $(TORCH) ai2-olmo-core==3.0.0 $(CKPTFS_DEPS)
	touch $@

bench-venvs: $(MEGATRON_VENV)/.installed $(OLMO_VENV)/.installed

interop: megatron-venvs
	$(MEGATRON_VENV)/bin/python tests/interop/megatron_live.py \
		--venv019 $(abspath $(MEGATRON_VENV)) --venv015 $(abspath $(MEGATRON015_VENV))

# ckptfs.megatron's strategies under megatron-core 0.19.2 and 0.15.3 (tests/interop/megatron_strategies.py;
# the distributed optimizer's flattened_range: tests/interop/megatron_flattened.py; stacked layers:
# tests/interop/megatron_stacked.py; the optimizer's flat slices of stacked layers, 0.15 only:
# tests/interop/megatron_flat_layers.py)
interop-strategies: megatron-venvs
	PYTHONPATH=$(abspath .) $(MEGATRON_VENV)/bin/python tests/interop/megatron_strategies.py
	PYTHONPATH=$(abspath .) $(MEGATRON015_VENV)/bin/python tests/interop/megatron_strategies.py
	PYTHONPATH=$(abspath .) $(MEGATRON_VENV)/bin/python tests/interop/megatron_flattened.py
	PYTHONPATH=$(abspath .) $(MEGATRON015_VENV)/bin/python tests/interop/megatron_flattened.py
	PYTHONPATH=$(abspath .) $(MEGATRON_VENV)/bin/python tests/interop/megatron_stacked.py
	PYTHONPATH=$(abspath .) $(MEGATRON015_VENV)/bin/python tests/interop/megatron_stacked.py
	PYTHONPATH=$(abspath .) $(MEGATRON015_VENV)/bin/python tests/interop/megatron_flat_layers.py

# Megatron's dist_checkpointing with ckptfs's strategies against its torch_dist (bench/megatron_strategies.py)
bench-megatron: $(MEGATRON_VENV)/.installed
	PYTHONPATH=$(abspath .) $(MEGATRON_VENV)/bin/python -m bench.megatron_strategies

# rewrites tests/fixtures/megatron/ (commit the result only when the format it tests changes)
megatron-fixtures: megatron-venvs
	$(MEGATRON_VENV)/bin/python tests/fixtures/megatron/make_fixtures.py
	$(MEGATRON015_VENV)/bin/python tests/fixtures/megatron/make_fixtures.py

# torchtitan's own trainer on CPU ranks with ckptfs's checkpoint manager (tests/interop/titan_trainer.py):
# torchtitan 0.3.0 with the training stack its trainer imports (datasets, torchdata, tensorboard,
# triton), torch pinned; ckptfs from PYTHONPATH
TITAN_VENV ?= .venv-titan
$(TITAN_VENV)/.installed:
	$(PY) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/pip install -q $(TORCH)
	$(TITAN_VENV)/bin/pip install -q --no-deps $(TITAN)
	$(TITAN_VENV)/bin/pip install -q $(TORCH) torchdata einops tensorboard "datasets>=3.6,<4.8" tokenizers \
		triton pillow $(CKPTFS_DEPS)
	touch $@

titan-trainer: $(TITAN_VENV)/.installed
	PYTHONPATH=$(abspath .) $(TITAN_VENV)/bin/python tests/interop/titan_trainer.py

# The parsers' fuzzers (tests/test_fuzz.py) with FUZZ_EXAMPLES examples per target (`make test`
# runs 30, seeded); FUZZ_SEED=N draws other inputs than the fixed seed
FUZZ_EXAMPLES ?= 2000
FUZZ_SEED ?=
fuzz: $(STAMP)
	CKPTFS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) CKPTFS_FUZZ_SEED=$(FUZZ_SEED) \
		$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) tests/test_fuzz.py

# The fault soak (tests/soak.py): SOAK_CYCLES save/load cycles against moto through the fault
# proxy at SOAK_RATE faults per request (every kind, seeded), then the whole fault matrix
# (tests/test_fault_matrix.py: every fault x operation x client x store, S3 on moto and GCS on
# fake-gcs-server); `make test` runs 10 cycles and each fault once per client (S3) or once (GCS)
SOAK_CYCLES ?= 200
SOAK_RATE ?= 0.05
soak: $(STAMP)
	$(BIN)/python -m tests.soak --cycles $(SOAK_CYCLES) --rate $(SOAK_RATE) --seed 0
	CKPTFS_FAULT_MATRIX=full $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) tests/test_fault_matrix.py

mutate: $(STAMP)
	$(BIN)/python -m tools_dev.mutate

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
