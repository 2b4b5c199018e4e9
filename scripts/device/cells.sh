#!/bin/bash
# Runs the moonshot's 64k needle cells (`ctxext tasks`, fp32, CUDA) on the lent GPU machine, from what
# scripts/device/pack.sh packed and its first two calls left in /tmp/parts. The first call on a machine
# installs the wheels, rebuilds SmolLM2 from its GGUF (about 40 s) and checks every tensor against this
# checkpoint's digests; later calls on the same warm machine skip that. Cells resume from the committed cache
# (benchmarks/moonshot_cells/tasks): a CUDA cell's key differs from a CPU one's only in "device".
# CELLS picks them (default "native dpe g12"), DTYPE their dtype (default fp32, the CPU cells' dtype on an
# AVX2-only machine); DEADLINE (s) bounds the whole run. CELLS=cost runs no cell: it times one 64k prefill of
# dpe against native attention on SmolLM2's shape (`ctxext check`, 30 layers, fp32 and bf16) into
# $OUT/cost_*.json, which tells the prefill apart from decoding and per-process work in a cell's time. What
# the cells wrote comes back as $OUT/cells.tar: copy new *.json and requests/*.db into
# benchmarks/moonshot_cells/tasks.
# CELLS=search32 finishes issue 24's comparison rows: scripts/compare_methods.py on CUDA in bf16 (the page's
# dtype) runs the needle-ppl searches at 32k of SEARCH_METHODS (default leaky_rerope,dual_chunk,rerope) and their
# rows' cells; what it computed comes back as $OUT/comparison_cells.tar (extract it over docs/comparison_cells,
# then run compare_methods.py --report-only here). CELLS=needle32 then asks RULER's niah_single_1 at 32k, 10
# samples, of every needle row that has parameters at 32k (scripts/device/needle_sweep.py), in bf16: its cells
# come back in cells.tar (they belong in benchmarks/needle_cells/tasks).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CTXEXT_CACHE_DIR=/tmp/c TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/site:$PWD
DEADLINE=${DEADLINE:-560}
CELLS_DIR=/tmp/cells CMP_DIR=/tmp/comparison_cells
SEARCH_METHODS=${SEARCH_METHODS:-leaky_rerope,dual_chunk,rerope}
trap 'tar -cf $OUT/cells.tar -C $CELLS_DIR .; tar -cf $OUT/comparison_cells.tar -C $CMP_DIR .' EXIT
if [ ! -f /tmp/setup.done ]; then
  nvidia-smi -L
  cp .gpu/c/*.whl /tmp/parts/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/parts/*.whl || exit 3
  GGUF=/tmp/c/smollm2-gguf/$(python3 -c "from ctxext.assets import SMOLLM2_GGUF; print(SMOLLM2_GGUF)")
  mkdir -p /tmp/c/smollm2-gguf && cat /tmp/parts/gguf.part1 /tmp/parts/gguf.part2 > "$GGUF"
  [ "$(sha256sum "$GGUF" | cut -c1-64)" = "$(cat .gpu/c/gguf.sha)" ] || { echo "GGUF parts do not match"; exit 4; }
  python3 -c "from ctxext.assets import smollm2_checkpoint; smollm2_checkpoint()" || exit 5
  python3 scripts/device/weights_digest.py check /tmp/c/smollm2-135m-instruct/model.safetensors .gpu/c/weights.json || exit 6
  cp .gpu/c/tok/* /tmp/c/smollm2-135m-instruct/  # the tokenizer's bytes are part of every cell's key
  mkdir -p $CELLS_DIR && cp -r benchmarks/moonshot_cells/tasks/. benchmarks/needle_cells/tasks/. $CELLS_DIR/
  mkdir -p /tmp/c/shakespeare $CMP_DIR && cp .gpu/c/shakespeare/* /tmp/c/shakespeare/
  cp -r docs/comparison_cells/. $CMP_DIR/
  touch /tmp/setup.done
fi
# step NAME CAP: sets $limit to CAP or what is left of DEADLINE, whichever is less; fails under 30 s.
step() {
  local left=$((DEADLINE - SECONDS)); limit=$((left < $2 ? left : $2))
  [ $limit -lt 30 ] && { echo "skipped $1: ${limit} s left"; return 1; }
  echo "=== $1 (at most $limit s, from $SECONDS s)"
}
cell() {
  local name=$1 cap=$2; shift 2
  step $name $cap || return
  timeout $limit python3 -m ctxext tasks /tmp/c/smollm2-135m-instruct --tasks niah_single_1 --device cuda \
    --dtype ${DTYPE:-fp32} --cache-dir $CELLS_DIR -o /tmp/results_$name --overwrite --no-progress "$@" 2>&1 | tail -20
}
cost() {
  for dtype in fp32 bf16; do
    step "cost $dtype" 200 || return
    timeout $limit python3 -m ctxext check --device cuda --model /tmp/c/smollm2-135m-instruct --methods dpe \
      --implementations sdpa --lengths 65536 --layers 30 --dtype $dtype --repeats 2 --json $OUT/cost_$dtype.json \
      2>&1 | grep -v "ctxext check:" | tail -12
  done
}
search32() {
  step search32 ${SEARCH_CAP:-540} || return
  timeout $limit python3 scripts/compare_methods.py --methods $SEARCH_METHODS --lengths 32768 --device cuda \
    --dtype bf16 --cells $CMP_DIR --output /tmp/comparison --max-minutes $(((limit - 60) / 60)) 2>&1 | tail -40
  cp /tmp/comparison/comparison.json $OUT/ 2>/dev/null
}
needle32() {  # the page search32 wrote on this machine, else the committed one
  local page=/tmp/comparison/comparison.json
  [ -f $page ] || page=docs/comparison.json
  python3 scripts/device/needle_sweep.py $page 32768 $SEARCH_METHODS /tmp/needle32.yaml || return
  DTYPE=bf16 cell needle32 ${NEEDLE_CAP:-540} --lengths 32k --limit 10 --no-baseline --config /tmp/needle32.yaml
}
for name in ${CELLS:-native dpe g12}; do case $name in
  cost) cost ;;
  native) cell native 150 --lengths 4k --limit 20 ;;
  dpe) cell dpe 330 --lengths 64k --limit 10 --no-baseline --method dpe --window 3028 \
         --group-scales "[8, 4, 8, 16, 1, 32, 16, 16]" ;;
  g12) cell g12 400 --lengths 64k --limit 10 --no-baseline --method self_extend --group-size 12 --window 2048 ;;
  search32) search32 ;;
  needle32) needle32 ;;
  *) echo "unknown cell '$name' (native, dpe, g12, cost, search32, needle32)"; exit 2 ;;
esac; done
