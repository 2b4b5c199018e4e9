"""`ctxext eval`: sliding-window perplexity at several lengths, several methods on the same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import (
    DEFAULT_LENGTHS,
    add_data_arguments,
    add_method_arguments,
    add_runtime_arguments,
    method_selection,
    parse_lengths,
    parse_stride,
)
from .evaluation import data_options, invocation, runtime_options

HELP = "sliding-window perplexity at several lengths, for several methods on the same tokens"
DESCRIPTION = (
    "Perplexity of MODEL at each --lengths value, per the protocol in docs/METHODS.md: windows of that "
    "length advance by --stride; each token is scored once (earlier targets get label -100); "
    "exp(token-weighted mean NLL) over all documents; documents are evaluated separately and one "
    "shorter than a window is skipped (reported) or, with --short-docs truncate, scored in one "
    "shorter window. --stride window is one pass per document (YaRN's tables). Every method is "
    "scored on exactly the same tokens; 'none' (plain RoPE) is always included as the baseline. "
    "Without --method/--config the model is evaluated as loaded. Writes results.json (with "
    "provenance), results.csv, table.txt and perplexity.png to --output. Each (method, length) cell is "
    "kept as soon as it is done: after a failure the finished cells are written with the error, and the "
    "same command computes only the missing ones. "
    "Under `accelerate launch -m ctxext eval ...` the windows are shared among the processes."
)
EPILOG = (
    "example: ctxext eval my-model --method linear --method yarn --factor 2 --lengths 2k,4k,8k,16k "
    "--dataset pg19 --max-docs 20 -o eval-out"
)


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory or a hub id")
    parser.add_argument(
        "--lengths",
        default=DEFAULT_LENGTHS,
        metavar="N,N,...",
        help=f"windows (evaluated contexts) in tokens, e.g. 2048,4096 or 2k,4k (default {DEFAULT_LENGTHS})",
    )
    parser.add_argument(
        "--stride",
        default="256",
        metavar="S",
        help="how far each window advances (default 256; a window not longer than it advances by "
        "half its length); 'window' = one pass per document",
    )
    parser.add_argument(
        "--short-docs",
        choices=("skip", "truncate"),
        default="skip",
        help="a document shorter than the window: skip it (default; reported) or score it in one "
        "window of its own length",
    )
    parser.add_argument("--no-baseline", action="store_true", help="do not add the 'none' (plain RoPE) baseline")
    parser.add_argument("-o", "--output", required=True, help="directory for results.json, results.csv, perplexity.png")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --output if it holds an earlier ctxext result"
    )
    cache = parser.add_argument_group("cache of finished cells")
    cache.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where each (method, length) result is kept as soon as it is done (default: .OUTPUT.cells beside "
        "--output, removed once the output is complete); give one to share cells between runs",
    )
    cache.add_argument("--no-cache", action="store_true", help="neither read nor write cached cells")
    add_data_arguments(parser)
    add_runtime_arguments(parser)
    add_method_arguments(parser, multiple=True)


def request(args):
    """The PerplexityRequest the arguments ask for."""
    from ..eval.workflow import PerplexityRequest

    return PerplexityRequest(
        model=args.model,
        data=data_options(args),
        lengths=parse_lengths(args.lengths),
        stride=parse_stride(args.stride),
        short_docs=args.short_docs,
        methods=method_selection(args),
        runtime=runtime_options(args),
        output=args.output,
        overwrite=args.overwrite,
        cache_dir=args.cache_dir,
        use_cache=not args.no_cache,
        invocation=invocation(args),
    )


def run(args) -> int:
    from ..eval.workflow import evaluate_perplexity

    try:
        result = evaluate_perplexity(request(args), log=lambda line: print(line, flush=True))
    except BaseException:
        _tell_what_was_kept(args, sys.stderr)
        raise
    if not result.main_process:
        return 0
    print()
    print(result.table)
    for length, names in result.skipped.items():
        print(
            f"skipped at {length}: {len(names)} documents shorter than the window ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''})"
        )
    if result.cells_cached:
        cache = result.payload["runtime"]["cell_cache"]
        print(f"\n{result.cells_cached} of {len(result.rows)} cells from the cache ({cache}), not computed again")
    print(f"\nresults: {Path(args.output).resolve()} (results.json, results.csv, perplexity.png)")
    return 0


def _tell_what_was_kept(args, stream) -> None:
    """After a failure: where the finished cells are, and that the same command resumes."""
    from ..eval.workflow import incomplete_output

    if incomplete_output(args.output):
        print(
            f"ctxext eval: the finished cells are written to {args.output} (results.json has the error); the same "
            "command computes only the missing ones",
            file=stream,
        )
