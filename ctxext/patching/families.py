"""Which models ctxext can patch, and where their rotary embedding lives.

LLaMA, Mistral, Qwen2 and Qwen3 share one layout in transformers 5: a single `rotary_emb` on the base
model (`model.model` for the *ForCausalLM classes) computes (cos, sin) once for all layers.
"""

from __future__ import annotations

import math

from torch import nn

from ..errors import CtxextError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _unwrap(model: nn.Module) -> nn.Module:
    # PEFT wraps the transformers model; the rotary embedding lives in the model it wraps.
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def check_supported(config, what: str | None = None) -> None:
    """A CtxextError naming the supported families unless `config` is one of them."""
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_FAMILIES:
        return
    what = what or (f"model type '{model_type}'" if model_type else "this model")
    has_rope = bool(getattr(config, "rope_parameters", None))
    reason = "is not a supported RoPE family" if has_rope else "has no rotary position embedding (RoPE)"
    raise CtxextError(f"{what} {reason}; ctxext supports {', '.join(SUPPORTED_FAMILIES)}")


def rotary_host(model: nn.Module) -> nn.Module:
    """The module that owns `rotary_emb` (the bare base model), or a CtxextError naming what is supported."""
    model = _unwrap(model)
    config = getattr(model, "config", None)
    check_supported(config, None if getattr(config, "model_type", None) else type(model).__name__)
    for host in (model, getattr(model, "model", None)):
        if host is not None and isinstance(getattr(host, "rotary_emb", None), nn.Module):
            return host
    raise CtxextError(f"{type(model).__name__} has no 'rotary_emb' module; is this a transformers >= 5 model?")


def rotary_dim(config) -> int:
    """The number of rotated channels per head: head_dim, times partial_rotary_factor where set."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = (config.rope_parameters or {}).get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", None)
    )
    return int(head_dim * (partial or 1.0))


def rotary_wavelengths(model: nn.Module) -> list[float] | None:
    """Each rotary pair's wavelength in tokens, 2*pi / theta_i, at the model's plain base (None without one)."""
    from ..methods.frequency import rope_inv_freq

    config = _unwrap(model).config
    base = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if base is None:
        return None
    return (2 * math.pi / rope_inv_freq(rotary_dim(config), float(base)).double()).tolist()
