"""Patching real (tiny, random) models of every family: against transformers' native rope types, identity,
unpatch, replace-not-stack, config updates and unsupported models."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ctxext
from ctxext.errors import CtxextError
from ctxext.patching import ScaledRotaryEmbedding
from tests.helpers import tiny_model

L = 64
TOKENS = torch.randint(0, 256, (2, 5 * L), generator=torch.Generator().manual_seed(1))


def logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(tokens).logits


def native_twin(model, rope_parameters, max_position_embeddings):
    """The same weights in a model configured with transformers' own rope type."""
    config = model.config.to_dict()
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope_parameters}
    config["max_position_embeddings"] = max_position_embeddings
    twin = type(model)(type(model.config).from_dict(config)).eval()
    twin.load_state_dict(model.state_dict())
    return twin


NATIVE = [
    ("linear", {"factor": 4.0}, {"rope_type": "linear", "factor": 4.0}, 4 * L),
    ("yarn", {"factor": 4.0}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L}, 4 * L),
    (
        "yarn",
        {"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": L,
        },
        4 * L,
    ),
    (
        "yarn",
        {"factor": 2.0, "attention_factor": 1.2},
        {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.2, "original_max_position_embeddings": L},
        2 * L,
    ),
    ("dynamic_ntk", {"factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}, L),
    (
        "llama3",
        {"factor": 8.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": L,
        },
        8 * L,
    ),
    (
        "longrope",
        {"factor": 4.0},
        {
            "rope_type": "longrope",
            "factor": 4.0,
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
            "original_max_position_embeddings": L,
        },
        4 * L,
    ),
]


@pytest.mark.parametrize("method,params,rope_parameters,max_positions", NATIVE, ids=lambda v: str(v)[:30])
def test_patched_logits_equal_transformers_native(family, method, params, rope_parameters, max_positions):
    model = tiny_model(family)
    twin = native_twin(model, rope_parameters, max_positions)
    ctxext.patch(model, method, **params)
    torch.testing.assert_close(logits(model), logits(twin), rtol=1e-5, atol=1e-5)
    assert model.config.max_position_embeddings == max_positions
    assert model.config.rope_parameters["rope_type"] == rope_parameters["rope_type"]


# The position-remapping methods act whatever the factor (it only records a length); they are bit-identical
# while the sequence stays in their first region: tests/test_remapping.py.
REMAPPING = {"rerope", "leaky_rerope", "self_extend", "dpe", "dual_chunk", "string", "gali"}


# theta, proportional and cope change frequencies whatever the factor (a new base, zeroed or clipped pairs).
@pytest.mark.parametrize("method", sorted(set(ctxext.METHODS) - {"theta", "proportional", "cope"} - REMAPPING))
def test_factor_one_is_bit_identical(family, method):
    model = tiny_model(family)
    before = logits(model)
    ctxext.patch(model, method, factor=1.0)
    assert torch.equal(logits(model), before)


@pytest.mark.parametrize(
    "method,params",
    [
        ("none", {}),
        ("yarn", {"factor": 4.0}),
        ("ntk_mixed", {"factor": 4.0}),
        ("dynamic_yarn", {"factor": 2.0}),
        ("theta", {"new_base": 1e6}),
    ],
)
def test_unpatch_restores_bit_identical_logits_and_config(family, method, params):
    model = tiny_model(family)
    before, config_before = logits(model), model.config.to_dict()
    ctxext.patch(model, method, **params)
    if method != "none":
        assert not torch.equal(logits(model), before)
    ctxext.unpatch(model)
    assert torch.equal(logits(model), before)
    assert model.config.to_dict() == config_before
    assert not isinstance(model.model.rotary_emb, ScaledRotaryEmbedding)


def test_patching_twice_replaces(family):
    model = tiny_model(family)
    reference = tiny_model(family)
    ctxext.patch(reference, "linear", factor=2.0)
    ctxext.patch(model, "yarn", factor=4.0)
    ctxext.patch(model, "linear", factor=2.0)
    assert torch.equal(logits(model), logits(reference))
    assert not isinstance(model.model.rotary_emb.original, ScaledRotaryEmbedding)
    assert model.config.max_position_embeddings == 2 * L
    ctxext.unpatch(model)
    assert torch.equal(logits(model), logits(tiny_model(family)))


def test_bare_base_model_and_head_dim(family):
    # head_dim 32 with hidden 64 and 4 heads: the rotary dim must come from head_dim, not hidden/heads.
    model = tiny_model(family, head_dim=32).model
    twin = native_twin(
        tiny_model(family, head_dim=32),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L},
        4 * L,
    ).model
    ctxext.patch(model, "yarn", factor=4.0)
    assert model.rotary_emb.inv_freq.shape == (16,)
    with torch.no_grad():
        torch.testing.assert_close(
            model(TOKENS).last_hidden_state, twin(TOKENS).last_hidden_state, rtol=1e-5, atol=1e-5
        )


def test_original_length_defaults_to_the_model_and_can_be_given(family):
    model = tiny_model(family)
    ctxext.patch(model, "yarn", factor=4.0, original_max_position_embeddings=32)
    assert model.config.rope_parameters["original_max_position_embeddings"] == 32
    assert model.config.max_position_embeddings == 128
    for bad in (0, -5, 2.5, "64"):
        with pytest.raises(CtxextError, match="original_max_position_embeddings"):
            ctxext.patch(model, "yarn", factor=4.0, original_max_position_embeddings=bad)


def test_cos_sin_are_fp32_then_cast():
    model = tiny_model("llama").to(torch.bfloat16)
    ctxext.patch(model, "yarn", factor=4.0)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    x = torch.zeros(1, 3, dtype=torch.bfloat16)
    cos, sin = model.model.rotary_emb(x, torch.tensor([[0, 1000, 4000]]))
    assert cos.dtype == torch.bfloat16
    # The reference: the same angles in float64, rounded once to bf16.
    inv = model.model.rotary_emb.inv_freq.double()
    angles = torch.tensor([0.0, 1000.0, 4000.0], dtype=torch.float64)[:, None] * inv
    expected = (torch.cat([angles, angles], -1).cos() * model.model.rotary_emb.attention_scaling).to(torch.bfloat16)
    assert torch.equal(cos[0], expected)


def test_dynamic_decode_differs_from_full_forward_only_by_stale_cached_keys(family):
    """The known defect of dynamic scaling: keys cached earlier keep their old rotation. With the same
    cache, ctxext's dynamic_ntk decodes exactly like transformers' own `dynamic`; inside L it equals a
    full forward pass, and past L the full forward differs."""
    model = tiny_model(family)
    twin = native_twin(model, {"rope_type": "dynamic", "factor": 2.0}, L)
    ctxext.patch(model, "dynamic_ntk", factor=2.0)
    model.generation_config.max_length = twin.generation_config.max_length = 4 * L
    prompt = TOKENS[:1, : L - 8]
    generated = {}
    for name, m in (("ours", model), ("transformers", twin)):
        out = m.generate(prompt, max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
        generated[name] = (out.sequences, torch.stack(out.logits, 1))
    assert torch.equal(generated["ours"][0], generated["transformers"][0])
    torch.testing.assert_close(generated["ours"][1], generated["transformers"][1], rtol=1e-5, atol=1e-5)
    sequence, step_logits = generated["ours"]
    # Recompute every step from scratch: the whole sequence then shares the scale of its current length.
    start = prompt.shape[1]
    recomputed = torch.stack([logits(model, sequence[:, : start + t])[:, -1] for t in range(24)], 1)
    inside = L - start + 1  # steps whose sequence still fits in L
    torch.testing.assert_close(step_logits[:, :inside], recomputed[:, :inside], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(step_logits[:, inside + 1 :], recomputed[:, inside + 1 :], atol=1e-4)


def test_model_without_rope_is_rejected_naming_the_families():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(CtxextError, match="no rotary position embedding"):
        ctxext.patch(gpt2, "yarn", factor=2.0)


def test_peft_wrapped_model_is_patched_through_the_wrapper():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    reference = tiny_model("llama")
    ctxext.patch(model, "linear", factor=2.0)
    ctxext.patch(reference, "linear", factor=2.0)
    torch.testing.assert_close(logits(model), logits(reference))


def test_is_dynamic_says_whether_the_rotation_follows_the_length():
    from ctxext.patching import is_dynamic

    model = tiny_model("llama")
    assert not is_dynamic(model)
    assert not is_dynamic(ctxext.patch(model, "yarn", factor=4.0))
    assert is_dynamic(ctxext.patch(model, "yarn", factor=4.0, dynamic=True))  # s = max(1, l/L)
    assert is_dynamic(ctxext.patch(model, "dynamic_ntk", factor=2.0))
    assert not is_dynamic(ctxext.unpatch(model))
    # A checkpoint saved with transformers' own dynamic type, loaded without ctxext's patch.
    dynamic = tiny_model("qwen2", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert is_dynamic(dynamic)
