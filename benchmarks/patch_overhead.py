"""Forward time of SmolLM2-135M patched with yarn x2 against the unpatched model, at 2k tokens.

The two are timed side by side in one process, interleaved (A B A B ...), on the same input, so machine
noise hits both alike; the result is the ratio of medians (target <= 1.02).

    CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/patch_overhead.py [--tokens 2048] [--repeats 7]
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

import ctxext
from ctxext import assets


def timed_forward(model, tokens) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        model(tokens, logits_to_keep=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--method", default="yarn")
    parser.add_argument("--factor", type=float, default=2.0)
    args = parser.parse_args()

    path = assets.smollm2_checkpoint()
    baseline = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    patched = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ctxext.patch(patched, args.method, factor=args.factor)
    tokens = torch.randint(0, baseline.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    timed_forward(baseline, tokens), timed_forward(patched, tokens)  # warm-up
    times = {"unpatched": [], "patched": []}
    for _ in range(args.repeats):
        times["unpatched"].append(timed_forward(baseline, tokens))
        times["patched"].append(timed_forward(patched, tokens))
    unpatched, with_patch = statistics.median(times["unpatched"]), statistics.median(times["patched"])
    print(
        f"SmolLM2-135M fp32, {args.tokens} tokens, {args.repeats} interleaved repeats, torch threads "
        f"{torch.get_num_threads()}"
    )
    print(f"median forward: unpatched {unpatched:.3f} s, {args.method} x{args.factor:g} {with_patch:.3f} s")
    print(f"ratio patched/unpatched: {with_patch / unpatched:.3f} (target <= 1.02)")


if __name__ == "__main__":
    main()
