"""Old spellings of options, kept working: hidden from --help, and each use prints one line naming the new one.

The command line has one spelling per concept (tests/test_cli_vocabulary.py walks every parser): `--method`
(repeatable, comma-separated), `--lengths` (with "k"), `--passkey-depths`/`--passkey-trials`, `--held-out-docs`
(a count) and `--held-out` (names), `--cache-dir`, `-o/--output`, `--recipe` for finetune's recipe and
`--config` for a method YAML. What was spelled otherwise before stays an alias here.
"""

from __future__ import annotations

import argparse
import sys


class _Renamed(argparse.Action):
    """Acts as the option it was renamed to, after saying so on stderr."""

    def __init__(self, option_strings, dest, target: argparse.Action, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.target = target

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"ctxext: {option_string} is now {self.target.option_strings[-1]}; the old spelling will go",
            file=sys.stderr,
        )
        self.target(parser, namespace, values, option_string)


def add_alias(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Make `old` a hidden spelling of the option `new`, which `parser` (or one of its groups) already has.

    argparse counts a required option as given only under its own spelling, so a required `new` is made
    optional here and `check_required` (called after parsing) asks for it instead."""
    target = next(action for action in parser._actions if new in action.option_strings)
    if target.required:
        target.required = False
        parser.set_defaults(**{target.dest: None})
        parser.required_through_aliases = [*getattr(parser, "required_through_aliases", []), target]
    parser.add_argument(
        old,
        action=_Renamed,
        target=target,
        dest=target.dest,
        nargs=target.nargs,
        type=target.type,
        choices=target.choices,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


def check_required(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse's 'required' error for the required options that have an alias (see `add_alias`)."""
    for target in getattr(parser, "required_through_aliases", []):
        if getattr(args, target.dest, None) is None:
            parser.error(f"the following arguments are required: {'/'.join(target.option_strings)}")
