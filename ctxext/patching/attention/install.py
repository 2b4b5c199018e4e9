"""Putting an attention-level method on a model and taking it off: registering ctxext's wrapper of the model's
attention implementation, the state on each patched layer, the settings recorded in config.json
(`ctxext_attention`), and the `PreTrainedModel.post_init` hook that re-installs them on a model built from it."""

from __future__ import annotations

import functools
import re

from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import StaticLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.utils.generic import is_flash_attention_requested

from ... import compat
from ...errors import CtxextError
from ...methods.attention import AttentionSettings
from ..families import attention_of, rope_layout, rotary_host
from ..refusals import AttentionRequest, first_refusal
from ..remap_kernel import QUERY_BLOCK
from .forward import ctxext_attention
from .memo import ForwardMemo
from .regions import KeptKeys
from .state import STATE, AttentionState, state_of

CONFIG_KEY = "ctxext_attention"  # the config.json entry that records the settings
LAYERS_KEY = "layers"  # in `ctxext_attention`: the layers the method is on, where not every RoPE layer
PREFIX = "ctxext_"  # attention implementations registered by ctxext start with this

_CACHE_CHECK = "_ctxext_cache_check"  # attribute on the base model: the handle of its cache-refusing hook
_WRAPPED: dict[str, str] = {}  # registered wrapper name -> the implementation it wraps


# ------------------------------------------------------------------------------------ layers and names
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


# ------------------------------------------------------------------------------------- install/remove
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
        module.__dict__[STATE] = AttentionState(settings, host, memo, query_block, kernel, layer_type=layer_type)
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
        attention.__dict__.pop(STATE, None)
    current = compat.attention_implementation(host.config)
    if current is not None and current.startswith(PREFIX):
        _switch_implementation(host, wrapped_implementation(current))


def _patched_modules(host: nn.Module) -> list[nn.Module]:
    return [module for _, module in _all_attention(host) if state_of(module) is not None]


def installed_settings(host: nn.Module) -> AttentionSettings | None:
    """The settings of the attention-level method installed on `host` (None where none is)."""
    patched = _patched_modules(host)
    return state_of(patched[0]).settings if patched else None


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
        state = state_of(module)
        module.__dict__[STATE] = AttentionState(
            state.settings,
            state.host,
            state.memo,
            query_block or state.query_block,
            kernel or state.kernel,
            state.keep_keys if keep_keys is None else keep_keys,
            state.layer_type,
        )


# --------------------------------------------------------------------------- config.json and load hook
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
