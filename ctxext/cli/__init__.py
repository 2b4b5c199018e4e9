"""The `ctxext` command line: one module per command, listed in `COMMANDS`.

A command module is imported only when its command runs (or its --help is asked for), and imports nothing
heavy at the top: `ctxext --help` and `ctxext COMMAND --help` answer without torch or transformers. Each
command module has

    HELP          one line, shown by `ctxext --help` (the same text as its entry in COMMANDS)
    DESCRIPTION   the text at the top of `ctxext COMMAND --help`
    add_arguments(parser)
    run(args) -> int   the exit code; torch, transformers and the library are imported in here

and optionally EPILOG and FORMATTER_CLASS. A `CtxextError` raised by `run` becomes one line on stderr and
exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from ..errors import CtxextError
from .aliases import check_required
from .common import Parser, split_method_params

__all__ = ["COMMANDS", "build_parser", "main", "parse_args"]  # main: the `ctxext` console script

# name -> (module, one-line help), in the order `ctxext --help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "methods": (
        "ctxext.cli.methods",
        "list the scaling methods and their parameters (--model: which apply to a model, and its rope layout)",
    ),
    "patch": ("ctxext.cli.patch", "apply a method to a checkpoint and save the patched checkpoint"),
    "plot-freqs": ("ctxext.cli.plot_freqs", "plot theta'_i/theta_i per pair for one or more methods"),
    "eval": ("ctxext.cli.eval", "sliding-window perplexity at several lengths, for several methods on the same tokens"),
    "passkey": ("ctxext.cli.passkey", "passkey retrieval accuracy per length and depth (Landmark/YaRN format)"),
    "tasks": (
        "ctxext.cli.tasks",
        "lm-evaluation-harness tasks (RULER, LongBench v2, babilong, ...) under several methods, side by side",
    ),
    "finetune": ("ctxext.cli.finetune", "LoRA fine-tuning at a longer context (PI / YaRN / any method), resumable"),
    "search": (
        "ctxext.cli.search",
        "search a method's parameters (LongRoPE's per-pair factors too) on your model and data; resumable",
    ),
    "compare": (
        "ctxext.cli.compare",
        "which method, at its defaults and searched, works for your model, and who serves it",
    ),
    "export": (
        "ctxext.cli.export",
        "which engines (vLLM, SGLang, llama.cpp, transformers) serve a patched model, checked",
    ),
    "check": (
        "ctxext.cli.check",
        "check that the attention-level methods run exactly here, under every attention implementation",
    ),
    "serve": (
        "ctxext.cli.serve",
        "serve a patched checkpoint over an OpenAI-compatible API (transformers serve, with ctxext's methods)",
    ),
}


def build_parser(command: str | None = None) -> tuple[Parser, Parser | None]:
    """The top-level parser, and the subparser of `command` with its arguments (the others stay empty)."""
    parser = Parser(
        prog="ctxext",
        description="Extend the context window of Hugging Face RoPE models: see what a model has, compare the "
        "methods on it, patch a checkpoint, evaluate it, fine-tune it, serve it.",
    )
    parser.add_argument("--version", action="version", version=f"ctxext {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    chosen = None
    for name, (module_name, help_text) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text)  # listed only; its module is not imported
            continue
        module = importlib.import_module(module_name)
        chosen = sub.add_parser(
            name,
            help=help_text,
            description=module.DESCRIPTION,
            epilog=getattr(module, "EPILOG", None),
            formatter_class=getattr(module, "FORMATTER_CLASS", argparse.HelpFormatter),
        )
        module.add_arguments(chosen)
    return parser, chosen


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a command line; method parameter flags (--beta-fast 32) become `param_<name>` attributes."""
    argv = list(argv)
    # Top-level options take no value, so the first word that is not an option is the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    parser, chosen = build_parser(command if command in COMMANDS else None)
    params = {}
    if chosen is not None and chosen.takes_method_params:
        at = argv.index(command) + 1
        rest, params = split_method_params(argv[at:], chosen)
        argv = argv[:at] + rest
    args = parser.parse_args(argv)
    if chosen is not None:
        check_required(chosen, args)
    for name, value in params.items():
        setattr(args, f"param_{name}", value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        build_parser()[0].print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return module.run(args) or 0
    except CtxextError as error:
        print(f"ctxext {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ctxext {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `ctxext methods | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
