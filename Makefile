# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv if missing.
# `make test` also creates .venv312 (Python 3.12, megatron-core 0.19.x) and runs the suite on both
# releases; each venv is built once (its stamp) and reused.
PY ?= python3
# The supported releases (venv, megatron-core pin, torch, Python, tests) are configs/mcore_releases.json
RELEASE = $(shell python3 tools/mcore_releases.py get $(1) $(2))
# megatron-core 0.19 needs Python >= 3.12
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/$(call RELEASE,0.19,python_tested)/bin/python) \
                     $(shell command -v python$(call RELEASE,0.19,python_minor) 2>/dev/null))
VENV := $(call RELEASE,0.16,venv)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VENV312 := $(call RELEASE,0.19,venv)
BIN312 := $(VENV312)/bin
STAMP312 := $(VENV312)/.installed
# pip keeps no copy of the wheels: the CUDA torch that Python 3.12 gets (there is no CPU wheel for
# it) is ~3.5 GB of wheels and 5.3 GB installed, and a cache would hold the wheels a second time.
export PIP_NO_CACHE_DIR := 1
# Free space a new venv needs (GiB), checked before pip starts so that a full disk is named as
# such instead of surfacing as pip's "[Errno 28]" halfway through. Measured (fresh clone, 2026-11-27):
# .venv 1.5, .venv312 5.9 at its peak (5.3 once installed); the suite's temp data stays under 0.6.
# An existing venv is updated in place and needs next to nothing.
need_free = @test -x $(1)/bin/python || { avail=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	test "$$avail" -ge $(2) || { echo "make: $(1) ($(3)) needs about $(2) GiB free on the disk of" \
	"$$(pwd); $$avail GiB are free. Free space (old clones, /tmp) and rerun."; exit 1; }; }
# Azurite, the Azure Blob emulator the store tests start (tests/store_servers.py): an npm package
# (needs Node), installed once per version outside the clone, into a temporary directory moved into
# place whole (an interrupted install is redone, a finished one is never rerun).
AZURITE_VERSION := 3.37.0
AZURITE_HOME ?= $(HOME)/.cache/megatron-ucp/azurite-$(AZURITE_VERSION)
AZURITE := $(AZURITE_HOME)/node_modules/.bin/azurite-blob
export MEGATRON_UCP_AZURITE := $(AZURITE)
# The part of the suite that runs on megatron-core 0.19 (the full suite runs on 0.16): the live
# save/load (every transition kind incl. MoE), every on-disk format, the Megatron-LM hooks, the
# CLI and the release checks: the 0.19 release's `tests` in configs/mcore_releases.json.
TESTS_MCORE19 ?= $(call RELEASE,0.19,tests)
# Transformer Engine 2.20.2 in a venv of its own over .venv312 (tools/te/install_te_venv.sh): TE-spec
# models, FP8 state, TE <-> local. Its torch extension is built once into TE_CACHE (outside the clone).
VENVTE := .venvte
BINTE := $(VENVTE)/bin
STAMPTE := $(VENVTE)/.installed
TE_CACHE ?= $(HOME)/.cache/megatron-ucp
# Megatron-Bridge 0.6.2 in a venv of its own over .venv312 (tools/bridge/install_bridge_venv.sh): the
# 0.19 run's Bridge tests run Bridge's own load through it (tests/test_megatron_bridge.py); with its
# transformers (5.12.1, Bridge's pin; the other venvs have 5.23.0) the HF import tests run again:
# the importers read both releases' spellings
VENVBRIDGE := .venvbridge
STAMPBRIDGE := $(VENVBRIDGE)/.installed
TESTS_TE ?= tests/test_transformer_engine.py tests/test_megatron_lm_te.py tests/test_te_fp8_params.py \
            tests/test_precision_aware.py

.PHONY: demo test test-mcore16 test-mcore19 test-te test-full test-gpu gpu-wheels gpu-check-dry gpu-tree-slim gpu-tree-restore lint bench install install-mcore19 install-te install-bridge

$(STAMP): setup.py
	$(call need_free,$(VENV),3,Python 3.11 with CPU torch and megatron-core 0.16)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(call RELEASE,0.16,torch)
	$(BIN)/pip install -q "$(call RELEASE,0.16,pip)" safetensors tqdm
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

$(STAMP312): setup.py
	@test -n "$(PY312)" || { echo "megatron-core 0.19 needs Python 3.12: set PY312=/path/to/python3.12"; exit 1; }
	$(call need_free,$(VENV312),7,Python 3.12 with CUDA torch run on the CPU and megatron-core 0.19)
	test -x $(BIN312)/python || $(PY312) -m venv $(VENV312)
	$(BIN312)/pip install -q --upgrade pip
	$(BIN312)/pip install -q torch==$(call RELEASE,0.19,torch)
	$(BIN312)/pip install -q "$(call RELEASE,0.19,pip)" safetensors tqdm
	$(BIN312)/pip install -q -e ".[dev]"
	touch $(STAMP312)

$(STAMPTE): $(STAMP312) tools/te/install_te_venv.sh
	tools/te/install_te_venv.sh $(VENVTE) $(VENV312) $(TE_CACHE)
	touch $(STAMPTE)

$(STAMPBRIDGE): $(STAMP312) tools/bridge/install_bridge_venv.sh
	tools/bridge/install_bridge_venv.sh $(VENVBRIDGE) $(VENV312)
	touch $(STAMPBRIDGE)

$(AZURITE):
	@command -v npm >/dev/null || { echo "make: the Azure store tests need Azurite, installed with npm:" \
	"install Node.js (>= 20) and npm, then rerun"; exit 1; }
	rm -rf $(AZURITE_HOME).tmp && mkdir -p $(AZURITE_HOME).tmp
	npm install --prefix $(AZURITE_HOME).tmp --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION)
	rm -rf $(AZURITE_HOME) && mv $(AZURITE_HOME).tmp $(AZURITE_HOME)
	test -x $(AZURITE)

install: $(STAMP) $(AZURITE)

install-mcore19: $(STAMP312) $(AZURITE)

install-te: $(STAMPTE)

install-bridge: $(STAMPBRIDGE)

demo: $(STAMP)
	$(BIN)/python tools/demo.py --out out/demo

# both venvs first: the 0.16 run includes the cross-release migration tests, which use .venv312
test: $(STAMP) $(STAMP312) $(STAMPTE) $(STAMPBRIDGE) $(AZURITE)
	UCP_EXPECTED_SKIPS_ONLY=1 $(BIN)/python -m pytest -q -rs tests
	UCP_EXPECTED_SKIPS_ONLY=1 UCP_REDUCED=1 UCP_REQUIRE_BRIDGE=1 $(BIN312)/python -m pytest -q -rs $(TESTS_MCORE19)
	UCP_EXPECTED_SKIPS_ONLY=1 UCP_REQUIRE_TE=1 $(BINTE)/python -m pytest -q -rs $(TESTS_TE)
	UCP_EXPECTED_SKIPS_ONLY=1 $(VENVBRIDGE)/bin/python -m pytest -q -rs tests/test_hf_import.py tests/test_hf_files.py

test-mcore16: $(STAMP) $(AZURITE)
	UCP_EXPECTED_SKIPS_ONLY=1 $(BIN)/python -m pytest -q -rs tests

test-mcore19: $(STAMP312) $(STAMPBRIDGE) $(AZURITE)
	UCP_EXPECTED_SKIPS_ONLY=1 UCP_REDUCED=1 UCP_REQUIRE_BRIDGE=1 $(BIN312)/python -m pytest -q -rs $(TESTS_MCORE19)

test-te: $(STAMPTE)
	UCP_EXPECTED_SKIPS_ONLY=1 UCP_REQUIRE_TE=1 $(BINTE)/python -m pytest -q -rs $(TESTS_TE)

test-full: $(STAMP) $(AZURITE)
	UCP_FULL_MATRIX=1 $(BIN)/python -m pytest -q tests

# On a GPU host (CUDA torch, optionally Transformer Engine): the `gpu` tests, no CPU shim.
test-gpu:
	$(PY) -m pytest -q -m gpu tests/test_gpu.py

# The GPU check (tools/gpu/gpu_check.sh; README "GPU check"): the wheels a GPU machine without network
# needs (megatron-core and megatron-ucp's runtime imports, for Python 3.10-3.12: tools/gpu/wheels.txt)
# downloaded here into .whl/ (ignored: the GPU run carries it), checked against the list's bytes and
# sha256 and against its size budget; it prints the total and what the GPU run will send.
# GPU_PYTHONS=3.12 fetches one Python's only (3.8 MiB instead of 10.3; the image had 3.12.3).
gpu-wheels:
	$(PY) tools/gpu/wheels.py download $(if $(GPU_PYTHONS),--pythons "$(GPU_PYTHONS)")

# The device tool sends tracked files and carried paths, 64 MiB at most; the checkpoint fixtures
# alone are 63 MiB and the GPU check reads none of them. `gpu-tree-slim` untracks them (index only,
# the files stay; .git/info/exclude ignores them) for the GPU session; `gpu-tree-restore` undoes it.
FIXTURES_DIR := tests/fixtures
gpu-tree-slim:
	git rm -r -q --cached $(FIXTURES_DIR)
	grep -qx '/$(FIXTURES_DIR)/' .git/info/exclude 2>/dev/null || echo '/$(FIXTURES_DIR)/' >> .git/info/exclude
	@echo "untracked $(FIXTURES_DIR) for the GPU run; run 'make gpu-tree-restore' afterwards (never commit now)"

gpu-tree-restore:
	sed -i '\|^/$(FIXTURES_DIR)/$$|d' .git/info/exclude
	git reset -q -- $(FIXTURES_DIR)
	git status --short -- $(FIXTURES_DIR) | head -3

# What can be checked of it without a GPU (also in `make test`: tests/test_gpu_check.py)
gpu-check-dry: $(STAMP)
	GPU_CHECK_PYTHON=$(BIN)/python bash tools/gpu/gpu_check.sh --dry-run

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/bench_checkpoint.py
