"""`ctxext export`'s table beyond the flat rope forms: rope parameters nested by layer type (Gemma 3's form,
which transformers reads natively and SGLang's Gemma 3 code drops), and the query temperature, which only
ctxext (or a family that reads it) applies."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from ctxext.serving.engines import engine_table, read_served_model
from tests.family_models import build
from tests.helpers import run_cli, save_tiny_checkpoint


def patched(tmp_path, capsys, family, *argv):
    model, _ = build(family)
    source = save_tiny_checkpoint(tmp_path / family, model)
    out = tmp_path / f"{family}-out"
    code, _, err = run_cli(capsys, "patch", source, *argv, "-o", out)
    assert code == 0, err
    return out


def levels(path):
    return {row.engine: row for row in engine_table(read_served_model(path))}


def test_gemma3_nested_yarn_is_read_by_transformers_and_vllm_and_dropped_by_sglang(tmp_path, capsys):
    out = patched(tmp_path, capsys, "gemma3_text", "--method", "yarn", "--factor", "4")
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope["full_attention"]["rope_type"] == "yarn" and rope["sliding_attention"]["rope_type"] == "default"
    rows = levels(out)
    assert rows["transformers"].level == "exact"
    assert rows["vllm"].level == "exact" and "full_attention: yarn" in rows["vllm"].how
    assert rows["sglang"].level == "no" and "silently dropped" in rows["sglang"].how
    assert rows["llama.cpp"].level == "no"
    # the transformers row's claim, checked: plain transformers builds the nested form with the yarn layers scaled
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    full = reloaded.model.rotary_emb.full_attention_inv_freq
    plain = build("gemma3_text")[0].model.rotary_emb.full_attention_inv_freq
    assert not torch.allclose(full, plain)


def test_a_nested_family_whose_engine_code_was_not_read_is_not_claimed(tmp_path, capsys):
    out = patched(tmp_path, capsys, "olmo3", "--method", "yarn", "--factor", "4")
    rows = levels(out)
    assert rows["transformers"].level == "exact"
    for engine in ("vllm", "sglang"):
        assert rows[engine].level == "no" and "was not checked" in rows[engine].how


def test_the_query_temperature_is_served_by_ctxext_only_where_the_family_does_not_read_it(tmp_path, capsys):
    out = patched(tmp_path, capsys, "llama", "--method", "yarn", "--factor", "4", "--query-temperature", "0.1")
    rows = levels(out)
    assert rows["transformers"].level == "no" and "query temperature" in rows["transformers"].how
    for engine in ("vllm", "sglang"):
        assert rows[engine].level == "no" and "query temperature" in rows[engine].how
    code, _, err = run_cli(capsys, "export", out, "--engine", "vllm", "-o", tmp_path / "v")
    assert code == 2 and "query temperature" in err and not (tmp_path / "v").exists()


def test_a_gguf_cannot_carry_the_query_temperature(tmp_path, capsys):
    from ctxext import assets

    code, _, err = run_cli(
        capsys,
        "patch",
        assets.smollm2_gguf(),
        "--method",
        "yarn",
        "--factor",
        "2",
        "--query-temperature",
        "0.1",
        "-o",
        tmp_path / "x.gguf",
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "query temperature" in err, err
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize(
    ("family", "method", "level", "why"),
    [
        ("qwen3_5_text", "linear", "no", "multimodal RoPE (mrope_section) for the default and yarn types only"),
        ("qwen3_5_text", "yarn", "exact", "reads rope type 'yarn'"),
        ("deepseek_v3", "linear", "no", "serves every scaled rope type as DeepSeek's yarn"),
        ("deepseek_v3", "yarn", "exact", "reads rope type 'yarn'"),
    ],
)
def test_the_engines_family_code_decides_which_written_types_are_served(tmp_path, capsys, family, method, level, why):
    """vLLM's and SGLang's get_rope builds multimodal RoPE for 'default' and 'yarn' only, and their DeepSeek code turns
    every scaled type into DeepSeek's yarn (read from their source): a written type those paths change is not served
    as written, while transformers reads it (its reload is the patched model)."""
    out = patched(tmp_path, capsys, family, "--method", method, "--factor", "4")
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == method
    rows = levels(out)
    assert rows["transformers"].level == "exact"
    for engine in ("vllm", "sglang"):
        assert rows[engine].level == level and why in rows[engine].how, rows[engine].how


@pytest.mark.parametrize("family", ["ministral3", "qwen3_5_text"])
def test_ctxext_patch_keeps_the_keys_the_familys_code_reads(tmp_path, capsys, family):
    """Ministral 3's llama_4_scaling_beta (its query temperature: without it the model fails to run) and Qwen3.5's
    mrope_section/mrope_interleaved stay in the config `ctxext patch` rewrites for serving, beside the method's form:
    plain transformers reloads it with the logits of the model patched in memory (the oracle)."""
    import ctxext

    out = patched(tmp_path, capsys, family, "--method", "yarn", "--factor", "4")
    model, _ = build(family)  # shared with other tests: unpatched again below
    shipped = model.config.rope_parameters
    written = json.loads((out / "config.json").read_text())["rope_parameters"]
    family_keys = {"llama_4_scaling_beta", "mrope_section", "mrope_interleaved"} & set(shipped)
    assert family_keys and {key: written[key] for key in family_keys} == {key: shipped[key] for key in family_keys}
    tokens = torch.randint(3, 100, (1, 96), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            ctxext.patch(model, "yarn", factor=4.0)
            expected = model(tokens).logits
            reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-5, rtol=1e-5)
    finally:
        ctxext.unpatch(model)
