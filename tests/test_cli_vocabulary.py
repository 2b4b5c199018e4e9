"""One spelling per concept across every command: the parsers are walked, and a second visible spelling of an
agreed concept fails. Old spellings stay as hidden aliases that print one line and parse as the new one."""

import argparse

import pytest

from ctxext.cli import COMMANDS, build_parser, parse_args

# The old spellings: hidden wherever they still parse, never shown by --help. (compare's `--held-out` names the
# held-out documents, the agreed spelling for names; a count is `--held-out-docs` everywhere.)
OLD_SPELLINGS = {
    "--methods": "--method",
    "--length": "--lengths",
    "--depths": "--passkey-depths",
    "--cache": "--cache-dir",
    "--original-length": "--original-max-position-embeddings",
}
# Per command, old spellings whose new name differs by command.
COMMAND_OLD_SPELLINGS = {
    "passkey": {"--trials": "--passkey-trials"},
    "search": {"--held-out": "--held-out-docs"},
    "finetune": {"--config": "--recipe"},
}
WRITE_NO_FILES = {"methods", "serve"}  # every other command takes -o/--output


def visible_options(command: str) -> dict[str, argparse.Action]:
    parser = build_parser(command)[1]
    return {
        option: action
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
    }


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_shows_a_second_spelling_of_an_agreed_concept(command):
    shown = visible_options(command)
    old = {**OLD_SPELLINGS, **COMMAND_OLD_SPELLINGS.get(command, {})}
    assert not set(shown) & set(old), f"ctxext {command} shows old spellings: {sorted(set(shown) & set(old))}"


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - WRITE_NO_FILES))
def test_every_command_that_writes_takes_dash_o(command):
    shown = visible_options(command)
    assert "-o" in shown and "--output" in shown, f"ctxext {command} has no -o/--output"


def aliases():
    for command in COMMANDS:
        parser = build_parser(command)[1]
        hidden = {o for a in parser._actions if a.help == argparse.SUPPRESS for o in a.option_strings}
        for old, new in {**OLD_SPELLINGS, **COMMAND_OLD_SPELLINGS.get(command, {})}.items():
            if old in hidden:
                yield command, old, new


ALIASES = list(aliases())


def test_the_old_spellings_are_still_taken():
    commands = {command for command, _, _ in ALIASES}
    assert {"check", "passkey", "search", "finetune", "plot-freqs"} <= commands


@pytest.mark.parametrize("command,old,new", ALIASES)
def test_an_old_spelling_parses_as_the_new_one_and_says_so(command, old, new, capsys):
    value = "8192" if new in ("--lengths", "--original-max-position-embeddings", "--held-out-docs") else "1"
    value = "0.5" if new == "--passkey-depths" else value
    value = "x.yaml" if new == "--recipe" else value
    value = "yarn" if new == "--method" else value
    value = "cache" if new == "--cache-dir" else value
    head = [command] + (["MODEL"] if command in ("passkey", "search", "compare", "eval", "tasks") else [])
    tail = ["-o", "out"] if command in ("passkey", "search", "compare") else []
    lengths = ["--lengths", "8192"] if command in ("compare", "search") and new != "--lengths" else []
    method = ["--method", "yarn"] if command in ("search", "plot-freqs") and new != "--method" else []
    capsys.readouterr()
    with_new = parse_args([*head, *lengths, *method, new, value, *tail])
    assert capsys.readouterr().err == ""
    with_old = parse_args([*head, *lengths, *method, old, value, *tail])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and old in err and new in err
    assert vars(with_old) == vars(with_new)
