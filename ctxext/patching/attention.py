"""Attention-level methods inside a model, through transformers' AttentionInterface: log-n query scaling and
the position-remapping methods (ReRoPE, Leaky ReRoPE, SelfExtend, Dual Chunk Attention, STRING).

`install_attention(host, settings)` registers a wrapper around the model's attention implementation under the
name `ctxext_<implementation>` (e.g. `ctxext_sdpa`, with the same mask function) and switches the model to it
with `set_attn_implementation`; the settings sit on each attention module. The model's own attention forward
still projects, rotates, caches and calls the attention function; the wrapper then:

- **log-n**: multiplies each query by max(1, ln n / ln L) and hands over to the model's own implementation
  (SDPA, eager, FlashAttention);
- **remapping**: while every pair lies in the method's first region (r' = r) it hands over too, bit for bit;
  past that it turns the rotated queries and cached keys back to unrotated ones with the model's own
  (cos, sin) at their positions, rotates them per region, and runs `remapped_attention`. The KV cache stays
  the usual one (rotated keys), so decoding with a cache equals a full forward.

`remove_attention` switches the implementation back. A checkpoint keeps the settings as `ctxext_attention` in
config.json; `register_load_hook` (run at `import ctxext`) re-installs them on any model built from such a
config, so plain `AutoModelForCausalLM.from_pretrained` works after `import ctxext`.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .. import compat
from ..errors import CtxextError
from ..methods.attention import AttentionSettings, logn_scale
from .families import SUPPORTED_FAMILIES, rotary_host
from .remap_kernel import KERNELS, QUERY_BLOCK, remapped_attention

CONFIG_KEY = "ctxext_attention"  # the config.json entry that records the settings
PREFIX = "ctxext_"  # attention implementations registered by ctxext are named PREFIX + the wrapped one

_STATE = "_ctxext_attention"  # attribute on each patched attention module


class AttentionState:
    """What a patched attention module needs: the settings and the base model whose rotary_emb it reads.

    A plain object, not an nn.Module, so that the base model is not registered as a submodule of its own
    attention layers. `query_block` and `kernel` are tuning knobs (tests shrink the block to exercise it).
    """

    def __init__(self, settings: AttentionSettings, host: nn.Module, rotary_memo: "RotaryMemo",
                 query_block: int = QUERY_BLOCK, kernel: str = "auto"):
        if kernel not in KERNELS:
            raise CtxextError(f"unknown attention kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
        if query_block < 1:
            raise CtxextError(f"query_block must be >= 1, got {query_block}")
        self.settings = settings
        self.host = host
        self.query_block = int(query_block)
        self.kernel = kernel
        self.rotary_memo = rotary_memo  # one per model, shared by its layers


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


def wrapped_implementation(name: str | None) -> str:
    """The implementation a ctxext name wraps ('ctxext_sdpa' -> 'sdpa'); other names are returned as they are."""
    name = name or "eager"
    return name.removeprefix(PREFIX)


def register_wrapper(inner: str) -> str:
    """Register `ctxext_<inner>` with transformers' attention and mask interfaces (idempotent); its name."""
    name = PREFIX + inner
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, functools.partial(ctxext_attention, inner=inner))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS and inner in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def _switch_implementation(host: nn.Module, name: str) -> None:
    if compat.attention_implementation(host.config) == name:
        return
    if isinstance(host, PreTrainedModel):
        host.set_attn_implementation(name)
    else:
        raise CtxextError(f"{type(host).__name__} is not a transformers model: cannot set its attention")


def install_attention(host: nn.Module, settings: AttentionSettings | None, query_block: int = QUERY_BLOCK,
                      kernel: str = "auto") -> None:
    """Patch every attention layer of `host` (the base model) with `settings`; None or inactive removes."""
    remove_attention(host)
    if settings is None or not settings.active:
        return
    modules = attention_modules(host)
    memo = RotaryMemo()
    for module in modules:
        module.__dict__[_STATE] = AttentionState(settings, host, memo, query_block, kernel)
    inner = wrapped_implementation(compat.attention_implementation(host.config))
    _switch_implementation(host, register_wrapper(inner))


def remove_attention(host: nn.Module) -> None:
    """Give the model its own attention implementation back (no-op where nothing was installed)."""
    for module in getattr(host, "layers", []):
        attention = getattr(module, "self_attn", None)
        if attention is not None:
            attention.__dict__.pop(_STATE, None)
    current = compat.attention_implementation(host.config)
    if current is not None and current.startswith(PREFIX):
        _switch_implementation(host, wrapped_implementation(current))


def installed_settings(host: nn.Module) -> AttentionSettings | None:
    layers = getattr(host, "layers", [])
    state = layers[0].self_attn.__dict__.get(_STATE) if len(layers) else None
    return state.settings if state is not None else None


def set_attention_tuning(model: nn.Module, query_block: int | None = None, kernel: str | None = None) -> None:
    """Change the block size or kernel of an installed remapping method (benchmarks and tests; same results)."""
    for module in attention_modules(rotary_host(model)):
        state = module.__dict__.get(_STATE)
        if state is None:
            raise CtxextError("no ctxext attention method is installed on this model")
        module.__dict__[_STATE] = AttentionState(state.settings, state.host, state.rotary_memo,
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


def undo_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of `apply_rotation` with the same cos/sin (which may carry an attention factor), in float32."""
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    rotary = cos.shape[-1]
    turned = x[..., :rotary].float()
    norm = cos * cos + sin * sin  # a^2 per channel: 1 unless the method scales cos and sin
    back = (turned * cos - _rotate_half(turned) * sin) / norm
    return back if rotary == x.shape[-1] else torch.cat((back, x[..., rotary:].float()), dim=-1)


def _rotary_at(host: nn.Module, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the model's own rotary embedding at arbitrary (possibly fractional) positions."""
    return host.rotary_emb(like, positions.to(device=like.device, dtype=torch.float32))


class RotaryMemo:
    """The (cos, sin) one forward needs, computed by its first remapped layer and reused by the others.

    Every layer of a forward asks for the same positions (the keys', and each region's query and key rule), so
    without this a decode step spent about a fifth of its time recomputing them once per layer. The memo holds
    one forward's values: a call at other positions, or with another rotary module or frequencies, starts
    afresh. transformers' dynamic rotary types change their frequencies with every call's positions, so for
    them nothing is kept and every call goes to the module, as before.
    """

    def __init__(self):
        self.signature: tuple | None = None
        self.values: dict = {}

    def lookup(self, host: nn.Module, like: torch.Tensor, positions_key: tuple, name: object,
               positions: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`_rotary_at(host, like, positions())`, computed once per forward; `positions_key` identifies the
        forward's positions (the same in every layer), `name` which positions of it these are."""
        rotary = host.rotary_emb
        if "dynamic" in str(getattr(rotary, "rope_type", "")):
            return _rotary_at(host, like, positions())
        signature = (positions_key, rotary, _frequencies_state(rotary))
        if signature != self.signature:
            self.signature, self.values = signature, {}
        entry = (name, like.dtype, like.device)
        if entry not in self.values:
            self.values[entry] = _rotary_at(host, like, positions())
        return self.values[entry]


def _frequencies_state(rotary: nn.Module) -> tuple | None:
    """Where the rotary module's frequencies live and how often they were changed in place."""
    frequencies = getattr(rotary, "inv_freq", None)
    if not isinstance(frequencies, torch.Tensor):
        return None
    try:
        return frequencies.data_ptr(), frequencies._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return frequencies.data_ptr(), None


# ------------------------------------------------------------------------------- the attention function
def ctxext_attention(module, query, key, value, attention_mask, inner: str = "sdpa", **kwargs):
    """The registered attention function `ctxext_<inner>`: log-n and remapping around the `inner` one."""
    inner_function = ALL_ATTENTION_FUNCTIONS.get_interface(inner, compat.family_eager_attention(module))
    state: AttentionState | None = module.__dict__.get(_STATE)
    if state is None:  # a layer ctxext did not patch
        return inner_function(module, query, key, value, attention_mask, **kwargs)
    settings = state.settings
    q_len, total = query.shape[2], key.shape[2]
    position_ids = kwargs.get("position_ids")
    key_positions = _key_positions(position_ids, total, query.device)
    if settings.logn:
        positions = position_ids if position_ids is not None else key_positions[:, total - q_len:]
        scale = logn_scale(positions.to(query.device), settings.original_max_position_embeddings)
        query = query * scale[:, None, :, None].to(query.dtype)
    remap = settings.remap
    if remap is None or _within_first_region(remap, key_positions, total):
        return inner_function(module, query, key, value, attention_mask, **kwargs)
    return _remapped_forward(module, state, query, key, value, attention_mask, key_positions, kwargs)


def _key_positions(position_ids, total: int, device) -> torch.Tensor:
    """Positions of all keys (batch or 1, total): token order, anchored by the last query's position id.

    Token order gives the relative positions; position_ids only anchor them (left padding shifts a row).
    """
    if position_ids is None:
        offset = torch.zeros(1, 1, dtype=torch.long, device=device)
    else:
        offset = position_ids[:, -1:].to(device) - (total - 1)
    return offset + torch.arange(total, device=device)[None]


def _within_first_region(remap, key_positions: torch.Tensor, total: int) -> bool:
    if total > remap.plain_up_to():
        return False
    # A shift-invariant rule only sees i - j; the others are plain only from position 0.
    return remap.shift_invariant or bool((key_positions[:, 0] == 0).all())


def _remapped_forward(module, state: AttentionState, query, key, value, attention_mask, key_positions, kwargs):
    """Attention under a remapping method, for (batch, heads, q_len, d) rotated queries and all rotated keys."""
    remap = state.settings.remap
    q_len, total = query.shape[2], key.shape[2]
    window = kwargs.get("sliding_window")
    if window is not None and total > window:
        raise CtxextError(
            f"{state.settings.method} does not support sliding-window attention: this layer's window is {window} "
            f"tokens and the sequence has {total}; set config.sliding_window = None (or use_sliding_window = False)"
        )
    if module.training and kwargs.get("dropout", 0.0) > 0:
        raise CtxextError(f"{state.settings.method} does not implement attention dropout; set attention_dropout=0")
    if not remap.shift_invariant and bool((key_positions[:, :1] != key_positions[:1, :1]).any()):
        raise CtxextError(f"{state.settings.method} needs every row of a batch at the same positions "
                          "(no left padding); run the rows one at a time")

    allowed = _allowed_from_model_mask(attention_mask, q_len, total)
    if allowed is not None and not bool(allowed[..., -1, -1].all()):
        # The last query always sees itself, unless the cache hands over slots it has not filled yet.
        raise CtxextError(f"{state.settings.method} needs a cache that holds exactly the tokens seen so far "
                          "(DynamicCache, the default), not a StaticCache or a sliding-window cache")

    host, memo = state.host, state.rotary_memo
    positions_key = (tuple(key_positions[:, 0].tolist()), total, q_len)
    cos_k, sin_k = memo.lookup(host, query, positions_key, "keys", lambda: key_positions)
    query_positions = key_positions[:, total - q_len:]
    plain_query = undo_rotation(query, cos_k[:, total - q_len:], sin_k[:, total - q_len:])
    plain_key = None  # unrotated keys, made once a region rotates keys by a rule of its own (STRING's never does)
    first = key_positions[0, 0]
    queries, keys, lows, highs, rotated_keys = [], [], [], [], {}
    for index, region in enumerate(remap.regions()):
        if region.query_position is None:
            queries.append(query)
        else:
            cos, sin = memo.lookup(host, plain_query, positions_key, ("query", index),
                                   lambda: region.query_position(query_positions))
            queries.append(apply_rotation(plain_query, cos, sin).to(query.dtype))
        if region.key_position is None:
            keys.append(key)
        else:
            rule = region.key_position
            if rule not in rotated_keys:  # regions that share a key rule share the rotated keys
                plain_key = undo_rotation(key, cos_k, sin_k) if plain_key is None else plain_key
                cos, sin = memo.lookup(host, plain_key, positions_key, ("key", index),
                                       lambda: rule(key_positions))
                rotated_keys[rule] = apply_rotation(plain_key, cos, sin).to(key.dtype)
            keys.append(rotated_keys[rule])
        lo, hi = region.key_range(query_positions[0])
        lows.append((lo - first).clamp(0, total))
        highs.append((hi - first).clamp(0, total))
    attn = remapped_attention(queries, keys, value, torch.stack(lows), torch.stack(highs), module.scaling,
                              allowed=allowed, query_block=state.query_block, kernel=state.kernel)
    return attn.transpose(1, 2), None


def _allowed_from_model_mask(attention_mask, q_len: int, k_len: int) -> torch.Tensor | None:
    """The model's mask as booleans (batch, 1, q_len, k_len), True = may attend; None when there is none.

    The remapping kernel applies causality itself, so only padding matters here; the model gives a bool mask
    (SDPA), an additive float mask (eager) or a 2-D padding mask (FlashAttention).
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise CtxextError(f"position remapping cannot use an attention mask of type {type(attention_mask).__name__}; "
                          "load the model with attn_implementation='sdpa' or 'eager'")
    mask = attention_mask
    if mask.dim() == 2:
        mask = mask[:, None, None, :].bool()
    elif mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[..., -q_len:, :k_len]


__all__ = ["CONFIG_KEY", "AttentionState", "apply_rotation", "install_attention", "installed_settings",
           "record_attention_in_config", "register_load_hook", "remove_attention", "set_attention_tuning",
           "sync_attention_with_config", "undo_rotation"]
