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
  chunks; DPE w 1024, G 4 fast / 16 slow). `dpe_searched`: the moonshot's dpe (searched at 32k: w 3028,
  G 8,4,8,16,1,32,16,16), the setting of the 64k needle cells.

`--sample T` times what a needle cell's sample costs instead: the prefill of the N-token prompt (the texts in
TEXTS, as many as N needs) and T greedy tokens after it, per variant and round; the first round of a variant
includes what its first call compiles (flex_attention on CUDA), so it is reported apart from the others.
`--device cuda` runs on a GPU (each step is timed between two device synchronisations); `--clock cpu` times
process CPU time instead of wall time, for a CPU shared with other work (the ratio then counts the work done,
not the waits for a core). `--cells DIR` keeps each variant's result in DIR as soon as its rounds are done,
keyed by what it measured (the machine included): a rerun on the same machine computes only what is missing.
`--profile DIR` runs one more decode step per variant under torch.profiler and writes its busiest operations
to DIR/profile_<variant>.txt, with `ops_per_step`, the aten operators in it that compute (a kernel launch each
on a GPU: a decode step of a 135M model there is bound by launches), and on CUDA `syncs_per_step`, the step's
host-device synchronisations (torch's sync debug mode).

    CTXEXT_CACHE_DIR=.cache OMP_NUM_THREADS=1 .venv/bin/python benchmarks/remap_decode.py [--length 4096]
        [--steps 16] [--rounds 3] [--variants sdpa,dual_chunk] [--dtype bf16] [--random-cache] [--json out.json]
        [--sample 128] [--device cuda] [--clock cpu] [--cells DIR] [--profile DIR] [--model CHECKPOINT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import warnings
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
    "dpe_searched": {"window": 3028, "group_scales": [8, 4, 8, 16, 1, 32, 16, 16]},
    "gali": {},
}
# The prompt of --sample: the page's calibration text first (as without --sample), then its held-out plays
# (what scripts/device/pack.sh carries to a lent GPU), as many as the length needs.
TEXTS = ("hamlet_gut", "richard_iii_gut", "othello_gut", "lear_gut", "coriolanus_gut")


def method_of(variant: str) -> str:
    return "dpe" if variant == "dpe_searched" else variant


def random_cache(config, length: int, dtype, device="cpu"):
    """A DynamicCache holding `length` seeded random keys and values in every layer (the same for every call)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    generator = torch.Generator(device).manual_seed(0)  # on the device: a 64k cache is 3 GB of fp32 draws
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (1, config.num_key_value_heads, length, head_dim)
    for layer in range(config.num_hidden_layers):
        keys, values = (torch.randn(shape, generator=generator, device=device).to(dtype) for _ in range(2))
        cache.update(keys, values, layer)
    return cache


class Clock:
    """Seconds of wall time (after the device has finished what was queued) or of process CPU time."""

    def __init__(self, device, kind: str = "wall"):
        self.device, self.kind = device, kind

    def __call__(self) -> float:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.process_time() if self.kind == "cpu" else time.perf_counter()


def decode_step_seconds(model, prompt, steps: int, random_length: int | None = None, clock=None) -> float:
    """Median seconds of one greedy decode step after a prefill of `prompt` (the prefill is not timed), or after
    a random cache of `random_length` tokens and one untimed step."""
    import torch

    clock = clock or Clock(prompt.device)
    with torch.no_grad():
        if random_length is None:
            out = model(prompt, use_cache=True, logits_to_keep=1)
        else:
            cache = random_cache(model.config, random_length, model.dtype, prompt.device)
            out = model(prompt[:, :1], past_key_values=cache)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            began = clock()
            out = model(token, past_key_values=cache, use_cache=True)
            times.append(clock() - began)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times)


def sample_seconds(model, prompt, tokens: int, clock=None) -> dict:
    """One needle-like sample: the prefill of `prompt` and `tokens` greedy tokens after it (seconds of each)."""
    import torch

    clock = clock or Clock(prompt.device)
    with torch.no_grad():
        began = clock()
        out = model(prompt, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        prefilled = clock()
        cache = out.past_key_values
        for _ in range(tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        done = clock()
    return {"prefill": prefilled - began, "decode": done - prefilled, "total": done - began}


def profile_step(model, prompt, random_length: int | None, path: Path) -> int | None:
    """One decode step under torch.profiler, its busiest operations written to `path`: (on CUDA the number of
    host-device synchronisations it makes, else None; the number of aten operators that compute)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = prompt.device
    with torch.no_grad():
        if random_length is None:
            out = model(prompt, use_cache=True, logits_to_keep=1)
        else:
            out = model(prompt[:, :1], past_key_values=random_cache(model.config, random_length, model.dtype, device))
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        out = model(token, past_key_values=cache, use_cache=True)  # the kept keys exist from here on
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        syncs = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = model(token, past_key_values=cache, use_cache=True)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            model(token, past_key_values=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    launched = len(kernel_ops(prof.events()))
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
    except (AttributeError, KeyError, ValueError):  # torch before 2.4 names device time after CUDA
        table = prof.key_averages().table(sort_by=sort.replace("device", "cuda"), row_limit=30)
    path.write_text(
        f"host-device synchronisations in one step: {syncs}\noperators that compute: {launched}\n\n{table}\n"
    )
    return syncs, launched


# Operators that only make views, allocate, read a scalar or return their input: no device kernel of their own
# (a `to` or `contiguous` that copies shows its copy as a child, which is counted instead).
_NO_KERNEL_NAMES = (
    "view as_strided slice select reshape _reshape_alias unsqueeze expand transpose t permute alias detach detach_ "
    "squeeze flatten empty empty_strided empty_like _unsafe_view split unbind narrow lift_fresh resolve_conj "
    "resolve_neg real result_type item _local_scalar_dense is_nonzero is_same_size to contiguous"
)
NO_KERNEL = set(_NO_KERNEL_NAMES.split())


def kernel_ops(events) -> list:
    """The profiled aten operators that compute (a kernel each on a GPU): those with no computing aten child."""

    def computes(event) -> bool:
        return event.name.startswith("aten::") and event.name.removeprefix("aten::") not in NO_KERNEL

    return [e for e in events if computes(e) and not any(computes(c) for c in e.cpu_children)]


def cell_name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json"


def prompt_tokens(tokenizer, length: int):
    """The first `length` tokens of TEXTS, read one text at a time until there are enough."""
    import torch

    from ctxext import assets

    ids: list[int] = []
    for count in range(1, len(TEXTS) + 1):
        ids = tokenizer(assets.shakespeare_text(list(TEXTS[:count])), add_special_tokens=False).input_ids
        if len(ids) >= length:
            break
    if len(ids) < length:
        raise SystemExit(f"only {len(ids)} tokens of text in {'+'.join(TEXTS)}, fewer than {length}")
    return torch.tensor(ids[:length])[None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens before decoding (default 4096)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is kept)")
    parser.add_argument("--variants", default="sdpa," + ",".join(v for v in DECODE_PARAMS if v != "dpe_searched"))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument(
        "--random-cache", action="store_true", help="random keys and values in the cache instead of a prefill"
    )
    parser.add_argument("--sample", type=int, default=None, metavar="T", help="time prefill + T generated tokens")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="wall time or process CPU time")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--cells", default=None, help="keep each variant's result here; a rerun resumes")
    parser.add_argument("--profile", default=None, metavar="DIR", help="profile one decode step per variant")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v != "sdpa" and v not in DECODE_PARAMS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from sdpa, {', '.join(DECODE_PARAMS)}")
    if args.sample is not None and (args.random_cache or args.sample < 1):
        parser.error("--sample T needs T >= 1 and a real prompt (not --random-cache)")
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu times the CPU's work: only with --device cpu")

    import torch

    import ctxext
    from ctxext import assets
    from ctxext.eval.session import model_identity
    from ctxext.loading import load_model, load_tokenizer
    from ctxext.runtime import machine_description

    checkpoint = args.model or str(assets.smollm2_checkpoint())
    device = torch.device(args.device)
    model = load_model(
        checkpoint,
        dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
        device=device,
        attn_implementation="sdpa",
        progress=False,
    )
    if args.random_cache:
        prompt = torch.tensor([[1]])
    else:
        prompt = prompt_tokens(load_tokenizer(checkpoint), args.length)
    prompt = prompt.to(device)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else machine_description()
    mode = (
        {"sample_tokens": args.sample}
        if args.sample
        else {"steps": args.steps, "random_cache": args.random_cache, "clock": args.clock}
    )
    common = {
        "benchmark": "remap_decode v2",
        "model": model_identity(checkpoint, model),
        "length": args.length,
        "rounds": args.rounds,
        "dtype": args.dtype,
        "device": device.type,
        "machine": machine,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        **mode,
    }
    cells = Path(args.cells) if args.cells else None
    keys = {v: {**common, "variant": v, "params": DECODE_PARAMS.get(v, {})} for v in variants}
    done = {}
    if cells is not None:
        cells.mkdir(parents=True, exist_ok=True)
        for v in variants:
            path = cells / cell_name(keys[v])
            if path.exists():
                done[v] = json.loads(path.read_text())["result"]
                print(f"cached: {v}", flush=True)
    profiles = Path(args.profile) if args.profile else None
    if profiles is not None:
        profiles.mkdir(parents=True, exist_ok=True)
    clock = Clock(device, args.clock)
    random_length = args.length if args.random_cache else None
    todo = [v for v in variants if v not in done]
    measured = {v: [] for v in todo}
    for round_ in range(args.rounds):
        for variant in todo:
            ctxext.unpatch(model)
            if variant != "sdpa":
                ctxext.patch(model, method_of(variant), **DECODE_PARAMS[variant])
            if args.sample:
                measured[variant].append(sample_seconds(model, prompt, args.sample, clock))
                shown = ", ".join(f"{k} {v:.2f} s" for k, v in measured[variant][-1].items())
                print(f"round {round_ + 1}: {variant:<13} {shown}", flush=True)
            else:
                measured[variant].append(decode_step_seconds(model, prompt, args.steps, random_length, clock))
                print(f"round {round_ + 1}: {variant:<13} {1000 * measured[variant][-1]:7.1f} ms/step", flush=True)
            if round_ == args.rounds - 1:
                result = summary(measured[variant], bool(args.sample))
                if profiles is not None:
                    result["syncs_per_step"], result["ops_per_step"] = profile_step(
                        model, prompt, random_length, profiles / f"profile_{variant}.txt"
                    )
                done[variant] = result
                if cells is not None:
                    (cells / cell_name(keys[variant])).write_text(
                        json.dumps({"key": keys[variant], "result": result}, indent=1) + "\n"
                    )
    ctxext.unpatch(model)
    return report(args, variants, done, machine, common)


def summary(rounds: list, sample: bool) -> dict:
    """A variant's result from its rounds: the median step, or for samples the first round (compilation
    included) and the median of the later ones."""
    if not sample:
        return {"seconds_per_step": statistics.median(rounds), "rounds": rounds}
    later = rounds[1:] or rounds
    return {
        "first": rounds[0],
        "seconds": {part: statistics.median(r[part] for r in later) for part in ("prefill", "decode", "total")},
        "rounds": rounds,
    }


def report(args, variants: list[str], done: dict, machine: str, common: dict) -> int:
    def value(variant):
        result = done[variant]
        return result["seconds"]["total"] if args.sample else result["seconds_per_step"]

    base = value("sdpa") if "sdpa" in done else None
    what = f"prefill + {args.sample} tokens" if args.sample else f"{args.steps} steps, {args.clock} clock"
    source = "random cache" if args.random_cache else "prompt"
    print(f"\n{args.length}-token {source}, {what} x {args.rounds} rounds, {args.dtype}, {args.device}, {machine}")
    header = f"{'variant':<14}{'prefill s':>10}{'decode s':>10}{'total s':>9}" if args.sample else f"{'variant':<14}"
    print(header + (f"{'x sdpa':>8}" if args.sample else f"{'ms/step':>9}{'x sdpa':>8}"))
    rows = []
    for variant in variants:
        result = done[variant]
        ratio = value(variant) / base if base else None
        rows.append({"variant": variant, "params": DECODE_PARAMS.get(variant, {}), **result, "ratio_to_sdpa": ratio})
        if args.sample:
            s = result["seconds"]
            line = f"{variant:<14}{s['prefill']:10.2f}{s['decode']:10.2f}{s['total']:9.2f}"
        else:
            line = f"{variant:<14}{1000 * result['seconds_per_step']:9.1f}"
        print(line + (f"{ratio:8.2f}" if ratio else ""))
        if "ops_per_step" in result:
            syncs = result["syncs_per_step"]
            print(f"{'':<14}one decode step: {result['ops_per_step']} computing operators, {syncs} synchronisations")
    if args.json:
        Path(args.json).write_text(json.dumps({**common, "results": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
