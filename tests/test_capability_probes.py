"""Rotary modules and decoder layers found by what they are, not by name (issue 65 item 4).

LFM2-MoE's rotary is an ordinary one called `model.model.pos_emb`; falcon's and DBRX's decoder layers live in
`transformer.h` / `transformer.blocks` (DBRX's attention one level down, `norm_attn_norm.attn`); Granite MoE Hybrid
with `position_embedding_type="rope"` is an ordinary RoPE model too. Where the probe finds no such module, the
refusal names what there is instead. Oracle: the family's own yarn written in its config, a model built from it
with the same weights; and plain transformers reloading the saved checkpoint.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import ctxext
from ctxext.errors import CtxextError
from ctxext.patching.rotary import ScaledRotaryEmbedding
from tests.family_models import L, build, rebuilt_with

# family: (where its rotary module is, where its decoder layers are)
FOUND = {
    "lfm2_moe": ("model.pos_emb", "model.layers"),
    "falcon": ("transformer.rotary_emb", "transformer.h"),
    "dbrx": ("transformer.rotary_emb", "transformer.blocks"),
    "granitemoehybrid": ("model.rotary_emb", "model.layers"),
}


def _tokens(n: int = 3 * L) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", sorted(FOUND))
def test_a_rotary_and_layers_of_another_name_are_patched_as_the_familys_own_yarn(family, tmp_path):
    rotary_path, layers_path = FOUND[family]
    model, why = build(family)
    assert model is not None, why
    keys = sorted(model.state_dict())
    layout = ctxext.patching.rope_layout(model)
    assert len(layout.layer_types) == len(model.get_submodule(layers_path))
    tokens = _tokens()
    with torch.no_grad():
        before = model(tokens).logits
        ctxext.patch(model, "yarn", factor=4.0)
        assert isinstance(model.get_submodule(rotary_path), ScaledRotaryEmbedding)  # replaced under its own name
        patched = model(tokens).logits
        model.save_pretrained(tmp_path)
        ctxext.unpatch(model)
        assert not isinstance(model.get_submodule(rotary_path), ScaledRotaryEmbedding)
        assert torch.equal(model(tokens).logits, before)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()(tokens).logits
    assert sorted(model.state_dict()) == keys  # no second name in what is saved

    def change(values):
        rope = values["rope_parameters"] if "rope_parameters" in values else values["attn_config"]["rope_parameters"]
        rope.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=L)

    with torch.no_grad():
        theirs = rebuilt_with(family, change)(tokens).logits
    torch.testing.assert_close(patched, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reloaded, patched, atol=1e-5, rtol=1e-5)
    assert (patched - before).abs().max() > 1e-3, f"{family}: yarn x4 changed nothing past L"


@pytest.mark.parametrize(
    ("family", "why"),
    [
        ("moshi", "rotary module(s) sit at model.layers.0.self_attn.rotary_emb, model.layers.1.self_attn.rotary_emb"),
        ("recurrent_gemma", "rotary module(s) sit at model.layers.1.temporal_block.rotary_emb"),
        ("blt", "its 4 rotary module(s) sit at model.local_encoder.rotary_emb"),
        ("hrm_text", "runs its decoder layers as 2 stacks (L_module.layers, H_module.layers)"),
        ("zamba2", "rope parameters in its config but no rotary module"),  # use_mem_rope off, as it ships
    ],
)
def test_a_refusal_names_what_the_model_has_instead(family, why):
    model, reason = build(family)
    assert model is not None, reason
    rope_parameters = json.dumps(model.config.rope_parameters, sort_keys=True, default=str)
    with pytest.raises(CtxextError) as error:
        ctxext.patch(model, "yarn", factor=2.0)
    assert why in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert "compute RoPE in their own way" not in str(error.value)
    assert json.dumps(model.config.rope_parameters, sort_keys=True, default=str) == rope_parameters
