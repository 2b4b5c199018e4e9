"""What a remapping forward with earlier keys in a cache reads from the model's inputs: every key's position
(`key_positions`) and which keys are padding (`key_padding_from_mask`), refusing masks and position ids the
remapping backends could not honour. A full forward (padded and packed rows) is read by `layout.token_layout`."""

from __future__ import annotations

import torch

from ...errors import CtxextError
from ..remap_kernel import key_padding


def key_positions(position_ids, total: int, q_len: int, key_allowed: torch.Tensor | None) -> torch.Tensor:
    """Positions of all keys (batch or 1, total), int64 on the CPU.

    Without a cache (q_len = total) position_ids give every key's position: gapped ones (PoSE) are used as
    they are and must increase. With a cache only the new tokens' positions are passed: earlier keys are taken
    to sit in token order before them. Left padding: padded tokens carry arbitrary position ids; their keys
    are masked, and the positions of the others follow token order.
    """
    order = torch.arange(total)[None]
    if position_ids is None:
        return order
    ids = position_ids.detach().to("cpu", torch.long)
    anchored = ids[:, -1:] - (total - 1) + order  # token order, ending at the last position id
    in_order = ids == anchored[:, total - q_len :]
    if key_allowed is not None:  # position ids may be (1, q_len) for a batch of padded rows
        in_order = in_order | ~key_allowed[:, total - q_len :].cpu()
    if bool(in_order.all()):
        return anchored
    if q_len < total:
        raise CtxextError(
            "position remapping with a KV cache needs consecutive position ids for the new tokens "
            "(gapped positions, as in PoSE, work in a full forward without a cache)"
        )
    if key_allowed is not None:
        raise CtxextError(
            "position remapping cannot combine gapped position ids (PoSE) with padding; pass unpadded rows"
        )
    if bool((ids[:, 1:] <= ids[:, :-1]).any()):
        raise CtxextError("position remapping needs position ids that increase along the sequence")
    return ids


def key_padding_from_mask(attention_mask, q_len: int, total: int) -> torch.Tensor | None:
    """(batch, total) bool, False for padding keys; None where no key is padding.

    The remapping backends apply causality and the regions themselves, so only padding is read from the
    model's mask: a bool (SDPA) or additive float (eager) 4-D mask, a 2-D padding mask (FlashAttention), or a
    flex_attention BlockMask, whose mask_mod is asked about the last query (which sees every key but padding).
    """
    if attention_mask is None:
        return None
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() == 2:  # FlashAttention's padding mask
            return key_padding(attention_mask, total)
        mask = attention_mask[..., -q_len:, :total]
        if mask.dtype != torch.bool:
            mask = mask > torch.finfo(mask.dtype).min / 2
        allowed = key_padding(mask, total)
        _check_causal_with_padding(mask[:, 0].sum(-1), allowed, torch.arange(q_len), q_len, total)
        return allowed
    _, rows, visible = mask_rows(attention_mask, q_len, total)
    allowed = key_padding(visible[:, -1], total)
    _check_causal_with_padding(visible.sum(-1), allowed, rows, q_len, total)
    return allowed


def mask_rows(attention_mask, q_len: int, total: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(batch, a sample of up to 64 query rows, (batch, rows, total) bool: which keys each sees) from a
    flex_attention BlockMask, asked through its mask_mod."""
    mask_mod = getattr(attention_mask, "mask_mod", None)
    if mask_mod is None:
        raise CtxextError(f"position remapping cannot read an attention mask of type {type(attention_mask).__name__}")
    device = attention_mask.kv_indices.device
    batch = attention_mask.kv_indices.shape[0]
    b = torch.arange(batch, device=device)[:, None, None]
    kv = torch.arange(total, device=device)[None, None]
    zero = torch.zeros((), dtype=torch.long, device=device)
    rows = torch.unique(torch.linspace(0, q_len - 1, min(q_len, 64)).long())
    visible = mask_mod(b, zero, rows.to(device)[None, :, None], kv).expand(batch, len(rows), total)
    return batch, rows, visible


def _check_causal_with_padding(
    visible: torch.Tensor, allowed: torch.Tensor | None, rows: torch.Tensor, q_len: int, total: int
) -> None:
    """Refuse a mask that hides more than later keys and padding: the kernel would not see it.

    `visible` (batch, len(rows)) counts the keys the model's mask lets each of those query rows see; with only
    causality and key padding that is the number of unpadded keys up to the query. A padding query may also
    see nothing, or every key (SDPA unmasks such rows).
    """
    keys = (total - q_len + rows).cpu()
    allowed = torch.ones(1, total, dtype=torch.bool) if allowed is None else allowed.cpu()
    expected = allowed.long().cumsum(-1)[:, keys]
    visible = visible.cpu()
    padding_query = ~allowed[:, keys] & ((visible == 0) | (visible == total))
    if bool(((visible != expected) & ~padding_query).any()):
        raise CtxextError(
            "position remapping with a KV cache reads only causality and padding from the attention mask, "
            "and this one hides other keys too (a sliding window, a custom mask): pass a causal mask or none"
        )
