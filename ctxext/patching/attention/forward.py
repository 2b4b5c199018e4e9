"""The attention function ctxext registers (`ctxext_attention`): log-n and the query temperature scale the
queries, then the wrapped implementation runs, or, for a remapping method past its first region, the remapping
backends (ctxext.patching.remap_kernel) on each region's queries and keys."""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

from ... import compat
from ...errors import CtxextError
from ...methods.attention import AttentionSettings, logn_scale, query_temperature_scale
from ..remap_kernel import attend_regions
from .layout import TokenLayout, counted_from_each_start, full_mask_view, is_default, token_layout
from .memo import ForwardPlan
from .regions import region_plans, region_queries_and_keys
from .state import AttentionState, state_of


def ctxext_attention(module, query, key, value, attention_mask, inner: str = "sdpa", **kwargs):
    """The registered attention function wrapping `inner`: log-n, the query temperature and remapping around the
    model's own one."""
    state = state_of(module)
    if state is None:  # a layer ctxext did not patch
        return call_inner(module, inner, query, key, value, attention_mask, **kwargs)
    settings = state.settings
    q_len, total = query.shape[2], key.shape[2]
    position_ids = kwargs.get("position_ids")
    cu_seq_lens = kwargs.get("cu_seq_lens_k")
    plan = state.memo.plan_for(position_ids, attention_mask, total, q_len, cu_seq_lens)
    query = _scaled_query(plan, settings, query, _query_positions(position_ids, attention_mask, total, q_len))
    remap = settings.remap
    if remap is None:
        return call_inner(module, inner, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and total > window:  # refused at patch time; here if the config changed since
        raise CtxextError(
            f"{settings.method} does not support sliding-window attention: this layer's window is {window} "
            f"tokens and the sequence has {total}; set config.sliding_window = None (or use_sliding_window = False)"
        )
    # Rows that share default position ids are counted from their own first real token where the method's
    # rule depends on where a sequence starts (a shift-invariant one keeps the model's own rotation of keys).
    layout = plan.remember(
        "layout",
        lambda: token_layout(position_ids, attention_mask, total, q_len, cu_seq_lens, not remap.shift_invariant),
    )
    if plan.remember("plain", lambda: _within_first_region(remap, layout)):
        return call_inner(module, inner, query, key, value, attention_mask, **kwargs)
    return _remapped_forward(module, state, plan, query, key, value, kwargs)


def _query_positions(position_ids, attention_mask, total: int, q_len: int):
    """A function giving the queries' positions, as the scales read them: the position ids, counted from each
    row's first real token where padded rows share transformers' default ones (`counted_from_each_start`)."""

    def positions() -> torch.Tensor:
        if position_ids is None:
            return torch.arange(total - q_len, total)[None]
        ids = position_ids.cpu()
        if q_len == total and is_default(ids):
            return counted_from_each_start(ids, full_mask_view(attention_mask, total)[0])
        return ids

    return positions


def _scaled_query(plan: ForwardPlan, settings: AttentionSettings, query: torch.Tensor, query_positions):
    """The query times log-n's factor max(1, ln n / ln L) and then the query temperature's, where the settings
    ask for them, at the queries' own positions (padding tokens carry small ones: factor 1)."""
    if settings.logn:
        scale = plan.remember(
            ("logn", query.device),
            lambda: logn_scale(query_positions(), settings.original_max_position_embeddings).to(query.device),
        )
        query = query * scale[:, None, :, None].to(query.dtype)
    if settings.query_temperature is not None:
        scale = plan.remember(
            ("query_temperature", query.device),
            lambda: query_temperature_scale(
                query_positions(), settings.query_temperature, settings.original_max_position_embeddings
            ).to(query.device),
        )
        query = query * scale[:, None, :, None].to(query.dtype)
    return query


def call_inner(module, inner: str, query, key, value, attention_mask, **kwargs):
    """The wrapped implementation, as transformers would call it for a model loaded with `inner`."""
    function = ALL_ATTENTION_FUNCTIONS.get_interface(inner, compat.family_eager_attention(module))
    if is_flash_attention_requested(requested_attention_implementation=inner):
        module = compat.module_with_attention_implementation(module, inner)
    return function(module, query, key, value, attention_mask, **kwargs)


def _within_first_region(remap, layout: TokenLayout) -> bool:
    """Whether every (query, key) pair lies in region 0, where r' = r, in documents the model's own mask keeps
    apart: then the model's own attention runs."""
    if not layout.mask_separates:
        return False
    first = layout.first_positions()
    span = int((layout.positions - first).max()) + 1
    if span > remap.plain_up_to():
        return False
    # A shift-invariant rule only sees i - j; the others are plain only from position 0.
    return remap.shift_invariant or bool((first == 0).all())


def _remapped_forward(module, state: AttentionState, plan: ForwardPlan, query, key, value, kwargs):
    """Attention under a remapping method, for (batch, heads, q_len, d) rotated queries and all rotated keys."""
    remap = state.settings.remap
    q_len = query.shape[2]
    if module.training and kwargs.get("dropout", 0.0) > 0:
        raise CtxextError(f"{state.settings.method} does not implement attention dropout; set attention_dropout=0")
    layout = plan.values["layout"]
    key_allowed, total = layout.key_allowed, key.shape[2]
    last_seen = q_len == total or key_allowed is None or plan.remember("last_seen", lambda: key_allowed[:, -1].all())
    if not bool(last_seen):
        # With a cache the last query always sees itself, unless the cache hands over slots it has not filled
        # yet (in a full forward the last token of a right-padded row is padding).
        raise CtxextError(
            f"{state.settings.method} needs a cache that holds exactly the tokens seen so far "
            "(DynamicCache, the default), not a StaticCache or a sliding-window cache"
        )
    positions = layout.positions
    regions = plan.remember("region list", lambda: remap.regions_for(positions[:, positions.shape[1] - q_len :]))
    plans = plan.remember(
        ("regions", state.query_block), lambda: region_plans(regions, layout, q_len, state.query_block)
    )
    queries, keys = region_queries_and_keys(module, state, plan, query, key, layout, regions)
    outputs = [
        attend_regions(
            queries if rows is None else [q[rows] for q in queries],
            keys if rows is None else [k[rows] for k in keys],
            value if rows is None else value[rows],
            region_plan,
            module.scaling,
            state.kernel,
        )
        for rows, region_plan in plans
    ]
    attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return attn.transpose(1, 2), None
