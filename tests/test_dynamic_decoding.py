"""The known defect of every dynamic method, pinned down: cached decoding differs from a full forward pass
only because keys (and the hidden states built on them) keep the rotation of the step that cached them.

Oracle: a naive forward pass written here (the model's weights, attention by hand) in which every token t
is computed at its own length l_t: the prompt at its length P, each later token at t + 1. Its query and its
key are rotated with the frequencies and attention factor of l_t. With l_t = T for every token it must equal
the patched model's full forward over T tokens at every T (which ties the oracle's frequencies to the
model's); with the per-step lengths it must equal the KV-cached greedy decode step by step; and past L the
two must differ, or there would be no defect to speak of.
"""

import pytest
import torch

import ctxext
from ctxext.methods import compute_inv_freq, get_method
from tests.helpers import tiny_model

L = 64  # the tiny models' max_position_embeddings
PROMPT = L - 8
NEW_TOKENS = 24  # the decode crosses L at step 9

# Every method whose frequencies follow the current length.
DYNAMIC = [
    ("dynamic_ntk", {"factor": 2.0}),
    ("dynamic_yarn", {"factor": 2.0}),
    ("linear", {"factor": 2.0, "dynamic": True}),
    ("ntk", {"factor": 2.0, "dynamic": True}),
    ("ntk_fixed", {"factor": 2.0, "dynamic": True}),
    ("ntk_mixed", {"factor": 2.0, "dynamic": True}),
    ("ntk_by_parts", {"factor": 2.0, "dynamic": True}),
    ("yarn", {"factor": 2.0, "dynamic": True}),
    ("longrope", {"factor": 2.0}),  # short factors up to L, long ones past it
]


def rotate(x, positions, inv_freq_per_token, factor_per_token):
    """RoPE as in the RoFormer/HF convention (halves, not interleaved), each token with its own frequencies."""
    angles = positions[:, None].double() * inv_freq_per_token.double()
    angles = torch.cat([angles, angles], -1)
    cos = angles.cos() * factor_per_token[:, None]
    sin = angles.sin() * factor_per_token[:, None]
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x.double() * cos + rotated_half.double() * sin).float()


def naive_logits(model, tokens, lengths, method, params):
    """Logits of every position of `tokens` (1-D) when token t is computed at length lengths[t]."""
    config = model.config
    head_dim, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    base = config.rope_parameters["rope_theta"]
    per_length = {n: compute_inv_freq(method, params, head_dim, base, L, seq_len=n) for n in set(lengths)}
    inv_freq = torch.stack([per_length[n][0] for n in lengths])
    factor = torch.tensor([per_length[n][1] for n in lengths], dtype=torch.float64)
    positions = torch.arange(len(tokens))
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()

    with torch.no_grad():
        x = model.model.embed_tokens(tokens)
        for layer in model.model.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(-1, heads, head_dim)
            k = attn.k_proj(h).view(-1, kv_heads, head_dim)
            v = attn.v_proj(h).view(-1, kv_heads, head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before rotating them
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = rotate(q.transpose(0, 1), positions, inv_freq, factor)
            k = rotate(k.transpose(0, 1), positions, inv_freq, factor)
            # Grouped-query attention: query head h reads key/value head h // (heads // kv_heads).
            k = k.repeat_interleave(heads // kv_heads, 0)
            v = v.transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
            scores = (q.double() @ k.double().transpose(1, 2)) / head_dim**0.5
            weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            out = (weights @ v.double()).float().transpose(0, 1).reshape(len(tokens), heads * head_dim)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(model.model.norm(x))


@pytest.mark.parametrize(
    "name,values", DYNAMIC, ids=[f"{n}-{'dynamic' if v.get('dynamic') else 'native'}" for n, v in DYNAMIC]
)
def test_cached_decode_differs_from_full_forward_only_by_stale_cached_rotations(family, name, values):
    model = tiny_model(family)
    ctxext.patch(model, name, **values)
    method = get_method(name)
    params = method.make_params(**values)
    prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    out = model.generate(
        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    step_logits = torch.cat(out.logits)  # step s predicts position PROMPT + s
    tokens = out.sequences[0, : PROMPT + NEW_TOKENS - 1]  # the last generated token is never fed back
    total = len(tokens)

    # The oracle with one length for all tokens is the model's own full forward, at every length.
    with torch.no_grad():
        for length in (PROMPT, L, L + 1, total):
            full = model(tokens[None, :length]).logits[0]
            torch.testing.assert_close(
                naive_logits(model, tokens[:length], [length] * length, method, params), full, rtol=1e-5, atol=1e-5
            )

    # With each token at the length it was computed at, the oracle is the cached decode, step by step.
    stale_lengths = [PROMPT] * PROMPT + [t + 1 for t in range(PROMPT, total)]
    stale = naive_logits(model, tokens, stale_lengths, method, params)[PROMPT - 1 :]
    torch.testing.assert_close(step_logits, stale, rtol=1e-5, atol=1e-5)

    # Recomputed from scratch, each step's sequence shares the scale of its current length: the same as
    # the cached decode while the sequence fits in L, different once it passes L.
    with torch.no_grad():
        recomputed = torch.stack([model(tokens[None, : PROMPT + s]).logits[0, -1] for s in range(NEW_TOKENS)])
    inside = L - PROMPT + 1  # steps whose sequence is at most L long
    torch.testing.assert_close(step_logits[:inside], recomputed[:inside], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(step_logits[inside:], recomputed[inside:], atol=1e-4)
