"""The command line starts fast: --help of ctxext and of every command imports neither torch nor transformers,
and the method parameter flags, which are not argparse options any more, still parse and still fail clearly."""

import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from ctxext.cli import COMMANDS, build_parser, main, parse_args
from ctxext.errors import CtxextError

REPO = Path(__file__).resolve().parents[1]


def imported_modules(*argv: str) -> set[str]:
    """Top-level names of the modules `python -X importtime -m ctxext ARGV` imports (in a fresh process)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ctxext", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    names = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    assert "ctxext" in names  # the parse above read the importtime lines
    return names


@pytest.mark.parametrize(
    "argv", [["--help"], *[[name, "--help"] for name in COMMANDS]], ids=lambda argv: " ".join(argv)
)
def test_help_imports_neither_torch_nor_transformers(argv):
    names = imported_modules(*argv)
    assert not {"torch", "transformers"} & names


def test_import_ctxext_is_light_and_registers_once_transformers_is_imported():
    # The registration itself (rope types, load hook) is tested by the round trips in a fresh process
    # (tests/test_roundtrip.py); here: `import ctxext` alone pulls in nothing heavy.
    code = "import sys, ctxext; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


@pytest.mark.parametrize("then", ["import peft", "from peft import LoraConfig", "from trl import SFTTrainer"])
def test_import_ctxext_then_a_library_that_imports_transformers_registers_everything(then):
    """`import ctxext` then `import peft` (what trainers such as axolotl do first): PEFT imports transformers
    while it is half-imported itself, and the adapter hooks, which import PEFT, wait until it is whole (this
    raised ImportError: cannot import name 'PeftModel' from partially initialized module 'peft')."""
    code = (
        f"import sys, ctxext; {then}; "
        "print(all(name in sys.modules for name in ('ctxext.patching', 'ctxext.integrations.hooks')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def without_spaces(text: str) -> str:
    """`text` with all whitespace gone: argparse re-wraps lines (and breaks words at hyphens)."""
    return "".join(text.split())


def required_argv(parser) -> list[str]:
    """A value for each required argument of `parser` (its first choice where it has choices); an option with an
    old spelling is required after parsing (ctxext.cli.aliases), not by argparse."""
    argv = []
    required_after_parsing = getattr(parser, "required_through_aliases", [])
    for action in parser._actions:
        required = action.required or action in required_after_parsing
        if action.nargs in (0, "?", "*") or (action.option_strings and not required):
            continue
        argv += action.option_strings[:1] + [str(next(iter(action.choices)) if action.choices else "1")]
    return argv


def test_help_lists_each_command_with_its_help_and_shows_its_description():
    top = without_spaces(build_parser()[0].format_help())
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        assert help_text == module.HELP, name
        assert without_spaces(f"{name} {help_text}") in top, name
        text = build_parser(name)[1].format_help()
        assert text.startswith(f"usage: ctxext {name} "), name
        assert without_spaces(module.DESCRIPTION) in without_spaces(text), name


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_runs_its_modules_run_and_reports_its_errors_in_one_line(name, monkeypatch, capsys):
    module = importlib.import_module(COMMANDS[name][0])
    argv = [name, *required_argv(build_parser(name)[1])]
    seen = []
    monkeypatch.setattr(module, "run", lambda args: seen.append(args.command) or 7)
    assert main(argv) == 7 and seen == [name]

    def refuse(args):
        raise CtxextError("the input is wrong")

    monkeypatch.setattr(module, "run", refuse)
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == f"ctxext {name}: error: the input is wrong\n"


def method_parameter_flags() -> set[str]:
    from ctxext.methods import METHODS

    return {
        f"--{f.name.replace('_', '-')}"
        for method in METHODS.values()
        for f in dataclasses.fields(method.params_cls)
        if f.name != "factor"
    }


def test_no_method_parameter_is_taken_for_an_option():
    # A method parameter flag that is an option of the command, or a prefix of one (argparse accepts
    # abbreviations), would never reach the method.
    for name in COMMANDS:
        _, parser = build_parser(name)
        if not parser.takes_method_params:
            continue
        options = [s for action in parser._actions for s in action.option_strings]
        for flag in method_parameter_flags():
            assert not [o for o in options if o.startswith(flag)], (name, flag)


@pytest.mark.parametrize(
    "argv",
    [
        ["patch", "MODEL", "--beta-fast", "16", "--beta-slow=2", "-o", "OUT", "--method", "yarn"],
        ["patch", "--beta-fast", "16", "MODEL", "--beta-slow", "2", "--method", "yarn", "-o", "OUT"],  # before MODEL
    ],
)
def test_method_parameter_flags_become_parameters(argv):
    args = parse_args(argv)
    assert (args.model, args.output, args.method) == ("MODEL", "OUT", "yarn")
    assert (args.param_beta_fast, args.param_beta_slow) == (16, 2)


def test_method_parameter_values_read_like_yaml():
    args = parse_args(
        ["eval", "M", "-o", "O", "--method", "theta", "--new-base", "1e6", "--dynamic", "true", "--beta", "-0.5"]
    )
    assert (args.param_new_base, args.param_dynamic, args.param_beta) == (1e6, True, -0.5)
    assert isinstance(args.param_new_base, float)


def test_a_method_parameter_without_value_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["patch", "MODEL", "--method", "yarn", "--beta-fast", "-o", "OUT"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--beta-fast" in err


def test_an_unknown_method_parameter_fails_with_did_you_mean(tmp_path, capsys):
    code = main(["plot-freqs", "--method", "yarn", "--beta-fsat", "16", "-o", str(tmp_path / "f.png")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "did you mean 'beta-fast'" in err, err
    assert not (tmp_path / "f.png").exists()


def test_options_still_abbreviate():
    args = parse_args(["patch", "MODEL", "--meth", "yarn", "--fact", "2", "-o", "OUT"])
    assert (args.method, args.factor) == ("yarn", 2)
    assert not [k for k in vars(args) if k.startswith("param_")]
