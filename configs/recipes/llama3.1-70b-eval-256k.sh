#!/usr/bin/env bash
# Llama-3.1-70B beyond its 128k: yarn x2 from the context it ships (llama3 rope, 131072 -> 262144), perplexity at
# 64k, 128k and 256k on PG19 books, against the model as shipped. 141 GB of bf16 weights are more than one 80 GB
# GPU holds: accelerate's dispatch (--device-map auto) spreads the layers over the GPUs, and what the limits leave
# over waits in CPU memory (offload), so two 80 GB GPUs run it; the limits leave each GPU room for a 256k window's
# activations. Perplexity never holds a full-vocabulary logits matrix: the LM head runs on 256 positions at a time
# (ctxext/eval/perplexity.py), under dispatch as without it.
#   bash configs/recipes/llama3.1-70b-eval-256k.sh                  # 2 GPUs of 80 GB
#   MAX_MEMORY=0=120GiB,1=120GiB bash configs/recipes/llama3.1-70b-eval-256k.sh   # 2 H200s: no CPU offload
# Every setting can be replaced from the environment (MODEL, OUTPUT, LENGTHS, FACTOR, MAX_MEMORY, DTYPE, DATA:
# the data flags). Untested on GPUs: tests/test_parallel_recipes.py runs this file on a tiny LLaMA with Llama 3.1's
# rope, with the same dispatch (auto, a CPU memory limit that leaves part of the model offloaded) on the CPU, and
# compares its perplexities with the undispatched model's.
set -euo pipefail
MODEL=${MODEL:-meta-llama/Llama-3.1-70B}
OUTPUT=${OUTPUT:-outputs/llama3.1-70b-eval-256k}
LENGTHS=${LENGTHS:-64k,128k,256k}
FACTOR=${FACTOR:-2}
MAX_MEMORY=${MAX_MEMORY:-0=70GiB,1=70GiB,cpu=200GiB}
DTYPE=${DTYPE:-bf16}
DATA=${DATA:---dataset pg19 --max-docs 10}
# shellcheck disable=SC2086  # DATA is several flags
exec ctxext eval "$MODEL" --method yarn --factor "$FACTOR" --lengths "$LENGTHS" --stride window \
    --device-map auto --max-memory "$MAX_MEMORY" --dtype "$DTYPE" $DATA -o "$OUTPUT"
