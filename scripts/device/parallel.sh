#!/bin/bash
# Issue 54's GPU step: sequence parallelism (SP = 2) and tensor parallelism (TP = 2) on a machine with at least 2
# GPUs, each against the same work on one GPU, with the engines the CPU tests cannot reach (NCCL, bf16,
# FlashAttention-2 where installed as Ulysses' core attention). On a machine with fewer GPUs it says so and
# stops: the proof on this project's machines is the CPU tests (tests/test_sequence_parallel.py,
# tests/test_tensor_parallel_cli.py).
#   run(timeout_s=600, command="bash scripts/device/parallel.sh")
# The model is ctxext:tiny-shakespeare (4 heads; pretrained on the GPU at its first use, under a minute), so
# nothing needs carrying; DeepSpeed must be importable (pip install 'ctxext[deepspeed]').
#   SP: `ctxext finetune` of configs/recipes/tiny-cpu.yaml with yarn x4, 20 steps, bf16, as 1 process and as 2
#       under DeepSpeed ZeRO-2 with parallel.sp_size=2: the logged losses and perplexities side by side.
#   TP: `ctxext eval` of the same model with yarn and self_extend at 1k, as 1 process and as 2 under torchrun
#       with --tp 2: the perplexities side by side.
# Results in $OUT/parallel/ (sp1/, sp2/, tp1/, tp2/ and parallel.json with the largest relative differences).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
OUT=${OUT:-/tmp/out}
RESULTS="$OUT/parallel"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 2 ]; then
    echo "parallel.sh: SP = 2 and TP = 2 need 2 GPUs; this machine has $GPUS. Nothing run." >&2
    exit 0
fi
$PY -c "import deepspeed" 2>/dev/null || { echo "parallel.sh: DeepSpeed is not installed: pip install 'ctxext[deepspeed]'" >&2; exit 1; }
mkdir -p "$RESULTS"
export HF_HUB_OFFLINE=1
MODEL=$($PY -c "from ctxext.train.pretrain_tiny import tiny_shakespeare_checkpoint; print(tiny_shakespeare_checkpoint())")

RECIPE=(--recipe configs/recipes/tiny-cpu.yaml --no-progress "method={method: yarn, factor: 4}" train.max_steps=20
        train.precision=bf16 eval.every=10 train.checkpoint_every=0 lora.dropout=0)
CUDA_VISIBLE_DEVICES=0 $PY -m ctxext finetune "${RECIPE[@]}" output_dir="$RESULTS/sp1"
$PY -m accelerate.commands.launch --config_file configs/accelerate/deepspeed-zero2.yaml --num_processes 2 \
    -m ctxext finetune "${RECIPE[@]}" output_dir="$RESULTS/sp2" parallel.sp_size=2

EVAL=(eval "$MODEL" --method yarn --method self_extend --factor 4 --lengths 1024 --stride 256 --dtype bf16
      --dataset shakespeare:othello_gut --no-progress --no-cache)
CUDA_VISIBLE_DEVICES=0 $PY -m ctxext "${EVAL[@]}" -o "$RESULTS/tp1"
$PY -m torch.distributed.run --nproc-per-node 2 -m ctxext "${EVAL[@]}" --tp 2 -o "$RESULTS/tp2"

$PY - "$RESULTS" <<'PYTHON'
import json, sys
from pathlib import Path

results = Path(sys.argv[1])


def metrics(run):
    """Every logged loss and perplexity of a fine-tuning run, by (kind, step, what)."""
    out = {}
    for line in (results / run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        scores = row.get("perplexity")
        scores = scores if isinstance(scores, dict) else {"perplexity": scores}
        for what, value in {"loss": row.get("loss"), **scores}.items():
            if isinstance(value, float):
                out[(row["kind"], row["step"], str(what))] = value
    return out


def cells(run):
    rows = json.loads((results / run / "results.json").read_text())["results"]
    return {(r["method"], r["length"]): r["perplexity"] for r in rows}


def worst(a, b):
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


report = {"sp2_vs_1_relative": worst(metrics("sp2"), metrics("sp1")),
          "tp2_vs_1_relative": worst(cells("tp2"), cells("tp1"))}
(results / "parallel.json").write_text(json.dumps(report, indent=2))
print(json.dumps(report, indent=2))
PYTHON
