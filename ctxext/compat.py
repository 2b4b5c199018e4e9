"""Every private API of torch, transformers and accelerate that ctxext uses, in one place.

Each entry says what it is, why no public API does the job, and the versions it was checked against
(torch 2.13, transformers 5.23, accelerate 1.15). When one changes, a test fails loudly:
tests/test_remapping.py::test_compat_module_names_the_private_apis_it_wraps, and tests/test_flash_inner.py for
the FlashAttention view. Everything else in ctxext uses public APIs only.
"""

from __future__ import annotations

import sys

import torch


# ---------------------------------------------------------------------------------------------- torch
# torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (private op, torch >= 2.2; checked on 2.13):
# the fused CPU attention that also returns the log-sum-exp, which the remapping kernel merges regions with.
# Public scaled_dot_product_attention does not return it. Without the op, the kernel takes its public
# single-SDPA form ("concat"), which is exact but twice as wide.
def cpu_attention_with_lse_available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def cpu_attention_with_lse(query, key, value, bias, scale):
    """(output, log-sum-exp) of softmax attention on CPU; bias is additive (or None)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse


# --------------------------------------------------------------------------------------- transformers
# config._attn_implementation (private attribute, transformers 5.x): the attention implementation a model
# runs. The public setter is PreTrainedModel.set_attn_implementation, which ctxext uses to switch to its
# own registered implementation; reading the current name has no public getter.
def attention_implementation(config) -> str | None:
    return config._attn_implementation


def family_eager_attention(module: torch.nn.Module):
    """The model family's module-level `eager_attention_forward` (transformers 5.x modeling files).

    transformers' AttentionInterface has no "eager" entry: each model file passes its own eager function as
    the default. ctxext's attention wrapper needs the same default to hand "eager" models back to it.
    """
    return sys.modules[type(module).__module__].eager_attention_forward


class _ConfigWithImplementation:
    def __init__(self, config, implementation: str):
        self._config = config
        self._attn_implementation = implementation

    def __getattr__(self, name):
        return getattr(self._config, name)


class _ModuleWithImplementation:
    def __init__(self, module: torch.nn.Module, implementation: str):
        self._module = module
        self.config = _ConfigWithImplementation(module.config, implementation)

    def __getattr__(self, name):
        return getattr(self._module, name)


# transformers' flash_attention_forward (integrations/flash_attention.py, transformers 5.x) picks the kernel to
# import from `module.config._attn_implementation`. Under ctxext's wrapper that names the wrapper, so the
# wrapper hands FlashAttention a view of the module whose config names the wrapped implementation; every
# other attribute is the module's own. No public argument selects the kernel.
def module_with_attention_implementation(module: torch.nn.Module, implementation: str):
    return _ModuleWithImplementation(module, implementation)


# PretrainedConfig's `_validate_<rope_type>_rope_parameters` hooks (private, transformers 5.x): transformers
# validates rope_parameters by calling a method named after the rope type; ctxext's own types need one, or
# loading a checkpoint saved with them fails. There is no public registry for rope-parameter validators.
def add_rope_validator(rope_type: str, validator) -> None:
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    setattr(RotaryEmbeddingConfigMixin, f"_validate_{rope_type}_rope_parameters", validator)


# ----------------------------------------------------------------------------------------- accelerate
# AcceleratorState._reset_state / GradientState._reset_state (private, accelerate 1.x): forget the process
# state so that a second Accelerator in the same process (tests, the tiny-model pretraining before a
# fine-tune) starts clean. accelerate has no public reset.
def reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
