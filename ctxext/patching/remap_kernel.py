"""The blockwise attention kernel of every position-remapping method (ReRoPE, Leaky ReRoPE, SelfExtend, Dual
Chunk Attention, STRING).

Each method splits the keys a query sees into regions (ctxext.methods.remapping); region r has its own rotated
queries and keys. `remapped_attention` walks query blocks and, per block and region, attends the region's keys
with a fused kernel that also returns the log-sum-exp, then merges the parts exactly: one softmax over all keys,
no T x T matrix. Columns every row of the block sees in a region go through one unmasked call; the ragged
edges through masked calls.

Kernels: "lse" (CPU, no autograd) uses PyTorch's fused CPU flash attention, which returns the log-sum-exp
(ctxext.compat). "concat" puts every region into a single `scaled_dot_product_attention` call, exact and
differentiable, on any device: the queries of all regions are concatenated along the head dimension and each
region's keys sit in their own slot, zeros elsewhere, so a query-key product picks exactly one region's score.
"naive" builds full score matrices (the test oracle and benchmark baseline).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import compat
from ..errors import CtxextError

QUERY_BLOCK = 256  # queries per block; measured on CPU: 256 beat 512-2048 (less masked waste per block)
KERNELS = ("auto", "lse", "concat", "naive")


def pick_kernel(kernel: str, *tensors: torch.Tensor) -> str:
    if kernel not in KERNELS:
        raise CtxextError(f"unknown attention kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
    if kernel != "auto":
        return kernel
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    # The fused CPU op returns the log-sum-exp we merge with, but not its gradient: training takes the
    # concatenated single-SDPA form, which autograd differentiates (and which runs on any device).
    if tensors[0].device.type == "cpu" and not needs_grad and compat.cpu_attention_with_lse_available():
        return "lse"
    return "concat"


def remapped_attention(queries: list[torch.Tensor], keys: list[torch.Tensor], value: torch.Tensor,
                       key_lo: torch.Tensor, key_hi: torch.Tensor, scale: float,
                       allowed: torch.Tensor | None = None, query_block: int = QUERY_BLOCK,
                       kernel: str = "auto") -> torch.Tensor:
    """Attention where query i sees, in region r, the keys [key_lo[r, i], key_hi[r, i]) with queries[r]/keys[r].

    queries[r]: (batch, heads, q_len, d); keys[r], value: (batch, kv_heads, k_len, d); key_lo/key_hi:
    (regions, q_len) key indices (the regions must not overlap). `allowed` (batch or 1, 1, q_len, k_len)
    adds padding. Returns (batch, heads, q_len, d). Grouped-query attention: query heads that share a key
    head are folded into extra query rows.
    """
    kernel = pick_kernel(kernel, queries[0], keys[0], value)
    if query_block < 1:
        raise CtxextError(f"query_block must be >= 1, got {query_block}")
    if kernel == "naive":
        return naive_remapped_attention(queries, keys, value, key_lo, key_hi, scale, allowed)
    q_len = queries[0].shape[2]
    device = value.device
    blocks = []
    for b0 in range(0, q_len, query_block):
        b1 = min(q_len, b0 + query_block)
        block_allowed = None if allowed is None else allowed[:, :, b0:b1]
        parts = []  # (region, first key, last key + 1, mask or None)
        for r in range(len(queries)):
            lo, hi = key_lo[r, b0:b1], key_hi[r, b0:b1]
            for c0, c1, masked in _column_spans(lo, hi):
                mask = None
                if masked:
                    cols = torch.arange(c0, c1, device=device)[None]
                    mask = ((cols >= lo[:, None]) & (cols < hi[:, None]))[None, None]
                if block_allowed is not None:
                    padding = block_allowed[..., c0:c1]
                    mask = padding if mask is None else mask & padding
                parts.append((r, c0, c1, mask))
        if kernel == "lse":
            outputs = [_attend_with_lse(queries[r][:, :, b0:b1], keys[r][:, :, c0:c1], value[:, :, c0:c1], mask,
                                        scale) for r, c0, c1, mask in parts]
            blocks.append(_merge_softmax_parts(outputs).to(value.dtype))
        else:
            blocks.append(_attend_concatenated([q[:, :, b0:b1] for q in queries], keys, value, parts, b1 - b0,
                                               scale))
    return torch.cat(blocks, dim=2)


def _column_spans(lo: torch.Tensor, hi: torch.Tensor) -> list[tuple[int, int, bool]]:
    """Split a block's key columns for one region into (start, end, needs a mask) spans.

    Columns in [max lo, min hi) are seen by every row: no mask. The ragged edges on either side need one.
    """
    seen = hi > lo
    if not bool(seen.any()):
        return []
    lo, hi = lo[seen], hi[seen]
    lo_min, lo_max, hi_min, hi_max = int(lo.min()), int(lo.max()), int(hi.min()), int(hi.max())
    all_rows = bool(seen.all())
    if lo_max >= hi_min or not all_rows:
        return [(lo_min, hi_max, True)]
    spans = [(lo_min, lo_max, True)] if lo_min < lo_max else []
    spans.append((lo_max, hi_min, False))
    if hi_min < hi_max:
        spans.append((hi_min, hi_max, True))
    return spans


def _fold_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, rows, d) -> (batch, kv_heads, groups*rows, d): query heads sharing a key head stacked."""
    batch, heads, rows, dim = query.shape
    return query.reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)


def _fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    return mask.repeat(1, 1, groups, 1) if groups > 1 else mask


def _bias(mask: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _attend_with_lse(query, key, value, allowed, scale):
    """Softmax attention over one key range: (output, log-sum-exp), -inf where a row sees no key."""
    batch, heads, rows, _ = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    bias = None if allowed is None else _fold_mask(_bias(allowed.expand(-1, -1, rows, -1), query.dtype), groups)
    out, lse = compat.cpu_attention_with_lse(_fold_heads(query, kv_heads), key, value, bias, scale)
    out = out.reshape(batch, heads, rows, value.shape[-1])
    lse = lse.reshape(batch, heads, rows)
    if allowed is not None:  # the op reports 0, not -inf, for rows with every key masked
        lse = lse.masked_fill(~allowed.expand(-1, -1, rows, -1).any(-1), float("-inf"))
    return out, lse


def _merge_softmax_parts(parts) -> torch.Tensor:
    """One softmax over the union of the parts' keys, from each part's normalised output and log-sum-exp."""
    if len(parts) == 1:
        out, lse = parts[0]
        return out.masked_fill(torch.isinf(lse)[..., None], 0.0)
    lse_all = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    # Rows that see no key at all (padding) get 0 rather than NaN.
    lse_all = lse_all.masked_fill(torch.isinf(lse_all), 0.0)
    merged = None
    for out, lse in parts:
        term = out.float() * torch.exp(lse - lse_all)[..., None]
        merged = term if merged is None else merged + term
    return merged


def _attend_concatenated(queries, keys, value, parts, rows: int, scale):
    """Every region's part in one SDPA call. The query is [q_0, ..., q_{R-1}] along the head dimension; a
    part of region r carries its keys in slot r and zeros elsewhere, so each product is one region's score."""
    regions = len(queries)
    batch, heads, _, dim = queries[0].shape
    kv_heads = value.shape[1]
    query = torch.cat(queries, dim=-1)
    key_parts, value_parts, masks = [], [], []
    for r, c0, c1, mask in parts:
        k = keys[r][:, :, c0:c1]
        slots = [k if s == r else torch.zeros_like(k) for s in range(regions)]
        key_parts.append(torch.cat(slots, dim=-1))
        value_parts.append(value[:, :, c0:c1])
        if mask is None:
            mask = torch.ones(1, 1, rows, c1 - c0, dtype=torch.bool, device=value.device)
        masks.append(mask.expand(-1, -1, rows, -1))
    if not key_parts:
        return torch.zeros(batch, heads, rows, value.shape[-1], dtype=value.dtype, device=value.device)
    key = torch.cat(key_parts, dim=2)
    values = torch.cat(value_parts, dim=2)
    width = query.shape[-1]
    # Same head size for q, k and v keeps SDPA on its fused kernels.
    values_padded = torch.cat((values, values.new_zeros(*values.shape[:-1], width - values.shape[-1])), dim=-1)
    batch_masks = max(m.shape[0] for m in masks)
    allowed = torch.cat([m.expand(batch_masks, -1, -1, -1) for m in masks], dim=-1)
    bias = _fold_mask(_bias(allowed, query.dtype), heads // kv_heads)
    out = F.scaled_dot_product_attention(_fold_heads(query, kv_heads), key, values_padded, attn_mask=bias,
                                         scale=scale)
    out = out[..., : value.shape[-1]].reshape(batch, heads, rows, value.shape[-1])
    seen = allowed.any(-1)[..., None]  # (batch, 1, rows, 1)
    return torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))


def naive_remapped_attention(queries, keys, value, key_lo, key_hi, scale, allowed=None) -> torch.Tensor:
    """Full score matrices, one per region, a per-cell choice by region, one softmax (O(T^2) memory).

    The reference form of Su's ReRoPE generalised to any number of regions: the oracle for the blocked
    kernel in tests, and the baseline in the memory benchmark.
    """
    groups = queries[0].shape[1] // value.shape[1]
    value = value.repeat_interleave(groups, dim=1)
    k_len = value.shape[2]
    cols = torch.arange(k_len, device=value.device)[None]
    scores = None
    visible = torch.zeros(queries[0].shape[2], k_len, dtype=torch.bool, device=value.device)
    for r, (q, k) in enumerate(zip(queries, keys)):
        in_region = (cols >= key_lo[r][:, None]) & (cols < key_hi[r][:, None])
        region_scores = (q @ k.repeat_interleave(groups, dim=1).transpose(-1, -2)) * scale
        scores = region_scores if scores is None else torch.where(in_region, region_scores, scores)
        visible |= in_region
    if allowed is not None:
        visible = visible & allowed
    scores = scores.float().masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs.to(value.dtype) @ value


# ----------------------------------------------------------------------- ReRoPE in the kernel's terms
def band_and_far_ranges(q_len: int, k_len: int, window: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """key_lo/key_hi of ReRoPE's two regions for the last q_len of k_len tokens: band [i-w+1, i], far [0, i-w]."""
    i = torch.arange(k_len - q_len, k_len, device=device)
    band_lo = (i - window + 1).clamp(min=0)
    lo = torch.stack((band_lo, torch.zeros_like(i)))
    hi = torch.stack((i + 1, band_lo))
    return lo, hi


def rerope_attention(query_band, query_far, key_band, key_far, value, window: int, scale: float,
                     allowed: torch.Tensor | None = None, query_block: int = QUERY_BLOCK,
                     kernel: str = "auto") -> torch.Tensor:
    """ReRoPE attention: pairs at distance < window score with the band tensors, the others with the far ones."""
    lo, hi = band_and_far_ranges(query_band.shape[2], key_band.shape[2], window, query_band.device)
    return remapped_attention([query_band, query_far], [key_band, key_far], value, lo, hi, scale, allowed,
                              query_block, kernel)
