"""`ctxext finetune --plan`'s estimate against the measured peak of short real fine-tunes on the CPU.

    python benchmarks/memory_plan.py                      # the default sizes, about 8 minutes on 2 cores
    python benchmarks/memory_plan.py --steps 2 --sizes 1024:off
    python benchmarks/memory_plan.py --sp 2 --sizes 4096:off 4096:on --output benchmarks/results/memory_plan_sp2.json

The model has the shape of ctxext:tiny-shakespeare (h 256, 4 layers, 4 heads, ffn 704, vocab 4096, untied) with
random weights and a BPE tokenizer trained here on the Shakespeare texts (memory does not depend on the weights'
values, and pretraining the real one takes 10-20 minutes). Each size runs `ctxext.train.loop` (prepare, then
train) in a fresh Python process: 1 process, fp32, SDPA (PyTorch's fused flash kernel on CPU), LoRA r 8 on
q,k,v,o with embeddings and norms trained, micro batch 4 = global batch 4, a few optimizer steps, no evaluation,
no checkpoint until the end.

Measured: the process's resident high-water mark (Linux VmHWM, reset after `prepare` so that tokenising the data
and loading do not count; read after every step, before the final save) minus the resident set after the
imports, before the model is loaded (the process baseline). So it holds the weights, the adapters, gradients,
AdamW state and the steps' peak. Every size runs twice: with glibc's malloc as it is, and with
MALLOC_MMAP_THRESHOLD_=65536, so that freed tensors leave the resident set (see ALLOCATORS): the difference is
memory the allocator keeps, not memory the training holds. Estimated: ctxext.train.memory_plan for the same shape
and settings.
With --sp N the run is N processes under DeepSpeed ZeRO-2 (configs/accelerate/deepspeed-zero2-cpu.yaml) with
parallel.sp_size N: each process measures itself, the peak is the largest of them, and the estimate is the plan's
for sp N, ZeRO-2.
Results: benchmarks/results/memory_plan.json (--sp 2: memory_plan_sp2.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "memory_plan.json"
DEFAULT_SIZES = ("1024:off", "4096:off", "4096:on")  # seq_len:gradient checkpointing
MICRO_BATCH = 4
# glibc's malloc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in its arenas, where the
# resident set still counts them; with the threshold at 64 KiB every tensor of that size is its own mapping,
# returned to the system when freed, so the resident set follows the live tensors.
ALLOCATORS = {"glibc default": {}, "glibc, mmap threshold 64 KiB": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def build_model(folder: Path) -> Path:
    """A random-weight model of the tiny preset's shape, with a BPE tokenizer of its vocabulary size."""
    from transformers import LlamaForCausalLM

    from ctxext.train.pretrain_tiny import TINY_PRESETS, tiny_llama_config, train_bpe_tokenizer, training_texts

    settings = TINY_PRESETS["tiny-shakespeare"]
    texts = [text for _, text in training_texts(settings.held_out)]
    tokenizer = train_bpe_tokenizer(texts, settings.vocab_size)
    model = LlamaForCausalLM(tiny_llama_config(settings, tokenizer.eos_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def recipe_overrides(model: Path, output: Path, seq_len: int, checkpointing: bool, steps: int) -> dict:
    return {
        "model": str(model),
        "method": {"method": "linear", "factor": max(1, seq_len // 256)},
        "seq_len": seq_len,
        "output_dir": str(output),
        "train.max_steps": steps,
        "train.global_batch_size": MICRO_BATCH,
        "train.micro_batch_size": MICRO_BATCH,
        "train.precision": "fp32",
        "train.device": "cpu",
        "train.gradient_checkpointing": checkpointing,
        "train.attn_implementation": "sdpa",
        "train.checkpoint_every": 0,
        "train.save_merged": False,
        "data.dataset": "shakespeare",
        "data.exclude": ["othello_gut", "macbeth_gut"],
        "eval.every": 0,
    }


def child(overrides: dict) -> dict:
    """In a fresh process: baseline, prepare, reset the high-water mark, train; the peak above the baseline. Under
    a launch of several processes, every process's measurement, gathered: the largest peak, and each one's."""
    import torch

    from ctxext.memory import reset_high_water_mark, resident_bytes
    from ctxext.train.loop import train
    from ctxext.train.recipe import load_recipe
    from ctxext.train.setup import prepare

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    baseline = resident_bytes("VmRSS")
    setup = prepare(load_recipe(None, overrides), resume=False, progress=False)
    loaded = resident_bytes("VmRSS")
    if not reset_high_water_mark():
        raise SystemExit("this system refuses to reset VmHWM; the measurement needs Linux's /proc/self/clear_refs")
    highs, start, gathered = [], time.perf_counter(), []

    def after_step(step: int) -> None:
        highs.append(resident_bytes("VmHWM"))
        if step == setup.recipe.train.max_steps and torch.distributed.is_initialized():  # before the group closes
            every = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, measured())
            gathered.extend(every)

    def measured() -> dict:
        return {
            "baseline_bytes": baseline,
            "loaded_bytes": loaded - baseline,
            "peak_bytes": max(highs) - baseline,
            "peak_by_step_bytes": [high - baseline for high in highs],
            "seconds": time.perf_counter() - start,
        }

    train(setup, resume=False, progress=False, after_step=after_step)
    if not gathered:
        return measured()
    return {**max(gathered, key=lambda m: m["peak_bytes"]), "processes": gathered}


def measure(overrides: dict, threads: int, allocator: str, sp: int = 1) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.update(ALLOCATORS[allocator])
    launch = []
    if sp > 1:  # N processes under DeepSpeed ZeRO-2, one sequence split over them
        env["DS_ACCELERATOR"] = "cpu"
        launch = ["-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/deepspeed-zero2-cpu.yaml",
                  "--num_processes", str(sp)]  # fmt: skip
    run = subprocess.run(
        [sys.executable, *launch, __file__, "--child", json.dumps(overrides)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if run.returncode:
        raise SystemExit(f"the measured run failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def estimated(overrides: dict, zero: int = 0) -> dict:
    from ctxext.train.memory_plan import estimate, read_model_shape, settings_from_recipe
    from ctxext.train.recipe import load_recipe

    recipe = load_recipe(None, overrides)
    return estimate(read_model_shape("ctxext:tiny-shakespeare"), settings_from_recipe(recipe, zero=zero))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_all(sizes: list[str], steps: int, threads: int, sp: int = 1) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="ctxext-memory-plan-") as scratch:
        model = build_model(Path(scratch) / "model")
        for index, size in enumerate(sizes):
            seq_len, checkpointing = int(size.split(":")[0]), size.split(":")[1] == "on"
            overrides = recipe_overrides(model, Path(scratch) / f"run-{index}", seq_len, checkpointing, steps)
            if sp > 1:
                overrides["parallel.sp_size"] = sp
            estimate = estimated(overrides, zero=2 if sp > 1 else 0)
            for number, allocator in enumerate(ALLOCATORS):
                overrides["output_dir"] = str(Path(scratch) / f"run-{index}-{number}")
                measured = measure(overrides, threads, allocator, sp)
                row = {
                    "seq_len": seq_len,
                    "sp": sp,
                    "micro_batch": MICRO_BATCH,
                    "gradient_checkpointing": checkpointing,
                    "allocator": allocator,
                    "estimate_bytes": estimate,
                    "measured": measured,
                    "ratio_measured_over_estimate": measured["peak_bytes"] / estimate["peak"],
                }
                rows.append(row)
                print(describe(row), flush=True)
    return {"machine": machine(threads), "steps": steps, "rows": rows}


def machine(threads: int) -> dict:
    import torch
    import transformers

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def describe(row: dict) -> str:
    mib = 2**20
    return (
        f"sp {row.get('sp', 1)}, seq {row['seq_len']:>5} x {row['micro_batch']}, checkpointing {'on ' if row['gradient_checkpointing'] else 'off'}:"
        f" estimate {row['estimate_bytes']['peak'] / mib:7.1f} MiB, measured {row['measured']['peak_bytes'] / mib:7.1f}"
        f" MiB (loaded {row['measured']['loaded_bytes'] / mib:.1f}), measured/estimate "
        f"{row['ratio_measured_over_estimate']:.2f} ({row['allocator']})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="seq_len:on|off (checkpointing)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each run")
    parser.add_argument("--sp", type=int, default=1, help="processes to a sequence (DeepSpeed Ulysses, ZeRO-2)")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if args.child:
        measured = child(json.loads(args.child))
        if "processes" not in measured or os.environ.get("RANK", "0") == "0":
            print(json.dumps(measured))
        return
    results = run_all(args.sizes, args.steps, args.threads, args.sp)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
