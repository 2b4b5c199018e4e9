"""DeepSeek: V4's rotary modules (the base model's, and one in each compressor and indexer) all patched alike, and
V3 / Kimi K2's shipped yarn x40 extended past its 163840 tokens as one yarn over L0 (issue 65 items 5).

The oracles: transformers' own yarn, written into the config a model is built from with the same weights (V4: in
rope_parameters['compress'] and ['main']; V3: yarn x80 over 4096 with mscale = mscale_all_dim = 1, whose softmax
scale DeepSeek's attention derives), and transformers' yarn frequencies against ctxext's composition rule for the
numbers docs/guides/methods.md gives.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import ctxext
from ctxext.errors import CtxextError
from ctxext.methods import composed_per_pair_factors, get_method, rope_inv_freq
from ctxext.patching.families import layer_rotaries
from tests.family_models import (
    DEEPSEEK_V3_CONTEXT,
    DEEPSEEK_V3_YARN,
    DEEPSEEK_V4_COMPRESSED,
    L,
    deepseek_v3_as_shipped,
    deepseek_v4_model,
)
from tests.helpers import run_cli, save_tiny_checkpoint

TOKENS = 48  # past L = 32, and whole windows of both compress rates (4 and 8)
V4_MAIN = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
V4_COMPRESS = {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.25}


def yarn_x2(plain: dict) -> dict:
    """transformers' own yarn x2 over L on a V4 rope parameter set."""
    return {**plain, "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": L}


def tokens(n: int = TOKENS) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(0))


def rotaries(model) -> dict:
    """{path: rotary module} of every rotary module that computes a rope position in a DeepSeek V4 model."""
    host = model.model
    return {"rotary_emb": host.rotary_emb, **{path: module for path, _, _, module in layer_rotaries(host)}}


def cos_sin(module, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(2 * TOKENS)[None]
    return module(torch.zeros(1, positions.shape[1], 4), position_ids=positions, layer_type=key)


# ------------------------------------------------------------------------------------------ DeepSeek V4
@pytest.mark.parametrize("compressed", DEEPSEEK_V4_COMPRESSED)
@pytest.mark.parametrize(("layer_types", "oracle_main"), [(None, V4_MAIN), ("all", yarn_x2(V4_MAIN))])
def test_v4_every_rotary_module_is_transformers_yarn(compressed, layer_types, oracle_main):
    """yarn x2 on the tiny V4: the base model's rotary, each compressor's and each indexer's give transformers' own
    yarn on `compress` (and, under --layer-types all, on `main`), and the logits are the oracle's; unpatch restores
    every module and the logits bit for bit."""
    model = deepseek_v4_model(compressed)
    oracle = deepseek_v4_model(compressed, {"main": oracle_main, "compress": yarn_x2(V4_COMPRESS)}, like=model)
    own = rotaries(model)
    # the base model's and the compressor's, and a CSA compressor's indexer's (HCA has none)
    assert len(own) == (3 if compressed == DEEPSEEK_V4_COMPRESSED[0] else 2), sorted(own)
    with torch.no_grad():
        before = model(tokens()).logits
        ctxext.patch(model, "yarn", factor=2.0, layer_types=layer_types)
        patched = model(tokens()).logits
        for path, module in rotaries(model).items():
            assert module is model.model.rotary_emb, path  # one scaled module for every place that computes positions
            for key in ("main", "compress"):
                for got, want in zip(cos_sin(module, key), cos_sin(rotaries(oracle)[path], key)):
                    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=f"{path} {key}")
        torch.testing.assert_close(patched, oracle(tokens()).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(patched, before, atol=1e-4)  # the patch changed the model past L
        ctxext.unpatch(model)
        assert rotaries(model) == own
        assert torch.equal(model(tokens()).logits, before)


def test_v4_saved_and_patched_by_the_cli_reloads_as_transformers_yarn(tmp_path, capsys):
    """`ctxext patch --factor 2` on a V4 checkpoint writes yarn x2 on compress (main as shipped), and plain
    transformers loads it as the patched model: every rotary module rebuilt from the written config."""
    model = deepseek_v4_model()
    oracle = deepseek_v4_model(rope_parameters={"main": V4_MAIN, "compress": yarn_x2(V4_COMPRESS)}, like=model)
    save_tiny_checkpoint(tmp_path / "v4", model)
    code, out, err = run_cli(
        capsys, "patch", tmp_path / "v4", "--method", "yarn", "--factor", "2", "-o", tmp_path / "out"
    )
    assert code in (0, None), err
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["max_position_embeddings"] == 2 * L
    assert written["rope_parameters"]["main"] == V4_MAIN
    compress = written["rope_parameters"]["compress"]
    assert (compress["rope_type"], compress["factor"], compress["original_max_position_embeddings"]) == ("yarn", 2.0, L)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").float().eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens()).logits, oracle(tokens()).logits, atol=1e-5, rtol=1e-5)


def test_v4_a_rotary_module_with_other_frequencies_is_refused_by_name():
    model = deepseek_v4_model()
    indexer = model.model.layers[1].self_attn.compressor.indexer
    indexer.rotary_emb.compress_inv_freq.mul_(2.0)
    with pytest.raises(CtxextError, match=r"layers\.1\.self_attn\.compressor\.indexer\.rotary_emb") as error:
        ctxext.patch(model, "yarn", factor=2.0)
    assert "\n" not in str(error.value) and "compress_inv_freq differs" in str(error.value)


# ------------------------------------------------------------------------------- DeepSeek V3 / Kimi K2
C = DEEPSEEK_V3_CONTEXT
L0 = DEEPSEEK_V3_YARN["original_max_position_embeddings"]
YARN_X80 = {**DEEPSEEK_V3_YARN, "factor": 2 * C / L0}


def m(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's yarn_get_mscale: 0.1 mscale ln s + 1."""
    return 0.1 * mscale * math.log(factor) + 1.0


def test_v3_yarn_x2_is_one_yarn_x80_over_L0_with_its_softmax_scale():
    """yarn x2 on V3's shipped yarn x40 in memory is transformers' yarn x80 over 4096 on the same weights: its
    frequencies and the softmax scale DeepSeek's attention derives from it (qk_head_dim^-1/2 m(80, 1)^2)."""
    model = deepseek_v3_as_shipped()
    oracle = deepseek_v3_as_shipped(YARN_X80, 2 * C)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        before = model(tokens()).logits
        ctxext.patch(model, "yarn", factor=2.0)
        assert model.config.max_position_embeddings == 2 * C == 327680
        assert attention.scaling == pytest.approx(attention.qk_head_dim**-0.5 * m(80.0) ** 2, rel=1e-12)
        assert attention.scaling == pytest.approx(oracle.model.layers[0].self_attn.scaling, rel=1e-12)
        torch.testing.assert_close(model.model.rotary_emb.inv_freq, oracle.model.rotary_emb.inv_freq)
        torch.testing.assert_close(model(tokens()).logits, oracle(tokens()).logits, atol=1e-5, rtol=1e-5)
        ctxext.unpatch(model)
        assert torch.equal(model(tokens()).logits, before)


def test_v3_cli_factor_2_writes_twice_C_and_says_it_replaces(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path / "v3", deepseek_v3_as_shipped())
    code, out, err = run_cli(
        capsys, "patch", tmp_path / "v3", "--method", "yarn", "--factor", "2", "-o", tmp_path / "out"
    )
    assert code in (0, None), err
    said = [line for line in out.splitlines() if "replaces the shipped yarn x40" in line]
    assert len(said) == 1 and "not composed" in said[0] and f"{C} -> {2 * C}" in said[0], out
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["max_position_embeddings"] == 327680
    rope = written["rope_parameters"]
    assert {key: rope[key] for key in YARN_X80} == YARN_X80
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    oracle = deepseek_v3_as_shipped(YARN_X80, 2 * C)
    assert reloaded.model.layers[0].self_attn.scaling == pytest.approx(oracle.model.layers[0].self_attn.scaling)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens()).logits, oracle(tokens()).logits, atol=1e-5, rtol=1e-5)


def test_v3_another_method_on_the_shipped_yarn_is_one_line():
    with pytest.raises(CtxextError, match="use yarn, which extends it as one yarn over L0") as error:
        ctxext.patch(deepseek_v3_as_shipped(), "linear", factor=2.0)
    assert "\n" not in str(error.value)


def test_yarn_x80_over_L0_is_not_yarn_x2_composed_on_the_x40_frequencies():
    """The numbers docs/guides/methods.md ('DeepSeek V3 / Kimi K2') rests on, at V3's real rotary (64 channels,
    base 1e4): transformers' yarn x80 over 4096 against ctxext's composition of yarn x2 (over C = 163840) with the
    x40 frequencies. Pairs 0-10 and 23-31 agree; the ramp's pairs do not, the farthest by 17.4% (pair 22), and the
    logit temperature differs by 3.6%."""
    d, base = 64, 10000.0
    config = deepseek_v3_as_shipped().config

    def transformers_yarn(factor: float) -> tuple[torch.Tensor, float]:
        trial = config.__class__(**{**config.to_dict(), "qk_rope_head_dim": d, "head_dim": d})
        trial.rope_parameters = {**DEEPSEEK_V3_YARN, "rope_theta": base, "factor": factor}
        return ROPE_INIT_FUNCTIONS["yarn"](trial, "cpu")

    x40, _ = transformers_yarn(40.0)
    x80, _ = transformers_yarn(80.0)
    yarn = get_method("yarn")
    factors, attention = composed_per_pair_factors(yarn, yarn.make_params(factor=2.0), x40, d, base, C)
    composed = rope_inv_freq(d, base).double() / torch.tensor(factors, dtype=torch.float64)
    gap = (composed / x80.double() - 1).abs()
    assert float(gap[:11].max()) < 1e-6 and float(gap[23:].max()) < 1e-6
    assert int(gap.argmax()) == 22 and float(gap.max()) == pytest.approx(0.174, abs=5e-4)
    assert float(gap[11:20].max()) == pytest.approx(0.0274, abs=5e-4)  # pairs 11-19: composed keeps x40's
    composed_logit_scale = m(40.0) ** 2 * attention**2  # the shipped softmax scale times yarn x2's temperature
    assert composed_logit_scale == pytest.approx(2.1426, abs=1e-4) and m(80.0) ** 2 == pytest.approx(2.0684, abs=1e-4)
    assert composed_logit_scale / m(80.0) ** 2 - 1 == pytest.approx(0.036, abs=5e-4)
