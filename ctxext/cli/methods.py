"""`ctxext methods`: the scaling methods and their parameters."""

from __future__ import annotations

HELP = "list the scaling methods and their parameters"
DESCRIPTION = (
    "List every scaling method with its parameters; -v adds each parameter's default and meaning, and "
    "each method's source."
)


def add_arguments(parser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="show every parameter with its default")


def run(args) -> int:
    from ..methods import METHODS

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
