"""Each command that needs an optional extra says so at once, with the install line, before it loads a model or
computes a cell: the package is hidden here (`sys.modules[name] = None` makes its import fail)."""

import sys
import time

import pytest

from ctxext.cli import main
from ctxext.extras import EXTRAS
from tests.helpers import save_tiny_checkpoint, tiny_model


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory):
    root = tmp_path_factory.mktemp("extras")
    text = root / "docs"  # three documents: compare splits them into calibration and held-out text
    text.mkdir()
    for n in range(3):
        (text / f"doc{n}.txt").write_text(" ".join(f"w{(i * (n + 1)) % 256}" for i in range(2000)))
    return save_tiny_checkpoint(root / "model", tiny_model("llama")), text


def commands(model, text, out):
    """(extra, hidden module, argv) for every command that needs an extra."""
    return [
        ("search", "optuna", ["search", model, "--method", "yarn", "--lengths", 256, "--text-file", text, "-o", out]),
        ("search", "cma", ["compare", model, "--lengths", 128, "--text-file", text, "-o", out]),
        (
            "tasks",
            "lm_eval",
            [
                "compare",
                model,
                "--lengths",
                128,
                "--text-file",
                text,
                "--no-search",
                "--tasks",
                "niah_single_1",
                "-o",
                out,
            ],
        ),
        ("tasks", "lm_eval", ["tasks", model, "--tasks", "niah_single_1", "--lengths", "1k", "-o", out]),
        ("serve", "fastapi", ["serve", model, "--port", 1]),
    ]


@pytest.mark.parametrize("case", range(5))
def test_a_missing_extra_is_one_line_with_its_install_line_before_any_work(
    case, model_and_text, tmp_path, monkeypatch, capsys
):
    model, text = model_and_text
    out = tmp_path / "out"
    extra, hidden, argv = commands(model, text, out)[case]
    monkeypatch.setitem(sys.modules, hidden, None)
    started = time.perf_counter()
    code = main([str(a) for a in argv])
    seconds = time.perf_counter() - started
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert EXTRAS[extra].install in err
    assert not out.exists()  # no cell, no report: nothing was computed
    assert seconds < 5


def test_every_extra_names_modules_that_pyproject_installs_with_it():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    optional = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for name, extra in EXTRAS.items():
        assert name in optional, name
        assert f"ctxext[{name}]" in extra.install
