"""Real checkpoints that tiny test models did not look like: `ctxext check` on a Qwen2.5 config (special token ids
far outside check's shrunk vocabulary), and `ctxext patch` on a training checkpoint without tokenizer files."""

import json
import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import ctxext
from tests.helpers import run_cli, tiny_model

# What AutoTokenizer.save_pretrained writes, or a source's tokenizer could be made of.
TOKENIZER_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
}
# Qwen2.5's token ids (vocabulary 151936, <|endoftext|> 151643, <|im_end|> 151645) on a small shape.
QWEN25_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "pad_token_id": 151643,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}


# ----------------------------------------------------------------------------- check on Qwen2.5 token ids
@pytest.mark.parametrize("given", ["directory", "config.json with an eos list"])
def test_check_runs_on_a_qwen25_config_whose_token_ids_exceed_its_small_vocabulary(given, tmp_path, capsys):
    values = dict(QWEN25_CONFIG)
    if given != "directory":
        values["eos_token_id"] = [151645, 151643]  # as Qwen2.5-Instruct's generation config has it
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(values))
    model = tmp_path / "qwen" if given == "directory" else tmp_path / "qwen" / "config.json"
    flags = ["--lengths", "", "--method", "rerope,logn", "--implementations", "sdpa"]
    code, out, err = run_cli(
        capsys, "check", "--device", "cpu", "--model", model, *flags, "--json", tmp_path / "check.json"
    )
    assert code == 0, out + err
    assert "all methods agree with the reference" in out and "DISAGREES" not in out
    result = json.loads((tmp_path / "check.json").read_text())
    assert result["ok"] and result["shape"]["model_type"] == "qwen2"
    assert [(row["implementation"], row["method"]) for row in result["agreement"]] == [
        ("sdpa", "rerope"),
        ("sdpa", "logn"),
    ]
    for row in result["agreement"]:
        assert row["ok"] and row["forward_error"] < 1e-4 and row["decode_error"] < 1e-4


def test_the_shrunk_model_keeps_only_the_special_token_ids_inside_its_vocabulary():
    from transformers import AutoConfig

    from ctxext.verification.check import random_model

    values = dict(QWEN25_CONFIG, pad_token_id=7, eos_token_id=[151645, 3])
    shape = AutoConfig.for_model(values.pop("model_type"), **values)
    model = random_model(shape, 1, "sdpa", "cpu", torch.float32, seed=0)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (7, None, [3])
    assert model.model.embed_tokens.padding_idx == 7
    assert shape.bos_token_id == 151643  # the user's config is not changed


# ------------------------------------------------------------------------- patch without a tokenizer
@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """A training checkpoint: weights, config.json and generation_config.json, no tokenizer files."""
    path = tmp_path_factory.mktemp("src") / "checkpoint-1000"
    tiny_model("llama").save_pretrained(path)
    assert not [name for name in TOKENIZER_FILES if (path / name).exists()]
    return path


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_patch_writes_a_checkpoint_without_a_tokenizer_that_matches_the_in_memory_patch(no_tokenizer, tmp_path, capsys):
    before = snapshot(no_tokenizer)
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "patch", no_tokenizer, "--method", "yarn", "--factor", "2", "-o", out)
    assert code == 0, stdout + err
    assert snapshot(no_tokenizer) == before  # the same files, byte for byte
    assert "tokenizer: none in" in stdout
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "ctxext.yaml"} <= names
    assert not names & TOKENIZER_FILES and not [n for n in names if "token" in n]
    record = yaml.safe_load((out / "ctxext.yaml").read_text())
    assert record["method"] == "yarn" and record["tokenizer"].startswith("none in the source")

    reference = ctxext.patch(tiny_model("llama"), "yarn", factor=2)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))  # 2x the 64 trained on
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, reference(tokens).logits)


def test_patch_leaves_a_source_without_a_tokenizer_unchanged(no_tokenizer, tmp_path, capsys):
    before = snapshot(no_tokenizer)
    for method in ("yarn", "rerope"):  # a frequency method and an attention-level one
        code, stdout, err = run_cli(capsys, "patch", no_tokenizer, "--method", method, "-o", tmp_path / method)
        assert code == 0, stdout + err
    assert snapshot(no_tokenizer) == before


def test_dpe_pair_selection_without_a_tokenizer_is_one_line(no_tokenizer, tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text("some calibration text " * 20)
    out = tmp_path / "out"
    argv = ["patch", no_tokenizer, "--method", "dpe", "--select-pairs", text, "--top-pairs", "2", "-o", out]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--select-pairs needs a tokenizer" in err
    assert not out.exists()


def test_a_broken_tokenizer_is_still_an_error_for_patch(no_tokenizer, tmp_path, capsys):
    source = tmp_path / "broken"
    shutil.copytree(no_tokenizer, source)
    (source / "tokenizer.json").write_text("{not json")
    code, _, err = run_cli(capsys, "patch", source, "--method", "yarn", "--factor", "2", "-o", tmp_path / "out")
    assert code == 2 and "ctxext patch: error: could not load a tokenizer" in err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_commands_that_read_text_still_need_a_tokenizer(no_tokenizer, tmp_path, capsys):
    argv = [
        "passkey",
        no_tokenizer,
        "--lengths",
        "128",
        "--passkey-trials",
        "1",
        "--no-progress",
        "-o",
        tmp_path / "out",
    ]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "could not load a tokenizer" in err and len(err.strip().splitlines()) == 1
