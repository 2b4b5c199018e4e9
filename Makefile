# The two commands: `make demo` (the offline end-to-end demo) and `make test` (ruff, then the test suite; its slow
# tier, real processes and real-model end-to-end oracles, is `make test-slow`, which CI runs second).
# Both create or reuse .venv, installing torch first so that pip never pulls a multi-GB CUDA build by accident.
# The default tier's budget: 8 minutes on 2 CPU cores from a fresh clone (the docs quote this line; a test checks).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
export CTXEXT_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: demo test test-slow setup assets clean-cache

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

assets: setup
	$(BIN)/python -m ctxext.assets

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/demo.py

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto --dist loadfile -m "not slow"

test-slow: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto --dist loadfile -m slow

clean-cache:
	rm -rf $(CTXEXT_CACHE_DIR)
