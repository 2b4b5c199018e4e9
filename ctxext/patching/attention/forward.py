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
from .memo import ForwardPlan
from .positions import key_padding_from_mask, key_positions
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
    plan = state.memo.plan_for(position_ids, attention_mask, total, q_len)
    query = _scaled_query(plan, settings, query, position_ids, total)
    remap = settings.remap
    if remap is None:
        return call_inner(module, inner, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and total > window:  # refused at patch time; here if the config changed since
        raise CtxextError(
            f"{settings.method} does not support sliding-window attention: this layer's window is {window} "
            f"tokens and the sequence has {total}; set config.sliding_window = None (or use_sliding_window = False)"
        )
    key_allowed = plan.remember("padding", lambda: key_padding_from_mask(attention_mask, q_len, total))
    positions = plan.remember("positions", lambda: key_positions(position_ids, total, q_len, key_allowed))
    if plan.remember("plain", lambda: _within_first_region(remap, positions)):
        return call_inner(module, inner, query, key, value, attention_mask, **kwargs)
    return _remapped_forward(module, state, plan, query, key, value, kwargs)


def _scaled_query(
    plan: ForwardPlan, settings: AttentionSettings, query: torch.Tensor, position_ids, total: int
) -> torch.Tensor:
    """The query times log-n's factor max(1, ln n / ln L) and then the query temperature's, where the settings
    ask for them, at the queries' own position ids (padding tokens carry small ones: factor 1)."""
    q_len = query.shape[2]

    def query_positions():
        return torch.arange(total - q_len, total)[None] if position_ids is None else position_ids.cpu()

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


def _within_first_region(remap, positions: torch.Tensor) -> bool:
    """Whether every (query, key) pair lies in region 0, where r' = r: then the model's own attention runs."""
    span = int((positions[:, -1] - positions[:, 0]).max()) + 1
    if span > remap.plain_up_to():
        return False
    # A shift-invariant rule only sees i - j; the others are plain only from position 0.
    return remap.shift_invariant or bool((positions[:, 0] == 0).all())


def _remapped_forward(module, state: AttentionState, plan: ForwardPlan, query, key, value, kwargs):
    """Attention under a remapping method, for (batch, heads, q_len, d) rotated queries and all rotated keys."""
    remap = state.settings.remap
    q_len = query.shape[2]
    if module.training and kwargs.get("dropout", 0.0) > 0:
        raise CtxextError(f"{state.settings.method} does not implement attention dropout; set attention_dropout=0")
    key_allowed = plan.values["padding"]
    if key_allowed is not None and not bool(plan.remember("last_seen", lambda: key_allowed[:, -1].all())):
        # The last query always sees itself, unless the cache hands over slots it has not filled yet.
        raise CtxextError(
            f"{state.settings.method} needs a cache that holds exactly the tokens seen so far "
            "(DynamicCache, the default), not a StaticCache or a sliding-window cache"
        )

    positions = plan.values["positions"]
    regions = plan.remember("region list", lambda: remap.regions_for(positions[:, positions.shape[1] - q_len :]))
    plans = plan.remember(
        ("regions", state.query_block), lambda: region_plans(regions, positions, q_len, key_allowed, state.query_block)
    )
    queries, keys = region_queries_and_keys(module, state, plan, query, key, positions, regions)
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
