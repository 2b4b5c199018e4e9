"""Training-free quality at 4x and 8x on SmolLM2: every remapping method next to the model's native quality.

Data: the first N tokens of Hamlet followed by Richard III (N = 32768 for 4x, 65536 for 8x; SmolLM2's L is 8192),
or of the texts of --documents.
- A method: one window over those N tokens, every token scored (`sliding_window_nll` with window = stride = N).
- Native: the unpatched model over the same N tokens in 8192-token windows with stride 4096.
Each (method, length) cell is cached in --output/cells.json as soon as it is done, so the table builds up over
several runs and a cell is never recomputed. Prints the table with the ratio to native.

    CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/remap_quality.py --lengths 32768 [--methods ...]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# label -> (method, parameters); reasonable settings for L = 8192 (see docs/METHODS.md for each rule).
METHODS = {
    "none": ("none", {}),
    "yarn x4": ("yarn", {"factor": 4}),
    "yarn x8": ("yarn", {"factor": 8}),
    "rerope w1024 +logn": ("rerope", {"window": 1024, "logn": True}),
    "leaky_rerope w1024 k16 +logn": ("leaky_rerope", {"window": 1024, "k": 16.0, "logn": True}),
    "self_extend G8 w1024": ("self_extend", {"group_size": 8, "window": 1024}),
    "self_extend G16 w2048": ("self_extend", {"group_size": 16, "window": 2048}),
    # finer groups than G16 at the same window (largest r' at 64k: 65535//12 + 2048 - 170 = 7339 < L)
    "self_extend G12 w2048": ("self_extend", {"group_size": 12, "window": 2048}),
    "dual_chunk (defaults)": ("dual_chunk", {}),
    "dpe w1024 fast G4 slow G16": ("dpe", {"window": 1024, "group_scales": [4, 4, 4, 4, 4, 16, 16, 16]}),
    # the best of dpe's needle-ppl search at 32k (docs/comparison.md), the moonshot's dpe at 64k
    "dpe searched 32k w3028": ("dpe", {"window": 3028, "group_scales": [8, 4, 8, 16, 1, 32, 16, 16]}),
    "string (defaults)": ("string", {}),
    "gali (defaults)": ("gali", {}),  # w 1, R = L: every relative position below L
    "proportional x4": ("proportional", {"factor": 4}),
    "cope (defaults)": ("cope", {}),
}
NATIVE = "native (8k windows, stride 4k)"
DOCUMENTS = ("hamlet_gut", "richard_iii_gut")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="32768", help="comma-separated N (default 32768)")
    parser.add_argument("--methods", default=",".join(METHODS), help="labels from METHODS, comma-separated")
    parser.add_argument(
        "--documents",
        default=",".join(DOCUMENTS),
        help="Shakespeare texts, concatenated, whose first N tokens are scored (default %(default)s; a held-out "
        "text for searched settings, e.g. othello_gut,lear_gut: 96k tokens)",
    )
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--output", default=str(REPO / "outputs" / "remap-quality"))
    args = parser.parse_args()

    import torch

    import ctxext
    from ctxext import assets
    from ctxext.eval.perplexity import perplexity, sliding_window_nll
    from ctxext.loading import load_model, load_tokenizer
    from ctxext.runtime import machine_description

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    cells_path = out / "cells.json"
    cells = json.loads(cells_path.read_text()) if cells_path.exists() else {}

    checkpoint = assets.smollm2_checkpoint()
    tokenizer = load_tokenizer(str(checkpoint))
    documents = [d.strip() for d in args.documents.split(",")]
    text_name = " + ".join(documents)
    ids = tokenizer(assets.shakespeare_text(documents), return_tensors="pt").input_ids[0]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = load_model(str(checkpoint), dtype=dtype, device="cpu", attn_implementation="sdpa")
    lengths = [int(x) for x in args.lengths.split(",")]
    labels = [NATIVE] + [m.strip() for m in args.methods.split(",")]

    for length in lengths:
        if ids.numel() < length:
            raise SystemExit(f"only {ids.numel()} tokens of text, fewer than {length}")
        tokens = ids[:length]
        for label in labels:
            key = cell_key(label, length, documents)
            if key in cells:
                continue
            start = time.perf_counter()
            if label == NATIVE:
                ctxext.unpatch(model)
                nll, n = sliding_window_nll(model, tokens[None], 8192, 4096)
            else:
                method, params = METHODS[label]
                ctxext.patch(model, method, **params)
                nll, n = sliding_window_nll(model, tokens[None], length, length)
            cells[key] = {
                "nll": nll,
                "tokens": n,
                "perplexity": perplexity(nll, n),
                "seconds": round(time.perf_counter() - start, 1),
            }
            cells_path.write_text(json.dumps(cells, indent=1))
            print(f"{key:<46} {cells[key]['perplexity']:8.2f}  ({cells[key]['seconds']:.0f} s)", flush=True)

    print(
        f"\nSmolLM2-135M-Instruct, {args.dtype}, SDPA; {machine_description()}; torch threads {torch.get_num_threads()}"
    )
    for length in lengths:
        native = cells.get(cell_key(NATIVE, length, documents))
        print(f"\nfirst {length} tokens of {text_name} ({length / 8192:g}x L):")
        print(f"{'method':<34} {'perplexity':>10} {'/ native':>9} {'time':>7}")
        for label in labels:
            cell = cells.get(cell_key(label, length, documents))
            if cell is None:
                continue
            ratio = cell["perplexity"] / native["perplexity"] if native else math.nan
            print(f"{label:<34} {cell['perplexity']:10.2f} {ratio:9.3f} {cell['seconds']:6.0f}s")
    return 0


def cell_key(label: str, length: int, documents: list[str]) -> str:
    """A cell's name in cells.json; the default text keeps the names cells have always had."""
    text = "" if tuple(documents) == DOCUMENTS else f" on {'+'.join(documents)}"
    return f"{label} @ {length}{text}"


if __name__ == "__main__":
    raise SystemExit(main())
