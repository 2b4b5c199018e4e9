"""DPE's dimension selection: which rotary pairs of each layer carry the attention, measured on a calibration text.

A pair's contribution in a layer is the mean, over tokens and query heads, of |q_p| |k_p|: the norms of the query's
and the key's two channels of pair p (channels p and p + d/2, as rotate_half lays them out), the key taken from the
query head's KV group. Rotation keeps a pair's norm, so positions do not matter. DPE keeps the top k pairs per
layer and groups only those.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from ..dispatch import input_device
from ..errors import CtxextError
from .families import rotary_dim, rotary_host


def pair_contributions(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(layers, pairs): each layer's mean |q_p| |k_p| over the tokens of `input_ids` (1, n) and the query heads.
    Run on the model as it is (unpatched, for DPE's selection)."""
    host = rotary_host(model)
    config = host.config
    dim = rotary_dim(config)
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(host.layers):
        attention = layer.self_attn
        for name in ("q", "k"):  # after q_norm/k_norm where the family has them (Qwen3), before RoPE
            source = getattr(attention, f"{name}_norm", None) or getattr(attention, f"{name}_proj")

            def keep(module, args, output, key=(index, name), head_dim=attention.head_dim):
                captured[key] = output.detach().reshape(*output.shape[:2], -1, head_dim)[..., :dim].float()

            hooks.append(source.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(input_ids.to(input_device(model)), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    rows = []
    for index in range(len(host.layers)):
        q, k = captured[(index, "q")], captured[(index, "k")]  # (batch, tokens, heads, dim)
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        q_norm = torch.hypot(q[..., : dim // 2], q[..., dim // 2 :])
        k_norm = torch.hypot(k[..., : dim // 2], k[..., dim // 2 :])
        rows.append((q_norm * k_norm).mean(dim=(0, 1, 2)).cpu())
    return torch.stack(rows)


def top_pairs(contributions: torch.Tensor, k: int) -> list[list[int]]:
    """Per layer, the k pairs with the largest contribution, in pair order."""
    check_top_pairs(k, contributions.shape[1])
    return [sorted(torch.topk(row, k).indices.tolist()) for row in contributions]


def check_top_pairs(k: int, pairs: int) -> None:
    if not 1 <= k <= pairs:
        raise CtxextError(f"--top-pairs must be between 1 and this model's {pairs} rotary pairs, got {k}")


def check_pair_selection(text: str | None, k: int | None, method: str, params: dict) -> tuple[str, int] | None:
    """(text, k) of DPE's --select-pairs TEXT --top-pairs K (patch and search), None when neither is given; a
    one-line CtxextError for a half-given, misplaced or doubled selection or a missing text file."""
    if text is None and k is None:
        return None
    if text is None or k is None:
        raise CtxextError("--select-pairs TEXT and --top-pairs K go together")
    if method != "dpe":
        raise CtxextError(f"--select-pairs chooses DPE's pairs; it does not apply to {method}")
    if "selected_pairs" in params:
        raise CtxextError("give the pairs either with --selected-pairs or by --select-pairs/--top-pairs, not both")
    if not Path(text).is_file():
        raise CtxextError(f"--select-pairs: text file '{text}' does not exist")
    return text, k


def selection_record(text: str, k: int, method_length: int) -> dict:
    """How the pairs are chosen, as ctxext.yaml and search.json record it (the text by path and content)."""
    return {
        "text": str(text),
        "text_sha256": hashlib.sha256(Path(text).read_bytes()).hexdigest(),
        "top_pairs": k,
        "max_tokens": min(SELECTION_TOKENS, method_length),
        "rule": "top k pairs per layer by mean |q_p||k_p| over tokens and heads",
    }


SELECTION_TOKENS = 4096  # the most tokens of the calibration text measured


def select_pairs(model: nn.Module, tokenizer, text: str, k: int, max_tokens: int) -> list[list[int]]:
    """DPE's selected pairs for `model`: the top k per layer by |q_p| |k_p| on the first `max_tokens` of `text`."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :max_tokens]
    if ids.shape[1] < 2:
        raise CtxextError("the --select-pairs text has fewer than 2 tokens; give a longer calibration text")
    return top_pairs(pair_contributions(model, ids), k)
