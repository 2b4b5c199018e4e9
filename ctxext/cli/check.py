"""`ctxext check`: do the attention-level methods run, exactly, on this machine (and at what cost)?"""

from __future__ import annotations

import argparse
import json

from tqdm.auto import tqdm

from ..errors import CtxextError
from .aliases import add_alias
from .common import HelpFormatter, add_placement_arguments, parse_lengths

HELP = "check that the attention-level methods run exactly here, under every attention implementation"
DESCRIPTION = """\
Run on a new machine before trusting ctxext's attention-level methods there. On a random model of your
architecture (--model: a config directory, config.json or hub id; only the config is read), for each
attention implementation available on the device (eager, sdpa, flex_attention, FlashAttention where
installed) and each method (rerope, leaky_rerope, self_extend, dual_chunk, string, dpe, gali, logn):

  1. agreement: the logits and weight gradients against a per-cell reference (every score from its
     remapped relative position, float64) on 160 tokens that cross every region boundary, and the logits
     of the last 16 tokens decoded one at a time through the KV cache (the path of generation);
  2. cost: the time and peak memory of one prefill (--backward: forward + backward) at each --lengths,
     every method extending L = length/4 by 4x, against the model's native attention.

Prints two tables; --json writes everything. Exit code 1 if any method disagrees with the reference."""
EPILOG = (
    "examples:\n"
    "  ctxext check --device cpu --lengths 2048                     # default 1B-class LLaMA shape\n"
    "  ctxext check --model Qwen/Qwen2.5-7B --lengths 8192,32768,131072 --backward --json check.json"
)
FORMATTER_CLASS = HelpFormatter  # wraps prose, keeps the examples one a line


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _lengths(text: str) -> list[int]:
    """'8k,32768' -> [8192, 32768], as every command reads lengths; '' -> [] (no cost table)."""
    if not text.strip():
        return []
    try:
        return parse_lengths(text)
    except CtxextError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser) -> None:
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    parser.add_argument(
        "--model",
        default=None,
        metavar="CONFIG",
        help="the architecture: a checkpoint directory, a config.json or a hub id (weights are "
        "not loaded); default: a 1B-class LLaMA shape (head_dim 128, 32 heads, 8 KV heads)",
    )
    parser.add_argument(
        "--method",
        type=_names,
        action="extend",
        default=None,
        metavar="A[,B]",
        help="a method to check (repeat it, or comma-separate; default: rerope,leaky_rerope,self_extend,"
        "dual_chunk,string,dpe,gali,logn)",
    )
    parser.add_argument(
        "--implementations",
        type=_names,
        default=None,
        metavar="A,B",
        help="attention implementations to check (default: every one available on the device)",
    )
    parser.add_argument(
        "--lengths",
        type=_lengths,
        default=[8192, 32768],
        metavar="N,M",
        help="prefill lengths for the cost table, e.g. 8k,32k (default 8192,32768); --lengths '' skips it",
    )
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the cost model (default 1)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="dtype of the cost model: auto, bf16, fp16, fp32 (agreement always runs in fp32)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method and length (median; 3)")
    parser.add_argument(
        "--backward", action="store_true", help="cost of forward + backward (training) instead of a prefill"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="largest relative error (max |diff| / max |reference|) that counts as agreement",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results (both tables, machine, shape) as JSON")
    parser.add_argument(
        "-o", "--output", metavar="DIR", help="write results.json (as --json) and the two tables (tables.txt) to DIR"
    )
    placement = parser.add_argument_group(
        "a device map for --model",
        "check a map before a long eval: against the model's architecture (every weight placed, every module named "
        "exists) and this machine (devices present, memory there); the agreement and cost models still run on --device",
    )
    add_placement_arguments(placement, help_suffix=" (checked here against --model, which it needs)")
    placement.add_argument("--tp", type=int, metavar="N", help=TP_CHECK_HELP)
    add_alias(parser, "--methods", "--method")


TP_CHECK_HELP = (
    "check that --model splits over N tensor-parallel processes (`--tp N` of eval, passkey, search): transformers "
    "has a tensor-parallel plan for its family and N divides its query and key/value heads; nothing is launched"
)


def run(args) -> int:
    from ..outputs import check_output_dir
    from ..verification.check import AGREEMENT_CASES, CheckOptions, run_check

    if args.layers < 1 or args.repeats < 1:
        raise CtxextError(f"--layers and --repeats must be >= 1, got {args.layers} and {args.repeats}")
    if args.output is not None:
        check_output_dir(args.output, [], overwrite=False)
    _check_device_map(args)
    _check_tensor_parallel(args)
    options = CheckOptions(
        device=args.device,
        model=args.model,
        methods=args.method or list(AGREEMENT_CASES),
        implementations=args.implementations,
        lengths=args.lengths,
        layers=args.layers,
        dtype=args.dtype,
        backward=args.backward,
        repeats=args.repeats,
        tolerance=args.tolerance,
    )
    result = run_check(options, progress=lambda total: tqdm(total=total, desc="ctxext check", unit="case"))
    tables = _tables(result, options)
    print(tables)
    _write_results(args, result, tables)
    failed = [f"{row.method} under {row.implementation}" for row in result.agreement if not row.ok]
    print("\n" + ("all methods agree with the reference" if not failed else f"DISAGREEMENT: {', '.join(failed)}"))
    return 1 if failed else 0


def _check_device_map(args) -> None:
    """--device-map/--max-memory: checked against --model's architecture and this machine, and said so."""
    from ..dispatch import check_machine, check_placement, placement_from_flags
    from ..verification.check import load_shape

    placement = placement_from_flags(args.device_map, args.max_memory)
    if placement is None:
        return
    if args.model is None:
        raise CtxextError("--device-map is checked against a model's architecture: give --model")
    check_machine(placement, "auto", 1)
    check_placement(placement, load_shape(args.model))
    what = "the explicit map" if placement.explicit else f"--device-map {placement.device_map}"
    print(f"device map: {what} fits {args.model} on this machine (every weight placed, the devices here)\n")


def _check_tensor_parallel(args) -> None:
    """--tp N: checked against --model's config (its family's plan, its heads), and said so."""
    from ..dispatch import check_tensor_parallel, placement_from_flags
    from ..runtime import check_tensor_parallel_launch
    from ..verification.check import load_shape

    if args.tp is None:
        return
    if args.model is None:
        raise CtxextError("--tp is checked against a model's heads and family: give --model")
    check_tensor_parallel_launch(args.tp, args.tp)  # a whole number >= 1
    config = load_shape(args.model)
    check_tensor_parallel(args.tp, placement_from_flags(args.device_map, args.max_memory), "auto", config)
    print(f"tensor parallel: {args.model} splits over {args.tp} processes (transformers' plan, whole heads each)\n")


def _tables(result, options) -> str:
    """The machine line, the agreement table and (with lengths) the cost table, as printed."""
    from ..verification.check import agreement_table, cost_table

    parts = [
        f"machine: {result.machine}; device {result.device}; shape {result.shape}",
        f"\nagreement with the per-cell reference (relative error, tolerance {result.tolerance:g}, fp32, "
        f"160 tokens, L = 64):",
        agreement_table(result),
    ]
    if result.cost:
        parts += [
            f"\ncost against native attention ({result.native}, {result.dtype}, {options.layers} layer(s), "
            f"each method at 4x: L = length/4):",
            cost_table(result, options.backward),
        ]
    return "\n".join(parts)


def _write_results(args, result, tables: str) -> None:
    """--json FILE, and -o DIR (results.json and tables.txt, written atomically)."""
    from ..outputs import atomic_output_dir, atomic_write_text

    payload = json.dumps(result.to_dict(), indent=2) + "\n"
    if args.json:
        atomic_write_text(args.json, payload)
        print(f"\nwrote {args.json}")
    if args.output is not None:
        with atomic_output_dir(args.output, [], overwrite=False) as staging:
            (staging / "results.json").write_text(payload)
            (staging / "tables.txt").write_text(tables + "\n")
        print(f"\nwrote {args.output}/results.json and tables.txt")
