"""Attention-level methods inside a model, through transformers' AttentionInterface: log-n query scaling and
the position-remapping methods (ReRoPE, Leaky ReRoPE, SelfExtend, Dual Chunk Attention, STRING).

`install_attention(host, settings)` registers a wrapper around the model's attention implementation (eager,
sdpa, flex_attention or FlashAttention) as `wrapper_name(inner)` (e.g. `ctxext_sdpa`, `ctxext_fa2`, with the
inner one's mask function) and switches the model to it with `set_attn_implementation`; the settings sit on
each attention module. What a method cannot run under is refused before anything changes
(`check_can_install`). The model's own attention forward still projects, rotates, caches and calls the
attention function; the wrapper then:

- **log-n**: multiplies each query by max(1, ln n / ln L) and hands over to the model's own implementation;
- **remapping**: while every pair lies in the method's first region (r' = r) it hands over too, bit for bit;
  past that it turns the rotated queries and cached keys back to unrotated ones with the model's own
  (cos, sin) at their positions, rotates them per region, and runs a remapping backend
  (ctxext.patching.remap_kernel) on a region plan that the forward's first layer builds for all layers
  (`ForwardPlan`). The KV cache stays the usual one (rotated keys), so decoding with a cache equals a full
  forward; each of its layers also keeps its keys as the method rotates them (`KeptKeys`), so that a decode
  step rotates only its new keys.

`remove_attention` switches the implementation back. A checkpoint keeps the settings as `ctxext_attention` in
config.json; `register_load_hook` (run at `import ctxext`) re-installs them on any model built from such a
config, so plain `AutoModelForCausalLM.from_pretrained` works after `import ctxext`.

Threads: one patched model may run forwards in several threads at once, at different lengths. The settings on
the layers are read-only during a forward, and the `ForwardPlan` that a forward's layers share is kept per
thread (`ForwardMemo`), so no thread sees another's positions, regions or (cos, sin); ctxext's rotary module
keeps its dynamic frequencies the same way (patching/rotary.py). Not covered: changing the patch
(`patch`, `unpatch`, `set_attention_tuning`) while another thread runs the model, and a rotary module of
transformers' own dynamic types, which updates its frequencies in place (a dynamic checkpoint loaded without
ctxext's stateless method): give each thread its own model there.
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import StaticLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.utils.generic import is_flash_attention_requested

from .. import compat
from ..errors import CtxextError
from ..methods.attention import AttentionSettings, logn_scale, query_temperature_scale
from ..validate import boolean
from .families import attention_of, rope_layout, rotary_host
from .refusals import AttentionRequest, first_refusal
from .remap_kernel import BACKEND_CHOICES, QUERY_BLOCK, RegionPlan, attend_regions, key_padding

CONFIG_KEY = "ctxext_attention"  # the config.json entry that records the settings
PREFIX = "ctxext_"  # attention implementations registered by ctxext start with this

_STATE = "_ctxext_attention"  # attribute on each patched attention module
_CACHE_CHECK = "_ctxext_cache_check"  # attribute on the base model: the handle of its cache-refusing hook
_WRAPPED: dict[str, str] = {}  # registered wrapper name -> the implementation it wraps


class AttentionState:
    """What a patched attention module needs: the settings and the base model whose rotary_emb it reads.

    A plain object, not an nn.Module, so that the base model is not registered as a submodule of its own
    attention layers. `layer_type` is the layer's type where the rotary module keeps one set of frequencies per
    type (None where one set serves every layer). `query_block` and `kernel` (a remapping backend, or "auto")
    are tuning knobs (tests shrink the block to exercise it, and force each backend); `keep_keys=False` trades
    decode speed for the memory of `KeptKeys`.
    """

    def __init__(
        self,
        settings: AttentionSettings,
        host: nn.Module,
        memo: ForwardMemo,
        query_block: int = QUERY_BLOCK,
        kernel: str = "auto",
        keep_keys: bool = True,
        layer_type: str | None = None,
    ):
        if kernel not in BACKEND_CHOICES:
            raise CtxextError(f"unknown remapping backend '{kernel}'; choose one of {', '.join(BACKEND_CHOICES)}")
        if query_block < 1:
            raise CtxextError(f"query_block must be >= 1, got {query_block}")
        self.settings = settings
        self.host = host
        self.query_block = int(query_block)
        self.kernel = kernel
        self.keep_keys = boolean("keep_keys", keep_keys)
        self.memo = memo  # one per model, shared by its layers
        self.layer_type = layer_type


# ------------------------------------------------------------------------------------- install/remove
def _all_attention(host: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, attention module) of every decoder layer with softmax attention."""
    found = []
    for index, layer in enumerate(getattr(host, "layers", [])):
        module = attention_of(layer)
        if module is not None:
            found.append((index, module))
    return found


def attention_modules(host: nn.Module, layers: tuple[int, ...] | None = None) -> list[nn.Module]:
    """The attention modules of `layers` (default: every layer that applies RoPE), checked for what ctxext's
    attention function reads from them."""
    if layers is None:
        layers = default_layers(host)
    chosen = dict(_all_attention(host))
    modules = [chosen[i] for i in layers if i in chosen]
    for module in modules:
        missing = [name for name in ("layer_idx", "scaling") if not hasattr(module, name)]
        if missing:
            raise CtxextError(
                f"{type(module).__name__} lacks {', '.join(missing)}: not the attention layout that ctxext's "
                "attention methods support"
            )
    return modules


def default_layers(host: nn.Module) -> tuple[int, ...]:
    """Every layer that applies RoPE (NoPE, linear-attention and other layers left out)."""
    return rope_layout(host).attention_layers()


def wrapper_name(inner: str) -> str:
    """The name ctxext registers its wrapper of `inner` under: 'ctxext_sdpa', 'ctxext_fa2' for
    'flash_attention_2'. transformers takes every name containing "flash" (or shaped like a hub kernel,
    org/name) for a FlashAttention kernel it must import, so the wrapper's name has neither."""
    if not is_flash_attention_requested(requested_attention_implementation=inner) and re.fullmatch(r"\w+", inner):
        return PREFIX + inner
    token = re.sub(r"\W+", "_", inner.lower()).replace("flash_attention_", "fa").replace("flash", "fa")
    return PREFIX + token.strip("_")


def wrapped_implementation(name: str | None) -> str:
    """The implementation a ctxext name wraps ('ctxext_sdpa' -> 'sdpa'); other names are returned as they are."""
    name = name or "eager"
    return _WRAPPED.get(name, name.removeprefix(PREFIX) if name.startswith(PREFIX) else name)


def register_wrapper(inner: str) -> str:
    """Register the wrapper of `inner` with transformers' attention and mask interfaces (idempotent); its name."""
    name = wrapper_name(inner)
    _WRAPPED[name] = inner
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, functools.partial(ctxext_attention, inner=inner))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS and inner in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def attention_request(
    host: nn.Module, settings: AttentionSettings, layout, layers: tuple, length: int | None = None
) -> AttentionRequest:
    """What the refusal rules (ctxext.patching.refusals) need to know of putting `settings` on `layers` of `host`:
    read from its config and `layout` once. `length`: the context the model will run to (default: the config's
    max_position_embeddings)."""
    config = host.config
    window = None if getattr(config, "use_sliding_window", True) is False else getattr(config, "sliding_window", None)
    return AttentionRequest(
        method=settings.method or "",
        remaps=settings.remap is not None,
        layout=layout,
        layers=tuple(layers),
        implementation=wrapped_implementation(compat.attention_implementation(config)),
        length=length or getattr(config, "max_position_embeddings", None),
        config_window=window,
        config_extras=tuple(
            name for name in ("attn_logit_softcapping", "attention_sinks") if getattr(config, name, None)
        ),
    )


def check_can_install(
    host: nn.Module, settings: AttentionSettings, length: int | None = None, layout=None, layers=None
) -> str:
    """Refuse, before anything changes, what `settings` cannot run on `host` (the first of the ordered refusal
    rules that matches, as one line); the implementation to wrap."""
    layout = layout or rope_layout(host)
    layers = layout.attention_layers() if layers is None else layers
    request = attention_request(host, settings, layout, layers, length)
    reason = first_refusal(request)
    if reason is not None:
        raise CtxextError(reason)
    return request.implementation


def _switch_implementation(host: nn.Module, name: str) -> None:
    if compat.attention_implementation(host.config) == name:
        return
    if isinstance(host, PreTrainedModel):
        host.set_attn_implementation(name)
    else:
        raise CtxextError(f"{type(host).__name__} is not a transformers model: cannot set its attention")


def install_attention(
    host: nn.Module,
    settings: AttentionSettings | None,
    query_block: int = QUERY_BLOCK,
    kernel: str = "auto",
    layers: tuple[int, ...] | None = None,
    layout=None,
) -> None:
    """Patch the attention layers `layers` of `host` (the base model; default: every RoPE layer) with
    `settings`; None or inactive removes. `layout`: the model's rope layout where the caller has read it."""
    remove_attention(host)
    if settings is None or not settings.active:
        return
    layout = layout or rope_layout(host)
    layers = layout.attention_layers() if layers is None else layers
    inner = check_can_install(host, settings, None, layout, layers)
    modules = attention_modules(host, layers)
    memo = ForwardMemo()
    for module in modules:
        layer_type = layout.layer_types[module.layer_idx] if layout.per_type_rotary else None
        module.__dict__[_STATE] = AttentionState(settings, host, memo, query_block, kernel, layer_type=layer_type)
    if settings.remap is not None:
        host.__dict__[_CACHE_CHECK] = host.register_forward_pre_hook(
            functools.partial(
                _before_forward, method=settings.method, memo=memo, layers={m.layer_idx for m in modules}
            ),
            with_kwargs=True,
        )
    _switch_implementation(host, register_wrapper(inner))


def _before_forward(host, args, kwargs, method: str, memo: ForwardMemo, layers: set):
    """Before a forward: a remapping method needs a cache holding exactly the tokens seen (its regions are
    built from every earlier key), so a StaticCache or a sliding-window cache layer under a patched layer is
    refused here, not mid-run. Then each cache layer's `KeptKeys` is marked usable or not by this forward
    (`KeptKeys.check`)."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    cache_layers = getattr(cache, "layers", None) or []
    if any(
        i in layers and (isinstance(layer, StaticLayer) or getattr(layer, "is_sliding", False))
        for i, layer in enumerate(cache_layers)
    ):
        raise CtxextError(
            f"{method} needs a cache that holds exactly the tokens seen so far (DynamicCache, the "
            f"default), not a {type(cache).__name__} with static or sliding-window layers"
        )
    memo.note_cache(cache)
    for layer in cache_layers:
        kept = layer.__dict__.get(KeptKeys.ATTRIBUTE)
        if kept is not None:
            kept.check(layer)


def remove_attention(host: nn.Module) -> None:
    """Give the model its own attention implementation back (no-op where nothing was installed)."""
    hook = host.__dict__.pop(_CACHE_CHECK, None)
    if hook is not None:
        hook.remove()
    for _, attention in _all_attention(host):
        attention.__dict__.pop(_STATE, None)
    current = compat.attention_implementation(host.config)
    if current is not None and current.startswith(PREFIX):
        _switch_implementation(host, wrapped_implementation(current))


def _patched_modules(host: nn.Module) -> list[nn.Module]:
    return [module for _, module in _all_attention(host) if _STATE in module.__dict__]


def installed_settings(host: nn.Module) -> AttentionSettings | None:
    patched = _patched_modules(host)
    return patched[0].__dict__[_STATE].settings if patched else None


def installed_layers(host: nn.Module) -> tuple[int, ...]:
    """The layers an attention-level method is installed on."""
    return tuple(module.layer_idx for module in _patched_modules(host))


def set_attention_tuning(
    model: nn.Module, query_block: int | None = None, kernel: str | None = None, keep_keys: bool | None = None
) -> None:
    """Change the block size, backend or key keeping of an installed remapping method; the results stay the same.

    `keep_keys=False` stops caches from keeping their keys rotated by the method's rules (`KeptKeys`), and drops
    what they kept at their next forward: decode steps rotate every cached key again (at 64k, about 5x slower
    on a CPU) but need no extra memory (`kept_keys_bytes`)."""
    modules = _patched_modules(rotary_host(model))
    if not modules:
        raise CtxextError("no ctxext attention method is installed on this model")
    for module in modules:
        state = module.__dict__[_STATE]
        module.__dict__[_STATE] = AttentionState(
            state.settings,
            state.host,
            state.memo,
            query_block or state.query_block,
            kernel or state.kernel,
            state.keep_keys if keep_keys is None else keep_keys,
            state.layer_type,
        )


def kept_keys_bytes(cache) -> int:
    """The memory a cache's layers hold in keys kept by `KeptKeys`, beyond the cache itself (0 when none)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        kept = layer.__dict__.get(KeptKeys.ATTRIBUTE)
        if kept is not None:
            total += sum(buffer.nbytes for buffer in kept.rotated.values())
    return total


LAYERS_KEY = "layers"  # in `ctxext_attention`: the layers the method is on, where not every RoPE layer


def sync_attention_with_config(host: nn.Module) -> None:
    """Install what `config.ctxext_attention` says (or remove everything when it is absent)."""
    values = dict(getattr(host.config, CONFIG_KEY, None) or {})
    layers = values.pop(LAYERS_KEY, None)
    install_attention(
        host, AttentionSettings.from_dict(values) if values else None, layers=None if layers is None else tuple(layers)
    )


def record_attention_in_config(config, settings: AttentionSettings | None, layers: tuple | None = None) -> None:
    """`ctxext_attention` in the config: the settings, and the layers they are on where not every RoPE layer."""
    if settings is not None and settings.active:
        values = settings.to_dict()
        if layers is not None:
            values[LAYERS_KEY] = list(layers)
        setattr(config, CONFIG_KEY, values)
    elif hasattr(config, CONFIG_KEY):
        delattr(config, CONFIG_KEY)


# ------------------------------------------------------------------------------------------ load hook
def _install_from_config_after_init(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if not getattr(config, CONFIG_KEY, None):
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


def _rotary_at(
    host: nn.Module, like: torch.Tensor, positions: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the model's own rotary embedding at arbitrary (possibly fractional) positions.

    Positions are computed on the CPU (in float64 where a rule needs it) and reach the device as float32, so
    devices without float64 (MPS) never see it.
    """
    positions = positions.to(device=like.device, dtype=torch.float32)
    if layer_type is None:  # one set of frequencies for every layer
        return host.rotary_emb(like, positions)
    return host.rotary_emb(like, positions, layer_type)


# ----------------------------------------------------------------------------- one forward, all layers
def _identity(obj) -> Callable[[object], bool]:
    """A test of whether a later call passes the very same object (held weakly where possible: an object that
    has died matches nothing, not even None)."""
    if obj is None:
        return lambda other: other is None
    try:
        ref = weakref.ref(obj)
    except TypeError:
        return lambda other: other is obj
    return lambda other: other is not None and ref() is other


class ForwardPlan:
    """What every layer of one forward shares: positions, region plans, log-n factors, (cos, sin).

    Built by the forward's first patched layer from position_ids and the attention mask, both of which the
    model passes unchanged to every layer; positions and region bounds live on the CPU, so a forward waits for
    the device a few times (reading positions and the mask), not once per layer and query block.
    """

    def __init__(self, position_ids, attention_mask, total: int, q_len: int):
        self._refs = (_identity(position_ids), _identity(attention_mask))
        self.shape = (total, q_len)
        self.values: dict = {}

    def serves(self, position_ids, attention_mask, total: int, q_len: int) -> bool:
        return self.shape == (total, q_len) and self._refs[0](position_ids) and self._refs[1](attention_mask)

    def remember(self, name, compute: Callable):
        if name not in self.values:
            self.values[name] = compute()
        return self.values[name]


class ForwardMemo:
    """The current forward's `ForwardPlan`, one per thread (two threads running one model do not mix plans)."""

    def __init__(self):
        self._local = threading.local()

    def note_cache(self, cache) -> None:
        """The cache this thread's next forward was given (None without one): its layers keep `KeptKeys`."""
        try:
            self._local.cache = None if cache is None else weakref.ref(cache)
        except TypeError:  # an object that cannot be referred to weakly keeps nothing
            self._local.cache = None

    def cache_layer(self, layer_idx: int, key: torch.Tensor):
        """The layer of this forward's cache that holds exactly `key` (the tensor the model's attention passed),
        or None (no cache, another kind of cache, or keys that are a copy)."""
        ref = getattr(self._local, "cache", None)
        cache = ref() if ref is not None else None
        layers = getattr(cache, "layers", None)
        if layers is None or not 0 <= layer_idx < len(layers):
            return None
        layer = layers[layer_idx]
        return layer if getattr(layer, "keys", None) is key else None

    def plan_for(self, position_ids, attention_mask, total: int, q_len: int) -> ForwardPlan:
        plan = getattr(self._local, "plan", None)
        if plan is None or not plan.serves(position_ids, attention_mask, total, q_len):
            plan = ForwardPlan(position_ids, attention_mask, total, q_len)
            self._local.plan = plan
        return plan


def _is_dynamic_rotary(rotary: nn.Module) -> bool:
    """ctxext's dynamic methods and transformers' dynamic rope types: frequencies that follow the length."""
    return bool(getattr(rotary, "dynamic", False)) or "dynamic" in str(getattr(rotary, "rope_type", ""))


def _rotary_identity(rotary: nn.Module) -> tuple:
    """Which rotary module, with which frequencies: (cos, sin) and rotated keys made under another differ."""
    frequencies = getattr(rotary, "inv_freq", None)
    return id(rotary), frequencies.data_ptr() if isinstance(frequencies, torch.Tensor) else None


def _interpolated_rotary_at(
    host: nn.Module, like: torch.Tensor, positions: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) that rotate a key at a fractional position p as GALI reads it: the blend (1 - f) R(floor p) +
    f R(floor p + 1), f = p - floor p. Dotted with a query rotated at an integer position, this is the logit
    interpolated linearly between the key's two integer neighbours (the dot product is linear in the key)."""
    low = positions.floor()
    weight = (positions - low).to(device=like.device, dtype=torch.float32)[..., None]
    cos_low, sin_low = _rotary_at(host, like, low, layer_type)
    cos_high, sin_high = _rotary_at(host, like, low + 1, layer_type)
    cos = torch.lerp(cos_low.float(), cos_high.float(), weight).to(cos_low.dtype)
    sin = torch.lerp(sin_low.float(), sin_high.float(), weight).to(sin_low.dtype)
    return cos, sin


def _rotary_entry(
    plan: ForwardPlan,
    host: nn.Module,
    like: torch.Tensor,
    name,
    positions: Callable,
    layer_type: str | None = None,
    interpolated: bool = False,
):
    """(cos, sin) at `positions()`, once per forward; dynamic rotary types, whose frequencies follow each call's
    positions, are asked every time. `interpolated`: GALI's blend at fractional positions."""
    rotary = host.rotary_emb
    rotary_at = _interpolated_rotary_at if interpolated else _rotary_at
    if _is_dynamic_rotary(rotary):
        return rotary_at(host, like, positions(), layer_type)
    return plan.remember(
        ("rotary", name, layer_type, *_rotary_identity(rotary), like.dtype, like.device, interpolated),
        lambda: rotary_at(host, like, positions(), layer_type),
    )


# ------------------------------------------------------------------------------------------ positions
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
    if key_allowed is not None:
        in_order |= ~key_allowed[:, total - q_len :].cpu()
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


def _region_plans(regions, positions: torch.Tensor, q_len: int, key_allowed, query_block: int):
    """[(rows, RegionPlan)]: one plan for the whole batch when every row's bounds agree, else one per row."""
    total = positions.shape[1]
    bounds = []
    for row in positions:
        query_positions = row[total - q_len :]
        lows, highs = [], []
        for region in regions:
            lo, hi = region.key_range(query_positions)
            lows.append(torch.searchsorted(row, lo))
            highs.append(torch.searchsorted(row, hi))
        bounds.append((torch.stack(lows), torch.stack(highs)))
    if all(torch.equal(lo, bounds[0][0]) and torch.equal(hi, bounds[0][1]) for lo, hi in bounds):
        return [(None, RegionPlan(*bounds[0], total, key_allowed, query_block))]
    return [
        (
            slice(b, b + 1),
            RegionPlan(lo, hi, total, None if key_allowed is None else key_allowed[b : b + 1], query_block),
        )
        for b, (lo, hi) in enumerate(bounds)
    ]


def _key_padding_from_mask(attention_mask, q_len: int, total: int) -> torch.Tensor | None:
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
    mask_mod = getattr(attention_mask, "mask_mod", None)
    if mask_mod is None:
        raise CtxextError(f"position remapping cannot read an attention mask of type {type(attention_mask).__name__}")
    device = attention_mask.kv_indices.device
    batch = attention_mask.kv_indices.shape[0]
    b = torch.arange(batch, device=device)[:, None, None]
    kv = torch.arange(total, device=device)[None, None]
    zero = torch.zeros((), dtype=torch.long, device=device)
    rows = torch.unique(torch.linspace(0, q_len - 1, min(q_len, 64)).long())  # a sample of query rows
    visible = mask_mod(b, zero, rows.to(device)[None, :, None], kv).expand(batch, len(rows), total)
    allowed = key_padding(visible[:, -1], total)
    _check_causal_with_padding(visible.sum(-1), allowed, rows, q_len, total)
    return allowed


def _check_causal_with_padding(
    visible: torch.Tensor, allowed: torch.Tensor | None, rows: torch.Tensor, q_len: int, total: int
) -> None:
    """Refuse a mask that hides more than later keys and padding: the kernel would not see it.

    `visible` (batch, len(rows)) counts the keys the model's mask lets each of those query rows see; with only
    causality and key padding that is the number of unpadded keys up to the query. A padding query may also
    see nothing, or every key (SDPA unmasks such rows); a packed sequence's first segment, which looks like
    left padding from the last query, sees its own earlier keys and is caught here.
    """
    keys = (total - q_len + rows).cpu()
    allowed = torch.ones(1, total, dtype=torch.bool) if allowed is None else allowed.cpu()
    expected = allowed.long().cumsum(-1)[:, keys]
    visible = visible.cpu()
    padding_query = ~allowed[:, keys] & ((visible == 0) | (visible == total))
    if bool(((visible != expected) & ~padding_query).any()):
        raise CtxextError(
            "position remapping reads only causality and padding from the attention mask, and this "
            "one hides other keys too (packed sequences: transformers builds them from position ids "
            "that jump when no attention_mask is given). For gapped positions (PoSE) pass "
            "attention_mask=torch.ones_like(input_ids); run packed sequences one at a time"
        )


# ------------------------------------------------------------------------------- the attention function
def ctxext_attention(module, query, key, value, attention_mask, inner: str = "sdpa", **kwargs):
    """The registered attention function wrapping `inner`: log-n, the query temperature and remapping around the
    model's own one."""
    state: AttentionState | None = module.__dict__.get(_STATE)
    if state is None:  # a layer ctxext did not patch
        return _call_inner(module, inner, query, key, value, attention_mask, **kwargs)
    settings = state.settings
    q_len, total = query.shape[2], key.shape[2]
    position_ids = kwargs.get("position_ids")
    plan = state.memo.plan_for(position_ids, attention_mask, total, q_len)
    if settings.logn:  # the queries' own position ids (padding tokens carry small ones: factor 1)
        scale = plan.remember(
            ("logn", query.device),
            lambda: logn_scale(
                torch.arange(total - q_len, total)[None] if position_ids is None else position_ids.cpu(),
                settings.original_max_position_embeddings,
            ).to(query.device),
        )
        query = query * scale[:, None, :, None].to(query.dtype)
    if settings.query_temperature is not None:
        scale = plan.remember(
            ("query_temperature", query.device),
            lambda: query_temperature_scale(
                torch.arange(total - q_len, total)[None] if position_ids is None else position_ids.cpu(),
                settings.query_temperature,
                settings.original_max_position_embeddings,
            ).to(query.device),
        )
        query = query * scale[:, None, :, None].to(query.dtype)
    remap = settings.remap
    if remap is None:
        return _call_inner(module, inner, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and total > window:  # refused at patch time; here if the config changed since
        raise CtxextError(
            f"{settings.method} does not support sliding-window attention: this layer's window is {window} "
            f"tokens and the sequence has {total}; set config.sliding_window = None (or use_sliding_window = False)"
        )
    key_allowed = plan.remember("padding", lambda: _key_padding_from_mask(attention_mask, q_len, total))
    positions = plan.remember("positions", lambda: key_positions(position_ids, total, q_len, key_allowed))
    if plan.remember("plain", lambda: _within_first_region(remap, positions)):
        return _call_inner(module, inner, query, key, value, attention_mask, **kwargs)
    return _remapped_forward(module, state, plan, query, key, value, kwargs)


def _call_inner(module, inner: str, query, key, value, attention_mask, **kwargs):
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
    region_plans = plan.remember(
        ("regions", state.query_block), lambda: _region_plans(regions, positions, q_len, key_allowed, state.query_block)
    )
    queries, keys = _region_queries_and_keys(module, state, plan, query, key, positions, regions)
    outputs = [
        attend_regions(
            queries if rows is None else [q[rows] for q in queries],
            keys if rows is None else [k[rows] for k in keys],
            value if rows is None else value[rows],
            region_plan,
            module.scaling,
            state.kernel,
        )
        for rows, region_plan in region_plans
    ]
    attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
    return attn.transpose(1, 2), None


def _region_queries_and_keys(
    module, state: AttentionState, plan: ForwardPlan, query, key, positions: torch.Tensor, regions: list
):
    """([queries], [keys]), one of each per region: rotated by the region's rules (the model's own rotation where
    a region keeps it), from the rotated query and keys and the model's (cos, sin). Keys that a cache layer kept
    from the previous forward (`KeptKeys`) are not rotated again: only the new ones are."""
    host = state.host
    q_len, total = query.shape[2], key.shape[2]
    query_positions = positions[:, total - q_len :]
    layer = state.memo.cache_layer(module.layer_idx, key)
    if layer is not None and not (state.keep_keys and _may_keep_keys(host, query, key)):
        layer.__dict__.pop(KeptKeys.ATTRIBUTE, None)
        layer = None
    region_names = tuple(region.name for region in regions)
    kept = KeptKeys.reusable(layer, state, key, positions, q_len, region_names)
    start = 0 if kept is None else kept.length  # keys [start, total) are rotated by this forward
    new_positions = positions[:, start:]
    layer_type = state.layer_type
    cos_k, sin_k = _rotary_entry(plan, host, query, ("keys", start), lambda: new_positions, layer_type)
    plain_query = undo_rotation(query, cos_k[:, -q_len:], sin_k[:, -q_len:])
    plain_key = None  # the new keys unrotated, made once a region rotates keys by a rule of its own (not STRING)
    queries, key_slots, rotated = [], [], {}  # rotated: key rule -> (slot, the new keys rotated by it)
    for index, region in enumerate(regions):
        query_rule, key_rule = region.query_position, region.key_position
        scales = None if region.pair_scales is None else region.pair_scales(cos_k.shape[-1] // 2, module.layer_idx)
        if scales is not None:  # DPE: every rotary pair at its own scale
            queries.append(
                _rotated_per_pair(
                    plan,
                    host,
                    plain_query,
                    ("query", index),
                    scales,
                    lambda G, r=query_rule: r(query_positions, G),
                    layer_type,
                ).to(query.dtype)
            )
        elif query_rule is None:
            queries.append(query)
        else:
            cos, sin = _rotary_entry(
                plan, host, plain_query, ("query", index), lambda r=query_rule: r(query_positions), layer_type
            )
            queries.append(apply_rotation(plain_query, cos, sin).to(query.dtype))
        if key_rule is None:
            key_slots.append(None)
            continue
        if key_rule not in rotated:  # regions that share a key rule share the rotated keys
            plain_key = undo_rotation(key[:, :, start:], cos_k, sin_k) if plain_key is None else plain_key
            name = ("key", index, start)
            if scales is not None:
                new = _rotated_per_pair(
                    plan, host, plain_key, name, scales, lambda G, r=key_rule: r(new_positions, G), layer_type
                )
            else:
                cos, sin = _rotary_entry(
                    plan,
                    host,
                    plain_key,
                    name,
                    lambda r=key_rule: r(new_positions),
                    layer_type,
                    region.interpolated_keys,
                )
                new = apply_rotation(plain_key, cos, sin)
            rotated[key_rule] = (index, new.to(key.dtype))
        key_slots.append(rotated[key_rule][0])
    new_keys = dict(rotated.values())
    if kept is not None:
        rotated_keys = kept.extend(new_keys, positions, key)
    else:
        rotated_keys = new_keys
        if layer is not None and new_keys:
            KeptKeys.keep(layer, state, new_keys, positions, key, region_names)
    keys = [key if slot is None else rotated_keys[slot] for slot in key_slots]
    return queries, keys


def _may_keep_keys(host: nn.Module, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether rotated keys may be kept for later forwards: not while training (in-place growth would break
    autograd) nor under a dynamic rotary type (its frequencies, and so every key's rotation, follow the length)."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        return False
    return not _is_dynamic_rotary(host.rotary_emb)


class KeptKeys:
    """One cache layer's keys as each key rule of a remapping method rotates them, kept on the cache layer
    between forwards, so that a decode step rotates only its new keys instead of turning every cached key
    back and rotating it again per region (at 64k tokens, most of a SmolLM2 decode step).

    A key's rotation depends on its own position only (`Region`: the key at k(j)), so kept keys stay right while
    the cache only grows. They are used only when all of these hold (else every key is rotated afresh and kept):
    - the layer held, when this forward began, the very keys tensor they were made with (`check`, run by the
      model's pre-forward hook; DynamicCache replaces that tensor on every update, crop, reorder and batch
      change, so keys changed in place behind the cache's back are not noticed);
    - this forward adds its q_len keys right after the kept ones, which sit at the same positions as before;
    - the same method settings, rotary frequencies, dtype, device and shape, and the same regions (GALI adds a
      region each time the length passes a group boundary; its keys are then all rotated afresh once).
    They go with the cache. Memory: one more copy of the layer's keys per key rule, plus an eighth to grow into.
    """

    ATTRIBUTE = "_ctxext_kept_keys"

    def __init__(self, settings: AttentionSettings, signature: tuple, rotated: dict):
        self.settings = settings
        self.signature = signature
        self.rotated = rotated  # slot -> (batch, kv heads, capacity, head_dim); the first `length` are valid
        self.positions: torch.Tensor | None = None  # (batch or 1, length) int64 on the CPU
        self.length = 0
        self.source: weakref.ref | None = None  # the layer's keys tensor they were made with
        self.usable = False  # set before each forward by `check`, spent by the forward's first use

    @staticmethod
    def _signature(host: nn.Module, key: torch.Tensor) -> tuple:
        return *_rotary_identity(host.rotary_emb), key.dtype, key.device, key.shape[0], key.shape[1], key.shape[3]

    @classmethod
    def keep(cls, layer, state: AttentionState, rotated: dict, positions: torch.Tensor, key: torch.Tensor, regions):
        kept = cls(state.settings, (*cls._signature(state.host, key), regions), rotated)
        kept._made_with(positions, key)
        layer.__dict__[cls.ATTRIBUTE] = kept

    @classmethod
    def reusable(cls, layer, state: AttentionState, key: torch.Tensor, positions: torch.Tensor, q_len: int, regions):
        """The layer's kept keys if this forward may extend them, else None."""
        kept = None if layer is None else layer.__dict__.get(cls.ATTRIBUTE)
        if kept is None:
            return None
        usable, kept.usable = kept.usable, False
        done = key.shape[2] - q_len
        if not usable or kept.length != done or done == 0 or kept.settings is not state.settings:
            return None
        if kept.signature != (*cls._signature(state.host, key), regions):  # GALI's regions follow the length
            return None
        if kept.positions.shape[0] != positions.shape[0] or not torch.equal(kept.positions, positions[:, :done]):
            return None
        return kept

    def check(self, layer) -> None:
        source = None if self.source is None else self.source()
        self.usable = source is not None and getattr(layer, "keys", None) is source

    def extend(self, new: dict, positions: torch.Tensor, key: torch.Tensor) -> dict:
        """Append each rule's newly rotated keys (in place, growing by an eighth when full); all of them, as views."""
        length = positions.shape[1]
        for slot, fresh in new.items():
            buffer = self.rotated[slot]
            if buffer.shape[2] < length:
                grown = buffer.new_empty(*buffer.shape[:2], length + length // 8, buffer.shape[3])
                grown[:, :, : self.length] = buffer[:, :, : self.length]
                buffer = self.rotated[slot] = grown
            buffer[:, :, self.length : length] = fresh
        self._made_with(positions, key)
        return {slot: buffer[:, :, :length] for slot, buffer in self.rotated.items()}

    def _made_with(self, positions: torch.Tensor, key: torch.Tensor) -> None:
        self.positions, self.length, self.source = positions, positions.shape[1], weakref.ref(key)


def _rotated_per_pair(
    plan: ForwardPlan,
    host: nn.Module,
    x: torch.Tensor,
    name,
    scales: torch.Tensor,
    positions_at: Callable,
    layer_type: str | None = None,
) -> torch.Tensor:
    """x rotated pair by pair, pair p at `positions_at(scales[p])`: one (cos, sin) per distinct scale (once per
    forward), then each channel takes its pair's (channels c and c + d/2 are pair c, as in rotate_half)."""
    distinct = sorted(set(scales.tolist()))
    tables = [_rotary_entry(plan, host, x, (*name, G), lambda G=G: positions_at(G), layer_type) for G in distinct]

    def assembled() -> tuple[torch.Tensor, torch.Tensor]:
        # Made once per forward, not per layer: on a GPU the index is a host-to-device copy, which waits for
        # the device to finish what was queued (two waits in every layer of every decode step, otherwise).
        rotary = tables[0][0].shape[-1]
        pick = torch.tensor([distinct.index(G) for G in scales.tolist()], dtype=torch.int64).repeat(2)
        pick, channels = pick.to(x.device), torch.arange(rotary, device=x.device)
        cos, sin = (torch.stack([table[which] for table in tables], dim=-1)[..., channels, pick] for which in (0, 1))
        return cos, sin

    cos, sin = plan.remember(("per-pair", name, layer_type, tuple(scales.tolist()), x.dtype, x.device), assembled)
    return apply_rotation(x, cos, sin)


__all__ = [
    "CONFIG_KEY",
    "AttentionState",
    "apply_rotation",
    "install_attention",
    "installed_settings",
    "kept_keys_bytes",
    "record_attention_in_config",
    "register_load_hook",
    "remove_attention",
    "set_attention_tuning",
    "sync_attention_with_config",
    "undo_rotation",
]
