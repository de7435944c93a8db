# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv if missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-full test-gpu lint bench install

$(STAMP): setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q "megatron-core==0.16.*" safetensors tqdm
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python tools/demo.py --out out/demo

test: $(STAMP)
	UCP_EXPECTED_SKIPS_ONLY=1 $(BIN)/python -m pytest -q -rs tests

test-full: $(STAMP)
	UCP_FULL_MATRIX=1 $(BIN)/python -m pytest -q tests

# On a GPU host (CUDA torch, optionally Transformer Engine): the `gpu` tests, no CPU shim.
test-gpu:
	$(PY) -m pytest -q -m gpu tests/test_gpu.py

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/bench_checkpoint.py
