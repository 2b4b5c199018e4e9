"""Attention-level methods inside a model: log-n query scaling, ReRoPE and Leaky ReRoPE.

`install_attention(host, settings)` gives every decoder layer's `self_attn` a patched `forward` (an instance
attribute, so removing it brings the class's own forward back, bit for bit). The patched forward serves the
attention shape that LLaMA, Mistral, Qwen2 and Qwen3 share (Qwen3 adds q_norm/k_norm, Qwen2 has q/k/v biases,
which live inside q_proj/k_proj/v_proj).

- **log-n alone** rotates q and k as usual, multiplies each query by max(1, ln n / ln L), and hands over to
  the model's own attention function (SDPA, eager, FlashAttention): the KV cache is the usual one.
- **ReRoPE / Leaky ReRoPE** cache *unrotated* keys and rotate them at use, because a cached key is needed at
  two rotations: its own position (the band |m-n| < w) and n/k (the far region; 0 for ReRoPE). Prefill and
  decoding go through `rerope_attention`, which never builds an L x L matrix: it walks query blocks and, per
  block, attends three key ranges (far keys every query sees, far keys that enter the far region inside the
  block, the band) and merges the three softmax parts exactly with their log-sum-exp.

A checkpoint keeps the settings as `ctxext_attention` in config.json; `register_load_hook` (run at
`import ctxext`) re-installs them on any model built from such a config, so plain
`AutoModelForCausalLM.from_pretrained` works after `import ctxext`.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import CtxextError
from ..methods.attention import AttentionSettings, far_key_positions, far_query_positions, logn_scale
from .families import SUPPORTED_FAMILIES, rotary_host

CONFIG_KEY = "ctxext_attention"  # the config.json entry that records the settings
QUERY_BLOCK = 256  # queries per block; measured on CPU: 256 beat 512-2048 (less masked waste per block)
KERNELS = ("auto", "lse", "concat", "naive")

_STATE = "_ctxext_attention"  # attribute on each patched attention module


class AttentionState:
    """What a patched attention module needs: the settings and the base model whose rotary_emb it reads.

    A plain object, not an nn.Module, so that the base model is not registered as a submodule of its own
    attention layers. `query_block` and `kernel` are tuning knobs (tests shrink the block to exercise it).
    """

    def __init__(self, settings: AttentionSettings, host: nn.Module, query_block: int = QUERY_BLOCK,
                 kernel: str = "auto"):
        if kernel not in KERNELS:
            raise CtxextError(f"unknown ReRoPE kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
        if query_block < 1:
            raise CtxextError(f"query_block must be >= 1, got {query_block}")
        self.settings = settings
        self.host = host
        self.query_block = int(query_block)
        self.kernel = kernel


# ------------------------------------------------------------------------------------- install/remove
def attention_modules(host: nn.Module) -> list[nn.Module]:
    modules = [layer.self_attn for layer in getattr(host, "layers", [])]
    for module in modules:
        missing = [name for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "scaling")
                   if not hasattr(module, name)]
        if missing:
            raise CtxextError(f"{type(module).__name__} lacks {', '.join(missing)}: not the LLaMA-style attention "
                              "that ctxext's attention methods support")
    return modules


def install_attention(host: nn.Module, settings: AttentionSettings | None, query_block: int = QUERY_BLOCK,
                      kernel: str = "auto") -> None:
    """Patch every attention layer of `host` (the base model) with `settings`; None or inactive removes."""
    remove_attention(host)
    if settings is None or not settings.active:
        return
    for module in attention_modules(host):
        module.__dict__[_STATE] = AttentionState(settings, host, query_block, kernel)
        module.forward = types.MethodType(ctxext_attention_forward, module)


def remove_attention(host: nn.Module) -> None:
    """Give every attention layer its class's own forward back (no-op where nothing was installed)."""
    for module in getattr(host, "layers", []):
        attention = getattr(module, "self_attn", None)
        if attention is not None and _STATE in attention.__dict__:
            del attention.__dict__[_STATE]
            attention.__dict__.pop("forward", None)


def installed_settings(host: nn.Module) -> AttentionSettings | None:
    layers = getattr(host, "layers", [])
    state = layers[0].self_attn.__dict__.get(_STATE) if len(layers) else None
    return state.settings if state is not None else None


def set_attention_tuning(model: nn.Module, query_block: int | None = None, kernel: str | None = None) -> None:
    """Change the block size or kernel of an installed ReRoPE (benchmarks and tests; results are the same)."""
    for module in attention_modules(rotary_host(model)):
        state = module.__dict__.get(_STATE)
        if state is None:
            raise CtxextError("no ctxext attention method is installed on this model")
        module.__dict__[_STATE] = AttentionState(state.settings, state.host,
                                                 query_block or state.query_block, kernel or state.kernel)


def sync_attention_with_config(host: nn.Module) -> None:
    """Install what `config.ctxext_attention` says (or remove everything when it is absent)."""
    values = getattr(host.config, CONFIG_KEY, None)
    install_attention(host, AttentionSettings.from_dict(values) if values else None)


def record_attention_in_config(config, settings: AttentionSettings | None) -> None:
    if settings is not None and settings.active:
        setattr(config, CONFIG_KEY, settings.to_dict())
    elif hasattr(config, CONFIG_KEY):
        delattr(config, CONFIG_KEY)


# ------------------------------------------------------------------------------------------ load hook
def _install_from_config_after_init(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if not getattr(config, CONFIG_KEY, None) or getattr(config, "model_type", None) not in SUPPORTED_FAMILIES:
        return
    try:
        host = rotary_host(model)
    except CtxextError:
        return  # not a model with decoder layers (yet)
    sync_attention_with_config(host)


def register_load_hook() -> None:
    """Make any transformers model built from a config with `ctxext_attention` come up patched (idempotent).

    `PreTrainedModel.post_init` runs at the end of every model's __init__, which `from_pretrained` calls
    too; the patch only sets Python attributes, so it does not matter that weights are loaded afterwards.
    """
    current = PreTrainedModel.post_init
    if getattr(current, "_ctxext_hook", False):
        return

    def post_init(self, *args, **kwargs):
        result = current(self, *args, **kwargs)
        _install_from_config_after_init(self)
        return result

    post_init._ctxext_hook = True
    post_init.__wrapped__ = current
    post_init.__doc__ = current.__doc__
    PreTrainedModel.post_init = post_init


# ------------------------------------------------------------------------------------------ rotation
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by cos/sin (batch, seq, rotary_dim), as transformers does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    # Partial rotary: only the first rotary_dim channels turn.
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat(((turned * cos) + (_rotate_half(turned) * sin), kept), dim=-1)


def _rotary_at(host: nn.Module, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the model's own rotary embedding at arbitrary (possibly fractional) positions."""
    return host.rotary_emb(like, positions.to(device=like.device, dtype=torch.float32))


# -------------------------------------------------------------------------------------- the forward
def _family_module(module: nn.Module):
    return sys.modules[type(module).__module__]


def _sliding_window_kwargs(module: nn.Module) -> dict:
    # What the original forward passes to the attention function: Qwen2/Qwen3 per layer, Mistral from config.
    if hasattr(module, "sliding_window"):
        return {"sliding_window": module.sliding_window}
    if getattr(module.config, "model_type", None) == "mistral":
        return {"sliding_window": getattr(module.config, "sliding_window", None)}
    return {}


def _project(module: nn.Module, hidden_states: torch.Tensor):
    hidden_shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query = module.q_proj(hidden_states).view(hidden_shape)
    key = module.k_proj(hidden_states).view(hidden_shape)
    if hasattr(module, "q_norm"):  # Qwen3: RMSNorm per head, before the rotation
        query, key = module.q_norm(query), module.k_norm(key)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    return query.transpose(1, 2), key.transpose(1, 2), value


def ctxext_attention_forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None,
                             **kwargs):
    """The patched attention forward (bound to each attention module by `install_attention`)."""
    state: AttentionState = self.__dict__[_STATE]
    settings = state.settings
    input_shape = hidden_states.shape[:-1]
    query, key, value = _project(self, hidden_states)
    position_ids = kwargs.get("position_ids")

    if not settings.rerope:
        cos, sin = position_embeddings
        query, key = apply_rotation(query, cos, sin), apply_rotation(key, cos, sin)
        if settings.logn:
            positions = position_ids if position_ids is not None else _positions_from_cache(
                past_key_values, self.layer_idx, query)
            query = query * _logn_column(positions, settings, query.dtype)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attn_output, attn_weights = _model_attention(self, query, key, value, attention_mask, kwargs)
    else:
        attn_output, attn_weights = _rerope_forward(self, state, query, key, value, attention_mask, past_key_values,
                                                    kwargs)

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _model_attention(module, query, key, value, attention_mask, kwargs):
    """The model's own attention function (SDPA, eager, FlashAttention...) on rotated q/k, as the original."""
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        module.config._attn_implementation, _family_module(module).eager_attention_forward
    )
    return attention_interface(
        module, query, key, value, attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout, scaling=module.scaling,
        **_sliding_window_kwargs(module), **kwargs,
    )


def _positions_from_cache(past_key_values, layer_idx: int, query: torch.Tensor) -> torch.Tensor:
    past = past_key_values.get_seq_length(layer_idx) if past_key_values is not None else 0
    return torch.arange(past, past + query.shape[2], device=query.device)[None]


def _logn_column(positions: torch.Tensor, settings: AttentionSettings, dtype) -> torch.Tensor:
    """log-n factors shaped (batch, 1, seq, 1) to multiply queries (batch, heads, seq, head_dim)."""
    return logn_scale(positions, settings.original_max_position_embeddings)[:, None, :, None].to(dtype)


def _rerope_forward(module, state: AttentionState, query, key, value, attention_mask, past_key_values, kwargs):
    """ReRoPE attention for (batch, heads, q_len, d) queries; returns ((batch, q_len, heads, d), weights)."""
    settings = state.settings
    position_ids = kwargs.get("position_ids")
    q_len = query.shape[2]
    past = past_key_values.get_seq_length(module.layer_idx) if past_key_values is not None else 0
    total = past + q_len
    window = _sliding_window_kwargs(module).get("sliding_window")
    if window is not None and total > window:
        raise CtxextError(
            f"ReRoPE does not support sliding-window attention: this layer's window is {window} tokens and the "
            f"sequence has {total}; set config.sliding_window = None (or use_sliding_window = False) first"
        )
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, module.layer_idx)  # unrotated keys
    if key.shape[2] != total:
        raise CtxextError("ReRoPE needs a cache that returns exactly the tokens seen so far (DynamicCache); "
                          f"got {key.shape[2]} keys for {total} tokens")

    # Token order gives the relative positions; position_ids only anchor them (left padding shifts all).
    device = query.device
    if position_ids is not None:
        offset = position_ids[:, -1:].to(device) - (total - 1)
    else:
        offset = torch.zeros(1, 1, dtype=torch.long, device=device)
    key_positions = offset + torch.arange(total, device=device)[None]
    query_positions = key_positions[:, past:]

    if settings.logn:
        query = query * _logn_column(query_positions, settings, query.dtype)
    host = state.host
    cos, sin = _rotary_at(host, query, key_positions)
    query_band = apply_rotation(query, cos[:, past:], sin[:, past:])
    key_band = apply_rotation(key, cos, sin)
    if total <= settings.window:
        # Every pair is inside the band, which is plain RoPE: the model's own attention does it exactly.
        return _model_attention(module, query_band, key_band, value, attention_mask, kwargs)
    if module.training and module.attention_dropout > 0:
        raise CtxextError("ReRoPE does not implement attention dropout; set attention_dropout=0")
    leak = settings.leak
    far_q = far_query_positions(query_positions, settings.window, leak)
    if leak == 0:  # ReRoPE: every query at w, keys unrotated
        cos_q, sin_q = _rotary_at(host, query, far_q[:, :1])
        key_far = key
    else:
        cos_q, sin_q = _rotary_at(host, query, far_q)
        cos_k, sin_k = _rotary_at(host, query, far_key_positions(key_positions, leak))
        key_far = apply_rotation(key, cos_k, sin_k)
    query_far = apply_rotation(query, cos_q, sin_q)

    allowed = _allowed_from_model_mask(attention_mask, q_len, total)
    attn = rerope_attention(query_band, query_far, key_band, key_far, value, settings.window, module.scaling,
                            allowed=allowed, query_block=state.query_block, kernel=state.kernel)
    return attn.transpose(1, 2), None


def _allowed_from_model_mask(attention_mask, q_len: int, k_len: int) -> torch.Tensor | None:
    """The model's mask as booleans (batch, 1, q_len, k_len), True = may attend; None when there is none.

    ReRoPE applies causality itself, so only padding matters here; the model gives a bool mask (SDPA), an
    additive float mask (eager) or a 2-D padding mask (FlashAttention).
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise CtxextError(f"ReRoPE cannot use an attention mask of type {type(attention_mask).__name__}; "
                          "load the model with attn_implementation='sdpa' or 'eager'")
    mask = attention_mask
    if mask.dim() == 2:
        mask = mask[:, None, None, :].bool()
    elif mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[..., -q_len:, :k_len]


# ---------------------------------------------------------------------------------- blocked kernel
def _lse_op_available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _pick_kernel(kernel: str, *tensors: torch.Tensor) -> str:
    if kernel != "auto":
        return kernel
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    # The fused CPU op returns the log-sum-exp we merge with, but not its gradient: training takes the
    # concatenated single-SDPA form, which autograd differentiates (and which runs on any device).
    if tensors[0].device.type == "cpu" and not needs_grad and _lse_op_available():
        return "lse"
    return "concat"


def rerope_attention(query_band, query_far, key_band, key_far, value, window: int, scale: float,
                     allowed: torch.Tensor | None = None, query_block: int = QUERY_BLOCK,
                     kernel: str = "auto") -> torch.Tensor:
    """ReRoPE attention without any full score matrix; returns (batch, heads, q_len, head_dim).

    query_band/query_far: (batch, heads, q_len, d), the queries rotated for the band (own position) and for
    the far region; key_band/key_far/value: (batch, kv_heads, k_len, d). The queries are the last q_len
    tokens. A pair (query i, key j <= i) scores with the band tensors when i - j < window, with the far
    tensors otherwise; one softmax over all keys. `allowed` (batch or 1, 1, q_len, k_len) adds padding.
    Grouped-query attention: query heads that share a key head are folded into extra query rows.
    """
    kernel = _pick_kernel(kernel, query_band, key_band, value)
    if kernel == "naive":
        return naive_rerope_attention(query_band, query_far, key_band, key_far, value, window, scale, allowed)
    q_len, k_len = query_band.shape[2], key_band.shape[2]
    start = k_len - q_len  # key index of the first query
    device = query_band.device
    blocks = []
    for b0 in range(0, q_len, query_block):
        b1 = min(q_len, b0 + query_block)
        i0, i1 = start + b0, start + b1
        rows = torch.arange(i0, i1, device=device)[:, None]
        band_start = max(0, i0 - window + 1)  # keys before it are far for every row of the block
        far_end = max(band_start, i1 - window)  # keys in [band_start, far_end) turn far inside the block
        block_allowed = None if allowed is None else allowed[:, :, b0:b1]
        qb, qf = query_band[:, :, b0:b1], query_far[:, :, b0:b1]

        cols = torch.arange(band_start, far_end, device=device)[None]
        far_in_block = _with_padding(cols <= rows - window, block_allowed, band_start, far_end)
        cols = torch.arange(band_start, i1, device=device)[None]
        band = _with_padding((cols > rows - window) & (cols <= rows), block_allowed, band_start, i1)
        always_far = None if block_allowed is None else block_allowed[..., :band_start]

        if kernel == "lse":
            parts = []
            if band_start > 0:
                parts.append(_attend_with_lse(qf, key_far[:, :, :band_start], value[:, :, :band_start],
                                              always_far, scale))
            if far_end > band_start:
                parts.append(_attend_with_lse(qf, key_far[:, :, band_start:far_end],
                                              value[:, :, band_start:far_end], far_in_block, scale))
            parts.append(_attend_with_lse(qb, key_band[:, :, band_start:i1], value[:, :, band_start:i1], band,
                                          scale))
            blocks.append(_merge_softmax_parts(parts).to(value.dtype))
        elif kernel == "concat":
            if always_far is None:
                always_far = torch.ones(1, 1, i1 - i0, band_start, dtype=torch.bool, device=device)
            far_allowed = _cat_masks(always_far, far_in_block)
            blocks.append(_attend_concatenated(qb, qf, key_band[:, :, band_start:i1], key_far[:, :, :far_end],
                                               value[:, :, band_start:i1], value[:, :, :far_end],
                                               band, far_allowed, scale))
        else:
            raise CtxextError(f"unknown ReRoPE kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
    return torch.cat(blocks, dim=2)


def _with_padding(structure: torch.Tensor, block_allowed: torch.Tensor | None, c0: int, c1: int) -> torch.Tensor:
    """Structural mask (rows, cols) combined with the model's padding mask, as (batch or 1, 1, rows, cols)."""
    structure = structure[None, None]
    return structure if block_allowed is None else structure & block_allowed[..., c0:c1]


def _cat_masks(*masks: torch.Tensor) -> torch.Tensor:
    """Concatenate masks along the key axis, broadcasting their batch dimension."""
    batch = max(mask.shape[0] for mask in masks)
    return torch.cat([mask.expand(batch, *mask.shape[1:]) for mask in masks], dim=-1)


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
    bias = None if allowed is None else _fold_mask(_bias(allowed, query.dtype), groups)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _fold_heads(query, kv_heads), key, value, 0.0, False, attn_mask=bias, scale=scale
    )
    out = out.reshape(batch, heads, rows, value.shape[-1])
    lse = lse.reshape(batch, heads, rows)
    if allowed is not None:  # the op reports 0, not -inf, for rows with every key masked
        lse = lse.masked_fill(~allowed.any(-1), float("-inf"))
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


def _attend_concatenated(query_band, query_far, key_band, key_far, value_band, value_far, band_allowed,
                         far_allowed, scale):
    """Both score sets in one SDPA call: [q_band, q_far] . [k_band, 0] is a band score and
    [q_band, q_far] . [0, k_far] a far score, so one softmax covers band and far keys together."""
    batch, heads, rows, dim = query_band.shape
    kv_heads = key_band.shape[1]
    query = torch.cat((query_band, query_far), dim=-1)
    key = torch.cat((torch.cat((torch.zeros_like(key_far), key_far), dim=-1),
                     torch.cat((key_band, torch.zeros_like(key_band)), dim=-1)), dim=2)
    value = torch.cat((value_far, value_band), dim=2)
    value = torch.cat((value, torch.zeros_like(value)), dim=-1)  # same head size as q/k: keeps fused kernels
    allowed = _cat_masks(far_allowed, band_allowed)
    bias = _fold_mask(_bias(allowed, query.dtype), heads // kv_heads)
    out = F.scaled_dot_product_attention(_fold_heads(query, kv_heads), key, value, attn_mask=bias, scale=scale)
    out = out[..., : value_band.shape[-1]].reshape(batch, heads, rows, value_band.shape[-1])
    seen = allowed.any(-1)[..., None]  # (batch, 1, rows, 1)
    return torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))


def naive_rerope_attention(query_band, query_far, key_band, key_far, value, window: int, scale: float,
                           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Su's reference form: two full score matrices, a per-cell choice, one softmax (O(L^2) memory).

    Used by the benchmark as the baseline and by tests as an oracle for the blocked kernel.
    """
    groups = query_band.shape[1] // key_band.shape[1]
    key_band, key_far, value = (t.repeat_interleave(groups, dim=1) for t in (key_band, key_far, value))
    q_len, k_len = query_band.shape[2], key_band.shape[2]
    rows = torch.arange(k_len - q_len, k_len, device=query_band.device)[:, None]
    cols = torch.arange(k_len, device=query_band.device)[None]
    band_scores = (query_band @ key_band.transpose(-1, -2)) * scale
    far_scores = (query_far @ key_far.transpose(-1, -2)) * scale
    scores = torch.where(rows - cols < window, band_scores, far_scores)
    del band_scores, far_scores
    visible = cols <= rows
    if allowed is not None:
        visible = visible & allowed
    scores = scores.float().masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs.to(value.dtype) @ value


__all__ = ["CONFIG_KEY", "AttentionState", "apply_rotation", "install_attention", "installed_settings",
           "naive_rerope_attention", "record_attention_in_config", "register_load_hook", "remove_attention",
           "rerope_attention", "set_attention_tuning", "sync_attention_with_config"]
