"""Peak memory and time of the position-remapping methods' prefill on SmolLM2-135M, against plain SDPA.

Variants of one forward pass (prefill, `logits_to_keep=1`, no KV cache) over the first N tokens of
Hamlet + Richard III, run one after another at each length (interleaved, so load drifts hit all alike):

- `sdpa`:   the unpatched model, transformers' SDPA attention (causal). The baseline for every ratio.
- `rerope`, `leaky_rerope`, `self_extend`, `dual_chunk`, `string`: ctxext's blockwise remapping kernel
            (exact log-sum-exp merge of the regions), with the parameters in REMAP_PARAMS.
- `naive`:  ReRoPE in Su's reference form: full L x L score matrices per layer, a per-cell choice, one
            softmax. Run only where its estimated peak fits in the free memory.

Each measurement runs in a fresh Python process (so one variant's freed memory cannot hide another's
peak). Memory is the process's peak RSS during the forward (Linux VmHWM, reset just before it; on GPU,
torch.cuda.max_memory_allocated), reported both in total and as the increase over the RSS before the
forward. A second table times the attention kernels alone, for one layer's shapes.

    CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/remap_memory.py [--lengths 4096,8192,16384]
        [--variants sdpa,rerope,naive] [--window 512] [--dtype fp32] [--json results.json] [--csv results.csv]

Targets: every remapping method's peak memory <= 1.5x plain SDPA and time <= 3x plain SDPA at the same length.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TARGET_MEMORY, TARGET_TIME = 1.5, 3.0
REPO = Path(__file__).resolve().parents[1]
# Parameters for SmolLM2 (L = 8192) beyond its length; ReRoPE's window comes from --window.
REMAP_PARAMS = {
    "rerope": {"logn": True},
    "leaky_rerope": {"k": 16.0, "logn": True},
    "self_extend": {"group_size": 8, "window": 1024},
    "dual_chunk": {},
    "string": {},
}


# ------------------------------------------------------------------------------------ memory probes
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRss:
    """Peak resident memory over a block: VmHWM after resetting it (Linux), else a 1 ms polling thread."""

    def __enter__(self):
        gc.collect()
        self.before = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.poller = None
        except OSError:
            self.samples = [self.before]
            self.stop = threading.Event()
            self.poller = threading.Thread(target=self._poll, daemon=True)
            self.poller.start()
        return self

    def _poll(self):
        while not self.stop.is_set():
            self.samples.append(_status_kib("VmRSS"))
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.poller is None:
            self.peak = _status_kib("VmHWM")
        else:
            self.stop.set()
            self.poller.join()
            self.peak = max(self.samples)
        return False


# --------------------------------------------------------------------------------------- workers
def worker_model(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ctxext
    from ctxext import assets
    from ctxext.config import load_method_config
    from ctxext.patching.attention import set_attention_tuning

    device = torch.device(args.device)
    path = assets.smollm2_checkpoint()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model = model.eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = assets.shakespeare_text(assets.HAMLET_RICHARD3)
    tokens = tokenizer(text, return_tensors="pt").input_ids[:, : args.length].to(device)
    if tokens.shape[1] < args.length:
        raise SystemExit(f"only {tokens.shape[1]} tokens of text for --length {args.length}")
    if args.variant == "naive":
        load_method_config(REPO / "configs/methods/rerope.yaml", {"window": args.window}).apply(model)
        set_attention_tuning(model, kernel="naive", query_block=args.query_block)
    elif args.variant != "sdpa":
        params = dict(REMAP_PARAMS[args.variant])
        if args.variant in ("rerope", "leaky_rerope"):
            params["window"] = args.window
        ctxext.patch(model, args.variant, **params)
        set_attention_tuning(model, query_block=args.query_block)
    with torch.inference_mode():
        model(tokens[:, :256], logits_to_keep=1, use_cache=False)  # warm-up: thread pools, allocator
        memory = PeakRss() if device.type == "cpu" else None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before_gpu = torch.cuda.memory_allocated()
        with memory or contextlib.nullcontext():
            start = time.perf_counter()
            logits = model(tokens, logits_to_keep=1, use_cache=False).logits
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
    result = {
        "variant": args.variant,
        "length": args.length,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if memory is not None:
        result.update(
            peak_mb=memory.peak / 1024, before_mb=memory.before / 1024, increase_mb=(memory.peak - memory.before) / 1024
        )
    else:
        peak = torch.cuda.max_memory_allocated()
        result.update(peak_mb=peak / 2**20, before_mb=before_gpu / 2**20, increase_mb=(peak - before_gpu) / 2**20)
    torch.save(logits[0, -1].float().cpu(), args.logits_out)
    return result


def worker_kernel(args) -> dict:
    """The attention of one SmolLM2 layer alone: 9 query heads, 3 key/value heads, head_dim 64."""
    import torch
    import torch.nn.functional as F

    from ctxext.patching.remap_kernel import rerope_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, n = 9, 3, 64, args.length
    q = torch.randn(1, heads, n, dim)
    k, v = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
    with torch.inference_mode():
        if args.variant == "sdpa":

            def run():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            q_far, k_far = torch.randn_like(q), torch.randn_like(k)
            kernel = "naive" if args.variant == "naive" else "auto"

            def run():
                return rerope_attention(
                    q, q_far, k, k_far, v, args.window, dim**-0.5, query_block=args.query_block, kernel=kernel
                )

        run()  # warm-up
        with PeakRss() as memory:
            start = time.perf_counter()
            run()
            seconds = time.perf_counter() - start
    return {
        "variant": args.variant,
        "length": n,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "peak_mb": memory.peak / 1024,
        "before_mb": memory.before / 1024,
        "increase_mb": (memory.peak - memory.before) / 1024,
    }


# ------------------------------------------------------------------------------------------ driver
def naive_fits(length: int, model: bool) -> bool:
    """Su's form holds about three H x L x L fp32 matrices at once (two score sets, then where/softmax)."""
    needed = 3.5 * 9 * length * length * 4 + (1.5e9 if model else 0)
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable"))
    return needed < 0.7 * available


def run_worker(mode: str, variant: str, length: int, args, logits_out: str) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        mode,
        "--variant",
        variant,
        "--length",
        str(length),
        "--window",
        str(args.window),
        "--query-block",
        str(args.query_block),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--logits-out",
        logits_out,
    ] + (["--threads", str(args.threads)] if args.threads else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode}/{variant} at {length} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio(value, base):
    return value / base if base else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384", help="comma-separated token counts")
    parser.add_argument(
        "--variants",
        default="sdpa,rerope,leaky_rerope,self_extend,dual_chunk,string,naive",
        help="sdpa (first: the baseline), naive, and any of " + ", ".join(REMAP_PARAMS),
    )
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="model dtype (default fp32)")
    parser.add_argument("--window", type=int, default=512, help="ReRoPE window w (default 512)")
    parser.add_argument("--query-block", type=int, default=256, help="queries per block of the ReRoPE kernel")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads in each measurement (default: torch's choice); 1 is steadier on a "
        "machine shared with other jobs",
    )
    parser.add_argument("--skip-kernels", action="store_true", help="skip the attention-only table")
    parser.add_argument("--json", help="write all measurements here")
    parser.add_argument("--csv", help="write all measurements here")
    parser.add_argument("--worker", choices=["model", "kernel"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--logits-out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        result = worker_model(args) if args.worker == "model" else worker_kernel(args)
        print(json.dumps(result))
        return

    import torch
    from tqdm import tqdm

    lengths = [int(x) for x in args.lengths.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="remap_bench_"))
    plan = [
        (mode, length, variant)
        for mode in (["model"] + ([] if args.skip_kernels else ["kernel"]))
        for length in lengths
        for variant in variants
        if mode == "model" or variant in ("sdpa", "rerope", "naive")
    ]  # the kernel table is ReRoPE's
    for mode, length, variant in tqdm(plan, desc="measurements", unit="run"):
        if variant == "naive" and not naive_fits(length, mode == "model"):
            rows.append({"mode": mode, "variant": variant, "length": length, "skipped": "does not fit in memory"})
            continue
        logits_out = str(scratch / f"{mode}-{variant}-{length}.pt")
        rows.append({"mode": mode, **run_worker(mode, variant, length, args, logits_out), "logits": logits_out})

    for mode, title in (
        ("model", f"SmolLM2-135M {args.dtype} prefill (logits_to_keep=1)"),
        ("kernel", "attention of one layer alone (9 q heads, 3 kv heads, d=64)"),
    ):
        table = [r for r in rows if r["mode"] == mode]
        if not table:
            continue
        threads = table[0].get("threads", args.threads or torch.get_num_threads())
        print(f"\n{title}; w={args.window}, block {args.query_block}, torch threads {threads}")
        print(
            f"{'length':>7} {'variant':<12} {'time s':>8} {'x sdpa':>7} {'peak MB':>8} {'x sdpa':>7} "
            f"{'forward +MB':>11} {'x sdpa':>7}  check"
        )
        for length in lengths:
            base = next(
                (r for r in table if r["length"] == length and r["variant"] == "sdpa" and "skipped" not in r), None
            )
            naive = next(
                (r for r in table if r["length"] == length and r["variant"] == "naive" and "skipped" not in r), None
            )
            for r in (r for r in table if r["length"] == length):
                if "skipped" in r:
                    print(f"{length:>7} {r['variant']:<12} skipped: {r['skipped']}")
                    continue
                check = ""
                if mode == "model" and r["variant"] == "rerope" and naive is not None:
                    logits = torch.load(r["logits"], weights_only=True)  # a tensor (run_worker's torch.save)
                    diff = (logits - torch.load(naive["logits"], weights_only=True)).abs().max().item()
                    r["max_abs_diff_vs_naive"] = diff
                    check = f"last logits vs naive: {diff:.1e}"
                if base is not None:
                    r["time_ratio"] = ratio(r["seconds"], base["seconds"])
                    r["peak_ratio"] = ratio(r["peak_mb"], base["peak_mb"])
                    r["increase_ratio"] = ratio(r["increase_mb"], base["increase_mb"])
                print(
                    f"{length:>7} {r['variant']:<12} {r['seconds']:>8.2f} {r.get('time_ratio', float('nan')):>7.2f} "
                    f"{r['peak_mb']:>8.0f} {r.get('peak_ratio', float('nan')):>7.2f} {r['increase_mb']:>11.0f} "
                    f"{r.get('increase_ratio', float('nan')):>7.2f}  {check}"
                )
    print(f"\ntargets for every remapping method: time <= {TARGET_TIME}x sdpa, peak memory <= {TARGET_MEMORY}x sdpa")
    for row in rows:
        row.pop("logits", None)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.csv:
        keys = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
