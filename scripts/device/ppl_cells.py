"""Held-out perplexity cells of the moonshot: each method of a sweep YAML over one window of the first N tokens
of a text, every token scored, and the unpatched model's native reference over the same N tokens in L-token
windows with stride L/2 (L: the model's trained length), as benchmarks/remap_quality.py scores 4x and 8x.

Each cell is written to DIR/cells.json as soon as it is done, named by what it computed (method, N, text,
dtype, device kind, the checkpoint's content), so an interrupted run, or a copy of DIR on another machine,
computes only the cells still missing. Prints the table with each method's ratio to native.

    python3 scripts/device/ppl_cells.py MODEL --config scripts/device/moonshot128.yaml --length 131072 \
        --documents othello_gut,lear_gut,coriolanus_gut --device cuda --dtype fp32 --cells DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HELD_OUT = "othello_gut,lear_gut,coriolanus_gut"  # the comparison page's held-out plays: 148,820 tokens


def native_label(original: int) -> str:
    return f"native ({original}-token windows, stride {original // 2})"


def cell_key(label: str, length: int, documents: str, dtype: str, device: str, model: str) -> str:
    return f"{label} @ {length} on {documents}, {dtype}, {device}, model {model}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--config", required=True, help="a `ctxext tasks`/`ctxext eval` sweep YAML (methods: [...])")
    parser.add_argument("--length", type=int, default=131072, help="tokens of the one window (default 131072)")
    parser.add_argument("--documents", default=HELD_OUT, help="Shakespeare texts, concatenated (default %(default)s)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--cells", required=True, help="folder of cells.json (created; resumed from)")
    parser.add_argument("--only", default=None, help="comma-separated method names: only these of --config")
    parser.add_argument("--no-native", action="store_true", help="leave out the native reference")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from ctxext import assets
    from ctxext.eval.perplexity import perplexity, sliding_window_nll
    from ctxext.eval.rows import EvalMethod, MethodSelection, mapping_row
    from ctxext.eval.session import model_identity
    from ctxext.loading import load_model, load_tokenizer

    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    device = torch.device(args.device)
    model = load_model(args.model, dtype=dtype, device=device, attn_implementation="sdpa", progress=False)
    original = int(
        getattr(model.config, "original_max_position_embeddings", None) or model.config.max_position_embeddings
    )
    identity = model_identity(args.model, model)
    fingerprint = str(identity.get("content") or json.dumps(identity, sort_keys=True))[:16]
    documents = [d.strip() for d in args.documents.split(",")]
    text = "+".join(documents)
    ids = load_tokenizer(args.model)(assets.shakespeare_text(documents), return_tensors="pt").input_ids[0]
    if ids.numel() < args.length:
        raise SystemExit(f"ppl_cells: only {ids.numel()} tokens in {text}, fewer than {args.length}")
    tokens = ids[: args.length][None]

    rows = [] if args.no_native else [EvalMethod(native_label(original))]
    only = None if args.only is None else set(args.only.split(","))
    mappings = [m for m in MethodSelection(config=args.config).mappings() if only is None or m["method"] in only]
    rows += [mapping_row(m, model.config) for m in mappings]
    out = Path(args.cells)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cells.json"
    cells = json.loads(path.read_text()) if path.exists() else {}
    keys = {row.label: cell_key(row.label, args.length, text, args.dtype, device.type, fingerprint) for row in rows}
    for row in rows:
        key = keys[row.label]
        if key in cells:
            print(f"cached: {key}", flush=True)
            continue
        began, cpu_began = time.perf_counter(), time.process_time()
        row.apply(model)
        if row.config is None:  # native: the unpatched model in windows of its trained length
            nll, n = sliding_window_nll(model, tokens, original, original // 2)
        else:
            nll, n = sliding_window_nll(model, tokens, args.length, args.length)
        row.remove(model)
        cells[key] = {
            "method": row.description or {"method": "none"},
            "nll": nll,
            "tokens": n,
            "perplexity": perplexity(nll, n),
            "seconds": round(time.perf_counter() - began, 1),
            "cpu_seconds": round(time.process_time() - cpu_began, 1),  # all threads: the work, not the waits
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }
        path.write_text(json.dumps(cells, indent=1) + "\n")  # at once: a killed run keeps every finished cell
        done = cells[key]
        print(f"{key}: {done['perplexity']:.3f} ({done['seconds']:.0f} s, CPU {done['cpu_seconds']:.0f} s)", flush=True)

    native = cells.get(cell_key(native_label(original), args.length, text, args.dtype, device.type, fingerprint))
    print(f"\n{args.length} tokens of {text}, {args.dtype}, {device.type}")
    for row in rows:
        cell = cells[keys[row.label]]
        ratio = f"{cell['perplexity'] / native['perplexity']:.3f}" if native else "-"
        print(f"{row.label:<40} {cell['perplexity']:10.3f} {ratio:>7} {cell['seconds']:8.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
