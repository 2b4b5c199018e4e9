"""The attention backends of every position-remapping method (ReRoPE, Leaky ReRoPE, SelfExtend, Dual Chunk
Attention, STRING).

Each method splits the keys a query sees into regions (ctxext.methods.remapping); region r has its own rotated
queries and keys. A backend attends each region separately, gets each part's log-sum-exp, and merges the parts
exactly: one softmax over all keys, and no T x T matrix except in the oracle.

Every backend has the same signature, `backend(queries, keys, value, plan, scale) -> output`, where
queries[r] is (batch, heads, q_len, d), keys[r] and value are (batch, kv_heads, k_len, d), and `plan`
(a `RegionPlan`) says which keys each query sees in each region and which keys are padding. The plan depends
only on positions, so one is built per forward and shared by all layers. `REMAP_BACKENDS` maps names to
backends, the way transformers' ROPE_INIT_FUNCTIONS maps rope types to init functions:

- "lse": CPU inference. Query blocks; per block and region, PyTorch's fused CPU attention, which also returns
  the log-sum-exp (ctxext.compat). No autograd.
- "blockwise": training (and inference off CUDA). The same blocks inside a `torch.autograd.Function` that
  saves only q, k, v, the output and the merged log-sum-exp, and recomputes each block's scores in backward
  (the FlashAttention recipe): memory linear in the length. Forward uses the fused CPU op on CPU, plain
  matmuls elsewhere.
- "flex": CUDA. One `flex_attention` call per region over the whole sequence, with a `BlockMask` built from
  the region bounds (full blocks skip the mask), `return_lse=True`, grouped-query attention, compiled; it
  has a backward, so training uses it too.
- "naive": full score matrices, a per-cell choice by region, one softmax (O(T^2) memory): the reference they
  are checked against (ctxext.patching.reference), selectable by name, never chosen by "auto".

`pick_backend` chooses among the first three by device and by whether gradients are needed. FlashAttention's own kernels are not a
backend: flex_attention on CUDA does the same merge without another dependency, and flash-attn cannot be
installed (or tested) on the CPU machines this project is built on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .. import compat
from ..errors import CtxextError
from .reference import naive_backend

try:  # torch 2.9+: flex_attention's `return_aux`; before it, `return_lse`
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:
    AuxRequest = None

QUERY_BLOCK = 256  # queries per block; measured on CPU: 256 beat 512-2048 (less masked waste per block)
FLEX_BLOCK = 128  # flex_attention's block size
FLEX_MIN_QUERIES = 128  # below this (decode steps) a CUDA forward takes the blockwise backend
NO_KEY = -1e30  # the log-sum-exp of a part that sees no key (finite, so gradients stay finite)


# ------------------------------------------------------------------------------------------- the plan
@dataclass(eq=False)
class RegionPlan:
    """Which keys query i sees in region r: [key_lo[r, i], key_hi[r, i]) (key indices), plus key padding.

    key_lo/key_hi: (regions, q_len) int64 on the CPU, regions not overlapping, each within [0, k_len].
    key_allowed: (batch, k_len) bool on the attention's device, False for padding; None when no key is
    padding. Structures a backend derives from the bounds (column spans, block masks) are kept here, so the
    layers of one forward share them.
    """

    key_lo: torch.Tensor
    key_hi: torch.Tensor
    k_len: int
    key_allowed: torch.Tensor | None = None
    query_block: int = QUERY_BLOCK
    derived: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.query_block < 1:
            raise CtxextError(f"query_block must be >= 1, got {self.query_block}")
        self.key_lo = self.key_lo.to("cpu", torch.long).clamp(0, self.k_len)
        self.key_hi = self.key_hi.to("cpu", torch.long).clamp(0, self.k_len)

    @property
    def regions(self) -> int:
        return self.key_lo.shape[0]

    @property
    def q_len(self) -> int:
        return self.key_lo.shape[1]

    def remember(self, name, compute: Callable):
        if name not in self.derived:
            self.derived[name] = compute()
        return self.derived[name]

    def blocks(self, device) -> list[tuple[int, int, list]]:
        """Per query block: (first row, last row + 1, parts), each part (region, first key, last key + 1, mask);
        the mask (batch or 1, 1, rows, cols) bool adds the ragged region edge and padding, None where all see."""
        return self.remember(("blocks", str(device)), lambda: self._blocks(device))

    def _blocks(self, device):
        out = []
        for b0, b1 in block_rows(self.q_len, self.query_block, bound_jumps(self.key_lo, self.key_hi)):
            parts = []
            for r in range(self.regions):
                lo, hi = self.key_lo[r, b0:b1], self.key_hi[r, b0:b1]
                for c0, c1, ragged in _column_spans(lo, hi):
                    mask = None
                    if ragged:
                        cols = torch.arange(c0, c1)[None]
                        mask = ((cols >= lo[:, None]) & (cols < hi[:, None]))[None, None].to(device)
                    if self.key_allowed is not None:
                        padding = self.key_allowed[:, None, None, c0:c1]
                        mask = padding if mask is None else mask & padding
                    parts.append((r, c0, c1, mask))
            out.append((b0, b1, parts))
        return out


def bound_jumps(key_lo: torch.Tensor, key_hi: torch.Tensor) -> list[int]:
    """Rows where some region's bounds jump (move back, or on by more than two keys), e.g. a chunk boundary.

    Bounds that advance steadily do not jump: one key per row (a band), or up to two (GALI's far edge)."""
    if key_lo.shape[1] < 2:
        return []
    steps = torch.cat((key_lo.diff(dim=1), key_hi.diff(dim=1)))
    jumps = ((steps < 0) | (steps > 2)).any(0)
    return (jumps.nonzero().flatten() + 1).tolist()


def block_rows(q_len: int, query_block: int, jumps: list[int]) -> list[tuple[int, int]]:
    """(first row, last row + 1) of each query block: `query_block` rows at a time, starting afresh at each jump.

    A block that spans a jump sees two unrelated key ranges, so one region's ragged edge covers both (a mask,
    and masked scores, up to a whole sequence wide); starting a block at the jump keeps every ragged edge about
    a block wide. Jumps closer than an eighth of a block to the previous start are ignored (no slivers).
    """
    starts = [0]
    for row in jumps:
        if row - starts[-1] > query_block // 8:
            starts.append(row)
    bounds = []
    for start, end in zip(starts, [*starts[1:], q_len]):
        bounds += [(b0, min(end, b0 + query_block)) for b0 in range(start, end, query_block)]
    return bounds


def key_padding(allowed: torch.Tensor | None, k_len: int) -> torch.Tensor | None:
    """(batch, k_len) key padding from a mask of any usual shape; None where every key may be seen.

    A 4-D (batch, 1, q, k) mask is read at its last query, which sees every earlier key unless it is padding
    (the kernel applies causality and the regions itself).
    """
    if allowed is None:
        return None
    if allowed.dim() == 4:
        allowed = allowed[:, 0, -1, :]
    allowed = allowed[:, :k_len].bool()
    return None if bool(allowed.all()) else allowed


def _column_spans(lo: torch.Tensor, hi: torch.Tensor) -> list[tuple[int, int, bool]]:
    """Split a block's key columns for one region into (start, end, ragged) spans.

    Columns in [max lo, min hi) are seen by every row: no mask. The ragged edges on either side need one.
    """
    seen = hi > lo
    if not bool(seen.any()):
        return []
    lo, hi = lo[seen], hi[seen]
    lo_min, lo_max, hi_min, hi_max = int(lo.min()), int(lo.max()), int(hi.min()), int(hi.max())
    if lo_max >= hi_min or not bool(seen.all()):
        return [(lo_min, hi_max, True)]
    spans = [(lo_min, lo_max, True)] if lo_min < lo_max else []
    spans.append((lo_max, hi_min, False))
    if hi_min < hi_max:
        spans.append((hi_min, hi_max, True))
    return spans


# ------------------------------------------------------------------------------------------- helpers
def _fold_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, rows, d) -> (batch, kv_heads, groups*rows, d): query heads sharing a key head stacked."""
    batch, heads, rows, dim = query.shape
    return query.reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)


def _unfold_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_fold_heads` for (batch, kv_heads, groups*rows, ...) tensors."""
    batch, kv_heads, folded = x.shape[:3]
    return x.reshape(batch, heads, folded // (heads // kv_heads), *x.shape[3:])


def _fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    return mask.repeat(1, 1, groups, 1) if groups > 1 else mask


def _bias(mask: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def merge_softmax_parts(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over the union of the parts' keys, from each part's normalised output and log-sum-exp.

    Returns (output in float32, merged log-sum-exp). A part that sees no key must report NO_KEY (or -inf);
    rows that see no key at all get output 0. Differentiable.
    """
    lses = torch.stack([lse.float().clamp(min=NO_KEY) for _, lse in parts])
    lse_all = torch.logsumexp(lses, dim=0)
    merged = None
    for (out, _), lse in zip(parts, lses):
        term = out.float() * torch.exp(lse - lse_all)[..., None]
        merged = term if merged is None else merged + term
    seen = (lses > NO_KEY / 2).any(0)
    return torch.where(seen[..., None], merged, torch.zeros((), device=merged.device)), lse_all


def _attend_part(query, key, value, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of (batch, heads, rows, d) queries over one key range: (output, log-sum-exp).

    The fused CPU op where it exists (it returns the log-sum-exp), plain float32 matmuls elsewhere.
    """
    batch, heads, rows, _ = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    folded_mask = None if mask is None else _fold_mask(mask.expand(-1, -1, rows, -1), groups)
    if query.device.type == "cpu" and compat.cpu_attention_with_lse_available():
        bias = None if folded_mask is None else _bias(folded_mask, query.dtype)
        out, lse = compat.cpu_attention_with_lse(_fold_heads(query, kv_heads), key, value, bias, scale)
        lse = lse.reshape(batch, kv_heads, groups * rows)
    else:
        scores = (_fold_heads(query, kv_heads).float() @ key.float().transpose(-1, -2)) * scale
        if folded_mask is not None:
            scores = scores.masked_fill(~folded_mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.exp(scores - lse.clamp(min=NO_KEY)[..., None]) @ value.float()
    if folded_mask is not None:  # the CPU op reports 0, not -inf, for rows with every key masked
        lse = lse.masked_fill(~folded_mask.any(-1), NO_KEY)
    out = _unfold_heads(out, heads)
    return out, _unfold_heads(lse, heads)


def _blockwise_forward(
    queries, keys, value, plan: RegionPlan, scale, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in `dtype`, merged log-sum-exp in float32) of the blocked kernel, without autograd."""
    batch, heads, q_len, _ = queries[0].shape
    # Laid out (batch, q_len, heads, d) in memory: the model's transpose and reshape before o_proj are then
    # views, not a copy that o_proj would keep for backward.
    out = torch.zeros(batch, q_len, heads, value.shape[-1], dtype=dtype, device=value.device)
    out = out.transpose(1, 2)
    lse = torch.full((batch, heads, q_len), NO_KEY, dtype=torch.float32, device=value.device)
    for b0, b1, parts in plan.blocks(value.device):
        if not parts:
            continue
        pieces = [
            _attend_part(queries[r][:, :, b0:b1], keys[r][:, :, c0:c1], value[:, :, c0:c1], mask, scale)
            for r, c0, c1, mask in parts
        ]
        out[:, :, b0:b1], lse[:, :, b0:b1] = merge_softmax_parts(pieces)
    return out, lse


# -------------------------------------------------------------------------------------------- backends
def lse_backend(queries, keys, value, plan: RegionPlan, scale) -> torch.Tensor:
    """CPU inference: the blocked kernel on PyTorch's fused CPU attention. No autograd."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*queries, *keys, value)):
        raise CtxextError("the 'lse' remapping backend has no backward; use 'blockwise' (or 'auto') for training")
    return _blockwise_forward(queries, keys, value, plan, scale, dtype=value.dtype)[0]


class _BlockwiseAttention(torch.autograd.Function):
    """The blocked kernel with a recomputing backward: saves q, k, v, output and log-sum-exp, nothing T x T."""

    @staticmethod
    def forward(ctx, plan, scale, value, *queries_and_keys):
        regions = len(queries_and_keys) // 2
        queries, keys = queries_and_keys[:regions], queries_and_keys[regions:]
        out, lse = _blockwise_forward(queries, keys, value, plan, scale)
        ctx.plan, ctx.scale = plan, scale
        ctx.save_for_backward(value, out, lse, *queries_and_keys)
        return out.to(value.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        value, out, lse, *queries_and_keys = ctx.saved_tensors
        regions = len(queries_and_keys) // 2
        queries, keys = queries_and_keys[:regions], queries_and_keys[regions:]
        heads, kv_heads = queries[0].shape[1], value.shape[1]
        groups = heads // kv_heads
        d_queries = [torch.zeros_like(q, dtype=torch.float32) for q in queries]
        d_keys = [torch.zeros_like(k, dtype=torch.float32) for k in keys]
        d_value = torch.zeros_like(value, dtype=torch.float32)
        scale = ctx.scale
        for b0, b1, parts in ctx.plan.blocks(value.device):
            if not parts:
                continue
            d_out = _fold_heads(grad_out[:, :, b0:b1].float(), kv_heads)
            row_lse = _fold_heads(lse[:, :, b0:b1, None], kv_heads)  # (batch, kv, groups*rows, 1)
            # D_i = sum_j P_ij dP_ij = d_out_i . out_i, the softmax's Jacobian term
            delta = (d_out * _fold_heads(out[:, :, b0:b1], kv_heads)).sum(-1, keepdim=True)
            for r, c0, c1, mask in parts:
                q = _fold_heads(queries[r][:, :, b0:b1].float(), kv_heads)
                k, v = keys[r][:, :, c0:c1].float(), value[:, :, c0:c1].float()
                probs = _recomputed_probabilities(q, k, row_lse, mask, scale, groups)
                d_value[:, :, c0:c1] += probs.transpose(-1, -2) @ d_out
                d_scores = _score_gradients(probs, d_out, v, delta, scale)
                del probs  # d_scores took its buffer
                d_queries[r][:, :, b0:b1] += _unfold_heads(d_scores @ k, heads)
                d_keys[r][:, :, c0:c1] += d_scores.transpose(-1, -2) @ q
        cast = [g.to(t.dtype) for g, t in zip(d_queries + d_keys, queries_and_keys)]
        return (None, None, d_value.to(value.dtype), *cast)


def _recomputed_probabilities(q, k, row_lse, mask, scale, groups: int) -> torch.Tensor:
    """softmax probabilities of folded queries q over keys k, from the merged log-sum-exp: exp(q k^T scale - lse),
    zero where `mask` hides a key. One (batch, kv, groups*rows, cols) buffer, every step in place."""
    probs = (q @ k.transpose(-1, -2)).mul_(scale).sub_(row_lse).exp_()
    if mask is not None:
        _per_group(probs, groups).masked_fill_(~mask[:, :, None], 0.0)
    return probs


def _score_gradients(probs, d_out, v, delta, scale) -> torch.Tensor:
    """dL/dscores = P * (dO V^T - D) * scale, written into `probs`' buffer (which it overwrites)."""
    return probs.mul_((d_out @ v.transpose(-1, -2)).sub_(delta)).mul_(scale)


def _per_group(folded: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, kv, groups*rows, cols) -> a (batch, kv, groups, rows, cols) view, so a (rows, cols) mask broadcasts."""
    batch, kv_heads, rows, cols = folded.shape
    return folded.view(batch, kv_heads, groups, rows // groups, cols)


def blockwise_backend(queries, keys, value, plan: RegionPlan, scale) -> torch.Tensor:
    """Training on any device: the blocked kernel with a memory-linear backward (recomputes in backward)."""
    return _BlockwiseAttention.apply(plan, scale, value, *queries, *keys)


_compiled_flex = None


def _flex_attention(device_type: str):
    """flex_attention, compiled where torch can compile it with `return_lse` (not on CPU, torch 2.13)."""
    global _compiled_flex
    if device_type == "cpu":  # eager: torch's math form, for tests and `ctxext check` at small sizes

        def eager_flex_attention(*args, **kwargs):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                return flex_attention(*args, **kwargs)

        return eager_flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def region_block_mask(plan: RegionPlan, region: int, device):
    """flex_attention's BlockMask for one region: blocks wholly inside every row's range are full (no
    mask_mod), blocks at a ragged edge (or with padding) partial; mask_mod tests the exact bounds."""
    q_len, k_len, size = plan.q_len, plan.k_len, FLEX_BLOCK
    q_blocks, k_blocks = -(-q_len // size), -(-k_len // size)
    pad = q_blocks * size - q_len
    lo = F.pad(plan.key_lo[region], (0, pad))  # padded rows see nothing (lo = hi = 0)
    hi = F.pad(plan.key_hi[region], (0, pad))
    lo_rows, hi_rows = lo.view(q_blocks, size), hi.view(q_blocks, size)
    seen = hi_rows > lo_rows
    big = k_len + size
    union_lo = torch.where(seen, lo_rows, big).min(1).values
    union_hi = torch.where(seen, hi_rows, -1).max(1).values
    inner_lo = torch.where(seen, lo_rows, -1).max(1).values
    inner_hi = torch.where(seen, hi_rows, big).min(1).values
    starts = torch.arange(k_blocks) * size  # (k_blocks,)
    ends = (starts + size).clamp(max=k_len)
    touched = (starts[None] < union_hi[:, None]) & (ends[None] > union_lo[:, None])
    full = (starts[None] >= inner_lo[:, None]) & (ends[None] <= inner_hi[:, None]) & seen.all(1)[:, None]
    if plan.key_allowed is not None:
        full = torch.zeros_like(full)
    partial = touched & ~full

    def block_lists(chosen):
        counts = chosen.sum(1).to(torch.int32)
        order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return counts[None, None].to(device), order[None, None].to(device)

    lo_dev, hi_dev = lo.to(device), hi.to(device)
    allowed = plan.key_allowed
    if allowed is not None:
        allowed = F.pad(allowed, (0, k_blocks * size - k_len))

    def mask_mod(b, h, q_idx, kv_idx):
        inside = (kv_idx >= lo_dev[q_idx]) & (kv_idx < hi_dev[q_idx])
        return inside if allowed is None else inside & allowed[b, kv_idx]

    counts, indices = block_lists(partial)
    full_counts, full_indices = block_lists(full)
    return BlockMask.from_kv_blocks(
        counts, indices, full_counts, full_indices, BLOCK_SIZE=size, mask_mod=mask_mod, seq_lengths=(q_len, k_len)
    )


def _flex_with_lse(attend, query, key, value, block_mask, scale, gqa: bool):
    """(output, log-sum-exp) from flex_attention: `return_aux` where torch has it (2.9+), else `return_lse`."""
    if AuxRequest is None:
        return attend(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)
    out, aux = attend(
        query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    return out, aux.lse


def flex_backend(queries, keys, value, plan: RegionPlan, scale) -> torch.Tensor:
    """One flex_attention call per region over the whole sequence, merged by log-sum-exp."""
    device = value.device
    attend = _flex_attention(device.type)
    groups = queries[0].shape[1] // value.shape[1]
    parts = []
    for r, (query, key) in enumerate(zip(queries, keys)):
        block_mask = plan.remember(("flex", r, str(device)), lambda r=r: region_block_mask(plan, r, device))
        parts.append(_flex_with_lse(attend, query, key, value, block_mask, scale, groups > 1))
    return merge_softmax_parts(parts)[0].to(value.dtype)


REMAP_BACKENDS: dict[str, Callable] = {
    "lse": lse_backend,
    "blockwise": blockwise_backend,
    "flex": flex_backend,
    "naive": naive_backend,  # the reference (ctxext.patching.reference): never picked by "auto"; for checking
}
BACKEND_CHOICES = ("auto", *REMAP_BACKENDS)


def pick_backend(requested: str, device: torch.device, needs_grad: bool, q_len: int) -> str:
    """The backend for a forward: `requested` unless it is "auto".

    auto: CUDA (and XPU) take flex for prefill and training, blockwise for short query blocks (decode steps);
    the CPU takes lse for inference and blockwise for training; other devices (MPS) take blockwise.
    """
    if requested not in BACKEND_CHOICES:
        raise CtxextError(f"unknown remapping backend '{requested}'; choose one of {', '.join(BACKEND_CHOICES)}")
    if requested != "auto":
        return requested
    if device.type in ("cuda", "xpu") and q_len >= FLEX_MIN_QUERIES:
        return "flex"
    if device.type == "cpu" and not needs_grad and compat.cpu_attention_with_lse_available():
        return "lse"
    return "blockwise"


def attend_regions(queries, keys, value, plan: RegionPlan, scale: float, kernel: str = "auto") -> torch.Tensor:
    """Run the backend `kernel` names (or `pick_backend`'s choice for "auto") on a region plan."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*queries, *keys, value))
    backend = pick_backend(kernel, value.device, needs_grad, plan.q_len)
    return REMAP_BACKENDS[backend](list(queries), list(keys), value, plan, scale)


def remapped_attention(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    value: torch.Tensor,
    key_lo: torch.Tensor,
    key_hi: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None = None,
    query_block: int = QUERY_BLOCK,
    kernel: str = "auto",
) -> torch.Tensor:
    """Attention where query i sees, in region r, the keys [key_lo[r, i], key_hi[r, i]) with queries[r]/keys[r].

    `allowed` (batch or 1, 1, q_len, k_len) or (batch, k_len) adds key padding. Returns (batch, heads, q_len, d).
    """
    k_len = value.shape[2]
    plan = RegionPlan(key_lo, key_hi, k_len, key_padding(allowed, k_len), query_block)
    return attend_regions(queries, keys, value, plan, scale, kernel)


# ----------------------------------------------------------------------- ReRoPE in the kernel's terms
def band_and_far_ranges(q_len: int, k_len: int, window: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """key_lo/key_hi of ReRoPE's two regions for the last q_len of k_len tokens: band [i-w+1, i], far [0, i-w]."""
    i = torch.arange(k_len - q_len, k_len, device=device)
    band_lo = (i - window + 1).clamp(min=0)
    lo = torch.stack((band_lo, torch.zeros_like(i)))
    hi = torch.stack((i + 1, band_lo))
    return lo, hi


def rerope_attention(
    query_band,
    query_far,
    key_band,
    key_far,
    value,
    window: int,
    scale: float,
    allowed: torch.Tensor | None = None,
    query_block: int = QUERY_BLOCK,
    kernel: str = "auto",
) -> torch.Tensor:
    """ReRoPE attention: pairs at distance < window score with the band tensors, the others with the far ones."""
    lo, hi = band_and_far_ranges(query_band.shape[2], key_band.shape[2], window)
    return remapped_attention(
        [query_band, query_far], [key_band, key_far], value, lo, hi, scale, allowed, query_block, kernel
    )
