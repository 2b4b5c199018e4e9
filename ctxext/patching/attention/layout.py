"""What a forward's tokens are to a remapping method (`TokenLayout`, built by `token_layout`): which keys are padding,
which document each token belongs to in a packed row, and each key's position within its document.

A full forward (no earlier keys in a cache) may hold padded rows (right-padded by a trainer's collator,
left-padded by generate) and packed rows (padding-free packing: position ids that start again at 0 for each
document, attention_mask None, maybe `cu_seq_lens_k`). A document starts at a row's first real token, wherever
the position ids do not increase (a sequence's positions never go back), at each `cu_seq_lens_k` boundary, and
at position ids that jump forward where the model's own mask keeps the two sides apart (transformers' packed
sequences); a jump the mask does not cut is a PoSE gap inside one document. Each document is then remapped
from its own positions and never sees another one: the region bounds of a query stop at its document's first
key. Padding tokens take positions in token order next to their neighbours; their keys are masked, and what
padding queries output is left to the loss to ignore.

A forward with earlier keys in a cache reads its positions as before (`key_positions`): one sequence per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import CtxextError
from ..remap_kernel import key_padding
from .positions import key_padding_from_mask, key_positions, mask_rows


@dataclass(eq=False)
class TokenLayout:
    """positions: (rows or 1, total) int64 on the CPU, each key's position within its document (what the method
    remaps); rotated_at: the positions the model rotated the keys at (different where shared default position
    ids are counted again from each row's first real token); documents: the document index of each key (all 0
    without packing); key_allowed: (batch, total) bool on the attention's device, False for padding, or None;
    mask_separates: whether the model's own mask already keeps the documents apart."""

    positions: torch.Tensor
    rotated_at: torch.Tensor
    documents: torch.Tensor
    key_allowed: torch.Tensor | None
    mask_separates: bool = True

    @property
    def packed(self) -> bool:
        return bool((self.documents > 0).any())

    def search_keys(self) -> tuple[torch.Tensor, int, int]:
        """(keys, low, width): document * width + position - low, increasing along each row, so that a position
        bound inside a document is found by one searchsorted (`key_index`)."""
        low, high = int(self.positions.min()), int(self.positions.max())
        width = high - low + 2
        documents = self.documents.expand_as(self.positions)
        return documents * width + (self.positions - low), low, width

    def first_positions(self) -> torch.Tensor:
        """(rows, total): the position of the first token of each token's document."""
        documents = self.documents.expand_as(self.positions)
        return self.positions.gather(-1, document_starts(documents))


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """(rows, total) int64: the index of the first token of each token's document (documents are contiguous)."""
    index = torch.arange(documents.shape[-1]).expand_as(documents)
    new = torch.ones_like(documents, dtype=torch.bool)
    new[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.where(new, index, 0).cummax(-1).values


def key_index(keys: torch.Tensor, low: int, width: int, document: torch.Tensor, bound: torch.Tensor):
    """The index of the first key of `document` at a position >= `bound` (the document's end where none is),
    for one row's `keys` from `TokenLayout.search_keys`."""
    bound = torch.ceil(bound) if bound.is_floating_point() else bound
    inside = bound.to(torch.long).clamp(low, low + width - 1) - low
    return torch.searchsorted(keys, document * width + inside)


def token_layout(
    position_ids, attention_mask, total: int, q_len: int, cu_seq_lens=None, rebase: bool = True
) -> TokenLayout:
    """The layout of this forward's keys (see the module's docstring); refuses what the kernel cannot honour.
    `rebase`: padded rows that share transformers' default position ids count from their own first real token
    (`counted_from_each_start`)."""
    if q_len < total:  # a cache holds earlier keys: one sequence per row, as before
        allowed = key_padding_from_mask(attention_mask, q_len, total)
        positions = key_positions(position_ids, total, q_len, allowed)
        return TokenLayout(positions, positions, torch.zeros(1, total, dtype=torch.long), allowed)
    allowed, visible, rows = full_mask_view(attention_mask, total)
    ids = torch.arange(total)[None] if position_ids is None else position_ids.detach().to("cpu", torch.long)
    real = torch.ones(1, total, dtype=torch.bool) if allowed is None else allowed.cpu()
    real = real.expand(max(real.shape[0], ids.shape[0]), -1)
    rotated_at = ids
    if rebase and is_default(ids):
        ids = counted_from_each_start(ids, allowed)
    reset, jump = _boundaries(ids, real, cu_seq_lens, total)
    documents, separates = _documents_the_mask_allows(reset, jump, real, visible, rows)
    positions = _padding_in_token_order(ids.expand_as(real), real)
    layout = TokenLayout(positions, rotated_at, documents, allowed, separates)
    keys = layout.search_keys()[0]
    if keys.shape[1] > 1 and bool((keys[:, 1:] <= keys[:, :-1]).any()):
        raise CtxextError(
            "position remapping cannot place padding inside a sequence (between tokens of one document); "
            "pad on the left or on the right"
        )
    return layout


def full_mask_view(attention_mask, total: int):
    """(key padding (batch, total) or None, keys each sampled query row sees (batch, rows) or None, those rows)
    from the model's mask in a full forward. A key is padding where its own query does not see it, or where
    that query sees later keys too (a padding row SDPA unmasked); counts are None where the mask is None or a
    2-D FlashAttention padding mask, which say nothing of documents. Reads the (batch, total, total) mask
    without another copy of it."""
    if attention_mask is None:
        return None, None, None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return key_padding(attention_mask, total), None, None
    if isinstance(attention_mask, torch.Tensor):
        mask = attention_mask[:, 0, -total:, :total]
        if mask.dtype != torch.bool:
            mask = mask > torch.finfo(mask.dtype).min / 2
        # A causal row before the last never sees the last key; one that does sees every key (unmasked padding).
        unmasked = mask[..., -1] & (torch.arange(total, device=mask.device) < total - 1)
        own = mask.diagonal(dim1=-2, dim2=-1) & ~unmasked
        return key_padding(own, total), mask.sum(-1), torch.arange(total)
    batch, sample, visible = mask_rows(attention_mask, total, total)
    index = torch.arange(total, device=visible.device)[None]
    b = torch.arange(batch, device=visible.device)[:, None]
    zero = torch.zeros((), dtype=torch.long, device=visible.device)
    own = attention_mask.mask_mod(b, zero, index, index).expand(batch, total)
    return key_padding(own, total), visible.sum(-1), sample


def is_default(ids: torch.Tensor) -> bool:
    """Whether position ids are transformers' default for a full forward: one (1, total) arange for all rows."""
    return ids.shape[0] == 1 and torch.equal(ids[0], torch.arange(ids.shape[1]))


def counted_from_each_start(ids: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Default position ids (one arange for all rows) counted again from each row's first real token, so that
    a left-padded row has the positions it has alone; unchanged without padding."""
    if allowed is None:
        return ids
    real = allowed.cpu()
    total = real.shape[1]
    first = torch.where(real, torch.arange(total), total).min(-1).values
    return ids - torch.where(first < total, first, 0)[:, None]


def _boundaries(ids: torch.Tensor, real: torch.Tensor, cu_seq_lens, total: int):
    """(reset, jump), (rows, total) bool: where a document must start (a row's first real token, position ids
    that do not increase, `cu_seq_lens` boundaries), and where position ids jump forward by more than one."""
    ids = ids.expand_as(real)
    index = torch.arange(total).expand_as(real)
    previous = torch.where(real, index, -1).cummax(-1).values  # the last real token at or before each
    previous = torch.cat((torch.full_like(previous[:, :1], -1), previous[:, :-1]), dim=1)
    previous_id = ids.gather(-1, previous.clamp(min=0))
    first = real & (previous < 0)
    reset = first | (real & (previous >= 0) & (ids <= previous_id))
    jump = real & (previous >= 0) & (ids > previous_id + 1)
    if cu_seq_lens is not None:
        reset = reset | _cu_boundaries(cu_seq_lens, real, total)
    return reset, reset | jump


def _cu_boundaries(cu_seq_lens, real: torch.Tensor, total: int) -> torch.Tensor:
    """(1, total) bool: the document starts `cu_seq_lens_k` gives (for one flattened row)."""
    cu = torch.as_tensor(cu_seq_lens).detach().to("cpu", torch.long).flatten()
    if real.shape[0] != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu.diff() < 0).any()):
        raise CtxextError(
            f"cu_seq_lens_k ({cu.tolist()[:8]}) does not describe one flattened row of {total} tokens "
            f"(batch {real.shape[0]}): pass the kwargs a collator made for this batch"
        )
    starts = torch.zeros(1, total, dtype=torch.bool)
    starts[0, cu[:-1][cu[:-1] < total]] = True
    return starts


def _documents(starts: torch.Tensor) -> torch.Tensor:
    """Document index per token from document starts; padding goes with the document next to it."""
    return (starts.long().cumsum(-1) - 1).clamp(min=0)


def _expected_visible(real: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """(rows, total): how many keys each query sees under causality, padding and these documents."""
    seen = real.long().cumsum(-1)
    start = document_starts(documents.expand_as(real))
    before = torch.where(start > 0, seen.gather(-1, (start - 1).clamp(min=0)), 0)
    return seen - before


def _documents_the_mask_allows(reset, jump, real, visible, rows) -> tuple[torch.Tensor, bool]:
    """(documents, whether the model's mask keeps them apart). The mask must show causality and padding within
    documents split at jumps (transformers' packed sequences), at resets only, or not at all (ctxext splits
    them at resets all the same); padding queries are not checked (their output is not used)."""
    by_jump, by_reset = _documents(jump), _documents(reset)
    if visible is None:
        return by_reset, not bool((by_reset > 0).any())
    visible = visible.cpu()
    checked = real.expand(visible.shape[0], -1)[:, rows.cpu()]
    for candidate in (by_jump, by_reset, torch.zeros_like(by_reset)):
        expected = _expected_visible(real, candidate).expand(visible.shape[0], -1)[:, rows.cpu()]
        if bool(((expected == visible) | ~checked).all()):
            chosen = by_jump if candidate is by_jump else by_reset
            return chosen, torch.equal(candidate, chosen)
    raise CtxextError(
        "position remapping reads only causality, padding and packed documents from the attention mask, and "
        "this one hides other keys too (a sliding window, a custom mask): pass a causal mask or none"
    )


def _padding_in_token_order(ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Position ids with each padding token placed in token order after the real token before it, or before
    the first real token of its row (a row of padding only keeps token order from 0)."""
    total = real.shape[1]
    index = torch.arange(total).expand_as(real)
    before = torch.where(real, index, -1).cummax(-1).values
    after = torch.where(real, index, total).flip(-1).cummin(-1).values.flip(-1)
    from_before = ids.gather(-1, before.clamp(min=0)) + (index - before)
    from_after = ids.gather(-1, after.clamp(max=total - 1)) - (after - index)
    padded = torch.where(before >= 0, from_before, torch.where(after < total, from_after, index))
    return torch.where(real, ids, padded)
