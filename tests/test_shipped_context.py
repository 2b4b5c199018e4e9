"""Models as users have them: checkpoints that already ship long-context scaling are extended from the context they
have (the trained context C of their rope record), a frequency method composing with the shipped scaling.

Tiny models carry exactly the rope configurations of Llama 3.1/3.2, Qwen2.5/Qwen3 with the card's yarn x4, Gemma 3
(linear x8 on its full-attention layers), gpt-oss (yarn x32, truncate false) and Phi-4-mini (longrope with short !=
long factors and partial rotary), at L0 = 32 with their published ratios (131072 / 8192 = 16 for Llama, ...).
The oracles: transformers' own rotary modules (the shipped model's frequencies, a reload of what ctxext writes) and
YaRN's rule from docs/METHODS.md applied to the trained wavelengths.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import ctxext
from ctxext.cli import main
from ctxext.compare.serving import engine_support
from ctxext.patching.families import module_frequencies
from ctxext.patching.patch import plan_patch
from ctxext.patching.record import model_rope_record
from ctxext.serving.engines import declared_max_position_embeddings, engine_table, read_served_model, served_length
from ctxext.serving.lengths import engine_lengths
from tests.family_models import build
from tests.helpers import save_tiny_checkpoint

L0 = 32
LLAMA3 = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": L0,
}
CARD_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0}
PHI4_PAIRS = 6  # head_dim 16 x partial_rotary_factor 0.75 = 12 rotated channels
# name: (family, the full-attention layers' rope parameters, max_position_embeddings, the trained context C)
SHAPES = {
    "llama3.1": ("llama", {**LLAMA3, "factor": 8.0}, 16 * L0, 16 * L0),
    "llama3.2": ("llama", {**LLAMA3, "factor": 32.0}, 16 * L0, 16 * L0),  # x32 over 8192, yet served at 131072
    "qwen2.5-card": ("qwen2", CARD_YARN, L0, 4 * L0),  # the card leaves max_position_embeddings at 32768
    "qwen3-card": ("qwen3", CARD_YARN, L0 * 5 // 4, 4 * L0),  # 40960 over 32768
    "gemma3": ("gemma3_text", {"rope_type": "linear", "factor": 8.0}, 4 * L0, 4 * L0),  # 131072, no L0 recorded
    "gpt-oss": (
        "gpt_oss",
        {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        | {"original_max_position_embeddings": L0},
        32 * L0,
        32 * L0,
    ),
    "phi4-mini": (
        "phi3",
        {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(PHI4_PAIRS)],
            "long_factor": [1.0 + 6.0 * i for i in range(PHI4_PAIRS)],
            "original_max_position_embeddings": L0,
            "partial_rotary_factor": 0.75,
        },
        32 * L0,
        32 * L0,
    ),
}


# the stock configurations (no scaling shipped): Qwen2.5 at 32768, Qwen3 at 40960 (its card's yarn counts from 32768)
STOCK = {
    "qwen2.5-stock": ("qwen2", {"rope_type": "default"}, L0, L0),
    "qwen3-stock": ("qwen3", {"rope_type": "default"}, L0 * 5 // 4, L0 * 5 // 4),
}
# the five shipped shapes of issue 63 (Llama 3.1, Qwen2.5 with the card's yarn, stock Qwen2.5/Qwen3, gpt-oss, Phi-4-mini)
SERVED = ["llama3.1", "qwen2.5-card", "qwen2.5-stock", "qwen3-stock", "gpt-oss", "phi4-mini"]


def shipped(name: str):
    """The tiny model of the shape `name`, rebuilt with its shipped rope configuration (the weights kept)."""
    family, rope, max_length, _ = {**SHAPES, **STOCK}[name]
    model, _ = build(family)
    values = model.config.to_dict()
    if family == "gemma3_text":  # Gemma 3: per layer type; the sliding layers keep their plain base
        values["rope_parameters"]["full_attention"] = {**values["rope_parameters"]["full_attention"], **rope}
    else:
        values["rope_parameters"] = {**rope, "rope_theta": float(values["rope_parameters"]["rope_theta"])}
    if family == "phi3":  # Phi-3 keeps L0 and the partial rotary factor at the top level too
        values.update(original_max_position_embeddings=L0, partial_rotary_factor=0.75)
    values["max_position_embeddings"] = max_length
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    rebuilt = AutoModelForCausalLM.from_config(config).eval()
    rebuilt.load_state_dict(model.state_dict(), strict=False)
    return rebuilt


def full_key(model):
    return "full_attention" if ctxext.patching.rope_layout(model).per_type_rotary else None


def rotary_of(model):
    return ctxext.patching.rotary_host(model).rotary_emb


def cos_sin(rotary, key, positions):
    x = torch.zeros(1, 1, 8)
    ids = torch.as_tensor(positions)[None]
    return rotary(x, ids) if key is None else rotary(x, ids, key)


def trained_frequencies(model, key, C):
    """What transformers' own rotary module of the unpatched model rotates with at C: its inv_freq and attention
    scaling (for longrope, the long set, as transformers' longrope computes it for a sequence of C tokens)."""
    rotary = rotary_of(model)
    inv_freq, scaling = module_frequencies(rotary, key)
    if model.config.rope_parameters.get("rope_type") == "longrope":
        inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, "cpu", seq_len=C)
    return inv_freq.double(), scaling


def tokens(n: int) -> torch.Tensor:
    return torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_record_reads_the_trained_context(name):
    family, rope, _, C = SHAPES[name]
    record = model_rope_record(shipped(name))
    assert record.trained_context == C and record.pretraining_length == rope.get("original_max_position_embeddings", C)
    assert record.full.rope_type == rope["rope_type"]
    assert record.base == (1e6 if family == "gemma3_text" else shipped(name).config.rope_parameters["rope_theta"])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_yarn_x2_writes_twice_the_trained_context_and_reloads_as_patched(name, tmp_path, capsys):
    """`ctxext patch --method yarn --factor 2` writes max_position_embeddings 2C, in a native rope type that plain
    transformers reloads with the rotation and logits of the model patched in memory."""
    model = shipped(name)
    C = SHAPES[name][3]
    save_tiny_checkpoint(tmp_path / "in", model)
    code = main(["patch", str(tmp_path / "in"), "--method", "yarn", "--factor", "2", "-o", str(tmp_path / "out")])
    assert code == 0
    told = capsys.readouterr().out
    assert f"trained context C {C}" in told and "composes with the shipped" in told and f"{C} -> {2 * C}" in told
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["max_position_embeddings"] == 2 * C
    key = full_key(model)
    written = config["rope_parameters"][key] if key else config["rope_parameters"]
    assert not written["rope_type"].startswith("ctxext_")
    with torch.no_grad():
        ctxext.patch(model, "yarn", factor=2.0)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
        positions = [0, 1, C // 2, C - 1, C, 2 * C - 1]
        for got, expected in zip(
            cos_sin(rotary_of(reloaded), key, positions), cos_sin(rotary_of(model), key, positions)
        ):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(reloaded(tokens(64)).logits, model(tokens(64)).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama3.1", "llama3.2", "qwen3-card", "gpt-oss", "phi4-mini", "gemma3"])
def test_yarn_composes_with_the_shipped_scaling_by_its_own_rule(name):
    """On the trained wavelengths against C (docs/METHODS.md, YaRN): a pair that turns more than beta_fast = 32 times
    in C tokens keeps its trained frequency, one that turns less than beta_slow = 1 time is divided by s = 2, those
    between lie between; the attention factor is the shipped one times 0.1 ln 2 + 1. Below C nothing else changes."""
    model = shipped(name)
    C, key = SHAPES[name][3], full_key(model)
    trained, shipped_scaling = trained_frequencies(model, key, C)
    ctxext.patch(model, "yarn", factor=2.0)
    rotary = rotary_of(model)
    assert rotary.composed_keys == (key,)
    composed, scaling = module_frequencies(rotary.composed, key)
    if model.config.rope_parameters.get("rope_type") == "longrope":  # the long set: past L0
        composed, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, "cpu", seq_len=2 * C)
    turns = C * trained / (2 * math.pi)
    kept, divided = turns > 32, turns < 1
    # both kinds of pair, where some pair can turn 32 times (at most C / 2 pi times: not in C = 128)
    assert divided.any() and (kept.any() or C / (2 * math.pi) <= 32), turns
    composed = composed.double()
    torch.testing.assert_close(composed[kept], trained[kept], rtol=1e-6, atol=0)
    torch.testing.assert_close(composed[divided], trained[divided] / 2, rtol=1e-6, atol=0)
    between = ~kept & ~divided
    assert bool((composed[between] <= trained[between] * (1 + 1e-6)).all())
    assert bool((composed[between] >= trained[between] / 2 * (1 - 1e-6)).all())
    assert scaling == pytest.approx(shipped_scaling * (0.1 * math.log(2) + 1), rel=1e-6)


def test_a_composition_of_linear_with_linear_is_one_linear():
    """Gemma 3's linear x8 on its global layers, extended by linear x2: exactly linear x16 there, the sliding layers'
    own frequencies untouched (the oracle: transformers' linear type)."""
    model = shipped("gemma3")
    sliding_before = module_frequencies(rotary_of(model), "sliding_attention")
    ctxext.patch(model, "linear", factor=2.0)
    full = model.config.rope_parameters["full_attention"]
    assert full["rope_type"] == "linear" and full["factor"] == 16.0
    assert model.config.rope_parameters["sliding_attention"]["rope_type"] == "default"
    sliding_after = cos_sin(rotary_of(model), "sliding_attention", [0, 5, 100])
    expected = cos_sin(ctxext.patching.rotary_host(model).rotary_emb.original, "sliding_attention", [0, 5, 100])
    assert all(torch.equal(a, b) for a, b in zip(sliding_after, expected))
    assert sliding_before[1] == 1.0


@pytest.mark.parametrize("name", ["llama3.1", "qwen3-card", "gemma3"])
def test_a_remapping_method_keeps_the_shipped_frequencies_and_remaps_past_C(name):
    model = shipped(name)
    C = SHAPES[name][3]
    plan = plan_patch(model, "self_extend", 2.0)
    assert plan.method_length == C and "remaps past C" in plan.describe()
    ctxext.patch(model, "self_extend", factor=2.0)
    assert ctxext.applied_method(model)["original_max_position_embeddings"] == C
    assert model.config.max_position_embeddings == 2 * C
    assert rotary_of(model).shipped == (full_key(model),)


@pytest.mark.parametrize("name", ["llama3.1", "qwen2.5-card"])
def test_target_length_is_the_matching_factor(name, tmp_path):
    model = shipped(name)
    C = SHAPES[name][3]
    save_tiny_checkpoint(tmp_path / "in", model)
    target = f"{2 * C // 1024}k" if (2 * C) % 1024 == 0 else str(2 * C)
    for folder, flags in (("factor", ["--factor", "2"]), ("target", ["--target-length", target])):
        argv = ["patch", str(tmp_path / "in"), "--method", "yarn", *flags, "-o", str(tmp_path / folder)]
        assert main(argv) == 0
    configs = [json.loads((tmp_path / folder / "config.json").read_text()) for folder in ("factor", "target")]
    assert configs[0]["rope_parameters"] == configs[1]["rope_parameters"]
    assert configs[0]["max_position_embeddings"] == configs[1]["max_position_embeddings"] == 2 * C
    with pytest.raises(ctxext.CtxextError, match="disagree"):
        ctxext.patch(model, "yarn", factor=3.0, target_length=2 * C)


def test_the_old_behaviour_is_reached_explicitly_and_a_shorter_checkpoint_is_refused(tmp_path, capsys):
    """--replace-shipped replaces llama3 x8 and counts from L0: yarn x2 would leave 64 of the 512 tokens the model has,
    which `ctxext patch` refuses in one line, exit 2, writing nothing, unless --allow-shorter; an explicit L counts
    from there and says what it replaces."""
    model = shipped("llama3.1")
    save_tiny_checkpoint(tmp_path / "in", model)
    capsys.readouterr()
    source = str(tmp_path / "in")
    refused = ["patch", source, "--method", "yarn", "--factor", "2", "--replace-shipped", "-o", str(tmp_path / "x")]
    assert main(refused) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "shorter than the 512 it has now" in err and "--allow-shorter" in err, err
    assert not (tmp_path / "x").exists()

    assert main([*refused, "--allow-shorter"]) == 0
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    assert config["max_position_embeddings"] == 2 * L0
    rope = config["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 2.0, L0)
    capsys.readouterr()

    argv = ["patch", source, "--method", "yarn", "--factor", "32", "--original-max-position-embeddings", "64"]
    assert main([*argv, "-o", str(tmp_path / "from64")]) == 0
    assert "replaces the shipped llama3 x8, counting from L = 64: 512 -> 2048" in capsys.readouterr().out
    rope = json.loads((tmp_path / "from64" / "config.json").read_text())["rope_parameters"]
    assert (rope["rope_type"], rope["original_max_position_embeddings"]) == ("yarn", 64)


def test_a_dynamic_method_does_not_compose_and_says_how_to_replace():
    with pytest.raises(ctxext.CtxextError, match="does not compose with the shipped llama3 x8.*--replace-shipped"):
        ctxext.patch(shipped("llama3.1"), "dynamic_ntk", factor=2.0)


def test_a_remapping_method_on_all_layer_types_says_which_it_leaves_and_writes_them_as_shipped(tmp_path, capsys):
    """Gemma 3's sliding layers (window 8 <= L) never see a distance to remap: under --layer-types all, self_extend
    goes on the full-attention layers only, the sliding layers' rope parameters stay as shipped, and patch says so."""
    model = shipped("gemma3")
    sliding = json.dumps(model.config.rope_parameters["sliding_attention"], sort_keys=True)
    save_tiny_checkpoint(tmp_path / "in", model)
    argv = ["patch", str(tmp_path / "in"), "--method", "self_extend", "--layer-types", "all", "-o", str(tmp_path / "o")]
    assert main([*argv, "--factor", "2"]) == 0
    assert "sliding_attention left as shipped" in capsys.readouterr().out
    written = json.loads((tmp_path / "o" / "config.json").read_text())["rope_parameters"]
    assert json.dumps(written["sliding_attention"], sort_keys=True) == sliding
    ctxext.patch(model, "self_extend", factor=2.0, layer_types="all")
    assert ctxext.applied_method(model)["layer_types"] == ["full_attention"]


# ------------------------------------------------------------------ to the engines: export copies and lengths
def patched_checkpoint(tmp_path, name: str, *flags: str):
    """`ctxext patch` of the shape `name` with yarn and `flags`: (its folder, C, what patch printed)."""
    model = shipped(name)
    C = {**SHAPES, **STOCK}[name][3]
    save_tiny_checkpoint(tmp_path / "in", model)
    out = tmp_path / "patched"
    with io.StringIO() as told, contextlib.redirect_stdout(told):
        assert main(["patch", str(tmp_path / "in"), "--method", "yarn", *flags, "-o", str(out)]) == 0
        return out, C, told.getvalue()


def reloaded_cos_sin(folder, positions):
    """cos and sin of the full-attention layers of `folder` loaded in plain transformers."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return cos_sin(rotary_of(model), full_key(model), positions)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("name", SERVED)
def test_an_export_copy_rotates_as_the_patched_checkpoint(name, engine, tmp_path, capsys):
    """`ctxext patch --factor 2` then `ctxext export --engine E`: plain transformers' load of the copy rotates as
    its load of the patched checkpoint at every position 0..2C-1 (before: the copy was yarn x2 rebuilt from
    ctxext.yaml over C, 2.14 off on Llama 3.1, 2.28 on the Qwen card, 2.51 on gpt-oss); the copy's table verdict is
    the engine's reading of the copy; where the engine reads no exact form (vLLM's gpt_oss code builds yarn
    whatever type is written; Phi-4's two factor sets, which transformers switches per sequence) export refuses in
    one line and writes nothing, and Phi-4's copy is written, labelled approximate, only with --allow-approximate."""
    patched, C, _ = patched_checkpoint(tmp_path, name, "--factor", "2")
    copy, report = tmp_path / engine, tmp_path / "table.json"
    capsys.readouterr()
    command = ["export", str(patched), "--engine", engine, "-o", str(copy), "--json", str(report)]
    code = main(command)
    out, err = capsys.readouterr()
    if (name, engine) == ("gpt-oss", "vllm"):
        assert code == 2 and len(err.strip().splitlines()) == 1 and "gpt_oss code builds yarn" in err, err
        assert not copy.exists()
        return
    if name == "phi4-mini":  # short != long sets: no engine switches them per sequence as transformers does
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--allow-approximate" in err, err
        assert "only an approximate one" in err and not copy.exists()
        code = main([*command, "--allow-approximate"])
        out, err = capsys.readouterr()
    assert code == 0, err
    positions = list(range(2 * C))
    for got, want in zip(reloaded_cos_sin(copy, positions), reloaded_cos_sin(patched, positions)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    rope = json.loads((copy / "config.json").read_text())["rope_parameters"]
    if rope["rope_type"] == "longrope" and "attention_factor" in rope:  # the scale vLLM and SGLang read
        assert rope["short_mscale"] == rope["long_mscale"] == rope["attention_factor"]
    level = {row["engine"]: row["level"] for row in json.loads(report.read_text())["engines"]}[engine]
    assert level == ("approximate" if name == "phi4-mini" else "exact"), out  # Phi-4's short != long sets
    assert (level != "exact") == (f"({level} in {engine}:" in out)


@pytest.mark.parametrize("name", ["llama3.1", "qwen2.5-card", "gpt-oss"])
def test_the_composed_longrope_carries_the_scale_vllm_and_sglang_read(name, tmp_path):
    """The composed longrope writes short_mscale = long_mscale = its attention factor (shipped x (0.1 ln 2 + 1)), so
    that vLLM does not compute its own sqrt(1 + ln(factor) / ln L0) (1.18 for Llama 3.1's 32 over 8192, not 1.07)."""
    model = shipped(name)
    _, shipped_scaling = trained_frequencies(model, full_key(model), SHAPES[name][3])
    patched, _, _ = patched_checkpoint(tmp_path, name, "--factor", "2")
    rope = json.loads((patched / "config.json").read_text())["rope_parameters"]
    expected = shipped_scaling * (0.1 * math.log(2) + 1)
    assert rope["short_mscale"] == rope["long_mscale"] == pytest.approx(expected, rel=1e-9)
    assert rope["attention_factor"] == pytest.approx(expected, rel=1e-9)
    assert served_length(read_served_model(patched)) == 2 * SHAPES[name][3]


def test_compare_grades_the_composed_form_patch_writes():
    """compare's servable levels read the form `ctxext patch` writes: on Llama 3.1 the composed longrope (vLLM
    exact: it carries the mscales), not the uncomposed yarn x2 over C; on gpt-oss vLLM's 'no'."""
    llama = shipped("llama3.1")
    table = engine_support({"method": "yarn", "factor": 2.0}, llama.config, SHAPES["llama3.1"][3])
    assert table["vllm"]["level"] == "exact" and "'longrope'" in table["vllm"]["how"]
    assert "--hf-overrides" not in table["vllm"]["how"]  # the copy declares 2C itself
    gpt = engine_support({"method": "yarn", "factor": 2.0}, shipped("gpt-oss").config, SHAPES["gpt-oss"][3])
    assert gpt["vllm"]["level"] == "no"


LENGTHS_PRINTED = (
    r"-> (\d+)",
    r"serve (\d+) tokens",
    r"derives (\d+)",
    r"--max-model-len (\d+)",
    r"--context-length (\d+)",
    r"--ctx-size (\d+)",
    r"n_ctx_train (\d+)",
)


def lengths_in(text: str) -> set[int]:
    return {int(n) for pattern in LENGTHS_PRINTED for n in re.findall(pattern, text)}


@pytest.mark.parametrize("how", ["factor", "target"])
@pytest.mark.parametrize("name", SERVED)
def test_every_length_ctxext_prints_is_the_target(name, how, tmp_path, capsys):
    """--factor 2 and --target-length 2C alike: ctxext.yaml records the factor applied (2, and the target), and
    every length `ctxext patch` and `ctxext export` print, and each engine's derived length after its flags, is 2C
    (before: --target-length recorded factor 1.0, and patch said 'max_position_embeddings stays L')."""
    C = {**SHAPES, **STOCK}[name][3]
    flags = ["--factor", "2"] if how == "factor" else ["--target-length", str(2 * C)]
    patched, _, told = patched_checkpoint(tmp_path, name, *flags)
    record = yaml.safe_load((patched / "ctxext.yaml").read_text())
    assert record["factor"] * record["original_max_position_embeddings"] == 2 * C
    assert record.get("target_length") == (None if how == "factor" else 2 * C)
    assert "stays L" not in told and lengths_in(told) == {2 * C}, told
    capsys.readouterr()
    assert main(["export", str(patched)]) == 0
    table = capsys.readouterr().out
    assert lengths_in(table) <= {2 * C} and f"L={C}" in table, table
    model = read_served_model(patched)
    assert served_length(model) == declared_max_position_embeddings(model) == 2 * C
    for row in engine_lengths(model.config, 2 * C):
        assert row.servable and (row.reaches or row.limit >= 2 * C), row


def test_stock_qwen3_says_its_card_counts_from_another_length(tmp_path, capsys):
    """Stock Qwen3's config counts from max_position_embeddings 40960, its card's yarn x4 from 32768: `ctxext methods
    --model` and `ctxext patch` say so and name the flag, with which patch writes the card's recipe (transformers'
    own yarn x4 over 32768, 131072 tokens); with it given, nothing is said."""
    model = shipped("qwen3-stock")
    model.config.max_position_embeddings = 40960
    save_tiny_checkpoint(tmp_path / "in", model)
    flag = "--original-max-position-embeddings 32768 --factor 4"
    capsys.readouterr()
    assert main(["methods", "--model", str(tmp_path / "in")]) == 0
    assert "from 32768" in capsys.readouterr().out.split("methods on this model")[0]
    argv = ["patch", str(tmp_path / "in"), "--method", "yarn", "--factor", "4", "-o", str(tmp_path / "from-config")]
    assert main(argv) == 0
    told = capsys.readouterr().out
    assert f"{flag} reproduces the card" in told and "40960 -> 163840" in told, told
    argv = ["patch", str(tmp_path / "in"), "--method", "yarn", *flag.split(), "-o", str(tmp_path / "card")]
    assert main(argv) == 0
    assert "reproduces the card" not in capsys.readouterr().out
    config = json.loads((tmp_path / "card" / "config.json").read_text())
    rope = config["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 32768)
    assert config["max_position_embeddings"] == 131072


@pytest.mark.parametrize("name", ["llama3.1", "qwen2.5-card", "phi4-mini"])
def test_exports_llama_cpp_advice_is_what_patch_does_with_the_gguf(name, tmp_path, capsys):
    """llama.cpp's row of a composed checkpoint says what `ctxext patch MODEL.gguf` does with the converter's GGUF
    (ctxext.serving.gguf.composition_refusal, tested on GGUF files in tests/test_serving_gguf.py): Llama 3.1's
    llama3 becomes rope_freqs, which the composition extends (exact); a yarn or longrope file is refused, and then
    `ctxext patch` prints no llama-server line."""
    patched, _, told = patched_checkpoint(tmp_path, name, "--factor", "2")
    row = {r.engine: r for r in engine_table(read_served_model(patched))}["llama.cpp"]
    if name == "llama3.1":
        assert row.level == "exact" and "rope_freqs" in row.how and "--ctx-size" in told
        return
    assert row.level == "no" and "reads only as rope_freqs on the llama architecture" in row.how
    assert "llama-server" not in told and "llama.cpp: no exact GGUF" in told
