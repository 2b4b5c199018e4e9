"""The `ctxext` command line: patch | methods | plot-freqs (and the subcommands other modules add)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

import yaml

from .errors import CtxextError

# Modules that add subcommands: each has `register(subparsers)`; a subcommand's handler is `args.handler(args)`.
SUBCOMMAND_MODULES: tuple[str, ...] = ("ctxext.eval.cli", "ctxext.train.cli")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_value(text: str):
    """A flag's value: int, float, or YAML (true/false, lists) — '1e6' is a float here, unlike in YAML 1.1."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _method_param_names() -> list[str]:
    from .methods import METHODS

    names = []
    for method in METHODS.values():
        for f in dataclasses.fields(method.params_cls):
            if f.name not in names and f.name not in ("factor",):
                names.append(f.name)
    return names


def add_method_arguments(parser: argparse.ArgumentParser, multiple: bool = False) -> None:
    """--method/--config/--factor/--original-max-position-embeddings plus one flag per method parameter."""
    group = parser.add_argument_group("method (flags override keys from --config)")
    group.add_argument(
        "--method", action="append" if multiple else "store", default=None, metavar="NAME",
        help="scaling method (see 'ctxext methods')" + ("; repeat to compare several" if multiple else ""),
    )
    group.add_argument("--config", metavar="YAML", help="method YAML, e.g. configs/methods/yarn.yaml")
    group.add_argument("--factor", type=parse_value, default=argparse.SUPPRESS, metavar="S",
                       help="scale s = L'/L (>= 1), default 1")
    group.add_argument("--original-max-position-embeddings", dest="original_max_position_embeddings",
                       type=parse_value, default=argparse.SUPPRESS, metavar="L",
                       help="the pre-training context L (default: the model's max_position_embeddings)")
    group.add_argument("--logn", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                       help="log-n query scaling on top of the method: the query at position n is multiplied by "
                            "max(1, ln n / ln L)")
    for name in _method_param_names():
        group.add_argument(f"--{name.replace('_', '-')}", dest=f"param_{name}", type=parse_value,
                           default=argparse.SUPPRESS, metavar="V", help=argparse.SUPPRESS)


def method_overrides(args: argparse.Namespace) -> dict:
    """The method keys given as flags (everything but --method/--config)."""
    overrides = {}
    for key, value in vars(args).items():
        if key.startswith("param_"):
            overrides[key.removeprefix("param_")] = value
        elif key in ("factor", "original_max_position_embeddings", "logn"):
            overrides[key] = value
    return overrides


def method_config_from_args(args: argparse.Namespace):
    """One MethodConfig from --config and flags (single-method commands)."""
    from .config import load_method_config

    overrides = method_overrides(args)
    if args.method is not None:
        overrides["method"] = args.method
    if args.config is None and args.method is None:
        raise CtxextError("give a method with --method NAME or --config FILE (see 'ctxext methods')")
    return load_method_config(args.config, overrides)


# ---------------------------------------------------------------------------------------------- methods
def cmd_methods(args) -> int:
    from .methods import METHODS

    for method in METHODS.values():
        print(f"{method.name:<13} {method.summary}")
        if args.verbose:
            print(f"{'':13} source: {method.source}")
            for name, default, help_text in method.param_help():
                print(f"{'':15}--{name.replace('_', '-'):<18} (default {default!r}) {help_text}")
        else:
            print(f"{'':13} parameters: {', '.join(name for name, _, _ in method.param_help())}")
    print("\nAny method also takes --logn (YAML 'logn: true'): log-n query scaling, max(1, ln n / ln L).")
    if not args.verbose:
        print("Run 'ctxext methods -v' for each parameter's default and meaning, and each method's source.")
    return 0


# ------------------------------------------------------------------------------------------------ patch
def cmd_patch(args) -> int:
    from .loading import load_config, load_model, load_tokenizer
    from .outputs import atomic_output_dir, check_output_dir
    from .patching import applied_method
    from .patching.families import check_supported

    method_config = method_config_from_args(args)
    protected = [args.model] if Path(args.model).exists() else []
    check_output_dir(args.output, protected, args.overwrite)
    config = load_config(args.model)
    check_supported(config, f"'{args.model}' (model type '{config.model_type}')")

    model = load_model(args.model, dtype="auto", device="cpu")
    tokenizer = load_tokenizer(args.model)
    original_length = model.config.max_position_embeddings
    method_config.apply(model)
    applied = applied_method(model)

    with atomic_output_dir(args.output, protected, args.overwrite) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {
            "source_model": args.model,
            "ctxext_version": _version(),
            **method_config.to_dict(),
            "original_max_position_embeddings": applied["original_max_position_embeddings"],
            "rope_parameters": dict(model.config.rope_parameters),
            "max_position_embeddings": model.config.max_position_embeddings,
        }
        (staging / "ctxext.yaml").write_text(
            "# Written by `ctxext patch`: what was applied to the source model.\n"
            + yaml.safe_dump(record, sort_keys=False)
        )
    print(f"patched {args.model} with {method_config.label}")
    print(f"  rope_parameters: {dict(model.config.rope_parameters)}")
    print(f"  max_position_embeddings: {original_length} -> {model.config.max_position_embeddings}")
    native = not applied["rope_type"].startswith("ctxext_")
    if applied["attention"]:  # log-n / ReRoPE live in patched attention layers, re-installed by `import ctxext`
        print(f"  attention: {applied['attention']}")
        native_note = ("the frequencies only; log-n/ReRoPE need `import ctxext` first" if native
                       else "after `import ctxext`")
    else:
        native_note = "yes" if native else "after `import ctxext`"
    print(f"  loads in plain transformers: {native_note}")
    print(f"  saved to {Path(args.output).resolve()}")
    return 0


def _version() -> str:
    from . import __version__

    return __version__


# ------------------------------------------------------------------------------------------- plot-freqs
def cmd_plot_freqs(args) -> int:
    from .config import load_method_config
    from .freqplot import frequency_ratios, plot_frequency_ratios

    if not args.method:
        raise CtxextError("give at least one --method")
    overrides = method_overrides(args)
    configs = [load_method_config(None, {**overrides, "method": m}) for m in args.method]
    if args.head_dim <= 2 or args.head_dim % 2:
        raise CtxextError(f"--head-dim must be an even number > 2, got {args.head_dim}")
    L = overrides.get("original_max_position_embeddings", args.original_length)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    plot_frequency_ratios(configs, args.head_dim, args.base, L, output)
    for config in configs:
        ratio = frequency_ratios(config, args.head_dim, args.base, L)
        kept = int((ratio > 0.999).sum())
        interpolated = int((ratio < 1.001 / config.factor).sum()) if config.factor > 1 else 0
        print(f"{config.label:<16} kept {kept:3d}, interpolated by s {interpolated:3d}, "
              f"in between {len(ratio) - kept - interpolated:3d} of {len(ratio)} pairs")
    print(f"saved {output}")
    return 0


# ------------------------------------------------------------------------------------------------- main
def build_parser() -> Parser:
    parser = Parser(prog="ctxext", description="Extend the context window of LLaMA, Mistral, Qwen2 and Qwen3 models "
                    "with RoPE scaling: patch a checkpoint, evaluate it, fine-tune it.")
    parser.add_argument("--version", action="version", version=f"ctxext {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    p = sub.add_parser("methods", help="list the scaling methods and their parameters")
    p.add_argument("-v", "--verbose", action="store_true", help="show every parameter with its default")
    p.set_defaults(handler=cmd_methods)

    p = sub.add_parser(
        "patch", help="apply a method to a checkpoint and save the patched checkpoint",
        description="Load MODEL, apply a scaling method, and write a complete checkpoint (weights, config, "
                    "tokenizer, ctxext.yaml) to --output, atomically. The source is never modified. "
                    "Method parameters are flags named like the YAML keys, e.g. --beta-fast 32, --beta 0.625.",
    )
    p.add_argument("model", help="a local checkpoint directory or a hub id")
    p.add_argument("-o", "--output", required=True, help="directory to write the patched checkpoint to")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it already exists")
    add_method_arguments(p)
    p.set_defaults(handler=cmd_patch)

    p = sub.add_parser(
        "plot-freqs", help="plot theta'_i/theta_i per pair for one or more methods",
        description="Save a PNG of the per-pair frequency ratio of each method: 1 = extrapolated (kept), "
                    "1/s = interpolated, in between = ramped. No model needed.",
    )
    p.add_argument("--head-dim", type=int, default=128, help="rotary dimension d (default 128)")
    p.add_argument("--base", type=float, default=10000.0, help="RoPE base (default 10000)")
    p.add_argument("--original-length", type=int, default=4096, help="pre-training context L (default 4096)")
    p.add_argument("-o", "--output", default="freqs.png", help="PNG path (default freqs.png)")
    add_method_arguments(p, multiple=True)
    p.set_defaults(handler=cmd_plot_freqs)

    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    try:
        return args.handler(args) or 0
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
