"""A checkpoint that cannot be loaded is one line that names the cause, with the original error chained."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ctxext.errors import CtxextError
from ctxext.loading import describe_failure, load_config, load_model, load_tokenizer
from tests.helpers import save_tiny_checkpoint, tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("good") / "tiny", tiny_model("llama"))


def damaged(checkpoint: Path, tmp_path: Path, damage) -> str:
    """A copy of the checkpoint with `damage(folder)` done to it."""
    folder = tmp_path / "damaged"
    shutil.copytree(checkpoint, folder)
    damage(folder)
    return str(folder)


def truncate_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def shrink_mlp(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))


# (what is done to the checkpoint, the loader, what the one line must say, the error chained under it)
CASES = {
    "corrupt config.json": (
        lambda f: (f / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,'),
        load_config,
        r"could not load the config of '.*': OSError: .*not a valid JSON file.* \(caused by JSONDecodeError: "
        r"Expecting property name .*line 1 column",
        OSError,
    ),
    "corrupt config.json, whole model": (
        lambda f: (f / "config.json").write_text("{"),
        load_model,
        r"could not load model '.*': OSError: .* \(caused by JSONDecodeError: Expecting",
        OSError,
    ),
    "missing weights": (
        lambda f: (f / "model.safetensors").unlink(),
        load_model,
        r"could not load model '.*': OSError: .*no file named model\.safetensors",
        OSError,
    ),
    "truncated weights": (truncate_weights, load_model, r"could not load model '.*': SafetensorError: ", Exception),
    "weights of another shape": (shrink_mlp, load_model, r"could not load model '.*': RuntimeError: ", RuntimeError),
    "corrupt tokenizer.json": (
        lambda f: (f / "tokenizer.json").write_text("{not json"),
        load_tokenizer,
        r"could not load a tokenizer for '.*': JSONDecodeError: Expecting property name",
        ValueError,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_load_is_one_line_that_names_its_cause(case, checkpoint, tmp_path):
    damage, loader, message, chained = CASES[case]
    path = damaged(checkpoint, tmp_path, damage)
    with pytest.raises(CtxextError, match=message) as raised:
        loader(path)
    text = str(raised.value)
    assert "\n" not in text and len(text) < 2 * 200 + len(path) + 80, text
    assert isinstance(raised.value.__cause__, chained)  # the original error is kept, for a traceback


def test_the_cli_prints_the_cause_in_one_line(checkpoint, tmp_path):
    path = damaged(checkpoint, tmp_path, lambda f: (f / "config.json").write_text("{"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxext",
            "patch",
            path,
            "--method",
            "linear",
            "--factor",
            "2",
            "-o",
            str(tmp_path / "o"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "caused by JSONDecodeError" in result.stderr, result.stderr


def test_describe_failure_follows_the_chain_to_its_end_and_shortens():
    try:
        try:
            try:
                raise KeyError("inner")
            except KeyError as inner:
                raise ValueError("middle\nsecond line") from inner
        except ValueError:
            raise OSError("outer " + "x " * 300)  # noqa: B904 (an implicit context, as transformers raises)
    except OSError as error:
        text = describe_failure(error)
    assert text.startswith("OSError: outer x x") and text.endswith("(caused by KeyError: 'inner')")
    assert "second line" not in text and "middle" not in text and len(text) < 260
    assert describe_failure(ValueError()) == "ValueError"
