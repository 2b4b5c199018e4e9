"""The naive references that ctxext's attention is checked against: full T x T score matrices, float64, no
blocks, no merging. They are for `ctxext check` and the tests (and the memory benchmark's baseline), never what a
patched model runs by default.

- `per_cell_attention`: every score from its own relative position r'(i, j). The query, not yet rotated, is
  turned by r'(i, j) pair by pair and dotted with the unrotated key; a cell marked interpolated (GALI) scores the
  linear interpolation between floor(r') and floor(r') + 1. This is the position-remapping methods' definition
  written out; the oracles in the tests give it r' from the published formulas, `ctxext check` from the
  method's regions.
- `naive_backend`: the remapping kernel's own terms (ctxext.patching.remap_kernel): queries and keys already
  rotated per region, one score matrix per region, each cell taken from its region, one softmax. Selectable as
  the kernel "naive" (`set_attention_tuning(model, kernel="naive")`), the oracle of the kernel's backends.
"""

from __future__ import annotations

import torch


def rotated_scores(query: torch.Tensor, key: torch.Tensor, relative: torch.Tensor, inv_freq: torch.Tensor):
    """(batch, heads, q_len, k_len) dot products of each query turned by relative[i, j] (rotate-half RoPE) with each
    key, summed over the rotary pairs only. query (batch, heads, q_len, d) and key (batch, heads, k_len, d) in
    float64, not rotated; relative (q_len, k_len), or (q_len, k_len, pairs) for one position per pair (DPE)."""
    pairs = inv_freq.shape[0]
    scores = query.new_zeros(*query.shape[:3], key.shape[2])
    for p in range(pairs):  # turned by a: (q_p cos a - q_{p+h} sin a, q_{p+h} cos a + q_p sin a), h = pairs
        angle = (relative[..., p] if relative.dim() == 3 else relative) * inv_freq[p]
        q1, q2 = query[..., p : p + 1], query[..., pairs + p : pairs + p + 1]
        k1, k2 = key[..., p : p + 1], key[..., pairs + p : pairs + p + 1]
        along = q1 @ k1.transpose(-1, -2) + q2 @ k2.transpose(-1, -2)
        across = q1 @ k2.transpose(-1, -2) - q2 @ k1.transpose(-1, -2)
        scores = scores + angle.cos() * along + angle.sin() * across
    return scores


def per_cell_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    relative: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float,
    attention_factor: float = 1.0,
    visible: torch.Tensor | None = None,
    interpolated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention where the score of query i and key j is the query turned by relative[i, j].

    query (batch, heads, q_len, d), key and value (batch, kv_heads, k_len, d): query and key NOT rotated. The
    first 2 * len(inv_freq) dimensions of a head rotate (pair p by relative * inv_freq[p]) and their product is
    scaled by attention_factor ** 2; the other dimensions (partial rotary) dot as they are. `visible`: a boolean
    mask broadcastable to (batch, 1, q_len, k_len), e.g. the causal one (default: every key); a row that sees no
    key gives zeros. `interpolated`: a (q_len, k_len) boolean mask of the cells scored by interpolation between
    floor(r') and floor(r') + 1. Returns (batch, heads, q_len, d_v) in float64.
    """
    groups = query.shape[1] // key.shape[1]
    q, k = query.double(), key.double().repeat_interleave(groups, 1)
    v = value.double().repeat_interleave(groups, 1)
    inv_freq, relative = inv_freq.double().to(q.device), relative.double().to(q.device)
    rotary = 2 * inv_freq.shape[0]
    scores = rotated_scores(q, k, relative, inv_freq)
    if interpolated is not None and bool(interpolated.any()):
        low = relative.floor()
        blended = torch.lerp(
            rotated_scores(q, k, low, inv_freq), rotated_scores(q, k, low + 1, inv_freq), relative - low
        )
        scores = torch.where(interpolated.to(q.device), blended, scores)
    scores = attention_factor**2 * scores + q[..., rotary:] @ k[..., rotary:].transpose(-1, -2)
    scores = scores * scale
    if visible is not None:
        scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v


def naive_backend(queries, keys, value, plan, scale) -> torch.Tensor:
    """Full score matrices, one per region, a per-cell choice by region, one softmax (O(T^2) memory).

    The reference form of Su's ReRoPE generalised to any number of regions, with the remapping backends'
    signature (`plan` a ctxext.patching.remap_kernel.RegionPlan): the oracle of the other backends.
    """
    groups = queries[0].shape[1] // value.shape[1]
    value = value.repeat_interleave(groups, dim=1)
    device = value.device
    cols = torch.arange(plan.k_len, device=device)[None]
    key_lo, key_hi = plan.key_lo.to(device), plan.key_hi.to(device)
    scores = None
    visible = torch.zeros(plan.q_len, plan.k_len, dtype=torch.bool, device=device)
    for r, (q, k) in enumerate(zip(queries, keys)):
        in_region = (cols >= key_lo[r][:, None]) & (cols < key_hi[r][:, None])
        region_scores = (q @ k.repeat_interleave(groups, dim=1).transpose(-1, -2)) * scale
        scores = region_scores if scores is None else torch.where(in_region, region_scores, scores)
        visible = visible | in_region
    if plan.key_allowed is not None:
        visible = visible & plan.key_allowed[:, None, None, :]
    scores = scores.float().masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs.to(value.dtype) @ value
