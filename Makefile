# One entry point for set-up, demo and tests. The venv is created on first use;
# torch is installed first and pinned so pip never pulls a CUDA build.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ckptfs-installed
TORCH := torch==2.13.0

.PHONY: venv demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml examples/npy_plugin/pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]" $(TORCH)
	$(BIN)/pip install -q --no-deps -e examples/npy_plugin
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m ckptfs.demo

test: $(STAMP)
	$(BIN)/ruff check ckptfs tests bench examples
	$(BIN)/python -m pytest -q -ra

lint: $(STAMP)
	$(BIN)/ruff check ckptfs tests bench examples

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
