"""The naive reference (ctxext.patching.reference) against transformers' own RoPE attention.

Every oracle of the remapping methods scores cells with `per_cell_attention`; here it is held to what it must
reduce to: with r'(i, j) = i - j it is plain RoPE attention (queries and keys rotated by transformers'
`apply_rotary_pos_emb`, then torch's scaled_dot_product_attention), for grouped-query heads, partial rotary and
an attention factor; an interpolated cell is the mean of its two integer neighbours' scores; one position per
rotary pair equals the frequencies scaled pair by pair.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ctxext.patching.reference import per_cell_attention

BATCH, HEADS, KV_HEADS, N, DIM = 2, 4, 2, 12, 16


def inputs(seed=0, dim=DIM):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, N, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(BATCH, KV_HEADS, N, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(BATCH, KV_HEADS, N, dim, generator=generator, dtype=torch.float64)
    return q, k, v


def inverse_frequencies(rotary_dim, base=10000.0):
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def rotated(q, k, positions_q, positions_k, inv_freq, factor=1.0):
    """q and k turned at their positions by transformers' rotation on the first 2 * len(inv_freq) dims."""
    rotary = 2 * len(inv_freq)

    def cos_sin(positions):
        angles = positions.double()[:, None] * inv_freq
        emb = torch.cat((angles, angles), -1)
        return (emb.cos() * factor)[None], (emb.sin() * factor)[None]

    cos_q, sin_q = cos_sin(positions_q)
    cos_k, sin_k = cos_sin(positions_k)
    q_turned, _ = apply_rotary_pos_emb(q[..., :rotary], q[..., :rotary], cos_q, sin_q)
    _, k_turned = apply_rotary_pos_emb(k[..., :rotary], k[..., :rotary], cos_k, sin_k)
    return torch.cat((q_turned, q[..., rotary:]), -1), torch.cat((k_turned, k[..., rotary:]), -1)


def causal():
    i, j = torch.arange(N)[:, None], torch.arange(N)[None]
    return j <= i, (i - j).double()


@pytest.mark.parametrize("rotary_dim,factor", [(DIM, 1.0), (8, 1.0), (DIM, 1.3)])
def test_relative_i_minus_j_is_plain_rope_attention(rotary_dim, factor):
    q, k, v = inputs()
    inv_freq = inverse_frequencies(rotary_dim)
    visible, relative = causal()
    got = per_cell_attention(q, k, v, relative, inv_freq, 0.25, factor, visible=visible)
    positions = torch.arange(N)
    q_rot, k_rot = rotated(q, k, positions, positions, inv_freq, factor)
    want = F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_an_interpolated_cell_scores_between_its_integer_neighbours():
    """r' = i - j - 1/2 in every cell, interpolated: each score is the mean of the scores at i - j - 1 and i - j."""
    q, k, v = inputs(1)
    inv_freq = inverse_frequencies(DIM)
    visible, relative = causal()
    got = per_cell_attention(
        q, k, v, relative - 0.5, inv_freq, 0.25, visible=visible, interpolated=torch.ones(N, N, dtype=torch.bool)
    )
    positions = torch.arange(N)
    k_repeated = k.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = []
    for key_shift in (0, 1):  # the key at j or at j + 1: r' = i - j and i - j - 1
        q_rot, k_rot = rotated(q, k_repeated, positions, positions + key_shift, inv_freq)
        scores.append(q_rot @ k_rot.transpose(-1, -2))
    mean = (scores[0] + scores[1]) / 2 * 0.25
    want = torch.softmax(mean.masked_fill(~visible, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_one_position_per_pair_is_the_frequencies_scaled_pair_by_pair():
    q, k, v = inputs(2)
    inv_freq = inverse_frequencies(DIM)
    scales = torch.tensor([1.0, 0.5, 0.25, 2.0, 1.0, 3.0, 0.125, 1.5], dtype=torch.float64)
    visible, relative = causal()
    per_pair = relative[..., None] * scales
    got = per_cell_attention(q, k, v, per_pair, inv_freq, 0.25, visible=visible)
    want = per_cell_attention(q, k, v, relative, inv_freq * scales, 0.25, visible=visible)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    plain = per_cell_attention(q, k, v, relative, inv_freq, 0.25, visible=visible)
    assert (got - plain).abs().max() > 1e-3  # the scales really act


def test_a_row_that_sees_no_key_gives_zeros():
    q, k, v = inputs(3)
    visible, relative = causal()
    visible = visible.clone()
    visible[4] = False
    got = per_cell_attention(q, k, v, relative, inverse_frequencies(DIM), 0.25, visible=visible)
    assert torch.equal(got[:, :, 4], torch.zeros_like(got[:, :, 4]))
    assert got[:, :, 5].abs().max() > 0
