"""docs/comparison.md, the method comparison page on SmolLM2-135M: `ctxext compare` with the page's settings.

This script only holds the page's protocol and runs `ctxext compare` (ctxext.compare) with it:

- SmolLM2-135M-Instruct (L = 8192, `ctxext.assets`), bf16, SDPA, at 16k (s = 2) and 32k (s = 4);
- held out: Othello, King Lear, Coriolanus; calibration (searches only): Hamlet followed by Richard III;
- searched rows: every searchable method but dpe with objective ppl (12 trials), and dpe, rerope, leaky_rerope,
  dual_chunk again with needle-ppl (8 trials, keys seeded by 1);
- passkey at 8192 (the unpatched model: the baseline of the effective length) and 16384;
- cells and searches in docs/comparison_cells/ (committed: the page is rebuilt from them, never recomputed).
- notes on rows from docs/comparison_notes.md (--page-notes): what was found about a row outside the cells.

It prints the `ctxext compare` command it runs. --methods and --lengths narrow what is computed, not the page: a
narrowed run computes its cells, then the page is written from every cached cell (report-only), with every method
at every default length. Without --report-only, missing cells and searches are computed (hours on a 2-core CPU).

    .venv/bin/python scripts/compare_methods.py --report-only      # the page from the committed cells
    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python scripts/compare_methods.py --methods rerope --lengths 32768
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

L = 8192
CALIBRATION = "hamlet_gut+richard_iii_gut"
HELD_OUT = ("othello_gut", "lear_gut", "coriolanus_gut")
DEFAULT_LENGTHS = (16384, 32768)  # the page's columns: 2x and 4x L
PASSKEY_LENGTHS = (8192, 16384)
NEEDLE_METHODS = ("dpe", "rerope", "leaky_rerope", "dual_chunk")
PPL_SEARCH_SKIP = ("dpe",)  # searched with needle-ppl only: eight scales, and a perplexity search costs retrieval
MODEL_NAME = "SmolLM2-135M-Instruct"
NOTES = REPO / "docs" / "comparison_notes.md"  # findings the cells cannot show, under the table


def full_searches(search_trials: int, needle_methods: list[str], needle_trials: int) -> list[str]:
    """The --full-search values of the page: objective ppl for all but PPL_SEARCH_SKIP, needle-ppl for a few."""
    kinds = [f"ppl:{search_trials}:" + ",".join(f"-{m}" for m in PPL_SEARCH_SKIP)] if search_trials else []
    if needle_methods and needle_trials:
        kinds.append(f"needle-ppl:{needle_trials}:{','.join(needle_methods)}")
    return kinds


def compare_argv(model: str, args, lengths: list[int], methods: str | None, report_only: bool, page: Path) -> list:
    """The `ctxext compare` command line of the page's protocol at `lengths` for `methods` (None: every one)."""
    needle_methods = [m for m in args.needle_methods.split(",") if m]
    held_out = args.held_out.split(",")
    argv = [
        "compare", model, "--lengths", ",".join(str(n) for n in lengths),
        "--dataset", f"shakespeare:{CALIBRATION},{','.join(held_out)}",
        "--calibration", CALIBRATION, "--held-out", ",".join(held_out),
        "--passkey-lengths", ",".join(str(n) for n in args.passkey_lengths if n == L or n in lengths),
        "--dtype", args.dtype, "--attn-implementation", "sdpa", "--device", args.device,
        "--model-name", MODEL_NAME, "--cache-dir", str(args.cells), "--page", str(page),
        "--page-notes", str(NOTES),
    ]  # fmt: skip
    for kind in full_searches(args.search_trials, needle_methods, args.needle_trials):
        argv += ["--full-search", kind]
    if not args.search_trials and not (needle_methods and args.needle_trials):
        argv.append("--no-search")
    if methods:
        argv += ["--method", methods]
    if report_only:
        argv.append("--report-only")
    return argv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--lengths",
        default=",".join(str(n) for n in DEFAULT_LENGTHS),
        help="comma-separated N to compute (default %(default)s); the page also shows every default length",
    )
    parser.add_argument(
        "--methods", default=None, help="comma-separated methods to compute (default: every one); the page has all"
    )
    parser.add_argument("--held-out", default=",".join(HELD_OUT), help="Shakespeare texts scored (default %(default)s)")
    parser.add_argument(
        "--passkey-lengths",
        default=",".join(str(n) for n in PASSKEY_LENGTHS),
        help="comma-separated passkey lengths (default %(default)s); 8192 runs only the unpatched model",
    )
    parser.add_argument("--search-trials", type=int, default=12, help="trials per ppl search (default 12; 0: none)")
    parser.add_argument(
        "--needle-methods",
        default=",".join(NEEDLE_METHODS),
        help="methods also searched with the needle-ppl objective (default %(default)s; empty: none)",
    )
    parser.add_argument("--needle-trials", type=int, default=8, help="trials per needle-ppl search (default 8)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop computing after this many minutes (every kept cell and trial stays), then write the page",
    )
    parser.add_argument("--report-only", action="store_true", help="write the page from the cached cells only")
    parser.add_argument("--output", default=str(REPO / "docs"), help="where comparison.md/.png/.json go")
    parser.add_argument(
        "--cells",
        default=str(REPO / "docs" / "comparison_cells"),
        help="where the computed cells and searches are kept (default %(default)s, committed)",
    )
    args = parser.parse_args()
    args.passkey_lengths = [int(n) for n in args.passkey_lengths.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from ctxext import assets
    from ctxext.cli import main as ctxext_main

    model = str(assets.smollm2_checkpoint())
    asked = sorted({int(n) for n in args.lengths.split(",")})
    page = Path(args.output) / "comparison.md"
    with tempfile.TemporaryDirectory() as scratch:
        runs = []
        if not args.report_only:  # compute the narrowed cells (their page is scratch), then the whole page
            runs.append(compare_argv(model, args, asked, args.methods, False, Path(scratch) / "narrowed.md"))
        runs.append(compare_argv(model, args, sorted({*DEFAULT_LENGTHS, *asked}), None, True, page))
        for argv in runs:
            print("ctxext " + shlex.join(argv), flush=True)
            report_only = "--report-only" in argv
            code = ctxext_main([*argv, "--no-progress"]) if report_only else computed(argv, args.max_minutes)
            if code != 0:
                return code
    return 0


def computed(argv: list[str], max_minutes: float | None) -> int:
    """Run a computing `ctxext compare` in a child process, stopped after `max_minutes` (cells are written atomically
    and searches resume, so a stopped run loses at most the cell or trial in progress); its exit code, 0 if stopped."""
    import subprocess

    try:
        return subprocess.run(
            [sys.executable, "-m", "ctxext", *argv, "--no-progress"],
            timeout=(None if max_minutes is None else 60 * max_minutes),
        ).returncode
    except subprocess.TimeoutExpired:
        print(f"stopped after {max_minutes:g} minutes; run the same command again to go on", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
