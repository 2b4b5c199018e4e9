"""Which transformers auto class builds a checkpoint: a causal LM, or a vision-language model.

ctxext patches the language model of a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ...:
`ctxext.patching.families.language_model_of`), so every command that loads or builds a model from a config asks
here for the class: `AutoModelForCausalLM` where transformers has a causal LM of the type, else
`AutoModelForImageTextToText` where it has that (the checkpoint then reloads as the same class).
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)


def is_image_text_to_text(config) -> bool:
    """Whether transformers builds this config's type as an image-text-to-text model and not as a causal LM."""
    model_type = getattr(config, "model_type", None)
    return (
        model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


def auto_model_class(config):
    """The auto class that builds `config` (see the module's docstring)."""
    return AutoModelForImageTextToText if is_image_text_to_text(config) else AutoModelForCausalLM
