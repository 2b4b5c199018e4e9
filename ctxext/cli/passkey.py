"""`ctxext passkey`: passkey retrieval accuracy per length and depth (Landmark/YaRN format)."""

from __future__ import annotations

from pathlib import Path

from .aliases import add_alias
from .common import (
    DEFAULT_LENGTHS,
    add_method_arguments,
    add_runtime_arguments,
    method_selection,
    parse_depths,
    parse_lengths,
)
from .evaluation import invocation, runtime_options

HELP = "passkey retrieval accuracy per length and depth (Landmark/YaRN format)"
DESCRIPTION = (
    "Hide a random 1-50000 pass key at each --passkey-depths fraction of a filler text of each --lengths "
    "size, decode 10 tokens greedily, and count a success when the first integer of the output is "
    "the key. The keys are seeded, so every method sees the same prompts. Writes results.json "
    "(every trial's output), results.csv, table.txt and a heat map passkey.png to --output."
)
EPILOG = "example: ctxext passkey my-model --method yarn --factor 2 --lengths 4k,8k,16k --passkey-trials 5 -o pk-out"


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a local checkpoint directory or a hub id")
    parser.add_argument(
        "--lengths",
        default=DEFAULT_LENGTHS,
        metavar="N,N,...",
        help=f"prompt lengths in tokens (default {DEFAULT_LENGTHS})",
    )
    parser.add_argument(
        "--passkey-depths",
        default="0,0.25,0.5,0.75,1",
        metavar="D,D,...",
        help="where the key sits: 0 = start, 1 = just before the question (default 0,0.25,0.5,0.75,1)",
    )
    parser.add_argument(
        "--passkey-trials", type=int, default=5, metavar="N", help="keys per length and depth (default 5)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the keys (default 0)")
    parser.add_argument("--no-baseline", action="store_true", help="do not add the 'none' (plain RoPE) baseline")
    parser.add_argument("-o", "--output", required=True, help="directory for results.json, results.csv, passkey.png")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it already holds something")
    add_runtime_arguments(parser, decoding=True)
    add_method_arguments(parser, multiple=True)
    parser.set_defaults(text_file=None, dataset=None)
    add_alias(parser, "--depths", "--passkey-depths")
    add_alias(parser, "--trials", "--passkey-trials")


def request(args):
    """The PasskeyRequest the arguments ask for."""
    from ..eval.passkey_workflow import PasskeyRequest

    return PasskeyRequest(
        model=args.model,
        lengths=parse_lengths(args.lengths),
        depths=parse_depths(args.passkey_depths),
        trials=args.passkey_trials,
        seed=args.seed,
        methods=method_selection(args),
        runtime=runtime_options(args),
        output=args.output,
        overwrite=args.overwrite,
        invocation=invocation(args),
    )


def run(args) -> int:
    from ..eval.passkey_workflow import evaluate_passkey

    result = evaluate_passkey(request(args), log=lambda line: print(line, flush=True))
    if not result.main_process:
        return 0
    print()
    print(result.table)
    print(f"\nresults: {Path(args.output).resolve()} (results.json, results.csv, passkey.png)")
    return 0
