"""Which methods apply to a model, decided from its config alone: the model is built on the meta device (no
weights, no memory), its rotary module is rebuilt on the CPU so that the layout probe sees real frequencies, and
`plan_patch` is asked about each method, as `patch` would ask before changing anything."""

from __future__ import annotations

import torch
from torch import nn

from ..auto_classes import auto_model_class
from ..errors import CtxextError
from ..methods import METHODS, get_method
from .families import rotary_host
from .patch import plan_patch


def skeleton(config) -> nn.Module:
    """The model of `config` with every weight on the meta device but its rotary module, which is real."""
    try:
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, ImportError, AssertionError) as error:
        # ImportError: a family that needs another library (timm); AssertionError: Reformer's is_decoder check
        what = getattr(config, "model_type", type(config).__name__)
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise CtxextError(f"transformers cannot build a causal LM of type '{what}': {first}") from None
    host = rotary_host(model)  # refuses a model without RoPE in one line
    try:
        with torch.device("cpu"):
            host.rotary_emb = type(host.rotary_emb)(config=host.config)
    except TypeError:  # a rotary class built another way: the probe then reads sizes only (rotate-half assumed)
        pass
    return model


def why_not(
    model: nn.Module,
    method: str,
    factor: float = 2.0,
    layer_types=None,
    original_max_position_embeddings: int | None = None,
    **params,
) -> str | None:
    """None where `method` at `factor` (with `params`) can be applied to `model`, else the one line `patch` would
    refuse it with ("needs a setting: ..." where the method cannot run at its defaults, e.g. theta's new base)."""
    try:
        get_method(method).make_params(factor=factor, **params)
    except CtxextError as error:
        return f"needs a setting: {error}"
    try:
        plan_patch(model, method, factor, original_max_position_embeddings, False, layer_types, **params)
    except CtxextError as error:
        return str(error)
    return None


def applicable_methods(model: nn.Module, factor: float = 2.0, layer_types=None) -> dict[str, str | None]:
    """Every registered method: None where it applies to `model`, else why not."""
    return {name: why_not(model, name, factor, layer_types) for name in METHODS if name != "none"}
