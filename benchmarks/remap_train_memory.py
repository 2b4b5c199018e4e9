"""Training memory (forward + backward) of the position-remapping methods on a random LLaMA, against plain SDPA.

One training step's activations, not a checkpoint's: a random LLaMA (4 layers, hidden 512, 8 query heads and
2 key/value heads of head_dim 64, intermediate 1408, vocab 4096, untied embeddings, fp32, attention dropout 0,
attn_implementation "sdpa", max_position_embeddings L = 2048, so that every method remaps at 4096 and 8192
tokens) in train mode runs one forward with labels = the (seeded, random) tokens and `loss.backward()`.
Variants, run one after another at each length (interleaved, so drifts in machine load hit all alike):

- `sdpa`:          the unpatched model: transformers' SDPA attention (causal; on CPU PyTorch's fused flash
                   kernel, which saves q, k, v, output and log-sum-exp). The baseline of every ratio.
- `rerope`, `leaky_rerope`, `self_extend`, `dual_chunk`, `string`: `ctxext.patch(model, method, **params)`
                   with the parameters in REMAP_PARAMS; the remapping backend is whatever ctxext picks
                   ("auto": on CPU with gradients, "blockwise", whose backward recomputes the scores), unless
                   --backend forces one through `set_attention_tuning(model, kernel=...)` ("naive" is the O(T^2)
                   reference; "concat", the training path before the blockwise backend, is gone: its
                   figures in git history came from commits before it was removed).

Each measurement runs in a fresh Python process (one variant's freed memory cannot hide another's peak). The
process builds the model, runs a 256-token warm-up step (thread pools, lazy initialisation; at 256 tokens no
method remaps yet) and keeps the parameters' gradient buffers allocated (zeroed), so the measured growth is
the step's activations and transient buffers, not the one-off gradient allocation. Then, inside the probe:

- peak MB:   the process's peak RSS during forward + backward (Linux VmHWM reset just before the step, via
             `remap_memory.PeakRss`; elsewhere a 1 ms polling thread);
- growth MB: peak RSS minus the RSS just before the forward: what the ratios and the targets are about;
- fwd MB:    the same growth measured at the end of the forward (VmHWM then; "-" when polling);
- saved MB:  bytes autograd holds for backward at the end of the forward, counted with
             `torch.autograd.graph.saved_tensors_hooks` (distinct storages, parameters excluded): a
             deterministic view of the activation memory, free of the allocator's noise. --saved-detail
             prints, per variant, the saved storages grouped by shape and dtype.

Then the same step runs once more, under torch's profiler with profile_memory (a second step, so that the
profiler's own records cannot inflate the RSS figures above):

- live MB:   the peak of the bytes held in torch's CPU allocator during that step, over the bytes held before
             it (the running sum of the profiler's allocation and free events): every tensor ctxext, the model
             and autograd hold at once, transients included, and nothing the C allocator keeps after a free.

Growth exceeds saved by the step's transients (logits, the loss's log-softmax, gradients in flight): that is
live - saved. It exceeds live by what glibc's heap keeps resident after frees (growth - live, the "heap" column):
its mmap threshold rises to the largest block freed (up to 32 MiB), so later blocks of that size come from the
heap, where freed holes stay resident. --mmap-threshold 65536 fixes the threshold, so that RSS follows the live
tensors (slower: every large block is mapped anew).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/remap_train_memory.py --lengths 4096,8192 \\
        --json /tmp/train_memory.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/remap_train_memory.py --backend naive --lengths 4096 \\
        --variants sdpa,dual_chunk

Targets, per remapping method: peak RSS growth, live bytes and saved bytes each <= 1.5x sdpa's at every
length. The exit status is 1 when a method misses it (--report-only: 0 either way); the verdicts are printed and
written to --json. A growth ratio that rises from one length to the next by more than --tolerance (default 5%;
single RSS measurements move by a few percent) is flagged, without failing: the saved and live bytes, which
are exact, show whether anything grows with the length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
from remap_memory import PeakRss, _status_kib  # noqa: E402  (the prefill benchmark's RSS probe)

TARGET_GROWTH_RATIO = 1.5
ORIGINAL_LENGTH = 2048
MODEL = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=ORIGINAL_LENGTH,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    attn_implementation="sdpa",
)
# Parameters for L = 2048; dual_chunk (s = 3L/4 = 1536, w = L/16 = 128) and string (S = floor(0.33 L) = 675,
# W = 128) take their defaults.
REMAP_PARAMS = {
    "rerope": {"window": 512, "logn": True},
    "leaky_rerope": {"window": 512, "k": 16.0, "logn": True},
    "self_extend": {"group_size": 8, "window": 512},
    "dual_chunk": {},
    "string": {},
}
VARIANTS = ("sdpa", *REMAP_PARAMS)
WARMUP_TOKENS = 256
MB = 1024  # KiB per MiB (RSS is read in KiB)


# --------------------------------------------------------------------------------------------- worker
class SavedBytes:
    """Counts the distinct storages autograd saves for backward (parameters excluded), by shape and dtype."""

    def __init__(self, parameters):
        self.skip = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, tuple[int, str]] = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.skip and pointer not in self.storages and storage.nbytes() > 0:
            self.storages[pointer] = (storage.nbytes(), f"{tuple(tensor.shape)} {str(tensor.dtype)[6:]}")
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor

    def total(self) -> int:
        return sum(size for size, _ in self.storages.values())

    def by_shape(self) -> dict[str, list]:
        groups: dict[str, list] = {}
        for size, label in self.storages.values():
            count, total = groups.get(label, (0, 0))
            groups[label] = [count + 1, total + size]
        return dict(sorted(groups.items(), key=lambda item: -item[1][1]))


class LiveBytes:
    """The peak, over a block, of the bytes held in torch's CPU allocator above what it held at the start:
    the running sum of the allocation (+) and free (-) events that torch's profiler records with
    profile_memory. Blocks freed inside the block but allocated before it count as negative."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        self.profiler.__exit__(*exc)
        events = self.profiler.profiler.kineto_results.events()
        changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        self.peak = peak_of_running_sum(nbytes for _, nbytes in changes)
        return False


def peak_of_running_sum(changes) -> int:
    running = peak = 0
    for change in changes:
        running += change
        peak = max(peak, running)
    return peak


def build_model(variant: str, backend: str | None, query_block: int | None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ctxext
    from ctxext.patching.attention import set_attention_tuning

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).float()
    if variant != "sdpa":
        ctxext.patch(model, variant, **REMAP_PARAMS[variant])
        if backend or query_block:
            set_attention_tuning(model, query_block=query_block, kernel=backend)
    return model.train()


def worker(args) -> dict:
    import gc

    import torch

    torch.set_num_threads(args.threads)
    model = build_model(args.variant, args.backend, args.query_block)
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, MODEL["vocab_size"], (1, args.length), generator=generator)

    warm = tokens[:, :WARMUP_TOKENS]
    model(warm, labels=warm, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=False)  # gradient buffers stay allocated: the measurement sees activations
    del warm
    gc.collect()

    saved = SavedBytes(model.parameters())
    with PeakRss() as memory:
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = model(tokens, labels=tokens, use_cache=False).loss
        forward_seconds = time.perf_counter() - start
        forward_peak = _status_kib("VmHWM") if memory.poller is None else None
        loss.backward()
        seconds = time.perf_counter() - start
    loss_value = loss.item()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    live_peak = None
    if not args.no_live:
        del loss
        model.zero_grad(set_to_none=False)
        gc.collect()
        with LiveBytes() as live:
            model(tokens, labels=tokens, use_cache=False).loss.backward()
        live_peak = live.peak
    result = {
        "variant": args.variant,
        "length": args.length,
        "backend": args.backend or "auto",
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "forward_seconds": forward_seconds,
        "peak_mb": memory.peak / MB,
        "before_mb": memory.before / MB,
        "growth_mb": (memory.peak - memory.before) / MB,
        "forward_growth_mb": None if forward_peak is None else (forward_peak - memory.before) / MB,
        "saved_mb": saved.total() / 2**20,
        "live_mb": None if live_peak is None else live_peak / 2**20,
        "loss": loss_value,
        "grad_norm": grad_norm.item(),
    }
    if args.saved_detail:
        result["saved_by_shape"] = {label: [count, size / 2**20] for label, (count, size) in saved.by_shape().items()}
    return result


# --------------------------------------------------------------------------------------------- driver
def run_worker(variant: str, length: int, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        "--variant",
        variant,
        "--length",
        str(length),
        "--threads",
        str(args.threads),
    ]
    if args.backend:
        command += ["--backend", args.backend]
    if args.query_block:
        command += ["--query-block", str(args.query_block)]
    if args.saved_detail:
        command.append("--saved-detail")
    if args.no_live:
        command.append("--no-live")
    env = dict(os.environ)
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{variant} at {length} tokens failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio(value, base):
    return value / base if value is not None and base else None


def fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def summarise(rows: list[dict], lengths, variants) -> list[dict]:
    """One row per (length, variant): medians over the rounds, and ratios to sdpa's medians."""
    table = []
    for length in lengths:
        for variant in variants:
            runs = [r for r in rows if r["length"] == length and r["variant"] == variant]
            if not runs:
                continue
            keys = (
                "seconds",
                "forward_seconds",
                "peak_mb",
                "growth_mb",
                "forward_growth_mb",
                "saved_mb",
                "live_mb",
                "loss",
                "grad_norm",
            )
            row = {"length": length, "variant": variant, "rounds": len(runs), "backend": runs[0]["backend"]}
            for key in keys:
                values = [r[key] for r in runs if r.get(key) is not None]
                row[key] = statistics.median(values) if values else None
            table.append(row)
        base = next((r for r in table if r["length"] == length and r["variant"] == "sdpa"), None)
        for row in (r for r in table if r["length"] == length):
            row["heap_mb"] = None if row["live_mb"] is None else row["growth_mb"] - row["live_mb"]
            for key in ("seconds", "growth_mb", "forward_growth_mb", "saved_mb", "live_mb"):
                row[key.replace("_mb", "") + "_ratio"] = ratio(row[key], base and base[key])
    return table


JUDGED_RATIOS = {"growth_ratio": "peak RSS growth", "saved_ratio": "saved bytes", "live_ratio": "live bytes"}


def verdicts(table, lengths, tolerance: float) -> dict:
    """Per method: pass when every judged ratio (those measured) is <= the target at every length; a growth
    ratio rising with the length by more than `tolerance` is noted, not failed (single RSS readings are noisy)."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in table if r["variant"] != "sdpa"):
        rows = {r["length"]: r for r in table if r["variant"] == variant}
        ratios = {n: rows[n]["growth_ratio"] for n in lengths if n in rows}
        if any(ratios.get(n) is None for n in lengths):
            out[variant] = {"ratios": ratios, "pass": None, "why": "no sdpa baseline or a missing length"}
            continue
        over = [
            f"{label} {rows[n][key]:.2f}x at {n}"
            for key, label in JUDGED_RATIOS.items()
            for n in lengths
            if rows[n].get(key) is not None and rows[n][key] > TARGET_GROWTH_RATIO
        ]
        rising = [
            f"growth ratio rises {ratios[a]:.2f} -> {ratios[b]:.2f} from {a} to {b}"
            for a, b in zip(lengths, lengths[1:])
            if ratios[b] > ratios[a] * (1 + tolerance)
        ]
        out[variant] = {
            "ratios": ratios,
            "saved_ratios": {n: rows[n]["saved_ratio"] for n in lengths},
            "live_ratios": {n: rows[n].get("live_ratio") for n in lengths},
            "within_target": not over,
            "not_growing": not rising,
            "pass": not over,
            "why": "; ".join([f"above {TARGET_GROWTH_RATIO}x: " + ", ".join(over)] if over else []),
            "note": "; ".join(rising),
        }
    return out


def print_table(table, args, lengths) -> None:
    print(
        f"\nrandom LLaMA (4 layers, 8/2 heads x 64, hidden 512, mlp 1408, vocab 4096, L {ORIGINAL_LENGTH}), "
        f"fp32, train mode, forward(labels) + backward; remap backend {args.backend or 'auto'}; "
        f"torch threads {args.threads}; median of {args.rounds} round(s)"
        + ("" if args.mmap_threshold is None else f"; MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}")
    )
    print(
        f"{'tokens':>6} {'variant':<13} {'time s':>7} {'x sdpa':>6} {'peak MB':>8} {'growth MB':>9} "
        f"{'x sdpa':>6} {'fwd MB':>7} {'x sdpa':>6} {'saved MB':>8} {'x sdpa':>6} {'live MB':>8} {'x sdpa':>6} "
        f"{'heap MB':>7} {'loss':>7}"
    )
    for length in lengths:
        for r in (r for r in table if r["length"] == length):
            print(
                f"{length:>6} {r['variant']:<13} {r['seconds']:>7.2f} {fmt(r['seconds_ratio'], '.2f', 6)} "
                f"{r['peak_mb']:>8.0f} {r['growth_mb']:>9.0f} {fmt(r['growth_ratio'], '.2f', 6)} "
                f"{fmt(r['forward_growth_mb'], '.0f', 7)} {fmt(r['forward_growth_ratio'], '.2f', 6)} "
                f"{r['saved_mb']:>8.0f} {fmt(r['saved_ratio'], '.2f', 6)} "
                f"{fmt(r['live_mb'], '.0f', 8)} {fmt(r['live_ratio'], '.2f', 6)} {fmt(r['heap_mb'], '.0f', 7)} "
                f"{r['loss']:>7.4f}"
            )
    print(
        "growth: peak RSS over the RSS before the step; saved: autograd's saved tensors at the end of the forward; "
        "live: peak bytes in torch's CPU allocator (a second, profiled step); heap: growth - live, what glibc "
        "kept resident beyond the live tensors"
    )


def print_verdicts(checks: dict, lengths) -> None:
    print(
        f"\ntarget per method: peak RSS growth, saved bytes and live bytes each <= {TARGET_GROWTH_RATIO}x sdpa "
        f"at {', '.join(map(str, lengths))} tokens"
    )
    print(f"  {'method':<13} {'verdict':<7} " + " ".join(f"{f'growth/saved/live {n}':>26}" for n in lengths))
    for variant, check in checks.items():
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[check["pass"]]
        cells = []
        for n in lengths:
            figures = (
                check["ratios"].get(n),
                check.get("saved_ratios", {}).get(n),
                check.get("live_ratios", {}).get(n),
            )
            cells.append(f"{' / '.join(fmt(x, '.2f', 0) for x in figures):>26}")
        extra = "  ".join(part for part in (check["why"], check.get("note", "")) if part)
        print(f"  {variant:<13} {verdict:<7} " + " ".join(cells) + (f"  {extra}" if extra else ""))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Each measurement is one forward (labels = tokens) + backward in "
        "a fresh process; reports time, peak RSS, peak growth over the pre-step RSS, bytes saved for backward "
        "and the peak bytes live in torch's allocator, each with its ratio to plain SDPA, and checks the "
        "target: each ratio <= 1.5x sdpa at every length (exit status 1 when a method misses it).",
        epilog="Example: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/remap_train_memory.py "
        "--lengths 4096,8192 --json /tmp/train_memory.json",
    )
    parser.add_argument("--lengths", default="4096,8192", help="comma-separated token counts (default 4096,8192)")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)} (default all; sdpa is the baseline of every ratio)",
    )
    parser.add_argument(
        "--backend",
        default=None,
        choices=["auto", "blockwise", "naive", "lse", "flex"],
        help="force the remapping backend with set_attention_tuning (default: ctxext's choice, "
        "blockwise for CPU training; naive: the O(T^2) reference)",
    )
    parser.add_argument(
        "--query-block",
        type=int,
        default=None,
        help="queries per block of the remapping kernel (default: ctxext's, 256)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each measurement (default 1)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the table shows medians")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="how much the growth ratio may rise from one length to the next (default 0.05)",
    )
    parser.add_argument(
        "--saved-detail",
        action="store_true",
        help="also print each variant's saved-for-backward storages by shape and dtype",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="set glibc's MALLOC_MMAP_THRESHOLD_ in each measurement (e.g. 65536): every larger "
        "block is mmapped and returned on free, so RSS follows the live tensors instead of "
        "what glibc's heap keeps after frees (default: glibc's own, dynamic threshold)",
    )
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="skip the second, profiled step that measures the live bytes in torch's allocator (halves the time)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="exit 0 even when a method misses the target (default: exit 1 then)",
    )
    parser.add_argument("--json", help="write the raw measurements, the table and the verdicts here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend == "auto":
        args.backend = None

    if args.worker:
        print(json.dumps(worker(args)))
        return

    lengths = [int(x) for x in args.lengths.split(",")]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    rows = []
    started = time.perf_counter()
    plan = [(r, n, v) for r in range(args.rounds) for n in lengths for v in variants]
    for i, (round_, length, variant) in enumerate(plan, 1):
        t0 = time.perf_counter()
        row = run_worker(variant, length, args)
        row["round"] = round_
        rows.append(row)
        print(
            f"[{i}/{len(plan)}] round {round_} {length:>6} {variant:<13} step {row['seconds']:6.2f} s, growth "
            f"{row['growth_mb']:6.0f} MB, saved {row['saved_mb']:6.0f} MB (process {time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    table = summarise(rows, lengths, variants)
    print_table(table, args, lengths)
    checks = verdicts(table, lengths, args.tolerance)
    print_verdicts(checks, lengths)
    if args.saved_detail:
        for row in rows:
            print(
                f"\nsaved for backward, {row['variant']} at {row['length']} (round {row['round']}): "
                f"{row['saved_mb']:.1f} MB"
            )
            for label, (count, size) in row["saved_by_shape"].items():
                print(f"  {size:9.1f} MB  {count:4d} x {label}")
    print(f"\nwall time {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "settings": {
                        **vars(args),
                        "model": MODEL,
                        "remap": REMAP_PARAMS,
                        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    },
                    "runs": rows,
                    "table": table,
                    "verdicts": checks,
                },
                indent=2,
            )
        )
    if not args.report_only and any(check["pass"] is False for check in checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
