"""log-n against a decoder forward written out here: embedding, RMSNorm, q/k/v (+ Qwen3's q_norm/k_norm),
RoPE, query at 1-based position n times max(1, ln n / ln L), causal softmax attention with grouped-query
heads, o_proj, SwiGLU MLP, final norm, LM head. float64, reading only the model's weights and config.

The reference without log-n must give the unpatched model's logits: that validates the reference itself.
"""

import math

import pytest
import torch

import ctxext
from ctxext.methods import compute_inv_freq, get_method
from tests.helpers import tiny_model

L = 16  # the "original" length for log-n; the sequences are longer
SEQ = 48
TOL = 1e-5


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def linear(x, layer):
    y = x @ layer.weight.double().T
    return y if layer.bias is None else y + layer.bias.double()


def rotate(x, cos, sin):
    """RoPE on (batch, heads, seq, dim) with the half-split pairing (i, i + dim/2) of the HF LLaMA code."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


def reference_logits(model, input_ids, inv_freq, attention_factor=1.0, logn_length=None):
    """The forward pass of a LLaMA/Mistral/Qwen2/Qwen3 decoder, float64.

    `inv_freq` and `attention_factor` are the RoPE inputs (cos and sin are both multiplied by the factor, as
    YaRN does); with `logn_length` = L the query at 1-based position n is multiplied by max(1, ln n / ln L).
    """
    config = model.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    batch, seq = input_ids.shape
    eps = config.rms_norm_eps

    positions = torch.arange(seq, dtype=torch.float64)
    angles = positions[:, None] * inv_freq.double()[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    n = positions + 1
    logn = (n.log() / math.log(logn_length)).clamp(min=1.0) if logn_length else torch.ones(seq, dtype=torch.float64)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()

    h = model.model.embed_tokens.weight.double()[input_ids]
    for layer in model.model.layers:
        attn = layer.self_attn
        x = rms_norm(h, layer.input_layernorm.weight, eps)
        q = linear(x, attn.q_proj).view(batch, seq, heads, head_dim)
        k = linear(x, attn.k_proj).view(batch, seq, kv_heads, head_dim)
        v = linear(x, attn.v_proj).view(batch, seq, kv_heads, head_dim)
        if config.model_type == "qwen3":  # per-head RMSNorm on q and k, before the rotation
            q = rms_norm(q, attn.q_norm.weight, eps)
            k = rms_norm(k, attn.k_norm.weight, eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q = q * logn[:, None]
        # Grouped-query attention: query head j reads key/value head j // (heads / kv_heads).
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~causal, float("-inf"))
        out = scores.softmax(-1) @ v
        out = out.transpose(1, 2).reshape(batch, seq, heads * head_dim)
        h = h + linear(out, attn.o_proj)

        mlp = layer.mlp
        x = rms_norm(h, layer.post_attention_layernorm.weight, eps)
        h = h + linear(torch.nn.functional.silu(linear(x, mlp.gate_proj)) * linear(x, mlp.up_proj), mlp.down_proj)

    h = rms_norm(h, model.model.norm.weight, eps)
    return linear(h, model.lm_head)


def plain_inv_freq(config):
    base, dim = config.rope_parameters["rope_theta"], config.head_dim
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def sharp_model(family):
    """A tiny model whose attention is far from uniform (random init is nearly uniform), so that scaling the
    queries changes the logits visibly."""
    model = tiny_model(family, seed=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    return model


def tokens(seed=0):
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def model_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def test_reference_equals_the_unpatched_model(family):
    model = sharp_model(family)
    ids = tokens()
    torch.testing.assert_close(
        model_logits(model, ids), reference_logits(model, ids, plain_inv_freq(model.config)), rtol=TOL, atol=TOL
    )


def test_logn_equals_the_reference(family):
    model = sharp_model(family)
    ids = tokens(1)
    expected = reference_logits(model, ids, plain_inv_freq(model.config), logn_length=L)
    without = reference_logits(model, ids, plain_inv_freq(model.config))
    # log-n matters here: past L it changes the logits by far more than the tolerance.
    assert (expected - without).abs().max() > 100 * TOL
    ctxext.patch(model, "none", logn=True, original_max_position_embeddings=L)
    torch.testing.assert_close(model_logits(model, ids), expected, rtol=TOL, atol=TOL)
    # Up to L log-n is the identity.
    torch.testing.assert_close(model_logits(model, ids[:, :L]), without[:, :L], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logn_with_yarn_equals_the_reference(family):
    model = sharp_model(family)
    ids = tokens(2)
    method = get_method("yarn")
    inv_freq, attention_factor = compute_inv_freq(
        method, method.make_params(factor=4.0), model.config.head_dim, model.config.rope_parameters["rope_theta"], L
    )
    assert attention_factor > 1
    expected = reference_logits(model, ids, inv_freq, attention_factor, logn_length=L)
    ctxext.patch(model, "yarn", factor=4.0, logn=True, original_max_position_embeddings=L)
    torch.testing.assert_close(model_logits(model, ids), expected, rtol=TOL, atol=TOL)
